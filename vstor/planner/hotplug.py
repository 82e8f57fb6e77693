"""Hot-plug: one disk more or less for a running domain, planned against the
placement it runs with (its node, its reactors, its memory as it is).

Pure.  The disk is chosen by the planner's own code with the running
domain's holding in the ledger (its controllers, volumes and sockets are
taken, by itself), and what cannot change while QEMU runs is refused: memory
that is not shared (vhost-user) or not on hugepages (SPDK), a guest without
the vIOMMU that SPDK in the guest needs, a device on another node under
numa='strict'.
"""

from __future__ import annotations

from collections import Counter

from vstor.config import Config
from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import Host
from vstor.meta.intent import DiskIntent, Intent
from vstor.meta.metadata import digest
from vstor.meta.plan import Plan
from vstor.planner import Request, check_request, disk_plan
from vstor.planner.disks import NoFit, choose_all
from vstor.planner.ledger import Ledger, Overlay
from vstor.planner.placement import place_reactor
from vstor.records import replace


HOTPLUGGED = "hot-plugged"      # the reason a disk added to a running domain carries


def with_disk(intent: Intent, disk: DiskIntent) -> Intent:
    return Intent(intent.vm, intent.disks + (disk,))


def without_disk(intent: Intent, target: str) -> Intent:
    return Intent(intent.vm, tuple(d for d in intent.disks if d.target != target))


def plan_attach(host: Host, cfg: Config, req: Request, plan: Plan, disk: DiskIntent,
                ledger: Ledger) -> Plan:
    """The running domain's plan with `disk` added.  `req` is the running
    domain's request (its intent without the disk), `ledger` every running
    domain's holding, this one's included."""
    check_request(req)
    who = req.who
    if plan.cpus == "external":
        raise BadInput(f"{who} is a Nova instance: Nova owns its devices",
                       hint="give the flavor the vstor:disk spec instead")
    if plan.disk(disk.target) is not None or any(d.target == disk.target for d in req.intent.disks):
        raise BadInput(f"{who} already has a vstor disk {disk.target}",
                       hint="pick another target, or vstor detach it first")
    choices = choose_all(host, cfg, req.intent.vm, (disk,), Overlay(ledger))
    if isinstance(choices, NoFit):
        raise DoesNotFit(f"{disk.target} cannot be added to {who}: {choices.reason}")
    (c,) = choices
    reasons = list(c.reasons)
    cell = _cell(who, plan, c, disk)
    if c.node is not None and cell.node is not None and c.node != cell.node:
        where = f"its guest cell {cell.id} is on node {cell.node}" if plan.cells else \
            f"the domain runs on node {cell.node}"
        if plan.numa == "strict":
            raise DoesNotFit(f"{disk.target} cannot be added to {who}: {c.node_from} is on node "
                             f"{c.node} and {where} (numa='strict')",
                             hint="pick a device on its node, or plan it with numa='preferred'")
        reasons.append(f"{c.node_from} is on node {c.node}, {where}: its I/O crosses the interconnect")
    _check_live(who, plan, c.mode, c.backend, disk)
    reactor = None
    if c.backend == "spdk":
        node = host.node(cell.node) if cell.node is not None else None
        reactor = place_reactor(cfg, node, plan.numa == "strict", Counter(ledger.reactor_load))
        if isinstance(reactor, NoFit):
            raise DoesNotFit(f"{disk.target} cannot be added to {who}: {reactor.reason}")
    added = disk_plan(cfg, req, replace(c, reasons=(*reasons, HOTPLUGGED)), reactor,
                      cell.id if plan.cells else None)
    return replace(plan, digest=digest(with_disk(req.intent, disk)), disks=plan.disks + (added,))


def _cell(who: str, plan: Plan, c, disk: DiskIntent):
    """The guest cell a new disk goes to: the one it names, else the one on
    its device's node, else the first."""
    cells = plan.guest_cells()
    if disk.cell is not None:
        if disk.cell >= len(cells):
            raise BadInput(f"{disk.target} names guest cell {disk.cell}; {who} has cells "
                           f"0-{len(cells) - 1}", hint="name one of them, or leave cell unset")
        return cells[disk.cell]
    return next((x for x in cells if c.node is not None and x.node == c.node), cells[0])


def plan_detach(req: Request, plan: Plan, target: str) -> Plan:
    """The running domain's plan without the disk `target`."""
    if plan.disk(target) is None:
        have = ", ".join(d.target for d in plan.disks) or "none"
        raise BadInput(f"{req.who} has no vstor disk {target} (its vstor disks: {have})",
                       hint=f"see: vstor status {req.name}")
    left = tuple(d for d in plan.disks if d.target != target)
    if not left:
        raise BadInput(f"{target} is the last vstor disk of {req.who}; the domain's placement "
                       "stands on its vstor metadata, which needs a disk",
                       hint="stop the domain, remove the <vstor:vstor> element, then start it")
    return replace(plan, digest=digest(without_disk(req.intent, target)), disks=left)


def _check_live(who: str, plan: Plan, mode: str, backend: str, disk: DiskIntent) -> None:
    """What a running QEMU cannot be given: refused with the way out."""
    replan = "stop the domain, add the disk to its metadata, vstor apply, start it"
    if mode == "vhost" and not any(d.mode == "vhost" for d in plan.disks):
        raise DoesNotFit(f"{disk.target} cannot be added to {who} live: its memory is not shared, "
                         "and a vhost-user backend must map the guest's memory",
                         hint=replan + " (or give it mode='passthrough')")
    if backend == "spdk" and not plan.hugepage_kib:
        raise DoesNotFit(f"{disk.target} cannot be added to {who} live: its memory is not on "
                         "hugepages, which SPDK needs", hint=replan + " (or backend='qsd')")
    if mode == "passthrough" and disk.guest == "spdk" and not plan.viommu:
        raise DoesNotFit(f"{disk.target} cannot be added to {who} live: guest='spdk' needs a "
                         "vIOMMU, which a running domain cannot be given", hint=replan)
