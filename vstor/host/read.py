"""Build the host model (`vstor.model.Host`) from sysfs and procfs.

Everything is read through the `SysFS` it is given, so the same code reads the
live host, a `vstor host capture` extracted elsewhere, or a synthetic tree
from `tests/hostlayout` (a test tool).
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
import re
import uuid

from vstor.host.model import (NVME_CLASS, Cpu, HugepagePool, Host, Namespace, NetDev,
                    NumaNode, NvmeController, PciDevice, RdmaNic, parse_cpulist, stacked_on)
from vstor.host.blocks import BlockUsage, read_block_devices
from vstor.host.sysfs import SysFS

PCI_DEVICES = "/sys/bus/pci/devices"
CPU_DIR = "/sys/devices/system/cpu"
NODE_DIR = "/sys/devices/system/node"
IOMMU_GROUPS = "/sys/kernel/iommu_groups"
INFINIBAND = "/sys/class/infiniband"

# nvme0n1, or with native multipath the per-path device nvme0c1n1 (subsystem 0,
# controller 1, namespace 1) whose block device is the subsystem's head nvme0n1.
_NS_NAME = re.compile(r"nvme(\d+)(?:c\d+)?n(\d+)")


def read_host(sysfs: SysFS, processes: bool = True) -> Host:
    """`processes=False`: the one fact read from every process (whether
    irqbalance runs: doctor's) is left unread (None), for the hook."""
    online = read_online_cpus(sysfs)
    nodes = read_nodes(sysfs, online)
    usage = BlockUsage(sysfs)
    return Host(
        hostname=sysfs.read("/proc/sys/kernel/hostname", "", optional=True),
        cpus=read_cpus(sysfs, online, nodes),
        nodes=nodes,
        controllers=read_controllers(sysfs, usage),
        rdma_nics=read_rdma_nics(sysfs),
        block_devices=read_block_devices(sysfs, usage),
        cmdline=sysfs.read("/proc/cmdline", ""),
        iommu_enabled=bool(sysfs.listdir(IOMMU_GROUPS)),
        vfio_available=(sysfs.exists("/sys/bus/pci/drivers/vfio-pci")
                        or sysfs.exists("/sys/module/vfio_pci")),
        thp=bracketed(sysfs.read("/sys/kernel/mm/transparent_hugepage/enabled", "", optional=True)),
        irqbalance_running=irqbalance_running(sysfs) if processes else None,
        hostnqn=read_hostnqn(sysfs),
    )


HOSTNQN_FILE = "/etc/nvme/hostnqn"
MACHINE_ID = "/etc/machine-id"
_NQN = re.compile(r"nqn\.[!-~]{1,219}")


def read_hostnqn(sysfs: SysFS) -> str | None:
    """This host's NVMe host NQN, what SPDK attaches with unless a disk or
    [nvmf] hostnqn names one: the host's own (/etc/nvme/hostnqn, which
    nvme-cli writes once at install and NVMe-oF targets already allow), or
    else one made from the machine ID, the same at every boot without any
    file of vstor's (the state directory is on /run), the ID itself hashed
    as systemd's application-specific IDs are, so it never leaves the host;
    None when the host has neither (the planner then asks for one)."""
    given = sysfs.read(HOSTNQN_FILE, "", optional=True)
    if given and _NQN.fullmatch(given):
        return given
    machine = sysfs.read(MACHINE_ID, "", optional=True)
    if not re.fullmatch(r"[0-9a-f]{32}", machine or ""):
        return None
    digest = hmac.new(bytes.fromhex(machine), b"vstor NVMe host NQN", hashlib.sha256).digest()
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.UUID(bytes=digest[:16], version=4)}"


def bracketed(text: str) -> str:
    """The active choice of a sysfs selector: 'always [madvise] never' -> 'madvise'."""
    match = re.search(r"\[([^\]]+)\]", text)
    if match:
        return match.group(1)
    words = text.split()
    return words[0] if len(words) == 1 else ""


# --- CPUs and NUMA nodes ----------------------------------------------------

def read_online_cpus(sysfs: SysFS) -> tuple[int, ...]:
    online = sysfs.read(f"{CPU_DIR}/online")
    if online is not None:
        return parse_cpulist(online)
    return tuple(sorted(int(d[3:]) for d in sysfs.listdir(CPU_DIR) if re.fullmatch(r"cpu\d+", d)))


def read_nodes(sysfs: SysFS, online: tuple[int, ...]) -> tuple[NumaNode, ...]:
    if not sysfs.is_dir(NODE_DIR):
        # A kernel without NUMA support: one node holding everything.
        return (NumaNode(0, online, meminfo_total(sysfs.read("/proc/meminfo", "")),
                         read_hugepage_pools(sysfs, "/sys/kernel/mm/hugepages")),)
    ids = parse_cpulist(sysfs.read(f"{NODE_DIR}/online", ""))
    if not ids:
        ids = tuple(sorted(int(d[4:]) for d in sysfs.listdir(NODE_DIR) if re.fullmatch(r"node\d+", d)))
    nodes = []
    for node_id in ids:
        base = f"{NODE_DIR}/node{node_id}"
        nodes.append(NumaNode(node_id, parse_cpulist(sysfs.read(f"{base}/cpulist", "")),
                              meminfo_total(sysfs.read(f"{base}/meminfo", "")),
                              read_hugepage_pools(sysfs, f"{base}/hugepages")))
    return tuple(nodes)


def meminfo_total(text: str) -> int:
    """KiB of 'MemTotal:' in /proc/meminfo or a node's 'Node 0 MemTotal:' line."""
    match = re.search(r"MemTotal:\s+(\d+)", text)
    return int(match.group(1)) if match else 0


def read_hugepage_pools(sysfs: SysFS, base: str) -> tuple[HugepagePool, ...]:
    pools = []
    for entry in sysfs.listdir(base):
        match = re.fullmatch(r"hugepages-(\d+)kB", entry)
        if match:
            pools.append(HugepagePool(int(match.group(1)),
                                      sysfs.read_int(f"{base}/{entry}/nr_hugepages", 0),
                                      sysfs.read_int(f"{base}/{entry}/free_hugepages", 0)))
    return tuple(sorted(pools, key=lambda p: p.size_kib))


def read_cpus(sysfs: SysFS, online: tuple[int, ...], nodes: tuple[NumaNode, ...]) -> tuple[Cpu, ...]:
    node_of = {cpu: node.id for node in nodes for cpu in node.cpus}
    isolated = set(parse_cpulist(sysfs.read(f"{CPU_DIR}/isolated", "")))
    cpus = []
    for cpu in online:
        topo = f"{CPU_DIR}/cpu{cpu}/topology"
        cpus.append(Cpu(id=cpu, node=node_of.get(cpu, 0),
                        package=sysfs.read_int(f"{topo}/physical_package_id", 0),
                        core_id=sysfs.read_int(f"{topo}/core_id", cpu),
                        siblings=parse_cpulist(sysfs.read(f"{topo}/thread_siblings_list", "")) or (cpu,),
                        isolated=cpu in isolated))
    return tuple(cpus)


# --- PCI devices and NVMe controllers --------------------------------------

def read_pci_device(sysfs: SysFS, address: str) -> PciDevice:
    dev = f"{PCI_DEVICES}/{address}"
    return PciDevice(address=address, vendor=sysfs.read(f"{dev}/vendor", ""),
                     device=sysfs.read(f"{dev}/device", ""),
                     pci_class=sysfs.read(f"{dev}/class", "").lower(),
                     driver=sysfs.link_name(f"{dev}/driver"),
                     numa_node=sysfs.read_int(f"{dev}/numa_node", -1))


def read_controllers(sysfs: SysFS, usage: BlockUsage) -> tuple[NvmeController, ...]:
    # By class, not by driver: a controller bound to vfio-pci or to nothing is still one.
    return tuple(read_controller(sysfs, address, usage) for address in sysfs.listdir(PCI_DEVICES)
                 if sysfs.read(f"{PCI_DEVICES}/{address}/class", "").lower() == NVME_CLASS)


def read_controller(sysfs: SysFS, address: str, usage: BlockUsage) -> NvmeController:
    dev = f"{PCI_DEVICES}/{address}"
    pci = read_pci_device(sysfs, address)
    name = nvme_name(sysfs, dev)
    namespaces = read_namespaces(sysfs, name, usage) if name else ()
    group = iommu_group(sysfs, dev)
    ctrl = f"/sys/class/nvme/{name}"
    return NvmeController(
        address=address, numa_node=pci.numa_node, vendor=pci.vendor, device=pci.device,
        driver=pci.driver, name=name,
        model=sysfs.read(f"{ctrl}/model", "", optional=True) if name else "",
        serial=sysfs.read(f"{ctrl}/serial", "", optional=True) if name else "",
        iommu_group=group, group_peers=group_peers(sysfs, group, address),
        namespaces=tuple(ns for ns, _ in namespaces),
        local_cpus=parse_cpulist(sysfs.read(f"{dev}/local_cpulist", "")),
        irqs=read_msi_irqs(sysfs, dev),
        backs_root=any(backs_root for _, backs_root in namespaces),
        sriov_vfs=sysfs.read_int(f"{dev}/sriov_totalvfs", 0, optional=True) or 0,
        virtfns=tuple(sorted(filter(None, (sysfs.link_name(f"{dev}/{n}") for n in sysfs.listdir(dev)
                                          if re.fullmatch(r"virtfn\d+", n))))),
        physfn=sysfs.link_name(f"{dev}/physfn"),
    )


def nvme_name(sysfs: SysFS, dev: str) -> str | None:
    """'nvme0' while the nvme driver owns the device (its class dir sits under it)."""
    names = [n for n in sysfs.listdir(f"{dev}/nvme") if re.fullmatch(r"nvme\d+", n)]
    return names[0] if names else None


def iommu_group(sysfs: SysFS, dev: str) -> int | None:
    group = sysfs.link_name(f"{dev}/iommu_group")
    return int(group) if group and group.isdigit() else None


def group_peers(sysfs: SysFS, group: int | None, address: str) -> tuple[PciDevice, ...]:
    if group is None:
        return ()
    members = sysfs.listdir(f"{IOMMU_GROUPS}/{group}/devices")
    return tuple(read_pci_device(sysfs, m) for m in members if m != address)


def read_msi_irqs(sysfs: SysFS, dev: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
    irqs = []
    for irq in sysfs.listdir(f"{dev}/msi_irqs"):
        # msi_irqs/N holds the vector's mode ('msix', 'msi'); no mode: freed since the listing.
        if not irq.isdigit() or not sysfs.read(f"{dev}/msi_irqs/{irq}", optional=True):
            continue
        affinity = sysfs.read(f"/proc/irq/{irq}/smp_affinity_list", "", optional=True)
        irqs.append((int(irq), parse_cpulist(affinity)))
    return tuple(sorted(irqs))


def read_namespaces(sysfs: SysFS, name: str, usage: BlockUsage) -> list[tuple[Namespace, bool]]:
    """(namespace, backs_root) for each namespace of controller NAME, by nsid."""
    ctrl = f"/sys/class/nvme/{name}"
    found: dict[str, tuple[Namespace, bool]] = {}
    for entry in sysfs.listdir(ctrl):
        match = _NS_NAME.fullmatch(entry)
        if not match:
            continue
        block = f"nvme{match.group(1)}n{match.group(2)}"
        nsid = (sysfs.read_int(f"/sys/block/{block}/nsid")
                or sysfs.read_int(f"{ctrl}/{entry}/nsid") or int(match.group(2)))
        found[block] = read_namespace(sysfs, block, nsid, usage)
    return sorted(found.values(), key=lambda item: item[0].nsid)


def read_namespace(sysfs: SysFS, block: str, nsid: int, usage: BlockUsage) -> tuple[Namespace, bool]:
    base = f"/sys/block/{block}"
    uses = usage.disk_uses(block)
    namespace = Namespace(name=block, nsid=nsid, size_bytes=sysfs.read_int(f"{base}/size", 0) * 512,
                          partitions=usage.partitions(block),
                          in_use=tuple(why for why, _ in uses),
                          scheduler=bracketed(sysfs.read(f"{base}/queue/scheduler", "", optional=True)))
    return namespace, any(root for _, root in uses)


# --- RDMA NICs and the rest ---------------------------------------------------

def read_rdma_nics(sysfs: SysFS) -> tuple[RdmaNic, ...]:
    nics = []
    for name in sysfs.listdir(INFINIBAND):
        dev = f"{INFINIBAND}/{name}/device"
        pci = sysfs.resolve(dev)
        netdevs = tuple(NetDev(n, sysfs.read_int(f"{dev}/net/{n}/mtu", 0, optional=True))
                        for n in sysfs.listdir(f"{dev}/net"))
        nics.append(RdmaNic(name, posixpath.basename(pci) if pci else "",
                            sysfs.read_int(f"{dev}/numa_node", -1), netdevs))
    return tuple(nics)


def irqbalance_running(sysfs: SysFS) -> bool:
    return any(sysfs.read(f"/proc/{pid}/comm", optional=True) == "irqbalance"
               for pid in sysfs.listdir("/proc") if pid.isdigit())


def block_sources(host: Host) -> list[tuple[str, int, tuple[str, ...]]]:
    """Every block device the planner would consider as a <vstor:block>
    source, as (path, bytes, why vstor would not take it: what it stacks on
    and what the host uses it for; empty when vstor would take it), in the
    planner's order: an NVMe namespace by its controller's reading, any
    other disk or partition by the host model's.  Loop, nbd, ublk, RAM and
    multipath path devices are never block sources, nor is what stacks on
    one (host.model.unservable)."""
    out, seen = [], set()
    for ctrl in host.controllers:
        for ns in ctrl.namespaces:
            seen.add(ns.name)
            out.append((f"/dev/{ns.name}", ns.size_bytes, tuple(ns.in_use)))
    for dev in host.block_devices:
        if dev.name not in seen:
            stack = (stacked_on(dev.stacks_on),) if dev.stacks_on else ()
            out.append((f"/dev/{dev.name}", dev.size_bytes, stack + tuple(dev.in_use)))
    return out


def block_source_lines(host: Host) -> list[str]:
    """`vstor host show`'s lines for block_sources."""
    rows = block_sources(host)
    free = [f"{p} ({size // 10**9} GB)" for p, size, use in rows if not use]
    lines = [f"  block sources vstor would take: {', '.join(free) or 'none'}"]
    lines += [f"    not {p}: {'; '.join(use)}" for p, _, use in rows if use]
    return lines + ["    (never a loop, nbd, ublk or RAM device or what stacks on one, nor a multipath "
                    "path device: serve a loop's file as <vstor:file>)"]
