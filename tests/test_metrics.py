"""vstor's metrics without a host: the events the hooks count and their
folding (no line lost or counted twice, even when the file is moved aside
under appends), the exposition read back by Prometheus's own parser
(prometheus_client.parser), `vstor top`'s rates, and where each disk's
figures come from (a /proc and an SPDK answer laid out as the kernel and
SPDK give them).  The real guest, promtool and a real Prometheus judge
them in tests/e2e/test_metrics.py."""
from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vstor import counters
from vstor.errors import Unavailable
from vstor.metrics import collect, expose, top, totals
from vstor.metrics.collect import Disk, Look


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    counters.at(str(d))
    yield d
    counters.at(None)


def _families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def _samples(families: dict, name: str) -> dict:
    family = families[name.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum")
                      .removesuffix("_count")]
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == name}


def test_events_fold_into_totals_once(state_dir):
    counters.add("hook", ("libvirt", "prepare", "0"), 0.2)
    counters.add("hook", ("libvirt", "prepare", "3"), 0.03)
    counters.add("refusal", ("status", "2"))
    counters.add("gc", ())
    first = totals.fold(str(state_dir))
    assert first["counts"] == {"hook\tlibvirt prepare 0": 1, "hook\tlibvirt prepare 3": 1,
                               "refusal\tstatus 2": 1, "gc\t": 1}
    d = first["durations"]["libvirt prepare"]
    assert d["count"] == 2 and d["sum"] == pytest.approx(0.23)
    assert d["buckets"][totals.BUCKETS.index(0.05)] == 1 and d["buckets"][totals.BUCKETS.index(0.25)] == 2
    assert totals.fold(str(state_dir)) == first          # nothing new: nothing counted twice
    counters.add("gc", ())
    assert totals.fold(str(state_dir))["counts"]["gc\t"] == 2


def test_labels_cannot_break_a_line(state_dir):
    counters.add("refusal", ("bad\tcommand\nsecond", "2"))
    counters.add("no-such-kind", ("x",))
    assert totals.fold(str(state_dir))["counts"] == {"refusal\t- 2": 1}


def test_nothing_is_counted_without_a_state_directory(tmp_path):
    counters.at(str(tmp_path / "missing"))
    try:
        counters.add("gc", ())
    finally:
        counters.at(None)
    assert not (tmp_path / "missing").exists()
    assert totals.fold(str(tmp_path / "missing")) == totals.empty()


def test_no_line_is_lost_when_the_fold_moves_the_file_aside(state_dir, monkeypatch):
    monkeypatch.setattr(totals, "ROTATE", 2000)     # rotated many times under the appends
    per_thread, threads = 400, 4

    def append():
        counters.at(str(state_dir))
        for _ in range(per_thread):
            counters.add("gc", ())
    workers = [threading.Thread(target=append) for _ in range(threads)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        totals.fold(str(state_dir))
    for w in workers:
        w.join()
    assert totals.fold(str(state_dir))["counts"]["gc\t"] == per_thread * threads


def test_unfolded_lines_stop_at_a_bound(state_dir, monkeypatch):
    monkeypatch.setattr(counters, "MOST", 100)
    for _ in range(50):
        counters.add("refusal", ("hook-prepare", "3"))
    assert 100 <= (state_dir / "metrics" / "events").stat().st_size < 130
    assert totals.fold(str(state_dir))["counts"]["refusal\thook-prepare 3"] < 10


def test_a_fold_that_holds_the_file_never_blocks_a_run(state_dir):
    import fcntl
    import time
    counters.add("gc", ())
    fd = os.open(state_dir / "metrics" / "events", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)          # a fold moving it aside, stopped (SIGSTOP)
    try:
        t0 = time.monotonic()
        counters.add("gc", ())
        assert time.monotonic() - t0 < 2
    finally:
        os.close(fd)
    assert totals.fold(str(state_dir))["counts"]["gc\t"] == 1     # that one was dropped


def test_damaged_totals_are_a_refusal_not_zeros(state_dir):
    counters.add("gc", ())
    totals.fold(str(state_dir))
    (state_dir / "metrics" / "totals.json").write_text("{not json")
    with pytest.raises(Unavailable, match="cannot read vstor's event totals"):
        totals.fold(str(state_dir))


def _disk(**kw) -> Disk:
    base = dict(domain="web1", uuid="u-1", disk="vdb", backend="qsd", node=0, pid=10)
    return Disk(**{**base, **kw})


def _look(disks, at=100.0, **kw) -> Look:
    return Look(at=at, disks=tuple(disks), domains=(("web1", "u-1", "prepared"),), **kw)


def test_the_exposition_as_prometheus_reads_it():
    look = _look([_disk(read_bytes=4096, written_bytes=8192, cpu_seconds=1.5),
                  _disk(disk="vdc", backend="spdk", node=1, pid=None, read_bytes=1, written_bytes=2,
                        reads=3, writes=4, read_seconds=0.5, write_seconds=0.25),
                  _disk(disk="vdd", up=False, why="its qemu-storage-daemon is not running"),
                  _disk(disk="0000:5e:00.0", backend="passthrough", node=None, up=False, why="guest's")],
                 held={"qsd-export": 2}, drift=(("web1", "u-1", "vcpu", 1), ("web1", "u-1", "emulator", 0)),
                 totals={"counts": {"hook\tlibvirt prepare 0": 3, "refusal\thook-prepare 3": 2},
                         "durations": {"libvirt prepare": {"buckets": [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3],
                                                           "sum": 0.4, "count": 3}}})
    fam = _families(expose.text(lambda: look))
    vdb = (("backend", "qsd"), ("disk", "vdb"), ("domain", "web1"), ("node", "0"), ("uuid", "u-1"))
    assert _samples(fam, "vstor_disk_read_bytes_total")[vdb] == 4096
    assert _samples(fam, "vstor_disk_backend_cpu_seconds_total")[vdb] == 1.5
    assert vdb not in _samples(fam, "vstor_disk_reads_total")        # qsd without a v2 scope: absent, not 0
    reads = _samples(fam, "vstor_disk_reads_total")
    assert list(reads.values()) == [3] and dict(next(iter(reads)))["backend"] == "spdk"
    up = {dict(k)["disk"]: v for k, v in _samples(fam, "vstor_disk_stats_up").items()}
    assert up == {"vdb": 1, "vdc": 1, "vdd": 0}        # a passed-through controller has no figures to read
    # a disk whose figures cannot be read has none, never zeros
    assert not [k for k in _samples(fam, "vstor_disk_written_bytes_total") if dict(k)["disk"] == "vdd"]
    passthrough = [k for k in _samples(fam, "vstor_disk_info") if dict(k)["backend"] == "passthrough"]
    assert dict(passthrough[0])["node"] == ""
    assert _samples(fam, "vstor_hook_runs_total") == {
        (("entry", "libvirt"), ("phase", "prepare"), ("result", "ok")): 3}
    assert _samples(fam, "vstor_refusals_total") == {(("class", "does_not_fit"), ("command", "hook-prepare")): 2}
    buckets = _samples(fam, "vstor_hook_duration_seconds_bucket")
    assert buckets[(("entry", "libvirt"), ("le", "+Inf"), ("phase", "prepare"))] == 3
    assert buckets[(("entry", "libvirt"), ("le", "0.05"), ("phase", "prepare"))] == 1
    assert _samples(fam, "vstor_drift") == {(("domain", "web1"), ("uuid", "u-1"), ("what", "vcpu")): 1,
                                            (("domain", "web1"), ("uuid", "u-1"), ("what", "emulator")): 0}
    assert _samples(fam, "vstor_daemon_restarts_total") == {(("daemon", "qemu-storage-daemon"),): 0}
    assert _samples(fam, "vstor_backends_held") == {(("kind", "qsd-export"),): 2}


def test_counts_that_cannot_be_read_leave_the_disks_figures(state_dir):
    counters.add("gc", ())
    (state_dir / "metrics").mkdir(exist_ok=True)
    totals.fold(str(state_dir))
    (state_dir / "metrics" / "totals.json").write_text("[]")
    from vstor.host.sysfs import SysFS
    rt = SimpleNamespace(sysfs=SysFS(str(state_dir)))       # a host tree with nothing in it
    state = SimpleNamespace(path=str(state_dir), records=lambda damaged: [])
    look = collect.look(rt, state)
    fam = _families(expose.text(lambda: look))
    assert "is not vstor's event totals" in look.counts_error
    assert _samples(fam, "vstor_counts_up") == {(): 0}
    assert "vstor_gc_releases" not in fam                     # not zeros
    assert _samples(fam, "vstor_damaged_records") == {(): 0}


def test_a_scrape_loop_costs_one_look_per_interval():
    looks = []
    collector = expose.Collector(lambda: looks.append(1) or _look([]), fresh=60)
    for _ in range(50):
        collector.collect()
    assert len(looks) == 1


def test_the_textfile_never_follows_a_link_where_it_writes(tmp_path):
    (tmp_path / "target").write_text("root's own file\n")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "d" / "vstor.prom")
    expose.write_textfile(str(tmp_path / "d" / "vstor.prom"), lambda: _look([]))
    assert (tmp_path / "target").read_text() == "root's own file\n"
    assert not (tmp_path / "d" / "vstor.prom").is_symlink()
    os.symlink(tmp_path / "d", tmp_path / "link")
    with pytest.raises(OSError):
        expose.write_textfile(str(tmp_path / "link" / "vstor.prom"), lambda: _look([]))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["vstor.prom"]


def test_top_rates_between_two_looks():
    before = _look([_disk(read_bytes=0, written_bytes=0, cpu_seconds=1.0),
                    _disk(disk="vdc", backend="spdk", pid=None, read_bytes=0, written_bytes=0, reads=10,
                          writes=0, read_seconds=0.0, write_seconds=0.0)], at=10.0)
    after = _look([_disk(read_bytes=4 << 20, written_bytes=2 << 20, cpu_seconds=1.5),
                   _disk(disk="vdc", backend="spdk", pid=None, read_bytes=1 << 20, written_bytes=0, reads=210,
                         writes=0, read_seconds=0.02, write_seconds=0.0)], at=12.0)
    rows = {r["disk"]: r for r in top.rates(before, after)}
    assert rows["vdb"]["read_bytes_per_second"] == 2 << 20
    assert rows["vdb"]["cpu_percent"] == pytest.approx(25.0)
    assert rows["vdb"]["reads_per_second"] is None          # not given: "-", never 0
    assert rows["vdc"]["reads_per_second"] == 100
    assert rows["vdc"]["read_ms"] == pytest.approx(0.1)
    assert rows["vdc"]["write_ms"] is None                   # no writes: no mean
    lines = top.table(list(rows.values()), (("web1", "u-1", "vcpu", 2),))
    assert lines[1] == "web1  DRIFT: 2 (vstor status web1)"
    assert lines[2].split()[:3] == ["vdb", "qsd", "0"] and lines[2].split()[3] == "-"


def test_a_restarted_daemon_counts_anew_in_top():
    before = _look([_disk(read_bytes=1 << 30, written_bytes=0, cpu_seconds=9.0)], at=0.0)
    after = _look([_disk(pid=11, read_bytes=4096, written_bytes=0, cpu_seconds=0.1)], at=1.0)
    row = top.rates(before, after)[0]
    assert row["read_bytes_per_second"] is None and row["cpu_percent"] is None


def _proc(tmp_path, pid: int, cgroup: str = "0::/user.slice\n") -> str:
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True)
    # As Linux 6.1 writes them (proc_pid_io_accounting, proc_pid_stat).
    (d / "io").write_text("rchar: 100\nwchar: 200\nsyscr: 3\nsyscw: 4\nread_bytes: 40960\n"
                          "write_bytes: 8192\ncancelled_write_bytes: 0\n")
    (d / "stat").write_text(f"{pid} (qemu-storage-d) S 1 {pid} {pid} 0 -1 4194560 500 0 0 0 "
                            f"{3 * collect.CLK_TCK} {collect.CLK_TCK} 0 0 20 0 3 0 100 1000 100\n")
    (d / "cgroup").write_text(cgroup)
    return str(tmp_path / "proc")


def test_a_qsd_disk_from_its_daemons_kernel_accounting(tmp_path, monkeypatch):
    from vstor.backends.qsd import daemon
    monkeypatch.setattr(daemon, "pid", lambda export: 4242)
    rec = SimpleNamespace(domain="web1", key="web1")
    export = SimpleNamespace(name="web1-vdb", cpus=(2, 3))
    d = collect._qsd(rec, "u-1", export, {2: 1, 3: 1}, _proc(tmp_path, 4242))
    assert (d.disk, d.node, d.read_bytes, d.written_bytes, d.cpu_seconds) == ("vdb", 1, 40960, 8192, 4.0)
    assert d.reads is None and d.up


def test_a_qsd_disk_in_its_own_cgroup_v2_scope_has_operations(tmp_path, monkeypatch):
    from vstor.backends.qsd import daemon
    monkeypatch.setattr(daemon, "pid", lambda export: 4243)
    scope = "/vstor.slice/run-r1.scope"
    proc = _proc(tmp_path, 4243, f"0::{scope}\n")
    stat = tmp_path / "cgroup" / scope.lstrip("/")
    stat.mkdir(parents=True)
    (stat / "io.stat").write_text("259:0 rbytes=40960 wbytes=8192 rios=10 wios=2 dbytes=0 dios=0\n"
                                  "8:0 rbytes=0 wbytes=4096 rios=0 wios=1 dbytes=0 dios=0\n")
    monkeypatch.setattr(collect, "CGROUP_MOUNTS", (str(tmp_path / "cgroup"),))
    # The device it serves alone: 8:0 below it (a device mapper's, say) counts the same I/O again.
    monkeypatch.setattr(collect, "_served_device", lambda pid, proc: "259:0")
    d = collect._qsd(SimpleNamespace(domain="web1", key="web1"), "u-1",
                     SimpleNamespace(name="web1-vdb", cpus=()), {}, proc)
    assert (d.reads, d.writes, d.node) == (10, 2, None)
    monkeypatch.setattr(collect, "_served_device", lambda pid, proc: "253:7")    # nothing done on it yet
    d = collect._qsd(SimpleNamespace(domain="web1", key="web1"), "u-1",
                     SimpleNamespace(name="web1-vdb", cpus=()), {}, proc)
    assert (d.reads, d.writes) == (0, 0)


def test_a_daemon_that_does_not_run_is_down_not_zero(monkeypatch):
    from vstor.backends.qsd import daemon
    monkeypatch.setattr(daemon, "pid", lambda export: None)
    d = collect._qsd(SimpleNamespace(domain="web1", key="web1"), "u-1",
                     SimpleNamespace(name="web1-vdb", cpus=()), {}, "/proc")
    assert not d.up and d.read_bytes is None and "not running" in d.why


# bdev_get_iostat's answer as SPDK documents it (doc/jsonrpc.md, bdev_get_iostat).
IOSTAT = {"tick_rate": 2200000000, "ticks": 2523538189523,
          "bdevs": [{"name": "Nvme0n1", "bytes_read": 36864, "num_read_ops": 2, "bytes_written": 0,
                     "num_write_ops": 0, "bytes_unmapped": 0, "num_unmap_ops": 0,
                     "read_latency_ticks": 178904, "max_read_latency_ticks": 102020,
                     "min_read_latency_ticks": 76884, "write_latency_ticks": 0,
                     "max_write_latency_ticks": 0, "min_write_latency_ticks": 0,
                     "unmap_latency_ticks": 0, "max_unmap_latency_ticks": 0, "min_unmap_latency_ticks": 0,
                     "copy_latency_ticks": 0, "max_copy_latency_ticks": 0, "min_copy_latency_ticks": 0}]}


def test_an_spdk_disk_from_bdev_get_iostat():
    calls = []
    rt = SimpleNamespace(spdk=SimpleNamespace(call=lambda m, p=None: calls.append(m) or IOSTAT))
    spdk = collect._Spdk(rt)
    rec = SimpleNamespace(domain="db1", key="db1")
    step = SimpleNamespace(ctrlr="db1-vdb", bdev="Nvme0n1", reactor=4)
    d = spdk.disk(rec, "u-2", step, {4: 1})
    assert (d.disk, d.backend, d.node, d.reads, d.read_bytes) == ("vdb", "spdk", 1, 2, 36864)
    assert d.read_seconds == pytest.approx(178904 / 2.2e9)
    gone = spdk.disk(rec, "u-2", SimpleNamespace(ctrlr="db1-vdc", bdev="Nvme9n1", reactor=4), {4: 1})
    assert not gone.up and "no bdev Nvme9n1" in gone.why
    assert calls == ["bdev_get_iostat"]                     # asked once per look


def test_an_spdk_that_cannot_be_asked_leaves_its_disks_down():
    from vstor.errors import Unavailable as U

    def refuse(method, params=None):
        raise U("cannot reach SPDK at /var/tmp/spdk.sock")
    spdk = collect._Spdk(SimpleNamespace(spdk=SimpleNamespace(call=refuse)))
    d = spdk.disk(SimpleNamespace(domain="db1", key="db1"), "u", SimpleNamespace(ctrlr="db1-vdb",
                                                                                 bdev="Nvme0n1", reactor=0), {})
    assert not d.up and "cannot ask SPDK" in d.why and d.reads is None


def test_the_dashboard_queries_only_what_vstor_exports():
    import re
    board = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "etc", "grafana",
                                         "vstor-dashboard.json")).read())
    exported = {n + "_total" for n, _, _ in expose.DISK_COUNTERS} | {
        "vstor_disk_info", "vstor_disk_stats_up", "vstor_domains", "vstor_backends_held", "vstor_drift",
        "vstor_hook_duration_seconds_bucket", "vstor_refusals_total", "vstor_daemon_restarts_total",
        "vstor_gc_releases_total", "vstor_index_rebuilds_total", "vstor_collect_cpu_seconds"}
    used = {m for p in board["panels"] for t in p.get("targets", []) for m in re.findall(r"vstor_\w+", t["expr"])}
    assert used and used <= exported, used - exported


# -- the commands, in process (main() as the CLI runs it) -----------------------------------

def _cli(capsys, tmp_path, *args):
    from tests.helpers import conf_file, run_cli
    (tmp_path / "state").mkdir(mode=0o700, exist_ok=True)
    try:
        return run_cli(capsys, "--config", conf_file(tmp_path), *args)
    finally:
        counters.at(None)


@pytest.mark.parametrize("args,message", [
    (("metrics", "serve", "--listen", "localhost:9743"), "--listen 'localhost:9743' is not ADDRESS:PORT"),
    (("metrics", "serve", "--listen", "127.0.0.1:70000"), "is not ADDRESS:PORT"),
    (("metrics", "textfile", "/tmp/vstor.txt"), "reads only *.prom files"),
    (("metrics", "textfile", "/no/such/dir/vstor.prom"), "/no/such/dir is not a directory"),
    (("top", "--interval", "0"), "--interval must be above 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path, args, message):
    code, out, err = _cli(capsys, tmp_path, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_the_textfile_is_written_whole_and_counts_what_was_refused(capsys, tmp_path):
    _cli(capsys, tmp_path, "status", "nosuch")
    code, _, err = _cli(capsys, tmp_path, "metrics", "textfile", str(tmp_path / "vstor.prom"))
    assert code == 0, err
    fam = _families((tmp_path / "vstor.prom").read_bytes())
    assert _samples(fam, "vstor_refusals_total") == {(("class", "bad_input"), ("command", "status")): 1}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("vstor.prom")] == ["vstor.prom"]


def test_top_once_as_json_on_a_host_with_nothing(capsys, tmp_path):
    code, out, err = _cli(capsys, tmp_path, "top", "--count", "1", "--interval", "0.01", "--json")
    assert code == 0, err
    screen = json.loads(out)
    assert screen["disks"] == [] and screen["seconds"] > 0


def test_a_dry_run_counts_nothing(capsys, tmp_path):
    _cli(capsys, tmp_path, "release", "nosuch", "--dry-run")
    assert not (tmp_path / "state" / "metrics" / "events").exists()
