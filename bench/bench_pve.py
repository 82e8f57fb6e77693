"""The Proxmox hookscript's cost, in one run, on a Proxmox tree in a
temporary directory (as tests/test_pve.py builds it):

1. a phase the hookscript does nothing for (pre-stop), divided by
   `python3 -c pass`: the file imports nothing but sys for it;
2. pre-start + post-stop of a VM with one qemu-storage-daemon disk (real
   daemons; needs root and qemu-storage-daemon), next to the libvirt hook's
   prepare + release of the same disk (bench_hook.py's measure);
3. `vstor pve apply` (plan, render, write the config and the plan record).

    python3 bench/bench_pve.py [--runs N] [--quick]

Figures go into docs/performance.md; nothing here asserts a time.  `--quick`
runs each case once and checks the bench's own sanity (bench/sanity.py):
tests/test_bench.py runs it so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench.sanity import Sanity, holders  # noqa: E402


def _median(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="each case once; check the bench's own sanity")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_pve: needs root (pre-start starts a real qemu-storage-daemon)")
    sanity = Sanity(args.quick)
    root = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-pve-", dir="/tmp"))
    try:
        measure(root, 1 if args.quick else args.runs, sanity)
    finally:
        subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", f"{root}/vstor.conf",
                        "release", "--force", "pve-100"], capture_output=True, cwd=ROOT)
        shutil.rmtree(root, ignore_errors=True)
    sanity.finish(expected=5)


def measure(root: str, runs: int, sanity: Sanity) -> None:
    from tests.test_pve import CONF, Pve
    pve = Pve(root)
    pve.vm(CONF)
    pve.intent(pve.file_disk())
    vstor = [sys.executable, "-m", "vstor.cli.main", "--config", pve.conf]
    apply = _median(lambda: subprocess.run(vstor + ["pve", "apply", "100"],
                                           check=True, stdout=subprocess.DEVNULL, cwd=ROOT), runs)
    subprocess.run(vstor + ["pve", "hooks", "install"], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    text = pve.config().replace("boot:", "hookscript: local:snippets/vstor\nboot:", 1)
    pve.vm(text)
    hook = [f"{pve.snippets}/vstor", "100"]
    env = {**os.environ, "PVE_MIGRATED_FROM": ""}
    bare = _median(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), runs)
    idle = _median(lambda: subprocess.run(hook + ["pre-stop"], check=True, env=env), runs)
    starts, stops = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(hook + ["pre-start"], check=True, env=env)
        starts.append(time.perf_counter() - t0)
        # Not timed: what pre-start was timed for happened (a daemon serves
        # the VM's disk), and post-stop undid it.
        if not holders([f"{root}/d0.raw"]):
            sanity.problem("pre-start exited 0 but no process holds the VM's disk")
        t1 = time.perf_counter()
        subprocess.run(hook + ["post-stop"], check=True, env=env)
        stops.append(time.perf_counter() - t1)
        if holders([f"{root}/d0.raw"]):
            sanity.problem("a process still holds the VM's disk after post-stop")
    start, stop = statistics.median(starts), statistics.median(stops)
    for label, value in (("pre-stop", idle), ("python3 -c pass", bare), ("pre-start", start),
                         ("post-stop", stop), ("pve apply", apply)):
        sanity.figure(label, value)
    print(f"hookscript, a phase it ignores (pre-stop): {idle * 1000:.1f} ms vs python3 -c pass "
          f"{bare * 1000:.1f} ms: ratio {idle / bare:.2f}")
    print(f"pre-start, one qemu-storage-daemon disk: {start * 1000:.0f} ms")
    print(f"post-stop of the same: {stop * 1000:.0f} ms")
    print(f"vstor pve apply: {apply * 1000:.0f} ms")


if __name__ == "__main__":
    main()
