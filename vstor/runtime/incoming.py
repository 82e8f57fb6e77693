"""The destination's side of a live migration: backends made ahead for a
domain that is coming (`vstor migrate prepare` on the source asks for it
through `vstor migrate agent` here), the XML it arrives with (the migrate
hook), and giving the reservation up (abort, or a failed migration).

The domain XML the source sends is input like any domain's (threats.md):
its intent is planned again here, with this host's model, config and ledger;
the source's plan is never used."""

from __future__ import annotations

from collections.abc import Callable

from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import Host
from vstor.meta.document import Domain
from vstor.planner import Request, fit, plan_domain
from vstor.planner.ledger import Ledger
from vstor.meta.names import gate_path
from vstor.render.libvirt import render
from vstor.render.migration import render_incoming
from vstor.runtime.executor import Runtime
from vstor.runtime.lifecycle import own_record, prepare, release
from vstor.runtime.state import INCOMING, StateDir


def plan_here(host: Host, rt: Runtime, dom: Domain, ledger: Ledger, imports=(), cold=False) -> Domain:
    """The domain as it would arrive here: its intent planned on this host,
    `imports` (target, NvmfSource) standing in for local NVMe the source
    exports.  `cold`: it starts afresh here, so it is rendered anew (a live
    one keeps every device, render_incoming)."""
    if not dom.has_vstor():
        raise BadInput(f"domain '{dom.name}' has no vstor metadata", hint="nothing for vstor to prepare")
    local = {d.target for d in dom.intent().disks if d.source.kind == "nvme"}
    for target, _ in imports:
        if target not in local:
            raise BadInput(f"an import for disk {target}, which is not a local NVMe disk of "
                           f"domain '{dom.name}'")
    req = Request.from_domain(dom, imports) if cold else Request.keeping_cells(dom, imports)
    plan = plan_domain(host, rt.cfg, req, ledger.without(dom.name, dom.uuid))
    return _placed(dom, plan, cold, gate_path(rt.cfg.vhost_dir, dom.safe_name))


def _placed(dom: Domain, plan, cold: bool, gate: str | None = None) -> Domain:
    return (render(dom, plan, dom.recorded_plan(), gate=gate) if cold
            else render_incoming(dom, plan, gate))


def ledger_now(ledger: Ledger | Callable[[], Ledger], state: StateDir) -> Ledger:
    """The ledger to plan an arriving domain with, read under the planning
    lock: `ledger` itself when it is a function (it then reads libvirt now),
    and the state records as they are now (a domain prepared or reserved
    since `ledger` was read) besides."""
    from vstor.runtime.holders import holding_of, recorded
    base = ledger() if callable(ledger) else ledger
    known = {h.domain for h in base.holdings}
    return Ledger(base.holdings + tuple(holding_of(r) for r in recorded(state)
                                        if r.holding and r.domain not in known))


def reserve_cold(rt: Runtime, state: StateDir, host: Host, dom: Domain, ledger, source: str):
    """A cold migration: what the domain will hold here, reserved (no host
    change yet: its start here makes the backends, as any start does).
    Planned and recorded under the planning lock (`ledger`: see ledger_now)."""
    with state.planning():
        return _reserve_cold(rt, state, host, dom, ledger_now(ledger, state), source)


def _reserve_cold(rt: Runtime, state: StateDir, host: Host, dom: Domain, ledger: Ledger, source: str):
    from vstor.planner.ledger import Holding, holding_to_json
    from vstor.runtime.state import Record
    arriving = plan_here(host, rt, dom, ledger, cold=True)
    plan = arriving.recorded_plan()
    with state.record_lock(dom.safe_name), state.lock():
        existing = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
        if existing is not None and (existing.status != INCOMING or existing.steps):
            raise DoesNotFit(f"domain '{dom.name}' already has backends on this host ({existing.status})",
                             hint=f"vstor migrate abort {dom.name} on the source first")
        from vstor.runtime.holders import ledger_of
        problems = fit.problems(host, rt.cfg, Request.from_domain(arriving), plan,
                                ledger_of(state, {dom.safe_name}))
        if problems:
            raise DoesNotFit(f"domain '{dom.name}' cannot be reserved here: {problems[0]}",
                             reasons=tuple(problems))
        rec = Record(dom.safe_name, dom.name, dom.uuid, status=INCOMING,
                     holding=holding_to_json(Holding.from_plan(plan)),
                     migration={"role": "incoming", "cold": "yes", "from": source,
                                "xml": arriving.to_string()})
        state.save(rec)
    return rec, arriving


def parse_imports(given) -> tuple:
    """{target: {nvmf attributes}} from a request -> ((target, NvmfSource), ...),
    each checked by the metadata's own declaration."""
    from lxml import etree
    from vstor.meta import xmlmodel
    from vstor.meta.intent import NvmfSource
    from vstor import NS
    if not isinstance(given, dict):
        raise BadInput("imports must be an object")
    out = []
    for target, attrs in sorted(given.items()):
        if not (isinstance(attrs, dict) and all(isinstance(v, str) for v in attrs.values())):
            raise BadInput(f"import {target!r} is not an object of strings")
        e = etree.Element(f"{{{NS}}}nvmf", {k: v for k, v in attrs.items()})
        out.append((str(target), xmlmodel.parse(NvmfSource, e, f"import for {target}")))
    return tuple(out)


def prepare_incoming(rt: Runtime, state: StateDir, host: Host, dom: Domain, ledger,
                     source: str, progress=None, imports=()):
    """Make the backends the domain will arrive on, and hold them for it:
    planned, recorded and made under the planning lock (`ledger`: see
    ledger_now)."""
    with state.planning():
        return _prepare_incoming(rt, state, host, dom, ledger_now(ledger, state), source, progress,
                                 imports)


def _prepare_incoming(rt: Runtime, state: StateDir, host: Host, dom: Domain, ledger: Ledger,
                      source: str, progress, imports):
    existing = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
    if existing is not None and existing.status != INCOMING:
        raise DoesNotFit(f"domain '{dom.name}' already has backends on this host ({existing.status})",
                         hint="it runs here" if existing.status != "exporting" else
                              "this host exports its disk; shut it down where it runs and start it here")
    arriving = plan_here(host, rt, dom, ledger, imports)
    handover = Runtime(rt.cfg, rt.sysfs, dry_run=rt.dry_run, handover=rt.cfg.local_peers)
    rec = prepare(handover, state, host, arriving, progress=progress,
                  incoming={"role": "incoming", "from": source, "xml": arriving.to_string()})
    return rec, arriving


def arriving_xml(state: StateDir, dom: Domain) -> str:
    """The migrate hook: the XML the domain arrives with, placed by the plan
    made here for it; refused when no migration was prepared here."""
    rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
    if rec is None or rec.status != INCOMING:
        raise DoesNotFit(f"vstor domain '{dom.name}' arrives, but no migration was prepared for "
                         "it on this host", hint=f"on the source: vstor migrate prepare {dom.name} "
                                                 "--to <this host>, then migrate again")
    made = Domain.parse(rec.migration.get("xml", ""), f"state record {rec.key}")
    planned = made.recorded_plan()
    fit.check_made_for(planned, Request.from_domain(dom))
    # The prepared mark where the domain was placed here for it (plan_here).
    arriving = _placed(dom, planned, rec.migration.get("cold") == "yes", made.gate()).to_string()
    # Read first: a refusal takes no lock and creates nothing; then, under
    # the lock, only a domain let in here takes the held backends over.
    with state.record_lock(dom.safe_name), state.lock():
        rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
        if rec is not None and rec.status == INCOMING:
            rec.migration = {**rec.migration, "arriving": "yes"}
            state.save(rec)
    return arriving


def abort_incoming(rt: Runtime, state: StateDir, name: str, uuid: str | None, progress=None) -> bool:
    """Give up the backends held for a migration that will not come.  Never
    a domain that arrived (its record is prepared then): False if none."""
    from vstor.meta.names import is_safe_name
    key = next((r.key for r in state.records() if r.domain == name), name)
    if not is_safe_name(key):
        return False
    rec = own_record(state.load(key), name, uuid)
    if rec is None:
        return False
    if rec.status != INCOMING:
        raise DoesNotFit(f"domain '{name}' is not waiting for a migration here ({rec.status}): "
                         "it arrived, or was never prepared for one", hint="nothing to abort here")
    release(rt, state, key, progress=progress, domain=name, uuid=uuid)
    return True
