"""A domain's host side over its life: prepare before QEMU starts, release
after it stops, reconnect when libvirtd restarts, gc for what nobody runs.

Each run holds the domain's record lock throughout, and the host lock while
it decides (the ledger read, the fit checked, the record written), so two
domains being prepared at once never get the same core, socket or
controller.  A run whose steps touch only the domain's own things (its
qemu-storage-daemons, its SPDK vhost controllers) lets the host lock go
before it starts them: other domains are planned meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import Host
from vstor.host.read import read_host
from vstor.meta.document import Domain
from vstor.meta.names import gate_path
from vstor.meta.plan import Plan
from vstor.planner import Request, fit
from vstor.planner.ledger import Holding, holding_to_json
from vstor.runtime import actions
from vstor.runtime import executor, supervise
from vstor.runtime.holders import holders_of, ledger_of
from vstor.runtime.journal import Journal
# Release, reconnect and health work from the record alone (vstor.runtime.recorded);
# named here too, where every caller looks for a domain's life.
from vstor.runtime.recorded import (Runtime, check_releasable, roll_back, own_record, private_only,  # noqa: F401
                                    health, reconnect, release)
from vstor.runtime.state import INCOMING, PREPARED, Record, StateDir


def plan_of(dom: Domain) -> tuple[Request, Plan]:
    """The recorded plan, and the request it must have been made for (with
    the guest cells the domain's XML has: what will run)."""
    req = Request.keeping_cells(dom)
    plan = dom.recorded_plan()
    if plan is None:
        raise BadInput(f"domain '{dom.name}' has vstor metadata but no plan",
                       hint=f"run: vstor apply {dom.name}")
    fit.check_made_for(plan, req)
    return req, plan


def prepare(rt: Runtime, state: StateDir, host: Host, dom: Domain,
            progress: Callable[[str], None] | None = None, incoming: dict | None = None) -> Record:
    """Carry out the domain's recorded plan (see carry_out)."""
    req, plan = plan_of(dom)
    return carry_out(rt, state, host, req, plan, progress, incoming)


def _gate(rt: Runtime, req: Request) -> str | None:
    """Where the domain's XML has QEMU read vstor's prepared mark, checked
    to be the one place vstor writes it for this domain (whoever wrote the
    XML chose the path)."""
    if req.gate is None:
        return None
    mine = gate_path(rt.cfg.vhost_dir, req.safe_name)
    if req.gate != mine:
        raise BadInput(f"{req.who}: its XML has QEMU read vstor's mark {req.gate[:200]!r}; vstor "
                       f"writes it only at {mine}", hint=f"run: {req.fix}")
    return mine


def carry_out(rt: Runtime, state: StateDir, host: Host, req: Request, plan: Plan,
              progress: Callable[[str], None] | None = None, incoming: dict | None = None) -> Record:
    """Carry out a plan checked to be made for `req`.  Everything that can
    fail before the first host change (building the steps, checking the host,
    reaching SPDK, reading what undo will need) happens before the state
    record is written; a failure after it leaves no record holding anything.
    `incoming`: made ahead of a live migration (the record's `migration`)."""
    say = progress or print
    key = req.safe_name
    rec = Record(key=key, domain=req.name, uuid=req.uuid, migration=dict(incoming or {}),
                 holding=holding_to_json(Holding.from_plan(plan, active=True)))
    with state.record_lock(key, dry_run=rt.dry_run), contextlib.ExitStack() as host_lock:
        host_lock.enter_context(state.lock(dry_run=rt.dry_run))
        leftover = own_record(state.load(key), req.name, req.uuid)
        if leftover is not None and leftover.status == INCOMING and not incoming:
            if leftover.migration.get("cold") != "yes":
                return _arrive(rt, state, leftover, plan, say)
            _claim(leftover, plan)      # a cold migration's reservation: this start makes it real
            if not rt.dry_run:
                state.remove(key)
            leftover = None
        if leftover is not None and not rt.dry_run:
            # A run that never released (crash, or an interrupted prepare):
            # undo what it left, then start clean; but never what a running
            # QEMU of this name still uses.
            roll_back(rt, state, leftover, progress, steps=check_releasable(rt, leftover))
            host = read_host(rt.sysfs)      # the undo moved things: look again
        problems = fit.problems(host, rt.cfg, req, plan, ledger_of(state, {key}, rt.dry_run))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise DoesNotFit(f"{req.who} cannot start: {problems[0]}{more}",
                             reasons=tuple(problems), hint=f"if the host changed for good: {req.fix}")
        for line in fit.advice(req, plan):
            say(f"warning: {line}")
        steps = actions.build(plan, rt.cfg, _gate(rt, req))     # from a plan that passed the check
        executor.preflight(steps, rt)
        if rt.dry_run:
            if leftover is not None:
                say(f"would first undo the {len(leftover.steps)} steps an earlier run left")
            for step in steps:
                say(f"would {step.describe()}")
                for line in step.dry_run():
                    say(f"    {line}")
            return rec
        methods = {m for step in steps for m in getattr(step, "rpc_methods", ())}
        if methods:     # SPDK missing, or an app without vhost: said before touching anything
            rt.spdk.require(methods)
        others = holders_of(state, key)
        steps = [executor.observe(step, rt, others) for step in steps]
        state.save(rec)     # holds the resources while preparing: a concurrent prepare sees them
        if private_only(step.kind for step in steps):
            host_lock.close()       # decided and recorded; the daemons start under the record lock
        Journal(state, rec, rt, progress).run(steps, final=INCOMING if incoming else PREPARED)
    if any(step.kind == "qsd-export" for step in steps):
        supervise.ensure(rt.cfg, rt.sysfs.root)
    return rec


def _claim(rec: Record, plan: Plan) -> None:
    """Refused unless this start is the migration the record was made for:
    the plan made here for it, let in by the migrate hook."""
    from vstor.meta.document import Domain
    planned = Domain.parse(rec.migration.get("xml", ""), f"state record {rec.key}").recorded_plan()
    if planned != plan or rec.migration.get("arriving") != "yes":
        raise DoesNotFit(f"domain '{rec.domain}' is reserved here for an incoming migration, and "
                         "this start is not it (the migrate hook did not let it in with the plan "
                         "made for it)", hint=f"vstor migrate abort {rec.domain} on the source, or "
                                              f"vstor release --force {rec.domain} here")


def _arrive(rt: Runtime, state: StateDir, rec: Record, plan: Plan, say) -> Record:
    """The domain a live migration brought, started on what `vstor migrate
    prepare` made for it: taken over (see _claim), if it is all still there."""
    _claim(rec, plan)
    for entry in rec.steps:
        problem = executor.check(actions.from_json(entry), rt)
        if problem:     # QEMU would wait on a dead backend (and the migration hang)
            raise DoesNotFit(f"domain '{rec.domain}': what was made for its migration is gone: "
                             f"{problem}", hint=f"vstor migrate abort {rec.domain} on the source, "
                                                "then prepare the migration again")
    if rt.dry_run:
        say(f"would take over the {len(rec.steps)} host changes made for the incoming migration")
        return rec
    rec.status, rec.migration = PREPARED, {}
    state.save(rec)
    say(f"took over the {len(rec.steps)} host changes made for the incoming migration")
    return rec
