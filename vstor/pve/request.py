"""A Proxmox VM as the planner sees it: the request its config and vstor
intent make.  Pure."""

from __future__ import annotations

from vstor.errors import BadInput
from vstor.formats.pve.config import PveConfig
from vstor.formats.pve.vm import (HUGEPAGE_NODES, count_of, machine_of, memory_mib, name_of,
                                  uuid_of)
from vstor.meta.intent import Intent
from vstor.planner import Request


# qemu-server starts every QEMU thread on the VM's whole `affinity` set.
PINS_AT = "by vstor's hookscript at post-start (until then on the VM's whole affinity set)"


def request_of(vm: int, conf: PveConfig, intent: Intent) -> Request:
    where = f"VM {vm}"
    vcpus = count_of(conf, "sockets", where) * count_of(conf, "cores", where)
    if conf.get("vcpus") is not None and conf.get("vcpus") != str(vcpus):
        raise BadInput(f"{where}: vcpus is {conf.get('vcpus')[:20]} of {vcpus}; vstor pins every "
                       "vCPU and needs them all present", hint=f"qm set {vm} --delete vcpus")
    if "memory" in (conf.get("hotplug") or "").split(","):
        raise BadInput(f"{where}: memory hotplug is on; Proxmox then refuses the numa0 and "
                       "hugepages layout vstor writes", hint=f"qm set {vm} --hotplug network,disk,usb")
    return Request(name=name_of(vm), safe_name=name_of(vm), uuid=uuid_of(conf, where),
                   vcpus=vcpus, memory_kib=memory_mib(conf, where) * 1024,
                   machine=machine_of(conf, where), intent=intent,
                   vhost_memory="hugepages", grows_hugepages=True,
                   hugepage_nodes=HUGEPAGE_NODES, replan=f"vstor pve apply {vm}",
                   title=f"VM {vm}", pins_at=PINS_AT)
