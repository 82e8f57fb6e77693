"""PCI functions: root ports, drivers, IOMMU groups, MSI-X vectors, netdevs
and RDMA devices."""

from __future__ import annotations

import itertools

from vstor.errors import BadInput
from vstor.host.model import NVME_CLASS, format_cpulist

from .model import KEYS, Build, Pci, check_keys, pci_address
from .tree import cpumask

AHCI = "0000:00:17.0"


def collect_pci(b: Build) -> None:
    """Every PCI function the layout describes or implies, placed under its port."""
    for spec in b.layout.get("pci", []):
        _add_pci(b, spec, "pci", ("0x020000", "0x8086", "0x1572", None))
    for spec in b.layout.get("nvme", []):
        dev = _add_pci(b, spec, "nvme", (NVME_CLASS, "0x8086", "0x0a54", "nvme"))
        if dev.driver == "nvme" and "irqs" not in spec:
            dev.irqs = 1 + min(len(b.cpus), 32)
        _virtual_functions(b, dev, spec.get("vfs", 0))
    for spec in b.layout.get("rdma", []):
        _add_pci(b, spec, "rdma", ("0x020000", "0x15b3", "0x1017", "mlx5_core"))
    if any(d.get("name", "").startswith("sd") and "pci" not in d for d in b.layout.get("disk", [])):
        if AHCI not in b.pci:
            _add_pci(b, {"address": AHCI}, "pci", ("0x010601", "0x8086", "0xa182", "ahci"))
    _root_ports(b)
    for dev in b.pci.values():
        _place(b, dev, set())
    if b.iommu:
        used = {d.group for d in b.pci.values() if d.group is not None}
        free = (g for g in itertools.count() if g not in used)
        for dev in sorted(b.pci.values(), key=lambda d: d.address):
            if dev.group is None:
                dev.group = next(free)


def _add_pci(b: Build, spec: dict, kind: str, defaults: tuple[str, str, str, str | None]) -> Pci:
    check_keys(spec, KEYS[kind], f"{kind} {spec.get('address', '?')}")
    if "address" not in spec:
        raise BadInput(f"every [[{kind}]] needs an 'address'")
    pci_class, vendor, device, driver = defaults
    address = pci_address(spec["address"])
    if address in b.pci:
        raise BadInput(f"PCI address {address} is described twice")
    dev = Pci(address, spec.get("class", pci_class), spec.get("vendor", vendor),
              spec.get("device", device), spec.get("driver", driver) or None,
              spec.get("node", 0 if b.numa else -1), spec.get("iommu_group"),
              pci_address(spec["port"]) if "port" in spec else None,
              spec.get("irqs", 0), spec.get("netdevs", {}), sriov=spec.get("sriov", 0))
    b.pci[address] = dev
    return dev


def _virtual_functions(b: Build, pf: Pci, count: int) -> None:
    """`count` enabled VFs of an SR-IOV PF (sriov_numvfs), as the kernel
    makes them: NVMe functions after the PF on its bus (unbound here),
    each with `physfn`, the PF with `virtfnN`."""
    if count and not 0 < count <= pf.sriov:
        raise BadInput(f"nvme {pf.address}: vfs = {count} needs sriov (totalvfs) of at least that")
    for k in range(1, count + 1):
        address = f"{pf.address[:-1]}{k}"
        if address in b.pci:
            raise BadInput(f"PCI address {address} is described twice")
        b.pci[address] = Pci(address, pf.pci_class, pf.vendor, pf.device, None, pf.node,
                             port=pf.port, pf=pf.address)
        pf.vfs.append(address)


def _runs(numbers: list[int]) -> list[list[int]]:
    """[1, 2, 5] -> [[1, 2], [5]]"""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _root_ports(b: Build) -> None:
    """Make up the root ports a described endpoint hangs off: consecutive buses
    share a host bridge one bus below them, one port (slot) per bus."""
    for dev in list(b.pci.values()):
        if dev.port and dev.port not in b.pci:
            _add_port(b, dev.port, dev.node)
    buses: dict[str, set[int]] = {}
    for dev in b.pci.values():
        bus = int(dev.address[5:7], 16)
        if not dev.port and not dev.is_bridge and bus:
            buses.setdefault(dev.address[:4], set()).add(bus)
    for domain, numbers in buses.items():
        for run in _runs(sorted(numbers)):
            bridge_bus = run[0] - 1
            for slot, bus in enumerate(run, start=1 if bridge_bus == 0 else 0):
                port = f"{domain}:{bridge_bus:02x}:{slot:02x}.0"
                children = [d for d in b.pci.values()
                            if d.address.startswith(f"{domain}:{bus:02x}:") and not d.port and not d.is_bridge]
                if port not in b.pci:
                    _add_port(b, port, children[0].node)
                for child in children:
                    child.port = port


def _add_port(b: Build, address: str, node: int) -> None:
    b.pci[address] = Pci(address, "0x060400", "0x8086", "0x2030", "pcieport", node)


def _place(b: Build, dev: Pci, seen: set[str]) -> str:
    if not dev.path:
        if dev.address in seen:
            raise BadInput(f"PCI ports form a loop at {dev.address}")
        seen.add(dev.address)
        parent = (_place(b, b.pci[dev.port], seen) if dev.port
                  else f"/sys/devices/pci{dev.address[:4]}:{dev.address[5:7]}")
        dev.path = f"{parent}/{dev.address}"
    return dev.path


def write_pci(b: Build) -> None:
    for dev in sorted(b.pci.values(), key=lambda d: d.address):
        _write_function(b, dev)


def _write_function(b: Build, dev: Pci) -> None:
    p, t = dev.path, b.t
    local = b.node_cpus(dev.node)
    for name, value in (("vendor", dev.vendor), ("device", dev.device), ("class", dev.pci_class),
                        ("subsystem_vendor", dev.vendor), ("subsystem_device", "0x0000"),
                        ("numa_node", dev.node), ("local_cpulist", format_cpulist(local)),
                        ("local_cpus", cpumask(local, len(b.cpus))),
                        ("driver_override", "(null)"), ("enable", 1), ("irq", 16)):
        t.write(f"{p}/{name}", value)
    t.write(f"{p}/uevent", f"DRIVER={dev.driver}\n" * bool(dev.driver) +
            f"PCI_CLASS={int(dev.pci_class, 16):X}\nPCI_SLOT_NAME={dev.address}")
    t.link(f"/sys/bus/pci/devices/{dev.address}", p)
    if dev.sriov:
        t.write(f"{p}/sriov_totalvfs", dev.sriov)
        t.write(f"{p}/sriov_numvfs", len(dev.vfs))
    for k, vf in enumerate(dev.vfs):
        t.link(f"{p}/virtfn{k}", b.pci[vf].path)
    if dev.pf:
        t.link(f"{p}/physfn", b.pci[dev.pf].path)
    if dev.driver:
        driver = write_driver(b, dev.driver)
        t.link(f"{p}/driver", driver)
        t.link(f"{driver}/{dev.address}", p)
    if dev.group is not None:
        group = f"/sys/kernel/iommu_groups/{dev.group}"
        t.write(f"{group}/type", "identity" if "iommu=pt" in b.cmdline else "DMA-FQ")
        t.link(f"{p}/iommu_group", group)
        t.link(f"{group}/devices/{dev.address}", p)
    vectors = [next(b.irq) for _ in range(dev.irqs)]
    for i, irq in enumerate(vectors):
        t.write(f"{p}/msi_irqs/{irq}", "msix")
        _irq(b, irq, _spread(b, i, len(vectors)) if dev.pci_class == NVME_CLASS else local)
    for name, mtu in dev.netdevs.items():
        _netdev(b, dev, name, mtu)


def write_driver(b: Build, name: str) -> str:
    driver = f"/sys/bus/pci/drivers/{name}"
    for attr in ("bind", "unbind", "new_id", "remove_id"):
        b.t.write(f"{driver}/{attr}")
    return driver


def _spread(b: Build, vector: int, count: int) -> list[int]:
    """The CPUs of one NVMe vector: the admin queue (0) may run anywhere; the
    I/O queues split all CPUs between them, node by node, SMT siblings together."""
    cpus = sorted(b.cpus, key=lambda c: (b.cpus[c].node, b.cpus[c].package, b.cpus[c].core, c))
    if vector == 0 or count < 2:
        return sorted(cpus)
    queues = count - 1
    chunk = [cpus[i] for i in range(len(cpus)) if i * queues // len(cpus) == vector - 1]
    return sorted(chunk) or [cpus[(vector - 1) % len(cpus)]]


def _irq(b: Build, irq: int, cpus: list[int]) -> None:
    b.t.write(f"/proc/irq/{irq}/smp_affinity_list", format_cpulist(cpus))
    b.t.write(f"/proc/irq/{irq}/smp_affinity", cpumask(cpus, len(b.cpus)))
    b.t.write(f"/proc/irq/{irq}/effective_affinity_list", min(cpus))


def _netdev(b: Build, dev: Pci, name: str, mtu: int) -> None:
    path = f"{dev.path}/net/{name}"
    b.t.write(f"{path}/mtu", mtu)
    b.t.write(f"{path}/operstate", "up")
    bus, slot, fn = int(dev.address[5:7], 16), int(dev.address[8:10], 16), int(dev.address[11])
    b.t.write(f"{path}/address", f"0c:42:a1:{bus:02x}:{slot:02x}:{fn:02x}")
    b.t.link(f"{path}/device", dev.path)
    b.t.link(f"/sys/class/net/{name}", path)


def write_rdma(b: Build) -> None:
    for i, spec in enumerate(b.layout.get("rdma", [])):
        dev = b.pci[pci_address(spec["address"])]
        name = spec.get("name", f"mlx5_{i}")
        ib = f"{dev.path}/infiniband/{name}"
        b.t.write(f"{ib}/node_type", "1: CA")
        b.t.write(f"{ib}/ports/1/state", "4: ACTIVE")
        b.t.write(f"{ib}/ports/1/link_layer", "Ethernet")
        b.t.link(f"{ib}/device", dev.path)
        b.t.link(f"/sys/class/infiniband/{name}", ib)
