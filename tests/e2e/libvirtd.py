"""Real virtlogd + libvirtd for end-to-end tests, on a machine without systemd.

Daemons already running are used as they are and never stopped; the ones this
module starts are stopped by pid. Hooks and the hugetlbfs mount must be in place
before libvirtd starts: libvirt looks for both only at start.

Every change a session makes to the machine (a hook, a daemon, the mount,
/dev/kvm's mode) is written to JOURNAL before or as it is made, and the
journal is removed once `stop()` has undone them all. A session killed half
way (a CI job's time running out) leaves the journal: the next session, or
ci-package.sh, undoes what it lists before it starts (`reap_dead_session`),
so that a hook the tests wrote never meets the Debian package's conffile.
"""
from __future__ import annotations

import base64
import fcntl
import grp
import hashlib
import json
import os
import sys
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import libvirt

URI = "qemu:///system"
HOOK_DIR = Path("/etc/libvirt/hooks/qemu.d")
HUGEPAGES = Path("/dev/hugepages")
KVM = Path("/dev/kvm")
# One test session at a time per host: sessions would stop or restart each
# other's libvirtd and race for hooks and hugepages.
SESSION_LOCK = Path("/run/vstor-e2e.lock")
PIDFILES = {"virtlogd": Path("/run/virtlogd.pid"), "libvirtd": Path("/run/libvirtd.pid")}
# On disk, not in /run: the hooks it lists outlive a reboot.
JOURNAL = Path("/var/lib/vstor-e2e-session.json")


def which(tool: str) -> str | None:
    """`tool` on PATH or in the sbin directories a non-login shell may lack."""
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def running_pid(name: str) -> int | None:
    """The pid of the machine's own `name` daemon, if it runs: the live
    process of that name its pid file (PIDFILES) names.  Not any process of
    that name: another user's session libvirtd, one in a container or a
    migration lab's is not the daemon qemu:///system reaches, and taking it
    for that one left the session waiting for a socket nobody served."""
    try:
        pid = int(PIDFILES[name].read_text())
    except (OSError, ValueError):
        return None
    return pid if _comm(pid) == name else None


def _comm(pid: int) -> str | None:
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": a zombie is as good as gone.
    comm, state = line[line.index("(") + 1:line.rindex(")")], line[line.rindex(")") + 2]
    return None if state in "ZX" else comm


def hugetlbfs_mounted() -> bool:
    return any(line.split()[1:3] == [str(HUGEPAGES), "hugetlbfs"]
               for line in Path("/proc/mounts").read_text().splitlines())


def wait_shutoff(dom: libvirt.virDomain, timeout: float = 120) -> float:
    """Seconds until the domain shut off; TimeoutError (with its state) otherwise."""
    start = time.monotonic()
    while True:
        state = dom.state()[0]
        if state == libvirt.VIR_DOMAIN_SHUTOFF:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"domain {dom.name()} still in state {state} after {timeout}s")
        time.sleep(0.2)


def read_console(path: str | os.PathLike) -> str:
    """The serial console log virtlogd wrote (empty if there is none yet)."""
    try:
        return Path(path).read_bytes().decode("utf-8", "replace").replace("\r", "")
    except FileNotFoundError:
        return ""


class Daemons:
    """virtlogd and libvirtd, started if need be; `stop()` undoes what `start()` did."""

    def __init__(self) -> None:
        self.changes = Changes()
        self._conn: libvirt.virConnect | None = None
        self._lock = None

    def start(self, timeout: float = 30, wait_for_others: float = 900) -> Daemons:
        self._lock = take_session_lock(wait_for_others)
        reap_dead_session()
        if not hugetlbfs_mounted() and not running_pid("libvirtd"):
            HUGEPAGES.mkdir(exist_ok=True)
            self.changes.note(mounted_hugetlbfs=True)
            _run("mount", "-t", "hugetlbfs", "nodev", str(HUGEPAGES))
        kvm_mode = share_kvm()
        if kvm_mode:
            self.changes.note(kvm_mode=kvm_mode)
        # Without virtlogd every domain start fails ("Failed to connect socket to
        # '/run/libvirt/virtlogd-sock'").
        self._ensure("virtlogd", timeout)
        self._ensure("libvirtd", timeout)
        self.connect(timeout)
        return self

    def owns_libvirtd(self) -> bool:
        return "libvirtd" in self.changes.started

    def install_hook(self, name: str, text: str | bytes) -> Path:
        """Install an executable hook in qemu.d; a libvirtd already running is
        restarted (if this started it) so that it sees the hook."""
        data = text.encode() if isinstance(text, str) else text
        path = HOOK_DIR / name
        old = path.read_bytes() if path.exists() else None
        if old != data:
            HOOK_DIR.mkdir(parents=True, exist_ok=True)
            self.changes.hook(path, old, data)
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_bytes(data)
            tmp.chmod(0o755)
            tmp.replace(path)
            if running_pid("libvirtd") and old is None:
                if not self.owns_libvirtd():
                    raise RuntimeError(
                        f"hook {path} installed, but libvirtd (pid {running_pid('libvirtd')}) "
                        "was started outside the tests and only sees hooks present at its "
                        "start: restart it yourself, or stop it and let the tests start one")
                self.restart_libvirtd()
        return path

    def restart_libvirtd(self, timeout: float = 30) -> None:
        """Restart the libvirtd this started (domains keep running; libvirt
        reconnects to them). Connections opened before are dead afterwards."""
        if not self.owns_libvirtd():
            raise RuntimeError("libvirtd was not started by the tests: not restarting it")
        self._close()
        _terminate(self.changes.started.pop("libvirtd")[0], timeout)
        self.changes.save()
        self._ensure("libvirtd", timeout)
        self.connect(timeout)

    def connect(self, timeout: float = 30) -> libvirt.virConnect:
        """A live connection to qemu:///system, reopened after a restart."""
        if self._conn is not None and self._conn.isAlive():
            return self._conn
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._conn = libvirt.open(URI)
                return self._conn
            except libvirt.libvirtError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, timeout: float = 30) -> None:
        self._close()
        self.changes.undo(timeout)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _ensure(self, name: str, timeout: float) -> None:
        if running_pid(name):
            return
        PIDFILES[name].unlink(missing_ok=True)
        _run(which(name) or name, "-d")
        pid = wait_for_pidfile(PIDFILES[name], name, timeout)
        self.changes.started[name] = (pid, _starttime(pid))
        self.changes.save()

    def _close(self) -> None:
        close_quietly(self._conn)
        self._conn = None


class Changes:
    """What a session changed on the machine, kept in JOURNAL as it changes."""

    def __init__(self, journal: Path | None = None) -> None:
        self.journal = journal or JOURNAL
        self.started: dict[str, tuple[int, int | None]] = {}   # name -> (pid, start time)
        self.hooks: dict[Path, tuple[bytes | None, str]] = {}  # path -> (old content, new sha256)
        self.mounted_hugetlbfs = False
        self.kvm_mode: tuple[int, int, int] | None = None      # (mode, uid, gid) to restore

    def note(self, **what) -> None:
        for key, value in what.items():
            setattr(self, key, value)
        self.save()

    def hook(self, path: Path, old: bytes | None, new: bytes) -> None:
        old = self.hooks[path][0] if path in self.hooks else old
        self.hooks[path] = (old, hashlib.sha256(new).hexdigest())
        self.save()

    def save(self) -> None:
        doc = {"started": self.started, "mounted_hugetlbfs": self.mounted_hugetlbfs,
               "kvm_mode": self.kvm_mode,
               "hooks": {str(p): [None if old is None else base64.b64encode(old).decode(), sha]
                         for p, (old, sha) in self.hooks.items()}}
        tmp = self.journal.with_name(self.journal.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.journal)

    @classmethod
    def load(cls, journal: Path | None = None) -> Changes:
        journal = journal or JOURNAL
        doc = json.loads(journal.read_text())
        changes = cls(journal)
        changes.started = {name: tuple(v) for name, v in doc["started"].items()}
        changes.mounted_hugetlbfs = doc["mounted_hugetlbfs"]
        changes.kvm_mode = tuple(doc["kvm_mode"]) if doc["kvm_mode"] else None
        changes.hooks = {Path(p): (None if old is None else base64.b64decode(old), sha)
                         for p, (old, sha) in doc["hooks"].items()}
        return changes

    def undo(self, timeout: float = 30) -> list[str]:
        """Undo every change that is still the session's own; what was undone."""
        done = []
        for name in sorted(self.started, key=lambda name: name != "libvirtd"):  # it logs to virtlogd
            pid, started = self.started.pop(name)
            if _comm(pid) == name and _starttime(pid) == started:
                _terminate(pid, timeout)
                done.append(f"stopped {name} (pid {pid})")
        for path, (old, sha) in self.hooks.items():
            try:
                ours = hashlib.sha256(path.read_bytes()).hexdigest() == sha
            except FileNotFoundError:
                continue
            if not ours:        # changed since: someone else's now
                continue
            if old is None:
                path.unlink()
            else:
                path.write_bytes(old)
            done.append(f"restored {path}")
        self.hooks.clear()
        if self.kvm_mode:
            mode, uid, gid = self.kvm_mode
            os.chown(KVM, uid, gid)
            KVM.chmod(mode)
            self.kvm_mode = None
            done.append(f"gave {KVM} back its mode")
        if self.mounted_hugetlbfs and not running_pid("libvirtd") and hugetlbfs_mounted():
            _run("umount", str(HUGEPAGES))
            done.append(f"unmounted {HUGEPAGES}")
        self.mounted_hugetlbfs = False
        self.journal.unlink(missing_ok=True)
        return done


def reap_dead_session() -> list[str]:
    """Undo what a session killed half way left (its JOURNAL), under the
    session lock the caller holds; what was undone."""
    if not JOURNAL.exists():
        return []
    done = Changes.load().undo()
    print(f"e2e: a session that died left changes; {'; '.join(done) or 'none remained'}",
          file=sys.stderr)
    return done


def close_quietly(conn) -> None:
    """Close a libvirt connection that may already be dead."""
    if conn is not None:
        try:
            conn.close()
        except libvirt.libvirtError:
            pass


def wait_for_pidfile(pidfile: Path, name: str, timeout: float, where: str = "") -> int:
    """The pid a daemon just started with -d wrote, once a live process of
    that name has it; RuntimeError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid = int(pidfile.read_text())
            if _comm(pid) == name:
                return pid
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{where}{name} -d did not come up within {timeout:.0f}s")
        time.sleep(0.1)


class SessionLock:
    """A hold on SESSION_LOCK: one e2e session on the machine at a time.

    Taken again in the same process (the e2e daemons, then a systemd test's
    container, in one pytest run) it is the same hold, counted; a child
    started with HELD_BY_PARENT in its environment rides on its parent's.
    flock() alone would make a process wait for itself: its locks belong to
    each open(), not to the process."""
    _file = None
    _count = 0

    def __init__(self, wait: float) -> None:
        self._open = True
        if os.environ.get("VSTOR_E2E_LOCK_HELD") == "1" and SessionLock._count == 0:
            self._open = False          # the parent holds it for this process
            return
        if SessionLock._count == 0:
            SessionLock._file = _flock(wait)
        SessionLock._count += 1

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        SessionLock._count -= 1
        if SessionLock._count == 0:
            SessionLock._file.close()
            SessionLock._file = None


HELD_BY_PARENT = {"VSTOR_E2E_LOCK_HELD": "1"}    # a child's environment: the caller holds the lock


def take_session_lock(wait: float) -> SessionLock:
    """SESSION_LOCK held; RuntimeError after `wait` seconds of another session."""
    return SessionLock(wait)


def _flock(wait: float):
    lock = open(SESSION_LOCK, "w")
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                raise RuntimeError(f"another e2e test session held {SESSION_LOCK} "
                                   f"for more than {wait:.0f}s")
            time.sleep(1)


def share_kvm() -> tuple[int, int, int] | None:
    """Give /dev/kvm to group kvm, 0660, as Debian's udev rule would; the
    (mode, uid, gid) to restore, or None when nothing changed.

    A root-only /dev/kvm makes libvirt 9.0 re-probe QEMU on nearly every API
    call ("KVM was enabled when probing ..., but it is not available now":
    the probe runs as root, the check as libvirt-qemu): ~4 s per probe, about
    a minute for the first defineXML. The tests use TCG either way."""
    try:
        kvm_gid = grp.getgrnam("kvm").gr_gid
        st = KVM.stat()
    except (KeyError, OSError):
        return None
    if st.st_gid == kvm_gid and st.st_mode & 0o060 == 0o060:
        return None
    old = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    os.chown(KVM, -1, kvm_gid)
    KVM.chmod(0o660)
    return old


def _starttime(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): a pid reused since differs."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line[line.rindex(")") + 2:].split()[19])


def _terminate(pid: int, timeout: float) -> None:
    name = _comm(pid)
    if name is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _comm(pid) == name:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline += timeout
        time.sleep(0.1)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


if __name__ == "__main__":      # ci-package.sh, holding the session lock
    reap_dead_session()
