"""Doing host changes so that every one can be undone.

The journal writes each step (a typed record, vstor.runtime.actions) into the
domain's state record (state 'doing') before doing it and marks it 'done'
after; on a failure it undoes, in reverse, everything the record holds.  Undo
must therefore cope with a step that was only half done.  What a step does is
the executor's (vstor.runtime.steps, or a test's own).
"""

from __future__ import annotations

from typing import Callable

from vstor.errors import ActionFailed, VstorError
from vstor.runtime.state import PREPARED, RELEASING, Record, StateDir

DOING, DONE = "doing", "done"


class Journal:
    """Runs steps for one domain's record, under the state directory's lock
    (the caller holds it)."""

    def __init__(self, state: StateDir, rec: Record, rt, progress: Callable[[str], None] | None = None,
                 executor=None):
        if executor is None:
            from vstor.runtime import steps as executor
        self.state = state
        self.rec = rec
        self.rt = rt
        self._progress = progress or (lambda _msg: None)
        self.x = executor

    def progress(self, message: str) -> None:
        """Best effort: a reader that went away (a closed pipe) must not stop
        a change half-way."""
        try:
            self._progress(message)
        except Exception:
            pass

    def run(self, steps: list, final: str = PREPARED) -> None:
        """Do every step; the record then says `final` (written once)."""
        try:
            self._run(steps, final=final)
        except KeyboardInterrupt:
            # Interrupted between or inside steps: undo what is recorded, so no
            # record is left holding resources, then stop as asked.
            self.rollback()
            raise

    def extend(self, steps: list) -> None:
        """More steps for a prepared record (a running domain's): a failure
        undoes only these; what the domain runs on stays, and so does its status."""
        first = len(self.rec.steps)
        status = self.rec.status
        try:
            self._run(steps, first)
        except KeyboardInterrupt:
            self.rollback(keep=lambda i, _entry: i < first)
            raise
        finally:
            if self.rec.steps and self.rec.status != status:
                self.rec.status = status
                self.state.save(self.rec)

    def _run(self, steps: list, first: int = 0, final: str = PREPARED) -> None:
        for step in steps:
            self.rec.steps.append(self.x.encode(step, DOING))
            self.state.save(self.rec)
            self.progress(step.describe())
            try:
                self.x.do(step, self.rt)
            except Exception as e:
                failure = _one_line(e)
                errors = self.rollback(keep=lambda i, _entry: i < first)
                more = f"; undo also failed: {'; '.join(errors)}" if errors else "; everything done before it was undone"
                err = ActionFailed(f"{self.rec.domain}: {step.describe()} failed: {failure}{more}")
                if isinstance(e, VstorError):
                    err.exit_code = e.exit_code     # a missing SPDK stays "unavailable"
                raise err from None
            self.rec.steps[-1] = self.x.encode(step, DONE)
            self.state.save(self.rec)
        self.rec.status = final
        self.state.save(self.rec)

    def rollback(self, keep=None) -> list[str]:
        """Undo every recorded step (but those `keep(index, entry)` names),
        newest first; the record goes when empty.  The first undo that fails
        stops the rollback: the steps before it are what it stands on (an
        NVMe controller under a vhost controller QEMU still uses), so they
        stay, recorded, for a later release or gc."""
        self.rec.status = RELEASING
        self.state.save(self.rec)
        # What every other domain holds: a shared controller stays while one uses it.
        others = [r for r in self.state.records() if r.key != self.rec.key]
        errors: list[str] = []
        pending = list(self.rec.steps)
        kept: list[dict] = []
        while pending:
            entry = pending.pop()
            if keep is not None and keep(len(pending), entry):
                kept.insert(0, entry)
                self.rec.steps = pending + kept
                continue
            what = entry.get("kind", "step")
            try:
                step = self.x.decode(entry)
                what = step.describe()
                self.progress(f"undo: {what}")
                self.x.undo(step, self.rt, others)
            except Exception as e:
                errors.append(f"{what}: {_one_line(e)}")
                kept = pending + [entry] + kept
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
