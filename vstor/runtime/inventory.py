"""Where the ledger comes from: the plans recorded in every defined domain
(through libvirt) and, for running domains, the state directory."""

from __future__ import annotations

import contextlib
import json
import os
import sys

from vstor.meta.document import Domain
from vstor.errors import VstorError
from vstor.planner.ledger import Holding, Ledger, holding_from_json, holding_to_json
from vstor.runtime import virt


def holdings_from_libvirt(conn, cache: str | None = None) -> list[Holding]:
    """Every defined vstor domain's holding, from the plan its XML records.
    `cache`: a file keeping each plan's holding by the plan's exact text
    (with the domain's name and UUID), so a host's thousands of domains are
    not all parsed again by every `vstor plan` (what a plan holds is a
    function of that text alone)."""
    known = _load_cache(cache)
    used: dict[str, dict] = {}
    out = []
    for vdom in virt.all_domains(conn):
        try:
            dom = Domain.parse(virt.inactive_xml(vdom), f"domain '{vdom.name()}'")
            if not dom.has_vstor():
                continue
            key = _plan_key(dom)
            if key is None:
                continue        # never planned
            active = bool(vdom.isActive())
            held = _cached(known.get(key), active)
            if held is None:
                plan = dom.recorded_plan()
                if plan is None:
                    continue
                held = Holding.from_plan(plan, active=active)
            used[key] = holding_to_json(held)
        except VstorError as e:
            # One damaged neighbour must not block planning for everybody.
            print(f"vstor: warning: ledger skips {e}", file=sys.stderr)
            continue
        out.append(held)
    if cache and used != known:
        _save_cache(cache, used)
    return out


def _plan_key(dom: Domain) -> str | None:
    text = dom.plan_text()
    if text is None:
        return None
    import hashlib
    return hashlib.sha256(b"\0".join([dom.name.encode(), (dom.uuid or "").encode(), text])).hexdigest()


def _cached(data, active: bool) -> Holding | None:
    if not isinstance(data, dict):
        return None
    try:
        return holding_from_json(data, active=active)
    except (KeyError, TypeError, ValueError):
        return None


def _load_cache(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(path: str, data: dict) -> None:
    """Best effort: a reader that may not write the state directory (not
    root) parses again next time."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def plans_cache(cfg) -> str:
    """Where the holdings of parsed plans are kept (holdings_from_libvirt)."""
    return os.path.join(cfg.state_dir, "plans.json")


def load_ledger(conn=None, records=(), cache: str | None = None) -> Ledger:
    """Every defined domain's plan (libvirt) and, besides, what state
    records hold for domains libvirt does not list: prepared by hand, or
    reserved for an incoming migration."""
    from vstor.runtime.lifecycle import holding_of
    holdings = holdings_from_libvirt(conn, cache) if conn is not None else []
    known = {h.domain for h in holdings}
    holdings += [holding_of(r) for r in records if r.holding and r.domain not in known]
    return Ledger(holdings)
