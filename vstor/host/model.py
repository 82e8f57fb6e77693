"""The immutable host model: what vstor knows about a host, as plain data.

`vstor.host.read_host(SysFS(root))` builds it from sysfs/procfs; the planner
and `doctor` only ever read it.  Nothing here does I/O.
"""

from __future__ import annotations

import re

from vstor.cpulist import MAX_CPU, format_cpulist, parse_cpulist  # noqa: F401 (where the planner reads them)
from vstor.records import field, record

NVME_CLASS = "0x010802"


@record
class Cpu:
    id: int
    node: int
    package: int
    core_id: int
    siblings: tuple[int, ...]   # thread_siblings_list, including itself
    isolated: bool = False      # in /sys/devices/system/cpu/isolated


@record
class HugepagePool:
    size_kib: int               # 2048 or 1048576
    total: int
    free: int


@record
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    memory_kib: int = 0
    hugepages: tuple[HugepagePool, ...] = ()

    def pool(self, size_kib: int) -> HugepagePool | None:
        for pool in self.hugepages:
            if pool.size_kib == size_kib:
                return pool
        return None


@record
class PciDevice:
    address: str                # '0000:5e:00.0'
    vendor: str = ""            # '0x8086'
    device: str = ""            # '0x0a54'
    pci_class: str = ""         # '0x010802'
    driver: str | None = None   # 'nvme', 'vfio-pci', None when unbound
    numa_node: int = -1         # -1: firmware did not say

    @property
    def is_bridge(self) -> bool:
        # class 0x0604xx: PCI-to-PCI bridge; 0x0600xx host bridge
        return self.pci_class.startswith(("0x0604", "0x0600"))


@record
class Namespace:
    name: str                   # block device name, 'nvme0n1'
    nsid: int
    size_bytes: int = 0
    partitions: tuple[str, ...] = ()
    # Why the host is using it, one human-readable phrase each:
    # 'mounted at / (nvme0n1p2)', 'swap (nvme0n1p3)', 'held by dm-0 (vg-root)'.
    in_use: tuple[str, ...] = ()
    scheduler: str = ""         # active I/O scheduler, e.g. 'none'

    @property
    def dev_path(self) -> str:
        return f"/dev/{self.name}"


@record
class NvmeController:
    address: str                # PCI address
    numa_node: int = -1
    vendor: str = ""
    device: str = ""
    driver: str | None = None   # 'nvme', 'vfio-pci', 'uio_pci_generic', None
    name: str | None = None     # 'nvme0' while the kernel driver has it
    model: str = ""
    serial: str = ""
    iommu_group: int | None = None
    # Every OTHER device in the same IOMMU group.
    group_peers: tuple[PciDevice, ...] = ()
    namespaces: tuple[Namespace, ...] = ()
    local_cpus: tuple[int, ...] = ()
    # (irq number, cpus it may run on) for each MSI-X vector.
    irqs: tuple[tuple[int, tuple[int, ...]], ...] = ()
    backs_root: bool = False    # the root filesystem lives on it
    sriov_vfs: int = 0          # sriov_totalvfs: SR-IOV capable (libvirt, and Nova, call it a PF)
    virtfns: tuple[str, ...] = ()   # its enabled virtual functions (virtfnN), by address
    physfn: str | None = None   # a virtual function's physical function (physfn), by address

    @property
    def in_use(self) -> tuple[str, ...]:
        reasons = [f"{ns.name}: {why}" for ns in self.namespaces for why in ns.in_use]
        return tuple(reasons)

    def namespace(self, nsid: int) -> Namespace | None:
        for ns in self.namespaces:
            if ns.nsid == nsid:
                return ns
        return None


@record
class BlockDevice:
    """Any whole disk (NVMe or not) or partition, for the qsd backend's block sources."""
    name: str                   # 'sdb', 'nvme0n1', 'nvme0n1p2'
    size_bytes: int = 0
    in_use: tuple[str, ...] = ()
    # From this device down to one vstor cannot vouch for (a loop, nbd,
    # ublk or RAM device), through dm/md slaves and a partition's disk:
    # ('dm-1', 'md5', 'loop1'); () when nothing below it is one.
    stacks_on: tuple[str, ...] = ()


@record
class NetDev:
    name: str
    mtu: int = 0


@record
class RdmaNic:
    name: str                   # 'mlx5_0'
    address: str                # its PCI address
    numa_node: int = -1
    netdevs: tuple[NetDev, ...] = ()


@record
class Host:
    hostname: str
    cpus: tuple[Cpu, ...]
    nodes: tuple[NumaNode, ...]
    controllers: tuple[NvmeController, ...] = ()
    rdma_nics: tuple[RdmaNic, ...] = ()
    block_devices: tuple[BlockDevice, ...] = ()
    cmdline: str = ""
    iommu_enabled: bool = False     # /sys/kernel/iommu_groups is populated
    vfio_available: bool = False    # vfio-pci driver or module present
    thp: str = ""                   # transparent hugepages mode: always|madvise|never
    irqbalance_running: bool | None = False     # None: not looked at (read_host)
    hostnqn: str | None = None      # the NVMe host NQN SPDK attaches with (read_hostnqn)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def controller(self, address: str) -> NvmeController | None:
        for ctrl in self.controllers:
            if ctrl.address == address:
                return ctrl
        return None

    def node(self, node_id: int) -> NumaNode | None:
        for node in self.nodes:
            if node.id == node_id:
                return node
        return None

    def cpu(self, cpu_id: int) -> Cpu | None:
        for cpu in self.cpus:
            if cpu.id == cpu_id:
                return cpu
        return None

    def rdma_nic(self, name: str) -> RdmaNic | None:
        for nic in self.rdma_nics:
            if nic.name == name:
                return nic
        return None

    def block_device(self, name: str) -> BlockDevice | None:
        for dev in self.block_devices:
            if dev.name == name:
                return dev
        return None


# Which kernel block device names the host model lists as disks (and why
# the others are never a block source): hidden multipath path devices are
# not usable disks (their head is); the devices below are not storage vstor
# can vouch for, and neither is a dm, md or bcache device stacked on one
# (host.blocks.stack_of finds that, through slaves/ and a partition's disk).
_PATH_DEVICE = re.compile(r"nvme\d+c\d+n\d+")
_SERVE_INSTEAD = ("serve the storage itself: a file under [paths] images as <vstor:file path='...'/>, "
                  "or a disk of this host; ")
# Kernel name prefix (a partition, loop0p1, starts with its disk's name):
# what the device is, why vstor does not serve it, and the fix.  rbd, drbd,
# iSCSI and NVMe-oF devices are not here: a kernel driver serves them from
# storage root configured (a Ceph image, a lower disk, a remote LUN), as an
# HBA does; vstor looks at what the host uses them for, as for any disk.
_UNVOUCHED = {
    "loop": ("a loop device", "the file behind it may lie outside the image roots and vstor cannot "
                              "check what it never opened",
             "serve the file itself: <vstor:file path='...'/> under [paths] images "
             "(losetup --list {dev} names it)"),
    "nbd": ("a network block device (nbd)", "a process at the other end of a socket decides what it "
                                            "holds, from a file or host vstor never opened",
            _SERVE_INSTEAD + "the nbd server's command line names what it serves"),
    "ublkb": ("a ublk device", "a process decides what it holds (Linux lets an unprivileged user "
                               "create one), from a file vstor never opened",
              _SERVE_INSTEAD + "the ublk server's command line names what it serves"),
    "ram": ("a RAM disk", "it is not storage a VM keeps", "use a disk, a partition or a file"),
    "zram": ("a RAM disk", "it is not storage a VM keeps", "use a disk, a partition or a file"),
}


def unvouched(name: str) -> str | None:
    """The kind of device vstor cannot vouch for that kernel name NAME is
    (its prefix: 'loop', 'nbd', 'ublkb', 'ram', 'zram'), or None."""
    return next((prefix for prefix in _UNVOUCHED if name.startswith(prefix)), None)


def is_listed(name: str) -> bool:
    """Whether the host model lists a disk or partition of this kernel name
    (when sysfs has it): hidden multipath path devices are not usable disks
    (their head is), and loop, nbd, ublk and RAM devices are not storage
    vstor can vouch for."""
    return not (unvouched(name) or _PATH_DEVICE.fullmatch(name))


def unservable(path: str, stack: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(why, fix) when a /dev path names a device vstor never takes as a
    block source: by its own name, or because it stacks on such a device
    (`stack`: kernel names from it down to that device, BlockDevice.stacks_on).
    A loop device is a view of a host file that vstor did not open and
    cannot vouch for: its backing file may lie outside the image roots
    (threats.md), may be swapped or unlinked while it is attached, and
    qemu-storage-daemon serves that file directly anyway; an nbd or ublk
    device is that file seen through a process; a dm or md device over
    either serves the same file."""
    name = path[len("/dev/"):] if path.startswith("/dev/") else ""
    if stack:
        what, why, fix = _UNVOUCHED[unvouched(stack[-1])]
        return (f"{path} {stacked_on(stack)}: vstor does not serve {what} or what stacks on one, "
                f"as {why}", fix.format(dev=f"/dev/{stack[-1]}"))
    kind = unvouched(name)
    if kind:
        what, why, fix = _UNVOUCHED[kind]
        return f"{path} is {what}: vstor does not serve {what}, as {why}", fix.format(dev=path)
    if _PATH_DEVICE.fullmatch(name):
        head = re.sub(r"c\d+n", "n", name)
        return (f"{path} is one path of a multipath NVMe namespace", f"use its head device /dev/{head}")
    return None


def stacked_on(stack: tuple[str, ...]) -> str:
    """'stacks on /dev/loop1 through /dev/md5, a loop device', for a
    BlockDevice's stacks_on ('dm-1', 'md5', 'loop1')."""
    through = f" through {', '.join(f'/dev/{n}' for n in stack[1:-1])}" if len(stack) > 2 else ""
    return f"stacks on /dev/{stack[-1]}{through}, {_UNVOUCHED[unvouched(stack[-1])][0]}"
