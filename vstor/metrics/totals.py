"""The running totals of vstor's events (vstor.counters): the lines the
hooks and commands appended, folded into `<state_dir>/metrics/totals.json`.

Folding reads the events file from where the last fold stopped (its
inode and offset are in the totals), under `<state_dir>/metrics/lock`,
so a scrape endpoint and a textfile timer never count a line twice.
Past ROTATE bytes the fold takes the file's lock exclusively (every
append holds it shared for its one write), reads the rest, and renames it
aside: an append that opened it before sees the name now names another
file and opens the new one (vstor.counters._append).  Totals only grow,
as Prometheus's counters must; a totals file that cannot be read is a
refusal, never zeros.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os

from vstor.atomic import write_file
from vstor.counters import EVENTS
from vstor.errors import Unavailable

ROTATE = 1 << 20
# vstor_hook_duration_seconds' buckets: a start's prepare takes 0.1-0.3 s,
# one waiting for an SPDK attach or a daemon's socket several seconds.
BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FORMAT = 1


def empty() -> dict:
    return {"format": FORMAT, "inode": None, "offset": 0, "counts": {}, "durations": {}}


def fold(state_dir: str) -> dict:
    """The totals with every event appended so far counted in, written
    back.  Without a state directory: nothing was ever counted."""
    where = os.path.join(state_dir, "metrics")
    try:
        os.stat(state_dir)
    except FileNotFoundError:
        return empty()
    except OSError as e:
        raise Unavailable(f"cannot read vstor's state directory {state_dir}: {e.strerror}",
                          hint="run as root (the state directory is root's)") from None
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        with _locked(os.path.join(where, "lock")):
            totals = _read(os.path.join(where, "totals.json"))
            changed = _fold_file(where, totals)
            if changed:
                write_file(os.path.join(where, "totals.json"), json.dumps(totals, sort_keys=True) + "\n",
                           mode=0o600)
            return totals
    except OSError as e:
        raise Unavailable(f"cannot fold vstor's event counts in {where}: {e.strerror}",
                          hint="run as root (the state directory is root's)") from None


def _fold_file(where: str, totals: dict) -> bool:
    path = os.path.join(where, EVENTS)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        start = totals["offset"] if totals["inode"] == [st.st_dev, st.st_ino] else 0
        if st.st_size <= start:
            return False
        rotate = st.st_size >= ROTATE
        if rotate:
            fcntl.flock(fd, fcntl.LOCK_EX)      # no append is half-way; none starts on it now
        f.seek(start)
        data = f.read()
        whole = data[:data.rfind(b"\n") + 1]   # a line being written is counted next time
        if rotate:
            whole = data                        # every append has finished: all of it
            os.replace(path, path + ".old")
            totals.update(inode=None, offset=0)
        else:
            totals.update(inode=[st.st_dev, st.st_ino], offset=start + len(whole))
    for line in whole.decode(errors="replace").splitlines():
        count(totals, line)
    return True


def count(totals: dict, line: str) -> None:
    """One event line into the totals; a line that is not one is skipped
    (the file is root's, written only by vstor.counters)."""
    parts = line.split("\t")
    if len(parts) != 3:
        return
    kind, labels, value = parts
    try:
        v = float(value)
    except ValueError:
        return
    key = f"{kind}\t{labels}"
    totals["counts"][key] = totals["counts"].get(key, 0) + (1 if kind == "hook" else v)
    if kind == "hook":
        phase = labels.rsplit(" ", 1)[0]       # "<entry> <phase> <result>": by entry and phase
        d = totals["durations"].setdefault(phase, {"buckets": [0] * len(BUCKETS), "sum": 0.0, "count": 0})
        for i, le in enumerate(BUCKETS):
            if v <= le:
                d["buckets"][i] += 1
        d["sum"] += v
        d["count"] += 1


def _read(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return empty()
    except (OSError, ValueError) as e:
        raise Unavailable(f"cannot read vstor's event totals {path}: {e}",
                          hint=f"move {path} aside: counting starts again from zero") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Unavailable(f"{path} is not vstor's event totals",
                          hint=f"move {path} aside: counting starts again from zero")
    return data


@contextlib.contextmanager
def _locked(path: str):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
