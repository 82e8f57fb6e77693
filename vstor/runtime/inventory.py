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
from vstor.runtime.recordfile import read_json, write_text


def holdings_from_libvirt(conn, cache: str | None = None) -> list[Holding]:
    """Every defined vstor domain's holding, from the plan its XML records.
    `cache`: a file keeping each domain's holding (or that it holds
    nothing) by its XML's SHA-256, so a host's thousands of domains are not
    all parsed again by every `vstor plan`: what a domain holds is a
    function of its XML alone; whether it runs is asked of libvirt, once
    for all of them.  Read here; what this run learned is written by
    save_pending(), after a define or apply that went well."""
    import hashlib
    known = _load_cache(cache)
    # What the cache holds after this run: each listed domain's entry, the
    # JSON read from the cache or, parsed now, the Holding (or None).
    used: dict[str, dict | Holding | None] = {}
    parsed = False
    active, persistent = virt.uuids_of(conn, "ACTIVE"), virt.uuids_of(conn, "PERSISTENT")
    # Every definition first, then each read: parsing between libvirt's
    # answers ran a third slower (the CPU's caches cold after each wait).
    listed = [(vdom.name(), uuid, virt.inactive_xml(vdom, uuid in persistent))
              for vdom in virt.all_domains(conn) for uuid in (vdom.UUIDString(),)]
    out = []
    for name, uuid, xml in listed:
        try:
            key = hashlib.sha256(xml.encode("utf-8", "surrogateescape")).hexdigest()
            entry = known.get(key)
            held = _cached(entry, uuid in active)
            if key not in known or (entry is not None and held is None):     # not kept, or damaged
                held = entry = _held(Domain.parse(xml, f"domain '{name}'"), uuid in active)
                parsed = True
            used[key] = entry
        except VstorError as e:
            # One damaged neighbour must not block planning for everybody.
            print(f"vstor: warning: ledger skips {e}", file=sys.stderr)
            continue
        if held is not None:
            out.append(held)
    if cache and (parsed or len(used) != len(known)):
        _PENDING[cache] = used      # written by save_pending(), once the run went well
    return out


_PENDING: dict[str, dict] = {}


def save_pending() -> None:
    """Write the plan caches holdings_from_libvirt filled: by a command that
    changes the host anyway and went well (define, apply); `vstor plan`,
    a dry run and a refused run write nothing, not even this."""
    while _PENDING:
        path, used = _PENDING.popitem()
        _save_cache(path, {key: holding_to_json(entry) if isinstance(entry, Holding) else entry
                           for key, entry in used.items()})


def _held(dom: Domain, active: bool) -> Holding | None:
    """The holding of a domain's recorded plan; None when it has no vstor
    metadata or was never planned."""
    plan = dom.recorded_plan()
    return None if plan is None else Holding.from_plan(plan, active)


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
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(path: str, data: dict) -> None:
    """Best effort: a reader that may not write the state directory (not
    root) parses again next time."""
    try:
        write_text(path, json.dumps(data, separators=(",", ":")), shared=True)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(f"{path}.{os.getpid()}.tmp")


def readable_records(state_dir: str) -> list:
    """Every state record, for a planner that may not be root (nova-compute
    runs as nova, who cannot enter the root-only state directory, nor so
    much as check it): none then, as the hook reads them again, as root,
    and refuses what they forbid.  A damaged record, or a state directory
    someone else may change, still refuses."""
    from vstor.errors import Unavailable
    from vstor.runtime.recordfile import DamagedRecord, UntrustedState
    from vstor.runtime.state import StateDir
    try:
        return StateDir(state_dir).records()
    except (DamagedRecord, UntrustedState):
        raise
    except (OSError, Unavailable):
        return []


def plans_cache(cfg) -> str:
    """Where the holdings of parsed plans are kept (holdings_from_libvirt)."""
    return os.path.join(cfg.state_dir, "plans.json")


def load_ledger(conn=None, records=(), cache: str | None = None) -> Ledger:
    """Every defined domain's plan (libvirt) and, besides, what state
    records hold for domains libvirt does not list: prepared by hand, or
    reserved for an incoming migration."""
    from vstor.runtime.holders import holding_of
    holdings = holdings_from_libvirt(conn, cache) if conn is not None else []
    known = {h.domain for h in holdings}
    holdings += [holding_of(r) for r in records if r.holding and r.domain not in known]
    return Ledger(holdings)
