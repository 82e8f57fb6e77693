"""A boot storm, smaller than bench/bench_storm.py's: vstor domains with
qemu-storage-daemon file disks prepared at once through the installed hook
(bench/storm.py: planned on a synthetic host, real daemons here), checked
by bench/storm_check.py against their plans and the kernel's view of the
daemons: every one starts, no two share a core, socket, volume or daemon,
nothing is left after release.  Also a storm on this machine's own cores
(each daemon pinned as planned), one where half the domains stop while the
others start, one where a prepare is killed -9 mid-way (its next start, or
`vstor gc`, cleans up; nothing of the others is touched), and one of domains
whose plans collide (planned apart: one of each group starts), and a gc
held mid-way while a storm starts (it leaves the new domains' daemons), and
a start past the host's AIO budget (its daemon uses the thread pool).

Needs root and qemu-storage-daemon (skipped without, failed in CI); about
10 s on the 2-core development machine.  The AIO test holds the host's AIO
budget (fs.aio-max-nr) for about a second: a daemon with aio=native that
another process starts meanwhile fails."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench import storm_check as check
from bench.storm import QSD_AIO_EVENTS, World, daemons_under, pidfile_of
from vstor.runtime.state import StateDir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
QSD = "/usr/bin/qemu-storage-daemon"


def _need(ok: bool, why: str) -> None:
    if not ok:
        if CI:
            pytest.fail(f"CI is set and {why}", pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="module")
def compiled():
    # Byte-code written first, as pip's install does: with PYTHONDONTWRITEBYTECODE
    # set, every hook would compile vstor anew.
    import compileall
    compileall.compile_dir(os.path.join(ROOT, "vstor"), quiet=1)


@pytest.fixture
def storm(compiled):
    """World(domains, disks), cleaned up after the test (each test checks
    itself that nothing was left: this is for one that failed half-way)."""
    _need(os.geteuid() == 0, "needs root (real qemu-storage-daemons)")
    _need(os.access(QSD, os.X_OK), f"{QSD} is not installed")
    made: list[World] = []

    def make(domains: int = 8, disks: int = 2, here: bool = False) -> World:
        made.append(World(domains, disks, here))
        return made[-1]
    yield make
    for w in made:
        w.cleanup()


def _ok(runs) -> None:
    failed = [r for r in runs if r.rc != 0]
    assert not failed, failed


def test_every_domain_of_a_storm_starts_and_none_shares_a_core_socket_or_volume(storm):
    w = storm(8, 2).plan()
    _, runs = w.storm([(n, "prepare") for n in w.names])
    _ok(runs)
    assert check.prepared(w, w.names) == []
    _, runs = w.storm([(n, "release") for n in w.names])
    _ok(runs)
    assert check.released(w) == []


def test_on_this_machine_every_daemon_of_a_storm_runs_on_its_plans_emulator_cores(storm):
    # Planned on this machine's own cores (too few for dedicated vCPUs):
    # the daemons are pinned, each to its domain's housekeeping cores.
    w = storm(4, 2, here=True).plan(cpus=lambda i: "shared")
    _ok(w.storm([(n, "prepare") for n in w.names])[1])
    assert check.prepared(w, w.names) == []
    _ok(w.storm([(n, "release") for n in w.names])[1])
    assert check.released(w) == []


def test_half_the_domains_stop_while_the_other_half_start(storm):
    w = storm(8, 2).plan()
    first, second = w.names[::2], w.names[1::2]
    _ok(w.storm([(n, "prepare") for n in first])[1])
    assert check.prepared(w, first) == []
    # Interleaved: each start beside a stop of the domain planned next to it.
    _ok(w.storm([pair for a, b in zip(first, second) for pair in ((a, "release"), (b, "prepare"))])[1])
    assert check.prepared(w, second) == []
    _ok(w.storm([(n, "release") for n in second])[1])
    assert check.released(w) == []


def _pids(w: World, names: list[str]) -> dict[str, int]:
    """pid file -> pid of the daemons of `names`."""
    return {pidfile_of(argv): pid for pid, argv in daemons_under(w.work)
            if any(os.path.basename(pidfile_of(argv)).startswith(n + "-") for n in names)}


def _kill_mid_way(w: World, victim: str) -> list:
    """Every domain's prepare at once; the victim's hook killed -9 (its whole
    process group) as soon as the first of its daemons wrote its pid file.
    The others' runs."""
    pidfiles = [os.path.join(w.cfg.qsd_dir, d.vhost_name + ".pid") for d in w.plans[victim].disks]
    for _ in range(5):
        runs = [w.launch(n, "prepare") for n in w.names if n != victim]
        hook = w.launch(victim, "prepare")
        deadline = time.monotonic() + 30
        while not any(map(os.path.exists, pidfiles)) and hook.proc.poll() is None:
            assert time.monotonic() < deadline, "the victim's prepare neither started a daemon nor ended"
            time.sleep(0.001)
        hook.kill()
        for r in runs:
            r.wait()
        if hook.wait() == -9:
            return runs
        # It had ended before the kill landed: stop it, and storm again.
        _ok(w.storm([(n, "release") for n in w.names])[1])
    raise AssertionError("5 storms in a row, the victim's prepare ended before it could be killed")


def _gc(w: World, running: list[str], out, gate=None) -> subprocess.Popen:
    """`vstor gc` on the world, started, libvirt (its test driver, from a
    file) saying that `running` run; its output to the file `out`; held at
    each read of zzz's record by `gate` (GATED) when given."""
    node = out.parent / "node.xml"
    node.write_text("<node>" + "".join(
        f"<domain type='test'><name>{n}</name><uuid>{w.uuid(n)}</uuid><memory>262144</memory>"
        "<os><type>hvm</type></os></domain>" for n in running) + "</node>")
    code, argv = ((GATED, [str(gate)]) if gate else
                  ("import sys; from vstor.cli.main import main; sys.exit(main(sys.argv[1:]))", []))
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-c", code, *argv, "-c", f"test://{node}",
                                 "--config", w.conf, "--host-root", w.root, "gc"],
                                env={**os.environ, "PYTHONPATH": ROOT}, stdout=f, stderr=subprocess.STDOUT)


# `vstor gc` whose every read of the record domains/zzz.json first opens the
# test's gate, a FIFO outside the state directory: it waits there until the
# test opens the gate to write, or puts a plain file in its place (a record
# that is a FIFO is damaged, so the gate cannot be the record itself).
GATED = """import sys
from vstor.runtime import recordfile
real = recordfile.read_text
def read_text(path):
    if path.endswith('/domains/zzz.json'):
        open(sys.argv[1]).close()
    return real(path)
recordfile.read_text = read_text
from vstor.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("then", ["its next start", "gc"])
def test_a_prepare_killed_mid_way_is_cleaned_up_and_the_others_untouched(storm, then, tmp_path):
    w = storm(6, 2).plan()
    victim, others = w.names[2], [n for n in w.names if n != w.names[2]]
    _ok(_kill_mid_way(w, victim))
    # Killed after a daemon started: its record says what it did (written first).
    assert StateDir(w.cfg.state_dir).load(victim) is not None
    theirs = _pids(w, others)
    assert len(theirs) == 2 * len(others)
    if then == "gc":
        out = tmp_path / "gc.out"
        assert _gc(w, others, out).wait(60) == 0, out.read_text()
        assert f"Releasing {victim} (not running)" in out.read_text(), out.read_text()
        assert check.prepared(w, others) == []
    else:
        _ok(w.storm([(victim, "prepare")])[1])
        assert check.prepared(w, w.names) == []
    assert _pids(w, others) == theirs        # the same daemons: none restarted, none stopped
    _ok(w.storm([(n, "release") for n in w.names])[1])
    assert check.released(w) == []


def test_of_domains_whose_plans_collide_one_of_each_group_starts(storm):
    # Planned apart (each against an empty ledger, as two hosts' plans
    # migrated here might be): 0-3 are given the same dedicated cores, 4-7
    # (shared vCPUs) the same image for their first disk.
    w = storm(8, 2).plan(together=False, cpus=lambda i: "dedicated" if i < 4 else "shared",
                         shared=frozenset(range(4, 8)))
    _, runs = w.storm([(n, "prepare") for n in w.names])
    winners = [r.name for r in runs if r.rc == 0]
    assert len([n for n in winners if n < "storm04"]) == 1, runs
    assert len([n for n in winners if n >= "storm04"]) == 1, runs
    refused = [r for r in runs if r.rc != 0]
    assert all(r.rc == 3 and "cannot start" in r.stderr for r in refused), refused
    assert check.prepared(w, winners) == []
    _ok(w.storm([(n, "release") for n in w.names])[1])
    assert check.released(w) == []


# -- the host's AIO budget ------------------------------------------------------------------

SYS_IO_SETUP = {"x86_64": (206, 207), "aarch64": (0, 1)}


@contextlib.contextmanager
def aio_taken(leave: int):
    """Hold AIO contexts (io_setup(2)) so that fewer than `leave` events of
    the host's budget (fs.aio-max-nr) are free; and keep taking what other
    processes give back meanwhile (their daemons stop too), until the end."""
    calls = SYS_IO_SETUP.get(os.uname().machine)
    _need(calls is not None, f"io_setup's syscall number on {os.uname().machine} is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    held, done = [], threading.Event()

    def take() -> int:
        with open("/proc/sys/fs/aio-max-nr") as f, open("/proc/sys/fs/aio-nr") as g:
            room = int(f.read()) - int(g.read()) - leave + 1
        ctx = ctypes.c_ulong(0)
        if room > 0 and libc.syscall(calls[0], ctypes.c_uint(room), ctypes.byref(ctx)) == 0:
            held.append(ctx)
        return room

    def keep_taking() -> None:
        while not done.is_set():
            take()
    try:
        _need(any(take() <= 0 for _ in range(20)),
              "could not take the host's AIO budget (io_setup(2) kept failing)")
        taker = threading.Thread(target=keep_taking)
        taker.start()
        try:
            yield
        finally:
            done.set()
            taker.join()
    finally:
        for ctx in held:
            libc.syscall(calls[1], ctx)


def test_a_start_past_the_hosts_aio_budget_still_starts(storm):
    w = storm(1, 1).plan()
    with aio_taken(leave=QSD_AIO_EVENTS // 2):
        run = w.launch(w.names[0], "prepare")
        run.wait()
    assert run.rc == 0, run.stderr
    assert check.prepared(w, w.names) == []
    _ok(w.storm([(w.names[0], "release")])[1])
    assert check.released(w) == []


# -- gc during a storm ------------------------------------------------------------------------

def _opening_a_fifo(pid: int) -> bool:
    """The process waits in open(2) for a FIFO's writer."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read() == "wait_for_partner"
    except OSError:
        return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _until(what, why: str, timeout: float = 30) -> None:
    """Wait for what(); RuntimeError (never the assertion an xfail expects)
    when it does not come."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise RuntimeError(why)
        time.sleep(0.002)


def _in_open(gc: subprocess.Popen, read: str) -> None:
    """gc waits in open(2) on the gate (GATED), for its `read` read."""
    _until(lambda: _opening_a_fifo(gc.pid) or gc.poll() is not None, f"gc never began {read}")
    if gc.returncode is not None:
        raise RuntimeError(f"gc ended (exit {gc.returncode}) before {read}: it reads no record file?")


def test_gc_during_a_storm_leaves_the_daemons_of_domains_that_start_meanwhile(storm, tmp_path):
    """gc is held at a chosen point by a gate (GATED) before each read of
    the record zzz (read by `vstor gc` once under the host lock, where the
    index is checked against what it read, then by orphan_files()):
    stopped there, the gate replaced by a plain
    file, the storm run, gc let go.  A slow state directory (many records)
    opens the same window."""
    from vstor.runtime.state import PREPARED, Record
    w = storm(4, 2).plan()
    state = StateDir(w.cfg.state_dir)
    state.save(Record(key="zzz", domain="zzz", uuid=None, status=PREPARED))
    gate = tmp_path / "gate"
    os.mkfifo(gate, 0o600)
    gc = _gc(w, [*w.names, "zzz"], tmp_path / "gc.out", gate)
    try:
        for read in ("its read of the records (and the index's check, under the host lock)",):
            _in_open(gc, read)
            open(gate, "w").close()
            _until(lambda: not _opening_a_fifo(gc.pid), f"gc is stuck in {read}")
        _in_open(gc, "orphan_files()' read of the records")
        # Stopped in open(2), which it restarts after SIGCONT: then on a
        # plain file in the gate's place.
        os.kill(gc.pid, signal.SIGSTOP)
        _until(lambda: _state(gc.pid) == "T", "gc did not stop")
        open(f"{gate}.new", "w").close()
        os.replace(f"{gate}.new", gate)
        _ok(w.storm([(n, "prepare") for n in w.names])[1])
        os.kill(gc.pid, signal.SIGCONT)
        assert gc.wait(60) == 0, (tmp_path / "gc.out").read_text()
    finally:
        if gc.poll() is None:
            gc.kill()
            gc.wait()
        state.remove("zzz")
    assert check.prepared(w, w.names) == [], (tmp_path / "gc.out").read_text()
    _ok(w.storm([(n, "release") for n in w.names])[1])
    assert check.released(w) == []
