"""Is a recorded plan still good on the host as it is now?  Asked at
`prepare`, just before anything changes: the host may have moved on since the
domain was planned (a disk mounted, hugepages taken, cores handed to a VM
that runs now, a namespace renamed).

Not a second implementation: the disks are chosen again by the planner's own
code with the recorded decisions pinned, the CPUs, hugepages and reactors
checked by the placement code's own pools, and everything the plan derived
(sockets, SPDK names and attach parameters, the bind, the block device)
derived again and compared.  A plan that was made for other metadata is
refused before any of that.
"""

from __future__ import annotations

from itertools import islice

from vstor import records
from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, format_cpulist
from vstor.meta.metadata import digest
from vstor.meta.names import migration_subnqn
from vstor.meta.plan import Plan
from vstor.planner import Request, cells, check_request, disk_plan, grow_pool, page_size
from vstor.planner.cells import candidate_nodes
from vstor.planner.disks import NoFit, choose_all
from vstor.planner.ledger import Ledger, Overlay
from vstor.planner.spdk_paths import attach_paths
from vstor.planner.placement import (cpu_problems, place_cpus, place_hugepages, place_memory,
                                     reactor_candidates)

_MODES = {("passthrough", "vfio"), ("vhost", "spdk"), ("vhost", "qsd")}


def check_made_for(plan: Plan, req: Request) -> None:
    """BadInput unless `plan` was made for this domain's metadata and size."""
    check_request(req)
    fix = f"run {req.fix}"
    if plan.digest != digest(req.intent):
        raise BadInput(f"{req.who}: the vstor metadata changed since the plan was made",
                       hint=fix)
    if (plan.vcpus, plan.memory_kib) != (req.vcpus, req.memory_kib):
        raise BadInput(f"{req.who} has {req.vcpus} vCPUs and {req.memory_kib} KiB now; "
                       f"the plan was made for {plan.vcpus} and {plan.memory_kib} KiB", hint=fix)
    vm = req.intent.vm
    if (plan.numa, plan.cpus, plan.migratable) != (vm.numa, vm.cpus, vm.migratable):
        raise BadInput(f"{req.who}: the plan's numa/cpus/migratable "
                       f"({plan.numa}/{plan.cpus}/{plan.migratable}) are not the metadata's", hint=fix)


def problems(host: Host, cfg: Config, req: Request, plan: Plan, running: Ledger) -> list[str]:
    """One line per reason the plan cannot be carried out now; [] when it can.
    `running` holds what the other running vstor domains have."""
    taken = Overlay(running.without(plan.domain, plan.uuid))
    choices = _choices(host, cfg, req, plan, taken)
    if isinstance(choices, str):
        return [choices]
    out = _disks(cfg, req, plan, choices, taken)
    out += _node(host, cfg, req, plan, choices, taken)
    if out:
        return out
    if not plan.cells and len(req.fixed_cells) > 1:
        return [f"the domain's XML gives the guest {len(req.fixed_cells)} NUMA cells, its plan one"]
    return _cells(host, cfg, req, plan, choices, taken) + _reactors(host, cfg, plan)


def _choices(host, cfg, req: Request, plan: Plan, running: Ledger):
    """The planner's disk choices again, with what the plan chose pinned
    where the intent left the choice to vstor; or why not."""
    planned = {d.target: d for d in plan.disks}
    if set(planned) != {d.target for d in req.intent.disks}:
        return "the plan's disks are not the metadata's disks"
    # A local NVMe disk the plan serves from NVMe-oF arrived by migration
    # from the host that exports it (no more than the metadata could ask).
    req = records.replace(req, imports=tuple(
        (d.target, planned[d.target].source) for d in req.intent.disks
        if d.source.kind == "nvme" and planned[d.target].source.kind == "nvmf"
        and planned[d.target].source.subnqn == migration_subnqn(req.safe_name, d.target)))
    pinned = []
    for d in req.disks():
        was = planned[d.target]
        if (was.mode, was.backend) not in _MODES:
            return f"{d.target}: the plan has mode {was.mode} with backend {was.backend}"
        pinned.append(records.replace(
            d, mode=was.mode if d.mode == "auto" else d.mode,
            backend=(was.backend if d.backend == "auto" else d.backend) if was.mode == "vhost" else d.backend))
    try:
        choices = choose_all(host, cfg, req.intent.vm, tuple(pinned), running)
    except BadInput as e:
        return e.message
    return choices.reason if isinstance(choices, NoFit) else choices


def _disks(cfg, req: Request, plan: Plan, choices, running: Ledger) -> list[str]:
    planned = {d.target: d for d in plan.disks}
    out = []
    for c in choices:
        was = planned[c.disk.target]
        if default_hostnqn(was):    # recorded before vstor always named one: as it was (advice)
            c = records.replace(c, attach=attach_paths(cfg, c.disk.source))
        now = disk_plan(cfg, req, c, None)
        for f in records.fields(now):
            if f.name not in ("reactor", "reasons", "cell") and getattr(now, f.name) != getattr(was, f.name):
                out.append(f"{was.target}: the plan has {f.name} {_show(getattr(was, f.name))}, "
                           f"the metadata, host and config now give {_show(getattr(now, f.name))}")
        if was.cell is not None and not plan.cells:
            out.append(f"{was.target}: the plan puts it in guest cell {was.cell} of a guest "
                       "with one cell")
        if was.socket and was.socket in running.sockets:
            out.append(f"{was.target}: socket {was.socket} belongs to running domain "
                       f"'{running.sockets[was.socket]}'")
    return out


def advice(req: Request, plan: Plan) -> list[str]:
    """What the start check says without refusing: a remote disk whose plan
    was recorded before vstor always sent a host NQN attaches with SPDK's
    default one, as it did; re-planning records this host's."""
    return [f"{d.target}: attaches with SPDK's default host NQN, which SPDK makes anew at every "
            f"start of its app (no target can be told to allow it); run {req.fix} to plan it with "
            "this host's NQN" for d in plan.disks if default_hostnqn(d)]


def default_hostnqn(d) -> bool:
    return d.source.kind == "nvmf" and any(p.hostnqn is None for p in d.attach)


def _show(value) -> str:
    if isinstance(value, tuple):
        return "; ".join(_show(v) for v in value) or "none"
    if hasattr(value, "params"):
        return " ".join(f"{k}={v}" for k, v in value.params("").items() if k != "name")
    if hasattr(value, "kind"):
        return f"{value.kind} " + " ".join(f"{k}={v}" for k, v in vars(value).items()
                                          if v not in (None, ()) and not isinstance(v, tuple))
    return "none" if value is None else str(value)


def _node(host, cfg, req: Request, plan: Plan, choices, running: Ledger) -> list[str]:
    if not plan.cells and (plan.node is None or host.node(plan.node) is None):   # cells: cellfit
        return [f"NUMA node {plan.node} is not online on this host"]
    nodes = [n for n, _why in candidate_nodes(host, cfg, req, choices, running)]
    if not plan.cells and plan.node not in nodes:
        return [f"the plan puts the VM on node {plan.node}; the planner's nodes for it are "
                f"{', '.join(map(str, nodes)) or 'none'}"]
    viommu = any(c.mode == "passthrough" and c.disk.guest == "spdk" for c in choices)
    if plan.viommu != viommu:
        return [f"the plan has viommu {plan.viommu}, the disks need {viommu}"]
    return []


def _layout(host, req: Request, plan: Plan, choices, page_kib) -> list[str]:
    """Several cells: the ones the planner makes from this metadata (their
    number, vCPUs, memory and disks), each on a node that is online and
    that its disks' devices allow."""
    try:
        want, disk_cell = cells.layout(req, choices, len(plan.cells), page_kib)
    except BadInput as e:
        return [e.message]
    have = [(c.id, c.vcpus, c.memory_kib) for c in plan.cells]
    if (have != [(c.id, c.vcpus, c.memory_kib) for c in want]
            or {d.target: d.cell for d in plan.disks} != disk_cell):
        return [f"the plan's {len(plan.cells)} guest cells (vCPUs, memory or disks) are not "
                "the ones the metadata gives now"]
    out = []
    for c, node in zip(plan.cells, (w.node for w in want)):
        if host.node(c.node) is None:
            out.append(f"guest cell {c.id}: host node {c.node} is not online on this host")
        elif node is not None and node != c.node and plan.numa == "strict":
            out.append(f"guest cell {c.id} is on host node {c.node}; its disks' devices are on "
                       f"node {node} now (numa='strict')")
    return out


def _cells(host: Host, cfg: Config, req: Request, plan: Plan, choices, taken: Overlay) -> list[str]:
    """Each guest cell's CPUs, memory and hugepages still free on its node,
    taken by the placement code's own pools, cell after cell (a one-node
    guest's one cell is the plan's own fields)."""
    page_kib = page_size(req, choices)
    wrong_size = [] if plan.hugepage_kib == page_kib else [
        f"the plan has {plan.hugepage_kib or 'no'} KiB hugepages, the metadata and disks ask for "
        f"{page_kib or 'none'}"]
    several = bool(plan.cells)
    if several:
        out = wrong_size or _layout(host, req, plan, choices, page_kib)
        if out:
            return out
    pins = iter(plan.vcpu_pins)
    emulator: set[int] = set()
    for c in plan.guest_cells():
        node = host.node(c.node)
        mine = tuple(islice(pins, len(c.vcpus)))       # a forged plan may have fewer
        placed = _cpus(host, cfg, plan, c, node, mine, taken, several)
        out = placed if isinstance(placed, list) else []
        out += wrong_size or _memory(cfg, req, plan, c, node, taken, page_kib, several)
        if out:
            return [f"guest cell {c.id}: {line}" for line in out] if several else out
        emulator.update(placed.emulator)
        taken.take_node(plan.domain, placed.vcpu_pins + placed.reserved, c.node, page_kib, c.hugepages,
                        0 if page_kib else c.memory_kib)
    if several and tuple(sorted(emulator)) != plan.emulator:
        return [f"the plan's emulator CPUs {format_cpulist(plan.emulator)} are not its cells' "
                f"housekeeping cores {format_cpulist(emulator)}"]
    return []


def _cpus(host: Host, cfg: Config, plan: Plan, cell, node, mine, taken: Overlay, several: bool):
    """The placement `place_cpus` makes from the cell's own CPUs (its pins
    and the idle siblings beside them) must be the plan's: that placement,
    or the lines that say why not."""
    near = (tuple(x for x in plan.reserved if x in node.cpus and x not in taken.own_cpus)
            if several else plan.reserved)
    wanted = frozenset(mine + near)
    out = cpu_problems(host, cfg, node, wanted, taken) if wanted else []
    if out:
        return out
    placed = place_cpus(host, cfg, node, len(cell.vcpus), plan.cpus, taken, only=wanted)
    if isinstance(placed, NoFit):
        return [placed.reason]
    if several and placed.vcpu_pins != mine:
        return [f"pins {format_cpulist(mine)} are not a placement vstor makes on node {cell.node} "
                f"(it would pin {format_cpulist(placed.vcpu_pins)})"]
    if several and placed.emulator != cell.emulator:
        return [f"the plan runs its daemons on {format_cpulist(cell.emulator)}, node {cell.node}'s "
                f"housekeeping cores are {format_cpulist(placed.emulator)}"]
    got = (placed.vcpu_pins, placed.reserved, placed.shared, placed.emulator)
    if not several and got != (plan.vcpu_pins, plan.reserved, plan.shared_cpus, plan.emulator):
        return [f"the plan's CPUs (pins {_show(plan.vcpu_pins)}, reserved {format_cpulist(plan.reserved)}, "
                f"shared {format_cpulist(plan.shared_cpus)}, emulator {format_cpulist(plan.emulator)}) "
                f"are not a placement vstor makes here (it would pin {_show(placed.vcpu_pins)}, "
                f"emulator on {format_cpulist(placed.emulator)})"]
    return placed


def _memory(cfg: Config, req: Request, plan: Plan, cell, node, taken: Overlay, page_kib,
            several: bool) -> list[str]:
    if not page_kib:
        if cell.hugepages:
            return [f"the plan holds {cell.hugepages} hugepages without a size"]
        short = place_memory(cfg, node, cell.memory_kib, taken) if plan.numa != "none" else None
        return [short.reason] if short else []
    pages = place_hugepages(node, page_kib, cell.memory_kib, taken, grow_pool(cfg, req))
    if isinstance(pages, NoFit):
        return [pages.reason]
    if pages != cell.hugepages:
        return [f"the plan has {cell.hugepages} hugepages, the {'cell' if several else 'memory'} "
                f"needs {pages}"]
    return []


def _reactors(host: Host, cfg: Config, plan: Plan) -> list[str]:
    """Each SPDK disk's reactor among the reactor cores of its cell's node."""
    out = []
    for d in plan.disks:
        if d.backend != "spdk":
            if d.reactor is not None:
                out.append(f"{d.target}: the plan gives a {d.backend} disk reactor core {d.reactor}")
            continue
        cell = plan.disk_cell(d)
        node = host.node(cell.node) if cell.node is not None else None
        found = reactor_candidates(cfg, node, plan.numa == "strict")
        if isinstance(found, NoFit):
            out.append(f"{d.target}: {found.reason}")
        elif d.reactor not in found[0]:
            out.append(f"{d.target}: reactor core {d.reactor} is not one of the SPDK reactor "
                       f"cores for node {cell.node} ([cpu] reactors: "
                       f"{format_cpulist(cfg.reactors) or 'none'})")
    return out


def pin_problems(host: Host, cfg: Config, plan: Plan, running: Ledger) -> list[str]:
    """Why a running domain's threads cannot be pinned again as its plan
    says (vstor repair): each core a vCPU or idle sibling is dedicated to
    must still be one the placement pools would give it (`cpu_problems`:
    online, on its cell's node, not housekeeping or a reactor, not held by
    another domain), and every other core the plan pins to (the emulator's,
    the shared vCPUs') the ones the placement gives a cell on its node
    (the start's own check, _cpus: its housekeeping cores), online.
    `running` holds what the other domains have."""
    taken = Overlay(running.without(plan.domain, plan.uuid))
    out: list[str] = []
    several = bool(plan.cells)
    pins = iter(plan.vcpu_pins if plan.cpus == "dedicated" else ())
    placed_emulator: set[int] = set()
    for c in plan.guest_cells():
        mine = tuple(islice(pins, len(c.vcpus)))
        node = host.node(c.node) if c.node is not None else None
        if node is None:
            cores = frozenset(mine) | frozenset(plan.reserved)
            outside = sorted(cores - {cpu.id for cpu in host.cpus})
            held = sorted(x for x in cores if x in taken.cpu_owner)
            out += [f"CPUs {format_cpulist(outside)} are not online on this host"] if outside else []
            out += [f"CPU {x} is held by domain {taken.cpu_owner[x]}" for x in held[:1]]
            continue
        placed = _cpus(host, cfg, plan, c, node, mine, taken, several)
        if isinstance(placed, list):
            out += [f"guest cell {c.id}: {line}" for line in placed] if several else placed
            continue
        placed_emulator.update(placed.emulator)
        taken.take_node(plan.domain, placed.vcpu_pins + placed.reserved, c.node, None, 0, 0)
    if several and not out and tuple(sorted(placed_emulator)) != plan.emulator:
        out.append(f"the plan's emulator CPUs {format_cpulist(plan.emulator)} are not its cells' "
                   f"housekeeping cores {format_cpulist(placed_emulator)}")
    vcpus, emulator = plan.thread_pins()
    floating = (set().union(*vcpus) if plan.cpus == "shared" and vcpus else set()) | set(emulator)
    outside = sorted(floating - {cpu.id for cpu in host.cpus})
    if outside:
        out.append(f"CPUs {format_cpulist(outside)} (emulator or shared vCPUs) are not online "
                   "on this host")
    return out
