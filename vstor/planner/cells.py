"""A guest's NUMA cells, and the one placement path that puts each on a
host node.  A one-node guest is a guest with one cell.

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

from collections import Counter

from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import format_cpulist
from vstor.meta.intent import MAX_CELLS
from vstor.meta.plan import CellPlan
from vstor.planner.disks import NoFit
from vstor.planner.ledger import Overlay
from vstor.planner.placement import (CpuPlacement, counted, place_cpus, place_hugepages, place_memory,
                                     place_reactor, ranked_nodes)
from vstor.records import replace


def count(req, choices, page_kib: int | None = None) -> int:
    """How many guest cells the domain gets (1: a one-node guest)."""
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


def layout(req, choices, n: int, page_kib: int | None):
    """The guest's cells before any host node is chosen, each with its
    vCPUs and memory split evenly (the first cells take the remainders) or
    as a migration's arriving domain has them, and `node` the host node its
    disks' devices need (None: no device ties it); and each disk's cell,
    {target: cell}.  BadInput for what cannot be split."""
    if n == 1:
        node = next((c.node for c in choices if c.node is not None), None)
        return ((CellPlan(0, node, tuple(range(req.vcpus)), req.memory_kib),),
                {c.disk.target: 0 for c in choices})
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
    return (tuple(CellPlan(k, nodes[k], tuple(vcpus[k]), memory[k]) for k in range(n)),
            {c.disk.target: cell.get(c.disk.target, 0) for c in choices})


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


def candidate_nodes(host, cfg, req, choices, ledger):
    """The nodes to try for a one-cell guest, best first, with why each is a
    candidate."""
    device = [(c.node, c.node_from) for c in choices if c.node is not None]
    if device:
        node, origin = device[0]
        yield node, f"node {node}: where {origin} is"
        if req.intent.vm.numa == "strict":
            return
    elif len(host.nodes) == 1:
        yield host.nodes[0].id, f"node {host.nodes[0].id}: the host's only node"
        return
    for n in ranked_nodes(host, cfg, ledger):
        if device and n.id == device[0][0]:
            continue
        yield n.id, (f"node {n.id}: the device's node has no room (numa='{req.intent.vm.numa}')"
                     if device else f"node {n.id}: no device ties the VM to a node; the freest")


def _cell_nodes(host, cfg, req, taken, cells, k: int, placed):
    """The nodes to try for cell k of several, best first, with why: its
    disks' devices' node, or the freest nodes no other cell has first."""
    ranked = [n.id for n in ranked_nodes(host, cfg, taken)]    # as the cells before left them
    wanted, numa = cells[k].node, req.intent.vm.numa
    if wanted is None:
        used = {c.node for c in placed} | {c.node for c in cells if c.node is not None}
        for node in dict.fromkeys([n for n in ranked if n not in used] + ranked):
            yield node, "no device ties it to a node; the freest"
        return
    yield wanted, "where its disks' devices are"
    if numa != "strict":
        for node in ranked:
            if node != wanted:
                yield node, f"node {wanted}, where its disks' devices are, has no room (numa='{numa}')"


def place(host, cfg, req, choices, taken: Overlay, cells, disk_cell: dict, page_kib, grow):
    """Each cell on a host node, in order: its vCPUs, memory and hugepages,
    and its SPDK disks' reactors, taken into `taken` (cells may share a
    node); (cells, cpus, reactors, reasons), or DoesNotFit naming what is
    short (the cell, when there are several)."""
    several = len(cells) > 1
    placed, pins, reserved, shared, emulator, reasons, reactors = [], [], [], [], [], [], {}
    for cell in cells:
        tries = (_cell_nodes(host, cfg, req, taken, cells, cell.id, placed) if several
                 else candidate_nodes(host, cfg, req, choices, taken))
        mine = [c for c in choices if c.backend == "spdk" and disk_cell[c.disk.target] == cell.id]
        failures = []
        for node_id, why in tries:
            got = _place_cell(host, cfg, req, taken, cell, node_id, mine, page_kib, grow, several)
            if not isinstance(got, NoFit):
                break
            failures.append(got.reason)
        else:
            where = (f"guest cell {cell.id} ({counted(len(cell.vcpus), 'vCPU')}, "
                     f"{cell.memory_kib // 1024} MiB): " if several else "")
            raise DoesNotFit(f"{req.who} does not fit: {where}{failures[0]}", reasons=tuple(failures))
        cell, cpus, picked = got
        placed.append(cell)
        pins += cpus.vcpu_pins
        reserved += cpus.reserved
        shared += cpus.shared
        emulator += cpus.emulator
        reactors.update(picked)
        if several:
            why = (f"guest cell {cell.id}: vCPUs {format_cpulist(cell.vcpus)} and "
                   f"{cell.memory_kib // 1024} MiB on host node {cell.node} ({why})")
        reasons += [why, *cpus.reasons]
    if several:
        cpus = CpuPlacement(tuple(pins), tuple(sorted(set(reserved))), tuple(sorted(set(shared))),
                            tuple(sorted(set(emulator))), ())
    return tuple(placed), cpus, reactors, tuple(reasons)


def _place_cell(host, cfg, req, taken: Overlay, cell, node_id: int, spdk, page_kib, grow, several):
    """One cell on one node: (the cell placed, its CpuPlacement, its SPDK
    disks' reactors), taken into `taken`; or NoFit."""
    bind = req.intent.vm.numa != "none"
    got = place_node(host, cfg, req, node_id, len(cell.vcpus), cell.memory_kib, taken, page_kib,
                     grow, bind=bind)
    if isinstance(got, NoFit):
        return got
    cpus, pages = got
    load, reactors = Counter(taken.reactor_load), {}
    for c in spdk:
        picked = place_reactor(cfg, host.node(node_id), req.intent.vm.numa == "strict", load)
        if isinstance(picked, NoFit):
            return NoFit(f"disk {c.disk.target}: {picked.reason}") if several else picked
        reactors[c.disk.target] = picked
        load[picked[0]] += 1
    taken.reactor_load = load
    taken.take_node(req.name, cpus.vcpu_pins + cpus.reserved, node_id, page_kib, pages,
                    cell.memory_kib if bind and not page_kib else 0)
    return replace(cell, node=node_id, hugepages=pages, emulator=cpus.emulator), cpus, reactors


def place_node(host, cfg, req, node_id: int, vcpus: int, memory_kib: int, ledger, page_kib, grow,
               bind: bool = True):
    """vCPUs and memory (hugepages from the node's pool, or ordinary memory
    bound there when `bind`) on one host node: (CpuPlacement, pages) or NoFit.
    One cell's (a one-node guest's one cell too)."""
    node = host.node(node_id)
    if node is None:
        return NoFit(f"node {node_id} is not online on this host")
    cpus = place_cpus(host, cfg, node, vcpus, req.intent.vm.cpus, ledger, pins_at=req.pins_at)
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
