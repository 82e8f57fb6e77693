"""The runtime at host scale: a start, gc and `vstor plan` as the host's
records and domains grow (issue 23's figures).

1. per start: `prepare begin` + `release end` of a domain with four
   qemu-storage-daemon file disks through the installed hook (as libvirt
   runs it; bench_hook.py's domain and hook), with N other domains' records
   in the state directory (bench/scale_fill.py), in interleaved pairs with
   the same cycle on a state directory of its own records only: the hook
   processes' CPU time (getrusage of the children; the daemons are
   daemonized, so theirs is never counted: checked), wall time, and the
   median of the pairs' CPU ratios (targets: 1.1 at 500, 1.3 at 2000).
   Then the one-time rebuild: the first cycle after the index was removed
   (records written straight into <state_dir>/domains, as after an
   upgrade).  `--via cli`: the same cycle through the CLI instead, `vstor
   prepare FILE` (the rendered domain) and `vstor release NAME` (on
   test:///default, where the domain is not defined: libvirt says it does
   not run);
2. `vstor gc` (the CLI, a process, on a connection where no filler runs:
   test:///default) of N stale records: its CPU time (target: 2000 under
   2 s); afterwards no record is left, only the index and the locks;
3. the ledger of N records, what a start reads of them (bench/scale_ledger.py):
   the plain way (every record file's JSON, its holding made a Holding,
   the planner's Ledger over them) against the index's;
4. `vstor plan FILE` with N domains defined in libvirt's test driver (a
   node file, test:///PATH) on an 8-node host's sysfs tree (--host-root):
   the CPU time of the process, with plans.json cold and warm (target: 2000
   under 1 s), and of the test driver itself (libvirt parsing its node file
   and listing the domains: in the vstor process here, in libvirtd's on a
   host); then the same through a private libvirtd (as nobody, in session
   mode, its sockets under the bench's directory) serving that node file:
   the domains reach vstor over libvirt's RPC, as on a host (bench/scale_plan.py).

    python3 bench/bench_scale.py [--runs R] [--counts 0,500,2000,5000]
        [--gc-counts 500,2000,5000] [--gc-runs 3] [--plan-counts 0,500,2000]
        [--only start,gc,ledger,plan] [--via hook,cli] [--quick]

Needs root (1 to 3) and qemu-storage-daemon (1 and 2).  Figures go into
docs/performance.md ("Host scale"); nothing here asserts a time.  `--quick`
runs a small version once and checks the bench's own sanity
(bench/sanity.py); tests/test_bench.py runs it so.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench.bench_hook import FOUR_DISKS, _disks, _serving, installed_hook  # noqa: E402
from bench.sanity import NO_SUPERVISOR, Sanity  # noqa: E402
from bench import scale_fill  # noqa: E402

OPS = (["prepare", "begin", "-"], ["release", "end", "-"])


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_timed(argv: list[str], **kw) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the finished process, its CPU seconds with its children's, wall seconds)."""
    c0, t0 = cpu_of_children(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, **kw)
    return done, cpu_of_children() - c0, time.perf_counter() - t0


def spread(xs: list[float], scale: float = 1000.0, fmt: str = "{:.0f}") -> str:
    """'median (min-max)' of xs times scale."""
    m = statistics.median(xs)
    return f"{fmt.format(m * scale)} ({fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)})"


def vstor_env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT}


# -- 1. per start ------------------------------------------------------------------------

class Site:
    """The measured domain on two state directories: `alone` (its own
    records only) and `full` (the fillers' too); images under `work` (where
    O_DIRECT works), state, sockets and pidfiles under `run` (a tmpfs, as
    /run/vstor is on a host)."""

    def __init__(self, work: str, run: str):
        from vstor.config import Config
        self.work, self.run = work, run
        os.chmod(work, 0o755)
        os.chmod(run, 0o755)
        self.cfgs = {which: Config(state_dir=f"{run}/{which}", vhost_dir=f"{run}/vhost",
                                   qsd_dir=f"{run}/qsd", images=(work,)) for which in ("alone", "full")}
        self.hooks = {}
        for which, cfg in self.cfgs.items():
            os.makedirs(f"{run}/{which}-hook")
            conf = f"{run}/{which}-hook/vstor.conf"
            with open(conf, "w") as f:
                f.write(f"[paths]\nstate_dir = {cfg.state_dir}\nvhost_dir = {cfg.vhost_dir}\n"
                        f"qsd_dir = {cfg.qsd_dir}\nimages = {work}\n{NO_SUPERVISOR}")
            self.hooks[which] = installed_hook(f"{run}/{which}-hook", conf)
        self.dom = self._domain()
        self.xml = self.dom.to_string().encode()
        self.file = f"{run}/{self.dom.name}.xml"        # for the CLI's prepare FILE
        with open(self.file, "wb") as f:
            f.write(self.xml)
        self.filled = 0
        self.daemon_cpu: list[float] = []       # each daemon's own, at the end of a prepare

    def _domain(self):
        """bench_hook's four-disk domain, planned for this host."""
        from vstor.host.read import read_host
        from vstor.host.sysfs import SysFS
        from vstor.meta.document import Domain
        from vstor.planner import Request, plan_domain
        from vstor.planner.ledger import Ledger
        from vstor.render.libvirt import render
        disks = ""
        for path, t in zip(_disks(self.work), "bcde"):
            with open(path, "wb") as f:
                f.truncate(64 << 20)
            disks += f"<vstor:disk target='vd{t}'><vstor:file path='{path}'/></vstor:disk>"
        dom = Domain.parse(FOUR_DISKS.format(disks=disks))
        cfg = self.cfgs["alone"]
        return render(dom, plan_domain(read_host(SysFS("/")), cfg, Request.from_domain(dom), Ledger()))

    def fill_to(self, count: int) -> float:
        """Filler records up to `count` in the full state directory; seconds taken."""
        from vstor.runtime.state import StateDir
        t0 = time.perf_counter()
        scale_fill.fill(StateDir(self.cfgs["full"].state_dir), self.cfgs["full"], self.work,
                        self.filled, count)
        self.filled = max(self.filled, count)
        return time.perf_counter() - t0

    def command(self, which: str, op: list[str], via: str) -> tuple[list[str], bytes | None]:
        """The argv (and stdin) of one half of a cycle: the hook's, or the CLI's."""
        if via == "hook":
            return [self.hooks[which], self.dom.name, *op], self.xml
        cli = [sys.executable, "-m", "vstor.cli.main", "-c", "test:///default",
               "--config", f"{self.run}/{which}-hook/vstor.conf"]
        return cli + (["prepare", self.file] if op[0] == "prepare" else ["release", self.dom.name]), None

    def cycle(self, which: str, sanity: Sanity, via: str = "hook") -> tuple[float, float, float]:
        """prepare + release through the hook (or the CLI): (CPU s, wall s,
        CPU s of prepare alone)."""
        cpu = wall = 0.0
        prep = 0.0
        for op in OPS:
            argv, stdin = self.command(which, op, via)
            done, c, w = run_timed(argv, input=stdin, env=vstor_env() if via == "cli" else None)
            if done.returncode:
                raise SystemExit(f"{via} {op[0]} ({which}): {done.stderr.decode().strip()}")
            cpu, wall = cpu + c, wall + w
            if op[0] == "prepare":
                prep = c
                self._daemons_apart(sanity)
            _serving(sanity, _disks(self.work), f"{via} {op[0]} ({which})", 4 if op[0] == "prepare" else 0)
        return cpu, wall, prep

    def _daemons_apart(self, sanity: Sanity) -> None:
        """Untimed: the domain's daemons are no descendants of this process,
        so their CPU time never reaches RUSAGE_CHILDREN."""
        pids = []
        for pidfile in glob.glob(os.path.join(self.run, "qsd", "*.pid")):
            with open(pidfile) as f:
                pids.append(int(f.read()))
        if len(pids) != 4:
            sanity.problem(f"after prepare, {len(pids)} daemon pidfiles, not 4")
        for pid in pids:
            ns = 0      # on-CPU time of each of its threads (schedstat: finer than stat's ticks)
            for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
                with open(task) as f:
                    ns += int(f.read().split()[0])
            self.daemon_cpu.append(ns / 1e9)
            ppid = pid
            while ppid > 1:
                with open(f"/proc/{ppid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid == os.getpid():
                    sanity.problem(f"daemon {pid} is a descendant of the bench: its CPU would be counted")
                    return

    def release_all(self) -> None:
        """Leave nothing behind, also after a failure half-way."""
        from vstor.host.sysfs import SysFS
        from vstor.runtime.executor import Runtime
        from vstor.runtime.recorded import release
        from vstor.runtime.state import StateDir
        for cfg in self.cfgs.values():
            try:
                release(Runtime(cfg, SysFS("/")), StateDir(cfg.state_dir), self.dom.safe_name)
            except Exception as e:  # noqa: BLE001 (report it, go on cleaning)
                print(f"release during cleanup: {e}", file=sys.stderr)


def start_cost(site: Site, counts: list[int], runs: int, snapshots: dict, sanity: Sanity,
               via: str = "hook") -> None:
    print(f"per start: prepare + release of 4 qsd disks through the {via}, {runs} interleaved "
          "pairs (N records vs the domain's own only); ms, median (min-max)")
    print(f"{'records':>8} {'fill s':>7} {'cpu, N records':>16} {'cpu, own only':>16} {'wall, N':>14} "
          f"{'cpu ratio':>18} {'rebuild, prepare cpu':>22}")
    for n in counts:
        fill_s = site.fill_to(n)
        if n in snapshots:
            shutil.copytree(site.cfgs["full"].state_dir, snapshots[n], symlinks=True)
        full, alone, ratios = [], [], []
        for i in range(runs):
            order = ("alone", "full") if i % 2 == 0 else ("full", "alone")
            got = {which: site.cycle(which, sanity, via) for which in order}
            full.append(got["full"])
            alone.append(got["alone"])
            ratios.append(got["full"][0] / got["alone"][0])
        cpu_full = [c for c, _, _ in full]
        sanity.figure(f"cpu, {n} records, {via}", statistics.median(cpu_full))
        sanity.figure(f"wall, {n} records, {via}", statistics.median(w for _, w, _ in full))
        sanity.figure(f"ratio, {n} records, {via}", statistics.median(ratios))
        rebuild = ""
        if n and via == "hook":
            rebuild = rebuild_cost(site, max(1, min(3, runs)), [p for _, _, p in full], sanity, n)
        print(f"{n:>8} {fill_s:>7.1f} {spread(cpu_full):>16} {spread([c for c, _, _ in alone]):>16} "
              f"{spread([w for _, w, _ in full]):>14} {spread(ratios, 1, '{:.3f}'):>18} {rebuild:>22}")
    own = spread(site.daemon_cpu, fmt="{:.1f}")
    print(f"(each daemon's own CPU by the end of a prepare, not counted above: {own} ms; "
          "the daemons are no descendants of the bench: checked)")


def rebuild_cost(site: Site, times: int, prepares: list[float], sanity: Sanity, n: int) -> str:
    """The first prepare after the index is gone (the records written
    straight into domains/, as after an upgrade from a vstor without it):
    its CPU beside the usual prepare's."""
    index = os.path.join(site.cfgs["full"].state_dir, "index")
    took = []
    for _ in range(times):
        shutil.rmtree(index)
        took.append(site.cycle("full", sanity)[2])
        if not os.path.isdir(index):
            sanity.problem("the index was not rebuilt by the first start")
    sanity.figure(f"rebuild, {n} records", statistics.median(took))
    return f"{spread(took)} vs {statistics.median(prepares) * 1000:.0f}"


# -- 2. gc -------------------------------------------------------------------------------

def gc_cost(site: Site, snapshots: dict, runs: int, sanity: Sanity) -> None:
    print(f"vstor gc (the CLI, test:///default: no filler runs) of N stale records, each run on a "
          f"copy of the state directory; s, median (min-max) of {runs}")
    print(f"{'records':>8} {'cpu s':>18} {'wall s':>18}  left in the state directory")
    cfg = site.cfgs["full"]
    for n, snapshot in sorted(snapshots.items()):
        state_dir = f"{snapshot}-run"
        conf = os.path.join(site.run, f"gc{n}.conf")
        with open(conf, "w") as f:
            f.write(f"[paths]\nstate_dir = {state_dir}\nvhost_dir = {cfg.vhost_dir}\n"
                    f"qsd_dir = {cfg.qsd_dir}\nimages = {site.work}\n{NO_SUPERVISOR}")
        cpus, walls, left = [], [], []
        for _ in range(runs):
            shutil.copytree(snapshot, state_dir, symlinks=True)
            done, cpu, wall = run_timed([sys.executable, "-m", "vstor.cli.main", "-c", "test:///default",
                                         "--config", conf, "gc"], env=vstor_env(), text=True)
            if done.returncode:
                raise SystemExit(f"vstor gc of {n} records exited {done.returncode}: {done.stderr.strip()}")
            released = done.stdout.count("Releasing fill")
            if released != n:
                sanity.problem(f"gc of {n} records released {released}")
            left += gc_leftovers(state_dir, cfg)
            cpus.append(cpu)
            walls.append(wall)
            shutil.rmtree(state_dir)
        if left:
            sanity.problem(f"after gc of {n} records: {', '.join(left[:3])}")
        sanity.figure(f"gc, {n} records", statistics.median(cpus))
        print(f"{n:>8} {spread(cpus, 1, '{:.2f}'):>18} {spread(walls, 1, '{:.2f}'):>18}  "
              f"{left[:3] if left else 'nothing but the index and locks'}")
        shutil.rmtree(snapshot)


def gc_leftovers(state_dir: str, cfg) -> list[str]:
    """What gc should have removed and did not: records, index entries,
    the fillers' files in the socket and daemon directories."""
    left = [f"{state_dir}/{n}" for n in os.listdir(state_dir)
            if n not in ("index", "lock", "plan.lock", "domains", "metrics")]   # metrics: what gc counted
    left += glob.glob(f"{state_dir}/domains/*")
    left += glob.glob(f"{state_dir}/index/keys/*") + glob.glob(f"{state_dir}/index/by/*/*")
    left += [p for d in (cfg.vhost_dir, cfg.qsd_dir) for p in glob.glob(f"{d}/fill*")]
    return left


def _tmpfs() -> str:
    """/run where it is a tmpfs (on a host it is), else /dev/shm."""
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4]: line.split(" - ")[1].split()[0] for line in f}
    return "/run" if mounts.get("/run") == "tmpfs" else "/dev/shm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--runs", type=int, default=10, help="cycles (pairs) and plan runs per count")
    ap.add_argument("--counts", type=ints, default=[0, 500, 2000, 5000], help="records, per start")
    ap.add_argument("--gc-counts", type=ints, default=[500, 2000, 5000], help="records, gc")
    ap.add_argument("--gc-runs", type=int, default=3, help="gc runs per count")
    ap.add_argument("--plan-counts", type=ints, default=[0, 500, 2000], help="libvirt domains, plan")
    ap.add_argument("--only", type=lambda s: s.split(","), default=["start", "gc", "ledger", "plan"])
    ap.add_argument("--via", type=lambda s: s.split(","), default=["hook"],
                    help="per start: through the hook, the CLI, or both (hook,cli)")
    ap.add_argument("--quick", action="store_true", help="a small version once; check the bench's own sanity")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.gc_runs, args.counts, args.gc_counts, args.plan_counts = 1, 1, [0, 20], [20], [0, 20]
        args.via = ["hook", "cli"]
    if os.geteuid() != 0 and {"start", "gc", "ledger"} & set(args.only):
        sys.exit("bench_scale: needs root (real qemu-storage-daemons, a root-owned state directory); "
                 "--only plan does not")
    sanity = Sanity(args.quick)
    import compileall       # byte-code written first, as pip's install does (bench_hook.py)
    compileall.compile_dir(os.path.join(ROOT, "vstor"), quiet=1)
    expected = 0
    if {"start", "gc"} & set(args.only):
        counts = sorted(set(args.counts) | set(args.gc_counts)) if "gc" in args.only else args.counts
        if "start" in args.only:
            expected += 3 * len(counts) * len(args.via) + len([n for n in counts if n]) * ("hook" in args.via)
        expected += len(args.gc_counts) if "gc" in args.only else 0
        work = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir="/var/tmp"))
        run = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir=_tmpfs()))
        site = None
        try:
            site = Site(work, run)
            snapshots = {n: f"{run}/gc{n}" for n in args.gc_counts} if "gc" in args.only else {}
            if "start" in args.only:
                for via in args.via:
                    start_cost(site, counts, args.runs, snapshots if via == args.via[0] else {}, sanity, via)
            else:
                for n in sorted(snapshots):
                    site.fill_to(n)
                    shutil.copytree(site.cfgs["full"].state_dir, snapshots[n], symlinks=True)
            if snapshots:
                gc_cost(site, snapshots, args.gc_runs, sanity)
        finally:
            if site is not None:
                site.release_all()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)
    if "ledger" in args.only:
        expected += 2 * len(args.counts)
        from bench.scale_ledger import ledger_cost
        ledger_cost(args.counts, max(3, args.runs), sanity)
    if "plan" in args.only:
        expected += (4 if scale_fill.can_run_libvirtd() else 2) * len(args.plan_counts)
        from bench.scale_plan import plan_cost
        plan_cost(args.plan_counts, args.runs, sanity)
    sanity.finish(expected)


if __name__ == "__main__":
    main()
