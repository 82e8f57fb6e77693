"""The supervisor: a qemu-storage-daemon that dies while its domain runs is
started again, and QEMU reconnects (the rendered <reconnect>).

The restart is the repair `vstor status` and libvirtd's reconnect make:
the source opened again through the checked path the prepare took
(vstor.host.sources: below an image root, or the block device sysfs names),
never by name, and handed to the daemon; the socket bound again where QEMU
looks for it.  Only a daemon a state record names, of a domain prepared or
arriving, and only under that record's lock (a release that is stopping it
goes first, and then there is nothing to restart).

One supervisor per state directory (it holds LOCK there).  `ensure` starts
one where none runs: each prepare and attach that starts a daemon asks, and
so do reconnect and gc.  It watches each daemon through a pidfd, so a death
is seen at once, and looks at the records again when they change.  With
nothing to watch for IDLE seconds it exits.

Restarts are bounded: a daemon that died more than `[vhost] restart_limit`
times within `restart_window` seconds (5 in 10 s by default, systemd's
start limit) stays dead, logged, and named by `vstor status` (exit 1) from
FAILED, until its domain is prepared again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time

from vstor import counters, log
from vstor.errors import VstorError
from vstor.runtime import actions, executor
from vstor.runtime.journal import DONE
from vstor.runtime.state import INCOMING, PREPARED, StateDir

LOCK = "supervise.lock"
FAILED = "supervise.json"
IDLE = 10.0
RESCAN = 60.0       # the records read again this often even when their directory did not change
BACKOFF = (0.0, 0.2, 1.0, 2.0, 5.0)     # before each retry of a restart that failed


class Watch:
    """One daemon a record names: the step, and a pidfd of its process."""

    def __init__(self, rec, step) -> None:
        self.key, self.domain, self.updated = rec.key, rec.domain, rec.updated
        self.step = step
        self.fd: int | None = None
        self.restarts: list[float] = []
        self.retry_at: float | None = None
        self.failures = 0
        self.gave_up = False

    @property
    def name(self) -> str:
        return self.step.export.name

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Supervisor:
    def __init__(self, rt, state: StateDir, say=print) -> None:
        self.rt, self.state, self.say = rt, state, say
        self.watches: dict[tuple[str, str], Watch] = {}
        self.failed: dict[str, dict] = read_failed(state)
        self._seen = None

    # -- the records ---------------------------------------------------------------------

    def scan(self) -> None:
        """Watch every daemon the records name (prepared or arriving, its
        step done); forget the ones no record names any more."""
        wanted = set()
        for rec in self.state.records():
            if rec.status not in (PREPARED, INCOMING):
                continue
            for entry in rec.steps:
                if entry.get("kind") != "qsd-export" or entry.get("state") != DONE:
                    continue
                try:
                    step = actions.from_json(entry)
                except VstorError:
                    continue        # a step this vstor cannot read: status names it
                ident = (rec.key, step.export.name)
                wanted.add(ident)
                w = self.watches.get(ident)
                if w is None or w.updated != rec.updated:      # prepared again: a fresh count
                    if w is not None:
                        w.close()
                    w = self.watches[ident] = Watch(rec, step)
                    self._forget_failure(w)
                if w.fd is None and w.retry_at is None and not w.gave_up:
                    self._follow(w)
        for ident in set(self.watches) - wanted:
            self.watches.pop(ident).close()
        if self.failed and any(k not in {i[0] for i in wanted} for k in self.failed):
            self.failed = {k: v for k, v in self.failed.items() if k in {i[0] for i in wanted}}
            write_failed(self.state, self.failed)

    def changed(self) -> bool:
        """The records directory changed since the last look (a save renames into it)."""
        try:
            st = os.stat(self.state.domains)
        except FileNotFoundError:
            return True
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._seen:
            return False
        self._seen = seen
        return True

    # -- the daemons ---------------------------------------------------------------------

    def _follow(self, w: Watch) -> None:
        """Hold a pidfd of the daemon; one that is not running died unseen."""
        from vstor.backends.qsd import daemon
        pid = daemon.pid(w.step.export)
        if pid is not None:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                fd = None
            if fd is not None and daemon.pid(w.step.export) == pid:    # not a reused pid
                w.fd = fd
                return
            if fd is not None:
                os.close(fd)
        self.died(w)

    def died(self, w: Watch) -> None:
        w.close()
        self._attempt(w)

    def _attempt(self, w: Watch) -> None:
        """Start it again, unless it was started restart_limit times within
        restart_window: every start counts, a retry after a failed one too
        (as systemd counts starts), so a daemon that dies while it is being
        started again, before it is watched, is not a death missed."""
        now = time.monotonic()
        limit, window = self.rt.cfg.restart_limit, self.rt.cfg.restart_window
        w.restarts = [t for t in w.restarts if now - t < window]
        if len(w.restarts) >= limit:
            self._give_up(w, f"it died {limit + 1} times within {window:g}s")
            return
        w.restarts.append(now)
        self._restart(w)

    def _restart(self, w: Watch) -> None:
        if not os.path.isdir(self.state.domains):
            return
        try:
            with self.state.record_lock(w.key, timeout=30):
                rec = self.state.load(w.key)
                if rec is None or rec.updated != w.updated or rec.status not in (PREPARED, INCOMING):
                    return      # released or prepared again meanwhile: the next scan sees it
                rt = self.rt.of(rec)
                if executor.check(w.step, rt) is None:
                    w.retry_at = None
                    self._follow(w)     # someone brought it back (libvirtd's reconnect)
                    return
                executor.repair(w.step, rt)
        except (VstorError, OSError) as e:
            w.failures += 1
            w.retry_at = time.monotonic() + BACKOFF[min(w.failures, len(BACKOFF) - 1)]
            why = e.strerror if isinstance(e, OSError) else str(e)
            log.note(w.domain, f"qemu-storage-daemon {w.name} died and could not be started "
                     f"again: {why}", log.ERR)
            if w.failures > self.rt.cfg.restart_limit:
                self._give_up(w, f"it could not be started again: {why}")
            return
        w.retry_at, w.failures = None, 0
        counters.add("restart", ("qemu-storage-daemon",))
        from vstor.backends.qsd import daemon
        log.note(w.domain, f"qemu-storage-daemon {w.name} died; started again (pid "
                 f"{daemon.pid(w.step.export)}; restart {len(w.restarts)} of "
                 f"{self.rt.cfg.restart_limit} within {self.rt.cfg.restart_window:g}s)", log.WARNING)
        self._follow(w)

    def _give_up(self, w: Watch, why: str) -> None:
        w.gave_up, w.retry_at = True, None
        w.close()
        log.note(w.domain, f"qemu-storage-daemon {w.name} stays dead: {why}; "
                 f"fix the cause, then: vstor status {w.domain}", log.ERR)
        self.failed.setdefault(w.key, {})[w.name] = {"updated": w.updated, "why": why,
                                                     "at": time.time()}
        write_failed(self.state, self.failed)

    def _forget_failure(self, w: Watch) -> None:
        mine = self.failed.get(w.key, {})
        if w.name in mine and mine[w.name].get("updated") != w.updated:
            del mine[w.name]
            write_failed(self.state, self.failed)

    # -- the loop ------------------------------------------------------------------------

    def run(self, idle: float | None = IDLE) -> None:
        """Until nothing was watched for `idle` seconds (None: for ever), or
        the state directory is gone."""
        quiet_since = last_scan = time.monotonic()
        self.scan()
        while os.path.isdir(self.state.domains):
            now = time.monotonic()
            if self.changed() or now - last_scan >= RESCAN:
                self.scan()
                last_scan = now
            for w in list(self.watches.values()):
                if w.retry_at is not None and w.retry_at <= now and not w.gave_up:
                    self._attempt(w)
            if any(not w.gave_up for w in self.watches.values()):
                quiet_since = now
            elif idle is not None and now - quiet_since >= idle:
                return
            by_fd = {w.fd: w for w in self.watches.values() if w.fd is not None}
            poller = select.poll()
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(500):
                w = by_fd[fd]
                if w.fd == fd:
                    self.died(w)


def run(rt, state: StateDir, idle: float | None = IDLE) -> bool:
    """Supervise `state`'s daemons; False when another supervisor does."""
    state.trusted()
    with _holding(state) as mine:
        if not mine:
            return False
        Supervisor(rt, state).run(idle)
        return True


@contextlib.contextmanager
def _holding(state: StateDir):
    fd = os.open(os.path.join(state.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)     # for stop()
        yield True
    finally:
        os.close(fd)


def running(state_dir: str) -> bool:
    """A supervisor holds `state_dir`'s lock."""
    try:
        fd = os.open(os.path.join(state_dir, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def stop(state_dir: str, timeout: float = 10.0) -> bool:
    """Stop the supervisor of `state_dir` (a package's removal or upgrade:
    the next start, or `supervise --start`, runs the new code).  Only the
    process that holds the lock, whose pid it wrote there and whose command
    is a vstor supervise, is signalled, through its pidfd.  True when one
    was stopped."""
    from vstor.backends.qsd import proc
    path = os.path.join(state_dir, LOCK)
    try:
        with open(path, "rb") as f:
            pid = int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return False
    with proc.pidfd(pid) as fd:
        argv = proc.cmdline(pid) if fd is not None else []
        if fd is None or "supervise" not in argv or not running(state_dir):
            return False
        proc.signal_until_gone(fd, [(signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)])
    return True


# -- what gave up, for `vstor status` -------------------------------------------------------

def read_failed(state: StateDir) -> dict[str, dict]:
    """{record key: {daemon name: {"updated", "why", "at"}}}; nothing when unreadable."""
    try:
        with open(os.path.join(state.path, FAILED), "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)}


def failures(state: StateDir, rec) -> list[str]:
    """Why the supervisor left daemons of this record (as prepared now) dead."""
    mine = read_failed(state).get(rec.key, {})
    return [f"qemu-storage-daemon {name} stays dead: {v.get('why')}" for name, v in sorted(mine.items())
            if isinstance(v, dict) and v.get("updated") == rec.updated]


def write_failed(state: StateDir, failed: dict) -> None:
    from vstor.atomic import write_file
    path = os.path.join(state.path, FAILED)
    if not failed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(VstorError):       # the log said it already
        write_file(path, json.dumps(failed, sort_keys=True), mode=0o600)


# -- starting one ---------------------------------------------------------------------------

def ensure(cfg, host_root: str = "/") -> None:
    """Start a supervisor for cfg's state directory unless one runs (or the
    config says no).  It runs detached, in vstor.slice's scope under
    systemd, as the daemons do, so that no restart of its caller's service
    takes it along.  A config built in a process (no file it came from)
    cannot be handed to another: nothing starts."""
    from vstor.config import Config
    if not cfg.supervise or running(cfg.state_dir):
        return
    if cfg.source == "(defaults)" and cfg != Config():
        return
    from vstor.backends.qsd import daemon, proc
    argv = [sys.executable, "-m", "vstor.cli.main"]
    if cfg.source != "(defaults)":
        argv += ["--config", cfg.source]
    if host_root != "/":
        argv += ["--host-root", host_root]
    argv += ["supervise"]
    setsid = proc.which("setsid") or "/usr/bin/setsid"
    # The vstor this one is, and the site directories this Python was given
    # (the hook runs with -S and names them itself); not the caller's
    # script directory (sys.path[0]) or working directory.
    import vstor
    here = os.path.dirname(os.path.dirname(os.path.abspath(vstor.__file__)))
    paths = [here] + [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    with contextlib.suppress(OSError):      # the next start asks again; status names dead daemons
        subprocess.run([setsid, "--fork", *daemon.scope(cfg.state_dir, what="supervisor for"), *argv],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=env, cwd="/", timeout=10)
