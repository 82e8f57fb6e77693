"""The Proxmox hookscript's post-start pins each thread of a real QEMU as
the plan says (issue 31, item 3).  qemu-server starts QEMU under one
`taskset --all-tasks` set; the kernel's own view of each thread
(/proc/PID/task/TID/status, Cpus_allowed_list) judges what vstor did, and
QEMU's own thread names (-name ...,debug-threads=on: "CPU 1/TCG") say which
thread is which vCPU, apart from the monitor vstor asks.

On this 2-core machine: a 2-cell VM with one dedicated core per cell (no
housekeeping cores, so the emulator shares the VM's cores), and a 3-cell
plan made by hand from this machine's cores for the pinning alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import Pve, until
from vstor.meta.plan import CellPlan, Plan
from vstor.pve import pinning

pytestmark = pytest.mark.skipif(os.cpu_count() < 2 or shutil.which("qemu-system-x86_64") is None,
                                reason="needs 2 CPUs and qemu-system-x86_64")

VM = """boot: order=scsi0
cores: 2
memory: 256
name: pinned
ostype: l26
smbios1: uuid=6ad6b5f0-3b36-4a8e-9e1c-1f0d2d5e8c12
"""


@pytest.fixture
def pve(tmp_path):
    p = Pve(tmp_path)
    p.write_config(f"qemu = {shutil.which('qemu-system-x86_64')}\n")
    text = Path(p.conf).read_text().replace("reactors = 2,18\n", "reactors = \nhousekeeping = \n")
    Path(p.conf).write_text(text)
    yield p
    p.vstor("release", "--force", "pve-100")


class Qemu:
    """A QEMU started as qemu-server starts it: under `taskset --all-tasks`
    with the config's affinity, with its pidfile and QMP socket where
    qemu-server puts them ([pve] run_dir)."""

    def __init__(self, pve, affinity: str, smp: int, iothreads: int = 1):
        run = Path(pve.root) / "run"
        self.pidfile, self.qmp = run / "100.pid", run / "100.qmp"
        argv = ["taskset", "--cpu-list", "--all-tasks", affinity, "qemu-system-x86_64",
                "-machine", "pc,accel=tcg", "-smp", str(smp), "-m", "64", "-S", "-nodefaults",
                "-display", "none", "-name", "vm100,debug-threads=on",
                "-chardev", f"socket,id=qmp,path={self.qmp},server=on,wait=off",
                "-mon", "chardev=qmp,mode=control", "-pidfile", str(self.pidfile)]
        for i in range(iothreads):
            argv += ["-object", f"iothread,id=iothread-v{i}"]     # comm keeps 15 bytes
        self.proc = subprocess.Popen(argv)
        assert until(lambda: self.pidfile.exists() and self.qmp.exists() and
                     len(self.threads()) >= 2 + smp, 30), "QEMU did not start"

    @property
    def pid(self) -> int:
        return int(self.pidfile.read_text())

    def threads(self) -> dict[str, str]:
        """Thread name (with its tid when names repeat) -> Cpus_allowed_list."""
        out = {}
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
        except (FileNotFoundError, ValueError):
            return {}
        for tid in tasks:
            try:
                name = Path(f"/proc/{self.pid}/task/{tid}/comm").read_text().strip()
                status = Path(f"/proc/{self.pid}/task/{tid}/status").read_text()
            except FileNotFoundError:
                continue
            key = name if name.startswith(("CPU ", "IO iothread")) else f"{name} {tid}"
            out[key] = status.split("Cpus_allowed_list:")[1].split()[0]
        return out

    def tid(self, name: str) -> int:
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            if Path(f"/proc/{self.pid}/task/{tid}/comm").read_text().strip() == name:
                return int(tid)
        raise AssertionError(f"no thread {name}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def qemus():
    out: list[Qemu] = []
    yield out
    for q in out:
        q.stop()


def _two_cells(pve, capsys) -> None:
    pve.vm(VM)
    pve.intent(f"<vstor:disk target='vdb'><vstor:file path='{pve.root}/d0.raw'/></vstor:disk>",
               vm="<vstor:vm cpus='dedicated' numa='strict' cells='2'/>")
    Path(pve.root, "d0.raw").write_bytes(b"\0" * (16 << 20))
    assert pve.vstor("pve", "apply", "100") == 0
    capsys.readouterr()


def test_post_start_pins_each_vcpu_of_a_two_cell_vm_to_its_cells_core(pve, qemus, capsys):
    _two_cells(pve, capsys)
    conf = pve.config()
    assert "numa0: cpus=0,hostnodes=0" in conf and "numa1: cpus=1,hostnodes=0" in conf
    assert "affinity: 0-1" in conf
    # The plan says when the pins are made, and does not claim them before.
    assert pve.vstor("pve", "plan", "100") == 0
    text = capsys.readouterr().out
    assert "to be pinned 1:1 by vstor's hookscript at post-start" in text
    assert "pinned 1:1 to" not in text.replace("to be pinned 1:1", "")
    assert "cell 0: vCPU threads 1:1 (vCPU->core) 0->0" in text
    assert "cell 1: vCPU threads 1:1 (vCPU->core) 1->1" in text
    pre = pve.hook(100, "pre-start")
    assert pre.returncode == 0, pre.stderr
    q = Qemu(pve, "0-1", 2)
    qemus.append(q)
    assert set(q.threads().values()) == {"0-1"}         # qemu-server's one set, for every thread

    post = pve.hook(100, "post-start")
    assert post.returncode == 0, post.stderr
    got = q.threads()
    assert got["CPU 0/TCG"] == "0" and got["CPU 1/TCG"] == "1", got
    # Every other thread: the emulator's cores (no housekeeping: the VM's own).
    assert {v for k, v in got.items() if not k.startswith("CPU ")} == {"0-1"}, got
    assert pve.vstor("status", "pve-100") == 0
    out = capsys.readouterr().out
    assert "pinned by vstor at post-start: cell 0: vCPU threads 1:1 (vCPU->core) 0->0" in out, out
    assert "PROBLEM" not in out

    # Somebody moves vCPU 1 (taskset on its thread): status says so, exit 1.
    subprocess.run(["taskset", "-p", "-c", "0", str(q.tid("CPU 1/TCG"))], check=True,
                   capture_output=True)
    assert pve.vstor("status", "pve-100") == 1
    out = capsys.readouterr().out
    assert "PROBLEM: vCPU 1 (thread" in out and "runs on 0, the plan pins it to 1" in out, out
    assert f"fix: {pve.snippets}/vstor 100 post-start)" in out, out
    assert pve.vstor("status", "--json", "pve-100") == 1
    row = json.loads(capsys.readouterr().out)[0]
    assert row["problem"].startswith("vCPU 1") and row["pinning"][0].startswith("cell 0:")
    # post-start again (what a migration's target or a resume runs) restores it.
    again = pve.hook(100, "post-start")
    assert again.returncode == 0, again.stderr
    assert q.threads()["CPU 1/TCG"] == "1"
    assert pve.vstor("status", "pve-100") == 0
    capsys.readouterr()

    q.stop()
    qemus.clear()
    stop = pve.hook(100, "post-stop")
    assert stop.returncode == 0, stop.stderr


def _three_cell_plan() -> Plan:
    """Three guest cells as the plan records them, on this machine's two
    cores (the planner gives each dedicated vCPU a core of its own; this
    machine has two): shared vCPUs, each cell on its node's cores."""
    cells = (CellPlan(0, 0, (0, 1), 64 << 10, emulator=(0,)),
             CellPlan(1, 0, (2,), 32 << 10, emulator=(1,)),
             CellPlan(2, 0, (3,), 32 << 10, emulator=(0,)))
    return Plan(node=0, cpus="shared", vcpus=4, memory_kib=128 << 10, shared_cpus=(0, 1),
                emulator=(1,), cells=cells, domain="pve-100")


def test_a_three_cell_plan_pins_every_cell_and_the_io_threads(pve, qemus):
    plan = _three_cell_plan()
    q = Qemu(pve, "0-1", 4, iothreads=2)
    qemus.append(q)
    found = pinning.threads(q.pid, str(q.qmp))
    assert sorted(found.vcpus) == [0, 1, 2, 3]
    assert set(found.iothreads) == {"iothread-v0", "iothread-v1"}
    assert pinning.check(plan, found) != []             # before: every thread on 0-1
    assert pinning.apply(plan, found) >= 4
    got = q.threads()
    assert [got[f"CPU {i}/TCG"] for i in range(4)] == ["0", "0", "1", "0"], got
    assert got["IO iothread-v0"] == got["IO iothread-v1"] == "1"
    assert {v for k, v in got.items() if not k.startswith("CPU ")} == {"1"}, got
    assert pinning.check(plan, found) == []
    assert pinning.apply(plan, found) == 0              # twice is once
    # A thread the emulator set does not hold is named.
    subprocess.run(["taskset", "-p", "-c", "0", str(q.tid("IO iothread-v1"))], check=True,
                   capture_output=True)
    assert pinning.check(plan, found) == [
        f"1 emulator or I/O thread (thread {q.tid('IO iothread-v1')}: 0) not on the plan's "
        "emulator cores 1"]


def test_a_core_that_is_not_online_is_refused_before_any_thread_moves(pve, qemus):
    """A planned core that is not online (the host lost it since the plan):
    one line, exit 3, every thread where it was."""
    from vstor.errors import DoesNotFit
    from vstor.records import replace
    q = Qemu(pve, "0-1", 4, iothreads=1)
    qemus.append(q)
    found = pinning.threads(q.pid, str(q.qmp))
    with pytest.raises(DoesNotFit, match=r"to cores 7, which are not online \(cores 0-1 are\): "
                                         r"nothing pinned"):
        pinning.apply(replace(_three_cell_plan(), emulator=(0, 7)), found)
    assert set(q.threads().values()) == {"0-1"}


def test_the_plan_must_match_the_running_vcpus(pve, qemus):
    q = Qemu(pve, "0-1", 2)
    qemus.append(q)
    found = pinning.threads(q.pid, str(q.qmp))
    with pytest.raises(Exception, match="runs vCPUs 0-1, the plan has 4"):
        pinning.apply(_three_cell_plan(), found)
    assert set(q.threads().values()) == {"0-1"}         # nothing pinned


def test_post_start_refuses_a_pidfile_that_names_another_process(pve, qemus, capsys):
    """The pidfile is qemu-server's: a process it names that was not started
    with that -pidfile (a pid reused) is not the VM's QEMU; nothing is pinned."""
    _two_cells(pve, capsys)
    assert pve.hook(100, "pre-start").returncode == 0
    q = Qemu(pve, "0-1", 2)
    qemus.append(q)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        q.pidfile.write_text(str(other.pid))
        post = pve.hook(100, "post-start")
        assert post.returncode != 0
        assert post.stderr.startswith("vstor: VM 100's QEMU does not run (no live process behind ")
        assert len(post.stderr.splitlines()) == 1 and "Traceback" not in post.stderr
        assert set(Path(f"/proc/{other.pid}/status").read_text().split("Cpus_allowed_list:")[1]
                   .split()[:1]) == {"0-1"}
        assert set(q.threads().values()) == {"0-1"}
    finally:
        other.kill()
        other.wait()
    q.pidfile.write_text(str(q.proc.pid))     # taskset exec'd QEMU: the same pid
    assert pve.hook(100, "post-start").returncode == 0
    q.stop()
    qemus.clear()
    assert pve.hook(100, "post-stop").returncode == 0


def test_post_start_of_a_vm_without_vstor_does_nothing(pve):
    pve.vm(VM)
    started = time.monotonic()
    post = pve.hook(100, "post-start")
    assert post.returncode == 0 and post.stderr == ""
    assert time.monotonic() - started < 30


def test_a_set_the_kernel_refuses_half_way_puts_every_moved_thread_back(pve, qemus, monkeypatch):
    """The kernel refuses one thread's set (as it does for a core outside the
    cpuset of QEMU's cgroup, which this machine's cgroups cannot show): the
    threads pinned before it are put back, the refusal says so."""
    import errno
    from vstor.errors import ActionFailed
    q = Qemu(pve, "0-1", 4, iothreads=2)
    qemus.append(q)
    found = pinning.threads(q.pid, str(q.qmp))
    real, calls = os.sched_setaffinity, []

    def refusing(tid, cpus):
        calls.append(tid)
        if len(calls) == 3:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real(tid, cpus)
    monkeypatch.setattr(pinning.os, "sched_setaffinity", refusing)
    with pytest.raises(ActionFailed, match=r"Invalid argument; every thread moved was put back"):
        pinning.apply(_three_cell_plan(), found)
    assert len(calls) > 3                       # two moved, one refused, two put back
    assert set(q.threads().values()) == {"0-1"}


def test_post_start_on_a_migrations_target_reads_the_config_where_it_still_is(pve, qemus, capsys):
    """On a live migration's target qemu-server runs post-start before the
    config moves: PVE_MIGRATED_FROM names the source node, whose directory
    holds it; the pins are made from there."""
    _two_cells(pve, capsys)
    assert pve.hook(100, "pre-start").returncode == 0
    here = Path(pve.etc, "qemu-server", "100.conf")
    there = Path(pve.etc, "nodes", "other", "qemu-server", "100.conf")
    there.write_text(here.read_text())
    here.unlink()
    q = Qemu(pve, "0-1", 2)
    qemus.append(q)
    post = pve.hook(100, "post-start", env={"PVE_MIGRATED_FROM": "other"})
    assert post.returncode == 0, post.stderr
    got = q.threads()
    assert got["CPU 0/TCG"] == "0" and got["CPU 1/TCG"] == "1", got
    bad = pve.hook(100, "post-start", env={"PVE_MIGRATED_FROM": "../x"})
    assert bad.returncode == 2 and "is not a node name" in bad.stderr
    here.write_text(there.read_text())
    q.stop()
    qemus.clear()
    assert pve.hook(100, "post-stop").returncode == 0
