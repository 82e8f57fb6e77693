"""vstor.lab.vhost_nvmf_rdma: SPDK on the host attaches a remote NVMe-oF
namespace over RDMA by two paths and serves it as vhost-user-blk
(xml-templates/vhost-nvmf-rdma-multipath.xml), with a path failure:

1. the guest finds its disk and holds; SPDK reports both paths connected;
2. the lab's vstor_path_down_cmd takes the first path down;
3. the guest writes its pattern and reads it back (over the second path);
4. the guest then waits (for its disk to be unplugged, which never comes),
   keeping the domain, and so SPDK's controller, alive;
5. vstor_path_up_cmd brings the first path back, and SPDK must report it
   connected again within vstor_reconnect_wait seconds.

The remote namespace's bytes cannot be read from this host: the guest's
read-back after the failure is the data check. vCPUs, memory and SPDK's
reactor on the RDMA NIC's node."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestCancel, TestFail  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-nvmf"
WHY = "the lab names no NVMe-oF subsystem with two RDMA paths and the commands that fail one"


def paths(spdk: str, controller: str) -> dict[str, str]:
    """SPDK's answer: each path's target address -> its state ("enabled" when connected)."""
    out = {}
    for ctrl in hostdev.spdk_call(spdk, "bdev_nvme_get_controllers", {"name": controller}):
        for c in ctrl.get("ctrlrs") or [ctrl]:      # SPDK before 22.x: one trid per controller
            out[c["trid"]["traddr"]] = c.get("state", "enabled")
    return out


def disk_xml(lab) -> str:
    hostnqn = lab.get("vstor_nvmf_hostnqn")
    svc = lab.get("vstor_nvmf_trsvcid", "4420")
    return (f"<vstor:disk xmlns:vstor='{guestrun.NS}' target='vdb' mode='vhost' backend='spdk'>"
            f"<vstor:nvmf transport='rdma' traddr='{lab.get('vstor_nvmf_traddr')}' trsvcid='{svc}'"
            f" subnqn='{lab.get('vstor_nvmf_subnqn')}' namespace='{lab.number('vstor_nvmf_namespace', 1)}'"
            + (f" hostnqn='{hostnqn}'" if hostnqn else "") + ">"
            f"<vstor:path traddr='{lab.get('vstor_nvmf_traddr2')}' trsvcid='{svc}'/>"
            f"<vstor:reconnect ctrlr_loss_timeout='{lab.number('vstor_ctrlr_loss_timeout', 60)}'"
            f" reconnect_delay='{lab.number('vstor_reconnect_delay', 2)}'"
            f" fast_io_fail_timeout='{lab.number('vstor_fast_io_fail_timeout', 10)}'/>"
            "</vstor:nvmf></vstor:disk>")


def wait_paths(spdk: str, controller: str, want: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = paths(spdk, controller)
        if {a for a, s in now.items() if s == "enabled"} >= want:
            return
        if time.monotonic() > deadline:
            raise TestFail(f"SPDK's {controller} paths after {timeout:.0f}s: {now}; "
                           f"expected {sorted(want)} connected")
        time.sleep(1)


def run(test, params, env):
    lab = open_lab(params)
    for key in ("vstor_nvmf_subnqn", "vstor_nvmf_traddr", "vstor_nvmf_traddr2",
                "vstor_path_down_cmd", "vstor_path_up_cmd"):
        lab.need(key, WHY)
    nic = lab.get("vstor_rdma_nic")
    node = hostdev.rdma_nic(lab, nic)["numa_node"] if nic else None
    if not nic and not hostdev.host_model(lab)["rdma_nics"]:
        raise TestCancel("no RDMA NIC on this host")
    spdk = hostdev.spdk_socket(lab)
    ready(lab)
    seed, size = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 64 << 20)
    first, second = lab.get("vstor_nvmf_traddr"), lab.get("vstor_nvmf_traddr2")
    vm = {"numa": "strict", "cpus": "dedicated", "hugepages": lab.get("vstor_hugepages", "2M")}
    wait = lab.number("vstor_reconnect_wait", 60)
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block(vm, [disk_xml(lab)]),
        tiny.job("write-verify", "vda", seed, size,
                 timeout=lab.number("vstor_guest_timeout", 240) + wait,
                 hold=lab.number("vstor_guest_hold", 10), unplug="vda"))
    down = False
    try:
        dom.define()
        dom.start()
        dom.wait("HOLD")
        place = numa.check(dom, node)
        numa.reactor(spdk, dom, place)
        plan = dom.live_xml().find(f"metadata/{{{guestrun.NS}}}vstor/{{{guestrun.NS}}}plan/{{{guestrun.NS}}}disk")
        controller = plan.get("spdk_controller")
        wait_paths(spdk, controller, {first, second}, 30)

        hostdev.run_shell(lab.get("vstor_path_down_cmd"), "taking the first path down")
        down = True
        test.log.info("path %s down; SPDK says %s", first, paths(spdk, controller))
        guestrun.check_guest_io(dom.wait("AWAIT-UNPLUG"), "vda", seed, size)

        hostdev.run_shell(lab.get("vstor_path_up_cmd"), "bringing the first path back")
        down = False
        wait_paths(spdk, controller, {first, second}, wait)
        test.log.info("SPDK reconnected %s: %s", first, paths(spdk, controller))
    finally:
        if down:
            try:
                hostdev.run_shell(lab.get("vstor_path_up_cmd"), "bringing the first path back")
            except Exception as e:      # noqa: BLE001 (the test's own error comes first)
                test.log.error("%s", e)
        dom.clean_up()
