"""What vstor's short runs count for its metrics: each hook phase and how
long it took, each refusal, each daemon restarted, each index rebuilt,
each record gc released.

The hooks run as one process per phase, so nothing can be counted in
memory: each event is one line appended to `<state_dir>/metrics/events`
(O_APPEND, one write(2), under a shared flock(2) of the file, so the
collector can move it aside without losing a line: vstor.metrics.totals).
The collector folds the lines into running totals; this module only
appends.  Like the log, counting never fails a run and costs a run that
counts nothing nothing: the file is opened at the first event.

    <kind> TAB <labels, space-separated> TAB <value> NEWLINE
"""

from __future__ import annotations

import os

EVENTS = "events"
KINDS = ("hook", "refusal", "restart", "rebuild", "gc")
# Lines nobody folded yet stop here: without a collector (the package
# enables none) a refused start looped forever must not fill /run.
MOST = 4 << 20
# A fold moving the file aside holds its lock for a read: a run waits this
# long at most (in 5 ms steps), then counts nothing rather than wait on it.
WAITS = 40
_place = {"dir": None}


def at(state_dir: str | None) -> None:
    """Where this run's events go: set by the entry point once its config
    names the state directory (None: nowhere, e.g. a dry run)."""
    _place["dir"] = os.path.join(state_dir, "metrics") if state_dir else None


def add(kind: str, labels: tuple[str, ...], value: float = 1.0) -> None:
    """One event: `labels` are words (no tab, space or newline)."""
    where = _place["dir"]
    if where is None or kind not in KINDS:
        return
    words = [w if w and not any(c in w for c in " \t\n") else "-" for w in labels]
    line = f"{kind}\t{' '.join(words)}\t{value:.6g}\n".encode()
    try:
        _append(where, line)
    except OSError:         # a count lost never stops a run (the log says what was done)
        pass


def _append(where: str, line: bytes) -> None:
    path = os.path.join(where, EVENTS)
    for _ in range(3):      # the collector moved the file aside between our open and lock
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except FileNotFoundError:
            if not os.path.isdir(os.path.dirname(where)):
                return      # no state directory: nothing vstor holds, nothing to count
            os.makedirs(where, mode=0o700, exist_ok=True)
            continue
        try:
            if not _lock_shared(fd):
                return
            st = os.fstat(fd)
            if st.st_size >= MOST:
                return
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                continue
            os.write(fd, line)
            return
        finally:
            os.close(fd)


def _lock_shared(fd: int) -> bool:
    import fcntl
    import time
    for _ in range(WAITS):
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.005)
    return False

