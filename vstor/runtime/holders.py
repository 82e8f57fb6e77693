"""What the other domains' records hold, as a step's observe and undo ask
it: another domain's journal entry on the same shared thing (a controller's
vfio binding, an SPDK NVMe controller), by the step's identity
(vstor.runtime.actions.identity); and `damaged`, the records that could not
be read (what they hold is unknown).  Asked of the index
(vstor.runtime.index.FromIndex) by every run; of the records themselves
here (a dry run, which writes no index)."""

from __future__ import annotations


class FromRecords:
    """The answers, from a list of the other domains' records."""

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
