"""Whether the records' directory changed behind vstor's back (a record
put there or removed by hand), without listing it at every run: vstor
marks the directory's mtime after each change it makes there, with a value
no change makes (a moment in 2000, to the nanosecond at random), and keeps
the mark (in sums.json, or in `stamp` for a record written without the
host lock).  Any entry made, replaced or removed there since sets the
mtime to the clock's now, so a directory whose mtime is not a mark kept is
listed, and its names compared with the index's keys.  (The mtime alone,
unmarked, would not do: the kernel's file times follow a coarse clock, and
two changes within its tick leave one mtime.)  vstor marks again after it
saved or removed a record only if the directory was as marked just before
(StateDir._write, _unlink), and marks before it lists the names: what a
hand changes meanwhile (a save's temporary file written and synced:
milliseconds on a disk, much less on /run's tmpfs) goes unseen until gc's
check, which lists everything."""

from __future__ import annotations

import contextlib
import os

from vstor.runtime.recordfile import read_json, read_text, write_text

EPOCH = 946684800 * 10**9      # 2000-01-01, in ns


def now(domains: str) -> str:
    try:
        st = os.stat(domains)
    except FileNotFoundError:
        return "none"
    return f"{st.st_ino}:{st.st_mtime_ns}"


def mark(domains: str) -> str:
    """Mark the directory; the stamp."""
    try:
        st = os.stat(domains)
        os.utime(domains, ns=(st.st_atime_ns, EPOCH + int.from_bytes(os.urandom(6), "big")))
    except OSError:
        return "unknown"
    return now(domains)


def saved(index: str) -> str | None:
    try:
        return read_text(os.path.join(index, "stamp"))
    except (OSError, ValueError):      # damaged: as if none
        return None


def marked(domains: str, index: str) -> bool:
    """The directory is as vstor last marked it."""
    here = now(domains)
    if here == saved(index):
        return True
    try:
        return here == read_json(os.path.join(index, "sums.json")).get("stamp")
    except (OSError, ValueError, AttributeError):
        return False


def keep(index: str, stamp: str) -> None:
    """Keep the stamp a mark gave, beside the index (best effort: two
    writers at once may keep one the directory no longer has; the next run
    then lists it)."""
    with contextlib.suppress(OSError):
        write_text(os.path.join(index, "stamp"), stamp, shared=True)
