"""metrics show|serve|textfile, top: what vstor's disks are doing, for
Prometheus and for a terminal (vstor.metrics)."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import time

from vstor.cli.context import warn
from vstor.errors import BadInput, Unavailable

DEFAULT_LISTEN = "127.0.0.1:9743"
TEXTFILE = "/var/lib/prometheus/node-exporter/vstor.prom"    # Debian's node_exporter reads *.prom there


def register(sub) -> None:
    m = sub.add_parser("metrics", help="per-disk I/O, what vstor holds and counts, drift: "
                                       "for Prometheus")
    msub = m.add_subparsers(dest="metrics_command", metavar="SUBCOMMAND")
    msub.required = True
    p = msub.add_parser("show", help="print one scrape (Prometheus's text format)")
    p.set_defaults(func=cmd_show)
    p = msub.add_parser("serve", help="serve scrapes over HTTP until stopped (vstor-metrics.service)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDRESS:PORT",
                   help=f"where to listen (default {DEFAULT_LISTEN}: this host only)")
    p.set_defaults(func=cmd_serve)
    p = msub.add_parser("textfile", help="write one scrape for node_exporter's textfile collector, "
                                         "whole (vstor-metrics-textfile.timer)")
    p.add_argument("path", metavar="FILE", nargs="?", default=TEXTFILE,
                   help=f"a .prom file (default {TEXTFILE})")
    p.set_defaults(func=cmd_textfile)

    p = sub.add_parser("top", help="per domain and disk, live: operations, bytes and latency per "
                                   "second, the backend and its node")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="between two looks (default 2)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N screens (default: never)")
    p.add_argument("--json", action="store_true", help="one JSON document per screen, one per line")
    p.set_defaults(func=cmd_top)


def looker(ctx):
    """Each call one look at this host (vstor.metrics.collect.look), with
    each running libvirt domain's drift (vstor.runtime.drift) on a libvirt
    connection of the look's own: a long-running endpoint outlives a
    libvirtd restart."""
    from vstor.metrics import collect
    from vstor.pve.node import Node
    state = ctx.state()
    proxmox = Node(ctx.config).is_proxmox()

    said = [""]

    def look():
        rt, conn = ctx.runtime(), []
        try:
            got = collect.look(rt, state, drift=lambda rec: _drift(ctx, rt, conn, rec, proxmox))
        finally:
            for c in conn:
                c.close()
        if got.counts_error and got.counts_error != said[0]:     # once, not at every scrape
            warn(f"{got.counts_error}: the counts are left out")
        said[0] = got.counts_error
        return got
    return look


def _drift(ctx, rt, conn: list, rec, proxmox: bool):
    """The record's differences from its plan; None for a Proxmox VM (its
    threads' pinning is checked by `vstor status`, over QEMU's monitor,
    which a scrape does not ask)."""
    from vstor.formats.pve.vm import vmid_of
    from vstor.runtime import drift, virt
    if proxmox and vmid_of(rec.domain):
        return None
    if not conn:
        conn.append(virt.connect(ctx.uri))
    return drift.find(conn[0], rt, rec)


def cmd_show(ctx, args) -> int:
    from vstor.metrics import expose
    sys.stdout.write(expose.text(looker(ctx)).decode())
    return 0


def cmd_textfile(ctx, args) -> int:
    from vstor.metrics import expose
    if not args.path.endswith(".prom"):
        raise BadInput(f"{args.path}: node_exporter's textfile collector reads only *.prom files",
                       hint="name the file NAME.prom")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.path))):
        raise BadInput(f"{os.path.dirname(os.path.abspath(args.path))} is not a directory",
                       hint="install prometheus-node-exporter, or name the directory its "
                            "--collector.textfile.directory reads")
    try:
        expose.write_textfile(args.path, looker(ctx))
    except OSError as e:
        raise Unavailable(f"cannot write {args.path}: {e.strerror}",
                          hint="its directory must be a directory (never a link) root can write") from None
    return 0


def listen_address(text: str) -> tuple[str, int]:
    """ADDRESS:PORT (IPv6 in brackets) checked before anything binds."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not 0 < number < 65536:
        raise BadInput(f"--listen {text!r} is not ADDRESS:PORT", hint=f"e.g. --listen {DEFAULT_LISTEN}")
    return host, number


def cmd_serve(ctx, args) -> int:
    from vstor.metrics import expose
    host, port = listen_address(args.listen)
    look = looker(ctx)
    look()      # the first look now: a host vstor cannot read refuses before anything listens
    try:
        expose.serve(host, port, look)
    except OSError as e:
        raise BadInput(f"cannot listen on {args.listen}: {e.strerror}",
                       hint="choose another --listen ADDRESS:PORT") from None
    return 0


def cmd_top(ctx, args) -> int:
    from vstor.metrics import top
    if args.interval <= 0 or args.count < 0:
        raise BadInput("--interval must be above 0 and --count 0 or more", hint="e.g. --interval 2")
    look = looker(ctx)
    before = look()
    shown = 0
    while not args.count or shown < args.count:
        time.sleep(args.interval)
        after = look()
        rows = top.rates(before, after)
        if args.json:
            print(json.dumps({"seconds": round(after.at - before.at, 3), "disks": rows,
                              "drift": [list(d) for d in after.drift]}), flush=True)
        else:
            if sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print(f"vstor top: every {args.interval:g}s ({time.strftime('%H:%M:%S')}), "
                  "rates since the last screen")
            print("\n".join(top.table(rows, after.drift)), flush=True)
        before = after
        shown += 1
    return 0
