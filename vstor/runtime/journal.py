"""Doing host changes so that every one can be undone.

Each change is a Step that knows how to do, undo and check itself from a
JSON-able `data` dict.  The journal writes a step into the domain's state
record (state 'doing') before doing it and marks it 'done' after; on a
failure it undoes, in reverse, everything the record holds.  Undo must
therefore cope with a step that was only half done.
"""

from __future__ import annotations

from typing import Callable

from vstor.errors import ActionFailed, VstorError
from vstor.runtime.state import PREPARED, RELEASING, Record, StateDir

DOING, DONE = "doing", "done"


class Step:
    kind = "step"

    def __init__(self, data: dict):
        self.data = data

    def describe(self) -> str:
        raise NotImplementedError

    def do(self, rt) -> None:
        raise NotImplementedError

    def undo(self, rt) -> None:
        raise NotImplementedError

    def check(self, rt) -> str | None:
        """None when what the step made still exists and works, else why not."""
        return None

    def repair(self, rt) -> None:
        """Bring back what check() found missing (default: do it again)."""
        self.do(rt)

    def to_json(self, state: str) -> dict:
        return {"kind": self.kind, "state": state, "data": self.data}


REGISTRY: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    REGISTRY[cls.kind] = cls
    return cls


def step_from_json(entry: dict) -> Step:
    try:
        return REGISTRY[entry["kind"]](entry["data"])
    except KeyError:
        raise ActionFailed(f"state record holds an unknown step {entry.get('kind')!r}",
                           hint="it was written by another vstor version") from None


class Journal:
    """Runs steps for one domain's record, under the state directory's lock
    (the caller holds it)."""

    def __init__(self, state: StateDir, rec: Record, rt, progress: Callable[[str], None] | None = None):
        self.state = state
        self.rec = rec
        self.rt = rt
        self.progress = progress or (lambda _msg: None)

    def run(self, steps: list[Step]) -> None:
        for step in steps:
            self.rec.steps.append(step.to_json(DOING))
            self.state.save(self.rec)
            self.progress(step.describe())
            try:
                step.do(self.rt)
            except Exception as e:
                failure = _one_line(e)
                errors = self.rollback()
                more = f"; undo also failed: {'; '.join(errors)}" if errors else "; everything done before it was undone"
                err = ActionFailed(f"{self.rec.domain}: {step.describe()} failed: {failure}{more}")
                if isinstance(e, VstorError):
                    err.exit_code = e.exit_code     # a missing SPDK stays "unavailable"
                raise err from None
            self.rec.steps[-1] = step.to_json(DONE)
            self.state.save(self.rec)
        self.rec.status = PREPARED
        self.state.save(self.rec)

    def rollback(self) -> list[str]:
        """Undo every recorded step, newest first; the record goes when empty.
        The first undo that fails stops the rollback: the steps before it are
        what it stands on (an NVMe controller under a vhost controller QEMU
        still uses), so they stay, recorded, for a later release or gc."""
        self.rec.status = RELEASING
        self.state.save(self.rec)
        errors: list[str] = []
        pending = list(self.rec.steps)
        kept: list[dict] = []
        while pending:
            entry = pending.pop()
            step = step_from_json(entry)
            self.progress(f"undo: {step.describe()}")
            try:
                step.undo(self.rt)
            except Exception as e:
                errors.append(f"{step.describe()}: {_one_line(e)}")
                kept = pending + [entry]
                pending = []
            # Saved after every undo: a crash here leaves an exact record.
            self.rec.steps = pending + kept
            if self.rec.steps:
                self.state.save(self.rec)
        if not self.rec.steps:
            self.state.remove(self.rec.key)
        return errors


def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, VstorError) else (str(e) or type(e).__name__)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__
