"""Collecting what no running domain needs: records of domains that stopped
without a release, and files in vstor's own directories that no record owns.
Only what vstor provably made is touched: its records' steps, and files in
its own socket and daemon directories."""

from __future__ import annotations

import os
import socket
import stat
from contextlib import nullcontext
from typing import Callable

from vstor import counters
from vstor.config import Config
from vstor.errors import InUse, Unavailable, VstorError
from vstor.meta.names import gate_path, is_disk_name, is_safe_name
from vstor.runtime import actions
from vstor.runtime.executor import Runtime
from vstor.runtime.index import reindex
from vstor.runtime.lifecycle import release
from vstor.runtime.state import EXPORTING, INCOMING, Record, StateDir


def collect(rt: Runtime, state: StateDir, records: list[Record], running: set[str],
            say: Callable[[str], None], step: Callable[[str], None], guard=None,
            damaged: list[str] = (), ask: Callable[[str, Record], dict] | None = None) -> bool:
    """Release stale records and remove orphans (dry run: only say so); name
    what is in vstor's directories but not provably vstor's, and leave it.
    `records` (and the `damaged` ones) were read before `running` was asked:
    a record released is one of them, unchanged (checked under its lock), so
    a domain that started after `running` was asked keeps what its start
    recorded.  guard(rec): a context manager entered around each release,
    giving a reason to leave the record after all (checked again under its
    lock), or None.  ask(host, rec): the `status` answer of the host a
    migrated domain went to (vstor.migration.peer.status), which says whether
    it still needs the export it read its disk through; without it, every
    such export is left.  True when there was anything to collect."""
    stale = [r for r in records if r.domain not in running]
    rt = rt.looking_once()      # gc starts no daemon: one look through /proc finds every lost one
    for problem in damaged:
        say(f"Leaving {problem}")
    for rec in [r for r in stale if r.status == INCOMING]:
        say(f"Leaving what is held for {rec.domain}'s incoming migration from "
            f"{rec.migration.get('from') or 'another host'} (vstor migrate abort {rec.domain} there, "
            f"or vstor release --force {rec.domain} here)")
    stale = [r for r in stale if r.status != INCOMING]
    for rec in [r for r in stale if r.status == EXPORTING or any(
            e.get("kind") == "nvmf-export" for e in r.steps)]:
        why = _still_needed(ask, rec)
        if why:
            say(f"Leaving the NVMe-oF export of {rec.domain}: {why}")
            stale.remove(rec)
    for rec in list(stale):
        if state.busy(rec.key):
            say(f"Leaving {rec.domain}: a vstor run for it is under way")
            stale.remove(rec)
    in_use: list[str] = []
    for rec in stale:
        with guard(rec) if guard else nullcontext() as why:
            if why:
                say(f"Leaving {rec.domain}: {why}")
                continue
            with state.record_lock(rec.key, dry_run=rt.dry_run):
                why = _changed(state, rec)
                if why:
                    say(f"Leaving {rec.domain}: {why}")
                    continue
                say(f"{'Would release' if rt.dry_run else 'Releasing'} {rec.domain} (not running):")
                try:    # as read: unchanged, under its record lock
                    release(rt, state, rec.key, progress=step, drop_exports=True,  # still needed: left above
                            seen=rec)
                    if not rt.dry_run:
                        counters.add("gc", ())
                except InUse as e:      # a QEMU still connected: the others are collected all the same
                    say(f"Leaving {rec.domain}: {e}")
                    in_use.append(rec.domain)
                except Unavailable as e:
                    if not damaged:
                        raise
                    say(f"Leaving what {rec.domain} shares: {e}")     # said again at the end
    if damaged:     # a record nobody can read may own any of them
        orphans, foreign = [], [(d, "a state record that cannot be read may own what is there")
                                for d in (rt.cfg.vhost_dir, rt.cfg.qsd_dir)]
    else:
        orphans, foreign = orphan_files(rt.cfg, state)
    for path in orphans:
        key = _owner_key(path)
        with nullcontext() if rt.dry_run else state.record_lock(key):
            if not rt.dry_run and _claimed(state, key):
                # A start of that name recorded since the records were read:
                # the file is its daemon's now.
                say(f"Leaving {path}: a vstor run for {key} recorded it meanwhile")
                continue
            say(f"{'Would remove' if rt.dry_run else 'Removing'} orphan {path}")
            if not rt.dry_run:
                remove_orphan(path)
    for path, why in foreign:
        say(f"Leaving {path}: {why}")
    for what in spdk_leftovers(rt.cfg, state):
        say(f"Leaving {what}")
    if damaged:
        from vstor.runtime.state import DamagedRecord
        raise DamagedRecord(f"gc left what {len(damaged)} state records that cannot be read may "
                            "hold, and every file in vstor's directories",
                            hint="inspect each, undo by hand what it lists, remove it, then vstor gc again")
    if in_use:
        raise InUse(f"gc left {', '.join(in_use)}: not running, yet its storage is still in use",
                    hint="stop what is connected (a QEMU libvirt no longer knows?), then vstor gc again")
    return bool(stale or orphans)


def read_records(state: StateDir, dry_run: bool = False) -> tuple[list[Record], list[str]]:
    """Every record and the damaged ones, as collect() is to be given them
    (read before what runs is asked); read under the host lock, and the
    index checked against them there (vstor.runtime.index.reindex: a record
    fixed or removed by hand, damaged in place), unless a dry run."""
    damaged: list[str] = []
    if dry_run or not os.path.isdir(state.path):
        return state.records(damaged), damaged
    with state.lock():
        records = state.records(damaged)
        reindex(state, records, damaged)
    return records, damaged


def _changed(state: StateDir, seen: Record) -> str | None:
    """Why a record is not the one gc read before it asked what runs (its
    record lock held): a start, stop or release of it happened since."""
    if state.unchanged(seen):
        return None
    try:
        now = state.load(seen.key)
    except VstorError as e:
        return str(e)
    if now is None:
        return "released meanwhile"
    if now.to_json() != seen.to_json():
        return "its record changed since gc asked what runs (a start or stop of it since)"
    return None


def _still_needed(ask, rec) -> str | None:
    """Why an export that a migrated domain read its disk through must stay:
    the destination still holds the domain, or cannot say."""
    dest = rec.migration.get("to")
    if not dest:
        return None
    if ask is None:
        return f"{dest} was not asked whether it still needs it"
    try:
        there = ask(dest, rec)
    except VstorError as e:
        return f"cannot ask {dest} whether it still needs it ({e})"
    if "status" not in there:
        return f"{dest} did not say whether it still holds the domain"
    status = there["status"]
    return f"{dest} still holds the domain ({status})" if status is not None else None


def orphan_files(cfg: Config, state: StateDir) -> tuple[list[str], list[tuple[str, str]]]:
    """(what no record owns and vstor's naming proves is vstor's, stale;
    what is there but not provably vstor's, with why).  The directories are
    listed first and the records read after: a daemon's files are made after
    its record says so (the journal records a step before doing it), so a
    file listed is owned by a record read afterwards, if by any."""
    listed = []
    for directory, judge in ((cfg.vhost_dir, _vhost_entry), (cfg.qsd_dir, _qsd_entry)):
        try:
            listed.append((directory, judge, sorted(os.listdir(directory))))
        except FileNotFoundError:
            continue
    owned = set()
    for rec in state.records():
        owned.update(rec.holding.get("sockets", []))
        for entry in rec.steps:
            if entry.get("kind") == actions.QsdExport.kind:
                name = entry["data"].get("name", "")
                owned.update(os.path.join(cfg.qsd_dir, name + ext) for ext in (".pid", ".qmp"))
            elif entry.get("kind") == actions.Gate.kind:
                owned.add(entry["data"].get("path"))
    orphans, foreign = [], []
    for directory, judge, names in listed:
        for n in names:
            path = os.path.join(directory, n)
            if directory == cfg.qsd_dir and n == LEASES:
                orphans += _orphan_leases(cfg.qsd_dir, owned)
                continue
            if path in owned or n.startswith(".") or not os.path.lexists(path):
                continue
            why = judge(n, path)
            (foreign.append((path, why)) if why else orphans.append(path))
    return orphans, foreign


LEASES = "users"        # vstor.backends.qsd.grant.users_dir's


def _orphan_leases(qsd_dir: str, owned: set[str]) -> list[str]:
    """The uid leases (vstor.backends.qsd.grant) of daemons no record owns:
    a start interrupted before its record, or a record removed by hand."""
    from vstor.backends.qsd import grant
    where = grant.users_dir(qsd_dir)
    out = []
    for uid in sorted(os.listdir(where)) if os.path.isdir(where) else ():
        name = grant.lease_name(qsd_dir, uid)
        if uid.isdigit() and os.path.join(qsd_dir, f"{name}.pid") not in owned:
            out.append(os.path.join(where, uid))
    return out


def _owner_key(path: str) -> str:
    """The record key a vstor file's name says it is of (<key>-vdX[.pid|.qmp]);
    of a uid lease, its daemon's name's."""
    stem = os.path.basename(path)
    if os.path.dirname(path).endswith("/" + LEASES):
        from vstor.backends.qsd import grant
        stem = grant.lease_name(os.path.dirname(os.path.dirname(path)), stem)
    if stem.endswith(MARK):
        return stem[:-len(MARK)]
    stem = stem[:-4] if stem.endswith((".pid", ".qmp")) else stem
    return stem.rsplit("-vd", 1)[0]


def _claimed(state: StateDir, key: str) -> bool:
    try:
        return state.load(key) is not None
    except VstorError:      # damaged: it may own the file
        return True


def spdk_leftovers(cfg: Config, state: StateDir) -> list[str]:
    """SPDK objects named the way vstor names them that no record holds.
    Every change vstor makes is journaled before it is made, so these are not
    provably vstor's (an operator's, or a record removed by hand): named, with
    how to remove them, and left.  Only read, in a dry run too."""
    if not os.path.exists(cfg.spdk_socket):
        return []
    from vstor.backends.spdk import SpdkClient
    try:
        # SPDK first, the records after: a step is journaled before it is
        # made, so whatever SPDK listed is in a record read afterwards.
        with SpdkClient(cfg.spdk_socket, timeout=cfg.spdk_timeout, vhost_dir=cfg.vhost_dir,
                        config=cfg.file) as spdk:
            vhost = [] if spdk.missing(["vhost_get_controllers"]) else spdk.vhost_get_controllers()
            nvme = spdk.get_nvme_controllers()
    except VstorError as e:
        return [f"SPDK unchecked for leftovers: {e}"]
    damaged: list[str] = []
    records = state.records(damaged)
    if damaged:
        return [f"SPDK unchecked for leftovers: {len(damaged)} state records cannot be read, "
                "and what they hold is not known"]
    key = {actions.SpdkAttach.kind: "name", actions.SpdkVhost.kind: "ctrlr"}
    owned = {entry.get("data", {}).get(key[entry.get("kind")])
             for rec in records for entry in rec.steps if entry.get("kind") in key}
    out = []
    for c in vhost:
        name = c.get("ctrlr", "")
        if is_disk_name(name) and name not in owned:
            out.append(f"SPDK vhost controller {name}: no vstor record holds it (if nothing uses "
                       f"it: rpc.py vhost_delete_controller {name})")
    for c in nvme:
        name = c.get("name", "")
        if name.startswith("vs_") and name not in owned:
            out.append(f"SPDK NVMe controller {name}: no vstor record holds it (if nothing uses "
                       f"it: rpc.py bdev_nvme_detach_controller {name})")
    return out


MARK = os.path.basename(gate_path("/", "k"))[1:]     # ".vstor-prepared"


def _vhost_entry(name: str, path: str) -> str | None:
    """None when `path` is a stale vstor socket or a prepared mark vstor
    wrote (vstor.runtime.kinds.gate); else why it stays."""
    if name.endswith(MARK) and is_safe_name(name[:-len(MARK)]):
        from vstor.backends import ownership
        return None if ownership.marked(path) else "not a prepared mark vstor wrote"
    if not is_disk_name(name):
        return "not named like a vstor socket"
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        return "not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return None         # nobody listens: a dead daemon's socket
        except OSError as e:
            return f"cannot tell whether it is in use ({e.strerror})"
    return "something still listens on it (SPDK's, or a daemon no record knows)"


def _qsd_entry(name: str, path: str) -> str | None:
    stem, ext = os.path.splitext(name)
    if ext not in (".pid", ".qmp") or not is_disk_name(stem):
        return "not named like a vstor daemon's file"
    mode = os.lstat(path).st_mode
    if not (stat.S_ISREG(mode) if ext == ".pid" else stat.S_ISSOCK(mode)):
        return "not the kind of file vstor makes there"
    return None


def remove_orphan(path: str) -> None:
    if os.path.dirname(path).endswith("/" + LEASES):
        from vstor.backends.qsd import grant
        grant.revoke(os.path.dirname(os.path.dirname(path)), int(os.path.basename(path)))
        return
    if path.endswith(MARK):
        from vstor.backends import ownership
        ownership.unmark(path)      # only what vstor wrote
        return
    if path.endswith(".pid"):
        from vstor.backends.qsd import daemon
        daemon.stop_orphan(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
