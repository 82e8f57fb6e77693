"""`vstor migrate agent`: the destination's side, one JSON request in, one
JSON answer out.  Whoever reaches it is root on the source (over ssh), but
the domain XML it carries is input like any domain's: planned again here,
sources resolved against this host's own image roots."""

from __future__ import annotations

from vstor.errors import BadInput, DoesNotFit, VstorError
from vstor.meta.document import Domain
from vstor.migration.peer import PROTOCOL
from vstor.planner.ledger import Ledger


def answer(ctx, request) -> dict:
    """The answer to one request; a refusal is {"ok": false, ...}, never raised."""
    try:
        return {"ok": True, **_serve(ctx, request)}
    except VstorError as e:
        return {"ok": False, "exit_code": e.exit_code, "message": str(e)}


def _serve(ctx, request) -> dict:
    if not isinstance(request, dict) or request.get("vstor_agent") != PROTOCOL:
        raise BadInput(f"not a vstor migrate agent request of protocol {PROTOCOL}",
                       hint="install the same vstor version on both hosts")
    op = request.get("op")
    from vstor.cli.runtime import _runtime, _state
    rt, state = _runtime(ctx, False), _state(ctx)
    if op == "facts":
        # The host NQN this host's SPDK attaches with: what a source's export allows.
        return {"host": ctx.host.hostname, "hostnqn": rt.cfg.hostnqn}
    if op in ("abort", "status"):
        name, uuid = _text(request, "name"), request.get("uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise BadInput("uuid must be a string")
        if op == "status":
            from vstor.errors import Unavailable
            from vstor.runtime.lifecycle import own_record
            damaged: list[str] = []
            records = state.records(damaged)
            if damaged:     # one of them may be this domain's: "nothing" would be a guess
                raise Unavailable(f"{len(damaged)} state records here cannot be read",
                                  hint="vstor status names them")
            key = next((r.key for r in records if r.domain == name), None)
            rec = state.load(key) if key else None
            if rec is not None and uuid is not None:     # a read: the name is enough without one
                rec = own_record(rec, name, uuid)
            return {"host": ctx.host.hostname, "status": rec.status if rec else None,
                    "cold": bool(rec and rec.migration.get("cold") == "yes")}
        from vstor.runtime.incoming import abort_incoming
        return {"host": ctx.host.hostname, "aborted": abort_incoming(rt, state, name, uuid, _quiet)}
    from vstor.runtime.incoming import parse_imports
    dom = Domain.parse(_text(request, "xml"), "the migrating domain's XML")
    ledger = _ledger(ctx, state)
    imports = parse_imports(request.get("imports", {}))
    cold = request.get("cold") is True
    if op == "check":
        return _check(ctx, rt, dom, ledger, request.get("files", {}), imports, cold)
    if op == "prepare":
        from vstor.runtime.incoming import prepare_incoming, reserve_cold
        source = _text(request, "from")
        if cold:
            rec, arriving = reserve_cold(rt, state, ctx.host, dom, ledger, source)
        else:
            rec, arriving = prepare_incoming(rt, state, ctx.host, dom, ledger, source, _quiet, imports)
        return {"host": ctx.host.hostname, "xml": arriving.to_string(), "steps": len(rec.steps)}
    raise BadInput(f"unknown agent request '{op}'", hint="install the same vstor version on both hosts")


def _check(ctx, rt, dom: Domain, ledger: Ledger, files, imports, cold: bool) -> dict:
    from vstor.runtime.incoming import plan_here
    problems, placement, disks = [], [], {}
    try:
        plan = plan_here(ctx.host, rt, dom, ledger, imports, cold).recorded_plan()
        placement = list(plan.reasons)
        disks = {d.target: {"mode": d.mode, "backend": d.backend, "queues": d.queues,
                            "readonly": d.readonly} for d in plan.disks}
    except (BadInput, DoesNotFit) as e:    # the domain as this host would refuse to start it
        problems = list(getattr(e, "reasons", ())) or [e.message]
    if not isinstance(files, dict):
        raise BadInput("files must be an object")
    seen = {str(target): _sees(rt.cfg, theirs) for target, theirs in files.items()}
    return {"host": ctx.host.hostname, "problems": problems, "placement": placement, "seen": seen,
            "disks": disks}


def _sees(cfg, theirs) -> str | None:
    """None when this host has the same storage at the same path; else why not."""
    from vstor.migration import storage
    if not (isinstance(theirs, dict) and theirs.get("kind") in ("file", "block")
            and isinstance(theirs.get("path"), str) and isinstance(theirs.get("size"), int)):
        raise BadInput("files: each must be {path, kind, size, ...}")
    try:
        mine = storage.describe(cfg, theirs["kind"], theirs["path"])
    except BadInput as e:
        return f"cannot use it ({e.message})"
    return storage.differs(theirs, mine)


def _ledger(ctx, state) -> Ledger:
    """Other domains' holdings: libvirt's defined domains and every state
    record besides (a migration held for a domain not defined here yet)."""
    from vstor.runtime.inventory import load_ledger
    return load_ledger(ctx.conn, state.records())


def _text(request: dict, key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value:
        raise BadInput(f"the request has no {key}")
    return value


def _quiet(message: str) -> None:
    """Progress goes to stderr: stdout carries the one JSON answer."""
    import sys
    print(f"  {message}", file=sys.stderr)
