"""Where `vstor gc`'s time goes: gc in-process on N stale filler records
(bench/scale_fill.py), with the CPU time (time.process_time: every thread
of the process) of each call of the functions it spends its time in added
up, inclusive; no profiler, so nothing is inflated.  The figures in
docs/performance.md ("Host scale") come from it.

    python3 bench/scale_profile.py [N]      (root; default N = 2000)
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from bench.sanity import NO_SUPERVISOR  # noqa: E402

# (module, class or None, function): what gc calls, outermost first.
TIMED = [("vstor.runtime.gc", None, "collect"), ("vstor.runtime.journal", "Journal", "rollback"),
         ("vstor.runtime.journal", "Journal", "_all"), ("vstor.runtime.state", "StateDir", "remove"),
         ("vstor.runtime.state", "StateDir", "save"), ("vstor.runtime.state", "StateDir", "load"),
         ("vstor.runtime.state", "StateDir", "records"), ("vstor.runtime.index.store", "Index", "change"),
         ("vstor.runtime.index.store", "Index", "_load_sums"),
         ("vstor.runtime.index.store", "Index", "_apply"),
         ("vstor.runtime.index.store", "Index", "_write_sums"), ("vstor.runtime.index", None, "reindex"),
         ("vstor.runtime.recorded", None, "check_releasable"), ("vstor.runtime.gc", None, "_changed"),
         ("vstor.backends.qsd.daemon", None, "stop"), ("vstor.log", None, "change")]


def timed(spent: dict) -> list[str]:
    """Wrap each of TIMED; the names not found (vstor changed)."""
    missing = []
    for modname, owner, name in TIMED:
        obj = importlib.import_module(modname)
        obj = getattr(obj, owner) if owner else obj
        fn = getattr(obj, name, None)
        if fn is None:
            missing.append(f"{modname}.{owner + '.' if owner else ''}{name}")
            continue
        label = f"{owner or modname.rsplit('.', 1)[-1]}.{name}"

        def wrapper(*a, _fn=fn, _label=label, **k):
            t0 = time.process_time()
            try:
                return _fn(*a, **k)
            finally:
                calls, cpu = spent.get(_label, (0, 0.0))
                spent[_label] = (calls + 1, cpu + time.process_time() - t0)
        setattr(obj, name, wrapper)
    return missing


def main() -> None:
    from bench import scale_fill
    from vstor.config import Config
    from vstor.runtime.state import StateDir
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    run = tempfile.mkdtemp(prefix="vstor-bench-", dir="/dev/shm")
    try:
        cfg = Config(state_dir=f"{run}/state", vhost_dir=f"{run}/vhost", qsd_dir=f"{run}/qsd",
                     images=(run,))
        scale_fill.fill(StateDir(cfg.state_dir), cfg, run, 0, n)
        conf = os.path.join(run, "vstor.conf")
        with open(conf, "w") as f:
            f.write(f"[paths]\nstate_dir = {cfg.state_dir}\nvhost_dir = {cfg.vhost_dir}\n"
                    f"qsd_dir = {cfg.qsd_dir}\nimages = {run}\n{NO_SUPERVISOR}")
        spent: dict = {}
        missing = timed(spent)
        from vstor.cli.main import main as vstor
        out = io.StringIO()
        t0 = time.process_time()
        with contextlib.redirect_stdout(out):
            code = vstor(["-c", "test:///default", "--config", conf, "gc"])
        total = time.process_time() - t0
        print(f"vstor gc of {n} records, in-process: exit {code}, {out.getvalue().count('Releasing')} "
              f"released, {total * 1000:.0f} ms of CPU in main(); inclusive, per function:")
        for label, (calls, cpu) in sorted(spent.items(), key=lambda x: -x[1][1]):
            print(f"  {label:28s} {calls:6d} calls {cpu * 1000:8.0f} ms {cpu / calls * 1000:8.3f} ms a call")
        if missing:
            print("not found (vstor changed): " + ", ".join(missing))
    finally:
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
