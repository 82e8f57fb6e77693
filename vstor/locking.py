"""flock(2) with a deadline: vstor's processes wait for each other, but never forever."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from vstor.errors import Unavailable


@contextlib.contextmanager
def flocked(path: str, what: str, timeout: float, create: bool = False):
    """Hold an exclusive lock on `path` (a file, or a directory) for the block.
    `what` names the holder in the error when the deadline passes."""
    flags = (os.O_RDWR | os.O_CREAT) if create else (os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    fd = os.open(path, flags, 0o600)
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
