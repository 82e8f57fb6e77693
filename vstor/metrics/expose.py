"""A look (vstor.metrics.collect) as Prometheus metrics, through
prometheus_client: the families are declared here once, and the library
writes the exposition format, serves it and writes node_exporter's
textfile (docs/operations.md, "Metrics", lists every series).

Names follow Prometheus's rules: counters end in _total, times are in
seconds, sizes in bytes.  Every disk series carries domain, uuid, disk,
backend and node ("" when its backend is on no node)."""

from __future__ import annotations

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from vstor.metrics.collect import Look
from vstor.metrics.totals import BUCKETS

DISK = ("domain", "uuid", "disk", "backend", "node")
# (name, help, Disk field): counters a backend gives only where it counts them.
DISK_COUNTERS = (
    ("vstor_disk_read_bytes", "Bytes read from the disk's backing storage by its backend", "read_bytes"),
    ("vstor_disk_written_bytes", "Bytes written to the disk's backing storage by its backend",
     "written_bytes"),
    ("vstor_disk_reads", "Read operations the backend completed (SPDK; qemu-storage-daemon "
                         "under a cgroup v2 scope)", "reads"),
    ("vstor_disk_writes", "Write operations the backend completed (SPDK; qemu-storage-daemon "
                          "under a cgroup v2 scope)", "writes"),
    ("vstor_disk_read_time_seconds", "Time the backend's reads took, summed (SPDK)", "read_seconds"),
    ("vstor_disk_write_time_seconds", "Time the backend's writes took, summed (SPDK)", "write_seconds"),
    ("vstor_disk_backend_cpu_seconds", "CPU time of the disk's qemu-storage-daemon (user + system)",
     "cpu_seconds"),
)
EXIT_CLASSES = {"1": "error", "2": "bad_input", "3": "does_not_fit", "4": "unavailable",
                "5": "action_failed"}
RESULTS = {"0": "ok", **EXIT_CLASSES}
DAEMONS = ("qemu-storage-daemon",)      # what vstor supervise restarts


class Collector:
    """prometheus_client's custom collector: a scrape gets a new look,
    unless one was taken less than `fresh` seconds ago (then that one: a
    loop of requests, from anyone who can reach the endpoint, costs the
    host one look per `fresh` seconds).  One look at a time; a scrape that
    waits past `wait` seconds for one gets an error (HTTP 500), not a
    thread piled on the others."""

    def __init__(self, looker, fresh: float = 0.0, wait: float = 30.0):
        import threading
        self.looker = looker        # () -> Look
        self.fresh, self.wait = fresh, wait
        self.one = threading.Lock()
        self.last: tuple[float, list] | None = None

    def collect(self):
        import time
        if not self.one.acquire(timeout=self.wait):
            raise TimeoutError(f"a look at the host has taken more than {self.wait:g}s")
        try:
            now = time.monotonic()
            if self.last is None or now - self.last[0] >= self.fresh:
                self.last = (now, families(self.looker()))
            return self.last[1]
        finally:
            self.one.release()

    def describe(self):
        return []


def families(look: Look) -> list:
    out = []
    info = GaugeMetricFamily("vstor_disk_info", "A disk vstor serves to a running domain (always 1)",
                             labels=DISK)
    up = GaugeMetricFamily("vstor_disk_stats_up", "1 if the disk's backend statistics could be "
                                                  "read now, 0 if not (the log says why)",
                           labels=DISK)
    counters = {f: CounterMetricFamily(name, text, labels=DISK) for name, text, f in DISK_COUNTERS}
    for d in look.disks:
        labels = [d.domain, d.uuid, d.disk, d.backend, "" if d.node is None else str(d.node)]
        info.add_metric(labels, 1)
        if d.backend != "passthrough":          # it has no figures to read: never "down"
            up.add_metric(labels, 1 if d.up else 0)
        for f, family in counters.items():
            value = getattr(d, f)
            if d.up and value is not None:
                family.add_metric(labels, value)
    out += [info, up, *counters.values()]

    domains = GaugeMetricFamily("vstor_domains", "Domains vstor holds backends for, by record status",
                                labels=("status",))
    by: dict[str, int] = {}
    for _, _, status in look.domains:
        by[status] = by.get(status, 0) + 1
    for status, n in sorted(by.items()):
        domains.add_metric([status], n)
    held = GaugeMetricFamily("vstor_backends_held", "Host changes vstor holds now, by kind "
                                                    "(qsd-export: a qemu-storage-daemon)",
                             labels=("kind",))
    for kind, n in sorted(look.held.items()):
        held.add_metric([kind], n)
    damaged = GaugeMetricFamily("vstor_damaged_records", "State records that cannot be read "
                                                         "(vstor status names them)")
    damaged.add_metric([], look.damaged)
    drift = GaugeMetricFamily("vstor_drift", "Differences between what runs and the domain's plan "
                                             "(vstor status lists them, vstor repair fixes them)",
                              labels=("domain", "uuid", "what"))
    for domain, uuid, what, n in look.drift:
        drift.add_metric([domain, uuid, what], n)
    out += [domains, held, damaged, drift]
    counts = GaugeMetricFamily("vstor_counts_up", "1 if the counts of hook runs, refusals, restarts, "
                                                  "rebuilds and gc releases could be read (0: vstor "
                                                  "metrics show says why)")
    counts.add_metric([], 0 if look.counts_error else 1)
    out.append(counts)
    if not look.counts_error:
        out += _totals(look.totals)
    took = GaugeMetricFamily("vstor_collect_cpu_seconds", "CPU time vstor took to collect this scrape")
    took.add_metric([], look.seconds)
    out.append(took)
    return out


def _totals(totals: dict) -> list:
    runs = CounterMetricFamily("vstor_hook_runs", "Hook phases run, by entry (libvirt, proxmox), "
                                                  "phase and result", labels=("entry", "phase", "result"))
    refusals = CounterMetricFamily("vstor_refusals", "Refusals of vstor's commands and hooks, by "
                                                     "command and exit class",
                                   labels=("command", "class"))
    restarts = CounterMetricFamily("vstor_daemon_restarts", "Backends started again after they died "
                                                            "(vstor supervise, a reconnect)",
                                   labels=("daemon",))
    rebuilds = CounterMetricFamily("vstor_index_rebuilds", "Rebuilds of the state directory's index")
    gc = CounterMetricFamily("vstor_gc_releases", "Records vstor gc released")
    rebuilt = released = 0.0
    restarted = dict.fromkeys(DAEMONS, 0.0)
    for key, n in sorted(totals.get("counts", {}).items()):
        kind, _, labels = key.partition("\t")
        words = labels.split(" ")
        if kind == "hook" and len(words) == 3:
            runs.add_metric([words[0], words[1], RESULTS.get(words[2], "error")], n)
        elif kind == "refusal" and len(words) == 2:
            refusals.add_metric([words[0], EXIT_CLASSES.get(words[1], "error")], n)
        elif kind == "restart" and len(words) == 1:
            restarted[words[0]] = restarted.get(words[0], 0.0) + n
        elif kind == "rebuild":
            rebuilt += n
        elif kind == "gc":
            released += n
    for daemon, n in sorted(restarted.items()):
        restarts.add_metric([daemon], n)
    rebuilds.add_metric([], rebuilt)
    gc.add_metric([], released)
    hist = HistogramMetricFamily("vstor_hook_duration_seconds", "How long each hook phase took",
                                 labels=("entry", "phase"))
    for phase, d in sorted(totals.get("durations", {}).items()):
        words = phase.split(" ")
        if len(words) != 2:
            continue
        buckets = [(_le(b), n) for b, n in zip(BUCKETS, d["buckets"])] + [("+Inf", d["count"])]
        hist.add_metric(words, buckets, d["sum"])
    return [runs, hist, refusals, restarts, rebuilds, gc]


def _le(b: float) -> str:
    return repr(float(b))


def registry(looker, fresh: float = 0.0):
    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(looker, fresh))
    return reg


def text(looker) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(registry(looker))


def write_textfile(path: str, looker) -> None:
    """node_exporter's textfile collector reads `path`: written whole, a
    temporary beside it renamed over it, both by name inside the directory
    opened once without following a link (Debian's textfile directory is
    in one the prometheus user owns: a name there swapped for a link leads
    root's write nowhere else)."""
    import os
    where, name = os.path.split(os.path.abspath(path))
    data = text(looker)
    tmp = f".{name}.{os.getpid()}.tmp"
    dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def serve(address: str, port: int, looker, fresh: float = 5.0) -> None:
    """The scrape endpoint, until killed (prometheus_client's server: a
    thread per request; at most one look per `fresh` seconds)."""
    import threading
    from prometheus_client import start_http_server
    start_http_server(port, addr=address, registry=registry(looker, fresh))
    threading.Event().wait()
