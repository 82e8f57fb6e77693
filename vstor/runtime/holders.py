"""What the other domains' records hold, as a start, a release, an attach
and planning ask it: the planner's ledger (ledger_of), another domain's
journal entry on a shared thing (holders_of: a controller's vfio binding,
an SPDK NVMe controller, by the step's identity,
vstor.runtime.actions.identity), and every record as planning needs it
(recorded).  Asked of the index (vstor.runtime.index) by every run that
decides; of the records themselves by a dry run, which writes no index."""

from __future__ import annotations

import os

from vstor.meta.holding import holding_from_json
from vstor.runtime.index import UNREADABLE, FromIndex, IndexLedger
from vstor.runtime.state import INCOMING, PREPARED, Record, StateDir


def holding_of(rec: Record):
    """A record's holding; one held for an incoming migration is not running
    yet, so its hugepages are still in the pool but promised."""
    return holding_from_json(rec.holding, active=rec.status != INCOMING)


class FromRecords:
    """holders_of's answers, from a list of the other domains' records."""

    def __init__(self, records, damaged=()):
        self._records = list(records)
        # The records that could not be read: nothing shared is undone.
        self.damaged = list(damaged)

    def step(self, kind: str, ident: str, finished_only: bool) -> dict | None:
        """Another domain's journal entry of `kind` making `ident`, if one
        is recorded (only a finished one with `finished_only`)."""
        from vstor.runtime.actions import KINDS, from_json, identity
        if kind not in KINDS:
            return None
        for rec in self._records:
            for e in rec.steps:
                if e["kind"] != kind or (finished_only and e["state"] != "done"):
                    continue
                try:
                    if identity(from_json(e))[1] == ident:
                        return e
                except Exception:       # noqa: BLE001 (an unreadable step is its own record's problem)
                    continue
        return None


def ledger_of(state: StateDir, exclude=(), dry_run: bool = False):
    """What every record but those of `exclude` holds, as the planner asks
    it; refused (DamagedRecord) while a record cannot be read.  A dry run
    writes nothing, so it reads the records themselves (the index may need
    a rebuild)."""
    if dry_run:
        # Here, not at the top: the hook's release imports this module, and
        # vstor.planner (lxml, the declarations) is 19 ms it never needs.
        from vstor.planner.ledger import Ledger
        return Ledger([holding_of(r) for r in state.records() if r.holding and r.key not in exclude])
    state.index.check_damaged()
    return IndexLedger(state.index, frozenset(exclude))


def holders_of(state: StateDir, key: str, dry_run: bool = False):
    """Another domain's journal entry on a shared thing, for what others
    than `key` hold (.step), and the records that could not be read
    (.damaged: then nothing shared is undone)."""
    if dry_run:
        damaged: list[str] = []
        return FromRecords([r for r in state.records(damaged) if r.key != key], damaged)
    return FromIndex(state.index, key)


def recorded(state: StateDir) -> list[Record]:
    """Every record as the index holds it (who, its holding, whether it
    runs; no steps): what planning needs of the records, without reading
    each (the records themselves when the index needs a rebuild: planning
    writes nothing).  Refused (DamagedRecord) while a record cannot be read."""
    if not os.path.isdir(state.index.path):
        return state.records()      # no index yet: nothing made by asking
    with state.lock():
        if state.index.trusted() is None:
            return state.records()      # read, never written here: the next start rebuilds it
        state.index.check_damaged()
        out = []
        for key in state.index.keys() or ():
            s = state.index.indexed(key, rebuild=False)
            if s is UNREADABLE:
                return state.records()
            if s:
                out.append(Record(key=key, domain=s["domain"], uuid=s["uuid"], holding=s["holding"] or {},
                                  status=PREPARED if s["active"] else INCOMING))
        return out
