"""`vstor top`: per disk, what it did between two looks (vstor.metrics.collect):
operations and bytes per second, the mean time an operation took, its
backend and node; one line per domain above its disks.  Pure: the looks
are given.  A figure the backend does not give is "-", never 0."""

from __future__ import annotations

from vstor.metrics.collect import Look

COLUMNS = ("DOMAIN/DISK", "BACKEND", "NODE", "R/s", "W/s", "RMB/s", "WMB/s", "R ms", "W ms", "CPU%")


def rates(before: Look, after: Look) -> list[dict]:
    """One row per disk of `after`: its rates since `before` (None: not
    given by its backend, or the disk was not there, or not readable)."""
    seconds = max(after.at - before.at, 1e-6)
    old = {(d.domain, d.uuid, d.disk): d for d in before.disks}
    rows = []
    for d in after.disks:
        p = old.get((d.domain, d.uuid, d.disk))
        both = p is not None and p.up and d.up and p.pid == d.pid     # a restarted daemon counts anew

        def per_second(f: str, scale: float = 1.0):
            a, b = (getattr(p, f), getattr(d, f)) if both else (None, None)
            return None if a is None or b is None or b < a else (b - a) / seconds / scale

        def mean_ms(time_field: str, ops_field: str):
            if not both or getattr(d, time_field) is None or getattr(p, time_field) is None:
                return None
            ops = getattr(d, ops_field) - getattr(p, ops_field)
            took = getattr(d, time_field) - getattr(p, time_field)
            return took / ops * 1000 if ops > 0 else None
        rows.append({"domain": d.domain, "uuid": d.uuid, "disk": d.disk, "backend": d.backend,
                     "node": d.node, "up": d.up, "why": d.why or None,
                     "reads_per_second": per_second("reads"), "writes_per_second": per_second("writes"),
                     "read_bytes_per_second": per_second("read_bytes"),
                     "written_bytes_per_second": per_second("written_bytes"),
                     "read_ms": mean_ms("read_seconds", "reads"),
                     "write_ms": mean_ms("write_seconds", "writes"),
                     "cpu_percent": per_second("cpu_seconds", 0.01)})
    return rows


def table(rows: list[dict], drift: tuple = ()) -> list[str]:
    """The rows as `vstor top` prints them: a domain's line (its drift, if
    any) and its disks' lines under it."""
    lines = ["{:<24} {:<11} {:>4} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>5}".format(*COLUMNS)]
    drifted: dict[str, int] = {}
    for domain, _uuid, _what, n in drift:
        drifted[domain] = drifted.get(domain, 0) + n
    seen = None
    for r in sorted(rows, key=lambda r: (r["domain"], r["disk"])):
        if r["domain"] != seen:
            seen = r["domain"]
            mark = f"  DRIFT: {drifted[seen]} (vstor status {seen})" if drifted.get(seen) else ""
            lines.append(f"{seen}{mark}")
        if not r["up"]:
            figures = f"({r['why']})"
        else:
            figures = "{:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>5}".format(
                _n(r["reads_per_second"], 0), _n(r["writes_per_second"], 0),
                _n(r["read_bytes_per_second"], 2, 1 << 20), _n(r["written_bytes_per_second"], 2, 1 << 20),
                _n(r["read_ms"], 3), _n(r["write_ms"], 3), _n(r["cpu_percent"], 0))
        node = "-" if r["node"] is None else str(r["node"])
        lines.append(f"  {r['disk']:<22} {r['backend']:<11} {node:>4} {figures}")
    if len(lines) == 1:
        lines.append("(vstor serves no disk to a running domain on this host)")
    return lines


def _n(value, digits: int, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"

