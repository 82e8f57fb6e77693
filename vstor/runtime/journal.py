"""Doing host changes so that every one can be undone.

The journal writes each step (a typed record, vstor.runtime.actions) into the
domain's state record (state 'doing') before doing it and marks it 'done'
after; on a failure it undoes, in reverse, everything the record holds.  Undo
must therefore cope with a step that was only half done.  What a step does is
the executor's (vstor.runtime.executor, or a test's own).

Consecutive steps of a kind the executor lists in PARALLEL (one
qemu-storage-daemon per disk: independent of each other) form a group: all
written 'doing' at once, done side by side, each marked as it ends; undone
side by side too.  A failure in a group is a failure of the run, after the
group's other steps ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vstor import log
from vstor.errors import ActionFailed, InUse, Unavailable, VstorError
from vstor.runtime.holders import holders_of
from vstor.runtime.state import PREPARED, RELEASING, Record, StateDir

DOING, DONE = "doing", "done"


class Journal:
    """Runs steps for one domain's record, under the state directory's lock
    (the caller holds it)."""

    def __init__(self, state: StateDir, rec: Record, rt, progress: Callable[[str], None] | None = None,
                 executor=None):
        if executor is None:
            from vstor.runtime import executor
        self.state = state
        self.rec = rec
        self.rt = rt
        self._progress = progress or (lambda _msg: None)
        self.x = executor
        self.failures: list[BaseException] = []     # what the last rollback's undos raised

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
        groups = self._groups(steps)
        for n, group in enumerate(groups, 1):
            at = len(self.rec.steps)
            if any(getattr(step, "rpc_methods", ()) for step in group):
                self.rec.spdk_socket = self.rt.cfg.spdk_socket   # its undo asks the same SPDK
            self.rec.steps += [self.x.encode(step, DOING) for step in group]
            self.state.save(self.rec)
            for step in group:
                self.progress(step.describe())
            failed = None
            for i, (step, error) in enumerate(zip(group, self._all(self.x.do, group))):
                if error is None:
                    self.rec.steps[at + i] = self.x.encode(step, DONE)
                    log.change(self.rec.domain, step.describe(), log.DONE)
                else:
                    log.change(self.rec.domain, step.describe(), log.FAILED, _one_line(error))
                    if failed is None:
                        failed = step, error
            if failed is not None:
                step, e = failed
                errors = self.rollback(keep=lambda i, _entry: i < first)
                more = f"; undo also failed: {'; '.join(errors)}" if errors else "; everything done before it was undone"
                err = ActionFailed(f"{self.rec.domain}: {step.describe()} failed: {_one_line(e)}{more}")
                if isinstance(e, VstorError):
                    err.exit_code = e.exit_code     # a missing SPDK stays "unavailable"
                raise err from None
            if n < len(groups):
                self.state.save(self.rec)
        self.rec.status = final
        self.state.save(self.rec)       # with the last group's steps marked done

    def _parallel(self, kind) -> bool:
        return kind in getattr(self.x, "PARALLEL", ())

    def _groups(self, steps: list) -> list[list]:
        out: list[list] = []
        for step in steps:
            if out and self._parallel(step.kind) and self._parallel(out[-1][-1].kind):
                out[-1].append(step)
            else:
                out.append([step])
        return out

    def _all(self, fn, group: list, *args, side_by_side: bool = True) -> list[BaseException | None]:
        """fn(step, rt, *args) for each step of the group, side by side when
        there are several (and `side_by_side`); the exception of each (None
        when it went well).  An interrupt (KeyboardInterrupt) is raised, not
        returned."""
        def one(step):
            try:
                fn(step, self.rt, *args)
                return None
            except Exception as e:      # noqa: BLE001 (reported per step)
                return e
        if len(group) == 1 or not side_by_side:
            return [one(step) for step in group]
        out: list[BaseException | None] = [None] * len(group)
        errors: list[BaseException] = []

        def run(i):
            try:
                out[i] = one(group[i])
            except BaseException as e:      # an interrupt: raised below, after the others end
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,), name=f"vstor-step-{i}")
                   for i in range(len(group))]
        for t in threads:
            t.start()
        interrupted = None
        for t in threads:
            while True:         # an interrupt waits for every step of the group to end
                try:
                    t.join()
                    break
                except BaseException as e:  # noqa: BLE001 (raised below, after the others end)
                    interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
        if errors:
            raise errors[0]
        return out

    def rollback(self, keep=None, steps: list | None = None) -> list[str]:
        """Undo every recorded step (but those `keep(index, entry)` names),
        newest first; the record goes when empty.  The first undo that fails
        stops the rollback: the steps before it are what it stands on (an
        NVMe controller under a vhost controller QEMU still uses), so they
        stay, recorded, for a later release or gc.  `steps`: the record's
        entries as the caller decoded them (recorded.check_releasable), one
        each, None for one it could not: not decoded again."""
        self.rec.status = RELEASING
        self.state.save(self.rec)
        # What every other domain holds: a shared controller stays while one
        # uses it.  With a damaged record nobody can tell, so only what is
        # the domain's own alone is undone (_undo_all).
        others = holders_of(self.state, self.rec.key)
        errors: list[str] = []
        self.failures = []
        pending = list(self.rec.steps)
        if steps is None or len(steps) != len(pending):
            steps = [None] * len(pending)
        kept: list[dict] = []
        while pending:      # the entry popped is pending[len(pending)] of the record as it began
            entry = pending.pop()
            if keep is not None and keep(len(pending), entry):
                kept.insert(0, entry)
                self.rec.steps = pending + kept
                continue
            # This entry and the ones before it of a parallel kind, not kept: undone side by side.
            group, decoded = [entry], [steps[len(pending)]]
            while (pending and self._parallel(entry.get("kind"))
                   and self._parallel(pending[-1].get("kind"))
                   and not (keep is not None and keep(len(pending) - 1, pending[-1]))):
                group.append(pending.pop())
                decoded.append(steps[len(pending)])
            failed = []
            for item, (what, error) in zip(group, self._undo_all(group, others, decoded)):
                log.change(self.rec.domain, what, log.UNDONE if error is None else log.UNDO_FAILED,
                           None if error is None else _one_line(error))
                if error is not None:
                    errors.append(f"{what}: {_one_line(error)}")
                    self.failures.append(error)
                    failed.insert(0, item)
            if failed:
                kept = pending + failed + kept
                pending = []
            # Saved after every undo (group): a crash here leaves an exact record.
            self.rec.steps = pending + kept
            if self.rec.steps:
                self.state.save(self.rec)
        if not self.rec.steps:
            self.state.remove(self.rec.key)
        return errors

    def _undo_all(self, group: list[dict], others,
                  decoded: list | None = None) -> list[tuple[str, BaseException | None]]:
        """Undo each entry (side by side when several): (what, error) each.
        `decoded`: the entries' steps where the caller has them (else None)."""
        steps, out = [], []
        for entry, step in zip(group, decoded or [None] * len(group)):
            if step is None:
                try:
                    step = self.x.decode(entry)
                except Exception as e:      # noqa: BLE001 (an unreadable step stays recorded)
                    steps.append(None)
                    out.append((entry.get("kind", "step"), e))
                    continue
            if step.kind not in getattr(self.x, "PRIVATE", ()) and others.damaged:
                from vstor.runtime.state import DamagedRecord
                steps.append(None)
                out.append((step.describe(), DamagedRecord(
                    f"left: another domain may still use it, and {others.damaged[0]}")))
                continue
            steps.append(step)
            out.append((step.describe(), None))
            self.progress(f"undo: {step.describe()}")
        todo = [s for s in steps if s is not None]
        waits = getattr(self.x, "undo_waits", None)
        results = iter(self._all(self.x.undo, todo, others,
                                 side_by_side=waits is None or any(waits(s, self.rt) for s in todo)))
        return [(what, error if step is None else next(results))
                for (what, error), step in zip(out, steps)]


def undo_failed(journal: Journal, message: str, hint: str) -> VstorError:
    """The error for a rollback that left steps recorded: in use (exit 3)
    when every undo that failed found QEMU still connected, as a release
    refused up front is; unavailable (4) when each was refused for what
    cannot be read (SPDK gone, a damaged record); otherwise a failed host
    change."""
    failures = journal.failures
    for cls in (InUse, Unavailable):
        if failures and all(isinstance(e, cls) for e in failures):
            return cls(message, hint=hint)
    return ActionFailed(message, hint=hint)


def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, VstorError) else (str(e) or type(e).__name__)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__
