"""Locks with a deadline: vstor's processes wait for each other, but never forever."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from hashlib import sha256

from vstor.errors import Unavailable


@contextlib.contextmanager
def flocked(path: str, what: str, timeout: float, create: bool = False):
    """Hold an exclusive lock on `path` (a file, or a directory) for the block.
    `what` names the holder in the error when the deadline passes."""
    flags = (os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW) if create else (os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise Unavailable(f"cannot lock {what}: {e.strerror}", hint="run as root") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"{what} stayed locked by another vstor process "
                                      f"for {timeout:g}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


# struct flock on Linux x86-64/arm64: l_type, l_whence (short), l_start,
# l_len (off_t), l_pid (int, 0 for an open file description lock).
_FLOCK = "hhqqi4x"


def _slot(name: str) -> int:
    """A byte of the lock file per name (a collision only makes two names wait
    for each other)."""
    # The same slot in every vstor version: a run of an older one, still
    # going across an upgrade, must exclude a new one.
    return 1 + int.from_bytes(sha256(name.encode()).digest()[:6], "big")


def try_range(fd: int, name: str) -> bool:
    """Take `name`'s byte of an open lock file, exclusively, if it is free."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET,
                                                       _slot(name), 1, 0))
        return True
    except (BlockingIOError, PermissionError):      # EAGAIN, or EACCES on some kernels
        return False


@contextlib.contextmanager
def range_locked(path: str, name: str, what: str, timeout: float):
    """Hold an exclusive lock on one name within the file `path` (created
    0600): one byte of it, as an open file description lock (F_OFD_SETLK).
    Unlike flock there is a lock per name without a file per name, and unlike
    POSIX record locks it belongs to this descriptor alone: another thread
    closing the same file keeps it.  Independent of flock on the same file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise Unavailable(f"cannot lock {path}: {e.strerror}", hint="run as root") from None
    try:
        deadline = time.monotonic() + timeout
        while not try_range(fd, name):
            if time.monotonic() > deadline:
                raise Unavailable(f"{what} stayed locked by another vstor process "
                                  f"for {timeout:g}s")
            time.sleep(0.02)
        yield
    finally:
        os.close(fd)        # releases the byte
