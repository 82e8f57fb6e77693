"""A boot storm, timed: a host restarting with many vstor domains set to
autostart.  Every domain's `prepare begin` runs at once through the
installed hook (as `vstor hooks install` writes it, executed as libvirt
executes it: the domain XML on stdin, a scrubbed environment), each domain
with its qemu-storage-daemon file disks (real daemons); then every
`release end` at once.  Against a yardstick that starts and stops the same
daemons with the same concurrency and no checks: one minimal script per
domain, started all at once.

    python3 bench/bench_storm.py [--domains 32] [--disks 2] [--runs N] [--one-by-one] [--quick]

The domains are planned on a synthetic two-node host big enough for each
to have dedicated cores (bench/storm.py); the daemons run here, unpinned.
Every timed storm is checked, untimed (bench/storm_check.py): every hook
exited 0, each disk served by one daemon on its own socket and file, no
core, socket or volume held twice, and nothing left after release.  Each run
times vstor's storm and the yardstick's back to back (in alternating order):
the ratio of each pair is reported, median and range.  `--one-by-one` then
times the same prepares and releases one domain after the other (the same
work without the concurrency).  `--quick` runs a
small storm once and checks the bench's own sanity (bench/sanity.py);
tests/test_bench.py runs it so.  Needs root and qemu-storage-daemon.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench import storm_check as check  # noqa: E402
from bench.sanity import YARDSTICK_START, Sanity  # noqa: E402
from bench.storm import Run, World, aio_room, daemons_under  # noqa: E402

YARDSTICK = """#!{python} -S
# The yardstick for one domain: start its daemons at prepare, as vstor's
# command lines have them (the source opened and the sockets listening,
# handed over as descriptors; confined, the pidfile made for its uid), and
# stop them at release; nothing checked, no ACL (the images are open to all).
import os, signal, sys, time
sys.stdin.buffer.read()
DAEMONS = {daemons!r}     # (argv, pidfile, source, socket, uid)
{start}
if sys.argv[2] == "prepare":
    for daemon in DAEMONS:
        proc, keep = start(*daemon)
        if proc.wait():
            sys.exit(1)
        for held in keep:
            held.close() if hasattr(held, "close") else os.close(held)
elif sys.argv[2] == "release":
    pids = [int(open(p).read()) for _, p, _, _, _ in DAEMONS]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:     # gone, or a zombie its new parent has not reaped yet
        while True:
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.002)
    for _, pidfile, _, path, _ in DAEMONS:     # what a confined qsd cannot remove itself
        for left in (path, pidfile, pidfile[:-4] + ".qmp"):
            if os.path.exists(left):
                os.unlink(left)
"""


class Yardstick:
    """One yardstick script per domain of `world`, on the daemons vstor
    starts for it (its plan's steps; unpinned, as vstor runs them on the
    synthetic host), with sockets, monitors and pid files of its own."""

    def __init__(self, world: World):
        from vstor import records
        from vstor.backends.qsd.daemon import _resolved
        from vstor.host import sources
        from vstor.runtime.actions import build
        self.world = world
        self.dir = os.path.join(world.work, "yard")
        os.mkdir(self.dir)
        self.scripts = {}
        uid = world.cfg.daemon_users[1]
        for name in world.names:
            daemons = []
            for step in build(world.plans[name], world.cfg):
                export = records.replace(step.export, run_dir=self.dir, cpus=(),
                                         socket_path=os.path.join(self.dir, step.export.name + ".sock"))
                with sources.open_file(export.source, world.cfg.images) as src:
                    spec = _resolved(export, src)
                prefix = spec.jail(uid, world.cfg.images) if spec.users else []
                daemons.append((prefix + spec.argv("SRC_FD", "SOCK_FD", "QMP_FD"), spec.pidfile,
                                spec.source, spec.socket_path, uid))
                uid -= 1
            path = os.path.join(self.dir, name)
            with open(path, "w") as f:
                f.write(YARDSTICK.format(python=sys.executable, daemons=daemons,
                                         start=YARDSTICK_START))
            os.chmod(path, 0o755)
            self.scripts[name] = path

    def storm(self, op: str) -> tuple[float, list]:
        sub = "begin" if op == "prepare" else "end"
        t0 = time.perf_counter()
        runs = [Run(n, op, self.scripts[n], [n, op, sub, "-"], self.world.xml[n], self.world.env())
                for n in self.world.names]
        for r in runs:
            r.wait()
        return time.perf_counter() - t0, runs


def _cpu() -> float:
    """CPU time of the children waited for (the hooks, and the parents of
    the daemons they started; not the daemons, which detach)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def one_run(world: World, yard: Yardstick, vstor_first: bool, say) -> dict[str, float]:
    """vstor's storm and the yardstick's, back to back; each checked untimed.
    Wall times, and the CPU time of each storm's processes ("... cpu")."""
    took = {}
    everyone = world.names
    for who in (("vstor", "yardstick") if vstor_first else ("yardstick", "vstor")):
        for op in ("prepare", "release"):
            _wait_for_room(len(everyone) * world.disks if op == "prepare" else 0)
            cpu = _cpu()
            if who == "vstor":
                took[f"vstor {op}"], runs = world.storm([(n, op) for n in everyone])
            else:
                took[f"yardstick {op}"], runs = yard.storm(op)
            took[f"{who} {op} cpu"] = _cpu() - cpu
            problems = [f"{r!r}" for r in runs if r.rc != 0]
            if who == "vstor":
                problems += check.prepared(world, everyone) if op == "prepare" else check.released(world)
            else:
                running = len(daemons_under(yard.dir))
                want = len(everyone) * world.disks if op == "prepare" else 0
                problems += [] if running == want else [f"the yardstick left {running} daemons, not {want}"]
            for p in problems:
                say(f"{who} {op}: {p}")
    return took


def _wait_for_room(daemons: int, patience: float = 120) -> None:
    """Until the host's AIO budget (fs.aio-max-nr, shared with every other
    process) has room for `daemons` more with aio=native: past it, every
    further one fails to start, the yardstick's as vstor's (tests/test_storm.py)."""
    deadline = time.monotonic() + patience
    while aio_room() < daemons:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_storm: the host's AIO budget (fs.aio-max-nr, less what runs "
                             f"now) leaves room for {aio_room()} qemu-storage-daemons with "
                             f"aio=native, the storm needs {daemons}: raise fs.aio-max-nr, or "
                             "fewer --domains")
        time.sleep(1)


def one_by_one(world: World, say) -> None:
    """The same prepares, then releases, one domain after the other (what
    the storm is to be compared with: the same work without concurrency)."""
    for op in ("prepare", "release"):
        _wait_for_room(len(world.names) * world.disks if op == "prepare" else 0)
        took = 0.0
        for name in world.names:
            t, runs = world.storm([(name, op)])
            took += t
            for r in runs:
                if r.rc != 0:
                    say(f"one by one, {r!r}")
        problems = check.prepared(world, world.names) if op == "prepare" else check.released(world)
        for p in problems:
            say(f"one by one, {op}: {p}")
        print(f"  one domain after the other: {op} {took:.2f} s ({took / len(world.names) * 1000:.0f} ms each)")


def bench(domains: int, disks: int, runs: int, sanity: Sanity, serial: bool = False) -> None:
    _wait_for_room(domains * disks)
    world = World(domains, disks)
    sanity.watch(world.work)
    problems: list[str] = []
    try:
        world.plan()
        yard = Yardstick(world)
        load = os.getloadavg()[0]
        samples = [one_run(world, yard, i % 2 == 0, problems.append) for i in range(runs)]
        if problems:
            raise SystemExit("bench_storm: the storm did not hold: " + "; ".join(problems[:5]))
        report(domains, disks, samples, (load, os.getloadavg()[0]), sanity)
        if serial:
            one_by_one(world, problems.append)
            if problems:
                raise SystemExit("bench_storm: one by one, it did not hold: " + "; ".join(problems[:5]))
    finally:
        for what in world.cleanup():
            sanity.problem(f"cleanup: {what}")


def report(domains: int, disks: int, samples: list[dict], load, sanity: Sanity) -> None:
    def med(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    def ratio(ops: tuple[str, ...]) -> str:
        """The median of each run's ratio (vstor's storm to the yardstick's
        right beside it), and their range."""
        r = sorted(sum(s[f"vstor {op}"] for op in ops) / sum(s[f"yardstick {op}"] for op in ops)
                   for s in samples)
        spread = f", range {r[0]:.2f}-{r[-1]:.2f}" if len(r) > 1 else ""
        return f"{statistics.median(r):.2f}{spread}"

    print(f"boot storm, {domains} domains x {disks} qemu-storage-daemon disks ({domains * disks} "
          f"daemons), all at once through the installed hook; median of {len(samples)} runs, "
          f"load average {load[0]:.1f} before, {load[1]:.1f} after:")
    for who in ("vstor", "yardstick"):
        for op in ("prepare", "release"):
            sanity.figure(f"{who} {op}", med(f"{who} {op}"))
    for label, ops in (("prepare storm", ("prepare",)), ("release storm", ("release",)),
                       ("both", ("prepare", "release"))):
        ours, theirs = (sum(med(f"{who} {op}") for op in ops) for who in ("vstor", "yardstick"))
        print(f"  {label}: {ours:.2f} s vs yardstick {theirs:.2f} s: ratio {ratio(ops)}")
    cpu = {f"{who} {op}": med(f"{who} {op} cpu") / domains * 1000
           for who in ("vstor", "yardstick") for op in ("prepare", "release")}
    print(f"  cpu per domain (the hook's processes, not the daemons): prepare "
          f"{cpu['vstor prepare']:.0f} ms vs {cpu['yardstick prepare']:.0f} ms, release "
          f"{cpu['vstor release']:.0f} ms vs {cpu['yardstick release']:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domains", type=int, default=32)
    ap.add_argument("--disks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--one-by-one", action="store_true",
                    help="then also time the same prepares and releases one domain after the other")
    ap.add_argument("--quick", action="store_true",
                    help="a small storm once; check the bench's own sanity (needs root)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_storm: needs root (real qemu-storage-daemons)")
    if not 1 <= args.disks <= 16 or args.domains < 1 or args.runs < 1:
        sys.exit("bench_storm: --domains and --runs at least 1, --disks 1 to 16")
    sanity = Sanity(args.quick)
    # Byte-code written first, as pip's install does: with PYTHONDONTWRITEBYTECODE
    # set, every hook would compile vstor anew.
    import compileall
    compileall.compile_dir(os.path.join(ROOT, "vstor"), quiet=1)
    if args.quick:
        bench(4, 2, 1, sanity)
    else:
        bench(args.domains, args.disks, args.runs, sanity, args.one_by_one)
    sanity.finish(expected=4)


if __name__ == "__main__":
    main()
