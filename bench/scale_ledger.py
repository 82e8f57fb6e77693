"""What a start pays for the ledger of N other records (bench_scale.py's
`--only ledger`): the plain way, every record file read as JSON (O_NOFOLLOW,
as vstor reads them), its format checked and its holding made a Holding
(vstor.meta.holding.holding_from_json), then the planner's Ledger over
them; against the index's ledger (vstor.runtime.holders.ledger_of under the
host lock, the records' names listed), asked what a start asks.  CPU ms of
one read (time.process_time), the best of `runs`: the lower bound of each
way's cost, which is what decides whether the index is needed.

The records are bench/scale_fill.py's, saved with StateDir.save; in a
directory on a tmpfs, as /run/vstor is on a host."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from bench import scale_fill


def plain_ledger(domains: str):
    """The ledger from the records themselves, read fast: JSON, each
    record's format checked, its holding parsed, nothing else."""
    from vstor.planner.ledger import Ledger
    from vstor.meta.holding import holding_from_json
    from vstor.runtime.recordfile import INCOMING, check_format, read_json
    held = []
    for name in os.listdir(domains):
        if name.endswith(".json"):
            path = os.path.join(domains, name)
            data = read_json(path)
            check_format(data, path)
            if data.get("holding"):
                held.append(holding_from_json(data["holding"], active=data.get("status") != INCOMING))
    return Ledger(held)


def _asked(ledger) -> None:
    """What a start's fit check asks of the ledger, roughly (a few items)."""
    for cpu in range(8):
        ledger.cpu_owner.get(cpu)
    "/run/vstor/vhost/bench4-vdb" in ledger.sockets
    ledger.volume_conflict(("file:/var/tmp/x.raw",), False)
    ledger.promised_hugepages(0, 2048)


def ledger_cost(counts: list[int], runs: int, sanity) -> None:
    from vstor.config import Config
    from vstor.runtime.holders import ledger_of
    from vstor.runtime.state import StateDir
    run = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir="/dev/shm"))
    try:
        os.chmod(run, 0o755)
        cfg = Config(state_dir=f"{run}/state", vhost_dir=f"{run}/vhost", qsd_dir=f"{run}/qsd",
                     images=(run,))
        print(f"the ledger of N records: CPU ms of one read, the best of {runs}")
        print(f"{'records':>8} {'plain (JSON + Holding + Ledger)':>32} {'the index':>10}")
        with StateDir(cfg.state_dir).lock():
            pass        # the state directory made, as vstor makes it
        filled = 0
        for n in counts:
            scale_fill.fill(StateDir(cfg.state_dir), cfg, run, filled, n)
            filled = max(filled, n)
            plain, index = [], []
            for _ in range(runs):
                t0 = time.process_time()
                _asked(plain_ledger(os.path.join(cfg.state_dir, "domains")))
                plain.append(time.process_time() - t0)
                state = StateDir(cfg.state_dir)
                with state.lock():
                    t0 = time.process_time()
                    _asked(ledger_of(state, {"bench4"}))
                    index.append(time.process_time() - t0)
            sanity.figure(f"plain ledger, {n} records", min(plain))
            sanity.figure(f"index ledger, {n} records", min(index))
            print(f"{n:>8} {min(plain) * 1000:>32.1f} {min(index) * 1000:>10.1f}")
    finally:
        shutil.rmtree(run, ignore_errors=True)
