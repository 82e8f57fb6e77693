"""Kernel switches (THP, IOMMU, vfio-pci) and procfs: cmdline, processes,
mounts, swaps."""

from __future__ import annotations

from .model import Build
from .pci import write_driver

SELF_PID = 4242


def write_kernel(b: Build) -> None:
    t = b.t
    thp = b.layout.get("thp", "madvise")
    t.write("/sys/kernel/mm/transparent_hugepage/enabled",
            " ".join(f"[{m}]" if m == thp else m for m in ("always", "madvise", "never")))
    for d in ("/sys/kernel/iommu_groups", "/sys/class/nvme", "/sys/class/block", "/sys/block",
              "/sys/dev/block", "/sys/module"):
        t.mkdir(d)
    t.write("/sys/bus/pci/drivers_probe")
    t.write("/sys/bus/pci/rescan")
    if b.iommu:
        t.write("/sys/devices/virtual/iommu/dmar0/intel-iommu/version", "1:0")
        t.link("/sys/class/iommu/dmar0", "/sys/devices/virtual/iommu/dmar0")
    if b.layout.get("vfio", b.iommu):
        write_driver(b, "vfio-pci")
        t.write("/sys/module/vfio_pci/refcnt", 0)


def write_procfs(b: Build) -> None:
    t = b.t
    t.write("/proc/cmdline", b.cmdline)
    t.write("/proc/sys/kernel/hostname", b.layout.get("hostname", "vstor-test"))
    # Every installed host has one (systemd-machine-id-setup); vstor's host
    # NQN is made from it when there is no /etc/nvme/hostnqn.
    import hashlib
    t.write("/etc/machine-id", hashlib.md5(b.layout.get("hostname", "vstor-test").encode()).hexdigest())
    t.write("/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority" + "".join(
        f"\n{dev:<40}partition\t{kib}\t\t0\t\t-2" for dev, kib in b.swaps))
    processes = {1: "systemd", 2: "kthreadd", 512: "systemd-journal", 801: "sshd",
                 SELF_PID: "python3"}
    if b.layout.get("irqbalance"):
        processes[873] = "irqbalance"
    for pid, comm in processes.items():
        t.write(f"/proc/{pid}/comm", comm)
    me = f"/proc/{SELF_PID}"
    t.link("/proc/self", me)
    t.link("/proc/thread-self", f"{me}/task/{SELF_PID}")
    t.link("/proc/mounts", "/proc/self/mounts")
    mounts = _mount_table(b)
    t.write(f"{me}/mountinfo", "\n".join(
        f"{20 + i} {1 if i == 0 else 20} {devnum} / {point} rw,relatime shared:{i + 1} - {fs} {source} rw"
        for i, (point, devnum, fs, source) in enumerate(mounts)))
    t.write(f"{me}/mounts", "\n".join(f"{source} {point} {fs} rw,relatime 0 0"
                                      for point, devnum, fs, source in mounts))


def _mount_table(b: Build) -> list[tuple[str, str, str, str]]:
    virtual = [("/sys", "0:21", "sysfs", "sysfs"), ("/proc", "0:22", "proc", "proc"),
               ("/dev", "0:5", "devtmpfs", "udev"), ("/run", "0:24", "tmpfs", "tmpfs"),
               ("/dev/shm", "0:26", "tmpfs", "tmpfs"), ("/dev/hugepages", "0:35", "hugetlbfs", "hugetlbfs")]
    real = sorted(b.mounts, key=lambda m: (m[0] != "/", len(m[0]), m[0]))
    return real[:1] + virtual + real[1:] if real and real[0][0] == "/" else virtual + real
