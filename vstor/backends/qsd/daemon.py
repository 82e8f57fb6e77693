"""Starting, finding, checking and stopping the qemu-storage-daemon of one
QsdExport.

`start` looks before it creates and leaves nothing behind when it fails;
`stop` is idempotent.  The daemon is found again by its pidfile, or (pidfile
lost) by its own `--pidfile` argument in /proc, so nothing but the export's
record needs to outlive vstor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from vstor import records
from vstor.backends import ownership
from vstor.backends.qsd import aio, files, grant, proc, served
from vstor.backends.qsd.export import EXPORT_ID, QsdExport, option_value, export_opts
from vstor.backends.qsd.proc import connect_as
from vstor.errors import ActionFailed, BadInput, Unavailable
from vstor.host import sources
from vstor.locking import range_locked

__all__ = ["alive", "connect_as", "dry_run", "held_source", "pid", "restart_if_dead", "start", "stop",
           "stop_orphan"]


# -- looking ---------------------------------------------------------------------------------

def pid(export: QsdExport, among: list[int] | None = None, since: float | None = None) -> int | None:
    """The live daemon's pid: the pidfile's, or (pidfile lost) found in /proc
    (among the pids the caller found running that binary, if it looked; by
    a look made after `since`, see proc.pids_of)."""
    found = proc.read_pid(export.pidfile)
    if found is not None and _is_ours(export, found):
        return found
    if among is None and since is not None:
        return _by_pidfile(export.binary, since).get(export.pidfile)
    pids = proc.pids_of(export.binary) if among is None else among
    return next((p for p in pids if _is_ours(export, p)), None)


def _by_pidfile(binary: str, since: float) -> dict[str, int]:
    """The daemons of a look through /proc made after `since`, by their own
    --pidfile, each one's command line read once for the look: gc stops
    thousands of daemons on one look, with every daemon of the running
    domains in it.  A pid that ended and was reused since the look is
    checked again, under its pidfd, before it is signalled (_terminate)."""
    began, pids = proc.look(binary, since)
    last = _PIDFILES[0]
    if last is not None and last[0] == (binary, began):
        return last[1]
    found: dict[str, int] = {}
    for p in pids:
        argv = proc.cmdline(p)
        if argv and os.path.basename(argv[0]) == os.path.basename(binary):
            found.setdefault(option_value(argv, "--pidfile"), p)
    _PIDFILES[0] = ((binary, began), found)
    return found


_PIDFILES: list = [None]    # ((binary, when its look began), its daemons by --pidfile)


def alive(export: QsdExport) -> bool:
    return pid(export) is not None and _answers(export)


def dry_run(export: QsdExport, roots=(), kernel_name=None) -> list[str]:
    """What start() would run and change, as shell lines, with `direct`
    decided as start() would decide it (when the source opens as start()
    would open it; the runtime's preflight refuses one that does not)."""
    try:
        with _open(export, roots, kernel_name) as src:
            return _resolved(export, src).dry_run_lines(roots)
    except BadInput:
        return export.dry_run_lines(roots)


def _is_ours(export: QsdExport, p: int) -> bool:
    argv = proc.cmdline(p)
    return (bool(argv) and os.path.basename(argv[0]) == os.path.basename(export.binary)
            and option_value(argv, "--pidfile") == export.pidfile)


def _answers(export: QsdExport, timeout: float = 2.0) -> bool:
    # QEMU's QMP library is asyncio: imported only when a daemon is asked.
    from vstor.backends.qsd.monitor import Monitor, QmpConnectionError, QmpError
    # qsd now and then hangs up on a client between its greeting and the
    # capabilities reply (seen in CI: ECONNRESET in negotiation, the daemon
    # fine), so a refused connection is tried again until the deadline.
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Monitor(export.qmp_path, max(deadline - time.monotonic(), 0.1)) as qmp:
                exports = qmp.execute("query-block-exports")
            # The daemon's own answer: a taken-over daemon may answer anything.
            return isinstance(exports, list) and any(
                isinstance(e, dict) and e.get("id") == EXPORT_ID for e in exports)
        except QmpError:
            return False
        except QmpConnectionError:
            if time.monotonic() + 0.05 >= deadline:
                return False
            time.sleep(0.05)


# -- starting --------------------------------------------------------------------------------

def start(export: QsdExport, roots=(), kernel_name=None, timeout: float = 10.0,
          handover: bool = False) -> int:
    """Start the daemon (or take over the one already serving); its pid.

    The source is opened here, once (vstor.host.sources: a regular file
    below one of `roots`, or the block device sysfs names as the path does
    via `kernel_name`), and the daemon serves that very descriptor; the
    vhost-user socket is made here too and handed over listening.  No path
    is checked here and opened by the daemon later.  `handover`: see
    served.check_no_other_writer."""
    began = time.monotonic()
    ownership.ensure_dir(export.run_dir, export.qemu_group, enforce=True)
    with _lock(export), _open(export, roots, kernel_name) as src:
        # One look through /proc for both questions: a daemon of this name
        # whose pidfile was lost, and another writer.  Made since this call
        # began (by it, or by another daemon's start beside it): a daemon of
        # this name started since would have written its pidfile.
        daemons = proc.pids_of(export.binary, since=began)
        running = _reuse(export, src, daemons)
        if running is not None:
            return running
        _remove_files(export)
        _check_binary(export)
        served.check_no_other_writer(export, src.st, handover, daemons)
        ownership.ensure_dir(os.path.dirname(export.socket_path), export.qemu_group, enforce=False)
        resolved = _resolved(export, src)
        try:
            uid = _let_in(export, src) if export.users else None
            with ownership.listening_socket(export.socket_path, export.qemu_group) as sock:
                _spawn_any_aio(resolved, src.fd, sock.fileno(), timeout, _Jail(uid, tuple(roots)))
            return _settle(resolved, timeout)
        except BaseException:
            _kill_and_clean(export)
            raise


def restart_if_dead(export: QsdExport, roots=(), kernel_name=None, timeout: float = 10.0) -> bool:
    """Bring back a daemon that died (QEMU reconnects with <reconnect>).
    True when it had to be started again."""
    before = pid(export)
    if before is not None and _answers(export):
        return False
    return start(export, roots, kernel_name, timeout) != before


def _open(export: QsdExport, roots, kernel_name) -> sources.Source:
    return sources.open_source(export.kind, export.source, roots, kernel_name or _no_sysfs)


def _no_sysfs(rdev: int) -> None:
    return None         # nothing to vouch for a block device: refused


def _reuse(export: QsdExport, src: sources.Source, daemons: list[int]) -> int | None:
    found = pid(export, daemons)
    if found is None:
        return None
    opts = export_opts(proc.cmdline(found))
    why = served.differs(export, src, found, opts)
    if why:
        raise ActionFailed(f"qemu-storage-daemon {export.name} (pid {found}) already runs with "
                           f"different options: {why}",
                           hint=f"stop it first (vstor gc, or kill {found})")
    if not _answers(export):
        raise ActionFailed(f"qemu-storage-daemon {export.name} (pid {found}) runs but does not "
                           f"answer on {export.qmp_path}", hint=f"kill {found}, then retry")
    if not files.is_socket(export.socket_path):
        # Someone removed its socket: no client can reach this daemon again.
        _terminate(export, found, 5.0)
        return None
    return found


def _spawn_any_aio(export: QsdExport, source_fd: int, socket_fd: int, timeout: float,
                   jail: "_Jail") -> None:
    """Start it with aio=native where it uses O_DIRECT, unless the host's AIO
    events are used up (fs.aio-max-nr, 65536 by default: about 64 such
    daemons, vstor's and anyone else's): then, or when io_setup(2) fails at
    its start all the same (another process took the room meanwhile), with
    the thread pool, still O_DIRECT, and a warning naming the sysctl.  What
    a daemon serves is the same either way (served.differs)."""
    native = export.kind == "block" or bool(export.direct)
    if native and aio.room():
        try:
            return _spawn(export, source_fd, socket_fd, timeout, jail)
        except ActionFailed as e:
            if aio.FULL not in e.message:
                raise
        _remove_files(export, keep_socket=True)     # the listening socket is the next try's
    if native:
        from vstor import log
        log.note(export.name, "the host's AIO events are used up (fs.aio-max-nr): "
                 "qemu-storage-daemon uses its thread pool (aio=threads) instead of aio=native; "
                 f"raise the limit: {aio.FIX}", log.WARNING)
    _spawn(export, source_fd, socket_fd, timeout, jail, native_aio=False)


def _spawn(export: QsdExport, source_fd: int, socket_fd: int, timeout: float, jail: "_Jail",
           native_aio: bool = True) -> None:
    # subprocess, not os.posix_spawn (whose import is cheaper): Popen closes
    # every other fd in the child, and a daemon that outlives the hook must
    # not keep one its caller leaked (qemu-server's config lock, say).
    import subprocess       # here: a release (every hook's) starts nothing
    # qsd reports startup errors on stderr before its parent exits; a file
    # (in memory), not a pipe, so a daemon that kept stderr open could never
    # hang us.
    if jail.uid is not None:
        _pidfile_for(export, jail.uid)
        prefix = export.jail(jail.uid, jail.hide)
    else:
        prefix = _pin(export.cpus)
    # Its QMP monitor's socket too: a confined daemon cannot make a file,
    # and only root talks to the monitor.
    with open(os.memfd_create("qsd-stderr", os.MFD_CLOEXEC), "w+b") as err, \
            ownership.listening_socket(export.qmp_path, None) as qmp:
        try:
            done = subprocess.Popen(scope(export.name) + prefix
                                    + export.argv(source_fd, socket_fd, qmp.fileno(), native_aio),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    pass_fds=(source_fd, socket_fd, qmp.fileno()))
            if not proc.exits_within(done.pid, timeout):    # its parent returns once it serves
                done.kill()
                done.wait()
                raise ActionFailed(f"qemu-storage-daemon {export.name} did not finish starting "
                                   f"within {timeout:g}s")
            done.wait()
        except OSError as e:
            raise Unavailable(f"cannot run {export.binary}: {e.strerror}") from None
        if done.returncode != 0:
            err.seek(0)
            why = _last_line(err.read(), done.returncode)
            raise ActionFailed(f"qemu-storage-daemon {export.name} failed to start: {why}",
                               hint=_hint(why))


@records.record
class _Jail:
    uid: int | None         # None: not confined
    hide: tuple[str, ...]   # the image roots, covered in its view


def _let_in(export: QsdExport, src: sources.Source) -> int:
    """The uid leased to the daemon, given its ACL entry on the source."""
    uid = grant.lease(export.run_dir, export.name, export.users)
    grant.grant(export.run_dir, uid, src.fd, not export.readonly, export.source)
    return uid


def _pidfile_for(export: QsdExport, uid: int) -> None:
    """The confined daemon's pidfile, made here and owned by its uid: the
    one file it may write (its directory is root's)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(export.pidfile)
    fd = os.open(export.pidfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.fchown(fd, uid, uid)
    finally:
        os.close(fd)


def _pin(cpus: tuple[int, ...]) -> list[str]:
    """taskset's exec, pinned before qsd runs: every thread the daemon starts
    inherits it (a preexec_fn would not be safe with daemons started from
    several threads)."""
    if not cpus:
        return []
    return [proc.which("taskset") or "/usr/bin/taskset", "--cpu-list", ",".join(map(str, cpus))]


def scope(name: str, booted: str = "/run/systemd/system", what: str = "qemu-storage-daemon") -> list[str]:
    """Under systemd (sd_booted: /run/systemd/system exists), the daemon
    starts in a transient scope of its own in vstor.slice: it must outlive
    whoever started it, whose cgroup a restart kills (on Proxmox the
    pvedaemon or pve-ha-lrm task that ran the hookscript; libvirtd's unit
    kills only its main process).  systemd-run --scope runs the command
    itself, so the daemon's command line is unchanged."""
    tool = proc.which("systemd-run") if os.path.isdir(booted) else None
    if not tool:
        return []
    # IOAccounting: the kernel counts the scope's I/O operations per device
    # (io.stat on cgroup v2), each disk's for vstor's metrics (vstor.metrics.collect).
    return [tool, "--scope", "--quiet", "--collect", "--slice=vstor.slice", "--property=IOAccounting=yes",
            f"--description=vstor {what} {name}", "--"]


def _settle(export: QsdExport, timeout: float) -> int:
    """After the daemon forked: its pid, with QEMU's user able to connect."""
    found = pid(export)
    if found is None:
        raise ActionFailed(f"qemu-storage-daemon {export.name} exited right after starting")
    why = proc.reachable(export.qemu_user, export.socket_path)
    if why:
        raise ActionFailed(f"{export.qemu_user} cannot connect to {export.socket_path}: {why}",
                           hint=f"every directory above it must be searchable by group "
                                f"{export.qemu_group}")
    # No QMP question here: a daemonized qsd's parent exits 0 only after
    # every --export on its command line was created.
    return found


def _resolved(export: QsdExport, src: sources.Source) -> QsdExport:
    if export.direct is not None:
        return export
    return records.replace(export, direct=export.kind == "block" or src.direct_works())


# -- stopping --------------------------------------------------------------------------------

def stop(export: QsdExport, timeout: float = 5.0, since: float | None = None) -> None:
    """Quit the daemon (SIGTERM: qsd's clean exit, as QMP quit is; SIGKILL
    after `timeout`) and remove its socket, monitor and pidfile.  A daemon
    already gone is fine.  `since`: a look through /proc made after it
    finds a daemon that lost its pidfile (proc.pids_of)."""
    if not os.path.isdir(export.run_dir):
        _remove_files(export)
        return
    with _lock(export):
        _kill_and_clean(export, timeout, since)


def stop_orphan(pidfile: str, timeout: float = 5.0) -> bool:
    """Stop a qemu-storage-daemon no vstor record owns (`vstor gc`), found by
    its pidfile; only a qemu-storage-daemon whose own --pidfile is that file is
    touched, checked after its pidfd is held (so a reused pid is never hit).
    True when one was stopped."""
    found = proc.read_pid(pidfile)
    with proc.pidfd(found) if found else contextlib.nullcontext() as fd:
        argv = proc.cmdline(found) if fd is not None else []
        ours = (bool(argv) and os.path.basename(argv[0]) == "qemu-storage-daemon"
                and option_value(argv, "--pidfile") == pidfile)
        if ours:
            proc.signal_until_gone(fd, [(signal.SIGTERM, timeout), (signal.SIGKILL, timeout)])
    _give_back(os.path.dirname(pidfile), os.path.basename(pidfile).removesuffix(".pid"))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pidfile)      # stopped, or stale: its daemon is long gone
    return ours


def _kill_and_clean(export: QsdExport, timeout: float = 5.0, since: float | None = None) -> None:
    found = pid(export, since=since)
    held_at = _source_fd(found) if found is not None else None
    if found is not None:
        _terminate(export, found, timeout)
    _give_back(export.run_dir, export.name, held_at)
    _remove_files(export)


def _kill_all_of(uid: int) -> None:
    """Every process of the daemon's uid, killed before the uid goes to
    another daemon: a taken-over daemon may have forked children that
    outlive it (no pid namespace), or changed its own command line so that
    stop no longer knows it.  kill -1 as that uid (setpriv, util-linux)
    reaches exactly the processes of that uid."""
    import subprocess
    tool = proc.which("setpriv") or "/usr/bin/setpriv"
    for _ in range(3):      # one that forked as it was killed
        subprocess.run([tool, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                        proc.which("kill") or "/bin/kill", "-KILL", "-1"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)


def held_source(p: int, procfs: str = "/proc") -> str | None:
    """<procfs>/PID/fd/N: the source daemon `p` holds, by the descriptor
    its command line names (filename=/proc/self/fd/N, never a path); None
    when it names none."""
    name = export_opts(proc.cmdline(p) or []).get("filename", "")
    if not name.startswith("/proc/self/fd/"):
        return None
    return f"{procfs}/{p}/fd/{name[len('/proc/self/fd/'):]}"


def _source_fd(p: int) -> str | None:
    """/proc/PID/fd/N of the source the daemon holds, opened now (O_PATH)
    so that it outlives the daemon: the file, even renamed since."""
    held = held_source(p)
    if held is None:
        return None
    try:
        fd = os.open(held, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    return f"/proc/self/fd/{fd}"


def _give_back(run_dir: str, name: str, held_at: str | None = None) -> None:
    """The uid a confined daemon held, and its ACL entry on the source
    (kept by a lease whatever the record says: one from an older vstor
    may not know it was confined).  `held_at`: where the source is held
    open (_source_fd), closed here."""
    try:
        held = grant.leased(run_dir, name)
        if held is not None:
            _kill_all_of(held[0])
            grant.revoke(run_dir, held[0], held_at)
    finally:
        if held_at is not None:
            os.close(int(held_at.rsplit("/", 1)[1]))


def _terminate(export: QsdExport, p: int, timeout: float) -> None:
    with proc.pidfd(p) as fd:
        if fd is None or not _is_ours(export, p):
            return      # it exited (and the pid may be reused) after we looked
        # SIGTERM makes qemu-storage-daemon leave its main loop and close its
        # block nodes (flushed) exactly as QMP quit does, without a monitor
        # session (and QEMU's asyncio QMP library) on every stop.
        if not proc.signal_until_gone(fd, [(signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)]):
            raise ActionFailed(f"qemu-storage-daemon {export.name} (pid {p}) did not exit "
                               "even after SIGKILL", hint="it is stuck in the kernel; see dmesg")


def _remove_files(export: QsdExport, keep_socket: bool = False) -> None:
    """Its pidfile, monitor and socket; `keep_socket`: not the socket (the
    one a start bound and hands the next try)."""
    pidfile = export.pidfile
    for path in (pidfile, export.qmp_path) + (() if keep_socket else (export.socket_path,)):
        if path == pidfile or files.is_socket(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# -- the host around it ----------------------------------------------------------------------

def _lock(export: QsdExport, timeout: float = 30.0):
    """One vstor at a time starts or stops the daemon of one name: a second
    qsd started on a live one's files would steal its monitor socket.  Per
    name (a byte of the run dir's lock file each), so one domain's daemons
    start and stop side by side.  The lock file is root's alone: the run
    directory itself is readable by QEMU's group, and anyone who can open a
    file can lock it."""
    path = os.path.join(export.run_dir, ".lock")
    return range_locked(path, export.name, f"{path} (qemu-storage-daemon {export.name} "
                                           "start/stop)", timeout)


def _check_binary(export: QsdExport) -> None:
    if not os.access(export.binary, os.X_OK):
        raise Unavailable(f"{export.binary} is not installed (the embedded vhost backend)",
                          hint="apt install qemu-system-common, or use backend='spdk'")


def _hint(why: str) -> str | None:
    # io_setup(2)'s EAGAIN (vstor.backends.qsd.aio): only when the thread
    # pool's start failed too, or this daemon did not use O_DIRECT.
    if aio.FULL in why:
        return ("the host's AIO events are used up (/proc/sys/fs/aio-nr against fs.aio-max-nr; "
                f"each qemu-storage-daemon with aio=native holds {aio.EVENTS}): raise the limit, "
                f"e.g. {aio.FIX}")
    return None


def _last_line(raw: bytes, code: int) -> str:
    lines = [ln.strip() for ln in raw.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {code}, no message"
