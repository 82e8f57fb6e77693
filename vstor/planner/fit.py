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

import dataclasses

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, format_cpulist
from vstor.meta.metadata import digest
from vstor.meta.plan import Plan
from vstor.planner import Request, disk_plan
from vstor.planner.disks import NoFit, choose_all
from vstor.planner.ledger import Ledger
from vstor.planner.placement import cpu_problems, housekeeping, place_hugepages, reactor_candidates

# What the plan derived from a choice, compared field by field.
_DERIVED = ("controller", "device", "socket", "spdk_controller", "bdev", "attach", "source")


def check_made_for(plan: Plan, req: Request) -> None:
    """BadInput unless `plan` was made for this domain's metadata and size."""
    fix = f"run vstor apply {req.name}"
    if plan.digest != digest(req.intent):
        raise BadInput(f"domain '{req.name}': the vstor metadata changed since the plan was made",
                       hint=fix)
    if (plan.vcpus, plan.memory_kib) != (req.vcpus, req.memory_kib):
        raise BadInput(f"domain '{req.name}' has {req.vcpus} vCPUs and {req.memory_kib} KiB now; "
                       f"the plan was made for {plan.vcpus} and {plan.memory_kib} KiB", hint=fix)


def problems(host: Host, cfg: Config, req: Request, plan: Plan, running: Ledger) -> list[str]:
    """One line per reason the plan cannot be carried out now; [] when it can.
    `running` holds what the other running vstor domains have."""
    running = running.without(plan.domain, plan.uuid)
    out = _disks(host, cfg, req, plan, running)
    node = host.node(plan.node) if plan.node is not None else None
    if plan.node is not None and node is None:
        return out + [f"NUMA node {plan.node} is not online on this host"]
    out += _cpus(host, cfg, plan, node, running)
    out += _memory(plan, node, running)
    out += _reactors(cfg, plan, node)
    return out


def _disks(host, cfg, req: Request, plan: Plan, running: Ledger) -> list[str]:
    planned = {d.target: d for d in plan.disks}
    if set(planned) != {d.target for d in req.intent.disks}:
        return ["the plan's disks are not the metadata's disks"]
    pinned = tuple(dataclasses.replace(
        d, mode=planned[d.target].mode,
        backend=planned[d.target].backend if planned[d.target].mode == "vhost" else "auto")
        for d in req.intent.disks)
    try:
        choices = choose_all(host, cfg, req.intent.vm, pinned, running)
    except BadInput as e:
        return [e.message]
    if isinstance(choices, NoFit):
        return [choices.reason]
    out = []
    for c in choices:
        was = planned[c.disk.target]
        now = disk_plan(cfg, req, c, None)
        for name in _DERIVED:
            if getattr(now, name) != getattr(was, name):
                out.append(f"{was.target}: the plan has {name} {_show(getattr(was, name))}, "
                           f"the host and config now give {_show(getattr(now, name))}")
        if now.bind and not was.bind:
            out.append(f"{was.target}: controller {was.controller} is on the kernel's driver now; "
                       "the plan expected it on a userspace driver (SPDK's setup.sh)")
        if was.socket and was.socket in running.sockets:
            out.append(f"{was.target}: socket {was.socket} belongs to running domain "
                       f"'{running.sockets[was.socket]}'")
    return out


def _show(value) -> str:
    if isinstance(value, tuple):
        return "; ".join(str(v.params("")) if hasattr(v, "params") else str(v) for v in value) or "none"
    return "none" if value is None else str(value)


def _cpus(host: Host, cfg: Config, plan: Plan, node, running: Ledger) -> list[str]:
    online = {c.id for c in host.cpus}
    if node is not None and plan.dedicated_cpus:
        out = cpu_problems(host, cfg, node, plan.dedicated_cpus, running)
    else:
        gone = sorted(plan.dedicated_cpus - online)
        out = [f"CPUs {format_cpulist(gone)} are not online on this host"] if gone else []
    if plan.shared_cpus and node is not None:
        hk = set(housekeeping(host, cfg, node)) - set(cfg.reactors)
        off = sorted(set(plan.shared_cpus) - hk)
        if off:
            out.append(f"CPUs {format_cpulist(off)} are no longer housekeeping cores of node {node.id}")
    gone = sorted(set(plan.emulator) - online)
    if gone:
        out.append(f"emulator CPUs {format_cpulist(gone)} are not online on this host")
    return out


def _memory(plan: Plan, node, running: Ledger) -> list[str]:
    if not plan.hugepage_kib or node is None:
        return []
    pages = place_hugepages(node, plan.hugepage_kib, plan.memory_kib, running)
    if isinstance(pages, NoFit):
        return [pages.reason]
    if pages != plan.hugepages:
        return [f"the plan has {plan.hugepages} hugepages, the memory needs {pages}"]
    return []


def _reactors(cfg: Config, plan: Plan, node) -> list[str]:
    out = []
    for d in plan.disks:
        if d.backend != "spdk":
            continue
        found = reactor_candidates(cfg, node, plan.numa == "strict")
        if isinstance(found, NoFit):
            out.append(f"{d.target}: {found.reason}")
        elif d.reactor not in found[0]:
            out.append(f"{d.target}: reactor core {d.reactor} is not one of the SPDK reactor "
                       f"cores for node {plan.node} ([cpu] reactors: "
                       f"{format_cpulist(cfg.reactors) or 'none'})")
    return out
