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
    """prometheus_client's custom collector: each scrape is one new look."""

    def __init__(self, looker):
        import threading
        self.looker = looker        # () -> Look
        self.one = threading.Lock()     # one look at a time: scrapes share the SPDK client

    def collect(self):
        with self.one:
            return families(self.looker())

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


def registry(looker):
    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(looker))
    return reg


def text(looker) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(registry(looker))


def write_textfile(path: str, looker) -> None:
    """node_exporter's textfile collector reads `path`: written whole
    (prometheus_client writes a temporary beside it and renames it)."""
    from prometheus_client import write_to_textfile
    write_to_textfile(path, registry(looker))


def serve(address: str, port: int, looker) -> None:
    """The scrape endpoint, until killed: one thread per scrape, each a
    new look (prometheus_client's WSGI server)."""
    import threading
    from prometheus_client import start_http_server
    start_http_server(port, addr=address, registry=registry(looker))
    threading.Event().wait()
