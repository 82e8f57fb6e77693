"""`vstor migrate agent`: the destination's side, one JSON request in, one
JSON answer out.  Whoever reaches it is root on the source (over ssh), but
the request is input like a domain's XML: checked against its declaration
(vstor.migration.request), the domain planned again here, sources resolved
against this host's own image roots and block devices."""

from __future__ import annotations

import json
import os
import sys

from vstor.errors import EXIT_ERROR, BadInput, DoesNotFit, Unavailable, VstorError, one_line
from vstor.meta.document import Domain
from vstor.migration import request as requests, storage
from vstor.planner.ledger import Ledger
from vstor.runtime.context import HostContext
from vstor.runtime.holders import recorded
from vstor.runtime.incoming import abort_incoming, parse_imports, plan_here, prepare_incoming, reserve_cold
from vstor.runtime.inventory import load_ledger
from vstor.runtime.lifecycle import own_record


def serve(here: HostContext, stdin) -> int:
    """Read one request from `stdin`, write exactly one JSON answer on
    stdout, and return its exit code (0, or the refusal's).  Anything else
    written on stdout meanwhile (a daemon started here inherits it) goes to
    stderr: the source reads stdout as the answer."""
    sys.stdout.flush()
    out = os.dup(1)
    os.dup2(2, 1)
    try:
        reply = answer(here, stdin)
    finally:
        sys.stdout.flush()
        os.dup2(out, 1)
        os.close(out)
    print(json.dumps(reply), flush=True)
    return 0 if reply["ok"] else reply["exit_code"]


def answer(here: HostContext, stdin) -> dict:
    """The answer to the request on `stdin`; a refusal is {"ok": false,
    "exit_code", "message"}, never raised, even for a bug here."""
    try:
        return {"ok": True, **_serve(here, requests.read(stdin))}
    except VstorError as e:
        return {"ok": False, "exit_code": e.exit_code, "message": str(e)}
    except Exception as e:      # a bug: still one answer, the traceback on request
        if os.environ.get("VSTOR_DEBUG"):
            import traceback
            traceback.print_exc()
        return {"ok": False, "exit_code": EXIT_ERROR,
                "message": one_line(f"internal error: {type(e).__name__}: {e}")}


def _serve(here: HostContext, request: dict) -> dict:
    op = request["op"]
    rt, state = here.runtime(), here.state()
    if op == "facts":
        # The host NQN this host's SPDK attaches with: what a source's export allows.
        return {"host": here.host.hostname, "hostnqn": rt.cfg.hostnqn}
    if op in ("abort", "status"):
        name, uuid = request["name"], request["uuid"]
        if op == "status":
            damaged: list[str] = []
            records = state.records(damaged)
            if damaged:     # one of them may be this domain's: "nothing" would be a guess
                raise Unavailable(f"{len(damaged)} state records here cannot be read",
                                  hint="vstor status names them")
            key = next((r.key for r in records if r.domain == name), None)
            rec = state.load(key) if key else None
            if rec is not None and uuid is not None:     # a read: the name is enough without one
                rec = own_record(rec, name, uuid)
            return {"host": here.host.hostname, "status": rec.status if rec else None,
                    "cold": bool(rec and rec.migration.get("cold") == "yes")}
        return {"host": here.host.hostname, "aborted": abort_incoming(rt, state, name, uuid, _quiet)}
    dom = Domain.parse(request["xml"], "the migrating domain's XML")
    requests.NAME.check(dom.name, "the migrating domain's name")
    imports = parse_imports(request["imports"])
    if op == "check":
        return _check(here, rt, dom, _ledger(here, state), request["files"], imports, request["cold"])
    source = request["from"]
    # The ledger is read under the planning lock (runtime.incoming.ledger_now).
    if request["cold"]:
        rec, arriving = reserve_cold(rt, state, here.host, dom, lambda: _ledger(here, state), source)
    else:
        rec, arriving = prepare_incoming(rt, state, here.host, dom, lambda: _ledger(here, state),
                                         source, _quiet, imports)
    return {"host": here.host.hostname, "xml": arriving.to_string(), "steps": len(rec.steps)}


def _check(here: HostContext, rt, dom: Domain, ledger: Ledger, files, imports, cold: bool) -> dict:
    problems, placement, disks = [], [], {}
    try:
        plan = plan_here(here.host, rt, dom, ledger, imports, cold).recorded_plan()
        placement = list(plan.reasons)
        disks = {d.target: {"mode": d.mode, "backend": d.backend, "queues": d.queues,
                            "readonly": d.readonly} for d in plan.disks}
    except (BadInput, DoesNotFit) as e:    # the domain as this host would refuse to start it
        problems = list(getattr(e, "reasons", ())) or [e.message]
    seen = {target: _sees(rt, theirs) for target, theirs in files.items()}
    return {"host": here.host.hostname, "problems": problems, "placement": placement, "seen": seen,
            "disks": disks}


def _sees(rt, theirs: dict) -> str | None:
    """None when this host has the same storage at the same path; else why not."""
    try:
        mine = storage.describe(rt.cfg, theirs["kind"], theirs["path"], rt.sysfs)
    except BadInput as e:
        return f"cannot use it ({e.message})"
    return storage.differs(theirs, mine)


def _ledger(here: HostContext, state) -> Ledger:
    """Other domains' holdings: libvirt's defined domains and every state
    record besides (a migration held for a domain not defined here yet)."""
    return load_ledger(here.conn, recorded(state))


def _quiet(message: str) -> None:
    """Progress goes to stderr: stdout carries the one JSON answer."""
    print(f"  {message}", file=sys.stderr)
