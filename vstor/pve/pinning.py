"""Each thread of a Proxmox VM's QEMU on the cores its plan gives it.

qemu-server starts QEMU under `taskset --cpu-list --all-tasks <affinity>`:
one set, the union of every cell's cores, for every thread; it pins no
single vCPU.  After the start, the hookscript's post-start (qemu-server
runs it on every start it makes: a cold start, a live migration's target,
a resume from hibernation) pins each vCPU thread to its planned cores and
every other thread (the main loop, I/O threads, workers) to the plan's
emulator cores, as libvirt's vcpupin and emulatorpin do.

QEMU's monitor names the threads: `query-cpus-fast` gives each vCPU's
index and thread id, `query-iothreads` the I/O threads'.  The pidfile
qemu-server made names the process, and each thread id the monitor gives
must be one of that process's tasks: nothing else on the host is ever
pinned.  `vstor status` asks the same way and compares (check()).
"""

from __future__ import annotations

import os

from vstor.errors import ActionFailed, DoesNotFit, Unavailable
from vstor.host import threads as threads_of
from vstor.host.model import format_cpulist
from vstor.meta.plan import Plan

QMP_TIMEOUT = 10.0       # qemu-server's own monitor calls wait this long


class Threads:
    """A running QEMU's threads as its monitor names them."""

    def __init__(self, pid: int, vcpus: dict[int, int], iothreads: dict[str, int]):
        self.pid = pid
        self.vcpus = vcpus            # vCPU index -> thread id
        self.iothreads = iothreads    # I/O thread id -> thread id


def wanted(plan: Plan) -> tuple[tuple[frozenset[int], ...], frozenset[int]]:
    """The cores of each vCPU (by index) and of every other thread, as the
    plan gives them (Plan.thread_pins: the same answer libvirt's <cputune>
    is rendered from)."""
    return plan.thread_pins()


def describe(plan: Plan) -> list[str]:
    """What post-start pins, as `vstor pve plan` and `vstor status` say it."""
    vcpus, emulator = wanted(plan)
    if not vcpus and not emulator:
        return ["nothing to pin: every QEMU thread runs where qemu-server starts it"]
    out = []
    for cell in plan.guest_cells():
        sets = [vcpus[v] for v in cell.vcpus if v < len(vcpus)]
        if not sets:
            continue
        where = f"cell {cell.id}: " if plan.cells else ""
        if all(len(s) == 1 for s in sets):
            pairs = ", ".join(f"{v}->{next(iter(s))}" for v, s in zip(cell.vcpus, sets))
            out.append(f"{where}vCPU threads 1:1 (vCPU->core) {pairs}")
        else:
            out.append(f"{where}vCPU threads {format_cpulist(cell.vcpus)} on cores "
                       f"{format_cpulist(sorted(set().union(*sets)))}")
    if emulator:
        out.append(f"emulator and I/O threads on cores {format_cpulist(sorted(emulator))}")
    return out


def running(node, vm: int, timeout: float = QMP_TIMEOUT) -> Threads:
    """The threads of the VM's QEMU on this node (a vstor.pve.node.Node):
    Unavailable when it does not run."""
    pid = node.qemu_pid(vm)
    if pid is None:
        raise Unavailable(f"VM {vm}'s QEMU does not run (no live process behind "
                          f"{node.pidfile(vm)}): nothing pinned")
    return threads(pid, node.qmp_path(vm), timeout)


def threads(pid: int, qmp_path: str, timeout: float = QMP_TIMEOUT) -> Threads:
    """The vCPU and I/O threads of QEMU `pid`, from its monitor at
    `qmp_path`; Unavailable when the monitor cannot be asked, ActionFailed
    when its answer is not this process's threads."""
    from vstor.backends.qsd.monitor import Monitor
    with Monitor(qmp_path, timeout) as mon:
        cpus = mon.execute("query-cpus-fast")
        io = mon.execute("query-iothreads")
    tasks = _tasks(pid)
    vcpus, iothreads = {}, {}
    for entry in cpus if isinstance(cpus, list) else [None]:
        index, tid = _ids(entry, "cpu-index", "query-cpus-fast")
        if index in vcpus:
            raise ActionFailed(f"QEMU pid {pid}: query-cpus-fast names vCPU {index} twice")
        if tid in vcpus.values():
            raise ActionFailed(f"QEMU pid {pid} runs several vCPUs on thread {tid} (TCG without "
                               "multi-threading): they cannot be pinned apart")
        vcpus[index] = _own(tid, tasks, pid)
    for entry in io if isinstance(io, list) else [None]:
        name, tid = _ids(entry, "id", "query-iothreads")
        iothreads[name] = _own(tid, tasks, pid)
    return Threads(pid, vcpus, iothreads)


def apply(plan: Plan, found: Threads) -> int:
    """Pin every thread of `found.pid` as the plan says; how many threads
    were moved.  ActionFailed when the monitor's vCPUs are not the plan's,
    a planned core is not one QEMU may run on, or the kernel refuses a set:
    then every thread moved is put back where it was."""
    vcpus, emulator = wanted(plan)
    if not vcpus and not emulator:
        return 0
    _check_count(plan, found)
    online = threads_of.online()
    outside = set().union(*vcpus, emulator) - online
    if outside:
        raise DoesNotFit(f"the plan pins QEMU pid {found.pid}'s threads to cores "
                         f"{format_cpulist(sorted(outside))}, which are not online (cores "
                         f"{format_cpulist(sorted(online))} are): nothing pinned",
                         hint="bring the cores online, or plan the VM again (vstor pve apply, "
                              "with the VM stopped)")
    vcpu_tids = {tid: i for i, tid in found.vcpus.items()}
    before: dict[int, frozenset[int]] = {}
    def want_of(tid: int):
        return (vcpus[vcpu_tids[tid]] if vcpus else None) if tid in vcpu_tids else emulator
    who = f"QEMU pid {found.pid}"
    try:
        with threads_of.alive(found.pid, who) as alive:
            threads_of.pin(found.pid, who, want_of, alive, lambda tid, had, _now: before.setdefault(tid, had))
    except BaseException as e:
        for tid, have in before.items():
            try:
                os.sched_setaffinity(tid, have)
            except OSError:
                pass        # gone since: nothing to put back
        if isinstance(e, ActionFailed):
            raise ActionFailed(f"{e.message}; every thread moved was put back") from None
        raise
    return len(before)


def check(plan: Plan, found: Threads) -> list[str]:
    """How the running threads differ from the plan: one line each."""
    vcpus, emulator = wanted(plan)
    if not vcpus and not emulator:
        return []
    try:
        _check_count(plan, found)
    except ActionFailed as e:
        return [str(e)]
    out = []
    for i, tid in sorted(found.vcpus.items()):
        have = threads_of.affinity(tid)
        if vcpus and have is not None and have != vcpus[i]:
            out.append(f"vCPU {i} (thread {tid}) runs on {format_cpulist(sorted(have))}, "
                       f"the plan pins it to {format_cpulist(sorted(vcpus[i]))}")
    if emulator:
        vcpu_tids = set(found.vcpus.values())
        stray = {}
        for tid in _tasks(found.pid):
            # A kernel worker in QEMU's process (kvm-nx-lpage-recovery, vhost)
            # takes the affinity of the thread that made it: the kernel's.
            kernel = threads_of.kernel_worker(found.pid, tid)
            have = None if tid in vcpu_tids or kernel else threads_of.affinity(tid)
            if have is not None and have != emulator:
                stray[tid] = have
        if stray:
            tid, have = min(stray.items())
            out.append(f"{len(stray)} emulator or I/O thread{'s' if len(stray) > 1 else ''} "
                       f"(thread {tid}: {format_cpulist(sorted(have))}) not on the plan's emulator "
                       f"cores {format_cpulist(sorted(emulator))}")
    return out


def _check_count(plan: Plan, found: Threads) -> None:
    if sorted(found.vcpus) != list(range(plan.vcpus)):
        raise ActionFailed(f"QEMU pid {found.pid} runs vCPUs {format_cpulist(sorted(found.vcpus))}, "
                           f"the plan has {plan.vcpus}")


def _ids(entry, key: str, command: str):
    """(entry[key], entry['thread-id']) of one answer entry, checked."""
    if not isinstance(entry, dict):
        raise ActionFailed(f"QMP {command}: answer is not a list of objects")
    name, tid = entry.get(key), entry.get("thread-id")
    ok_name = (type(name) is int and 0 <= name < 4096) if key == "cpu-index" else \
        (isinstance(name, str) and 0 < len(name) <= 128 and name.isprintable())
    if not ok_name or type(tid) is not int or not 0 < tid <= 4194304:
        raise ActionFailed(f"QMP {command}: an entry without a valid {key} and thread-id")
    return name, tid


def _own(tid: int, tasks: set[int], pid: int) -> int:
    if tid not in tasks:
        raise ActionFailed(f"QEMU's monitor names thread {tid}, which is not a thread of QEMU "
                           f"pid {pid}: nothing pinned")
    return tid


def _tasks(pid: int) -> set[int]:
    return threads_of.tasks(pid, f"QEMU pid {pid}")
