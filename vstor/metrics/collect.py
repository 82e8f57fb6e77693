"""One look at what vstor's disks are doing: per disk, from the backend that
serves it, and what vstor holds and has counted.  `vstor metrics` exposes
a look to Prometheus (vstor.metrics.expose), `vstor top` compares two.

Where each disk's numbers come from (docs/operations.md, "Metrics"):

- qemu-storage-daemon: the kernel's accounting of its daemon, which serves
  that one disk.  QEMU's own block statistics count nothing on a
  vhost-user-blk export (`query-blockstats` stays at zero under I/O: the
  export path does no block accounting), and qemu-storage-daemon has no
  latency histogram.  Bytes: /proc/PID/io's read_bytes and write_bytes,
  what the daemon's threads moved to and from storage (with O_DIRECT, a
  block device's and most files', exactly what the guest moved).
  Operations: the io.stat of the daemon's own cgroup, where systemd gave
  it a scope on the unified hierarchy (cgroup v2); nowhere else, and then
  not invented.  CPU: the daemon's utime + stime.
- SPDK: `bdev_get_iostat` of the disk's bdev: bytes, operations and the
  time they took (its latency ticks over its tick rate).
- Passthrough: nothing.  The guest drives the controller; the host sees no
  I/O of it.  The disk is listed (vstor_disk_info), with no counters.

A disk whose numbers cannot be read is listed with `up` False and the
reason; its counters are left out, never reported as zero.
"""

from __future__ import annotations

import os
import time

from vstor.errors import ActionFailed, VstorError
from vstor.records import field, record
from vstor.runtime import actions
from vstor.runtime.state import PREPARED

CLK_TCK = os.sysconf("SC_CLK_TCK")
# What a drift check compares (vstor.runtime.drift): each is a series per
# running domain, 0 when it matches the plan.
DRIFT = ("vcpu", "emulator", "iothread", "numatune", "daemon", "reactor")
CGROUP_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")     # cgroup v2: unified, or systemd's hybrid


@record
class Disk:
    domain: str
    uuid: str
    disk: str               # the target (vdb); a passed-through controller's PCI address
    backend: str            # qsd | spdk | passthrough
    node: int | None        # the host node its backend runs on
    up: bool = True         # its numbers could be read
    why: str = ""           # why not
    pid: int | None = None  # its qemu-storage-daemon
    read_bytes: int | None = None
    written_bytes: int | None = None
    reads: int | None = None
    writes: int | None = None
    read_seconds: float | None = None
    write_seconds: float | None = None
    cpu_seconds: float | None = None


@record
class Look:
    at: float                                       # time.monotonic() of the look
    disks: tuple[Disk, ...]
    domains: tuple[tuple[str, str, str], ...]       # (domain, uuid, record status)
    held: dict = field(default_factory=dict)        # step kind -> done steps
    totals: dict = field(default_factory=dict)      # vstor.metrics.totals
    counts_error: str = ""                          # why the totals could not be read
    drift: tuple[tuple[str, str, str, int], ...] = ()   # (domain, uuid, what, differences)
    damaged: int = 0                                # state records that cannot be read
    seconds: float = 0.0                            # CPU time the look took


def look(rt, state, *, proc: str = "/proc", drift=None) -> Look:
    """What every record's disks are doing now.  `drift(record)`, given,
    returns that domain's differences from its plan (vstor.runtime.drift)."""
    from vstor.metrics import totals as totals_mod
    began = time.process_time()
    damaged: list[str] = []
    records = state.records(damaged)
    nodes = _cpu_nodes(rt.sysfs)
    spdk: dict[str, _Spdk] = {}     # per SPDK application (a record's own socket: Runtime.of)
    disks, held, found = [], {}, []
    for rec in records:
        uuid = rec.uuid or ""
        for entry in rec.steps:
            if entry.get("state") == "done":
                held[entry.get("kind", "")] = held.get(entry.get("kind", ""), 0) + 1
        if rec.status != PREPARED:
            continue
        for entry in rec.steps:
            if entry.get("state") != "done":
                continue
            try:
                step = actions.from_json(entry)
            except ActionFailed:
                continue
            if step.kind == "qsd-export":
                disks.append(_qsd(rec, uuid, step.export, nodes, proc))
            elif step.kind == "spdk-vhost":
                app = rt.of(rec)
                asked = spdk.setdefault(app.cfg.spdk_socket, _Spdk(app))
                disks.append(asked.disk(rec, uuid, step, nodes))
        for address in sorted(rec.holding.get("passthrough", [])):
            node = rt.sysfs.read_int(f"/sys/bus/pci/devices/{address}/numa_node", default=-1)
            disks.append(Disk(rec.domain, uuid, address, "passthrough", node if node >= 0 else None,
                              up=False, why="a passed-through controller's I/O is the guest's"))
        differences = _drift(drift, rec)
        if differences is not None:
            found.extend((rec.domain, uuid, what, n) for what, n in _by_what(differences))
    try:
        counted, counts_error = totals_mod.fold(state.path), ""
    except VstorError as e:     # the disks' figures still go out; the counts say they are not
        counted, counts_error = {}, e.message
    return Look(at=time.monotonic(), disks=tuple(disks),
                domains=tuple((r.domain, r.uuid or "", r.status) for r in records),
                held=held, totals=counted, counts_error=counts_error, drift=tuple(found),
                damaged=len(damaged), seconds=time.process_time() - began)


def _target(rec, name: str) -> str:
    """A disk's target from its daemon's or controller's name, <key>-<target>."""
    prefix = rec.key + "-"
    return name[len(prefix):] if name.startswith(prefix) else name


def _cpu_nodes(sysfs) -> dict[int, int]:
    """Each CPU's node, as the host model reads them (vstor.host.read)."""
    from vstor.host.read import read_nodes, read_online_cpus
    return {cpu: n.id for n in read_nodes(sysfs, read_online_cpus(sysfs)) for cpu in n.cpus}


def _qsd(rec, uuid: str, export, nodes: dict[int, int], proc: str) -> Disk:
    from vstor.backends.qsd import daemon
    node = nodes.get(export.cpus[0]) if export.cpus else None
    base = Disk(rec.domain, uuid, _target(rec, export.name), "qsd", node)
    pid = daemon.pid(export)
    if pid is None:
        return _down(base, "its qemu-storage-daemon is not running")
    try:
        io = _keyed(_read(f"{proc}/{pid}/io"), ":")
        stat = _read(f"{proc}/{pid}/stat")
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK        # utime, stime
        ops = _cgroup_ops(pid, proc)
    except (OSError, ValueError, IndexError, KeyError) as e:
        return _down(base, f"cannot read its daemon's accounting (pid {pid}): {e}")
    return _replace(base, pid=pid, read_bytes=int(io["read_bytes"]), written_bytes=int(io["write_bytes"]),
                    reads=ops[0] if ops else None, writes=ops[1] if ops else None, cpu_seconds=cpu)


def _served_device(pid: int, proc: str) -> str | None:
    """MAJ:MIN of what the daemon serves, by the descriptor it holds (its
    command line names /proc/self/fd/N, never a path): a block device's
    own number, a file's filesystem's."""
    import stat as st
    from vstor.backends.qsd import daemon
    held = daemon.held_source(pid, proc)
    if held is None:
        return None
    s = os.stat(held)
    dev = s.st_rdev if st.S_ISBLK(s.st_mode) else s.st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


def _cgroup_ops(pid: int, proc: str) -> tuple[int, int] | None:
    """(reads, writes) from io.stat of the daemon's own cgroup v2 scope
    (vstor.slice/…scope: systemd-run made it for this daemon alone), on
    the device it serves alone: a device mapper, md or loop device below
    it counts its own clones of the same I/O on its own line.  None when
    it has no such scope."""
    for line in _read(f"{proc}/{pid}/cgroup").splitlines():
        if not line.startswith("0::"):
            continue
        path = line[3:]
        if "/vstor.slice/" not in path or not path.endswith(".scope"):
            return None
        for mount in CGROUP_MOUNTS:
            try:
                text = _read(f"{mount}{path}/io.stat")
            except FileNotFoundError:
                continue
            device = _served_device(pid, proc)
            for dev in text.splitlines():
                words = dev.split()
                if words and words[0] == device:
                    kv = _keyed("\n".join(words[1:]), "=")
                    return int(kv.get("rios", 0)), int(kv.get("wios", 0))
            return 0, 0         # nothing done on it yet
    return None


class _Spdk:
    """SPDK's answers, asked once per look: every bdev's statistics."""

    def __init__(self, rt):
        self.rt = rt
        self.answer = None
        self.error = None

    def _stats(self) -> dict:
        if self.answer is None and self.error is None:
            try:
                got = self.rt.spdk.call("bdev_get_iostat")
                if not isinstance(got, dict) or "bdevs" not in got:
                    raise ActionFailed("SPDK's bdev_get_iostat answer has no bdevs "
                                       "(an SPDK older than 21.01)")
                self.answer = {b.get("name"): b for b in got["bdevs"]}
                self.answer[None] = {"tick_rate": got.get("tick_rate") or 0}
            except VstorError as e:
                self.error = e.message
        return self.answer or {}

    def disk(self, rec, uuid: str, step, nodes: dict[int, int]) -> Disk:
        base = Disk(rec.domain, uuid, _target(rec, step.ctrlr), "spdk", nodes.get(step.reactor))
        stats = self._stats()
        if self.error:
            return _down(base, f"cannot ask SPDK: {self.error}")
        b = stats.get(step.bdev)
        if b is None:
            return _down(base, f"SPDK has no bdev {step.bdev}")
        rate = stats[None]["tick_rate"]
        try:
            return _replace(base, read_bytes=int(b["bytes_read"]), written_bytes=int(b["bytes_written"]),
                            reads=int(b["num_read_ops"]), writes=int(b["num_write_ops"]),
                            read_seconds=int(b["read_latency_ticks"]) / rate if rate else None,
                            write_seconds=int(b["write_latency_ticks"]) / rate if rate else None)
        except (KeyError, TypeError, ValueError) as e:
            return _down(base, f"SPDK's statistics of {step.bdev} lack {e}")


def _drift(drift, rec):
    """The record's differences from its plan; None when it has no drift
    check (not a libvirt domain that runs) or it cannot be made now (vstor
    status says why): then it has no vstor_drift series, never zeros."""
    if drift is None:
        return None
    try:
        return drift(rec)
    except VstorError:
        return None


def _by_what(differences) -> list[tuple[str, int]]:
    out: dict[str, int] = dict.fromkeys(DRIFT, 0)
    for d in differences:
        out[d.what] = out.get(d.what, 0) + 1
    return sorted(out.items())


def _down(d: Disk, why: str) -> Disk:
    return _replace(d, up=False, why=why)


def _replace(d: Disk, **changes) -> Disk:
    from vstor import records
    return records.replace(d, **changes)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(text: str, sep: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(sep)
        out[k.strip()] = v.strip()
    return out
