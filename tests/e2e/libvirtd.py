"""Real virtlogd + libvirtd for end-to-end tests, on a machine without systemd.

Daemons already running are used as they are and never stopped; the ones this
module starts are stopped by pid. Hooks and the hugetlbfs mount must be in place
before libvirtd starts: libvirt looks for both only at start.
"""
from __future__ import annotations

import fcntl
import grp
import os
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


def which(tool: str) -> str | None:
    """`tool` on PATH or in the sbin directories a non-login shell may lack."""
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def running_pid(name: str) -> int | None:
    """The pid of a live process whose command name is `name`, if any."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _comm(int(entry.name)) == name:
            return int(entry.name)
    return None


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
        self.started: dict[str, int] = {}
        self.hooks: dict[Path, bytes | None] = {}   # installed hook -> previous content
        self.mounted_hugetlbfs = False
        self.kvm_mode: tuple[int, int, int] | None = None   # (mode, uid, gid) to restore
        self._conn: libvirt.virConnect | None = None
        self._lock = None

    def start(self, timeout: float = 30, wait_for_others: float = 900) -> Daemons:
        self._take_session_lock(wait_for_others)
        if not hugetlbfs_mounted() and not running_pid("libvirtd"):
            HUGEPAGES.mkdir(exist_ok=True)
            _run("mount", "-t", "hugetlbfs", "nodev", str(HUGEPAGES))
            self.mounted_hugetlbfs = True
        self._share_kvm()
        # Without virtlogd every domain start fails ("Failed to connect socket to
        # '/run/libvirt/virtlogd-sock'").
        self._ensure("virtlogd", timeout)
        self._ensure("libvirtd", timeout)
        self.connect(timeout)
        return self

    def owns_libvirtd(self) -> bool:
        return "libvirtd" in self.started

    def install_hook(self, name: str, text: str | bytes) -> Path:
        """Install an executable hook in qemu.d; a libvirtd already running is
        restarted (if this started it) so that it sees the hook."""
        data = text.encode() if isinstance(text, str) else text
        path = HOOK_DIR / name
        old = path.read_bytes() if path.exists() else None
        if old != data:
            HOOK_DIR.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_bytes(data)
            tmp.chmod(0o755)
            tmp.replace(path)
            self.hooks.setdefault(path, old)
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
        _terminate(self.started.pop("libvirtd"), timeout)
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
        for name in ("libvirtd", "virtlogd"):
            if name in self.started:
                _terminate(self.started.pop(name), timeout)
        for path, old in self.hooks.items():
            if old is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(old)
        self.hooks.clear()
        if self.kvm_mode:
            mode, uid, gid = self.kvm_mode
            os.chown(KVM, uid, gid)
            KVM.chmod(mode)
            self.kvm_mode = None
        if self.mounted_hugetlbfs and not running_pid("libvirtd"):
            _run("umount", str(HUGEPAGES))
            self.mounted_hugetlbfs = False
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _take_session_lock(self, wait: float) -> None:
        self._lock = take_session_lock(wait)

    def _share_kvm(self) -> None:
        self.kvm_mode = share_kvm()

    def _ensure(self, name: str, timeout: float) -> None:
        if running_pid(name):
            return
        PIDFILES[name].unlink(missing_ok=True)
        _run(which(name) or name, "-d")
        self.started[name] = wait_for_pidfile(PIDFILES[name], name, timeout)

    def _close(self) -> None:
        close_quietly(self._conn)
        self._conn = None


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


def take_session_lock(wait: float):
    """SESSION_LOCK held (the open file); RuntimeError after `wait` seconds."""
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
