"""A plan: what vstor decided for one domain on one host, with the reasons,
declared once as the <vstor:plan> record (vstor.meta.xmlmodel).

It is executable: it holds everything the host side needs (the source as
planned, the block device a qsd namespace is served from, whether the
controller must go to vfio-pci, the exact SPDK attach parameters, sockets,
reactors), so turning it into host changes decides nothing and reads nothing
(vstor.runtime.actions).  It knows nothing of libvirt: the libvirt renderer is
one of its outputs.
"""

from __future__ import annotations

from vstor.host.model import MAX_CPU, format_cpulist, parse_cpulist
from vstor.meta.intent import (ABSPATH, ADDR, BDF, CELL, DEVPATH, NQN, PORT, SECONDS, SOURCES, TARGET,
                               Source)
from vstor.meta.types import Enum, Int, Invalid, Text, YesNo
from vstor.meta.xmlmodel import attr, children, choice, element, texts
from vstor.records import record

PLAN_VERSION = "2"
CPU = Int(0, MAX_CPU)


@record
class CpuList(Text):
    """The kernel's and libvirt's notation, '0-3,8' <-> (0, 1, 2, 3, 8)."""

    def parse(self, text, name):
        super().parse(text, name)
        try:
            return parse_cpulist(text, below=10**5)     # any the pattern takes, as the schema does
        except ValueError:
            raise Invalid(self.problem, self.hint) from None

    def format(self, value):
        return format_cpulist(value)


@record
class CpuSequence(Text):
    """An ordered list, '4,5,6' <-> (4, 5, 6): vCPU i runs on the i-th."""

    def parse(self, text, name):
        super().parse(text, name)
        return tuple(int(p) for p in text.split(",")) if text else ()

    def format(self, value):
        return ",".join(map(str, value))


CPULIST = CpuList(r"([0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*)?", "is not a CPU list",
                  "like 0-3,8")
PINS = CpuSequence(r"([0-9]{1,5}(,[0-9]{1,5})*)?", "is not a list of CPUs", "like 4,5,6")
NAME = Text(r"[A-Za-z0-9_.+\-]{1,128}", "is not a name", "letters, digits and _.+-")
DIGEST = Text(r"sha256:[0-9a-f]{64}", "is not a digest", "sha256:<64 hex digits>")
HOSTNAME = Text(r"[A-Za-z0-9_.\-]{0,255}", "is not a host name", "letters, digits and _.-")


@element("attach")
@record
class AttachPath:
    """One bdev_nvme_attach_controller call (one path of a controller)."""
    trtype: str = attr(Enum(("PCIe", "RDMA", "TCP")), required=True)
    traddr: str = attr(ADDR, required=True)
    adrfam: str | None = attr(Enum(("IPv4", "IPv6")))
    trsvcid: int | None = attr(PORT)
    subnqn: str | None = attr(NQN)
    hostnqn: str | None = attr(NQN)
    multipath: str | None = attr(Enum(("multipath",)))
    ctrlr_loss_timeout_sec: int | None = attr(SECONDS)
    reconnect_delay_sec: int | None = attr(SECONDS)
    fast_io_fail_timeout_sec: int | None = attr(SECONDS)

    def params(self, name: str) -> dict:
        """The RPC's parameters (SPDK takes trsvcid as a string)."""
        out = {"name": name, "trtype": self.trtype, "traddr": self.traddr, "adrfam": self.adrfam,
               "trsvcid": None if self.trsvcid is None else str(self.trsvcid),
               "subnqn": self.subnqn, "hostnqn": self.hostnqn, "multipath": self.multipath,
               "ctrlr_loss_timeout_sec": self.ctrlr_loss_timeout_sec,
               "reconnect_delay_sec": self.reconnect_delay_sec,
               "fast_io_fail_timeout_sec": self.fast_io_fail_timeout_sec}
        return {k: v for k, v in out.items() if v is not None}


@element("disk", where="target", ordered=True)
@record
class DiskPlan:
    target: str = attr(TARGET, required=True)
    mode: str = attr(Enum(("passthrough", "vhost")), required=True)
    backend: str = attr(Enum(("vfio", "spdk", "qsd")), required=True)
    socket: str | None = attr(ABSPATH)                 # vhost-user socket QEMU connects to
    controller: str | None = attr(BDF)                 # local NVMe PCI address
    bind: bool = attr(YesNo(), default=False)          # vstor moves `controller` to vfio-pci
    device: str | None = attr(DEVPATH)                 # qsd: the namespace's block device
    spdk_controller: str | None = attr(NAME)           # SPDK bdev_nvme controller name
    bdev: str | None = attr(NAME)                      # SPDK bdev served (<ctrlr>n<nsid>)
    reactor: int | None = attr(CPU)                    # SPDK reactor core of the vhost controller
    queues: int = attr(Int(1, 64), default=1)
    readonly: bool = attr(YesNo(), default=False)
    guest: str = attr(Enum(("kernel", "spdk")), default="kernel")
    cell: int | None = attr(CELL)                      # guest NUMA cell (plans with cells only)
    source: Source = choice(*SOURCES, label="source")  # the source as planned
    attach: tuple[AttachPath, ...] = children(AttachPath)
    reasons: tuple[str, ...] = texts("reason")

    @property
    def vhost_name(self) -> str | None:
        """SPDK vhost controller / qsd daemon name: the socket's file name."""
        return self.socket.rsplit("/", 1)[1] if self.socket else None


@element("cell", where="id", ordered=True)
@record
class CellPlan:
    """One guest NUMA cell: its vCPUs (guest numbering), memory and
    hugepages, on host node `node`.  Recorded for a guest with several; a
    one-node guest's one cell is the plan's own fields (Plan.guest_cells),
    and there `node` may be None (bound to no host node).  Before placement
    (vstor.planner.cells) `node` is the node its disks' devices need."""
    id: int = attr(CELL, required=True)
    node: int = attr(Int(0, 1023), required=True)
    vcpus: tuple[int, ...] = attr(CPULIST, required=True, default=())
    memory_kib: int = attr(Int(1, 2**50), required=True, default=1)
    hugepages: int = attr(Int(0, 2**40), default=0)    # pages of the plan's hugepage_kib
    # The cell's node's housekeeping cores: its disks' qemu-storage-daemons run there.
    emulator: tuple[int, ...] = attr(CPULIST, default=())


@element("plan", ordered=True)
@record
class Plan:
    version: str = attr(Enum((PLAN_VERSION,)), required=True, default=PLAN_VERSION)
    digest: str = attr(DIGEST, required=True, default="sha256:" + "0" * 64)  # of what was planned
    host: str = attr(HOSTNAME, default="")
    node: int | None = attr(Int(0, 1023))              # NUMA node the VM lives on
    numa: str = attr(Enum(("strict", "preferred", "none")), default="strict")
    cpus: str = attr(Enum(("dedicated", "shared", "external")), default="dedicated")
    vcpus: int = attr(Int(1, 4096), required=True, default=1)
    memory_kib: int = attr(Int(1, 2**50), required=True, default=1)
    vcpu_pins: tuple[int, ...] = attr(PINS, default=(), name="pins")
    reserved: tuple[int, ...] = attr(CPULIST, default=())   # idle SMT siblings kept off other VMs
    shared_cpus: tuple[int, ...] = attr(CPULIST, default=(), name="shared")
    emulator: tuple[int, ...] = attr(CPULIST, default=())
    hugepage_kib: int | None = attr(Int(4, 16777216))
    hugepages: int = attr(Int(0, 2**40), default=0)    # pages of hugepage_kib on `node`
    viommu: bool = attr(YesNo(), default=False)
    migratable: bool = attr(YesNo(), default=False)
    # Several guest cells (vstor.planner.cells); none: one cell on `node` (guest_cells).
    cells: tuple[CellPlan, ...] = children(CellPlan, unique="id")
    disks: tuple[DiskPlan, ...] = children(DiskPlan, unique="target")
    reasons: tuple[str, ...] = texts("reason")
    # Not recorded: the document the plan sits in says them.
    domain: str = ""
    uuid: str | None = None

    @property
    def dedicated_cpus(self) -> frozenset[int]:
        return frozenset(self.vcpu_pins) | frozenset(self.reserved)

    def guest_cells(self) -> tuple[CellPlan, ...]:
        """The guest's NUMA cells: the recorded ones, or the one cell a plan
        without them gives the guest (node None: bound to no host node)."""
        if self.cells:
            return self.cells
        return (CellPlan(0, self.node, tuple(range(self.vcpus)), self.memory_kib, self.hugepages,
                         self.emulator),)

    def thread_pins(self) -> tuple[tuple[frozenset[int], ...], frozenset[int]]:
        """The cores of each vCPU (by index) and of every other QEMU thread
        (the emulator's and the I/O threads), as the plan gives them: a
        dedicated vCPU its one core; a shared vCPU its cell's node's
        housekeeping cores (every cell's, with one cell); ((), ...) when
        the plan pins no vCPU.  The one answer: libvirt's <cputune>
        (vstor.render.elements), Proxmox's post-start (vstor.pve.pinning)
        and the drift check (vstor.runtime.drift) all take it from here."""
        if self.cpus == "dedicated" and self.vcpu_pins:
            vcpus = tuple(frozenset((c,)) for c in self.vcpu_pins)
        elif self.cpus == "shared" and self.shared_cpus:
            per = [frozenset(self.shared_cpus)] * self.vcpus
            for cell in self.cells:
                for v in cell.vcpus:
                    if v < len(per):
                        per[v] = frozenset(cell.emulator or self.shared_cpus)
            vcpus = tuple(per)
        else:
            vcpus = ()
        return vcpus, frozenset(self.emulator)

    def disk_cell(self, disk: DiskPlan) -> CellPlan:
        cells = self.guest_cells()
        return next((c for c in cells if c.id == disk.cell), cells[0])

    def disk(self, target: str) -> DiskPlan | None:
        for d in self.disks:
            if d.target == target:
                return d
        return None

