"""Synthetic host trees for tests: write the sysfs/procfs tree of a host
described in a short TOML layout (tests/hosts/*.toml).

    python3 -m tests.hostlayout LAYOUT.toml DIR     (from the repository root)

The tree has the files vstor reads and the symlinks the kernel makes
(/sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:5d/0000:5d:00.0/<bdf>,
driver, iommu_group, /sys/class/nvme, /sys/block, /sys/dev/block, holders and
slaves, /sys/class/infiniband/<dev>/device, /proc/self -> <pid>), so that
`read_host(SysFS(DIR))` sees the host described.  An example, every key shown;
only `node.cores` and `nvme.address` are required:

    hostname = "lab1"
    cmdline = "BOOT_IMAGE=/vmlinuz-6.1.0-18-amd64 ro intel_iommu=on iommu=pt"
    smt = 2                      # threads per core (CPU ids numbered like Intel's)
    numa = true                  # false: no /sys/devices/system/node at all
    iommu = true                 # IOMMU groups populated
    vfio = true                  # vfio-pci driver present (default: = iommu)
    thp = "madvise"              # transparent hugepages: always | madvise | never
    irqbalance = true            # an irqbalance process runs
    isolated = "2-3"             # /sys/devices/system/cpu/isolated

    [[node]]                     # one per NUMA node, ids 0, 1, ... in order
    cores = 16
    memory = "192GiB"
    hugepages = { "2M" = 4096, "1G" = [8, 6] }   # total, or [total, free]

    [[nvme]]
    address = "0000:5e:00.0"
    node = 0
    vendor = "0x8086"
    device = "0x0a54"
    model = "INTEL SSDPE2KX040T8"
    serial = "PHLJ9500001X4P0DGN"
    driver = "nvme"              # or "vfio-pci", or "" for unbound
    iommu_group = 40             # default: numbered in address order
    port = "0000:5d:00.0"        # upstream bridge (default: a root port made up for the bus)
    irqs = 9                     # MSI-X vectors (default: 1 admin + min(CPUs, 32))
    multipath = false            # true: nvme0c0n1 path devices under head nvme0n1
    sriov = 0                    # sriov_totalvfs (> 0: SR-IOV capable, a PF to libvirt and Nova)
    vfs = 0                      # enabled VFs (sriov_numvfs): unbound NVMe functions .1-.N, physfn/virtfnN links
    [[nvme.namespace]]           # default: one namespace of 1TB
    size = "4TB"                 # KB/MB/GB/TB decimal; K/M/G/T and KiB/MiB/GiB/TiB binary
    scheduler = "none"
    partitions = [{ size = "1GiB", mount = "/boot" }, { size = "16GiB", swap = true },
                  { size = "3TB" }]

    [[volume]]                   # dm (LVM) or md device stacked on disks/partitions
    name = "vg0-root"            # dm name; 'md0' style names make an md device
    on = ["nvme0n1p3"]
    mount = "/"                  # also: swap = true, fs = "xfs", source = "/dev/root"
    partitions = []              # as a namespace's (an md device's: md0p1, ...)

    [[disk]]                     # non-NVMe disks: sdX behind an AHCI controller
    name = "sda"
    size = "480GB"
    mount = "/srv"

    [[disk]]                     # loopN, nbdN, ublkbN, ramN, zramN, rbdN, drbdN: virtual
    name = "loop0"
    backing = "/home/u/x.img"    # a loop device's backing file

    [[pci]]                      # any other PCI function (NIC, bridge, GPU...)
    address = "0000:5e:00.1"
    class = "0x020000"
    driver = "i40e"
    iommu_group = 40
    netdevs = { eno1 = 1500 }

    [[rdma]]                     # an RDMA NIC: PCI function + /sys/class/infiniband
    name = "mlx5_0"
    address = "0000:3b:00.0"
    node = 0
    netdevs = { ens1f0np0 = 4096 }
"""

from .build import build_tree
from .model import load_layout, parse_size

__all__ = ["build_tree", "load_layout", "parse_size"]
