"""A Debian 12 container with systemd 252 as its PID 1, for tests of what
only a real service manager shows: vstor's units, its slice and its
package's maintainer scripts (tests/systemd).

The root filesystem is bootstrapped once with mmdebstrap from Debian's
archive, with libvirt, QEMU (TCG), qemu-storage-daemon (qemu-system-common)
and everything vstor's .deb depends on baked in, and cached under
BASE/images/<key> (key: a hash of the package list and of how the image is
made; a second run starts from the cache).  Each session boots a copy of it
(an overlayfs over the cached tree, upper layer under BASE/run/<name>) with

    systemd-nspawn -D ROOT --boot --register=no --keep-unit --private-network

and reaches it with `nsenter -t <its PID 1> -a`.

Never /tmp, /var/tmp or /run of the machine: systemd-tmpfiles at boot would
empty them for every process here.  nspawn mounts a tmpfs of the container's
own on /tmp and /run, and /var/tmp is the container root's; `Container`
refuses a root that is the machine's own and checks canary files in the
machine's /tmp, /var/tmp and /run before the boot, after it and after the
shutdown (HostTmpTouched, loudly, if one went missing).

Every change a session makes to the machine (the overlay mount, its cgroups,
nspawn's process, nspawn's /run/systemd/nspawn/propagate/NAME) is written to
BASE/run/<name>/journal.json before it is made; `stop()` undoes them all and
removes the directory.  A session killed half way leaves the journal: the
next session (or `python3 tests/systemd/harness.py --reap`, which
scripts/ci-package.sh runs) undoes it.
Sessions hold the e2e session lock (tests/e2e/libvirtd.py) while their
container runs: its libvirtd and qemu-storage-daemons are processes of this
machine that the e2e tests would otherwise mistake for their own.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):           # run as a script: --reap
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.libvirtd import _comm, _starttime, take_session_lock  # noqa: E402

BASE = Path(os.environ.get("VSTOR_SYSTEMD_DIR", "/var/lib/vstor-systemd"))
SUITE = "bookworm"
MIRRORS = ("deb http://deb.debian.org/debian bookworm main",
           "deb http://deb.debian.org/debian bookworm-updates main",
           "deb http://deb.debian.org/debian-security bookworm-security main")
# systemd as PID 1 and what nspawn's recipe needs; libvirt, QEMU under TCG,
# qemu-storage-daemon (in qemu-system-common on Debian 12) and qemu-img;
# what vstor's .deb Depends and Recommends (debian/control), so that the
# package installs with no network.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "libpam-systemd", "iproute2", "procps",
            "libvirt-daemon-system", "libvirt-clients", "qemu-system-x86", "qemu-system-common",
            "qemu-utils", "python3", "python3-libvirt", "python3-lxml", "python3-prometheus-client")
# Done in the bootstrapped tree before it is cached (a change here changes the key).
PREPARE = (
    # nspawn mounts the cgroup v1 controllers read-only: libvirt must not try them.
    "echo 'cgroup_controllers = [ ]' >> /etc/libvirt/qemu.conf",
    # Timers that would take dpkg's lock or load the machine in the middle of a test.
    "for t in apt-daily.timer apt-daily-upgrade.timer man-db.timer dpkg-db-backup.timer"
    " e2scrub_all.timer fstrim.timer; do ln -sf /dev/null /etc/systemd/system/$t; done",
    "apt-get clean",
)
BOOTED = ("running", "degraded")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HostTmpTouched(RuntimeError):
    """A canary in the machine's /tmp, /var/tmp or /run went missing while a
    container booted or stopped: systemd may have cleaned the machine's own."""


def image_key() -> str:
    doc = json.dumps({"suite": SUITE, "mirrors": MIRRORS, "packages": PACKAGES, "prepare": PREPARE})
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def ensure_image(log=print) -> Path:
    """The cached root filesystem, bootstrapped first if there is none for
    image_key(); older images are removed."""
    images = BASE / "images"
    images.mkdir(parents=True, exist_ok=True)
    key = image_key()
    image = images / key
    with open(images / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (image / "complete").exists():
            return image / "root"
        for old in images.iterdir():
            if old.is_dir() and old.name != key:
                shutil.rmtree(old, ignore_errors=True)
        staging = images / f".{key}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "tmp").mkdir(parents=True)
        start = time.monotonic()
        log(f"systemd harness: bootstrapping Debian {SUITE} into {image} (cached afterwards)")
        with open(staging / "bootstrap.log", "w") as out:
            done = subprocess.run(
                ["mmdebstrap", "--mode=root", "--variant=apt", "--include=" + ",".join(PACKAGES),
                 SUITE, str(staging / "root"), *MIRRORS],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(staging / "tmp")})
        if done.returncode:
            tail = (staging / "bootstrap.log").read_text()[-3000:]
            raise RuntimeError(f"mmdebstrap failed ({done.returncode}):\n{tail}")
        for step in PREPARE:
            subprocess.run(["chroot", str(staging / "root"), "/bin/sh", "-ec", step], check=True,
                           env={"PATH": SBIN_PATH, "LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL)
        shutil.rmtree(staging / "tmp")
        (staging / "complete").write_text(f"{time.monotonic() - start:.0f} s\n")
        staging.rename(image)
        log(f"systemd harness: image ready in {time.monotonic() - start:.0f} s")
        return image / "root"


def _pid_alive(pid: int | None, started: int | None) -> bool:
    return bool(pid) and _starttime(pid) == started and _comm(pid) is not None


def _cgroup_roots() -> list[Path]:
    """The hierarchies a container's cgroup is made in: the unified and the
    named systemd one on a hybrid (v1) machine, /sys/fs/cgroup on a v2 one."""
    roots = [Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd")]
    found = [r for r in roots if (r / "cgroup.procs").exists()]
    return found or [Path("/sys/fs/cgroup")]


def _remove_cgroup(path: Path) -> None:
    """Remove a cgroup and those below it, deepest first; processes still in
    it are killed (they are the container's)."""
    if not path.is_dir():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _kill_cgroup(sub)
        try:
            sub.rmdir()
        except OSError:
            pass
    _kill_cgroup(path)
    try:
        path.rmdir()
    except OSError:
        pass


def _kill_cgroup(path: Path) -> None:
    for _ in range(50):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _mounted(path: Path) -> bool:
    target = str(path)
    return any(line.split()[4] == target for line in Path("/proc/self/mountinfo").read_text().splitlines())


class Journal:
    """What one session changed on the machine, in BASE/run/<name>/journal.json."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "journal.json"
        self.doc: dict = {}

    def note(self, **what) -> None:
        self.doc.update(what)
        tmp = self.path.with_name("journal.json.tmp")
        tmp.write_text(json.dumps(self.doc))
        tmp.replace(self.path)

    @classmethod
    def load(cls, directory: Path) -> Journal:
        journal = cls(directory)
        journal.doc = json.loads(journal.path.read_text())
        return journal


def undo(directory: Path, doc: dict, timeout: float = 60) -> list[str]:
    """Undo what the session of `directory` recorded; what was undone."""
    done = []
    pid, started = doc.get("nspawn") or (None, None)
    if _pid_alive(pid, started):
        leader = doc.get("leader")
        if leader and _pid_alive(*leader):
            subprocess.run(["nsenter", "-t", str(leader[0]), "-a", "systemctl", "poweroff"],
                           capture_output=True, timeout=30)
        if not _wait_gone(pid, started, timeout):
            os.kill(pid, signal.SIGTERM)        # nspawn: ask the container's init to power off
            if not _wait_gone(pid, started, timeout / 2):
                if leader and _pid_alive(*leader):
                    os.kill(leader[0], signal.SIGKILL)      # ends every process of the container
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, started, 10)
        done.append(f"stopped container {doc.get('name')} (nspawn pid {pid})")
    for path in map(Path, doc.get("cgroups", ())):
        if path.exists():
            _remove_cgroup(path)
            done.append(f"removed cgroup {path}")
    root = Path(doc["root"]) if doc.get("root") else None
    if doc.get("overlay") and root is not None and _mounted(root):
        subprocess.run(["umount", str(root)], check=False, capture_output=True)
        if _mounted(root):
            subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True)
        done.append(f"unmounted {root}")
    name = doc.get("name")
    if name:
        for leftover in ("propagate", "unix-export"):
            path = Path("/run/systemd/nspawn") / leftover / name
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
                done.append(f"removed {path}")
    for canary in doc.get("canaries", ()):
        Path(canary).unlink(missing_ok=True)
    if root is not None and _mounted(root):
        raise RuntimeError(f"{root} is still mounted: not removing {directory}")
    shutil.rmtree(directory, ignore_errors=True)
    return done


def _wait_gone(pid: int, started: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid, started):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def reap_dead(log=print) -> list[str]:
    """Undo what sessions whose process is gone left; what was undone."""
    done = []
    runs = BASE / "run"
    if not runs.is_dir():
        return done
    for directory in sorted(runs.iterdir()):
        try:
            doc = Journal.load(directory).doc
        except (OSError, ValueError):
            if directory.is_dir() and not _mounted(directory / "root"):
                shutil.rmtree(directory, ignore_errors=True)
            continue
        if _pid_alive(*doc.get("owner", (None, None))):
            continue
        what = undo(directory, doc)
        log(f"systemd harness: a session that died left {directory.name}; {'; '.join(what) or 'nothing ran'}")
        done += what
    return done


class Container:
    """One booted container: `start()`, then `run()` inside it, then `stop()`."""

    def __init__(self, image: Path, name: str | None = None, log=print) -> None:
        self.image = image
        self.name = name or f"vstor-sd-{os.getpid()}"
        self.dir = BASE / "run" / self.name
        self.root = self.dir / "root"
        self.log = log
        self.leader: int | None = None
        self._nspawn: subprocess.Popen | None = None
        self._journal: Journal | None = None
        self._lock = None
        self._canaries_written = False
        self.canaries = [Path(d) / f".vstor-systemd-canary-{self.name}" for d in ("/tmp", "/var/tmp", "/run")]

    # -- start and stop ------------------------------------------------------------------

    def start(self, timeout: float = 120, wait_for_others: float = 1800) -> Container:
        self._lock = take_session_lock(wait_for_others)
        try:
            reap_dead(self.log)
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        if self.dir.exists():
            raise RuntimeError(f"{self.dir} exists: a session of the same name runs")
        self.dir.mkdir(parents=True)
        self._journal = Journal(self.dir)
        self._journal.note(name=self.name, owner=[os.getpid(), _starttime(os.getpid())],
                           root=str(self.root), canaries=[str(c) for c in self.canaries])
        for d in ("upper", "work", "root"):
            (self.dir / d).mkdir()
        self._journal.note(overlay=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.image},upperdir={self.dir / 'upper'},workdir={self.dir / 'work'}",
                        str(self.root)], check=True, capture_output=True)
        self._refuse_host_root()
        for canary in self.canaries:
            canary.write_text(f"{self.name}: must survive the container's boot and shutdown\n")
        self._canaries_written = True
        cgroups = [root / f"vstor-systemd-{self.name}" for root in _cgroup_roots()]
        self._journal.note(cgroups=[str(c) for c in cgroups])
        for cgroup in cgroups:
            cgroup.mkdir(exist_ok=True)
        # The shell moves itself into the cgroups, then becomes nspawn: the
        # container never sits at the root of the machine's cgroup tree.
        enter = "; ".join(f"echo $$ > {c}/cgroup.procs" for c in cgroups)
        console = open(self.dir / "console.log", "wb")
        self._nspawn = subprocess.Popen(
            ["sh", "-ec", f'{enter}; exec "$@"', "sh", "systemd-nspawn", "--quiet",
             "-D", str(self.root), "--boot", "--register=no", "--keep-unit",
             f"--machine={self.name}", "--console=read-only", "--private-network"],
            stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
            start_new_session=True, env={"PATH": SBIN_PATH, "LANG": "C.UTF-8"})
        console.close()
        self._journal.note(nspawn=[self._nspawn.pid, _starttime(self._nspawn.pid)])
        self.leader = self._find_leader(timeout)
        self._journal.note(leader=[self.leader, _starttime(self.leader)])
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("systemctl", "is-system-running", check=False, timeout=30).stdout.strip()
            if state in BOOTED:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{self.name}: systemd did not finish booting in {timeout:.0f}s "
                               f"(is-system-running: {state!r}); console: {self.console()[-2000:]}")
        self.check_canaries("after the boot")
        for canary in self.canaries:
            if self.run("test", "-e", str(canary), check=False).returncode == 0:
                raise HostTmpTouched(f"{canary} of the machine is visible inside the container: "
                                     "it shares the machine's directory; stopping")
        self.log(f"systemd harness: {self.name} booted ({state}), PID 1 is pid {self.leader} here")

    def _refuse_host_root(self) -> None:
        here, mine = os.stat("/"), os.stat(self.root)
        if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino) or self.root.resolve() == Path("/"):
            raise RuntimeError(f"{self.root} is the machine's own root: never booting systemd on it")
        if (BASE / "images").resolve() not in self.image.resolve().parents:
            raise RuntimeError(f"{self.image} is not an image of {BASE / 'images'} (ensure_image()): "
                               "never booting systemd on another tree")

    def _find_leader(self, timeout: float) -> int:
        """The container's PID 1, as this machine numbers it: a descendant of
        nspawn that is pid 1 of its own namespace."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._nspawn.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited ({self._nspawn.returncode}): {self.console()[-2000:]}")
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    status = (entry / "status").read_text()
                except OSError:
                    continue
                fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                nspid = fields.get("NSpid", "").split()
                if len(nspid) >= 2 and nspid[-1] == "1" and self._descends(int(entry.name)):
                    return int(entry.name)
            time.sleep(0.1)
        raise RuntimeError(f"no PID 1 of {self.name} after {timeout:.0f}s")

    def _descends(self, pid: int) -> bool:
        for _ in range(8):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
            if pid == self._nspawn.pid:
                return True
            if pid <= 1:
                return False
        return False

    def check_canaries(self, when: str) -> None:
        missing = [str(c) for c in self.canaries if not c.exists()]
        if missing:
            message = (f"!!! {when}, the canaries {', '.join(missing)} are gone: the container's systemd "
                       "may have emptied the machine's /tmp, /var/tmp or /run. Stop and look. !!!")
            print(message, file=sys.stderr)
            raise HostTmpTouched(message)

    def stop(self, timeout: float = 60) -> None:
        """Power the container off and undo every change; idempotent."""
        try:
            if self._journal is not None:
                doc = dict(self._journal.doc, canaries=[])     # checked below, then removed
                self._journal = None
                what = undo(self.dir, doc, timeout)
                self.log("systemd harness: " + ("; ".join(what) or "nothing to undo"))
                if self._nspawn is not None:
                    self._nspawn.poll()
                try:
                    if self._canaries_written:
                        self.check_canaries("after the shutdown")
                finally:
                    for canary in self.canaries:
                        canary.unlink(missing_ok=True)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    # -- inside ----------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 300, input: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """argv inside the container (all its namespaces, as root), with a
        clean environment; stdout and stderr as text."""
        if self.leader is None:
            raise RuntimeError("the container is not running")
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                               f"PATH={SBIN_PATH}", "LANG=C.UTF-8", "HOME=/root",
                               "DEBIAN_FRONTEND=noninteractive", *extra, *argv],
                              capture_output=True, text=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL)
        if check and done.returncode:
            raise RuntimeError(f"in {self.name}: {' '.join(argv)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def path(self, inside: str) -> Path:
        """A path of the container as this machine reaches it (its /run and
        /tmp too, through its PID 1's root)."""
        return Path(f"/proc/{self.leader}/root") / inside.lstrip("/")

    def put(self, source: Path, inside: str, mode: int = 0o644) -> None:
        """Copy a file of this machine into the container."""
        target = self.root / inside.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(target.parent, 0o755)
        shutil.copyfile(source, target)
        os.chmod(target, mode)

    def console(self) -> str:
        try:
            return (self.dir / "console.log").read_bytes().decode("utf-8", "replace")
        except OSError:
            return ""


if __name__ == "__main__":
    if sys.argv[1:] != ["--reap"]:
        print("usage: python3 tests/systemd/harness.py --reap", file=sys.stderr)
        sys.exit(2)
    lock = take_session_lock(1800)      # ci-package.sh's own, when it holds it
    reap_dead(lambda line: print(line, file=sys.stderr))
    lock.close()
