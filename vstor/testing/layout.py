"""Write the sysfs/procfs tree of a host described in a short TOML layout.

    python -m vstor.testing.layout LAYOUT.toml DIR

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
    [[nvme.namespace]]           # default: one namespace of 1TB
    size = "4TB"                 # KB/MB/GB/TB decimal; K/M/G/T and KiB/MiB/GiB/TiB binary
    scheduler = "none"
    partitions = [{ size = "1GiB", mount = "/boot" }, { size = "16GiB", swap = true },
                  { size = "3TB" }]

    [[volume]]                   # dm (LVM) or md device stacked on disks/partitions
    name = "vg0-root"            # dm name; 'md0' style names make an md device
    on = ["nvme0n1p3"]
    mount = "/"                  # also: swap = true, fs = "xfs", source = "/dev/root"

    [[disk]]                     # non-NVMe disks: sdX behind an AHCI controller
    name = "sda"
    size = "480GB"
    mount = "/srv"

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

from __future__ import annotations

import itertools
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field

from vstor.errors import BadInput, VstorError
from vstor.host.model import NVME_CLASS, format_cpulist, parse_cpulist

_TOP_KEYS = {"hostname", "cmdline", "smt", "numa", "iommu", "vfio", "thp", "irqbalance",
             "isolated", "node", "nvme", "pci", "rdma", "disk", "volume"}
_USE_KEYS = {"mount", "swap", "fs", "source"}
_KEYS = {
    "node": {"id", "cores", "package", "memory", "hugepages"},
    "pci": {"address", "class", "vendor", "device", "driver", "node", "iommu_group", "port",
            "irqs", "netdevs"},
    "nvme": {"address", "vendor", "device", "driver", "node", "iommu_group", "port", "irqs",
             "name", "model", "serial", "multipath", "namespace"},
    "rdma": {"name", "address", "class", "vendor", "device", "driver", "node", "iommu_group",
             "port", "netdevs"},
    "namespace": {"size", "nsid", "scheduler", "partitions"} | _USE_KEYS,
    "partition": {"size"} | _USE_KEYS,
    "disk": {"name", "size", "pci", "scheduler", "partitions"} | _USE_KEYS,
    "volume": {"name", "on", "size", "level"} | _USE_KEYS,
}
_SELF_PID = 4242
_SCHEDULERS = ["none", "mq-deadline", "kyber", "bfq"]


def load_layout(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BadInput(f"cannot read host layout {path}: {e}") from e


def build_tree(layout: dict | str | os.PathLike, root: str | os.PathLike) -> str:
    """Write the tree LAYOUT (a dict, or a TOML file) describes under ROOT; returns ROOT."""
    if not isinstance(layout, dict):
        layout = load_layout(layout)
    _check_keys(layout, _TOP_KEYS, "layout")
    root = os.path.abspath(root)
    _HostBuilder(layout, _Tree(root)).build()
    return root


def parse_size(text: str | int) -> int:
    """Bytes: 4096, '512MiB', '16G' (binary), '960GB', '3.84TB' (decimal)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B)?\s*", str(text), re.I)
    if not match:
        raise BadInput(f"not a size: {text!r} (e.g. '512MiB', '960GB')")
    number, unit, suffix = match.groups()
    base = 1000 if unit and suffix and suffix.upper() == "B" else 1024
    power = "KMGTP".index(unit.upper()) + 1 if unit else 0
    return int(float(number) * base ** power)


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BadInput(f"unknown key(s) {', '.join(unknown)} in {where}",
                       hint=f"known: {', '.join(sorted(allowed))}")


def _pci_address(text: str) -> str:
    address = text.lower() if text.count(":") == 2 else f"0000:{text.lower()}"
    if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]", address):
        raise BadInput(f"not a PCI address: {text!r} (e.g. '0000:5e:00.0')")
    return address


def _runs(numbers: list[int]) -> list[list[int]]:
    """[1, 2, 5] -> [[1, 2], [5]]"""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _cpumask(cpus, width: int) -> str:
    """The kernel's hex mask notation: 32-bit words, high first, comma separated."""
    mask = sum(1 << cpu for cpu in cpus)
    words = [f"{(mask >> (32 * i)) & 0xFFFFFFFF:08x}" for i in range(max(1, (width + 31) // 32))]
    return ",".join(reversed(words))


class _Tree:
    """Files and relative symlinks under a root, addressed by host paths."""

    def __init__(self, root: str):
        self.root = root

    def path(self, host_path: str) -> str:
        return self.root + host_path

    def mkdir(self, host_path: str) -> None:
        os.makedirs(self.path(host_path), exist_ok=True)

    def write(self, host_path: str, value="") -> None:
        self.mkdir(os.path.dirname(host_path))
        with open(self.path(host_path), "w") as f:
            f.write(f"{value}\n" if value != "" else "")

    def link(self, host_path: str, target: str) -> None:
        """A relative symlink, as sysfs makes them."""
        self.mkdir(os.path.dirname(host_path))
        if os.path.lexists(self.path(host_path)):
            os.unlink(self.path(host_path))
        os.symlink(os.path.relpath(target, os.path.dirname(host_path)), self.path(host_path))


@dataclass
class _Pci:
    address: str
    pci_class: str
    vendor: str
    device: str
    driver: str | None
    node: int
    group: int | None = None
    port: str | None = None
    irqs: int = 0
    netdevs: dict = field(default_factory=dict)
    path: str = ""

    @property
    def is_bridge(self) -> bool:
        return self.pci_class.startswith("0x0604")


@dataclass
class _Block:
    path: str
    devnum: str
    size: int
    source: str


class _HostBuilder:
    def __init__(self, layout: dict, tree: _Tree):
        self.layout, self.t = layout, tree
        self.numa = layout.get("numa", True)
        self.iommu = layout.get("iommu", True)
        self.nodes = self._nodes()
        self.cpus: dict[int, tuple[int, int, int, tuple[int, ...]]] = {}  # cpu -> node, pkg, core, siblings
        self.pci: dict[str, _Pci] = {}
        self.blocks: dict[str, _Block] = {}
        self.mounts: list[tuple[str, str, str, str]] = []   # mountpoint, devnum, fs, source
        self.swaps: list[tuple[str, int]] = []
        self.irq = itertools.count(120)
        self.blkext = itertools.count(0)     # 259:N, shared by NVMe namespaces and partitions
        self.dm = itertools.count(0)

    def build(self) -> None:
        self._cpus()
        self._memory()
        self._collect_pci()
        for dev in sorted(self.pci.values(), key=lambda d: d.address):
            self._write_pci(dev)
        self._controllers()
        self._disks()
        self._volumes()
        self._rdma_nics()
        self._kernel()
        self._procfs()

    # --- CPUs, nodes, memory ---------------------------------------------------

    def _nodes(self) -> list[dict]:
        nodes = self.layout.get("node") or [{"cores": 1}]
        for i, node in enumerate(nodes):
            _check_keys(node, _KEYS["node"], f"node {i}")
            if "cores" not in node:
                raise BadInput(f"node {i} needs 'cores'")
            node.setdefault("id", i)
        if not self.numa and len(nodes) > 1:
            raise BadInput("numa = false describes a host with one node")
        return nodes

    def node_cpus(self, node: int) -> list[int]:
        if node < 0:
            return sorted(self.cpus)
        return sorted(c for c, (n, *_rest) in self.cpus.items() if n == node)

    def _cpus(self) -> None:
        smt, total = self.layout.get("smt", 1), sum(n["cores"] for n in self.nodes)
        core_index = 0
        for node in self.nodes:
            for core in range(node["cores"]):
                # Intel numbering: first threads of every core, then the second threads.
                siblings = tuple(t * total + core_index for t in range(smt))
                for cpu in siblings:
                    self.cpus[cpu] = (node["id"], node.get("package", node["id"]), core, siblings)
                core_index += 1
        base, every = "/sys/devices/system/cpu", format_cpulist(self.cpus)
        for name in ("online", "possible", "present"):
            self.t.write(f"{base}/{name}", every)
        self.t.write(f"{base}/offline")
        self.t.write(f"{base}/isolated", format_cpulist(parse_cpulist(self.layout.get("isolated", ""))))
        for cpu, (node, package, core, siblings) in self.cpus.items():
            topo = f"{base}/cpu{cpu}/topology"
            package_cpus = [c for c, v in self.cpus.items() if v[1] == package]
            self.t.write(f"{topo}/physical_package_id", package)
            self.t.write(f"{topo}/die_id", 0)
            self.t.write(f"{topo}/core_id", core)
            self.t.write(f"{topo}/thread_siblings_list", format_cpulist(siblings))
            self.t.write(f"{topo}/core_cpus_list", format_cpulist(siblings))
            self.t.write(f"{topo}/core_siblings_list", format_cpulist(package_cpus))
            self.t.write(f"{topo}/package_cpus_list", format_cpulist(package_cpus))
            if cpu:
                self.t.write(f"{base}/cpu{cpu}/online", 1)
            if self.numa:
                self.t.link(f"{base}/cpu{cpu}/node{node}", f"/sys/devices/system/node/node{node}")

    def _pools(self, node: dict) -> dict[int, tuple[int, int]]:
        pools = {2048: (0, 0), 1048576: (0, 0)}
        for size, count in node.get("hugepages", {}).items():
            total, free = (count, count) if isinstance(count, int) else count
            pools[parse_size(size) // 1024] = (total, free)
        return pools

    def _memory(self) -> None:
        base, ids = "/sys/devices/system/node", [n["id"] for n in self.nodes]
        totals = {2048: [0, 0], 1048576: [0, 0]}
        mem_kib = 0
        for node in self.nodes:
            kib = parse_size(node.get("memory", "16GiB")) // 1024
            mem_kib += kib
            pools = self._pools(node)
            for size, (total, free) in pools.items():
                totals.setdefault(size, [0, 0])
                totals[size][0] += total
                totals[size][1] += free
            if self.numa:
                self._node_dir(f"{base}/node{node['id']}", node, kib, pools, ids)
        if self.numa:
            for name in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory"):
                self.t.write(f"{base}/{name}", format_cpulist(ids))
        for size, (total, free) in totals.items():
            self._pool_dir(f"/sys/kernel/mm/hugepages/hugepages-{size}kB", total, free)
        pages2m = totals[2048]
        self.t.write("/proc/meminfo", f"MemTotal:       {mem_kib} kB\nMemFree:        {mem_kib // 2} kB\n"
                     f"HugePages_Total: {pages2m[0]}\nHugePages_Free:  {pages2m[1]}\n"
                     "Hugepagesize:       2048 kB")
        self.t.write("/proc/sys/vm/nr_hugepages", pages2m[0])

    def _node_dir(self, path: str, node: dict, kib: int, pools: dict, ids: list[int]) -> None:
        cpus, n = self.node_cpus(node["id"]), node["id"]
        self.t.write(f"{path}/cpulist", format_cpulist(cpus))
        self.t.write(f"{path}/cpumap", _cpumask(cpus, len(self.cpus)))
        self.t.write(f"{path}/distance", " ".join("10" if i == n else "21" for i in ids))
        self.t.write(f"{path}/meminfo", f"Node {n} MemTotal:       {kib} kB\n"
                     f"Node {n} MemFree:        {kib // 2} kB\n"
                     f"Node {n} HugePages_Total: {pools[2048][0]}\nNode {n} HugePages_Free:  {pools[2048][1]}")
        for size, (total, free) in pools.items():
            self._pool_dir(f"{path}/hugepages/hugepages-{size}kB", total, free)
        for cpu in cpus:
            self.t.link(f"{path}/cpu{cpu}", f"/sys/devices/system/cpu/cpu{cpu}")

    def _pool_dir(self, path: str, total: int, free: int) -> None:
        self.t.write(f"{path}/nr_hugepages", total)
        self.t.write(f"{path}/free_hugepages", free)
        self.t.write(f"{path}/surplus_hugepages", 0)

    # --- PCI functions -----------------------------------------------------------

    def _add_pci(self, spec: dict, kind: str, defaults: tuple[str, str, str, str | None]) -> _Pci:
        _check_keys(spec, _KEYS[kind], f"{kind} {spec.get('address', '?')}")
        if "address" not in spec:
            raise BadInput(f"every [[{kind}]] needs an 'address'")
        pci_class, vendor, device, driver = defaults
        address = _pci_address(spec["address"])
        if address in self.pci:
            raise BadInput(f"PCI address {address} is described twice")
        dev = _Pci(address, spec.get("class", pci_class), spec.get("vendor", vendor),
                   spec.get("device", device), spec.get("driver", driver) or None,
                   spec.get("node", 0 if self.numa else -1), spec.get("iommu_group"),
                   _pci_address(spec["port"]) if "port" in spec else None,
                   spec.get("irqs", 0), spec.get("netdevs", {}))
        self.pci[address] = dev
        return dev

    def _collect_pci(self) -> None:
        for spec in self.layout.get("pci", []):
            self._add_pci(spec, "pci", ("0x020000", "0x8086", "0x1572", None))
        for spec in self.layout.get("nvme", []):
            dev = self._add_pci(spec, "nvme", (NVME_CLASS, "0x8086", "0x0a54", "nvme"))
            if dev.driver == "nvme" and "irqs" not in spec:
                dev.irqs = 1 + min(len(self.cpus), 32)
        for spec in self.layout.get("rdma", []):
            self._add_pci(spec, "rdma", ("0x020000", "0x15b3", "0x1017", "mlx5_core"))
        if any(d.get("name", "").startswith("sd") and "pci" not in d for d in self.layout.get("disk", [])):
            if "0000:00:17.0" not in self.pci:
                self._add_pci({"address": "0000:00:17.0"}, "pci", ("0x010601", "0x8086", "0xa182", "ahci"))
        self._root_ports()
        for dev in self.pci.values():
            self._place(dev, set())
        if self.iommu:
            used = {d.group for d in self.pci.values() if d.group is not None}
            free = (g for g in itertools.count() if g not in used)
            for dev in sorted(self.pci.values(), key=lambda d: d.address):
                if dev.group is None:
                    dev.group = next(free)

    def _root_ports(self) -> None:
        """Make up the root ports a described endpoint hangs off: consecutive buses
        share a host bridge one bus below them, one port (slot) per bus."""
        for dev in list(self.pci.values()):
            if dev.port and dev.port not in self.pci:
                self._add_port(dev.port, dev.node)
        buses: dict[str, set[int]] = {}
        for dev in self.pci.values():
            bus = int(dev.address[5:7], 16)
            if not dev.port and not dev.is_bridge and bus:
                buses.setdefault(dev.address[:4], set()).add(bus)
        for domain, numbers in buses.items():
            for run in _runs(sorted(numbers)):
                bridge_bus = run[0] - 1
                for slot, bus in enumerate(run, start=1 if bridge_bus == 0 else 0):
                    port = f"{domain}:{bridge_bus:02x}:{slot:02x}.0"
                    children = [d for d in self.pci.values()
                                if d.address.startswith(f"{domain}:{bus:02x}:") and not d.port and not d.is_bridge]
                    if port not in self.pci:
                        self._add_port(port, children[0].node)
                    for child in children:
                        child.port = port

    def _add_port(self, address: str, node: int) -> None:
        self.pci[address] = _Pci(address, "0x060400", "0x8086", "0x2030", "pcieport", node)

    def _place(self, dev: _Pci, seen: set[str]) -> str:
        if not dev.path:
            if dev.address in seen:
                raise BadInput(f"PCI ports form a loop at {dev.address}")
            seen.add(dev.address)
            parent = (self._place(self.pci[dev.port], seen) if dev.port
                      else f"/sys/devices/pci{dev.address[:4]}:{dev.address[5:7]}")
            dev.path = f"{parent}/{dev.address}"
        return dev.path

    def _write_pci(self, dev: _Pci) -> None:
        p, t = dev.path, self.t
        local = self.node_cpus(dev.node)
        for name, value in (("vendor", dev.vendor), ("device", dev.device), ("class", dev.pci_class),
                            ("subsystem_vendor", dev.vendor), ("subsystem_device", "0x0000"),
                            ("numa_node", dev.node), ("local_cpulist", format_cpulist(local)),
                            ("local_cpus", _cpumask(local, len(self.cpus))),
                            ("driver_override", "(null)"), ("enable", 1), ("irq", 16)):
            t.write(f"{p}/{name}", value)
        t.write(f"{p}/uevent", f"DRIVER={dev.driver}\n" * bool(dev.driver) +
                f"PCI_CLASS={int(dev.pci_class, 16):X}\nPCI_SLOT_NAME={dev.address}")
        t.link(f"/sys/bus/pci/devices/{dev.address}", p)
        if dev.driver:
            driver = self._driver(dev.driver)
            t.link(f"{p}/driver", driver)
            t.link(f"{driver}/{dev.address}", p)
        if dev.group is not None:
            group = f"/sys/kernel/iommu_groups/{dev.group}"
            t.write(f"{group}/type", "identity" if "iommu=pt" in self.cmdline else "DMA-FQ")
            t.link(f"{p}/iommu_group", group)
            t.link(f"{group}/devices/{dev.address}", p)
        vectors = [next(self.irq) for _ in range(dev.irqs)]
        for i, irq in enumerate(vectors):
            t.write(f"{p}/msi_irqs/{irq}", "msix")
            self._irq(irq, self._spread(i, len(vectors)) if dev.pci_class == NVME_CLASS else local)
        for name, mtu in dev.netdevs.items():
            self._netdev(dev, name, mtu)

    def _driver(self, name: str) -> str:
        driver = f"/sys/bus/pci/drivers/{name}"
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            self.t.write(f"{driver}/{attr}")
        return driver

    def _spread(self, vector: int, count: int) -> list[int]:
        """The CPUs of one NVMe vector: the admin queue (0) may run anywhere; the
        I/O queues split all CPUs between them, node by node, SMT siblings together."""
        cpus = sorted(self.cpus, key=lambda c: (self.cpus[c][0], self.cpus[c][1], self.cpus[c][2], c))
        if vector == 0 or count < 2:
            return sorted(cpus)
        queues = count - 1
        chunk = [cpus[i] for i in range(len(cpus)) if i * queues // len(cpus) == vector - 1]
        return sorted(chunk) or [cpus[(vector - 1) % len(cpus)]]

    def _irq(self, irq: int, cpus: list[int]) -> None:
        self.t.write(f"/proc/irq/{irq}/smp_affinity_list", format_cpulist(cpus))
        self.t.write(f"/proc/irq/{irq}/smp_affinity", _cpumask(cpus, len(self.cpus)))
        self.t.write(f"/proc/irq/{irq}/effective_affinity_list", min(cpus))

    def _netdev(self, dev: _Pci, name: str, mtu: int) -> None:
        path = f"{dev.path}/net/{name}"
        self.t.write(f"{path}/mtu", mtu)
        self.t.write(f"{path}/operstate", "up")
        bus, slot, fn = int(dev.address[5:7], 16), int(dev.address[8:10], 16), int(dev.address[11])
        self.t.write(f"{path}/address", f"0c:42:a1:{bus:02x}:{slot:02x}:{fn:02x}")
        self.t.link(f"{path}/device", dev.path)
        self.t.link(f"/sys/class/net/{name}", path)

    @property
    def cmdline(self) -> str:
        return self.layout.get("cmdline", "BOOT_IMAGE=/boot/vmlinuz-6.1.0-18-amd64 ro quiet")

    # --- NVMe controllers and block devices ---------------------------------------

    def _controllers(self) -> None:
        specs = [s for s in self.layout.get("nvme", [])
                 if self.pci[_pci_address(s["address"])].driver == "nvme"]
        taken = {int(s["name"][4:]) for s in specs if "name" in s}
        free = (i for i in itertools.count() if i not in taken)
        for spec in specs:
            instance = int(spec["name"][4:]) if "name" in spec else next(free)
            self._controller(spec, self.pci[_pci_address(spec["address"])], instance)

    def _controller(self, spec: dict, dev: _Pci, instance: int) -> None:
        name, t = f"nvme{instance}", self.t
        ctrl = f"{dev.path}/nvme/{name}"
        model = spec.get("model", "INTEL SSDPE2KX040T8")
        serial = spec.get("serial", f"PHLJ{9100 + instance:04d}00A4P0DGN")
        nqn = f"nqn.2014.08.org.nvmexpress:{dev.vendor[2:]}{dev.vendor[2:]}{serial}{model}"
        for attr, value in (("model", model), ("serial", serial), ("firmware_rev", "VDV10170"),
                            ("transport", "pcie"), ("address", dev.address), ("state", "live"),
                            ("cntlid", 0), ("numa_node", dev.node), ("subsysnqn", nqn),
                            ("dev", f"240:{instance}")):
            t.write(f"{ctrl}/{attr}", value)
        t.link(f"{ctrl}/device", dev.path)
        t.link(f"/sys/class/nvme/{name}", ctrl)
        head_dir = None
        if spec.get("multipath"):
            head_dir = f"/sys/devices/virtual/nvme-subsystem/nvme-subsys{instance}"
            for attr, value in (("model", model), ("serial", serial), ("subsysnqn", nqn)):
                t.write(f"{head_dir}/{attr}", value)
            t.link(f"{head_dir}/{name}", ctrl)
            t.link(f"/sys/class/nvme-subsystem/nvme-subsys{instance}", head_dir)
        for i, ns in enumerate(spec.get("namespace", [{}])):
            _check_keys(ns, _KEYS["namespace"], f"namespace {i + 1} of {dev.address}")
            self._namespace(ns, ctrl, instance, ns.get("nsid", i + 1), head_dir)

    def _namespace(self, spec: dict, ctrl: str, instance: int, nsid: int, head_dir: str | None) -> None:
        head = f"nvme{instance}n{nsid}"
        if head_dir:
            # Native multipath: the controller holds a hidden per-path device
            # (no dev_t); the block device is the subsystem's head.
            path_dev = f"{ctrl}/nvme{instance}c{instance}n{nsid}"
            self.t.write(f"{path_dev}/nsid", nsid)
            self.t.write(f"{path_dev}/ana_state", "optimized")
            self.t.link(f"/sys/block/nvme{instance}c{instance}n{nsid}", path_dev)
            self.t.link(f"/sys/class/block/nvme{instance}c{instance}n{nsid}", path_dev)
        disk_dir = f"{head_dir or ctrl}/{head}"
        self._disk(head, disk_dir, spec, 259, self.blkext, {"nsid": nsid, "wwid": f"eui.{instance:04x}{nsid:012x}"},
                   default_size="1TB")

    def _disk(self, name: str, path: str, spec: dict, major: int, minors, extra: dict,
              default_size: str = "1TB", source: str | None = None) -> None:
        t, size = self.t, parse_size(spec.get("size", default_size))
        scheduler = spec.get("scheduler", "none")
        choices = _SCHEDULERS if scheduler in _SCHEDULERS else _SCHEDULERS + [scheduler]
        t.write(f"{path}/queue/scheduler", " ".join(f"[{s}]" if s == scheduler else s for s in choices))
        t.write(f"{path}/queue/logical_block_size", 512)
        t.write(f"{path}/queue/rotational", 0)
        t.write(f"{path}/removable", 0)
        for attr, value in extra.items():
            t.write(f"{path}/{attr}", value)
        self._block(name, path, spec, f"{major}:{next(minors)}", size, "disk", source)
        t.link(f"/sys/block/{name}", path)
        start = 2048
        for k, part in enumerate(spec.get("partitions", []), start=1):
            _check_keys(part, _KEYS["partition"], f"partition {k} of {name}")
            pname = f"{name}p{k}" if name[-1].isdigit() else f"{name}{k}"
            psize = parse_size(part.get("size", "1GiB"))
            t.write(f"{path}/{pname}/partition", k)
            t.write(f"{path}/{pname}/start", start)
            self._block(pname, f"{path}/{pname}", part, f"{major}:{next(minors)}", psize, "partition", None)
            start += psize // 512

    def _block(self, name: str, path: str, spec: dict, devnum: str, size: int, kind: str,
               source: str | None) -> None:
        t = self.t
        t.write(f"{path}/dev", devnum)
        t.write(f"{path}/size", size // 512)
        t.write(f"{path}/ro", 0)
        t.write(f"{path}/uevent", f"MAJOR={devnum.split(':')[0]}\nMINOR={devnum.split(':')[1]}\n"
                f"DEVNAME={name}\nDEVTYPE={kind}")
        t.mkdir(f"{path}/holders")
        if kind == "disk":
            t.mkdir(f"{path}/slaves")
        t.link(f"/sys/class/block/{name}", path)
        t.link(f"/sys/dev/block/{devnum}", path)
        block = _Block(path, devnum, size, spec.get("source", source or f"/dev/{name}"))
        self.blocks[name] = block
        if "mount" in spec:
            self.mounts.append((spec["mount"], devnum, spec.get("fs", "ext4"), block.source))
        if spec.get("swap"):
            self.swaps.append((block.source, size // 1024))

    def _disks(self) -> None:
        for k, spec in enumerate(self.layout.get("disk", [])):
            _check_keys(spec, _KEYS["disk"], f"disk {spec.get('name', k)}")
            name = spec.get("name", f"sd{chr(ord('a') + k)}")
            controller = self.pci[_pci_address(spec.get("pci", "0000:00:17.0"))]
            if name.startswith("sd"):
                path = f"{controller.path}/ata{k + 1}/host{k}/target{k}:0:0/{k}:0:0:0/block/{name}"
                major, minors = 8, iter(range(16 * k, 16 * k + 16))
            else:
                path, major, minors = f"{controller.path}/virtio{k}/block/{name}", 252, iter(range(16 * k, 16 * k + 16))
            self._disk(name, path, {"scheduler": "mq-deadline", **spec}, major, minors, {}, "480GB")

    def _volumes(self) -> None:
        for spec in self.layout.get("volume", []):
            _check_keys(spec, _KEYS["volume"], f"volume {spec.get('name', '?')}")
            name, members = spec["name"], spec.get("on", [])
            members = [members] if isinstance(members, str) else members
            for member in members:
                if member not in self.blocks:
                    raise BadInput(f"volume {name} is on {member}, which the layout does not describe")
            size = spec.get("size", self.blocks[members[0]].size if members else "10GiB")
            if re.fullmatch(r"md\d+", name):
                kname, path = name, f"/sys/devices/virtual/block/{name}"
                extra, major, minor, source = {"md/level": spec.get("level", "raid1")}, 9, int(name[2:]), None
            else:
                minor = next(self.dm)
                kname, path = f"dm-{minor}", f"/sys/devices/virtual/block/dm-{minor}"
                extra = {"dm/name": name, "dm/uuid": f"LVM-vstor{minor:04d}", "dm/suspended": 0}
                major, source = 254, f"/dev/mapper/{name}"
            volume = {k: v for k, v in spec.items() if k in _USE_KEYS} | {"size": size}
            self._disk(kname, path, volume, major, iter([minor]), extra, source=source)
            for member in members:
                self.t.link(f"{self.blocks[member].path}/holders/{kname}", path)
                self.t.link(f"{path}/slaves/{member}", self.blocks[member].path)

    # --- RDMA, kernel switches, procfs ---------------------------------------------

    def _rdma_nics(self) -> None:
        for i, spec in enumerate(self.layout.get("rdma", [])):
            dev = self.pci[_pci_address(spec["address"])]
            name = spec.get("name", f"mlx5_{i}")
            ib = f"{dev.path}/infiniband/{name}"
            self.t.write(f"{ib}/node_type", "1: CA")
            self.t.write(f"{ib}/ports/1/state", "4: ACTIVE")
            self.t.write(f"{ib}/ports/1/link_layer", "Ethernet")
            self.t.link(f"{ib}/device", dev.path)
            self.t.link(f"/sys/class/infiniband/{name}", ib)

    def _kernel(self) -> None:
        t = self.t
        thp = self.layout.get("thp", "madvise")
        t.write("/sys/kernel/mm/transparent_hugepage/enabled",
                " ".join(f"[{m}]" if m == thp else m for m in ("always", "madvise", "never")))
        for d in ("/sys/kernel/iommu_groups", "/sys/class/nvme", "/sys/class/block", "/sys/block",
                  "/sys/dev/block", "/sys/module"):
            t.mkdir(d)
        t.write("/sys/bus/pci/drivers_probe")
        t.write("/sys/bus/pci/rescan")
        if self.iommu:
            t.write("/sys/devices/virtual/iommu/dmar0/intel-iommu/version", "1:0")
            t.link("/sys/class/iommu/dmar0", "/sys/devices/virtual/iommu/dmar0")
        if self.layout.get("vfio", self.iommu):
            self._driver("vfio-pci")
            t.write("/sys/module/vfio_pci/refcnt", 0)

    def _procfs(self) -> None:
        t = self.t
        t.write("/proc/cmdline", self.cmdline)
        t.write("/proc/sys/kernel/hostname", self.layout.get("hostname", "vstor-test"))
        t.write("/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority" + "".join(
            f"\n{dev:<40}partition\t{kib}\t\t0\t\t-2" for dev, kib in self.swaps))
        processes = {1: "systemd", 2: "kthreadd", 512: "systemd-journal", 801: "sshd",
                     _SELF_PID: "python3"}
        if self.layout.get("irqbalance"):
            processes[873] = "irqbalance"
        for pid, comm in processes.items():
            t.write(f"/proc/{pid}/comm", comm)
        me = f"/proc/{_SELF_PID}"
        t.link("/proc/self", me)
        t.link("/proc/thread-self", f"{me}/task/{_SELF_PID}")
        t.link("/proc/mounts", "/proc/self/mounts")
        mounts = self._mount_table()
        t.write(f"{me}/mountinfo", "\n".join(
            f"{20 + i} {1 if i == 0 else 20} {devnum} / {point} rw,relatime shared:{i + 1} - {fs} {source} rw"
            for i, (point, devnum, fs, source) in enumerate(mounts)))
        t.write(f"{me}/mounts", "\n".join(f"{source} {point} {fs} rw,relatime 0 0"
                                          for point, devnum, fs, source in mounts))

    def _mount_table(self) -> list[tuple[str, str, str, str]]:
        virtual = [("/sys", "0:21", "sysfs", "sysfs"), ("/proc", "0:22", "proc", "proc"),
                   ("/dev", "0:5", "devtmpfs", "udev"), ("/run", "0:24", "tmpfs", "tmpfs"),
                   ("/dev/shm", "0:26", "tmpfs", "tmpfs"), ("/dev/hugepages", "0:35", "hugetlbfs", "hugetlbfs")]
        real = sorted(self.mounts, key=lambda m: (m[0] != "/", len(m[0]), m[0]))
        return real[:1] + virtual + real[1:] if real and real[0][0] == "/" else virtual + real


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0].startswith("-"):
        print("usage: python -m vstor.testing.layout LAYOUT.toml DIR", file=sys.stderr)
        return 2
    try:
        root = build_tree(args[0], args[1])
    except VstorError as e:
        print(f"vstor.testing.layout: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"host tree written to {root}; read it with: vstor --host-root {root} host show")
    return 0


if __name__ == "__main__":
    sys.exit(main())
