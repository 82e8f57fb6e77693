"""Named host layouts (tests/hosts/<name>.toml) built into real temporary
sysfs/procfs trees, once per session; the line between the pure tests and
the ones that start processes; and the suite's last check: it left the
checkout as it found it."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from vstor.config import Config
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
from vstor.runtime.lifecycle import Runtime, release
from vstor.runtime.state import StateDir
from tests.doubles.kernel_sysfs import KernelSysfsDouble
from tests.doubles.spdk_target import SpdkTargetDouble
from tests.helpers import LOCAL
from tests.hostlayout import build_tree

HOSTS_DIR = os.path.join(os.path.dirname(__file__), "hosts")


@pytest.fixture(scope="session")
def host_layout(tmp_path_factory):
    """name -> root of the tree built from tests/hosts/<name>.toml."""
    built: dict[str, str] = {}

    def root_of(name: str) -> str:
        if name not in built:
            root = tmp_path_factory.mktemp(f"host-{name}")
            built[name] = build_tree(os.path.join(HOSTS_DIR, f"{name}.toml"), root)
        return built[name]
    return root_of


@pytest.fixture(scope="session")
def host_model(host_layout):
    """name -> the Host read_host builds from that layout's tree."""
    return lambda name: read_host(SysFS(host_layout(name)))


@pytest.fixture(scope="module")
def conn():
    """libvirt's test driver (test:///default): its own parser and checks, no daemon."""
    libvirt = pytest.importorskip("libvirt")
    c = libvirt.open("test:///default")
    libvirt.registerErrorHandler(lambda *_: None, None)     # the refusal is in the exception
    yield c
    c.close()


@pytest.fixture
def cfg(tmp_path):
    """A vstor.conf of the test's own (test_cli, test_json)."""
    path = tmp_path / "vstor.conf"
    path.write_text(f"[cpu]\nreactors = 2,18\n[paths]\nstate_dir = {tmp_path}/state\n"
                    f"vhost_dir = /run/vstor/vhost\n")
    return str(path)


@pytest.fixture(params=["v24.01", "v26.09"])
def env(request):
    """A two-socket host tree, the SPDK double (as the oldest SPDK vstor
    supports and the newest recorded one), a state dir: one short-pathed workdir."""
    work = tempfile.mkdtemp(prefix="vs-", dir="/tmp")
    os.chmod(work, 0o755)
    root = build_tree(os.path.join(HOSTS_DIR, "two-socket.toml"), os.path.join(work, "host"))
    spdk = SpdkTargetDouble(os.path.join(work, "spdk.sock"), os.path.join(work, "vhost"),
                            cores=tuple(range(64)), version=request.param)
    spdk.add_pcie(LOCAL, 1).add_pcie("0000:60:00.0", 1)
    spdk.add_fabric("RDMA", "192.168.100.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
    spdk.add_fabric("RDMA", "192.168.101.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
    spdk.start()
    cfg = Config(reactors=(2, 18), images=(work,), state_dir=f"{work}/state", vhost_dir=spdk.vhost_dir,
                 qsd_dir=f"{work}/qsd", spdk_socket=spdk.socket_path, spdk_timeout=5.0)
    e = type("Env", (), {})()
    e.work, e.root, e.spdk, e.cfg = work, root, spdk, cfg
    e.sysfs = KernelSysfsDouble(root)
    e.state = StateDir(cfg.state_dir)
    e.rt = lambda: Runtime(cfg, e.sysfs)
    e.host = lambda: read_host(SysFS(root))
    yield e
    for rec in e.state.records():       # never leak a daemon into other tests
        try:
            release(e.rt(), e.state, rec.key)
        except Exception:
            pass
    spdk.stop()
    shutil.rmtree(work, ignore_errors=True)


# -- pure tests and tests that start processes ------------------------------------------

# The files whose every test starts processes (qemu-storage-daemon, libvirtd, the hook,
# perl, a child Python), opens sockets or needs root; in the other files such a test is
# marked @pytest.mark.process.  The rest are pure: `pytest -m "not process"` runs them
# alone, the fast loop (docs/testing.md).  tests/e2e is all processes.
PROCESS_FILES = {
    "test_agent_hostile", "test_bench", "test_checkout", "test_cli", "test_confine", "test_contract",
    "test_crash",
    "test_generated", "test_hook_script", "test_hooks_uninstall", "test_hostile", "test_hotplug",
    "test_json", "test_libvirt_accepts", "test_lifecycle", "test_logging", "test_migrate_json",
    "test_migration", "test_migration_agent", "test_migration_spdk", "test_nova", "test_nova_driver",
    "test_nova_hook", "test_nova_placement", "test_planning_lock", "test_pve", "test_pve_hostile", "test_pve_pinning",
    "test_pve_words", "test_qsd", "test_runtime_cli", "test_source_race", "test_supervise",
    "test_spdk_client", "test_spdk_double", "test_spdk_entry", "test_spdk_replay", "test_storm",
}
# What makes a test not pure, as Python's audit hooks name it.
STARTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system",
          "socket.__new__"}
_started: list[str] = []
_watching = [False]


def _audit(event: str, args: tuple) -> None:
    # The test's own thread: a double's server thread, left by another test, is not the test's.
    if _watching[0] and event in STARTS and threading.current_thread() is threading.main_thread():
        what = f"{event} {args[0]!r}" if args and event != "socket.__new__" else event
        _started.append(what[:120])


sys.addaudithook(_audit)


def pytest_collection_modifyitems(items):
    for item in items:
        path = item.path
        if "e2e" in path.parts or path.stem in PROCESS_FILES:
            item.add_marker(pytest.mark.process)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _watched(item))


def _watched(item):
    """A test without the mark that starts a process or opens a socket (in its
    own fixtures too) fails, so that the pure set stays pure."""
    pure = item.get_closest_marker("process") is None
    _started.clear()
    _watching[0] = pure
    try:
        result = yield
    finally:
        _watching[0] = False
    if pure and _started:
        pytest.fail(f"a pure test started a process or opened a socket ({'; '.join(sorted(set(_started))[:3])}): "
                    f"mark it @pytest.mark.process, or list its file in PROCESS_FILES (tests/conftest.py)",
                    pytrace=False)
    return result


# -- the checkout is left as it was ------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_state(root: str = ROOT) -> dict[str, tuple] | None:
    """What git says differs in the checkout (changed tracked files and
    untracked files it does not ignore), each as git's status line with
    what lstat says of the file, so that a file already changed before the
    run and written again during it is a change too.  None when `root` is
    not the top of a git checkout (an unpacked sdist, a wheel's tests, a
    tree inside someone else's repository) or git cannot say."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None
    top = git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top.strip()) != os.path.realpath(root):
        return None
    out = git("status", "--porcelain", "-z", "--untracked-files=all")
    if out is None:
        return None
    state = {}
    entries = iter(out.split("\0"))
    for entry in entries:
        if not entry:
            continue
        xy, path = entry[:2], entry[3:]
        if "R" in xy or "C" in xy:
            next(entries, None)         # -z gives a rename's old path as an entry of its own
        try:
            st = os.lstat(os.path.join(root, path))
            state[f"{xy} {path}"] = (st.st_mode, st.st_size, st.st_mtime_ns)
        except OSError:
            state[f"{xy} {path}"] = ()
    return state


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = checkout_state()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the checkout (a stray file at the root, a
    tracked file changed, or one already changed written again) fails the
    run, naming what it left."""
    before = session.config.stash.get(_BEFORE, None)
    after = checkout_state() if before is not None else None
    if after is None or after == before:
        return
    left = sorted(line for line in after.keys() | before.keys() if after.get(line) != before.get(line))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"the tests changed the checkout ({len(left)} paths): " + "; ".join(left[:8]),
                            red=True, bold=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[object]()
