"""Build the tree: check the layout, then run the writers in dependency order."""

from __future__ import annotations

import os

from .block import write_controllers, write_disks, write_volumes
from .cpus import write_cpus, write_memory
from .kernel import write_kernel, write_procfs
from .model import TOP_KEYS, Build, check_keys, load_layout
from .pci import collect_pci, write_pci, write_rdma
from .tree import Tree


def build_tree(layout: dict | str | os.PathLike, root: str | os.PathLike) -> str:
    """Write the tree LAYOUT (a dict, or a TOML file) describes under ROOT; returns ROOT."""
    if not isinstance(layout, dict):
        layout = load_layout(layout)
    check_keys(layout, TOP_KEYS, "layout")
    root = os.path.abspath(root)
    b = Build(layout, Tree(root))
    # CPUs first: PCI local_cpus and NVMe vector counts depend on them. Block
    # devices hang off PCI paths; volumes stack on the disks and partitions
    # written before them; procfs lists the mounts and swaps all of them declared.
    write_cpus(b)
    write_memory(b)
    collect_pci(b)
    write_pci(b)
    write_controllers(b)
    write_disks(b)
    write_volumes(b)
    write_rdma(b)
    write_kernel(b)
    write_procfs(b)
    return root
