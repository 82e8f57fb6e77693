"""The Proxmox hookscript's cost, in one run, on a Proxmox tree in a
temporary directory (as tests/test_pve.py builds it):

1. a phase the hookscript does nothing for (post-start), divided by
   `python3 -c pass`: the file imports nothing but sys for it;
2. pre-start + post-stop of a VM with one qemu-storage-daemon disk (real
   daemons; needs root and qemu-storage-daemon), next to the libvirt hook's
   prepare + release of the same disk (bench_hook.py's measure);
3. `vstor pve apply` (plan, render, write the config and the plan record).

    python3 bench/bench_pve.py [--runs N]

Figures go into README.md ("Performance"); nothing here asserts a time.
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
    runs = ap.parse_args().runs
    from tests.test_pve import CONF, Pve
    root = tempfile.mkdtemp(prefix="vstor-bench-pve-", dir="/tmp")
    try:
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
        idle = _median(lambda: subprocess.run(hook + ["post-start"], check=True, env=env), runs)
        starts, stops = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(hook + ["pre-start"], check=True, env=env)
            t1 = time.perf_counter()
            subprocess.run(hook + ["post-stop"], check=True, env=env)
            starts.append(t1 - t0)
            stops.append(time.perf_counter() - t1)
        print(f"hookscript, a phase it ignores (post-start): {idle * 1000:.1f} ms vs python3 -c pass "
              f"{bare * 1000:.1f} ms: ratio {idle / bare:.2f}")
        print(f"pre-start, one qemu-storage-daemon disk: {statistics.median(starts) * 1000:.0f} ms")
        print(f"post-stop of the same: {statistics.median(stops) * 1000:.0f} ms")
        print(f"vstor pve apply: {apply * 1000:.0f} ms")
    finally:
        subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", f"{root}/vstor.conf",
                        "release", "--force", "pve-100"], capture_output=True, cwd=ROOT)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
