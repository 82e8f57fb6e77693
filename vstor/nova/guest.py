"""vstor's vhost-user-blk disks in the guest config Nova builds (needs nova:
the optional extra, `pip install vstor[nova]`).

Nova's libvirt config classes have no vhost-user disk (its volume drivers
are a fixed list), so vstor brings its own device class, an adapter that
emits the element vstor's one builder makes (vstor/render/elements.py).  `augment` plans
the flavor's vstor disks with vstor's planner and adds, to the
LibvirtConfigGuest Nova made: a `<disk type='vhostuser'>` per disk on the
planned socket, shared guest memory (vhost-user needs it: hugepages Nova
chose, or a file-backed memory), and vstor's metadata (the intent and the
plan), from which vstor's hook creates the backends at the start.  Nova
keeps its own pinning and NUMA placement: vstor decides the disks only.
"""

from __future__ import annotations

import copy

from nova.virt.libvirt import config as vconfig

from vstor.config import Config
from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import Host
from vstor.meta.names import is_safe_name
from vstor.meta.plan import DiskPlan, Plan
from vstor.meta.xmlmodel import build
from vstor.nova import disks
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.render import elements


class VhostUserDisk(vconfig.LibvirtConfigGuestDevice):
    """Nova's config object for a planned vhost-user disk; the element is
    vstor's one builder's (vstor/render/elements.py), as the libvirt
    renderer emits it."""

    def __init__(self, disk: DiskPlan):
        super().__init__(root_name="disk")
        self.disk = disk

    def format_dom(self):
        return elements.vhost_disk(self.disk)


class SharedMemoryBacking(vconfig.LibvirtConfigGuestMemoryBacking):
    """Nova's memory backing, shared with the vhost-user backend: Nova's
    hugepages when the flavor has them, else memfd (Nova's class knows only
    a file source, which puts guest RAM in a file on the host's disk)."""

    @classmethod
    def of(cls, nova_mb):
        mb = cls()
        if nova_mb is not None:
            mb.__dict__.update({k: v for k, v in nova_mb.__dict__.items() if k != "root_name"})
        mb.sharedaccess = True
        return mb

    def format_dom(self):
        root = super().format_dom()
        elements.share_memory(root)
        return root


def _page_kib(mb) -> int | None:
    """The hugepage size Nova backs the guest with (its smallest), KiB."""
    pages = getattr(mb, "hugepages", None) or []
    sizes = [int(p.size_kb) for p in pages if getattr(p, "size_kb", None)]
    return min(sizes) if sizes else (2048 if pages else None)


def _nova_nodes(numatune) -> set[int]:
    """The host nodes Nova binds the guest's memory to."""
    if numatune is None:
        return set()
    out = set(getattr(numatune.memory, "nodeset", None) or []) if numatune.memory else set()
    for m in numatune.memnodes or []:
        out.update(m.nodeset or [])
    return {int(n) for n in out}


def _on_novas_nodes(host: Host, plan: Plan, nova: set[int], policy: str, who: str) -> Plan:
    """Nova picks the instance's host node; vstor the node of each SPDK
    disk's reactor (its device's, where it has one).  Apart: refused under
    'strict', said in the plan's reasons under 'preferred'."""
    from vstor.nova.instance import reactors_apart
    from vstor.records import replace
    apart = reactors_apart(host, {d.target: d.reactor for d in plan.disks if d.reactor is not None}, nova)
    if not apart:
        return plan
    said = ", ".join(f"{t}'s SPDK reactor on node {n}" for t, n in apart.items())
    where = f"Nova placed {who} on host node{'s' if len(nova) > 1 else ''} " \
            f"{','.join(map(str, sorted(nova)))}, {said}"
    if policy == "strict":
        raise DoesNotFit(f"{where} ({disks.NUMA_KEY}=strict)",
                         hint=f"Nova reschedules it; or set {disks.NUMA_KEY}=preferred on the flavor")
    return replace(plan, reasons=plan.reasons + (f"{where}: its I/O crosses the interconnect "
                                                 f"({disks.NUMA_KEY}=preferred)",))


class VstorMetadata(vconfig.LibvirtConfigObject):
    """vstor's element in <metadata>, as the hook reads it."""

    def __init__(self, elem):
        super().__init__(root_name="vstor")
        self.elem = elem

    def format_dom(self):
        return copy.deepcopy(self.elem)


def augment(guest: vconfig.LibvirtConfigGuest, specs: dict[str, str], flavor: str, project: str,
            host: Host, cfg: Config, ledger: Ledger) -> Plan | None:
    """Add the flavor's vstor disks to `guest` (an instance of `project`);
    None when it has none."""
    if not disks.has_disks(specs):
        return None
    where = f"flavor '{flavor}'"
    root, intent = disks.parse(specs, where)
    for target, owner in disks.projects_of(specs, intent, where).items():
        if owner != project:
            raise BadInput(f"{where}: disk {target} belongs to project {owner}, not this instance's",
                           hint="give the flavor only to that project (openstack flavor set "
                                "--no-public --project)")
    if not is_safe_name(guest.name):
        raise BadInput(f"instance name '{guest.name[:40]}' cannot name a socket",
                       hint="keep nova.conf's instance_name_template to letters, digits and _.+-")
    policy = disks.numa_policy(specs, where)
    page = _page_kib(guest.membacking)
    req = Request(name=guest.name, safe_name=guest.name, uuid=guest.uuid, vcpus=int(guest.vcpus),
                  memory_kib=int(guest.memory), machine=guest.os_mach_type or "pc", intent=intent,
                  vhost_memory="platform-hugepages" if page else "memfd", platform_page_kib=page,
                  replan="re-create the instance (or resize it to a flavor with the right disks)",
                  title=f"instance {guest.name}", external_cpus=True)
    plan = plan_domain(host, cfg, req, ledger)
    plan = _on_novas_nodes(host, plan, _nova_nodes(guest.numatune), policy, req.who)
    if any(d.mode != "vhost" for d in plan.disks):
        raise BadInput(f"{where}: vstor disks in a flavor are vhost-user disks; a whole controller "
                       "goes through Nova's own PCI passthrough", hint="see: vstor nova config")
    if any(d.target in {getattr(dev, "target_dev", None) for dev in guest.devices} for d in plan.disks):
        raise BadInput(f"{where}: a vstor disk's target is already one of the instance's disks",
                       hint="use targets after Nova's own (vdb, vdc, ...)")
    for d in plan.disks:
        guest.add_device(VhostUserDisk(d))
    guest.membacking = SharedMemoryBacking.of(guest.membacking)
    root.append(build(plan))
    guest.metadata.append(VstorMetadata(root))
    return plan
