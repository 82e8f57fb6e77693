"""Collecting what no running domain needs: records of domains that stopped
without a release, and files in vstor's own directories that no record owns.
Only what vstor provably made is touched: its records' steps, and files in
its own socket and daemon directories."""

from __future__ import annotations

import os
from typing import Callable

from vstor.config import Config
from vstor.runtime import actions
from vstor.runtime.lifecycle import Runtime, release
from vstor.runtime.state import Record, StateDir


def stale_records(state: StateDir, running: set[str]) -> list[Record]:
    return [r for r in state.records() if r.domain not in running]


def collect(rt: Runtime, state: StateDir, running: set[str],
            say: Callable[[str], None], step: Callable[[str], None]) -> bool:
    """Release stale records and remove orphans (dry run: only say so).
    True when there was anything to collect."""
    stale = stale_records(state, running)
    for rec in stale:
        say(f"{'Would release' if rt.dry_run else 'Releasing'} {rec.domain} (not running):")
        release(rt, state, rec.key, progress=step)
    orphans = orphan_files(rt.cfg, state)
    for path in orphans:
        say(f"{'Would remove' if rt.dry_run else 'Removing'} orphan {path}")
        if not rt.dry_run:
            remove_orphan(path)
    return bool(stale or orphans)


def orphan_files(cfg: Config, state: StateDir) -> list[str]:
    """Sockets and qsd files in vstor's own directories that no record owns."""
    owned = set()
    for rec in state.records():
        owned.update(rec.holding.get("sockets", []))
        for entry in rec.steps:
            if entry.get("kind") == actions.QsdExport.kind:
                name = entry["data"].get("name", "")
                owned.update(os.path.join(cfg.qsd_dir, name + ext) for ext in (".pid", ".qmp"))
    out = []
    for directory in (cfg.vhost_dir, cfg.qsd_dir):
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        out += [os.path.join(directory, n) for n in names
                if os.path.join(directory, n) not in owned and not n.startswith(".")]
    return out


def remove_orphan(path: str) -> None:
    if path.endswith(".pid"):
        from vstor.backends.qsd import daemon
        daemon.stop_orphan(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
