"""Guests with several NUMA cells.

A VM whose disks sit on devices of several host nodes gets one guest cell
per node (`<vstor:vm cells>`: unset means so, 'spread' always, a number
exactly that many): each cell's vCPUs pinned to whole cores of its node,
its memory and hugepages bound there, each disk in the cell of its
device's node, its SPDK reactor on that node, and in the guest behind a PCI
expander bus of that cell (vstor.render), so the guest's kernel knows
where each disk is.  A migration's arriving domain keeps its cells (the
guest's ABI): only the host nodes under them may change.

Pure, like the rest of the planner.
"""

from __future__ import annotations

from collections import ChainMap, Counter

from vstor.errors import BadInput
from vstor.host.model import format_cpulist
from vstor.meta.intent import MAX_CELLS
from vstor.meta.plan import CellPlan
from vstor.planner.disks import NoFit
from vstor.planner.placement import (CpuPlacement, counted, place_cpus, place_hugepages, place_memory,
                                     place_reactor, ranked_nodes)
from vstor.records import record


@record
class Layout:
    """The guest's cells before any host node is chosen: how many, each
    one's vCPUs and memory, and which disk sits in which."""
    vcpus: tuple[tuple[int, ...], ...]          # per cell, guest vCPU ids
    memory_kib: tuple[int, ...]                 # per cell
    disk_cell: tuple[tuple[str, int], ...]      # (target, cell)
    nodes: tuple[int | None, ...]               # per cell, the node its disks' devices need

    @property
    def count(self) -> int:
        return len(self.vcpus)


def count(req, choices, page_kib: int | None = None) -> int:
    """How many guest cells the domain gets (1: the one-node plan)."""
    vm = req.intent.vm
    explicit = [d.cell for d in req.intent.disks if d.cell is not None]
    if vm.cpus == "external":
        if vm.cells not in (None, "one", "1") or explicit:
            raise BadInput(f"{req.who}: guest NUMA cells of a Nova instance are its flavor's "
                           "(hw:numa_nodes), not vstor's", hint="leave cells and cell unset")
        return 1        # Nova's flavor makes its cells, and Nova's XML keeps them
    if req.fixed_cells:
        return len(req.fixed_cells)
    nodes = len({c.node for c in choices if c.node is not None})
    if vm.cells is None:
        if vm.numa == "none" and not explicit:
            return 1            # an unbound guest is on no node
        n = max(nodes if nodes > 1 else 1, max(explicit, default=0) + 1)
        if not explicit and (req.vcpus < n or req.memory_kib // (page_kib or 1024) < n):
            return 1            # unset: vstor's choice, and this guest cannot be split
    elif vm.cells == "spread":
        n = max(nodes, 1, max(explicit, default=0) + 1)
    else:
        n = 1 if vm.cells == "one" else int(vm.cells)
    if explicit and max(explicit) >= n:
        raise BadInput(f"{req.who}: a disk is in guest cell {max(explicit)}; the guest has "
                       f"{n} cell{'s' if n != 1 else ''}", hint=f"use cells='{max(explicit) + 1}', "
                       "or leave cells unset")
    if n == 1:
        return 1
    if vm.numa == "none":
        raise BadInput(f"{req.who}: {n} guest NUMA cells with numa='none': a cell is bound "
                       "to a host node", hint="use numa='strict' or 'preferred', or cells='one'")
    if n > MAX_CELLS:
        raise BadInput(f"{req.who}: the disks are on {n} host nodes; vstor gives a guest at "
                       f"most {MAX_CELLS} cells", hint="use cells='one'")
    return n


def layout(req, choices, n: int, page_kib: int | None) -> Layout:
    """Cells, their vCPUs and memory split evenly (the first cells take the
    remainders) or as a migration's arriving domain has them, and each
    disk's cell; BadInput for what cannot be split."""
    if req.fixed_cells:
        vcpus = tuple(c.vcpus for c in req.fixed_cells)
        memory = tuple(c.memory_kib for c in req.fixed_cells)
        fixed = dict(req.fixed_disk_cells)
        cell = {c.disk.target: fixed.get(c.disk.target, fixed.get(c.controller, 0) if c.mode ==
                                         "passthrough" else 0) for c in choices}
        for k, kib in enumerate(memory):
            if page_kib and kib % page_kib:
                raise BadInput(f"{req.who}: guest cell {k} has {kib} KiB, not a whole number of "
                               f"{page_kib} KiB hugepages", hint="migrate a domain as vstor rendered it")
    else:
        vcpus, memory = _split(req, n, page_kib)
        cell = {c.disk.target: c.disk.cell for c in choices if c.disk.cell is not None}
    nodes: list[int | None] = [None] * n
    strict = req.intent.vm.numa == "strict" and not req.fixed_cells
    for c in choices:
        k = cell.get(c.disk.target)
        if k is None:
            continue
        if k >= n:
            raise BadInput(f"{req.who}: disk {c.disk.target} is in guest cell {k}; the guest has "
                           f"cells 0-{n - 1}", hint=f"use cell='0'..'{n - 1}', or cells='{k + 1}'")
        if c.node is None:
            continue
        if nodes[k] is None:
            nodes[k] = c.node
        elif nodes[k] != c.node and strict:
            raise BadInput(f"{req.who}: guest cell {k} cannot be on host node {nodes[k]} and on "
                           f"node {c.node} ({c.node_from}, disk {c.disk.target}) with numa='strict'",
                           hint="put the disk in another cell, or use numa='preferred'")
    for c in choices:
        if c.disk.target in cell or c.node is None:
            continue
        k = next((i for i, node in enumerate(nodes) if node == c.node), None)
        if k is None:
            k = next((i for i, node in enumerate(nodes) if node is None), None)
        if k is None and strict:
            raise BadInput(f"{req.who}: disk {c.disk.target} is on node {c.node} ({c.node_from}) "
                           f"and none of its {n} guest cells is there (numa='strict')",
                           hint="give it more cells, or set the disk's cell and use numa='preferred'")
        k = 0 if k is None else k
        nodes[k] = c.node if nodes[k] is None else nodes[k]
        cell[c.disk.target] = k
    disk_cell = tuple((c.disk.target, cell.get(c.disk.target, 0)) for c in choices)
    return Layout(tuple(vcpus), tuple(memory), disk_cell, tuple(nodes))


def _split(req, n: int, page_kib: int | None):
    if req.vcpus < n:
        raise BadInput(f"{req.who} has {req.vcpus} vCPU{'s' if req.vcpus != 1 else ''} for "
                       f"{n} guest NUMA cells: each cell needs one", hint=f"give it {n} vCPUs, or cells='one'")
    unit = page_kib or 1024
    units, rest = divmod(req.memory_kib, unit)
    if units < n:
        raise BadInput(f"{req.who}: {req.memory_kib} KiB cannot be split into {n} cells of "
                       f"whole {unit} KiB units", hint="give it more memory, or cells='one'")
    vcpus, memory, at = [], [], 0
    for i in range(n):
        k = req.vcpus // n + (i < req.vcpus % n)
        vcpus.append(tuple(range(at, at + k)))
        at += k
        memory.append((units // n + (i < units % n)) * unit + (rest if i == 0 else 0))
    return vcpus, memory


class _Taken:
    """The ledger plus what the cells placed so far hold: cells may share a
    host node, and no core or page is given twice."""

    def __init__(self, ledger):
        self.base = ledger
        self.cpu_owner = ChainMap({}, ledger.cpu_owner)
        self.reactor_load = Counter(ledger.reactor_load)
        self._pages: Counter = Counter()
        self._bound: Counter = Counter()

    def take(self, domain: str, cpus, node: int, page_kib, pages: int, bound_kib: int) -> None:
        for cpu in cpus:
            self.cpu_owner.maps[0][cpu] = domain
        self._pages[(node, page_kib)] += pages
        self._bound[node] += bound_kib

    def promised_hugepages(self, node: int, size_kib: int) -> int:
        return self.base.promised_hugepages(node, size_kib) + self._pages[(node, size_kib)]

    def running(self, domain: str) -> bool | None:
        return self.base.running(domain)

    def bound_memory_kib(self, node: int) -> int:
        return self.base.bound_memory_kib(node) + self._bound[node]


def place(host, cfg, req, choices, ledger, lay: Layout, page_kib, grow):
    """Each cell placed on its node (a cell no device ties to a node: the
    freest, nodes no other cell has first); (cells, cpus, reactors, reasons)
    or NoFit naming the cell."""
    vm = req.intent.vm
    taken = _Taken(ledger)
    cells, pins, reserved, shared, emulator, reasons = [], [], set(), set(), set(), []
    for k in range(lay.count):
        ranked = [n.id for n in ranked_nodes(host, cfg, taken)]    # as the cells before left them
        wanted = lay.nodes[k]
        if wanted is None:
            used = {c.node for c in cells} | {n for n in lay.nodes if n is not None}
            tries = [n for n in ranked if n not in used] + ranked
            why = "no device ties it to a node; the freest"
        else:
            tries = [wanted] + ([] if vm.numa == "strict" else [n for n in ranked if n != wanted])
            why = "where its disks' devices are"
        failures = []
        for node_id in dict.fromkeys(tries):
            got = _place_cell(host, cfg, req, taken, k, node_id, lay, page_kib, grow)
            if isinstance(got, NoFit):
                failures.append(got.reason)
                continue
            cell, cpus = got
            break
        else:
            return NoFit(f"guest cell {k} ({counted(len(lay.vcpus[k]), 'vCPU')}, "
                         f"{lay.memory_kib[k] // 1024} MiB): {failures[0]}")
        if cell.node != wanted and wanted is not None:
            why = f"node {wanted}, where its disks' devices are, has no room (numa='{vm.numa}')"
        cells.append(cell)
        pins += cpus.vcpu_pins
        reserved.update(cpus.reserved)
        shared.update(cpus.shared)
        emulator.update(cpus.emulator)
        reasons.append(f"guest cell {k}: vCPUs {format_cpulist(cell.vcpus)} and "
                       f"{cell.memory_kib // 1024} MiB on host node {cell.node} ({why})")
        reasons += cpus.reasons
    cpus = CpuPlacement(tuple(pins), tuple(sorted(reserved)), tuple(sorted(shared)),
                        tuple(sorted(emulator)), ())
    reactors = {}
    node_of = dict(lay.disk_cell)
    for c in choices:
        if c.backend != "spdk":
            continue
        cell = cells[node_of[c.disk.target]]
        picked = place_reactor(cfg, host.node(cell.node), vm.numa == "strict", taken.reactor_load)
        if isinstance(picked, NoFit):
            return NoFit(f"disk {c.disk.target} in guest cell {cell.id}: {picked.reason}")
        reactors[c.disk.target] = picked
        taken.reactor_load[picked[0]] += 1
    return tuple(cells), cpus, reactors, tuple(reasons)


def _place_cell(host, cfg, req, taken: _Taken, k: int, node_id: int, lay: Layout, page_kib, grow):
    vcpus, memory = lay.vcpus[k], lay.memory_kib[k]
    got = place_node(host, cfg, req, node_id, len(vcpus), memory, taken, page_kib, grow)
    if isinstance(got, NoFit):
        return got
    cpus, pages = got
    taken.take(req.name, cpus.vcpu_pins + cpus.reserved, node_id, page_kib, pages,
               0 if page_kib else memory)
    return CellPlan(k, node_id, vcpus, memory, pages, cpus.emulator), cpus


def place_node(host, cfg, req, node_id: int, vcpus: int, memory_kib: int, ledger, page_kib, grow,
               bind: bool = True):
    """vCPUs and memory (hugepages from the node's pool, or ordinary memory
    bound there when `bind`) on one host node: (CpuPlacement, pages) or NoFit.
    A one-node guest's whole placement, or one cell's."""
    node = host.node(node_id)
    if node is None:
        return NoFit(f"node {node_id} is not online on this host")
    cpus = place_cpus(host, cfg, node, vcpus, req.intent.vm.cpus, ledger)
    if isinstance(cpus, NoFit):
        return cpus
    if page_kib and req.hugepage_nodes is not None and node_id >= req.hugepage_nodes:
        return NoFit(f"node {node_id}: {req.who}'s platform binds hugepages only on host nodes "
                     f"0-{req.hugepage_nodes - 1} (Proxmox's qemu-server, hugepages_topology)")
    if page_kib:
        pages = place_hugepages(node, page_kib, memory_kib, ledger, grow)
        return pages if isinstance(pages, NoFit) else (cpus, pages)
    short = place_memory(cfg, node, memory_kib, ledger) if bind else None
    return short or (cpus, 0)
