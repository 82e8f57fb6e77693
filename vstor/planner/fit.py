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

from vstor import records
from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, format_cpulist
from vstor.meta.metadata import digest
from vstor.meta.names import migration_subnqn
from vstor.meta.plan import Plan
from vstor.planner import Request, candidate_nodes, cellfit, check_request, disk_plan, grow_pool, page_size
from vstor.planner.disks import NoFit, choose_all
from vstor.planner.ledger import Ledger
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
    running = running.without(plan.domain, plan.uuid)
    choices = _choices(host, cfg, req, plan, running)
    if isinstance(choices, str):
        return [choices]
    out = _disks(cfg, req, plan, choices, running)
    out += _node(host, cfg, req, plan, choices, running)
    if out:
        return out
    if not plan.cells and len(req.fixed_cells) > 1:
        return [f"the domain's XML gives the guest {len(req.fixed_cells)} NUMA cells, its plan one"]
    if plan.cells:
        page_kib = page_size(req, choices)
        if plan.hugepage_kib != page_kib:
            return [f"the plan has {plan.hugepage_kib or 'no'} KiB hugepages, the metadata and "
                    f"disks ask for {page_kib or 'none'}"]
        out += cellfit.problems(host, cfg, req, plan, choices, running, page_kib, grow_pool(cfg, req))
    else:
        node = host.node(plan.node)
        out += _cpus(host, cfg, req, plan, node, running)
        out += _memory(cfg, req, plan, node, choices, running)
    return out + _reactors(host, cfg, plan)


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


def _cpus(host: Host, cfg: Config, req: Request, plan: Plan, node, running: Ledger) -> list[str]:
    """The placement `place_cpus` makes from the plan's own CPUs must be the plan's."""
    wanted = plan.dedicated_cpus
    out = cpu_problems(host, cfg, node, wanted, running) if wanted else []
    if out:
        return out
    placed = place_cpus(host, cfg, node, req.vcpus, req.intent.vm.cpus, running, only=wanted)
    if isinstance(placed, NoFit):
        return [placed.reason]
    got = (placed.vcpu_pins, placed.reserved, placed.shared, placed.emulator)
    if got != (plan.vcpu_pins, plan.reserved, plan.shared_cpus, plan.emulator):
        return [f"the plan's CPUs (pins {_show(plan.vcpu_pins)}, reserved {format_cpulist(plan.reserved)}, "
                f"shared {format_cpulist(plan.shared_cpus)}, emulator {format_cpulist(plan.emulator)}) "
                f"are not a placement vstor makes here (it would pin {_show(placed.vcpu_pins)}, "
                f"emulator on {format_cpulist(placed.emulator)})"]
    return []


def _memory(cfg: Config, req: Request, plan: Plan, node, choices, running: Ledger) -> list[str]:
    page_kib = page_size(req, choices)
    if plan.hugepage_kib != page_kib:
        return [f"the plan has {plan.hugepage_kib or 'no'} KiB hugepages, the metadata and disks "
                f"ask for {page_kib or 'none'}"]
    if not page_kib:
        if plan.hugepages != 0:
            return [f"the plan holds {plan.hugepages} hugepages without a size"]
        short = place_memory(cfg, node, req.memory_kib, running) if plan.numa != "none" else None
        return [short.reason] if short else []
    pages = place_hugepages(node, page_kib, req.memory_kib, running, grow_pool(cfg, req))
    if isinstance(pages, NoFit):
        return [pages.reason]
    if pages != plan.hugepages:
        return [f"the plan has {plan.hugepages} hugepages, the memory needs {pages}"]
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
