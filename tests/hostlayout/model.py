"""The layout's schema and the values the writers share.

`Build` holds the layout being written, the tree it is written to, and what
earlier steps made (CPUs, PCI functions, block devices, mounts) that later
steps refer to.
"""

from __future__ import annotations

import itertools
import os
import re
import tomllib
from dataclasses import dataclass, field

from vstor.errors import BadInput

from .tree import Tree

TOP_KEYS = {"hostname", "cmdline", "smt", "numa", "iommu", "vfio", "thp", "irqbalance",
            "isolated", "node", "nvme", "pci", "rdma", "disk", "volume"}
USE_KEYS = {"mount", "swap", "fs", "source"}
KEYS = {
    "node": {"id", "cores", "package", "memory", "hugepages"},
    "pci": {"address", "class", "vendor", "device", "driver", "node", "iommu_group", "port",
            "irqs", "netdevs"},
    "nvme": {"address", "vendor", "device", "driver", "node", "iommu_group", "port", "irqs",
             "name", "model", "serial", "multipath", "namespace", "sriov", "vfs"},
    "rdma": {"name", "address", "class", "vendor", "device", "driver", "node", "iommu_group",
             "port", "netdevs"},
    "namespace": {"size", "nsid", "scheduler", "partitions"} | USE_KEYS,
    "partition": {"size"} | USE_KEYS,
    "disk": {"name", "size", "pci", "scheduler", "partitions", "backing"} | USE_KEYS,
    "volume": {"name", "on", "size", "level", "partitions"} | USE_KEYS,
}
DEFAULT_CMDLINE = "BOOT_IMAGE=/boot/vmlinuz-6.1.0-18-amd64 ro quiet"


def load_layout(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BadInput(f"cannot read host layout {path}: {e}") from e


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


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BadInput(f"unknown key(s) {', '.join(unknown)} in {where}",
                       hint=f"known: {', '.join(sorted(allowed))}")


def pci_address(text: str) -> str:
    address = text.lower() if text.count(":") == 2 else f"0000:{text.lower()}"
    if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]", address):
        raise BadInput(f"not a PCI address: {text!r} (e.g. '0000:5e:00.0')")
    return address


def nodes_of(layout: dict, numa: bool) -> list[dict]:
    """The [[node]] tables, checked, each with its id filled in."""
    nodes = layout.get("node") or [{"cores": 1}]
    for i, node in enumerate(nodes):
        check_keys(node, KEYS["node"], f"node {i}")
        if "cores" not in node:
            raise BadInput(f"node {i} needs 'cores'")
        node.setdefault("id", i)
    if not numa and len(nodes) > 1:
        raise BadInput("numa = false describes a host with one node")
    return nodes


@dataclass
class Pci:
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
    sriov: int = 0              # sriov_totalvfs: an SR-IOV capable function
    vfs: list = field(default_factory=list)     # its enabled virtual functions' addresses
    pf: str | None = None       # a virtual function's physical function

    @property
    def is_bridge(self) -> bool:
        return self.pci_class.startswith("0x0604")


@dataclass
class Block:
    path: str
    devnum: str
    size: int
    source: str


@dataclass
class Cpu:
    node: int
    package: int
    core: int
    siblings: tuple[int, ...]


class Build:
    """The layout, and what the writers have made so far."""

    def __init__(self, layout: dict, tree: Tree):
        self.layout, self.t = layout, tree
        self.numa = layout.get("numa", True)
        self.iommu = layout.get("iommu", True)
        self.nodes = nodes_of(layout, self.numa)
        self.cpus: dict[int, Cpu] = {}
        self.pci: dict[str, Pci] = {}
        self.blocks: dict[str, Block] = {}
        self.mounts: list[tuple[str, str, str, str]] = []   # mountpoint, devnum, fs, source
        self.swaps: list[tuple[str, int]] = []
        self.irq = itertools.count(120)
        self.blkext = itertools.count(0)     # 259:N, shared by NVMe namespaces and partitions
        self.dm = itertools.count(0)

    @property
    def cmdline(self) -> str:
        return self.layout.get("cmdline", DEFAULT_CMDLINE)

    def node_cpus(self, node: int) -> list[int]:
        if node < 0:
            return sorted(self.cpus)
        return sorted(c for c, cpu in self.cpus.items() if cpu.node == node)
