"""The guest side of NVMe passthrough: what a guest has to do before SPDK in
it can drive a controller vstor passed through (hugepages, vfio-pci, the
controller's address as the guest sees it, SPDK's setup.sh environment, a
core mask), as a pure function of the recorded plan and the domain XML
libvirt addressed.

The plan decided everything that matters (which controllers pass through,
for SPDK or for the kernel, whether there is a vIOMMU, the vCPUs and their
node, the memory); this reads it.  The guest's PCI bus numbers are the one
thing neither says: the guest's firmware numbers the buses behind bridges,
so the kit carries the path from the root bus (the kernel's
`DDDD:BB:SS.F/SS.F` notation) and the script reads each bridge's secondary
bus number in the guest.  The script and the cloud-config are
vstor.render.guestscript's.
"""

from __future__ import annotations

import re

from vstor.errors import BadInput, DoesNotFit, one_line
from vstor.host.model import Host, format_cpulist
from vstor.meta.document import Domain
from vstor.meta.plan import Plan
from vstor.meta.topology import BadPart, hostdev_address, pci_address
from vstor.records import asdict, record

# SPDK in the guest gets 2 MiB pages (x86's default size, and setup.sh's) on
# the guest's only NUMA cell (vstor renders one): min(1024 MB, a quarter of
# the guest's memory).  setup.sh alone would take 2048 MB (its HUGEMEM
# default), half of a 4 GiB guest; SPDK apps size their memory from the pool.
PAGE_KIB = 2048
HUGEMEM_CAP_MB = 1024
GUEST_NODE = 0

# libvirt's PCI controller models a device can sit behind, one bus each;
# the roots are the guest's bus 0.  Expander buses (pxb) number their own
# root buses and are not followed.
_ROOTS = ("pcie-root", "pci-root")
_BRIDGES = ("pcie-root-port", "pcie-switch-upstream-port", "pcie-switch-downstream-port",
            "pci-bridge", "dmi-to-pci-bridge", "pcie-to-pci-bridge")
_MAX_DEPTH = 16
_PCI_ID = re.compile(r"0x[0-9a-f]{4}")


@record
class KitController:
    """One passed-through controller as the guest sees it."""
    targets: tuple[str, ...]        # the vstor disks it carries ('vdb',)
    host_address: str               # '0000:5e:00.0' on the host
    pci_path: str                   # '0000:00:02.3/00.0': root bus device, then one per bridge
    guest_address: str | None       # known here only on the root bus; else the script reads it
    behind: tuple[str, ...]         # libvirt's controllers on the way, nearest first ('pcie-root-port pci.5')
    vendor: str                     # '0x8086', '' when the host model does not say
    device: str                     # '0x0a54'
    vcpus: tuple[int, ...]          # the guest's SPDK app runs on these vCPUs
    core_mask: str                  # '0xfe', SPDK's -m
    notes: tuple[str, ...] = ()


@record
class Kit:
    domain: str
    digest: str
    noiommu: bool                   # no vIOMMU: vfio-pci in the (unsafe) no-IOMMU mode
    memory_mib: int
    hugepages: int                  # PAGE_KIB pages on the guest's node GUEST_NODE
    hugemem_mb: int
    controllers: tuple[KitController, ...]
    kernel: tuple[str, ...] = ()    # guest='kernel' controllers left to the guest's nvme driver
    warnings: tuple[str, ...] = ()
    page_kib: int = PAGE_KIB
    node: int = GUEST_NODE

    @property
    def pci_allowed(self) -> str | None:
        """setup.sh's PCI_ALLOWED, when every address is known without the guest."""
        known = [c.guest_address for c in self.controllers]
        return " ".join(known) if all(known) else None

    def setup_env(self) -> dict:
        """SPDK's setup.sh environment (PCI_ALLOWED None: the script prints it)."""
        return {"PCI_ALLOWED": self.pci_allowed, "HUGEMEM": self.hugemem_mb,
                "HUGENODE": self.node, "DRIVER_OVERRIDE": "vfio-pci"}


def build(dom: Domain, host: Host | None = None) -> Kit:
    """The kit for a domain vstor planned and libvirt defined; BadInput (one
    line, with the fix) for anything else.  `host`, when given, supplies the
    controllers' vendor:device and NUMA node."""
    who = f"domain '{one_line(dom.name)}'"
    if dom.is_nova():
        raise BadInput(f"{who} is a Nova instance: guest-kit covers domains vstor renders "
                       "through libvirt, not Nova's or Proxmox's guests")
    plan = dom.recorded_plan()
    if plan is None:
        raise BadInput(f"{who} has no vstor plan", hint=f"render it first: vstor define FILE, "
                                                         f"or vstor apply {one_line(dom.name)}")
    if host is not None and host.hostname != plan.host:
        host = None             # another host's controllers say nothing of this plan's
    if plan.cpus == "external":
        raise BadInput(f"{who} was planned for Nova (cpus='external'): guest-kit covers domains "
                       "vstor renders through libvirt")
    passed = [d for d in plan.disks if d.mode == "passthrough"]
    if not passed:
        raise BadInput(f"{who} passes no NVMe controller through: its vstor disks are "
                       "vhost-user, which the guest sees as virtio disks with nothing to set up")
    for_spdk = [d for d in passed if d.guest == "spdk"]
    chosen = for_spdk or passed
    noiommu = not plan.viommu and dom.root.find("devices/iommu") is None
    pages = min(HUGEMEM_CAP_MB, plan.memory_kib // 1024 // 4) * 1024 // PAGE_KIB
    hugemem = pages * PAGE_KIB // 1024
    if pages < 1:
        raise DoesNotFit(f"{who} has {plan.memory_kib} KiB of memory: too little for one "
                         f"{PAGE_KIB} KiB hugepage for SPDK", hint="give the guest more memory")
    controllers = tuple(_controller(dom, plan, who, address, targets, host)
                        for address, targets in _by_controller(chosen))
    kernel = tuple(f"{'/'.join(t)}: {a} stays with the guest's nvme driver (guest='kernel')"
                   for a, t in _by_controller(d for d in passed
                                              if d.controller not in {c.controller for c in chosen}))
    warnings = []
    if noiommu:
        warnings.append(
            "no vIOMMU in this domain: vfio-pci runs in no-IOMMU mode, which is UNSAFE (no DMA "
            "isolation: the controller can write anywhere in guest memory, and the guest "
            "kernel is tainted); for a vIOMMU set guest='spdk' on the disk and run "
            f"vstor apply {one_line(dom.name)} (needs q35)")
    return Kit(domain=one_line(dom.name), digest=plan.digest, noiommu=noiommu,
               memory_mib=plan.memory_kib // 1024, hugepages=pages, hugemem_mb=hugemem,
               controllers=controllers, kernel=kernel, warnings=tuple(warnings))


def _by_controller(disks) -> list[tuple[str, tuple[str, ...]]]:
    """(controller, its targets), in the plan's order: namespaces of one
    controller pass through as one device."""
    out: dict[str, list[str]] = {}
    for d in disks:
        out.setdefault(d.controller, []).append(d.target)
    return [(a, tuple(t)) for a, t in out.items()]


def _controller(dom: Domain, plan: Plan, who: str, address: str, targets, host) -> KitController:
    hostdev = next((hd for hd in dom.root.iterfind("devices/hostdev")
                    if hostdev_address(hd) == address), None)
    if hostdev is None:
        raise BadInput(f"{who} has no <hostdev> for {address}, which its plan passes through",
                       hint=f"vstor apply {one_line(dom.name)}")
    at = hostdev.find("address[@type='pci']")
    if at is None:
        raise BadInput(f"{who} has no guest PCI address for {address} yet: libvirt assigns it "
                       "when the domain is defined", hint="define it first: vstor define FILE, "
                                                          "then vstor guest-kit NAME")
    path, behind = pci_path(dom, at, f"{who}: hostdev {address}")
    ctrl = host.controller(address) if host is not None else None
    vendor, device = (ctrl.vendor, ctrl.device) if ctrl is not None else ("", "")
    if not (_PCI_ID.fullmatch(vendor) and _PCI_ID.fullmatch(device)):
        vendor = device = ""
    vcpus, notes = spdk_vcpus(plan, ctrl.numa_node if ctrl is not None else -1, host)
    return KitController(targets=tuple(targets), host_address=address, pci_path=path,
                         guest_address=None if "/" in path else path, behind=behind,
                         vendor=vendor, device=device, vcpus=vcpus,
                         core_mask=hex(sum(1 << v for v in vcpus)), notes=notes)


def pci_path(dom: Domain, at, who: str) -> tuple[str, tuple[str, ...]]:
    """The device at libvirt address `at` as a path from the guest's root
    bus: libvirt's bus='N' is the index of the controller whose bus it is,
    never the bus number the guest gives it."""
    hops: list[str] = []
    behind: list[str] = []
    for _ in range(_MAX_DEPTH):
        domain, bus, slot, function = _numbers(at, who)
        hops.append(f"{slot:02x}.{function:x}")
        ctrl = next((c for c in dom.root.iterfind("devices/controller[@type='pci']")
                     if c.get("index", "").strip() == str(bus)), None)
        if ctrl is None:
            raise BadInput(f"{who} sits on PCI bus {bus}, and the domain has no "
                           f"<controller type='pci' index='{bus}'>", hint="define it through "
                           "libvirt, which adds the controllers it addresses devices on")
        model = ctrl.get("model", "")
        if model in _ROOTS:
            return f"{domain:04x}:00:" + "/".join(reversed(hops)), tuple(behind)
        if model not in _BRIDGES:
            raise BadInput(f"{who} sits behind a {model or 'PCI'} controller (index {bus}): "
                           "guest-kit follows root ports, switches and PCI bridges",
                           hint="address the hostdev on a pcie-root-port")
        behind.append(f"{model} pci.{bus}")
        at = ctrl.find("address[@type='pci']")
        if at is None:
            raise BadInput(f"{who}: its {model} (index {bus}) has no PCI address yet",
                           hint="define it first: vstor define FILE, then vstor guest-kit NAME")
    raise BadInput(f"{who} sits more than {_MAX_DEPTH} bridges deep")


def _numbers(at, who: str) -> tuple[int, int, int, int]:
    """A guest <address>'s parts as libvirt reads them (topology.PCI_ADDRESS)."""
    try:
        return pci_address(at)
    except BadPart as e:
        raise BadInput(f"{who}: <address {e.where.lstrip('@')}='{one_line(e.text[:20])}'> "
                       f"is not a PCI {e.name}") from None


def spdk_vcpus(plan: Plan, ctrl_node: int, host: Host | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The vCPUs the guest's SPDK app gets: those running on the controller's
    node (in a vstor plan, with numa='strict', all of them), less vCPU 0,
    which is left to the guest OS when there is more than one."""
    every = tuple(range(plan.vcpus))
    notes = []
    if ctrl_node < 0 or host is None:
        near = every            # the plan's node is the controller's (strict placement)
        if plan.numa != "strict":
            notes.append(f"the host model does not say the controller's node: taking every "
                         f"vCPU, on node {plan.node} with the guest (numa='{plan.numa}')")
    elif plan.vcpu_pins:
        near = tuple(v for v, cpu in enumerate(plan.vcpu_pins)
                     if (c := host.cpu(cpu)) is not None and c.node == ctrl_node)
    else:
        near = every if plan.node == ctrl_node else ()
    if not near:
        near = every
        notes.append(f"no vCPU runs on node {ctrl_node} with the controller (the guest is on "
                     f"node {plan.node}): SPDK's I/O crosses the interconnect")
    if len(near) > 1 and near[0] == 0:
        near = near[1:]
        notes.append("vCPU 0 is left to the guest OS")
    return near, tuple(notes)


def to_json(kit: Kit) -> dict:
    return {**asdict(kit), "setup_sh": kit.setup_env()}


def describe(kit: Kit) -> list[str]:
    """The kit in words, one line each (the script's header comment)."""
    lines = [f"vstor guest-kit for domain '{kit.domain}' (plan {kit.digest[:19]}...)"]
    for c in kit.controllers:
        ids = f" ({c.vendor[2:]}:{c.device[2:]})" if c.vendor else ""
        where = (f"at {c.guest_address}" if c.guest_address else
                 f"at PCI path {c.pci_path}: behind {', '.join(c.behind)}; the guest's "
                 "firmware numbers that bus, the script reads it")
        lines.append(f"{'/'.join(c.targets)}: NVMe {c.host_address}{ids} on the host; "
                     f"in the guest {where}")
        lines.append(f"  SPDK core mask -m {c.core_mask} (vCPUs {format_cpulist(c.vcpus)})"
                     + "".join(f"; {n}" for n in c.notes))
    lines += kit.kernel
    lines.append("driver: vfio-pci " + ("in no-IOMMU mode" if kit.noiommu else
                 "behind the vIOMMU (the guest kernel's IOMMU must be on: intel_iommu=on)"))
    lines.append(f"hugepages: {kit.hugepages} x {kit.page_kib} kB on the guest's NUMA node "
                 f"{kit.node} (HUGEMEM={kit.hugemem_mb}: min({HUGEMEM_CAP_MB} MB, a quarter "
                 f"of the guest's {kit.memory_mib} MiB))")
    env = kit.setup_env()
    allowed = env["PCI_ALLOWED"] or "<the address the script prints>"
    lines.append(f"SPDK setup.sh instead: PCI_ALLOWED='{allowed}' HUGEMEM={env['HUGEMEM']} "
                 f"HUGENODE={env['HUGENODE']} DRIVER_OVERRIDE={env['DRIVER_OVERRIDE']} "
                 "scripts/setup.sh")
    lines += [f"WARNING: {w}" for w in kit.warnings]
    return lines
