"""Confined qemu-storage-daemons (vstor.backends.qsd.jail and .grant),
judged by the kernel and by others' tools: /proc/PID/status and the
namespaces' links, the daemon's own monitor asked what a guest that took
the daemon over could ask, and the source's ACL as getfacl (acl) reads it.

Each escape is tried on an unconfined daemon too, where it must work: a
test that cannot tell the two apart proves nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from vstor.backends.qsd import daemon, grant
from vstor.backends.qsd.export import JAIL, QsdExport
from vstor.backends.qsd.monitor import Monitor, QmpError
from vstor.errors import ActionFailed

from tests.helpers import until

QSD = "/usr/bin/qemu-storage-daemon"
USERS = (1879100000, 1879100009)
CI = os.environ.get("CI") == "true"


def _need(ok: bool, why: str) -> None:
    if not ok:
        if CI:
            pytest.fail(f"CI=true and {why}")
        pytest.skip(why)


class Site:
    """base/images (the one image root: mine.raw 0600, other.raw 0644),
    base/secret (root's, outside the roots), base/run, base/vhost."""

    def __init__(self, base: str):
        self.base = base
        self.images = os.path.join(base, "images")
        self.run_dir = os.path.join(base, "run")
        self.vhost = os.path.join(base, "vhost")
        self.secret = os.path.join(base, "secret")
        self.made: list[QsdExport] = []
        self.loop: str | None = None
        os.makedirs(self.images)
        for name, mode in (("mine.raw", 0o600), ("other.raw", 0o644), ("third.raw", 0o600)):
            self.image(name, mode)
        with open(self.secret, "wb") as f:
            f.write(b"root's alone\n" * 64)
        os.chmod(self.secret, 0o600)

    def disk(self) -> str:
        """A host block device (a loop device on a scratch file: this
        machine's own disks are closed even to root)."""
        if self.loop is None:
            backing = os.path.join(self.base, "hostdisk")
            with open(backing, "wb") as f:
                f.truncate(4 << 20)
            self.loop = subprocess.run(["losetup", "--find", "--show", backing], check=True,
                                       capture_output=True, text=True).stdout.strip()
        return self.loop

    def image(self, name: str, mode: int) -> str:
        path = os.path.join(self.images, name)
        with open(path, "wb") as f:
            f.truncate(4 << 20)
        os.chmod(path, mode)
        return path

    def export(self, name: str, image: str = "mine.raw", users=USERS, **kw) -> QsdExport:
        e = QsdExport(run_dir=self.run_dir, name=name, source=os.path.join(self.images, image),
                      kind="file", socket_path=os.path.join(self.vhost, name), users=users, **kw)
        self.made.append(e)
        return e

    def start(self, e: QsdExport) -> int:
        return daemon.start(e, roots=[self.images])


@pytest.fixture
def site():
    _need(os.geteuid() == 0, "needs root")
    _need(os.access(QSD, os.X_OK), f"{QSD} is not installed")
    base = tempfile.mkdtemp(prefix="vc-", dir="/var/tmp")     # ext4 here: ACLs and O_DIRECT
    os.chmod(base, 0o711)
    s = Site(base)
    yield s
    for e in s.made:
        with contextlib.suppress(Exception):
            daemon.stop(e)
    if s.loop:
        subprocess.run(["losetup", "--detach", s.loop], check=False)
    shutil.rmtree(base)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def _fds(pid: int) -> dict[str, str]:
    """The daemon's descriptors and what each is (one that closes as we
    look is left out: QEMU opens and closes a few as it runs)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


def _acl(path: str) -> list[str]:
    """getfacl's entries (numeric ids, no comments): the ACL as the acl package reads it."""
    _need(shutil.which("getfacl") is not None, "getfacl (package acl) is not installed")
    out = subprocess.run(["getfacl", "--numeric", "--omit-header", "--absolute-names", path],
                         capture_output=True, text=True, check=True).stdout
    return [line.split("\t")[0] for line in out.splitlines() if line]


def test_a_confined_daemon_holds_no_privilege(site):
    e = site.export("vm1-vdb")
    pid = site.start(e)
    uid, _ = grant.leased(site.run_dir, e.name)
    st = _status(pid)
    assert USERS[0] <= uid <= USERS[1]
    assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
    assert st["Groups"] == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[caps], 16) == 0, caps
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
    for ns in ("net", "mnt", "ipc", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    # It serves: its monitor answers with the export, and it holds the image read-write.
    assert daemon.alive(e)
    image = os.path.join(site.images, "mine.raw")
    modes = []
    for fd, what in _fds(pid).items():
        if what == image:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(ln for ln in f if ln.startswith("flags:")).split()[1], 8)
            modes.append("path" if flags & os.O_PATH else flags & os.O_ACCMODE)
    # vstor's descriptor (O_PATH) and the daemon's reopening of it, read-write
    assert sorted(modes, key=str) == [os.O_RDWR, "path"]
    # Nothing else with a name: /dev/null, its source and its pidfile; its
    # sockets are the two vstor bound (the vhost-user one and the monitor).
    held = _fds(pid)
    assert {h for h in held.values() if h.startswith("/")} == {"/dev/null", image, e.pidfile}
    from vstor.backends.qsd import proc
    sockets = {proc.socket_path_of(pid, fd) for fd, what in held.items() if what.startswith("socket:")}
    assert sockets == {e.socket_path, e.qmp_path}
    # Its view of the filesystem is read-only.
    with open(f"/proc/{pid}/mountinfo") as f:
        assert all(" ro," in line or " ro " in line for line in f if line.split()[4] != e.pidfile)


def _tries(site, qmp: Monitor, other_pid: int) -> dict[str, str | None]:
    """What a taken-over daemon would try through its monitor; the error
    of each, None where it worked."""
    other_fd = next(fd for fd, what in _fds(other_pid).items() if what.endswith("other.raw"))
    tries = {
        "root-only host file": {"driver": "file", "filename": site.secret},
        "another domain's image by name": {"driver": "file",
                                           "filename": os.path.join(site.images, "other.raw")},
        "another domain's image by its daemon's fd": {
            "driver": "file", "filename": f"/proc/{other_pid}/fd/{other_fd}"},
        "a host disk": {"driver": "host_device", "filename": site.disk()},
    }
    out: dict[str, str | None] = {}
    for i, (what, args) in enumerate(tries.items()):
        try:
            # Read-only and without QEMU's image locks: the unconfined
            # control must not fail on a lock the other daemon holds.
            qmp.execute("blockdev-add", {"node-name": f"escape{i}", "read-only": True,
                                         "locking": "off", **args})
            out[what] = None
        except QmpError as err:
            out[what] = str(err)
    # nbd-server-start takes QEMU's legacy SocketAddress: {type, data}.
    for what, addr in (("an inet socket",
                        {"type": "inet", "data": {"host": "127.0.0.1", "port": "0"}}),
                       ("a unix socket on the filesystem",
                        {"type": "unix", "data": {"path": os.path.join(site.base, "nbd.sock")}})):
        try:
            qmp.execute("nbd-server-start", {"addr": addr})
            out[what] = None
            qmp.execute("nbd-server-stop")
        except QmpError as err:
            out[what] = str(err)
    return out


def test_escapes_through_the_daemons_own_monitor_fail(site):
    mine = site.export("vm1-vdb")
    other = site.export("vm2-vdb", image="other.raw")
    site.start(mine)
    other_pid = site.start(other)
    with Monitor(mine.qmp_path) as qmp:
        confined = _tries(site, qmp, other_pid)
    assert all(why is not None for why in confined.values()), confined
    assert "Permission denied" in confined["root-only host file"]
    assert "No such file or directory" in confined["another domain's image by name"]
    assert "Permission denied" in confined["another domain's image by its daemon's fd"]
    assert "Permission denied" in confined["a host disk"]
    assert not os.path.exists(os.path.join(site.base, "nbd.sock"))
    # The control: the same tries through an unconfined daemon's monitor work.
    free = site.export("vm3-vdb", image="third.raw", users=None)
    site.start(free)
    with Monitor(free.qmp_path) as qmp:
        unconfined = _tries(site, qmp, other_pid)
    assert all(why is None for why in unconfined.values()), unconfined


def test_the_acl_entry_is_the_daemons_and_goes_with_it(site):
    image = os.path.join(site.images, "mine.raw")
    before = os.stat(image)
    assert _acl(image) == ["user::rw-", "group::---", "other::---"]
    e = site.export("vm1-vdb")
    site.start(e)
    uid, lease = grant.leased(site.run_dir, e.name)
    assert _acl(image) == ["user::rw-", f"user:{uid}:rw-", "group::---", "mask::rw-", "other::---"]
    assert (lease["dev"], lease["ino"]) == (before.st_dev, before.st_ino)
    daemon.stop(e)
    after = os.stat(image)
    assert _acl(image) == ["user::rw-", "group::---", "other::---"]
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
    with pytest.raises(OSError):
        os.getxattr(image, grant.XATTR)     # the mode alone again, no ACL left behind
    assert not os.path.exists(grant.users_dir(site.run_dir))


def test_a_readonly_disk_gets_read_and_others_entries_stay(site):
    image = os.path.join(site.images, "mine.raw")
    subprocess.run(["setfacl", "-m", "g:4242:r--", image], check=True)
    before = _acl(image)
    a = site.export("vm1-vdb", readonly=True)
    b = site.export("vm2-vdb", readonly=True)     # another domain's read-only disk, same file
    site.start(a)
    site.start(b)
    ua, ub = grant.leased(site.run_dir, a.name)[0], grant.leased(site.run_dir, b.name)[0]
    assert ua != ub
    assert f"user:{ua}:r--" in _acl(image) and f"user:{ub}:r--" in _acl(image)
    daemon.stop(a)
    assert f"user:{ua}:r--" not in _acl(image) and f"user:{ub}:r--" in _acl(image)
    assert daemon.alive(b)
    daemon.stop(b)
    assert _acl(image) == before


def test_an_acl_whose_mask_limits_its_entries_is_refused_and_left_as_it_was(site):
    image = os.path.join(site.images, "mine.raw")
    subprocess.run(["setfacl", "-m", "g:4242:rw-,m::r--", image], check=True)
    before = _acl(image)
    e = site.export("vm1-vdb")
    with pytest.raises(ActionFailed, match="mask limits what its entries grant") as err:
        site.start(e)
    assert "setfacl -m u:" in err.value.hint
    assert _acl(image) == before
    assert daemon.pid(e) is None and not os.path.exists(grant.users_dir(site.run_dir))


def test_each_daemon_its_own_uid_kept_across_a_restart_and_given_back(site):
    a, b = site.export("vm1-vdb"), site.export("vm2-vdb", image="other.raw")
    pa = site.start(a)
    site.start(b)
    ua, ub = grant.leased(site.run_dir, a.name)[0], grant.leased(site.run_dir, b.name)[0]
    assert ua != ub
    os.kill(pa, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while daemon.pid(a) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert daemon.restart_if_dead(a, roots=[site.images])
    assert grant.leased(site.run_dir, a.name)[0] == ua
    assert _status(daemon.pid(a))["Uid"].split()[0] == str(ua)
    daemon.stop(a)
    daemon.stop(b)
    assert not os.path.exists(grant.users_dir(site.run_dir))


def test_an_orphan_daemon_gives_its_uid_and_entry_back(site):
    image = os.path.join(site.images, "mine.raw")
    e = site.export("vm1-vdb")
    site.start(e)
    assert daemon.stop_orphan(e.pidfile)
    assert _acl(image) == ["user::rw-", "group::---", "other::---"]
    assert not os.path.exists(grant.users_dir(site.run_dir))


def test_starts_side_by_side_take_different_uids(site):
    import concurrent.futures
    names = [f"vm{i}-vdb" for i in range(4)]
    for n in names:
        site.image(f"{n}.raw", 0o600)
    exports = [site.export(n, image=f"{n}.raw") for n in names]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(site.start, exports))
    uids = [grant.leased(site.run_dir, n)[0] for n in names]
    assert len(set(uids)) == 4 and all(USERS[0] <= u <= USERS[1] for u in uids)


def test_the_jail_refuses_what_it_cannot_do_in_one_line():
    for argv in (["--uid", "0", "--", "/bin/true"], ["--uid", "x", "--", "/bin/true"],
                 ["--uid", "1879100000"],
                 ["--uid", "1879100000", "--hide", "/usr", "--", "/usr/bin/true"]):
        done = subprocess.run([sys.executable, "-I", "-S", JAIL, *argv], capture_output=True,
                              text=True)
        assert done.returncode == 125
        assert done.stderr.startswith("vstor confinement: ") and done.stderr.count("\n") == 1


def test_a_filesystem_without_acls_is_refused_with_the_fix(site, tmp_path):
    _need(os.geteuid() == 0, "needs root")
    mnt = os.path.join(site.base, "noacl")
    os.mkdir(mnt)
    # ramfs keeps no POSIX ACL (nor any xattr): the refusal operators on such storage see.
    subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], check=True)
    try:
        with open(os.path.join(mnt, "disk.raw"), "wb") as f:
            f.truncate(1 << 20)
        e = QsdExport(run_dir=site.run_dir, name="vm9-vdb", source=os.path.join(mnt, "disk.raw"),
                      kind="file", socket_path=os.path.join(site.vhost, "vm9-vdb"), users=USERS)
        site.made.append(e)
        with pytest.raises(ActionFailed, match="keeps no POSIX ACL") as err:
            daemon.start(e, roots=[mnt])
        assert "confine = no" in err.value.hint
        assert daemon.pid(e) is None
    finally:
        subprocess.run(["umount", mnt], check=True)


def test_gc_gives_back_the_uid_of_a_daemon_no_record_owns(site):
    from vstor.config import Config
    from vstor.runtime import gc
    from vstor.runtime.state import StateDir
    image = os.path.join(site.images, "mine.raw")
    e = site.export("vm1-vdb")
    pid = site.start(e)
    os.kill(pid, signal.SIGKILL)            # a daemon gone, its pidfile with it: the lease stays
    while daemon.pid(e) is not None:
        time.sleep(0.02)
    os.unlink(e.pidfile)
    uid = grant.leased(site.run_dir, e.name)[0]
    assert f"user:{uid}:rw-" in _acl(image)
    cfg = Config(qsd_dir=site.run_dir, vhost_dir=site.vhost, state_dir=os.path.join(site.base, "st"))
    state = StateDir(cfg.state_dir)
    orphans, foreign = gc.orphan_files(cfg, state)
    lease = os.path.join(grant.users_dir(site.run_dir), str(uid))
    assert lease in orphans and not any(p.startswith(grant.users_dir(site.run_dir)) for p, _ in foreign)
    assert gc._owner_key(lease) == "vm1"
    for path in orphans:
        gc.remove_orphan(path)
    assert _acl(image) == ["user::rw-", "group::---", "other::---"]
    assert not os.path.exists(grant.users_dir(site.run_dir))


def test_the_entry_is_taken_back_from_the_file_even_renamed_and_never_from_its_stand_in(site):
    image = os.path.join(site.images, "mine.raw")
    e = site.export("vm1-vdb")
    site.start(e)
    moved = os.path.join(site.images, "moved.raw")
    os.rename(image, moved)                 # the image renamed under the running daemon,
    site.image("mine.raw", 0o600)           # and another file put where it was
    stand_in = _acl(image)
    daemon.stop(e)
    assert _acl(moved) == ["user::rw-", "group::---", "other::---"]
    assert _acl(image) == stand_in


def _processes_of(uid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{p}/status") as f:
                    st = {k: v.split() for k, _, v in (ln.partition(":") for ln in f)}
                if st["Uid"][0] == str(uid) and st["State"][0] != "Z":
                    out.append(int(p))
    return out


def test_what_a_taken_over_daemon_leaves_cannot_outlive_its_uid_or_break_the_stop(site):
    """A child forked by the daemon (no pid namespace), a pidfile written
    with garbage: the stop kills every process of the uid before the uid
    can go to another daemon, and reads no pid where there is none."""
    e = site.export("vm1-vdb")
    pid = site.start(e)
    uid = grant.leased(site.run_dir, e.name)[0]
    lurker = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                               "--", "sleep", "300"], start_new_session=True)
    assert until(lambda: lurker.pid in _processes_of(uid), 5)
    with open(e.pidfile, "wb") as f:        # the daemon's one writable file
        f.write(b"\xff\xfe" + b"9" * 40)
    assert daemon.pid(e) == pid             # found by its command line instead
    daemon.stop(e)
    lurker.wait(5)
    assert _processes_of(uid) == [] and not os.path.exists(grant.users_dir(site.run_dir))


def test_taking_the_entry_back_never_widens_a_mask_the_owner_narrowed(site):
    image = os.path.join(site.images, "mine.raw")
    subprocess.run(["setfacl", "-m", "g:4242:rw-", image], check=True)
    e = site.export("vm1-vdb")
    site.start(e)
    subprocess.run(["chmod", "g-w", image], check=True)     # the owner narrows the mask meanwhile
    daemon.stop(e)
    assert "mask::r--" in _acl(image) and "group:4242:rw-" in _acl(image)


def test_a_confined_process_opens_no_socket_at_all():
    """Not even a Unix socket to a host service (libvirt's, D-Bus)."""
    base = tempfile.mkdtemp(prefix="vc-sock-", dir="/var/tmp")
    try:
        os.makedirs(f"{base}/run")
        pidfile = f"{base}/run/p.pid"
        open(pidfile, "w").close()
        done = subprocess.run(
            [sys.executable, "-I", "-S", JAIL, "--uid", str(USERS[1]), "--pidfile", pidfile, "--",
             "/usr/bin/python3", "-I", "-c",
             "import socket\ntry:\n socket.socket(socket.AF_UNIX)\nexcept OSError as e:\n print(e.errno)"],
            capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "97"      # EAFNOSUPPORT
    finally:
        shutil.rmtree(base)


def test_a_uid_another_process_runs_as_is_never_leased(tmp_path):
    """Two vstors on one host (another qsd_dir: another lease directory, as
    two test runs side by side) must not share a uid: a stop kills every
    process of its daemon's uid.  A uid any process runs as is skipped."""
    other = subprocess.Popen(["setpriv", f"--reuid={USERS[0]}", f"--regid={USERS[0]}", "--clear-groups",
                              "sleep", "30"])
    try:
        assert until(lambda: USERS[0] in grant.uids_running(USERS), 10)
        assert grant.lease(str(tmp_path), "vm1-vdb", USERS) == USERS[0] + 1
        assert grant.lease(str(tmp_path), "vm1-vdb", USERS) == USERS[0] + 1   # held: the same
    finally:
        other.kill()
        other.wait()
    assert grant.lease(str(tmp_path), "vm2-vdb", USERS) == USERS[0]
