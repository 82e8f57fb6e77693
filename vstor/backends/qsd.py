"""The embedded vhost backend: one qemu-storage-daemon per vstor disk.

A QsdExport names everything about one daemon: the file or block device it
serves, the vhost-user socket QEMU connects to, and its files in the run
directory (`<name>.pid`, `<name>.qmp`).  `start` looks before it creates and
leaves nothing behind when it fails; `stop` is idempotent.  The record
(`to_record`/`from_record`) is all vstor's state directory needs to find the
daemon again after vstor itself has exited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import grp
import os
import pwd
import select
import shlex
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass

from vstor.runtime.locking import flocked
from vstor.errors import ActionFailed, BadInput, DoesNotFit, Unavailable
from vstor.backends.qmp import QmpClient, QmpConnectionError, QmpError

RECORD_VERSION = 1
EXPORT_ID = "exp0"
SOCKET_MAX = 107            # sizeof(sun_path) - 1
NAME_MAX = 96
# '+' is allowed because vstor's disk names are "<domain safe name>-<target>"
# and domain safe names may hold it (vstor.domain); none of these characters
# is special in a path or in a QEMU option string.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")


@dataclass(frozen=True)
class QsdExport:
    run_dir: str
    name: str
    source: str
    kind: str                       # file | block
    socket_path: str
    readonly: bool = False
    queues: int = 1
    qemu_user: str = "libvirt-qemu"
    qemu_group: str = "kvm"
    binary: str = "/usr/bin/qemu-storage-daemon"
    # O_DIRECT for the source; None = decide at start (block devices: yes;
    # files: only where the filesystem accepts O_DIRECT, see _direct_works).
    direct: bool | None = None

    def __post_init__(self):
        _validate(self)

    @property
    def pidfile(self) -> str:
        return os.path.join(self.run_dir, self.name + ".pid")

    @property
    def qmp_path(self) -> str:
        return os.path.join(self.run_dir, self.name + ".qmp")

    # -- the command line (pure) -------------------------------------------------------

    def argv(self) -> list[str]:
        direct = self.kind == "block" or bool(self.direct)
        # aio=native needs O_DIRECT (QEMU refuses it otherwise); without it the
        # thread pool is the only mode that works on every kernel and filesystem.
        node = [f"driver={'host_device' if self.kind == 'block' else 'file'}", "node-name=file0",
                f"filename={_q(self.source)}", f"cache.direct={_on(direct)}",
                f"aio={'native' if direct else 'threads'}"]
        fmt = ["driver=raw", "node-name=disk0", "file=file0"]
        # read-only nodes open the source O_RDONLY and take only a shared lock,
        # so two readonly disks may share one source; writers pass guest TRIM on.
        extra = ["read-only=on"] if self.readonly else ["discard=unmap"]
        export = [f"type=vhost-user-blk,id={EXPORT_ID},node-name=disk0", "addr.type=unix",
                  f"addr.path={_q(self.socket_path)}", f"writable={_on(not self.readonly)}",
                  f"num-queues={self.queues}"]
        return [self.binary,
                "--blockdev", ",".join(node + extra),
                "--blockdev", ",".join(fmt + extra),
                "--export", ",".join(export),
                "--chardev", f"socket,id=qmp0,path={_q(self.qmp_path)},server=on,wait=off",
                "--monitor", "chardev=qmp0",
                "--pidfile", self.pidfile,
                "--daemonize"]

    def dry_run(self) -> list[str]:
        """What start() would run and change, as shell lines."""
        export = self._resolved() if os.path.exists(self.source) else self
        g = self.qemu_group
        return [f"install -d -o root -g {g} -m 0750 {shlex.quote(self.run_dir)}",
                shlex.join(export.argv()),
                f"chown root:{g} {shlex.quote(self.socket_path)}",
                f"chmod 0660 {shlex.quote(self.socket_path)}"]

    # -- the record ----------------------------------------------------------------------

    def to_record(self) -> dict:
        return {"version": RECORD_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_record(cls, rec: dict) -> "QsdExport":
        if not isinstance(rec, dict):
            raise BadInput("qemu-storage-daemon record is not a JSON object")
        if rec.get("version", RECORD_VERSION) != RECORD_VERSION:
            raise ActionFailed(f"qemu-storage-daemon record version {rec.get('version')!r} "
                               "is not one this vstor reads", hint="use the vstor that wrote it")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        missing = sorted(required - rec.keys())
        if missing:
            raise BadInput(f"qemu-storage-daemon record lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in rec.items() if k in names})

    # -- looking -------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The live daemon's pid: the pidfile's, or (pidfile lost) found in /proc."""
        pid = _read_pid(self.pidfile)
        if pid is not None and self._is_ours(pid):
            return pid
        for entry in os.listdir("/proc"):
            if entry.isdigit() and self._is_ours(int(entry)):
                return int(entry)
        return None

    def alive(self) -> bool:
        return self.pid() is not None and self._answers()

    def _is_ours(self, pid: int) -> bool:
        argv = _cmdline(pid)
        return (bool(argv) and os.path.basename(argv[0]) == os.path.basename(self.binary)
                and _after(argv, "--pidfile") == self.pidfile)

    def _answers(self, timeout: float = 2.0) -> bool:
        try:
            with QmpClient(self.qmp_path, timeout) as qmp:
                return any(e.get("id") == EXPORT_ID for e in qmp.execute("query-block-exports"))
        except (QmpConnectionError, QmpError):
            return False

    # -- starting ------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> int:
        """Start the daemon (or take over the one already serving); its pid."""
        self._prepare_run_dir()
        with self._lock():
            pid = self._reuse()
            if pid is not None:
                return pid
            self._remove_files()
            if os.path.lexists(self.socket_path):
                # qsd would unlink whatever is there before binding its socket.
                raise ActionFailed(f"{self.socket_path} exists and is not a socket",
                                   hint="move it away; vstor only replaces sockets")
            self._check_binary()
            self._check_source()
            self._check_no_other_writer()
            _ensure_dir(os.path.dirname(self.socket_path), self._gid())
            export = self._resolved()
            try:
                export._spawn(timeout)
                return export._settle(timeout)
            except BaseException:
                self._kill_and_clean()
                raise

    def restart_if_dead(self, timeout: float = 10.0) -> bool:
        """Bring back a daemon that died (QEMU reconnects with <reconnect>).
        True when it had to be started again."""
        if self.alive():
            return False
        self.start(timeout)
        return True

    def _reuse(self) -> int | None:
        pid = self.pid()
        if pid is None:
            return None
        running = _cmdline(pid)
        if _export_opts(running) != _export_opts(self.argv()):
            raise ActionFailed(f"qemu-storage-daemon {self.name} (pid {pid}) already runs with "
                               f"different options: {_after(running, '--export')}",
                               hint=f"stop it first (vstor gc, or kill {pid})")
        if not self._answers():
            raise ActionFailed(f"qemu-storage-daemon {self.name} (pid {pid}) runs but does not "
                               f"answer on {self.qmp_path}", hint=f"kill {pid}, then retry")
        if not _is_socket(self.socket_path):
            # Someone removed its socket: no client can reach this daemon again.
            self._terminate(pid, 5.0)
            return None
        self._restrict_socket()
        return pid

    def _spawn(self, timeout: float) -> None:
        # qsd reports startup errors on stderr before its parent exits; a file,
        # not a pipe, so a daemon that kept stderr open could never hang us.
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.run(self.argv(), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=err, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise ActionFailed(f"qemu-storage-daemon {self.name} did not finish starting "
                                   f"within {timeout:g}s") from None
            except OSError as e:
                raise Unavailable(f"cannot run {self.binary}: {e.strerror}") from None
            if proc.returncode != 0:
                err.seek(0)
                raise ActionFailed(f"qemu-storage-daemon {self.name} failed to start: "
                                   f"{_last_line(err.read(), proc.returncode)}")

    def _settle(self, timeout: float) -> int:
        """After the daemon forked: its pid, with the socket handed to QEMU."""
        pid = self.pid()
        if pid is None:
            raise ActionFailed(f"qemu-storage-daemon {self.name} exited right after starting")
        deadline = time.monotonic() + timeout
        while not _is_socket(self.socket_path):
            if time.monotonic() > deadline:
                raise ActionFailed(f"qemu-storage-daemon {self.name} created no socket "
                                   f"{self.socket_path} within {timeout:g}s")
            time.sleep(0.01)
        # qsd sets umask 027 when it daemonizes: the socket is born root:root
        # 0750, which only root can connect to, until it is handed to QEMU here.
        self._restrict_socket()
        why = connect_as(self.qemu_user, self.socket_path)
        if why:
            raise ActionFailed(f"{self.qemu_user} cannot connect to {self.socket_path}: {why}",
                               hint=f"every directory above it must be searchable by group "
                                    f"{self.qemu_group}")
        if not self._answers(timeout):
            raise ActionFailed(f"qemu-storage-daemon {self.name} does not list its export "
                               f"on {self.qmp_path}")
        return pid

    # -- stopping ------------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> None:
        """Quit the daemon (QMP quit, then SIGTERM, then SIGKILL) and remove
        its socket, monitor and pidfile.  A daemon already gone is fine."""
        if not os.path.isdir(self.run_dir):
            self._remove_files()
            return
        with self._lock():
            self._kill_and_clean(timeout)

    def _kill_and_clean(self, timeout: float = 5.0) -> None:
        pid = self.pid()
        if pid is not None:
            self._terminate(pid, timeout)
        self._remove_files()

    def _terminate(self, pid: int, timeout: float) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            if not self._is_ours(pid):
                return      # it exited and the pid was reused after we looked
            steps = [(signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)]
            try:
                with QmpClient(self.qmp_path, min(timeout, 2.0)) as qmp:
                    qmp.execute("quit")
                steps.insert(0, (None, timeout))
            except (QmpConnectionError, QmpError):
                steps.insert(0, (None, 0))    # it may have quit before answering
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            for sig, wait in steps:
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, sig)
                if poller.poll(wait * 1000):
                    return      # a pidfd turns readable when its process exits
            raise ActionFailed(f"qemu-storage-daemon {self.name} (pid {pid}) did not exit "
                               "even after SIGKILL", hint="it is stuck in the kernel; see dmesg")
        finally:
            os.close(pidfd)

    def _remove_files(self) -> None:
        for path in (self.pidfile, self.qmp_path, self.socket_path):
            if path == self.pidfile or _is_socket(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # -- the host around it ----------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        _ensure_dir(self.run_dir, self._gid(), enforce=True)

    def _lock(self, timeout: float = 30.0):
        """One vstor at a time starts or stops daemons in a run dir: a second
        qsd started on a live one's files would steal its monitor socket."""
        return flocked(self.run_dir, self.run_dir, timeout)

    def _gid(self) -> int:
        try:
            return grp.getgrnam(self.qemu_group).gr_gid
        except KeyError:
            raise ActionFailed(f"group '{self.qemu_group}' does not exist",
                               hint="set [qemu] group in vstor.conf to the group QEMU runs as") from None

    def _restrict_socket(self) -> None:
        try:
            os.chown(self.socket_path, 0, self._gid(), follow_symlinks=False)
            os.chmod(self.socket_path, 0o660)
        except OSError as e:
            raise ActionFailed(f"cannot restrict socket {self.socket_path}: {e.strerror}") from None

    def _check_binary(self) -> None:
        if not os.access(self.binary, os.X_OK):
            raise Unavailable(f"{self.binary} is not installed (the embedded vhost backend)",
                              hint="apt install qemu-system-common, or use backend='spdk'")

    def _check_source(self) -> None:
        # BadInput: the path comes from the domain's vstor metadata, and the fix
        # is there (or in creating the file), not in the host's resources.
        where = f"<vstor:{self.kind} path='{self.source}'>"
        try:
            st = os.stat(self.source)
        except OSError as e:
            hint = ("create it (qemu-img create -f raw PATH SIZE) or fix " + where
                    if e.errno == errno.ENOENT else None)
            raise BadInput(f"disk source {self.source}: {e.strerror}", hint=hint) from None
        if self.kind == "file" and not stat.S_ISREG(st.st_mode):
            raise BadInput(f"disk source {self.source} is not a regular file",
                           hint="use <vstor:block> for block devices")
        if self.kind == "block" and not stat.S_ISBLK(st.st_mode):
            raise BadInput(f"disk source {self.source} is not a block device",
                           hint="use <vstor:file> for image files")

    def _check_no_other_writer(self) -> None:
        """qsd's exports share every permission on their node, so QEMU's image
        locking lets two daemons write one source: refuse it here."""
        mine = os.stat(self.source)
        for entry in os.listdir("/proc"):
            argv = _cmdline(int(entry)) if entry.isdigit() else []
            if not argv or os.path.basename(argv[0]) != "qemu-storage-daemon":
                continue
            opts = dict(o.split("=", 1) for o in _export_opts(argv) if "=" in o)
            if "filename" not in opts or not _same_file(mine, opts["filename"]):
                continue
            if self.readonly and opts.get("writable") == "off":
                continue        # readers share
            raise DoesNotFit(f"disk source {self.source} is already exported by "
                             f"qemu-storage-daemon pid {entry} ({opts.get('addr.path')})",
                             hint="two writers would corrupt it; make both readonly "
                                  "or stop the other")

    def _resolved(self) -> "QsdExport":
        if self.direct is not None:
            return self
        return dataclasses.replace(self, direct=self.kind == "block" or _direct_works(self.source))


# -- helpers -------------------------------------------------------------------------------

def connect_as(user: str, path: str, timeout: float = 2.0) -> str | None:
    """Connect to a Unix socket with `user`'s uid and groups (in a forked
    child); None when it worked, else the reason (strerror)."""
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
    deadline = time.monotonic() + timeout + 1
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return None if code == 0 else (os.strerror(code) if code < 255 else "unknown error")
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return f"connect did not finish within {timeout:g}s"
        time.sleep(0.005)


def _direct_works(path: str) -> bool:
    """Does the filesystem accept O_DIRECT?  tmpfs before Linux 6.6 (and some
    FUSE filesystems) refuse it with EINVAL, and qsd with cache.direct=on
    would then fail to open the file at all."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _ensure_dir(path: str, gid: int, enforce: bool = False) -> None:
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


def _validate(e: QsdExport) -> None:
    def bad(what: str, hint: str | None = None):
        raise BadInput(f"qemu-storage-daemon export: {what}", hint=hint)

    for field in ("run_dir", "name", "source", "kind", "socket_path", "qemu_user",
                  "qemu_group", "binary"):
        value = getattr(e, field)
        if not isinstance(value, str) or not value or "\0" in value:
            bad(f"{field} must be a non-empty string")
    if not (set(e.name) <= _NAME_CHARS) or ".." in e.name or e.name.startswith(".") \
            or len(e.name) > NAME_MAX:
        bad(f"name {e.name!r} is not safe in a file name",
            hint=f"use up to {NAME_MAX} of A-Z a-z 0-9 _ . + - (no leading '.', no '..')")
    for field in ("run_dir", "source", "socket_path", "binary"):
        path = getattr(e, field)
        if not os.path.isabs(path) or os.path.normpath(path) != path:
            bad(f"{field} {path!r} is not a clean absolute path")
    for path in (e.socket_path, e.qmp_path):
        if len(path.encode()) > SOCKET_MAX:
            bad(f"socket path {path} is longer than a Unix socket allows ({SOCKET_MAX} bytes)",
                hint="shorten the name or the directory")
    if e.kind not in ("file", "block"):
        bad(f"kind {e.kind!r} is neither 'file' nor 'block'")
    if not isinstance(e.queues, int) or isinstance(e.queues, bool) or not 1 <= e.queues <= 1024:
        bad(f"queues {e.queues!r} must be an integer from 1 to 1024")
    if not isinstance(e.readonly, bool) or e.direct not in (None, True, False):
        bad("readonly and direct must be true or false")
    if e.socket_path in (e.pidfile, e.qmp_path):
        bad(f"socket path {e.socket_path} collides with the daemon's own files")


def _same_file(st: os.stat_result, path: str) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    if stat.S_ISBLK(st.st_mode) and stat.S_ISBLK(other.st_mode):
        return st.st_rdev == other.st_rdev
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _q(value: str) -> str:
    """A value inside a QEMU option string: commas are doubled."""
    return value.replace(",", ",,")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _after(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg == option:
            return argv[i + 1]
    return None


def _export_opts(argv: list[str]) -> tuple:
    """What makes two daemons interchangeable for QEMU: the source, the socket,
    and whether the export is writable."""
    blockdev, export = _after(argv, "--blockdev") or "", _after(argv, "--export") or ""
    keep = ("filename=", "addr.path=", "writable=")
    return tuple(sorted(o for o in _split(blockdev) + _split(export) if o.startswith(keep)))


def _split(opts: str) -> list[str]:
    return [part.replace("\0", ",") for part in opts.replace(",,", "\0").split(",")]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []       # gone (a zombie reads as empty too)
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _last_line(raw: bytes, code: int) -> str:
    lines = [ln.strip() for ln in raw.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {code}, no message"


def stop_orphan(pidfile: str, timeout: float = 5.0) -> bool:
    """Stop a qemu-storage-daemon no vstor record owns (`vstor gc`), found by
    its pidfile; only a process whose own --pidfile is that file is touched.
    True when one was stopped."""
    pid = _read_pid(pidfile)
    argv = _cmdline(pid) if pid else []
    if not argv or _after(argv, "--pidfile") != pidfile:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)      # stale: its daemon is long gone
        return False
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, sig)
            if poller.poll(timeout * 1000):
                break
    finally:
        os.close(pidfd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pidfile)
    return True
