"""The files around one qemu-storage-daemon: its source and how it is read.
Socket and directory ownership is vstor.backends.ownership's."""

from __future__ import annotations

import errno
import os
import stat

from vstor.backends.qsd.export import QsdExport
from vstor.errors import BadInput, Unavailable


def check_source(export: QsdExport) -> None:
    # BadInput: the path comes from the domain's vstor metadata, and the fix
    # is there (or in creating the file), not in the host's resources.
    where = f"<vstor:{export.kind} path='{export.source}'>"
    try:
        st = os.stat(export.source)
    except OSError as e:
        hint = ("create it (qemu-img create -f raw PATH SIZE) or fix " + where
                if e.errno == errno.ENOENT else None)
        raise BadInput(f"disk source {export.source}: {e.strerror}", hint=hint) from None
    if export.kind == "file" and not stat.S_ISREG(st.st_mode):
        raise BadInput(f"disk source {export.source} is not a regular file",
                       hint="use <vstor:block> for block devices")
    if export.kind == "block" and not stat.S_ISBLK(st.st_mode):
        raise BadInput(f"disk source {export.source} is not a block device",
                       hint="use <vstor:file> for image files")


def direct_works(path: str) -> bool:
    """Does the filesystem accept O_DIRECT?  tmpfs before Linux 6.6 (and some
    FUSE filesystems) refuse it with EINVAL, and qsd with cache.direct=on
    would then fail to open the file at all."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


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
