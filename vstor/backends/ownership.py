"""Who may reach what vstor hands to QEMU: vhost-user sockets root:<qemu
group> 0660, their directories root:<qemu group> 0750, and the prepared
mark QEMU reads first root:<qemu group> 0640.  The one place
ownership is set: never through a symlink, never on anything but a socket or
a directory, and a missing group is an error, not a silent skip."""

from __future__ import annotations

import grp
import os
import stat

from vstor.errors import ActionFailed
from vstor.meta.names import GATE_TEXT


def qemu_gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ActionFailed(f"group '{group}' does not exist",
                           hint="set [qemu] group in vstor.conf to the group QEMU runs as") from None


def restrict_socket(path: str, group: str) -> None:
    """The QEMU user's group may connect, nobody else: root:<group> 0660."""
    _hand_over(path, group, stat.S_ISSOCK, "a socket", 0o660)


def ensure_dir(path: str, group: str, enforce: bool = True) -> None:
    """root:<group> 0750: QEMU can reach sockets inside, other users cannot.
    An existing directory is only changed when `enforce` (a socket directory
    may be one the operator chose and shares)."""
    qemu_gid(group)
    if os.path.isdir(path) and not os.path.islink(path) and not enforce:
        return
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
    except OSError as e:
        raise ActionFailed(f"cannot make directory {path}: {e.strerror}") from None
    _hand_over(path, group, stat.S_ISDIR, "a directory", 0o750)


def mark(path: str, group: str, text: str = GATE_TEXT) -> None:
    """vstor's prepared mark at `path` (vstor.meta.names.gate_path), which
    QEMU reads: root:<group> 0640 in a directory made as for sockets; never
    written through a symbolic or hard link; one already there is written again."""
    ensure_dir(os.path.dirname(path), group, enforce=False)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o640)
    except OSError as e:
        raise ActionFailed(f"cannot write {path}: {e.strerror}",
                           hint="move away what is there; vstor writes its mark there") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ActionFailed(f"{path} is not a regular file", hint="move it away")
        if st.st_nlink != 1:    # a hard link planted there names another file too
            raise ActionFailed(f"{path} is a hard link ({st.st_nlink} names)", hint="move it away")
        os.ftruncate(fd, 0)
        os.write(fd, text.encode())
        os.fchown(fd, 0, qemu_gid(group))
        os.fchmod(fd, 0o640)
    except OSError as e:
        raise ActionFailed(f"cannot write {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def marked(path: str, text: str = GATE_TEXT) -> bool:
    """Is vstor's mark at `path` (a regular file holding what vstor writes)?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(text) + 1) == text.encode()
    finally:
        os.close(fd)


def unmark(path: str) -> None:
    """Remove vstor's mark; anything else at `path` is not vstor's and stays."""
    if marked(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ActionFailed(f"cannot remove {path}: {e.strerror}") from None


def _hand_over(path: str, group: str, is_kind, kind: str, mode: int) -> None:
    gid = qemu_gid(group)
    try:
        if not is_kind(os.lstat(path).st_mode):
            raise ActionFailed(f"{path} is not {kind}", hint="move it away; vstor only hands out "
                               "sockets and their directories")
        os.chown(path, 0, gid, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as e:
        raise ActionFailed(f"cannot restrict {kind} {path}: {e.strerror}") from None


def listening_socket(path: str, group: str | None):
    """The vhost-user socket at `path`, made by vstor itself: bound,
    root:<group> 0660 (group None: root's alone, 0600, as a daemon's QMP
    monitor is), and only then listening (before listen() a connect is
    refused, so nobody reaches it with the wrong owner).  Its directory must
    be one only root can change (root's, not writable by group or others):
    between bind() and the chown nobody else can swap the name.  A stale
    socket of that name (a daemon that died) is removed first; anything else
    there is refused.  The caller hands the listening socket to the daemon
    (qemu-storage-daemon's addr.type=fd) and closes its own copy."""
    import socket
    gid, mode = (qemu_gid(group), 0o660) if group is not None else (0, 0o600)
    where = os.path.dirname(path)
    st = os.lstat(where)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise ActionFailed(f"socket directory {where} is not root's alone (owner uid {st.st_uid}, "
                           f"mode {stat.S_IMODE(st.st_mode):04o})",
                           hint=f"chown root {where} && chmod go-w {where}; or set [paths] vhost_dir "
                                "to a directory only root can write")
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            raise ActionFailed(f"{path} exists and is not a socket",
                               hint="move it away; vstor only replaces sockets")
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        sock.bind(path)
        bound = True
        os.chown(path, 0, gid, follow_symlinks=False)
        os.chmod(path, mode)
        sock.listen(16)
    except OSError as e:
        sock.close()
        if bound:
            with _suppress():
                os.unlink(path)
        raise ActionFailed(f"cannot make socket {path}: {e.strerror}") from None
    except BaseException:
        sock.close()
        if bound:
            with _suppress():
                os.unlink(path)
        raise
    return sock


def _suppress():
    import contextlib
    return contextlib.suppress(OSError)
