"""The start check of a plan with several guest cells (vstor.planner.fit
asks it): the cells are the ones the planner makes from this metadata
(their number, vCPUs, memory and disks), each on a node that is online and
that its disks' devices allow, and each cell's CPUs, memory and hugepages
still free there, taken by the placement code's own pools.
"""

from __future__ import annotations

from vstor.errors import BadInput
from vstor.host.model import format_cpulist
from vstor.meta.plan import Plan
from vstor.planner import cells
from vstor.planner.disks import NoFit
from vstor.planner.placement import cpu_problems, place_cpus, place_hugepages, place_memory


def problems(host, cfg, req, plan: Plan, choices, running, page_kib, grow) -> list[str]:
    try:
        lay = cells.layout(req, choices, len(plan.cells), page_kib)
    except BadInput as e:
        return [e.message]
    have = (tuple(c.vcpus for c in plan.cells), tuple(c.memory_kib for c in plan.cells),
            tuple(sorted((d.target, d.cell) for d in plan.disks)))
    want = (lay.vcpus, lay.memory_kib, tuple(sorted(lay.disk_cell)))
    if [c.id for c in plan.cells] != list(range(len(plan.cells))) or have != want:
        return [f"the plan's {len(plan.cells)} guest cells (vCPUs, memory or disks) are not "
                "the ones the metadata gives now"]
    out = []
    for c, node in zip(plan.cells, lay.nodes):
        if host.node(c.node) is None:
            out.append(f"guest cell {c.id}: host node {c.node} is not online on this host")
        elif node is not None and node != c.node and plan.numa == "strict":
            out.append(f"guest cell {c.id} is on host node {c.node}; its disks' devices are on "
                       f"node {node} now (numa='strict')")
    if out:
        return out
    taken = cells._Taken(running)
    pins = iter(plan.vcpu_pins)
    emulator: set[int] = set()
    for c in plan.cells:
        node = host.node(c.node)
        mine = tuple(next(pins) for _ in c.vcpus) if plan.vcpu_pins else ()
        near = tuple(x for x in plan.reserved if x in node.cpus and x not in taken.cpu_owner.maps[0])
        why = cpu_problems(host, cfg, node, mine + near, taken) if mine else []
        if why:
            return [f"guest cell {c.id}: {w}" for w in why]
        placed = place_cpus(host, cfg, node, len(c.vcpus), plan.cpus, taken,
                            only=frozenset(mine + near) if mine else None)
        if isinstance(placed, NoFit):
            return [f"guest cell {c.id}: {placed.reason}"]
        if placed.vcpu_pins != mine:
            return [f"guest cell {c.id}: pins {format_cpulist(mine)} are not a placement vstor "
                    f"makes on node {c.node} (it would pin {format_cpulist(placed.vcpu_pins)})"]
        if placed.emulator != c.emulator:
            return [f"guest cell {c.id}: the plan runs its daemons on {format_cpulist(c.emulator)}, "
                    f"node {c.node}'s housekeeping cores are {format_cpulist(placed.emulator)}"]
        emulator.update(placed.emulator)
        short = _memory(cfg, plan, c, node, taken, page_kib, grow)
        if short:
            return [f"guest cell {c.id}: {short}"]
        taken.take(plan.domain, placed.vcpu_pins + placed.reserved, c.node, page_kib, c.hugepages,
                   0 if page_kib else c.memory_kib)
    if tuple(sorted(emulator)) != plan.emulator:
        out.append(f"the plan's emulator CPUs {format_cpulist(plan.emulator)} are not its cells' "
                   f"housekeeping cores {format_cpulist(emulator)}")
    return out


def _memory(cfg, plan: Plan, c, node, taken, page_kib, grow) -> str | None:
    if not page_kib:
        if c.hugepages:
            return f"the plan holds {c.hugepages} hugepages without a size"
        short = place_memory(cfg, node, c.memory_kib, taken)
        return short.reason if short else None
    pages = place_hugepages(node, page_kib, c.memory_kib, taken, grow)
    if isinstance(pages, NoFit):
        return pages.reason
    return None if pages == c.hugepages else f"the plan has {c.hugepages} hugepages, the cell needs {pages}"
