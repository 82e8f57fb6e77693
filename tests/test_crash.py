"""Crash safety: kill -9 at every journaled step of prepare and release, then
run again: it converges, with nothing leaked, and the `*.json.tmp` a killed
save left is cleaned up.

The test process owns the doubles (the SPDK target double, the sysfs tree of
the two-socket layout); vstor runs in child processes (tests/crash_child.py)
against the same tree, state directory and SPDK socket, with real
qemu-storage-daemons.  A child kills itself with SIGKILL at its k-th crash
point: before and after every `steps.do`/`steps.undo`, before every
`StateDir.save` and between a save's temporary file and its rename.  A
counting run (no crash) first lists every crash point of prepare and of
release; then every k is tried, each followed by the next runs a host would
see (the next start, or the stop).

The plan exercises every kind of step: a local NVMe controller on SPDK (vfio
bind, bdev_nvme attach, vhost controller), an NVMe-oF namespace on SPDK (a
multipath attach, a vhost controller) and a file served by a real
qemu-storage-daemon.

Each child is forked from a server (`crash_child --serve`) that imported
vstor once, so ~400 runs stay fast; one test runs a crash in a plain
`sys.executable` subprocess to show the two are the same kill."""

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.doubles.kernel_sysfs import KernelSysfsDouble
from tests.doubles.spdk_target import SpdkTargetDouble
from tests.hostlayout import build_tree
from vstor import records
from vstor.config import Config
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
from vstor.meta.document import Domain
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.render.libvirt import render
from vstor.runtime.lifecycle import Runtime, release
from vstor.runtime.state import PREPARED, StateDir

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="sockets are handed to root:kvm (needs root)")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NS = "https://vstor.dev/xmlns/domain/1"
LOCAL = "0000:5f:00.0"
KILLED = -signal.SIGKILL
KINDS = ["vfio-bind", "spdk-attach", "spdk-vhost", "spdk-attach", "spdk-vhost", "qsd-export"]


# -- the world: doubles in this process, vstor in forked children ---------------------------------

class Server:
    """tests/crash_child.py --serve: one forked process per run."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.crash_child", "--serve"],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert json.loads(self._answer(30)) == {"ready": True}

    def run(self, job: dict) -> int:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._answer(job.get("timeout", 60) + 10))["rc"]

    def _answer(self, timeout: float) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.proc.kill()
            raise AssertionError("the crash child server stopped answering")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the crash child server exited ({self.proc.wait()})")
        return line

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class Run:
    op: str
    crash_at: int
    rc: int
    log: str
    result: dict | None

    @property
    def points(self) -> list[str]:
        return self.result["points"] if self.result else []

    def why(self) -> str:
        if self.result and self.result["error"]:
            return self.result["error"]
        return self.log.strip().splitlines()[-1] if self.log.strip() else f"exit {self.rc}"


class World:
    def __init__(self):
        self.work = tempfile.mkdtemp(prefix="vc-", dir="/tmp")     # short: sockets live here
        os.chmod(self.work, 0o755)
        self.root = os.path.join(self.work, "host")
        self.image = os.path.join(self.work, "disk.raw")
        with open(self.image, "wb") as f:
            f.truncate(16 << 20)
        self._build_tree()
        self.spdk = SpdkTargetDouble(os.path.join(self.work, "spdk.sock"),
                                     os.path.join(self.work, "vhost"), cores=tuple(range(64)))
        self.spdk.add_pcie(LOCAL, 1)
        self.spdk.add_fabric("RDMA", "192.168.100.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
        self.spdk.add_fabric("RDMA", "192.168.101.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
        self.spdk.start()
        self.cfg = Config(reactors=(2, 18), images=(self.work,), state_dir=f"{self.work}/state",
                          vhost_dir=self.spdk.vhost_dir, qsd_dir=f"{self.work}/qsd",
                          spdk_socket=self.spdk.socket_path, spdk_timeout=5.0)
        self.state = StateDir(self.cfg.state_dir)
        self.dom = self._domain()
        self.domain_xml = os.path.join(self.work, "vm1.xml")
        with open(self.domain_xml, "w") as f:
            f.write(self.dom.to_string())
        self.jobs = os.path.join(self.work, "jobs")
        os.makedirs(self.jobs)
        self.runs = 0
        self.server = Server()

    def _build_tree(self):
        build_tree(os.path.join(HERE, "hosts", "two-socket.toml"), self.root)
        self.sysfs = KernelSysfsDouble(self.root)
        self.override = self.sysfs.override_of(LOCAL)

    def _domain(self) -> Domain:
        disks = (f"<vstor:disk target='vdb' backend='spdk'><vstor:nvme controller='{LOCAL}'/></vstor:disk>"
                 "<vstor:disk target='vdc' backend='spdk'><vstor:nvmf transport='rdma' "
                 "traddr='192.168.100.8' subnqn='nqn.2016-06.io.spdk:cnode1' namespace='1' "
                 "hostnqn='nqn.2014-08.org.nvmexpress:uuid:1'><vstor:path traddr='192.168.101.8'/>"
                 "</vstor:nvmf></vstor:disk>"
                 f"<vstor:disk target='vdd'><vstor:file path='{self.image}'/></vstor:disk>")
        dom = Domain.parse(f"""<domain type='kvm'><name>vm1</name><memory unit='MiB'>1024</memory>
          <vcpu>2</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'>{disks}</vstor:vstor></metadata>
          <os><type arch='x86_64' machine='q35'>hvm</type></os><devices/></domain>""")
        plan = plan_domain(read_host(SysFS(self.root)), self.cfg, Request.from_domain(dom), Ledger())
        return render(dom, plan)

    # -- running vstor -------------------------------------------------------------------------

    def job(self, op: str, crash_at: int = 0) -> dict:
        self.runs += 1
        base = os.path.join(self.jobs, f"{self.runs}-{op}-{crash_at}")
        cfg = {k: v for k, v in records.asdict(self.cfg).items() if k != "source"}
        return {"op": op, "crash_at": crash_at, "cfg": cfg, "root": self.root,
                "domain": self.domain_xml, "out": base + ".json", "log": base + ".log",
                "timeout": 60}

    def run(self, op: str, crash_at: int = 0) -> Run:
        job = self.job(op, crash_at)
        rc = self.server.run(job)
        return self._collect(job, rc)

    @staticmethod
    def _collect(job: dict, rc: int) -> Run:
        with open(job["log"]) as f:
            log = f.read()
        result = None
        if os.path.exists(job["out"]):
            with open(job["out"]) as f:
                result = json.load(f)
        return Run(job["op"], job["crash_at"], rc, log, result)

    # -- what the host holds -------------------------------------------------------------------

    def daemons(self) -> list[int]:
        """Live qemu-storage-daemons started for this world (a zombie's
        cmdline reads empty: it is gone)."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if (argv and os.path.basename(argv[0]) == b"qemu-storage-daemon"
                    and any(self.work.encode() in a for a in argv)):
                out.append(int(entry))
        return out

    def leftovers(self) -> list[str]:
        """Everything vstor still holds on the host: [] when nothing leaked."""
        left = []
        if self.sysfs.driver_of(LOCAL) != "nvme":
            left.append(f"{LOCAL} is on {self.sysfs.driver_of(LOCAL)}, not nvme")
        if self.sysfs.override_of(LOCAL) != self.override:
            left.append(f"{LOCAL} driver_override is {self.sysfs.override_of(LOCAL)!r}")
        if self.spdk.vhost:
            left.append(f"SPDK vhost controllers {sorted(self.spdk.vhost)}")
        if self.spdk.nvme:
            left.append(f"SPDK NVMe controllers {sorted(self.spdk.nvme)}")
        for d in (self.cfg.vhost_dir, self.cfg.qsd_dir):
            files = sorted(f for f in _listdir(d) if not f.startswith("."))
            if files:
                left.append(f"files in {d}: {files}")
        if self.daemons():
            left.append(f"qemu-storage-daemon still running: pids {self.daemons()}")
        files = sorted(f for f in _listdir(self.state.domains) if f.endswith((".json", ".json.tmp")))
        if files:
            left.append(f"state records: {files}")
        return left

    def prepared(self) -> list[str]:
        """What is missing for the domain to be prepared exactly once: []."""
        wrong = []
        rec = self.state.load("vm1")
        if rec is None or rec.status != PREPARED:
            wrong.append(f"record is {rec and rec.status}, not prepared")
        elif [(s["kind"], s["state"]) for s in rec.steps] != [(k, "done") for k in KINDS]:
            wrong.append(f"record steps {[(s['kind'], s['state']) for s in rec.steps]}")
        if self.sysfs.driver_of(LOCAL) != "vfio-pci":
            wrong.append(f"{LOCAL} is on {self.sysfs.driver_of(LOCAL)}")
        if sorted(self.spdk.vhost) != ["vm1-vdb", "vm1-vdc"]:
            wrong.append(f"SPDK vhost controllers {sorted(self.spdk.vhost)}")
        if len(self.spdk.nvme) != 2:
            wrong.append(f"SPDK NVMe controllers {sorted(self.spdk.nvme)}")
        if len(self.daemons()) != 1:
            wrong.append(f"{len(self.daemons())} qemu-storage-daemons, not 1")
        if not os.path.exists(os.path.join(self.cfg.vhost_dir, "vm1-vdd")):
            wrong.append("no socket vm1-vdd")
        return wrong

    # -- getting back to a clean host whatever a failed case left --------------------------------

    def reset(self):
        with self.state.lock():
            pass        # drops temporaries
        for rec in self.state.records():
            try:
                release(Runtime(self.cfg, self.sysfs), self.state, rec.key, progress=lambda m: None)
            except Exception:
                pass
        for pid in self.daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self.daemons() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.spdk.stop()
        self.spdk.nvme.clear()
        self.spdk.vhost.clear()
        for d in (self.cfg.vhost_dir, self.cfg.qsd_dir, self.cfg.state_dir, self.root):
            shutil.rmtree(d, ignore_errors=True)
        self._build_tree()
        self.spdk.start()

    def close(self):
        self.server.close()
        self.reset()
        self.spdk.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


@pytest.fixture
def env(world):
    """The world, clean before and after: a failed case never spoils the next."""
    if world.leftovers():
        world.reset()
    assert world.leftovers() == []
    yield world
    if world.leftovers():
        world.reset()


@pytest.fixture(scope="module")
def points(world):
    """The crash points of prepare and of release, from runs that count only."""
    assert world.leftovers() == []
    prep = world.run("prepare")
    assert prep.rc == 0, prep.log
    assert world.prepared() == []
    rel = world.run("release")
    assert rel.rc == 0, rel.log
    assert world.leftovers() == []
    return {"prepare": prep.points, "release": rel.points}


# -- the scenarios ---------------------------------------------------------------------------------

def crash(w: World, op: str, k: int, labels: list[str]) -> str | None:
    """Kill `op` at crash point k; None, or what went wrong."""
    run = w.run(op, k)
    if run.rc != KILLED:
        return f"the {op} run was to die by SIGKILL at point {k} but exited {run.rc}: {run.why()}"
    if f"crash point {k}: {labels[k - 1]}:" not in run.log:
        return f"the {op} run died at another point than {k} ({labels[k - 1]}): {run.log[-300:]}"
    if "temporary written" in labels[k - 1] and "vm1.json.tmp" not in _listdir(w.state.domains):
        return f"the {op} run killed at point {k} ({labels[k - 1]}) left no vm1.json.tmp"
    return None


def then(w: World, *ops: str) -> str | None:
    """The next runs, none crashing; None, or the first that failed."""
    for op in ops:
        run = w.run(op)
        if run.rc != 0:
            return f"the next {op} failed (exit {run.rc}): {run.why()}"
        if op == "prepare" and w.prepared():
            return f"the next prepare did not prepare: {w.prepared()}"
    return None


def converge(w: World, phase: str, labels: list[str], k: int, *ops: str) -> str | None:
    """Crash `phase` at k (after a prepare when the phase is release), run
    `ops`, and report whatever failed or leaked."""
    if phase == "release":
        failed = then(w, "prepare")
        if failed:
            return f"setup: {failed}"
    failed = crash(w, phase, k, labels) or then(w, *ops)
    if failed is None and w.leftovers():
        failed = f"leaked: {'; '.join(w.leftovers())}"
    if failed:
        w.reset()
    return failed


def check_every_point(w: World, phase: str, labels: list[str], ops: tuple[str, ...]):
    failures = []
    for k in range(1, len(labels) + 1):
        failed = converge(w, phase, labels, k, *ops)
        if failed:
            failures.append(f"{phase} killed at point {k} ({labels[k - 1]}), then "
                            f"{' + '.join(ops)}: {failed}")
    assert failures == [], "\n".join(failures)


def test_the_crash_points_cover_every_journaled_step(points):
    prep, rel = points["prepare"], points["release"]
    # prepare: the first save, two per step (doing, done), but the last step's
    # done is the save that also says prepared
    assert sum(p.endswith(": before") and p.startswith("save") for p in prep) == 1 + 2 * len(KINDS)
    assert sum(p.startswith("do ") for p in prep) == 2 * len(KINDS)
    assert sum(p.startswith("save") for p in prep) == 2 * (1 + 2 * len(KINDS))
    # release: the 'releasing' save, one after every undo but the last (the record goes)
    assert sum(p.startswith("undo ") for p in rel) == 2 * len(KINDS)
    assert sum(p.startswith("save") for p in rel) == 2 * len(KINDS)
    assert not any(p.startswith("undo ") for p in prep) and not any(p.startswith("do ") for p in rel)
    described = " ".join(prep)
    for what in ("bind 0000:5f:00.0 to vfio-pci", "attach SPDK NVMe controller vs_0000_5f_00_0",
                 "create SPDK vhost controller vm1-vdb", "create SPDK vhost controller vm1-vdc",
                 "start qemu-storage-daemon", "temporary written, before rename"):
        assert what in described


def test_a_crash_in_a_plain_subprocess_is_a_sigkill(env, points):
    """The forked runs are the same as `python tests/crash_child.py JOB`:
    here one crash point, in a plain sys.executable subprocess."""
    labels = points["prepare"]
    k = next(i for i, p in enumerate(labels, 1) if p.startswith("do start qemu-storage-daemon")
             and p.endswith(": after"))
    job = env.job("prepare", k)
    path = job["out"][:-5] + ".job"
    with open(path, "w") as f:
        json.dump(job, f)
    with open(job["log"], "w") as log:
        done = subprocess.run([sys.executable, "-m", "tests.crash_child", path], cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, timeout=60,
                              env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == KILLED
    assert len(env.daemons()) == 1           # the daemon the killed run started outlives it
    assert then(env, "prepare", "release") is None
    assert env.leftovers() == []


def test_prepare_killed_at_every_point_then_started_again_converges(env, points):
    check_every_point(env, "prepare", points["prepare"], ("prepare", "release"))


def test_prepare_killed_at_every_point_then_released_leaves_nothing(env, points):
    check_every_point(env, "prepare", points["prepare"], ("release",))


def test_release_killed_at_every_point_then_released_again_leaves_nothing(env, points):
    check_every_point(env, "release", points["release"], ("release",))


def test_release_killed_at_every_point_then_started_again_converges(env, points):
    check_every_point(env, "release", points["release"], ("prepare", "release"))


# -- the temporary file a killed save leaves ------------------------------------------------------

def test_a_temporary_left_by_a_killed_save_goes_with_the_next_run_and_nothing_else(env, points):
    labels = points["prepare"]
    k = next(i for i, p in enumerate(labels, 1)
             if "temporary written" in p and "spdk-attach:doing" in p)
    assert crash(env, "prepare", k, labels) is None
    domains = env.state.domains
    tmp = os.path.join(domains, "vm1.json.tmp")
    with open(tmp) as f:
        assert json.load(f)["steps"][-1]["kind"] == "spdk-attach"    # whole, never renamed
    with open(os.path.join(domains, "vm1.json")) as f:
        assert [s["kind"] for s in json.load(f)["steps"]] == ["vfio-bind"]
    outside = os.path.join(env.work, "x")
    with open(outside, "w") as f:
        f.write("not vstor's")
    decoys = {"notes.txt": "file", ".hidden.json.tmp": "file", "a b.json.tmp": "file",
              "-x.json.tmp": "file", "vm1.json.tmp.bak": "file", "..json.tmp": "file",
              "dir.json.tmp": "dir"}
    for name, kind in decoys.items():
        path = os.path.join(domains, name)
        if kind == "dir":
            os.mkdir(path)
        else:
            with open(path, "w") as f:
                f.write("keep me")
    os.symlink("../../x", os.path.join(domains, "link.json.tmp"))    # a record-like name: the link goes
    try:
        assert then(env, "release") is None
        left = set(os.listdir(domains))
        assert "vm1.json.tmp" not in left and "vm1.json" not in left
        assert "link.json.tmp" not in left
        with open(outside) as f:
            assert f.read() == "not vstor's"      # unlinked the link, never followed it
        assert set(decoys) <= left
    finally:
        for name in decoys:
            path = os.path.join(domains, name)
            if os.path.isdir(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)
    assert env.leftovers() == []


def test_a_temporary_left_by_a_killed_first_save_goes_with_the_next_start(env, points):
    """Killed before the first record was ever renamed into place: there is
    no record, only its temporary; the next start drops it and prepares."""
    labels = points["prepare"]
    assert "temporary written" in labels[1] and labels[1].startswith("save preparing []")
    assert crash(env, "prepare", 2, labels) is None
    assert os.listdir(env.state.domains) == ["vm1.json.tmp"]
    assert then(env, "prepare") is None
    assert "vm1.json.tmp" not in os.listdir(env.state.domains)
    assert then(env, "release") is None
    assert env.leftovers() == []
