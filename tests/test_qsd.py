"""vstor.backends.qsd (export, daemon, monitor) against the real qemu-storage-daemon.

The daemon tests need root (sockets are chowned to the QEMU group and
connections are tried as libvirt-qemu and nobody): they skip without root,
and fail instead when CI=true.  A minimal vhost-user-blk front end (below)
does real I/O through the exported socket, without booting a guest.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import mmap
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time

import pytest

from vstor.errors import ActionFailed, BadInput, DoesNotFit, Unavailable
from vstor.backends.qsd import daemon
from vstor.backends.qsd.export import QsdExport
from vstor.host import sources
from vstor.host.sysfs import SysFS
from vstor.backends.qsd.monitor import Monitor, QmpConnectionError, QmpError

QSD = "/usr/bin/qemu-storage-daemon"
QEMU_USER, QEMU_GROUP = "libvirt-qemu", "kvm"
CI = os.environ.get("CI") == "true"
# The image root every scratch source of these tests lies below.
ROOTS = ["/tmp"]


def start(export, **kw):
    return daemon.start(export, roots=ROOTS, **kw)


def restart_if_dead(export, **kw):
    return daemon.restart_if_dead(export, roots=ROOTS, **kw)


def _need(ok: bool, why: str):
    if not ok:
        if CI:
            pytest.fail(f"CI=true and {why}")
        pytest.skip(why)


@pytest.fixture
def area():
    """A scratch tree QEMU's user may traverse: base/run (the run dir),
    base/vhost (sockets), base/disk.raw (8 MiB).  Stops every export made."""
    _need(os.geteuid() == 0, "needs root")
    _need(os.access(QSD, os.X_OK), f"{QSD} is not installed")
    for name, get in ((QEMU_USER, pwd.getpwnam), (QEMU_GROUP, grp.getgrnam)):
        try:
            get(name)
        except KeyError:
            _need(False, f"no {name} on this host")
    base = tempfile.mkdtemp(prefix="vq-", dir="/tmp")
    os.chmod(base, 0o711)
    made: list[QsdExport] = []
    area = Area(base, made)
    with open(area.disk, "wb") as f:
        f.truncate(8 << 20)
    yield area
    for export in made:
        with contextlib.suppress(Exception):
            daemon.stop(export)
    shutil.rmtree(base)


class Area:
    def __init__(self, base: str, made: list):
        self.base, self.made = base, made
        self.run_dir = os.path.join(base, "run")
        self.vhost = os.path.join(base, "vhost")
        self.disk = os.path.join(base, "disk.raw")

    def export(self, name: str = "vm1-vdb", cls=QsdExport, **kw) -> QsdExport:
        kw.setdefault("source", self.disk)
        kw.setdefault("kind", "file")
        e = cls(run_dir=self.run_dir, name=name, socket_path=os.path.join(self.vhost, name), **kw)
        self.made.append(e)
        return e

    def leftovers(self) -> list[str]:
        """What a daemon left; the run dir's lock file stays on purpose
        (removing a lock file races with the next locker)."""
        found = []
        for d in (self.run_dir, self.vhost):
            if os.path.isdir(d):
                found += [os.path.join(d, n) for n in os.listdir(d) if n != ".lock"]
        users = os.path.join(self.run_dir, "users")     # the uid leases' (empty) directory
        if users in found and not os.listdir(users):
            found.remove(users)
        return found


def connect_as(user: str, path: str) -> int:
    """errno of connecting to `path` as `user` in a forked child (0 = connected).
    Written independently of daemon.connect_as on purpose."""
    pw = pwd.getpwnam(user)
    child = os.fork()
    if child == 0:
        code = 0
        try:
            os.setgroups(os.getgrouplist(user, pw.pw_gid))
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            s.connect(path)
            s.close()
        except OSError as e:
            code = e.errno or 254
        except BaseException:
            code = 255
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def qmp(export: QsdExport, command: str, args: dict | None = None):
    with Monitor(export.qmp_path) as client:
        return client.execute(command, args)


def node(export: QsdExport, name: str) -> dict:
    nodes = qmp(export, "query-named-block-nodes", {"flat": True})
    return next(n for n in nodes if n["node-name"] == name)


# -- a minimal vhost-user-blk front end (a test double of QEMU's side) ----------------------

class VhostUserBlk:
    """One split virtqueue of 8 entries in a shared memfd; synchronous requests.
    Enough to prove that bytes written through the socket land in the source."""

    GET_FEATURES, SET_FEATURES, SET_OWNER, SET_MEM_TABLE = 1, 2, 3, 5
    SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, SET_VRING_KICK, SET_VRING_CALL = 8, 9, 10, 12, 13
    GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, SET_VRING_ENABLE, GET_CONFIG = 15, 16, 18, 24
    F_BLK_RO, F_PROTOCOL_FEATURES, F_VERSION_1, PF_CONFIG = 1 << 5, 1 << 30, 1 << 32, 1 << 9
    QSIZE, MEM, UADDR = 8, 1 << 20, 0x7F0000000000
    DESC, AVAIL, USED, BUF = 0x0, 0x1000, 0x2000, 0x10000
    T_IN, T_OUT, T_FLUSH = 0, 1, 4

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.memfd = os.memfd_create("vu-test")
        os.ftruncate(self.memfd, self.MEM)
        self.mem = mmap.mmap(self.memfd, self.MEM)
        self.kick, self.call = os.eventfd(0), os.eventfd(0)
        self.avail_idx = 0
        self.features = self._get_u64(self.GET_FEATURES)
        proto = self._get_u64(self.GET_PROTOCOL_FEATURES) & self.PF_CONFIG
        self._send(self.SET_PROTOCOL_FEATURES, struct.pack("<Q", proto))
        self._send(self.SET_OWNER)
        want = self.F_VERSION_1 | self.F_PROTOCOL_FEATURES
        self._send(self.SET_FEATURES, struct.pack("<Q", self.features & want))
        self._send(self.SET_MEM_TABLE, struct.pack("<II4Q", 1, 0, 0, self.MEM, self.UADDR, 0),
                   fds=[self.memfd])
        self._send(self.SET_VRING_NUM, struct.pack("<II", 0, self.QSIZE))
        self._send(self.SET_VRING_BASE, struct.pack("<II", 0, 0))
        u = self.UADDR
        self._send(self.SET_VRING_ADDR, struct.pack("<IIQQQQ", 0, 0, u + self.DESC,
                                                    u + self.USED, u + self.AVAIL, 0))
        self._send(self.SET_VRING_KICK, struct.pack("<Q", 0), fds=[self.kick])
        self._send(self.SET_VRING_CALL, struct.pack("<Q", 0), fds=[self.call])
        self._send(self.SET_VRING_ENABLE, struct.pack("<II", 0, 1))

    def close(self):
        self.sock.close()
        self.mem.close()
        for fd in (self.memfd, self.kick, self.call):
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def capacity(self) -> int:
        """512-byte sectors, from the virtio-blk config space."""
        self._send(self.GET_CONFIG, struct.pack("<III", 0, 8, 0) + bytes(8))
        return struct.unpack_from("<Q", self._reply(self.GET_CONFIG), 12)[0]

    def read(self, sector: int, length: int) -> tuple[int, bytes]:
        return self._request(self.T_IN, sector, bytes(length), device_writes=True)

    def write(self, sector: int, data: bytes) -> int:
        return self._request(self.T_OUT, sector, data, device_writes=False)[0]

    def flush(self) -> int:
        return self._request(self.T_FLUSH, 0, b"", device_writes=False)[0]

    def _request(self, rtype, sector, data, device_writes):
        hdr, buf = self.BUF, self.BUF + 0x100
        status = buf + max(len(data), 1)
        self.mem[hdr:hdr + 16] = struct.pack("<IIQ", rtype, 0, sector)
        self.mem[buf:buf + len(data)] = data
        self.mem[status] = 0xFF
        descs = [(hdr, 16, 0)] + ([(buf, len(data), 2 if device_writes else 0)] if data else [])
        descs.append((status, 1, 2))
        for i, (addr, length, flags) in enumerate(descs):
            last = i + 1 == len(descs)
            struct.pack_into("<QIHH", self.mem, self.DESC + 16 * i, addr, length,
                             flags | (0 if last else 1), 0 if last else i + 1)
        struct.pack_into("<H", self.mem, self.AVAIL + 4 + 2 * (self.avail_idx % self.QSIZE), 0)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        struct.pack_into("<H", self.mem, self.AVAIL + 2, self.avail_idx)
        os.eventfd_write(self.kick, 1)
        deadline = time.monotonic() + 5
        while struct.unpack_from("<H", self.mem, self.USED + 2)[0] != self.avail_idx:
            if time.monotonic() > deadline:
                raise TimeoutError("the vhost-user-blk back end did not complete the request")
            time.sleep(0.001)
        return self.mem[status], bytes(self.mem[buf:buf + len(data)])

    def _send(self, req, payload=b"", fds=()):
        msg = struct.pack("<III", req, 0x1, len(payload)) + payload
        if fds:
            socket.send_fds(self.sock, [msg], list(fds))
        else:
            self.sock.sendall(msg)

    def _reply(self, req) -> bytes:
        got, flags, size = struct.unpack("<III", self._recv(12))
        assert got == req and flags & 0x4, (got, flags)
        return self._recv(size)

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the vhost-user back end closed the connection")
            out += chunk
        return out

    def _get_u64(self, req) -> int:
        self._send(req)
        return struct.unpack("<Q", self._reply(req))[0]


def roundtrip(socket_path: str, sector: int = 8) -> bytes:
    """Write a random 4 KiB pattern through the socket, flush, read it back."""
    pattern = os.urandom(4096)
    with VhostUserBlk(socket_path) as dev:
        assert dev.write(sector, pattern) == 0
        assert dev.flush() == 0
        status, data = dev.read(sector, len(pattern))
        assert status == 0 and data == pattern
    return pattern


def on_disk(path: str, sector: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(sector * 512)
        return f.read(length)


# -- pure: command line, names, record (no root) ----------------------------------------------

def _pure(**kw) -> QsdExport:
    base = dict(run_dir="/run/vstor/qsd", name="vm1-vdb", source="/var/lib/vstor/a,b.raw",
                kind="file", socket_path="/run/vstor/vhost/vm1-vdb")
    return QsdExport(**{**base, **kw})


def test_argv_is_the_documented_command_line():
    # No path of the source and none of the socket: the daemon inherits both.
    assert _pure(direct=True).argv(7, 9, 11) == [
        QSD,
        "--blockdev", "driver=file,node-name=file0,filename=/proc/self/fd/7,"
                      "cache.direct=on,aio=native,discard=unmap",
        "--blockdev", "driver=raw,node-name=disk0,file=file0,discard=unmap",
        "--export", "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=fd,"
                    "addr.str=9,writable=on,num-queues=1",
        "--chardev", "socket,id=qmp0,fd=11,server=on,wait=off",
        "--monitor", "chardev=qmp0",
        "--pidfile", "/run/vstor/qsd/vm1-vdb.pid",
        "--daemonize"]


def test_argv_readonly_block_and_unresolved_file():
    ro = _pure(kind="block", source="/dev/vg0/data", readonly=True, queues=4).argv(3, 4, 5)
    assert ro[2] == ("driver=host_device,node-name=file0,filename=/proc/self/fd/3,"
                     "cache.direct=on,aio=native,read-only=on")
    assert ro[4] == "driver=raw,node-name=disk0,file=file0,read-only=on"
    assert ro[6].endswith("writable=off,num-queues=4")
    # A file whose filesystem was not probed gets the mode that works everywhere.
    assert "cache.direct=off,aio=threads" in _pure().argv(3, 4, 5)[2]


@pytest.mark.parametrize("field,value,words", [
    ("name", "../etc", "not safe"),
    ("name", "a/b", "not safe"),
    ("name", ".hidden", "not safe"),
    ("name", "", "non-empty"),
    ("name", "x" * 97, "not safe"),
    ("name", "a,b", "not safe"),
    ("source", "relative.raw", "clean absolute path"),
    ("source", "/var/lib/../x.raw", "clean absolute path"),
    ("run_dir", "/run//vstor", "clean absolute path"),
    ("socket_path", "/run/" + "s" * 110, "longer than a Unix socket allows"),
    ("run_dir", "/" + "r" * 100, "longer than a Unix socket allows"),
    ("kind", "nvme", "neither"),
    ("queues", 0, "1 to 1024"),
    ("queues", True, "1 to 1024"),
    ("readonly", "yes", "true or false"),
])
def test_bad_input_is_refused_before_any_path_is_built(field, value, words):
    with pytest.raises(BadInput) as err:
        _pure(**{field: value})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_names_vstor_makes_are_accepted():
    assert _pure(name="db+1.prod-vdb").pidfile == "/run/vstor/qsd/db+1.prod-vdb.pid"


def test_record_roundtrip_is_json():
    e = _pure(readonly=True, queues=2)
    rec = json.loads(json.dumps(e.to_record()))
    assert rec["version"] == 1 and rec["socket_path"] == e.socket_path and rec["direct"] is None
    assert QsdExport.from_record(rec) == e
    with pytest.raises(BadInput, match="lacks socket_path"):
        QsdExport.from_record({k: v for k, v in rec.items() if k != "socket_path"})
    with pytest.raises(ActionFailed, match="version 9"):
        QsdExport.from_record({**rec, "version": 9})


def test_dry_run_lists_the_open_the_socket_and_the_command():
    lines = _pure().dry_run_lines()
    assert lines[0] == "install -d -o root -g kvm -m 0750 /run/vstor/qsd"
    assert lines[1].startswith("# vstor opens source=/var/lib/vstor/a,b.raw itself as SRC_FD")
    assert lines[2].startswith("# vstor binds /run/vstor/vhost/vm1-vdb itself, root:kvm 0660")
    assert lines[3] == "# vstor binds /run/vstor/qsd/vm1-vdb.qmp itself, root 0600, as QMP_FD"
    assert lines[4].startswith(QSD + " --blockdev ") and "--daemonize" in lines[4]
    assert "filename=/proc/self/fd/SRC_FD,cache.direct=off,aio=threads," in lines[4]
    assert "addr.type=fd,addr.str=SOCK_FD," in lines[4] and "qmp0,fd=QMP_FD," in lines[4]
    assert lines[5].startswith("# at start: cache.direct=on,aio=native instead")
    # Nothing to probe: the daemon's dry run shows the same.
    assert daemon.dry_run(_pure()) == lines


def test_daemon_dry_run_probes_o_direct_and_changes_nothing(tmp_path):
    disk = tmp_path / "disk.raw"
    disk.write_bytes(bytes(4096))
    e = _pure(run_dir=str(tmp_path / "run"), source=str(disk))
    lines = daemon.dry_run(e, roots=[str(tmp_path)])
    # tmp_path is on ext4 here, which takes O_DIRECT; the pure lines cannot know.
    assert "cache.direct=on,aio=native" in lines[4]
    assert "cache.direct=off,aio=threads" in e.dry_run_lines()[4]
    assert os.listdir(tmp_path) == ["disk.raw"]


def test_the_pure_modules_pull_in_no_process_control():
    forbidden = {"subprocess", "socket", "signal", "select", "pwd", "grp", "fcntl", "asyncio",
                 "qemu", "vstor.runtime", "vstor.backends.qsd.daemon"}
    probe = ("import sys; before = set(sys.modules); "
             "import vstor.backends.qsd, vstor.backends.qsd.export; "
             "print(' '.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run(["python3", "-c", probe], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loaded = set(out.stdout.split())
    assert "vstor.backends.qsd.export" in loaded
    assert {m for m in loaded if m.split(".")[0] in forbidden or m in forbidden
            or m.startswith("vstor.runtime")} == set()


def test_missing_binary_is_unavailable(area):
    with pytest.raises(Unavailable, match="apt install qemu-system-common"):
        start(area.export(binary="/nonexistent/qemu-storage-daemon"))
    assert area.leftovers() == []


# -- the QMP monitor (qemu.qmp behind vstor's errors) ----------------------------------------

def test_qmp_error_carries_class_and_desc(area):
    e = area.export()
    start(e)
    with Monitor(e.qmp_path) as client:
        assert client.version["qemu"]["major"] >= 7
        with pytest.raises(QmpError) as err:
            client.execute("no-such-command")
        assert err.value.error_class == "CommandNotFound" and "no-such-command" in err.value.desc
        assert isinstance(err.value, ActionFailed) and err.value.exit_code == 5
        assert str(err.value).startswith("QMP no-such-command failed: CommandNotFound: ")
        assert client.execute("query-block-exports")[0]["id"] == "exp0"   # still usable
        with pytest.raises(QmpError, match="GenericError"):
            client.execute("query-named-block-nodes", {"flat": "yes"})


def test_qmp_unreachable_and_silent_monitors(tmp_path):
    with pytest.raises(QmpConnectionError, match="cannot connect.*No such file") as err:
        Monitor(str(tmp_path / "none.qmp"), timeout=1).connect()
    assert isinstance(err.value, Unavailable) and err.value.exit_code == 4
    path = str(tmp_path / "silent.qmp")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    start = time.monotonic()
    with pytest.raises(QmpConnectionError, match="within 0.3s"):
        Monitor(path, timeout=0.3).connect()
    assert time.monotonic() - start < 2
    server.close()


class FakeMonitor:
    """A local QMP server that greets, negotiates, then plays `after` with the
    first command: "hangup" closes, "silent" never answers."""

    GREETING = {"QMP": {"version": {"qemu": {"major": 9, "minor": 0, "micro": 0},
                                    "package": ""}, "capabilities": []}}

    def __init__(self, path: str, after: str, greeting=None):
        self.after, self.greeting = after, greeting or self.GREETING
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.server.accept()
        with conn:
            conn.sendall(json.dumps(self.greeting).encode() + b"\n")
            for msg in self._requests(conn):
                if msg["execute"] != "qmp_capabilities":
                    if self.after == "silent":
                        time.sleep(1)
                    return
                conn.sendall(json.dumps({"return": {}, "id": msg.get("id")}).encode() + b"\n")

    @staticmethod
    def _requests(conn):
        """QMP requests are a JSON stream, not necessarily one per line."""
        buf, decoder = "", json.JSONDecoder()
        while chunk := conn.recv(4096):
            buf += chunk.decode()
            while buf.strip():
                try:
                    msg, end = decoder.raw_decode(buf.lstrip())
                except ValueError:
                    break
                buf = buf.lstrip()[end:]
                yield msg

    def close(self):
        self.server.close()
        self.thread.join(5)


@pytest.mark.parametrize("after,words", [
    ("hangup", "QMP query-block-exports: .* closed the connection"),
    ("silent", "QMP query-block-exports: no answer from .* within 0.3s"),
])
def test_qmp_monitor_that_goes_away_is_unavailable(tmp_path, after, words):
    path = str(tmp_path / "fake.qmp")
    fake = FakeMonitor(path, after)
    try:
        with Monitor(path, timeout=0.3) as client:
            assert client.version["qemu"]["major"] == 9
            with pytest.raises(QmpConnectionError, match=words) as err:
                client.execute("query-block-exports")
            assert "\n" not in str(err.value)
            with pytest.raises(QmpConnectionError, match="not connected"):
                client.execute("query-block-exports")
    finally:
        fake.close()


def test_qmp_something_that_is_not_a_monitor(tmp_path):
    path = str(tmp_path / "other.qmp")
    fake = FakeMonitor(path, "hangup", greeting={"hello": "world"})
    try:
        with pytest.raises(QmpConnectionError, match="is not a usable QMP monitor") as err:
            Monitor(path, timeout=1).connect()
        assert "\n" not in str(err.value)
    finally:
        fake.close()


class FlakyMonitor(FakeMonitor):
    """A QMP server that hangs up on its first client between greeting and
    capabilities (as qsd was seen to in CI), then serves query-block-exports."""

    def __init__(self, path: str):
        super().__init__(path, "serve")

    def _serve(self):
        first, _ = self.server.accept()
        first.sendall(json.dumps(self.greeting).encode() + b"\n")
        first.close()
        conn, _ = self.server.accept()
        with conn:
            conn.sendall(json.dumps(self.greeting).encode() + b"\n")
            for msg in self._requests(conn):
                ret = [{"id": "exp0"}] if msg["execute"] == "query-block-exports" else {}
                conn.sendall(json.dumps({"return": ret, "id": msg.get("id")}).encode() + b"\n")


def test_a_monitor_that_hangs_up_once_still_answers(tmp_path):
    e = QsdExport(run_dir=str(tmp_path), name="vm1-vdb", source="/dev/null", kind="file",
                  socket_path=str(tmp_path / "vm1-vdb"))
    fake = FlakyMonitor(e.qmp_path)
    try:
        assert daemon._answers(e, timeout=2.0)
    finally:
        fake.close()


# -- the daemon --------------------------------------------------------------------------------

def test_start_hands_the_socket_to_the_qemu_group_only(area):
    e = area.export()
    pid = start(e)
    kvm = grp.getgrnam(QEMU_GROUP).gr_gid
    st = os.lstat(e.socket_path)
    assert stat.S_ISSOCK(st.st_mode) and (st.st_uid, st.st_gid) == (0, kvm)
    assert stat.S_IMODE(st.st_mode) == 0o660
    rd = os.stat(area.run_dir)
    assert (rd.st_uid, rd.st_gid, stat.S_IMODE(rd.st_mode)) == (0, kvm, 0o750)
    assert stat.S_IMODE(os.stat(e.pidfile).st_mode) == 0o600
    assert daemon.pid(e) == pid and daemon.alive(e)
    assert connect_as(QEMU_USER, e.socket_path) == 0
    assert connect_as("nobody", e.socket_path) == errno.EACCES
    assert connect_as(QEMU_USER, e.qmp_path) == errno.EACCES      # the monitor is root's
    roundtrip(e.socket_path)        # the probes above left the export usable
    # The start/stop lock is root's alone: QEMU's group cannot open it to stall vstor.
    lock = os.stat(os.path.join(area.run_dir, ".lock"))
    assert (lock.st_uid, stat.S_IMODE(lock.st_mode)) == (0, 0o600)


def test_a_socket_qemu_cannot_reach_is_refused_and_every_directory_change_is_seen(area, monkeypatch):
    """QEMU's user must reach each socket through every directory above it.
    That is tried with one connection per directory while the directories
    stay as they were: a chmod of any of them is seen by the next start."""
    forks = []
    from vstor.backends.qsd import proc
    real = proc.connect_as
    monkeypatch.setattr(proc, "connect_as", lambda *a: forks.append(a[1]) or real(*a))
    # What earlier tests' daemons reached (a reused inode with the same
    # owner and mode is the same path to QEMU's user: rightly remembered).
    monkeypatch.setattr(proc, "_REACHED", set())
    disks = []
    for n in range(4):
        disks.append(os.path.join(area.base, f"d{n}.raw"))
        with open(disks[-1], "wb") as f:
            f.truncate(1 << 20)
    a, b = area.export("vm1-vdb", source=disks[0]), area.export("vm1-vdc", source=disks[1])
    start(a)
    start(b)
    assert forks == [a.socket_path]         # b's path is a's: not tried again
    os.chmod(area.base, 0o700)              # QEMU's user can no longer pass base
    c = area.export("vm1-vdd", source=disks[2])
    with pytest.raises(ActionFailed, match=f"^{QEMU_USER} cannot connect to {c.socket_path}: "
                                           "Permission denied") as e:
        start(c)
    assert e.value.hint == f"every directory above it must be searchable by group {QEMU_GROUP}"
    assert daemon.pid(c) is None and not os.path.lexists(c.socket_path)
    os.chmod(area.base, 0o711)              # back as it was when a was reached
    d = area.export("vm1-vde", source=disks[3])
    start(d)
    assert forks == [a.socket_path, c.socket_path]
    assert connect_as(QEMU_USER, d.socket_path) == 0
    # Known good path, but nobody listens: still found out (without a fork).
    daemon.stop(d)
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(d.socket_path)
        assert proc.reachable(QEMU_USER, d.socket_path) == "Connection refused"
    os.unlink(d.socket_path)
    assert forks == [a.socket_path, c.socket_path]


def test_a_daemon_keeps_no_file_its_starter_left_open(area):
    """The daemon outlives the hook: an fd the hook inherited open (a lock
    its caller holds, say) must not stay open in the daemon."""
    leaked = os.path.join(area.base, "callers-lock")
    fd = os.open(leaked, os.O_RDWR | os.O_CREAT, 0o600)
    os.set_inheritable(fd, True)
    try:
        pid = start(area.export())
        held = {os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
        assert leaked not in held and len(held) < 30
    finally:
        os.close(fd)


def test_socket_mode_alone_keeps_others_out(area):
    os.makedirs(area.vhost, mode=0o755)     # a directory anyone may traverse
    os.chmod(area.vhost, 0o755)
    e = area.export()
    start(e)
    assert connect_as("nobody", e.socket_path) == errno.EACCES
    assert connect_as(QEMU_USER, e.socket_path) == 0


def test_qmp_lists_the_export_and_the_cache_choice(area):
    e = area.export(queues=2)
    start(e)
    exports = qmp(e, "query-block-exports")
    assert [(x["id"], x["type"], x["node-name"]) for x in exports] == \
        [("exp0", "vhost-user-blk", "disk0")]
    assert node(e, "disk0")["ro"] is False
    # /tmp is ext4 here: O_DIRECT works, so the file is opened cache.direct=on.
    assert node(e, "file0")["cache"]["direct"] is True


def test_data_written_by_the_qemu_user_lands_in_the_file(area):
    e = area.export()
    start(e)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            pw = pwd.getpwnam(QEMU_USER)
            os.setgroups(os.getgrouplist(QEMU_USER, pw.pw_gid))
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            with VhostUserBlk(e.socket_path) as dev:
                os.write(w, struct.pack("<Q", dev.capacity()))
            os.write(w, roundtrip(e.socket_path, sector=24))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    with os.fdopen(r, "rb") as f:
        capacity, pattern = struct.unpack("<Q", f.read(8))[0], f.read()
    assert capacity == (8 << 20) // 512
    assert on_disk(area.disk, 24, 4096) == pattern


def test_stop_leaves_nothing_and_is_idempotent(area):
    e = area.export()
    pid = start(e)
    daemon.stop(e)
    assert gone(pid)
    assert area.leftovers() == []
    assert daemon.pid(e) is None and not daemon.alive(e)
    daemon.stop(e)        # a gone daemon is fine
    daemon.stop(QsdExport.from_record(e.to_record()))


def test_stop_orphan_touches_only_the_daemon_of_that_pidfile(area):
    e = area.export()
    pid = start(e)
    assert daemon.stop_orphan(e.pidfile) is True
    assert wait_gone(pid) and not os.path.exists(e.pidfile)
    # A stale pidfile naming a process that is no qsd of that file (this very
    # test) is removed, and that process is left alone.
    with open(e.pidfile, "w") as f:
        f.write(f"{os.getpid()}\n")
    assert daemon.stop_orphan(e.pidfile) is False
    assert not os.path.exists(e.pidfile)
    assert daemon.stop_orphan(e.pidfile) is False       # no pidfile at all


def test_connect_as_reports_why(area):
    e = area.export()
    start(e)
    assert daemon.connect_as(QEMU_USER, e.socket_path) is None
    assert daemon.connect_as("nobody", e.socket_path) == os.strerror(errno.EACCES)
    assert daemon.connect_as(QEMU_USER, os.path.join(area.base, "none")) == \
        os.strerror(errno.ENOENT)
    with pytest.raises(ActionFailed, match="user 'no-such-user' does not exist"):
        daemon.connect_as("no-such-user", e.socket_path)


def test_stop_kills_a_daemon_that_cannot_quit(area):
    e = area.export()
    pid = start(e)
    os.kill(pid, signal.SIGSTOP)        # frozen: QMP never answers, SIGTERM stays pending
    began = time.monotonic()
    daemon.stop(e, timeout=0.5)
    took = time.monotonic() - began
    assert gone(pid) and area.leftovers() == []
    assert took < 4, f"QMP 0.5s + SIGTERM grace 2s + SIGKILL, took {took:.1f}s"


def test_start_twice_reuses_the_running_daemon(area):
    e = area.export()
    pid = start(e)
    assert start(e) == pid
    assert start(QsdExport.from_record(e.to_record())) == pid
    assert len([p for p in os.listdir("/proc") if p.isdigit()
                and _argv(int(p))[:1] == [QSD] and e.pidfile in _argv(int(p))]) == 1


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def test_a_different_daemon_under_the_same_name_is_not_taken_over(area):
    e = area.export()
    pid = start(e)
    other = os.path.join(area.base, "other.raw")
    open(other, "wb").close()
    with pytest.raises(ActionFailed, match=f"pid {pid}.* already runs with different options"):
        start(area.export(source=other))
    assert daemon.alive(e) and daemon.pid(e) == pid


def test_killed_daemon_is_detected_and_restarted_on_the_same_socket(area):
    e = area.export()
    pid = start(e)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    assert not daemon.alive(e) and daemon.pid(e) is None
    assert os.path.exists(e.pidfile)            # SIGKILL leaves its files behind
    assert restart_if_dead(e) is True
    new = daemon.pid(e)
    assert new is not None and new != pid and daemon.alive(e)
    st = os.lstat(e.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(QEMU_GROUP).gr_gid
    pattern = roundtrip(e.socket_path)
    assert on_disk(area.disk, 8, 4096) == pattern
    assert restart_if_dead(e) is False and daemon.pid(e) == new


def test_missing_source_is_one_line_and_leaves_nothing(area):
    e = area.export(source=os.path.join(area.base, "nope.raw"))
    with pytest.raises(BadInput) as err:
        start(e)
    msg = str(err.value)
    assert "\n" not in msg and e.source in msg and "No such file" in msg
    assert "qemu-img create" in msg
    assert area.leftovers() == [] and daemon.pid(e) is None


def test_wrong_kind_of_source_is_bad_input(area):
    with pytest.raises(BadInput, match="is not /dev/<kernel name>"):
        start(area.export(kind="block"))
    with pytest.raises(BadInput, match="is a character device, not a block device"):
        start(area.export(kind="block", source="/dev/null"))
    assert area.leftovers() == []


class BadOption(QsdExport):
    """An export whose command line qsd itself refuses at startup."""

    def argv(self, source_fd, socket_fd, qmp_fd, native_aio=True):
        argv = super().argv(source_fd, socket_fd, qmp_fd, native_aio)
        argv[argv.index("--export") + 1] += ",logical-block-size=3"
        return argv


def test_startup_failure_reports_qsds_message_and_leaves_nothing(area):
    e = area.export(cls=BadOption)
    with pytest.raises(ActionFailed) as err:
        start(e)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("qemu-storage-daemon vm1-vdb failed to start: ")
    assert "logical-block-size doesn't take value 3" in msg
    assert area.leftovers() == [] and daemon.pid(e) is None


def test_aio_contexts_used_up_names_the_sysctl(area):
    # What qsd 7.2 printed when another bench's daemons had filled
    # fs.aio-max-nr (io_setup: EAGAIN), replayed by a stand-in binary: the
    # kernel's limit is host-wide and cannot be lowered for one test.
    fake = os.path.join(area.base, "qemu-storage-daemon")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\necho 'qemu-storage-daemon: --blockdev driver=file,node-name=file0,"
                "filename=/proc/self/fd/9,cache.direct=on,aio=native,discard=unmap: Unable to use "
                "native AIO: failed to create linux AIO context: Resource temporarily unavailable'"
                " >&2\nexit 1\n")
    os.chmod(fake, 0o755)
    e = area.export(binary=fake)
    with pytest.raises(ActionFailed) as err:
        start(e)
    assert "failed to create linux AIO context" in str(err.value)
    assert "sysctl -w fs.aio-max-nr=" in err.value.hint
    assert area.leftovers() == []


def test_a_second_writer_of_one_source_is_refused(area):
    # qsd's exports share every permission on their node, so QEMU's image
    # locking would let both start: vstor checks the running daemons itself.
    first = area.export("vm1-vdb")
    pid = start(first)
    link = os.path.join(area.base, "alias.raw")
    os.symlink(area.disk, link)
    for name, kw in (("vm2-vdb", {}), ("vm3-vdb", {"source": link}),
                     ("vm4-vdb", {"readonly": True})):
        with pytest.raises(DoesNotFit, match=f"already exported by qemu-storage-daemon pid {pid}"):
            start(area.export(name, **kw))
    assert sorted(area.leftovers()) == sorted([first.pidfile, first.qmp_path, first.socket_path])
    assert daemon.pid(first) == pid and daemon.alive(first)


def test_readonly_export_is_writable_off(area):
    with open(area.disk, "r+b") as f:
        f.write(b"\xab" * 4096)
    e = area.export(readonly=True)
    start(e)
    assert node(e, "disk0")["ro"] is True and node(e, "file0")["ro"] is True
    with VhostUserBlk(e.socket_path) as dev:
        assert dev.features & VhostUserBlk.F_BLK_RO
        assert dev.write(0, b"\x00" * 4096) != 0        # refused by the back end
        assert dev.read(0, 4096) == (0, b"\xab" * 4096)
    assert on_disk(area.disk, 0, 4096) == b"\xab" * 4096
    # Readers share: a second readonly export of the same file starts.
    start(area.export("vm2-vdb", readonly=True))


def test_source_path_with_a_comma(area):
    disk = os.path.join(area.base, "a,b.raw")
    with open(disk, "wb") as f:
        f.truncate(1 << 20)
    e = area.export(source=disk)
    pid = start(e)
    served = node(e, "file0")["file"]         # the inherited descriptor, no path at all
    assert served.startswith("/proc/self/fd/")
    assert os.path.samefile(f"/proc/{pid}/fd/{served.rsplit('/', 1)[1]}", disk)


def test_a_regular_file_at_the_socket_path_is_never_replaced(area):
    os.makedirs(area.vhost)
    path = os.path.join(area.vhost, "vm1-vdb")
    with open(path, "w") as f:
        f.write("precious")
    with pytest.raises(ActionFailed, match="is not a socket"):
        start(area.export())
    with open(path) as f:
        assert f.read() == "precious"


def test_filesystem_without_o_direct_gets_cache_direct_off(area):
    mnt = os.path.join(area.base, "ramfs")
    os.mkdir(mnt)
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], capture_output=True)
    _need(mounted.returncode == 0, f"cannot mount ramfs: {mounted.stderr.decode().strip()}")
    try:
        disk = os.path.join(mnt, "r.raw")
        with open(disk, "wb") as f:
            f.truncate(1 << 20)
        e = area.export(source=disk)
        start(e)
        assert node(e, "file0")["cache"]["direct"] is False
        pattern = roundtrip(e.socket_path)
        assert on_disk(disk, 8, 4096) == pattern
        daemon.stop(e)
    finally:
        subprocess.run(["umount", mnt], check=True)


def test_block_device_source(area):
    loop = subprocess.run(["losetup", "--find", "--show", area.disk], capture_output=True, text=True)
    _need(loop.returncode == 0, f"no loop device: {loop.stderr.strip()}")
    dev = loop.stdout.strip()
    try:
        e = area.export(source=dev, kind="block")
        start(e, kernel_name=sources.sysfs_kernel_name(SysFS("/")))
        info = node(e, "file0")
        assert info["drv"] == "host_device" and info["cache"]["direct"] is True
        pattern = roundtrip(e.socket_path, sector=40)
        daemon.stop(e)
        assert on_disk(area.disk, 40, 4096) == pattern
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


def test_concurrent_starts_of_one_export_make_one_daemon(area):
    exports = [area.export() for _ in range(4)]
    pids, errors = [], []

    def go(x):
        try:
            pids.append(start(x))
        except Exception as err:       # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=go, args=(x,)) for x in exports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(pids)) == 1 and daemon.alive(exports[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_the_second_writer_check_refuses_when_it_cannot_look():
    """Another daemon's source vstor may not stat is not 'another file'."""
    import shutil
    import tempfile
    from tests.helpers import as_nobody
    from vstor.backends.qsd import files
    work = tempfile.mkdtemp(prefix="vs-sw-", dir="/tmp")
    os.chmod(work, 0o755)
    hidden = os.path.join(work, "hidden")
    os.mkdir(hidden, 0o700)
    open(os.path.join(hidden, "d.raw"), "w").close()
    mine = os.stat(work)
    kind, message = as_nobody(lambda: files.same_file(mine, os.path.join(hidden, "d.raw")))
    assert (kind, message) == ("Unavailable", f"cannot tell whether {hidden}/d.raw is the same file: "
                               "Permission denied (run vstor as root)")
    assert files.same_file(mine, os.path.join(work, "gone")) is False
    shutil.rmtree(work)


def test_which_finds_what_shutil_finds_and_never_in_the_working_directory(tmp_path, monkeypatch):
    import shutil
    from vstor.backends.qsd.proc import which
    for name in ("taskset", "sh", "qemu-storage-daemon", "no-such-tool", "bin"):
        assert which(name) == shutil.which(name)
    (tmp_path / "tool").write_text("#!/bin/sh\n")
    (tmp_path / "tool").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f":{os.defpath}")        # '' is the working directory to a shell
    assert which("tool") is None
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin")
    assert which("tool") == str(tmp_path / "tool") == shutil.which("tool")


def test_under_systemd_a_daemon_gets_a_scope_of_its_own(tmp_path, monkeypatch):
    """It must outlive the service that started it (pvedaemon on Proxmox):
    systemd-run --scope in vstor.slice, the daemon's own argv after '--'."""
    from vstor.backends.qsd.daemon import scope
    assert scope("vm1-vdb", booted=str(tmp_path / "absent")) == []
    monkeypatch.setattr("vstor.backends.qsd.proc.which", lambda name: f"/usr/bin/{name}")
    argv = scope("vm1-vdb", booted=str(tmp_path))
    assert argv[:2] == ["/usr/bin/systemd-run", "--scope"] and argv[-1] == "--"
    assert "--slice=vstor.slice" in argv and "--collect" in argv
    assert "--property=IOAccounting=yes" in argv        # its operations counted (vstor metrics)


# -- issue 28: the other writer is named ------------------------------------------------------

def test_a_second_writer_refusal_names_the_vstor_disk_that_holds_the_source(area):
    """vstor's daemon serves a socket named <domain>-<target>: the refusal
    names that domain and the release that frees it if it has stopped."""
    first = area.export("web1-vdb")
    pid = start(first)
    with pytest.raises(DoesNotFit) as e:
        start(area.export("db2-vdb"))
    assert e.value.message == (f"disk source {area.disk} is already exported by qemu-storage-daemon pid {pid} "
                               f"for vstor disk web1-vdb ({first.socket_path})")
    assert e.value.hint == ("two writers would corrupt it: if domain web1 does not run, vstor release web1 "
                            "stops it; otherwise make both readonly or stop the other")


# -- the AIO fallback keeps the socket it hands the daemon ---------------------------------------


def test_the_aio_fallback_keeps_the_vhost_socket_it_hands_the_daemon(tmp_path, monkeypatch):
    from vstor.backends.qsd import aio, daemon
    from vstor.backends.qsd.export import QsdExport
    sock_path = str(tmp_path / "vm1-vdb")
    export = QsdExport(run_dir=str(tmp_path), name="vm1-vdb", source="/dev/null", kind="block",
                       socket_path=sock_path)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(sock_path)
    listening.listen()
    seen = []

    def spawn(exp, source_fd, socket_fd, timeout, jail, native_aio=True):
        seen.append((native_aio, os.path.exists(sock_path)))
        if native_aio:
            raise ActionFailed(f"qemu-storage-daemon vm1-vdb failed to start: {aio.FULL}: "
                               "Resource temporarily unavailable")
    monkeypatch.setattr(aio, "room", lambda *a: True)
    monkeypatch.setattr(daemon, "_spawn", spawn)
    monkeypatch.setattr("vstor.log.note", lambda *a, **k: None)
    try:
        daemon._spawn_any_aio(export, 0, listening.fileno(), 5.0, daemon._Jail(None, ()))
    finally:
        listening.close()
    assert seen == [(True, True), (False, True)], "the fallback daemon got a socket with no path"
