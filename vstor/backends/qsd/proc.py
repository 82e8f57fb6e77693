"""Processes as qemu-storage-daemon's control sees them: /proc, pidfiles,
pidfds and signals, and a connection tried as another user."""

from __future__ import annotations

import contextlib
import os
import pwd
import select
import signal
import threading
import time
from collections.abc import Iterator

from vstor.errors import ActionFailed


def pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def pids_of(binary: str, since: float | None = None) -> list[int]:
    """look(binary, since)'s pids."""
    return list(look(binary, since)[1])


def look(binary: str, since: float | None = None) -> tuple[float, tuple[int, ...]]:
    """(when the look began, the pids that may run `binary`): those whose
    /proc/PID/exe names it (by its file name), one readlink each instead of
    reading every process's cmdline.  A process whose exe cannot be read for any reason
    but its absence (kernel threads, zombies, the gone) is included: the
    caller reads its cmdline, as for the others.

    `since` (a time.monotonic()): a look another thread began after it is as
    good as a new one, and is taken instead (the hook starts a domain's
    daemons side by side, each of which looks; one look then serves them).
    Looks are made one at a time."""
    name = os.path.basename(binary)
    with _LOOK_LOCK:
        last = _LOOKS.get(name)
        if since is not None and last is not None and last[0] >= since:
            return last
        began = time.monotonic()
        found = []
        for pid in pids():
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except FileNotFoundError:
                continue
            except OSError:
                found.append(pid)
                continue
            if os.path.basename(exe.removesuffix(" (deleted)")) == name:
                found.append(pid)
        _LOOKS[name] = (began, tuple(found))
        return _LOOKS[name]


_LOOKS: dict[str, tuple[float, tuple[int, ...]]] = {}
_LOOK_LOCK = threading.Lock()


def which(name: str) -> str | None:
    """shutil.which without shutil's import (bz2, lzma, fnmatch: more than a
    hook's daemon start should pay), and without the empty PATH entry that
    would mean the working directory."""
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory, name)
        if directory and os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []       # gone (a zombie reads as empty too)
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def unix_peers(path: str, since: float | None = None) -> int:
    """Clients connected to the Unix socket bound at `path` (its accepted,
    connected sockets in /proc/net/unix).  A table vstor cannot read is a
    refusal, never "nobody connected".  `since` (a time.monotonic()): a
    read of the table begun after it serves, as pids_of's look does."""
    from vstor.errors import Unavailable
    with _LOOK_LOCK:
        last = _PEERS[0]
        if since is not None and last is not None and last[0] >= since:
            return last[1].get(path, 0)
        began = time.monotonic()
        count: dict[str, int] = {}
        try:
            with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
                next(f, None)
                for line in f:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and fields[5] == "03":
                        name = fields[7].rstrip("\n")
                        count[name] = count.get(name, 0) + 1
        except OSError as e:
            raise Unavailable(f"cannot read /proc/net/unix: {e.strerror}",
                              hint="vstor needs it to tell whether QEMU still uses a disk") from None
        _PEERS[0] = (began, count)
        return count.get(path, 0)


_PEERS: list = [None]       # the last read of /proc/net/unix: (when it began, peers by path)


def socket_path_of(pid: int, fd: str, here_only: bool = False) -> str | None:
    """The name the Unix socket held as descriptor `fd` by process `pid` was
    bound to, matched by inode in /proc/net/unix: this network namespace's
    first (vstor binds every socket it hands a daemon here, and a confined
    daemon runs in a namespace of its own), then the process's own (a
    daemon of another namespace, unless `here_only`); or None.  How a
    daemon given its listening socket (addr.type=fd) is matched to the
    name QEMU connects to."""
    from vstor.errors import Unavailable
    try:
        inode = str(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    except OSError as e:
        raise Unavailable(f"cannot look at descriptor {fd} of pid {pid}: {e.strerror}",
                          hint="run vstor as root") from None
    for table in ("/proc/self/net/unix",) + (() if here_only else (f"/proc/{pid}/net/unix",)):
        try:
            with open(table, encoding="utf-8", errors="replace") as f:
                next(f, None)
                for line in f:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and fields[6] == inode:
                        return fields[7].rstrip("\n")
        except FileNotFoundError:
            return None         # it exited
        except OSError as e:
            raise Unavailable(f"cannot read {table}: {e.strerror}", hint="run vstor as root") from None
    return None


def read_pid(path: str) -> int | None:
    """The pid a pidfile holds, or None.  A confined daemon may write its
    own pidfile: anything but a few ASCII digits naming a possible pid is
    no pid (never a traceback, never a read of a file grown huge)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(32).strip()
    except OSError:
        return None
    if not (raw.isdigit() and raw.isascii() and len(raw) <= 10):
        return None
    pid = int(raw)
    return pid if 0 < pid <= 4194304 else None       # PID_MAX_LIMIT


@contextlib.contextmanager
def pidfd(pid: int) -> Iterator[int | None]:
    """A pidfd for `pid` (None when it is gone): signals sent through it can
    never reach a process that reused the pid after we looked."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def signal_until_gone(fd: int, steps: list[tuple[signal.Signals | None, float]]) -> bool:
    """For each (signal or None, seconds): send it, then wait that long for
    the process to exit.  True as soon as it has."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    for sig, wait in steps:
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, sig)
        if poller.poll(wait * 1000):
            return True     # a pidfd turns readable when its process exits
    return False


def exits_within(pid: int, timeout: float) -> bool:
    """Whether our child `pid` exits within `timeout`, woken by its pidfd
    (Popen's own wait with a timeout polls with sleeps of up to 50 ms);
    the caller reaps it."""
    with pidfd(pid) as fd:
        return fd is None or signal_until_gone(fd, [(None, timeout)])


def connect_as(user: str, path: str, timeout: float = 2.0) -> str | None:
    """Connect to a Unix socket with `user`'s uid and groups (in a forked
    child); None when it worked, else the reason (strerror)."""
    # Imported here (a release, every hook's, never connects), and in the
    # parent: a child forked from threads must not import (another thread
    # may have held a module's import lock at the fork).
    import socket
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ActionFailed(f"user '{user}' does not exist",
                           hint="set [qemu] user in vstor.conf to the user QEMU runs as") from None
    groups = os.getgrouplist(user, pw.pw_gid)
    child = os.fork()
    if child == 0:      # pragma: no cover (runs in the child)
        code = 0
        try:
            os.setgroups(groups)
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
        except OSError as e:
            code = e.errno if e.errno and e.errno < 255 else 255
        except BaseException:
            code = 255
        os._exit(code)
    if not exits_within(child, timeout + 1):
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        return f"connect did not finish within {timeout:g}s"
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else (os.strerror(code) if code < 255 else "unknown error")


def reachable(user: str, path: str) -> str | None:
    """connect_as(user, path), or None when `user` already reached a socket
    in the same directory, through directories with the very same owner,
    mode and ACL, in this process: the sockets' own owner and mode are set
    alike (daemon._settle), so only the path could differ.  One fork per
    domain's directory instead of one per daemon.  (Not the directories'
    ctime: each new socket moves its directory's.)"""
    chain, where = [], os.path.dirname(path)
    while True:
        st = os.stat(where)
        try:
            acl = os.getxattr(where, "system.posix_acl_access")
        except OSError:
            acl = None      # none (ENODATA), or a filesystem without ACLs
        chain.append((st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_gid, acl))
        if where == os.path.dirname(where):
            break
        where = os.path.dirname(where)
    key = (user, tuple(chain))
    with _REACHED_LOCK:
        if key in _REACHED:
            return _listens(path)   # the path is known good: that a daemon listens, without a fork
        why = connect_as(user, path)
        if why is None:
            _REACHED.add(key)
        return why


def _listens(path: str, timeout: float = 2.0) -> str | None:
    """Connect to the socket (as whoever runs vstor); None when it worked."""
    import socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
        return None
    except OSError as e:
        return e.strerror or str(e)


_REACHED: set = set()
_REACHED_LOCK = threading.Lock()
