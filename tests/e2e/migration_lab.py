"""Two libvirt hosts on this one machine, for real live migrations (see
/work/shared/docs/migration-lab.md for how this was made to work by hand).

Each host is a long-lived "anchor" process (`sleep`) in its own mount, UTS
and network namespace. Inside it, per-host directories are bind-mounted over
/etc/libvirt, /var/lib/libvirt, /run/libvirt, /var/cache/libvirt and
/var/log/libvirt. virtlogd and libvirtd run there (started with `nsenter -t
<anchor>`, each with its own `-p` pidfile: the default pidfiles live outside
/run/libvirt, and so does the machine's own libvirtd). A veth pair joins the
two network namespaces (10.77.0.1 and 10.77.0.2). The pair disappears with
them. Each host has its own host_uuid, its own vstor.conf (state, vhost and
qsd directories under the lab), and vstor's hook in its own
/etc/libvirt/hooks/qemu.d. The hook is installed before that libvirtd starts.
The disk files live in <lab>/shared. Both configs list it in [migrate] shared
and in [paths] images. A's `[migrate] peer_command` runs `vstor migrate
agent` inside B's namespaces, and B's runs it inside A's.

What runs in the lab never touches the machine's own libvirtd. Processes are
found by pid or by their network namespace, never by name (pitfall 7: a
search by name would take a lab libvirtd for the default one; so does not
libvirtd.running_pid, which reads the default pid file). `Lab.stop()` also works after a half-done `start()`: it destroys
domains, stops daemons (SIGTERM, then SIGKILL), kills whatever is left in
the hosts' network namespaces, ends the anchors (their mounts, namespaces and
veth go with them) and removes the lab directory.

`Lab(take_lock=True)` holds libvirtd.SESSION_LOCK for its whole life, as
libvirtd.Daemons does. Inside a pytest session the `migration_lab` fixture
depends on `libvirt_daemons`, which already holds that lock for the session
(flock locks are per open file: taking it again from the same process would
wait for ourselves). That fixture also gives /dev/kvm to group kvm;
a standalone Lab does that itself.
"""
from __future__ import annotations

import json
import os
import pwd
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import libvirt
import pytest
from lxml import etree

from .guest import Guest, domain_xml
from .libvirtd import (KVM, _comm, close_quietly, reap_dead_session, share_kvm, take_session_lock,
                       wait_for_pidfile, which)

ROOT = Path(__file__).resolve().parents[2]
NS = "https://vstor.dev/xmlns/domain/1"
TOOLS = ("unshare", "nsenter", "ip", "virtlogd", "libvirtd", "qemu-storage-daemon")
LIBVIRT_DIRS = {"etc": "/etc/libvirt", "lib": "/var/lib/libvirt", "run": "/run/libvirt",
                "cache": "/var/cache/libvirt", "log": "/var/log/libvirt"}
SUBNET = "10.77.0"

# Runs in the new namespaces: name the host, bring lo up, put the host's own
# libvirt directories in place, say so, then keep the namespaces alive.
ANCHOR = r"""set -e
hostname "$1"
ip link set lo up
for pair in $2; do
    mkdir -p "${pair#*:}"
    mount --bind "${pair%%:*}" "${pair#*:}"
done
echo ready
exec sleep infinity
"""


@dataclass
class Host:
    key: str                    # "A" or "B"
    hostname: str
    dir: Path                   # <lab>/<key>
    addr: str                   # on the veth
    host_uuid: str
    anchor: subprocess.Popen | None = None
    netns: str | None = None    # readlink /proc/<anchor>/ns/net
    pids: dict[str, int] = field(default_factory=dict)
    _conn: libvirt.virConnect | None = None

    # -- where things are ------------------------------------------------------------
    @property
    def uri(self) -> str:
        # The lab path, not /run/libvirt: virsh, the tests and the other
        # host's libvirtd can all reach it.
        return f"qemu+unix:///system?socket={self.dir}/run/libvirt-sock"

    @property
    def conf(self) -> Path:
        return self.dir / "vstor.conf"

    @property
    def vstor_dir(self) -> Path:
        return self.dir / "vstor"

    @property
    def state_dir(self) -> Path:
        return self.vstor_dir / "state"

    @property
    def vhost_dir(self) -> Path:
        return self.vstor_dir / "vhost"

    @property
    def qsd_dir(self) -> Path:
        return self.vstor_dir / "qsd"

    @property
    def local(self) -> Path:
        """Images only this host lists in [paths] images (not shared)."""
        return self.dir / "local"

    def console(self, name: str) -> Path:
        """Where this host's virtlogd writes the console of domain_xml()'s
        default <console> (/var/log/libvirt/qemu inside the host)."""
        return self.dir / "log" / "qemu" / f"{name}-console.log"

    # -- acting inside the host ------------------------------------------------------
    def enter(self) -> list[str]:
        """argv prefix that runs a command inside this host (cwd: the repository,
        so `python -m vstor.cli.main` imports the vstor under test)."""
        if self.anchor is None:
            raise RuntimeError(f"host {self.key} is not running")
        return ["nsenter", "-t", str(self.anchor.pid), "-m", "-u", "-n", f"--wd={ROOT}", "--"]

    def vstor_argv(self, *args: str) -> list[str]:
        return [*self.enter(), sys.executable, "-m", "vstor.cli.main", "--config", str(self.conf),
                "-c", self.uri, *args]

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.enter(), *argv], capture_output=True, text=True,
                              timeout=timeout, input=input)
        if check and done.returncode:
            raise RuntimeError(f"host {self.key}: {' '.join(argv)} failed ({done.returncode}): "
                               f"{done.stderr.strip()}")
        return done

    def vstor(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`vstor --config <this host's> -c <this host's URI> ARGS` run on this host."""
        return subprocess.run(self.vstor_argv(*args), capture_output=True, text=True,
                              timeout=timeout)

    def connect(self, timeout: float = 30) -> libvirt.virConnect:
        if self._conn is not None and self._conn.isAlive():
            return self._conn
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._conn = libvirt.open(self.uri)
                return self._conn
            except libvirt.libvirtError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def domain(self, name: str) -> libvirt.virDomain | None:
        """The domain of that name on this host, if any (listed, not looked up:
        a lookup that fails prints libvirt's error on stderr)."""
        return next((d for d in self.connect().listAllDomains() if d.name() == name), None)

    # -- what vstor holds here -------------------------------------------------------
    def records(self) -> dict[str, str]:
        """domain -> status of every vstor state record on this host."""
        out = {}
        d = self.state_dir / "domains"
        for path in sorted(d.glob("*.json")) if d.is_dir() else ():
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                out[path.stem] = "unreadable"
                continue
            out[rec.get("domain", path.stem)] = rec.get("status")
        return out

    def sockets(self) -> list[str]:
        return [n for n in self._vhost() if not n.endswith(".vstor-prepared")]

    def marks(self) -> list[str]:
        """The prepared marks QEMU reads first (vstor.runtime.kinds.gate)."""
        return [n for n in self._vhost() if n.endswith(".vstor-prepared")]

    def _vhost(self) -> list[str]:
        return sorted(p.name for p in self.vhost_dir.iterdir()) if self.vhost_dir.is_dir() else []

    def qsd_pids(self) -> list[int]:
        """Live qemu-storage-daemons serving from this host's vstor directories."""
        mark = f"{self.vstor_dir}/"
        return [pid for pid, argv in _processes()
                if argv and os.path.basename(argv[0]) == "qemu-storage-daemon"
                and any(mark in a for a in argv)]

    def processes(self) -> list[int]:
        """Every live process in this host's network namespace but the anchor
        (libvirtd, virtlogd, QEMU, qemu-storage-daemons, hooks, agents)."""
        if self.netns is None:
            return []
        anchor = self.anchor.pid if self.anchor else None
        out = []
        for pid, _ in _processes():
            if pid != anchor and _readlink(f"/proc/{pid}/ns/net") == self.netns:
                out.append(pid)
        return out

    def close(self) -> None:
        close_quietly(self._conn)
        self._conn = None


class Lab:
    def __init__(self, root: str | os.PathLike | None = None, take_lock: bool = True,
                 lock_wait: float = 900) -> None:
        self.take_lock, self.lock_wait = take_lock, lock_wait
        self._lock = None
        self._made_root = root is None
        self.root = Path(root) if root else None
        self.kvm_mode: tuple[int, int, int] | None = None
        self.a: Host | None = None
        self.b: Host | None = None

    @property
    def hosts(self) -> list[Host]:
        return [h for h in (self.a, self.b) if h is not None]

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    # -- start -----------------------------------------------------------------------
    def start(self, timeout: float = 60) -> Lab:
        missing = [t for t in TOOLS if not which(t)]
        if missing:
            raise RuntimeError("the migration lab needs: " + ", ".join(missing))
        if self.take_lock:
            self._take_lock()
            self._share_kvm()
        if self.root is None:
            # Short: every vstor socket path must stay under 108 bytes.
            self.root = Path(tempfile.mkdtemp(prefix="vmig-", dir="/tmp"))
        self.root.chmod(0o755)      # QEMU (libvirt-qemu) traverses to sockets and disks
        self.shared.mkdir(exist_ok=True)
        self.a = Host("A", "host-a.vstor.test", self.root / "A", f"{SUBNET}.1",
                      "aaaaaaaa-0000-4000-8000-00000000000a")
        self.b = Host("B", "host-b.vstor.test", self.root / "B", f"{SUBNET}.2",
                      "aaaaaaaa-0000-4000-8000-00000000000b")
        for h in self.hosts:
            self._lay_out(h)
        for h in self.hosts:
            self._start_anchor(h, timeout)
        self._link()
        self.write_config(self.a, peer=self.b)
        self.write_config(self.b, peer=self.a)
        from vstor.cli.hooks import render_hook
        for h in self.hosts:
            hook = h.dir / "etc" / "hooks" / "qemu.d" / "vstor"
            text = render_hook(str(h.conf))
            # libvirt runs hooks from / with a scrubbed environment (no
            # PYTHONPATH): pin the vstor these tests come from, not whatever
            # an editable install elsewhere points at. In CI, where vstor is
            # `pip install -e` of this checkout, this changes nothing.
            # (Inside the shell hook's single-quoted program: double quotes.)
            assert "'" not in str(ROOT) and '"' not in str(ROOT)
            text = text.replace("import sys\n", f'import sys\nsys.path.insert(0, "{ROOT}")\n', 1)
            hook.write_text(text)
            hook.chmod(0o755)
        for h in self.hosts:
            self._start_daemon(h, "virtlogd", timeout)
            self._start_daemon(h, "libvirtd", timeout)
        for h in self.hosts:
            h.connect(timeout)
        return self

    def write_config(self, h: Host, peer: Host | None = None, extra: str = "") -> None:
        """The host's vstor.conf. No SPDK reactors. The lab's guests have
        cpus='shared', and shared vCPUs run on the housekeeping cores, so every
        online core is a housekeeping core. test_hook.py, with dedicated vCPUs,
        has none: on this 2-CPU machine nothing is left to dedicate."""
        online = Path("/sys/devices/system/cpu/online").read_text().strip()
        text = (f"[paths]\nstate_dir = {h.state_dir}\nvhost_dir = {h.vhost_dir}\n"
                f"qsd_dir = {h.qsd_dir}\nimages = {self.shared} {h.local}\n"
                f"[cpu]\nhousekeeping = {online}\nreactors =\n"
                f"[migrate]\nshared = {self.shared}\n")
        from vstor.config import Config
        if hasattr(Config(), "local_peers"):
            # Both hosts are on this machine: B's daemon may share the disk
            # file with A's during the hand-over (another mount namespace, a
            # socket of the same name). Real hosts never need this.
            text += "local_peers = yes\n"
        if peer is not None:
            agent = [*peer.enter(), sys.executable, "-m", "vstor.cli.main", "--config",
                     str(peer.conf), "-c", peer.uri, "migrate", "agent"]
            text += f"peer_command = {shlex.join(agent)}\n"
        h.conf.write_text(text + extra)

    def _lay_out(self, h: Host) -> None:
        for d in ("run", "log/qemu", "lib/qemu", "local"):
            (h.dir / d).mkdir(parents=True, exist_ok=True)
        qemu = pwd.getpwnam("libvirt-qemu")
        os.chown(h.dir / "lib" / "qemu", qemu.pw_uid, qemu.pw_gid)
        (h.dir / "lib" / "qemu").chmod(0o750)
        shutil.copytree("/etc/libvirt", h.dir / "etc", symlinks=True)
        if Path("/var/cache/libvirt").is_dir():     # QEMU's probed capabilities: a fast start
            shutil.copytree("/var/cache/libvirt", h.dir / "cache", symlinks=True)
        else:
            (h.dir / "cache").mkdir()
        etc = h.dir / "etc"
        # Nothing of the machine's own libvirt: no hooks (the session's vstor
        # hook would point at test_hook's config), no domains, no autostart.
        for sub in ("hooks", "qemu/autostart", "qemu/networks/autostart", "storage/autostart"):
            shutil.rmtree(etc / sub, ignore_errors=True)
        for xml in (etc / "qemu").glob("*.xml"):
            xml.unlink()
        (etc / "hooks" / "qemu.d").mkdir(parents=True)
        conf = etc / "libvirtd.conf"
        lines = [ln for ln in conf.read_text().splitlines()
                 if not ln.lstrip().startswith(("host_uuid", "log_outputs"))]
        # libvirt refuses a migration between two hosts of the same host UUID.
        lines += [f'host_uuid = "{h.host_uuid}"',
                  'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"']
        conf.write_text("\n".join(lines) + "\n")
        # qemu.conf: nothing. On this machine libvirt leaves QEMU in the root
        # cgroup (no systemd, so no machine.slice), uses no lock manager and
        # no security driver besides DAC, so the two libvirtds never collide.

    def _start_anchor(self, h: Host, timeout: float) -> None:
        pairs = " ".join(f"{h.dir / d}:{target}" for d, target in LIBVIRT_DIRS.items())
        h.anchor = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--net", "--propagation", "private", "--",
             "sh", "-c", ANCHOR, "anchor", h.hostname, pairs],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        ready, _, _ = select.select([h.anchor.stdout], [], [], timeout)
        line = h.anchor.stdout.readline().decode().strip() if ready else ""
        if line != "ready":
            h.anchor.kill()
            err = h.anchor.communicate(timeout=5)[1].decode().strip()
            h.anchor = None
            raise RuntimeError(f"host {h.key}: namespaces not set up: {err or 'no answer'}")
        h.netns = _readlink(f"/proc/{h.anchor.pid}/ns/net")
        if h.netns is None or h.netns == _readlink("/proc/self/ns/net"):
            raise RuntimeError(f"host {h.key}: the anchor has no network namespace of its own")

    def _link(self) -> None:
        a, b = self.a, self.b
        a.run("ip", "link", "add", "mig-a", "type", "veth", "peer", "name", "mig-b",
              "netns", str(b.anchor.pid))
        for h, dev in ((a, "mig-a"), (b, "mig-b")):
            h.run("ip", "addr", "add", f"{h.addr}/24", "dev", dev)
            h.run("ip", "link", "set", dev, "up")

    def _start_daemon(self, h: Host, name: str, timeout: float) -> None:
        pidfile = h.dir / f"{name}.pid"
        pidfile.unlink(missing_ok=True)
        h.run(which(name) or name, "-d", "-p", str(pidfile))
        h.pids[name] = wait_for_pidfile(pidfile, name, timeout, f"host {h.key}: ")

    def _take_lock(self) -> None:
        self._lock = take_session_lock(self.lock_wait)
        reap_dead_session()

    def _share_kvm(self) -> None:
        self.kvm_mode = share_kvm()

    # -- using it --------------------------------------------------------------------
    def disk(self, name: str, size: int = 4 << 20, where: Path | None = None) -> Path:
        """A fresh raw file (in <lab>/shared unless `where`)."""
        path = (where or self.shared) / f"{name}.raw"
        with open(path, "wb") as f:
            f.truncate(size)
        return path

    def migrate(self, name: str, src: Host, dst: Host, xml: str | None = None,
                persistent_xml: str | None = None,
                timeout: float = 120) -> tuple[float, libvirt.libvirtError | None]:
        """`virsh migrate --live --persistent --undefinesource [--xml FILE]
        [--persistent-xml FILE] NAME DST --migrateuri tcp://<dst addr>`
        through libvirt-python. Returns
        (seconds, the error or None). When it takes longer than `timeout`, the
        job is aborted and RuntimeError is raised. Without a migrate URI, libvirt
        would send QEMU to the destination's host name, which does not resolve."""
        dom = src.connect().lookupByName(name)
        params = {libvirt.VIR_MIGRATE_PARAM_URI: f"tcp://{dst.addr}"}
        if xml is not None:
            params[libvirt.VIR_MIGRATE_PARAM_DEST_XML] = xml
        if persistent_xml is not None:
            params[libvirt.VIR_MIGRATE_PARAM_PERSIST_XML] = persistent_xml
        flags = (libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PERSIST_DEST
                 | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE)
        result: dict = {}

        def run():
            try:
                dom.migrate3(dst.connect(), params, flags)
            except libvirt.libvirtError as e:
                result["error"] = e
        t0 = time.monotonic()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            try:
                dom.abortJob()
            except libvirt.libvirtError:
                pass
            worker.join(30)
            raise RuntimeError(f"migrating {name} {src.key}->{dst.key} took over {timeout:.0f}s; aborted")
        return time.monotonic() - t0, result.get("error")

    def forget(self, name: str) -> None:
        """Leave no trace of a domain on either host (end of a test, passed or not)."""
        for h in self.hosts:
            try:
                dom = h.domain(name)
                if dom is not None:
                    if dom.isActive():
                        dom.destroy()
                    if dom.isPersistent():
                        dom.undefine()
            except libvirt.libvirtError:
                pass
        deadline = time.monotonic() + 15       # release end runs just after QEMU exits
        for h in self.hosts:
            while name in h.records() and time.monotonic() < deadline:
                time.sleep(0.2)
            if name in h.records():
                h.vstor("release", "--force", name)
            for pid in h.qsd_pids():
                if any(f"/{name}-" in a for a in _cmdline(pid)):
                    _terminate(pid, 5)
            # A rerun's checks must not read an earlier run's console (a crash).
            h.console(name).unlink(missing_ok=True)

    # -- stop ------------------------------------------------------------------------
    def stop(self, timeout: float = 20) -> list[str]:
        """Undo everything start() did, as far as it got; what went wrong on the
        way (for information: stop() goes on regardless)."""
        problems: list[str] = []

        def attempt(what, fn, *args):
            try:
                fn(*args)
            except Exception as e:      # teardown goes on whatever failed
                problems.append(f"{what}: {type(e).__name__}: {e}")

        for h in self.hosts:
            if h.pids.get("libvirtd"):
                attempt(f"{h.key}: destroying domains", self._destroy_all, h)
            h.close()
        for h in self.hosts:
            for name in ("libvirtd", "virtlogd"):
                if name in h.pids:
                    attempt(f"{h.key}: stopping {name}", _terminate, h.pids.pop(name), timeout)
        for h in self.hosts:
            # QEMU, qemu-storage-daemons, a hook or agent still running.
            attempt(f"{h.key}: ending its processes", _terminate_all, h.processes(), timeout)
        for h in self.hosts:
            if h.anchor is not None:
                attempt(f"{h.key}: ending the anchor", _end_anchor, h.anchor)
                h.anchor = None
        if self.root is not None and self._made_root:
            attempt("removing the lab", _remove_tree, self.root)
        if self.kvm_mode:
            mode, uid, gid = self.kvm_mode
            attempt("restoring /dev/kvm", lambda: (os.chown(KVM, uid, gid), KVM.chmod(mode)))
            self.kvm_mode = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        return problems

    @staticmethod
    def _destroy_all(h: Host) -> None:
        conn = h.connect(5)
        for dom in conn.listAllDomains():
            try:
                if dom.isActive():
                    dom.destroy()
                if dom.isPersistent():
                    dom.undefine()
            except libvirt.libvirtError:
                pass
        # Let libvirt run `release end` (which stops vstor's daemons) before
        # libvirtd goes.
        deadline = time.monotonic() + 15
        while h.records() and time.monotonic() < deadline:
            time.sleep(0.2)

    def leftovers(self) -> list[str]:
        """What of the lab is still on the machine (empty after stop())."""
        out = []
        if self.root is not None and self.root.exists():
            out.append(f"directory {self.root}")
        if self.root is not None:
            mounts = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                      if str(self.root) in ln]
            out += [f"mount {ln.split()[4]}" for ln in mounts]
            out += [f"pid {pid} ({' '.join(argv)[:80]})" for pid, argv in _processes()
                    if any(str(self.root) in a for a in argv)]
        return out


# -- helpers -------------------------------------------------------------------------------

def vstor_domain_xml(name: str, guest: Guest, disk: str | os.PathLike, cmdline_job: str, *,
                     memory_mib: int = 256, target: str = "vdb", cells: bool = False) -> str:
    """The test guest with vstor metadata: shared CPUs, migratable, one
    qemu-storage-daemon disk on `disk` (vstor define renders the vhost-user
    disk and the memfd shared memory that vhost-user needs).  cells: two
    guest NUMA cells (two vCPUs), the disk in cell 1."""
    root = etree.fromstring(domain_xml(name, guest, cmdline_job, memory_backing=None,
                                       memory_mib=memory_mib, vcpus=2 if cells else 1))
    vm, at = ("cells='2' ", " cell='1'") if cells else ("", "")
    meta = etree.fromstring(
        f"<metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm {vm}cpus='shared' migratable='yes'/>"
        f"<vstor:disk target='{target}' backend='qsd'{at}><vstor:file path='{disk}'/></vstor:disk>"
        "</vstor:vstor></metadata>")
    root.insert(root.index(root.find("vcpu")) + 1, meta)
    return etree.tostring(root, encoding="unicode")


def _processes():
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = _cmdline(int(entry.name))
            if argv is not None:
                yield int(entry.name), argv


def _cmdline(pid: int) -> list[str] | None:
    """argv of a live process (None if gone or a zombie)."""
    if _comm(pid) is None:
        return None
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _terminate(pid: int, timeout: float) -> None:
    _terminate_all([pid], timeout)


def _terminate_all(pids: list[int], timeout: float) -> None:
    """SIGTERM, then SIGKILL for what is still there after `timeout`."""
    alive = {pid: _comm(pid) for pid in pids}
    alive = {p: c for p, c in alive.items() if c is not None}
    for pid in alive:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        alive = {p: c for p, c in alive.items() if _comm(p) == c}
        if not alive:
            return
        if time.monotonic() > deadline:
            if killed:
                raise RuntimeError(f"pids {sorted(alive)} survive SIGKILL")
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed, deadline = True, time.monotonic() + 10
        time.sleep(0.1)


def _end_anchor(anchor: subprocess.Popen) -> None:
    """The anchor is the namespaces' last process: with it go the bind mounts,
    the network namespace and the veth end inside it."""
    if anchor.poll() is None:
        anchor.kill()
    anchor.wait(10)
    for f in (anchor.stdout, anchor.stderr):
        if f is not None:
            f.close()


def _remove_tree(root: Path) -> None:
    mounted = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
               if str(root) in ln.split()[4]]
    for point in sorted(mounted, reverse=True):     # never rm -r through a mount
        subprocess.run(["umount", "-l", point], capture_output=True)
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def migration_lab(libvirt_daemons):
    """Two hosts A and B, for one test module. `libvirt_daemons` holds the
    session's e2e lock (and shares /dev/kvm); the lab must not take it again."""
    from .conftest import unavailable
    missing = [t for t in TOOLS if not which(t)]
    if missing:
        unavailable("the migration lab needs: " + ", ".join(missing))
    lab = Lab(take_lock=False)
    try:
        lab.start()
    except BaseException:
        lab.stop()
        raise
    yield lab
    problems = lab.stop()
    left = lab.leftovers()
    assert not problems and not left, f"lab teardown: {problems} {left}"
