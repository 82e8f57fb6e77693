"""The files around one qemu-storage-daemon: its source, its directories and
the vhost-user socket handed to QEMU's group."""

from __future__ import annotations

import errno
import grp
import os
import stat

from vstor.backends.qsd.export import QsdExport
from vstor.errors import ActionFailed, BadInput


def gid(export: QsdExport) -> int:
    try:
        return grp.getgrnam(export.qemu_group).gr_gid
    except KeyError:
        hint = "set [qemu] group in vstor.conf to the group QEMU runs as"
        raise ActionFailed(f"group '{export.qemu_group}' does not exist", hint=hint) from None


def restrict_socket(export: QsdExport) -> None:
    try:
        os.chown(export.socket_path, 0, gid(export), follow_symlinks=False)
        os.chmod(export.socket_path, 0o660)
    except OSError as e:
        raise ActionFailed(f"cannot restrict socket {export.socket_path}: {e.strerror}") from None


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


def ensure_dir(path: str, gid: int, enforce: bool = False) -> None:
    """root:<gid> 0750.  An existing directory is only changed when `enforce`:
    the socket's directory may be one the operator chose and shares."""
    if os.path.isdir(path) and not enforce:
        return
    os.makedirs(path, mode=0o750, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ActionFailed(f"{path} is not a directory", hint="move it away")
    try:
        os.chown(path, 0, gid)
        os.chmod(path, 0o750)
    except OSError as e:
        raise ActionFailed(f"cannot restrict directory {path}: {e.strerror}") from None


def same_file(st: os.stat_result, path: str) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    if stat.S_ISBLK(st.st_mode) and stat.S_ISBLK(other.st_mode):
        return st.st_rdev == other.st_rdev
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
