"""A plan: what vstor decided for one domain on one host, with the reasons.

The planner returns one; the renderer turns it into libvirt XML and records
it in the domain's metadata (<vstor:plan>), from where the hook, the ledger
and `vstor status` read it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lxml import etree

from vstor import NS
from vstor.errors import BadInput
from vstor.meta.intent import DiskIntent, Intent, Source
from vstor.host.model import format_cpulist, parse_cpulist

Q = "{%s}" % NS
PLAN_VERSION = "1"


@dataclass(frozen=True)
class DiskPlan:
    target: str
    mode: str                        # passthrough | vhost
    backend: str                     # vfio | spdk | qsd
    source: Source
    socket: str | None = None        # vhost-user socket QEMU connects to
    controller: str | None = None    # local NVMe PCI address
    spdk_controller: str | None = None  # SPDK bdev_nvme controller name
    bdev: str | None = None          # SPDK bdev served (<ctrlr>n<nsid>)
    reactor: int | None = None       # SPDK reactor core for the vhost controller
    queues: int = 1
    readonly: bool = False
    guest: str = "kernel"            # passthrough: kernel NVMe driver or SPDK in the guest
    reasons: tuple[str, ...] = ()

    @property
    def vhost_name(self) -> str | None:
        """SPDK vhost controller name: the socket's file name in SPDK's -S dir."""
        return self.socket.rsplit("/", 1)[1] if self.socket else None


@dataclass(frozen=True)
class Plan:
    domain: str
    uuid: str | None
    host: str
    node: int | None                 # NUMA node the VM lives on
    numa: str                        # strict | preferred | none
    cpus: str                        # dedicated | shared
    vcpus: int
    memory_kib: int
    vcpu_pins: tuple[int, ...] = ()  # dedicated: host CPU of vCPU i
    reserved: tuple[int, ...] = ()   # idle SMT siblings kept off other VMs
    shared_cpus: tuple[int, ...] = ()  # shared: where vCPUs float
    emulator: tuple[int, ...] = ()
    hugepage_kib: int | None = None
    hugepages: int = 0               # pages of hugepage_kib on `node`
    viommu: bool = False
    migratable: bool = False
    disks: tuple[DiskPlan, ...] = ()
    reasons: tuple[str, ...] = field(default=())

    @property
    def dedicated_cpus(self) -> frozenset[int]:
        return frozenset(self.vcpu_pins) | frozenset(self.reserved)

    def disk(self, target: str) -> DiskPlan | None:
        for d in self.disks:
            if d.target == target:
                return d
        return None


# -- the record in <metadata> ----------------------------------------------

def _opt(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _set(e: etree._Element, **attrs) -> etree._Element:
    for name, value in attrs.items():
        text = _opt(value)
        if text is not None and text != "":
            e.set(name, text)
    return e


def to_element(plan: Plan) -> etree._Element:
    e = _set(etree.Element(Q + "plan"), version=PLAN_VERSION, host=plan.host,
             node=plan.node, numa=plan.numa, cpus=plan.cpus)
    _set(etree.SubElement(e, Q + "vcpus"), count=plan.vcpus,
         pins=",".join(map(str, plan.vcpu_pins)) or None,
         reserved=format_cpulist(plan.reserved), shared=format_cpulist(plan.shared_cpus),
         emulator=format_cpulist(plan.emulator))
    _set(etree.SubElement(e, Q + "memory"), kib=plan.memory_kib,
         hugepage_kib=plan.hugepage_kib, pages=plan.hugepages or None,
         viommu=plan.viommu or None, migratable=plan.migratable or None)
    for d in plan.disks:
        de = _set(etree.SubElement(e, Q + "disk"), target=d.target, mode=d.mode,
                  backend=d.backend, socket=d.socket, controller=d.controller,
                  spdk_controller=d.spdk_controller, bdev=d.bdev, reactor=d.reactor,
                  queues=d.queues, readonly=d.readonly,
                  guest=d.guest if d.mode == "passthrough" else None)
        for r in d.reasons:
            etree.SubElement(de, Q + "reason").text = r
    for r in plan.reasons:
        etree.SubElement(e, Q + "reason").text = r
    return e


def from_element(e: etree._Element, intent: Intent, domain: str,
                 uuid: str | None) -> Plan:
    """Read a <vstor:plan> back; `intent` supplies each disk's source."""
    if e.get("version") != PLAN_VERSION:
        raise BadInput(f"domain '{domain}': vstor plan record version {e.get('version')!r} "
                       f"is not {PLAN_VERSION}", hint=f"re-plan it with: vstor apply {domain}")
    try:
        return _from_element(e, intent, domain, uuid)
    except (ValueError, TypeError, AttributeError) as err:
        raise BadInput(f"domain '{domain}': vstor plan record is damaged ({err})",
                       hint=f"re-plan it with: vstor apply {domain}") from None


def _from_element(e, intent: Intent, domain: str, uuid: str | None) -> Plan:
    v = e.find(Q + "vcpus")
    m = e.find(Q + "memory")
    sources = {d.target: d for d in intent.disks}
    disks = []
    for de in e.findall(Q + "disk"):
        di: DiskIntent | None = sources.get(de.get("target"))
        if di is None:
            raise ValueError(f"plan names disk {de.get('target')} that the intent lacks")
        disks.append(DiskPlan(
            target=de.get("target"), mode=de.get("mode"), backend=de.get("backend"),
            source=di.source, socket=de.get("socket"), controller=de.get("controller"),
            spdk_controller=de.get("spdk_controller"), bdev=de.get("bdev"),
            reactor=_int(de.get("reactor")), queues=int(de.get("queues", "1")),
            readonly=de.get("readonly") == "yes", guest=de.get("guest", "kernel"),
            reasons=tuple(r.text or "" for r in de.findall(Q + "reason"))))
    pins = v.get("pins")
    return Plan(
        domain=domain, uuid=uuid, host=e.get("host", ""), node=_int(e.get("node")),
        numa=e.get("numa", "strict"), cpus=e.get("cpus", "dedicated"),
        vcpus=int(v.get("count")), memory_kib=int(m.get("kib")),
        vcpu_pins=tuple(int(p) for p in pins.split(",")) if pins else (),
        reserved=parse_cpulist(v.get("reserved", "")),
        shared_cpus=parse_cpulist(v.get("shared", "")),
        emulator=parse_cpulist(v.get("emulator", "")),
        hugepage_kib=_int(m.get("hugepage_kib")), hugepages=int(m.get("pages", "0")),
        viommu=m.get("viommu") == "yes", migratable=m.get("migratable") == "yes",
        disks=tuple(disks),
        reasons=tuple(r.text or "" for r in e.findall(Q + "reason")))


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)
