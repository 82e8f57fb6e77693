"""One open per source (docs/security.md): the file vstor checks is
the very file qemu-storage-daemon serves, whoever renames, replaces or
symlinks inside an image root while a domain starts.

The oracle is the kernel's: which inodes each running qemu-storage-daemon
holds (its /proc/PID/fd), never what vstor says it did.  A swapper process
turns the domain's image, as fast as it can, into a symlink to a host file
outside every image root, into a FIFO, and back into the image, while the
start runs again and again through `vstor prepare` (in-process) and the
libvirt hook (a process): no daemon may ever hold the outside file or a
FIFO, a start that said yes must serve the image, and every call ends
within a bound (a FIFO never blocks).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from tests import ended_process, qsd_fds
from tests.helpers import contract_work  # noqa: F401 (the fixture work)
from tests.helpers import contract_hook as hook, contract_rendered as rendered, contract_vstor as vstor
from vstor.errors import BadInput, Unavailable
from vstor.host import sources
from vstor.host.sysfs import SysFS

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons handed to root:kvm (needs root)")

BOUND = 20.0            # seconds, for any one start or release
TRIALS_CLI = 200
TRIALS_HOOK = 40

SWAPPER = r"""
import os, sys, time
img, real, secret = sys.argv[1:4]
d = os.path.dirname(img)
tmp = os.path.join(d, ".swap")
while True:
    for make, hold in ((lambda: os.symlink(secret, tmp), 0.0005),
                       (lambda: os.mkfifo(tmp), 0.0005),
                       (lambda: os.link(real, tmp), 0.002)):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        make()
        os.replace(tmp, img)
        time.sleep(hold)
"""


@contextlib.contextmanager
def bounded(seconds: float):
    """Raise in this thread if the block takes longer (an open that blocks
    is interrupted by the signal, and the handler's exception ends it)."""
    def expired(*_a):
        raise TimeoutError(f"took longer than {seconds:g}s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def race(work):  # noqa: F811 (the fixture imported above)
    """The domain ct1 with one file disk, rendered while its image is an
    image; the secret, outside every image root; the swapper, started."""
    outside = tempfile.mkdtemp(prefix="vs-outside-", dir="/tmp")
    secret = os.path.join(outside, "secret.raw")
    with open(secret, "wb") as f:
        f.truncate(1 << 20)
    images = os.path.join(work.dir, "images")
    os.mkdir(images)
    real = os.path.join(work.dir, "real.raw")
    with open(real, "wb") as f:
        f.truncate(1 << 20)
    img = os.path.join(images, "a.raw")
    os.link(real, img)
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:file path='{img}'/></vstor:disk>")
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, img, real, secret])
    w = type("Race", (), {"work": work, "xml": xml, "real": real, "secret": secret})
    try:
        yield w
    finally:
        swapper.kill()
        swapper.wait()
        vstor(work, "release", "--force", "ct1")
        for p in qsd_fds.serving(secret):
            os.kill(p, signal.SIGKILL)
        os.unlink(secret)
        os.rmdir(outside)


def _held_wrongly(w) -> list[str]:
    """What any qemu-storage-daemon holds that it never may: the outside
    file, or a FIFO."""
    bad = []
    secret = os.stat(w.secret)
    for p in qsd_fds.daemons():
        for st in qsd_fds.held(p, named_only=True):
            if qsd_fds.same(st, secret):
                bad.append(f"pid {p} holds {w.secret}")
            elif stat.S_ISFIFO(st.st_mode):
                bad.append(f"pid {p} holds a FIFO")
    return bad


def _serves_the_image(w) -> bool:
    return len(qsd_fds.serving(w.real)) == 1


def test_a_swapped_image_is_never_served_through_prepare(race):
    said_yes = 0
    for i in range(TRIALS_CLI):
        with bounded(BOUND):
            code = vstor(race.work, "prepare", race.xml)
        assert code in (0, 2), f"trial {i}: exit {code}"
        assert _held_wrongly(race) == [], f"trial {i}"
        if code == 0:
            said_yes += 1
            assert _serves_the_image(race), f"trial {i}: a start said yes but serves no image"
        with bounded(BOUND):
            assert vstor(race.work, "release", "ct1") == 0
    assert said_yes > 0, "no start went through: the race was never run to the daemon"


def test_a_swapped_image_is_never_served_through_the_hook(race):
    said_yes = 0
    for i in range(TRIALS_HOOK):
        out = hook(race.work, "prepare", race.xml, timeout=BOUND)
        assert out.returncode in (0, 2), f"trial {i}: {out.stderr.decode()}"
        assert b"Traceback" not in out.stderr
        assert _held_wrongly(race) == [], f"trial {i}"
        if out.returncode == 0:
            said_yes += 1
            assert _serves_the_image(race), f"trial {i}"
        assert hook(race.work, "release", race.xml, timeout=BOUND).returncode == 0
    assert said_yes > 0


def test_a_fifo_as_the_image_is_refused_at_once(work):  # noqa: F811
    img = os.path.join(work.dir, "f.raw")
    open(img, "wb").close()
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:file path='{img}'/></vstor:disk>")
    os.unlink(img)
    os.mkfifo(img)
    began = time.monotonic()
    with bounded(BOUND):
        assert vstor(work, "prepare", "--dry-run", xml) == 2
        assert vstor(work, "prepare", xml) == 2
    out = hook(work, "prepare", xml, timeout=BOUND)
    assert out.returncode == 2 and b"is a FIFO, not a regular file" in out.stderr
    assert time.monotonic() - began < BOUND
    assert qsd_fds.daemons() == [] or qsd_fds.serving(img) == []


def test_the_daemon_is_given_descriptors_and_the_socket_is_made_by_vstor(work):  # noqa: F811
    img = os.path.join(work.dir, "d.raw")
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:file path='{img}'/></vstor:disk>")
    assert vstor(work, "prepare", xml) == 0
    [pid] = qsd_fds.serving(img)
    argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
    assert not any(img in a for a in argv)                     # no path to resolve again
    sock = os.path.join(work.dir, "vhost", "ct1-vdb")
    assert not any(sock in a for a in argv)
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o660
    export = next(a for a in argv if a.startswith("type=vhost-user-blk"))
    assert "addr.type=fd" in export
    assert vstor(work, "release", "ct1") == 0
    assert not os.path.lexists(sock)


# -- the opener itself ---------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (root / "a.raw").write_bytes(b"")
    (tmp_path / "out" / "secret").write_bytes(b"")
    return tmp_path, root


@pytest.mark.parametrize("link,ok", [
    ("a.raw", True),
    ("sub/../a.raw", True),
    ("../images/a.raw", True),
    ("../out/secret", False),
    ("sub/../../out/secret", False),
    ("/etc/shadow", False),
    ("/", False),
])
def test_a_symlink_is_followed_only_inside_the_root(tree, link, ok):
    base, root = tree
    os.symlink(link, root / "l.raw")
    if ok:
        with sources.open_file(str(root / "l.raw"), [str(root)]) as src:
            assert src.resolved == str(root / "a.raw")
            assert os.path.samefile(src.proc_path, root / "a.raw")
    else:
        with pytest.raises(BadInput, match="outside the image roots|not a regular file|names a directory"):
            sources.open_file(str(root / "l.raw"), [str(root)])


@pytest.mark.parametrize("make,words", [
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: os.mkdir(p), "is a directory"),
    (lambda p: os.symlink(os.path.basename(p), p), "too many levels of symbolic links"),
    (lambda p: os.symlink("/dev/null", p), "outside the image roots"),
])
def test_what_is_not_a_regular_file_is_refused_without_being_opened(tree, make, words):
    _base, root = tree
    make(str(root / "x.raw"))
    with bounded(5), pytest.raises(BadInput, match=words):
        sources.open_file(str(root / "x.raw"), [str(root)])


def test_a_root_named_through_a_symlink_is_the_same_root(tree):
    base, root = tree
    os.symlink("images", base / "alias")
    with sources.open_file(str(base / "alias" / "a.raw"), [str(base / "alias")]) as src:
        assert os.path.samefile(src.proc_path, root / "a.raw")


def test_nothing_is_left_open(tree):
    _base, root = tree
    before = len(os.listdir("/proc/self/fd"))
    for name in ("a.raw", "sub", "nope", "a.raw/x"):
        with contextlib.suppress(BadInput):
            sources.open_file(str(root / name), [str(root)]).close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_block_node_is_taken_only_under_its_kernel_name(tmp_path):
    name = sources.sysfs_kernel_name(SysFS("/"))
    with pytest.raises(BadInput, match="a character device, not a block device"):
        sources.open_block("/dev/null", name)
    with pytest.raises(BadInput, match="not /dev/<kernel name>"):
        sources.open_block("/dev/disk/by-id/x", name)
    backing = tmp_path / "b.raw"
    backing.write_bytes(bytes(1 << 20))
    loop = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if loop.returncode != 0:
        pytest.fail(f"losetup: {loop.stderr.strip()}")
    dev = loop.stdout.strip()
    alias = f"/dev/vstor-test-{os.getpid()}"
    try:
        with sources.open_block(dev, name) as src:
            assert stat.S_ISBLK(src.st.st_mode)
        os.mknod(alias, 0o600 | stat.S_IFBLK, os.stat(dev).st_rdev)
        with pytest.raises(BadInput, match="which this host's sysfs names loop"):
            sources.open_block(alias, name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(alias)
        subprocess.run(["losetup", "-d", dev], check=False)


def test_doctor_names_a_socket_directory_others_can_write(tmp_path):
    from vstor.config import Config
    from vstor.host import doctor
    d = tmp_path / "vhost"
    d.mkdir()
    os.chmod(d, 0o770)
    cfg = Config(vhost_dir=str(d))
    sock, links = doctor.check_sources(cfg)
    assert sock.status == doctor.FAIL and "not root's alone" in sock.detail and "chmod go-w" in sock.fix
    os.chmod(d, 0o750)
    assert doctor.check_sources(cfg)[0].status == doctor.OK
    assert links.status in (doctor.OK, doctor.WARN)


def test_a_start_in_a_socket_directory_others_can_write_is_refused(work):  # noqa: F811
    img = os.path.join(work.dir, "g.raw")
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:file path='{img}'/></vstor:disk>")
    os.makedirs(os.path.join(work.dir, "vhost"), exist_ok=True)
    os.chmod(os.path.join(work.dir, "vhost"), 0o777)
    out = hook(work, "prepare", xml, timeout=BOUND)
    assert out.returncode == 5 and b"is not root's alone" in out.stderr, out.stderr
    assert qsd_fds.serving(img) == []
    assert os.listdir(os.path.join(work.dir, "vhost")) == []


def test_attach_of_a_fifo_is_refused_at_once_and_changes_nothing(env, tmp_path):  # noqa: F811
    from tests.helpers import GuestDouble, disk, file_disk, file_disks, running
    from vstor.runtime.hotplug import attach
    from vstor.runtime.lifecycle import release
    _, paths = file_disks(env, "b", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    fifo = os.path.join(env.work, "fifo.raw")
    os.mkfifo(fifo)
    guest = GuestDouble(dom)
    before = env.state.load("vm1").steps
    with bounded(BOUND), pytest.raises(BadInput, match="is a FIFO, not a regular file"):
        attach(env.rt(), env.state, env.host(), dom, disk(file_disk(fifo, "vdc"), tmp_path), guest)
    assert guest.calls == [] and env.state.load("vm1").steps == before
    assert sorted(os.listdir(env.cfg.vhost_dir)) == ["vm1-vdb"]
    release(env.rt(), env.state, "vm1")


# -- issue 28: every OS error of the walk is a refusal ------------------------------------------
#
# /proc answers a walk that names it with errors a plain directory never
# gives: a process's cwd link answers ENOENT once the process ended (it may
# end between the walk's open and its readlink), pid 1's may answer EACCES.

@pytest.mark.parametrize("target", ["/proc/{ended}/cwd/a.raw", "/proc/self/cwd/a.raw", "/proc/self/fd/0",
                                    "/proc/self/root/etc/shadow", "a/" * 2000 + "x"],
                         ids=["ended-process-cwd", "self-cwd", "self-fd-0", "self-root", "4000-byte-target"])
def test_a_link_through_proc_or_past_the_kernel_s_limits_is_one_refusal(tree, target):
    _base, root = tree
    child = ended_process()
    os.symlink(target.format(ended=child.pid), root / "p.raw")
    before = sorted(os.listdir("/proc/self/fd"))
    try:
        with bounded(5), pytest.raises((BadInput, Unavailable)):
            sources.open_file(str(root / "p.raw"), [str(root)])
    finally:
        child.wait()
    assert sorted(os.listdir("/proc/self/fd")) == before
