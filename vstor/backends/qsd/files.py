"""Looking at the files around qemu-storage-daemons.  Opening a source is
vstor.host.sources'; socket and directory ownership vstor.backends.ownership's."""

from __future__ import annotations

import os
import stat

from vstor.errors import Unavailable


def same_file(st: os.stat_result, path: str) -> bool:
    """Is `path` the file `st` is?  A path that is gone is not; one vstor
    cannot look at is a refusal, never "not the same"."""
    try:
        other = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise Unavailable(f"cannot tell whether {path} is the same file: {e.strerror}",
                          hint="run vstor as root") from None
    if stat.S_ISBLK(st.st_mode) and stat.S_ISBLK(other.st_mode):
        return st.st_rdev == other.st_rdev
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
