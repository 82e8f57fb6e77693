"""bench_scale.py's third part: `vstor plan FILE` with N domains defined in
libvirt's test driver, in the vstor process and through a private libvirtd
(see bench_scale.py's docstring)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench import scale_fill
from bench.bench_scale import run_timed, spread, vstor_env
from bench.sanity import Sanity


def plan_cost(counts: list[int], runs: int, sanity: Sanity) -> None:
    work = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-"))
    os.chmod(work, 0o755)       # the private libvirtd (nobody) reads the node files
    try:
        with contextlib.ExitStack() as stack:
            rpc = (stack.enter_context(scale_fill.private_libvirtd(os.path.join(work, "libvirtd")))
                   if scale_fill.can_run_libvirtd() else None)
            _plan_cost(work, counts, runs, rpc, sanity)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _plan_cost(work: str, counts: list[int], runs: int, rpc, sanity: Sanity) -> None:
    from bench.bench_plan import REQUEST
    from tests.hostlayout import build_tree
    from vstor.config import Config
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    tree = build_tree(scale_fill.plan_host_layout(), os.path.join(work, "host"))
    host = read_host(SysFS(tree))
    cfg = Config(reactors=scale_fill.reactors())
    state = os.path.join(work, "state")
    os.makedirs(state)
    conf = os.path.join(work, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {state}\n\n[cpu]\nreactors = {','.join(map(str, cfg.reactors))}\n")
    request = os.path.join(work, "newvm.xml")
    with open(request, "w") as f:
        f.write(REQUEST.format(ctrl=host.controllers[-1].address))
    # What define takes besides (libvirt wants an <os>): the same request.
    definable = os.path.join(work, "newvm-define.xml")
    with open(definable, "w") as f:
        f.write(REQUEST.format(ctrl=host.controllers[-1].address).replace(
            "</vcpu>", "</vcpu><os><type arch='x86_64' machine='q35'>hvm</type></os>", 1))
    # The driver's process with no domain: its interpreter's and libvirt's start.
    empty = os.path.join(work, "empty.xml")
    scale_fill.node_file(empty, 0, host, cfg)
    base = statistics.median(run_timed(_driver(f"test://{empty}"), check=True)[1] for _ in range(runs))
    print(f"vstor plan FILE (the CLI, a process) on an 8-node host, N domains in libvirt's test driver; "
          f"cpu ms, median (min-max) of {runs}")
    through = (f" {'libvirtd: cold':>16} {'warm':>16} {'warm wall':>16}" if rpc
               else " (no private libvirtd: needs root, libvirtd and setpriv)")
    print(f"{'domains':>8} {'cold':>16} {'warm (plans.json)':>18} {'test driver alone':>18} "
          f"{'warm less the driver':>21}{through}")
    for n in counts:
        node = os.path.join(work, f"node{n}.xml")
        scale_fill.node_file(node, n, host, cfg)

        def define(uri: str) -> None:
            """Untimed: a define reads every domain as plan does and, having
            gone well, keeps what it read in plans.json (plan itself writes
            nothing); the test driver forgets the domain at the next open."""
            argv = [sys.executable, "-m", "vstor.cli.main", "-c", uri, "--config", conf, "--host-root", tree,
                    "define", definable]
            done = subprocess.run(argv, env=vstor_env(), text=True, capture_output=True)
            if done.returncode:
                raise SystemExit(f"vstor define with {n} domains ({uri}) exited {done.returncode}: "
                                 f"{done.stderr.strip()}")

        def plan(uri: str, into: list, walls: list | None = None) -> None:
            argv = [sys.executable, "-m", "vstor.cli.main", "-c", uri, "--config", conf, "--host-root", tree,
                    "plan", "--json", request]
            done, cpu, wall = run_timed(argv, env=vstor_env(), text=True)
            if done.returncode or '"disks"' not in done.stdout:
                raise SystemExit(f"vstor plan with {n} domains ({uri}) exited {done.returncode}: "
                                 f"{done.stderr.strip()}")
            into.append(cpu)
            if walls is not None:
                walls.append(wall)
        cold, warm, alone, rpc_cold, rpc_warm, rpc_wall = [], [], [], [], [], []
        for _ in range(runs):
            for uri, pair in ((f"test://{node}", (cold, warm)),
                              *(((rpc(node), (rpc_cold, rpc_warm)),) if rpc else ())):
                for path in glob.glob(os.path.join(state, "plans.json*")):
                    os.unlink(path)
                plan(uri, pair[0])
                if os.path.exists(os.path.join(state, "plans.json")):
                    sanity.problem(f"vstor plan with {n} domains defined ({uri}) wrote plans.json")
                define(uri)
                cached = _cached(os.path.join(state, "plans.json"))
                if cached != n:     # what it read of libvirt: every domain
                    sanity.problem(f"vstor define with {n} domains defined ({uri}) cached {cached} holdings")
                plan(uri, pair[1], rpc_wall if pair[1] is rpc_warm else None)
            alone.append(run_timed(_driver(f"test://{node}"), check=True)[1])
        sanity.figure(f"plan cold, {n} domains", statistics.median(cold))
        sanity.figure(f"plan warm, {n} domains", statistics.median(warm))
        # What is vstor's: the process less the driver's parsing and listing of the N domains
        # (libvirtd's work on a host, in this process with the test driver).
        own = statistics.median(warm) - (statistics.median(alone) - base)
        line = f"{n:>8} {spread(cold):>16} {spread(warm):>18} {spread(alone):>18} {own * 1000:>21.0f}"
        if rpc:
            sanity.figure(f"plan cold via libvirtd, {n} domains", statistics.median(rpc_cold))
            sanity.figure(f"plan warm via libvirtd, {n} domains", statistics.median(rpc_warm))
            line += f" {spread(rpc_cold):>16} {spread(rpc_warm):>16} {spread(rpc_wall):>16}"
        print(line)
        os.unlink(node)


def _driver(uri: str) -> list[str]:
    """A process that opens the test driver at `uri` and reads every
    domain's definition, as vstor plan has libvirt do, and nothing else."""
    return [sys.executable, "-c", "import libvirt, sys; c = libvirt.open(sys.argv[1]); "
            "[d.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) for d in c.listAllDomains(0)]", uri]


def _cached(path: str) -> int:
    import json
    try:
        with open(path) as f:
            return len(json.load(f))
    except FileNotFoundError:
        return 0
