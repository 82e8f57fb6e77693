"""What one scrape of vstor's metrics costs, on a host with many disks.

    python3 bench/bench_metrics.py [--domains 32] [--disks 2] [--runs 20] [--quick]

32 domains of 2 file disks each are prepared through the installed hook
(bench/storm.py: real qemu-storage-daemons, 64 by default), then each run
times, in this process's CPU time, one whole scrape as `vstor metrics
serve` makes it (every record read, each daemon found and its /proc
accounting read, the event totals folded, the exposition written by
prometheus_client), against a yardstick: the same daemons' /proc/PID/io
and /proc/PID/stat read by a bare loop over pids already known, the least
any per-daemon collector must do.  Reported: the median CPU time of each
and their ratio, and what one event costs a hook (vstor.counters.add).
`--quick`: 2 domains of 1 disk, 3 runs, and the bench's sanity
(bench/sanity.py).  Needs root and qemu-storage-daemon.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench.sanity import Sanity  # noqa: E402
from bench.storm import World, aio_room, daemons_under  # noqa: E402


def scrape(world: World) -> bytes:
    from vstor.host.sysfs import SysFS
    from vstor.metrics import collect, expose
    from vstor.runtime.executor import Runtime
    from vstor.runtime.state import StateDir
    rt, state = Runtime(world.cfg, SysFS(world.root)), StateDir(world.cfg.state_dir)
    return expose.text(lambda: collect.look(rt, state))


def yardstick(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/io") as f:
            total += len(f.read())
        with open(f"/proc/{pid}/stat") as f:
            total += len(f.read())
    return total


def cpu(fn, *args) -> float:
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domains", type=int, default=32)
    ap.add_argument("--disks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.domains, args.disks, args.runs = 2, 1, 3
    sanity = Sanity(args.quick)
    if aio_room() < args.domains * args.disks:
        print("not enough AIO room (fs.aio-max-nr) for the daemons", file=sys.stderr)
        return 1
    world = World(args.domains, args.disks).plan()
    sanity.watch(world.work)
    try:
        _, runs = world.storm([(n, "prepare") for n in world.names])
        failed = [r for r in runs if r.rc]
        if failed:
            sanity.problem(f"{len(failed)} prepares failed: {failed[0]!r}")
            raise SystemExit(1)
        pids = [pid for pid, _ in daemons_under(world.work)]
        text = scrape(world).decode()
        disks = sum(1 for line in text.splitlines() if line.startswith("vstor_disk_written_bytes_total{"))
        if disks != args.domains * args.disks:
            sanity.problem(f"the scrape has {disks} disks' figures, {args.domains * args.disks} expected")
        ours, floor = [], []
        for _ in range(args.runs):
            ours.append(cpu(scrape, world))
            floor.append(cpu(yardstick, pids))
        from vstor import counters
        counters.at(world.cfg.state_dir)
        event = statistics.median(cpu(counters.add, "gc", ()) for _ in range(200))
        counters.at(None)
        a, b = statistics.median(ours), statistics.median(floor)
        print(f"{disks} disks of {args.domains} domains, {args.runs} runs (CPU time, median)")
        print(f"  one scrape:        {sanity.figure('scrape', a) * 1000:8.2f} ms")
        print(f"  yardstick:         {sanity.figure('yardstick', b) * 1000:8.2f} ms "
              "(each daemon's /proc io and stat, pids known)")
        print(f"  ratio:             {a / b:8.1f}")
        print(f"  one hook's event:  {sanity.figure('event', event) * 1e6:8.1f} us (vstor.counters.add)")
    finally:
        for r in world.storm([(n, "release") for n in world.names])[1]:
            if r.rc:
                sanity.problem(f"release failed: {r!r}")
        for problem in world.cleanup():
            sanity.problem(problem)
    sanity.finish(expected=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
