"""A domain's host side from its state record alone: release after QEMU
stops, reconnect when libvirtd restarts, health for `vstor status`.

What to undo or check is all in the record, so nothing here reads the
domain's XML or plans: the hook's release and reconnect import this, not
vstor.runtime.lifecycle, and start up without lxml, vstor's declarations or
the planner.  Locks as lifecycle says: the record lock throughout, the host
lock while deciding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vstor import counters
from vstor.errors import ActionFailed, DoesNotFit, InUse
from vstor.meta.names import is_safe_name
from vstor.runtime import actions
from vstor.runtime import executor
from vstor.runtime.executor import Runtime
from vstor.runtime.journal import DONE, Journal, undo_failed
from vstor.runtime.state import EXPORTING, PREPARED, Record, StateDir


def private_only(kinds) -> bool:
    """Steps of these kinds change only the domain's own things (executor.PRIVATE)."""
    return all(kind in executor.PRIVATE for kind in kinds)


def own_record(rec: Record | None, domain: str | None, uuid: str | None) -> Record | None:
    """The record, if it is this domain's: a safe name can be another
    domain's UUID, and one domain's hook must never undo another's work."""
    if rec is None or domain is None:
        return rec
    if rec.domain != domain or rec.uuid != uuid:
        theirs = f"'{rec.domain}'" if rec.domain != domain else f"'{rec.domain}' of UUID {rec.uuid}"
        raise DoesNotFit(f"state record {rec.key} belongs to domain {theirs}, not '{domain}'"
                         f"{'' if rec.domain != domain else f' of UUID {uuid}'}",
                         hint="give the domain a name of letters, digits and _.+- or another <uuid>")
    return rec


def _load_own(state: StateDir, key: str, domain: str | None, uuid: str | None) -> Record | None:
    """own_record of the record under `key`; for a domain whose name has
    spaces around it, also the record an earlier vstor (which read names
    stripped) kept under the stripped name, if it has the domain's UUID."""
    rec = own_record(state.load(key), domain, uuid)
    if rec is None and domain and uuid and domain != domain.strip() and is_safe_name(domain.strip()):
        old = state.load(domain.strip())
        if old is not None and old.domain == domain.strip() and old.uuid == uuid:
            return old
    return rec


def release(rt: Runtime, state: StateDir, key: str,
            progress: Callable[[str], None] | None = None, domain: str | None = None,
            uuid: str | None = None, migrated: bool = False,
            drop_exports: bool = False, seen: Record | None = None) -> Record | None:
    """Undo what vstor holds under `key`; with `domain`, only that domain's
    record; `seen`: the record as the caller read it under the record lock
    it holds (gc), not read again.  An NVMe-oF export made for a migration (the domain may now run
    on the other host, reading its disk through it) stays, with what it
    stands on, in a record marked exporting, unless `drop_exports` (gc found
    the other host done with it) or `rt.force`."""
    with state.record_lock(key, dry_run=rt.dry_run), contextlib.ExitStack() as host_lock:
        host_lock.enter_context(state.lock(dry_run=rt.dry_run))
        rec = seen if seen is not None else _load_own(state, key, domain, uuid)
        if rec is None:
            return None
        rt = rt.of(rec)
        # An export the other host may read its disk through stays until gc
        # has asked it (libvirt before 10.5 gives no 'migrated' reason).
        exports = exported(rec)
        if exports and rec.status == EXPORTING and not (drop_exports or rt.force):
            raise InUse(f"domain '{rec.domain}' runs on {rec.migration.get('to') or 'another host'} "
                             "and reads its disk through this host's NVMe-oF export",
                             hint="vstor gc removes it once that host no longer holds the domain; "
                                  "vstor release --force removes it now")
        keep = exports if exports and not (drop_exports or rt.force) and (
            migrated or rec.migration.get("role") == "outgoing") else None
        if rt.dry_run:
            for i, entry in reversed(list(enumerate(rec.steps))):
                if not (keep and keep(i, entry)):
                    (progress or print)(f"would undo: {_describe(entry)}")
            return rec
        steps = check_releasable(rt, rec)
        if private_only(entry.get("kind") for entry in rec.steps):
            host_lock.close()
        roll_back(rt, state, rec, progress, keep, steps)
        if keep is not None and rec.steps:
            # What the export stands on is all it holds now: no cores,
            # reactor, socket or memory of a domain that runs elsewhere.
            rec.status = EXPORTING
            rec.holding = {**rec.holding, "cpus": [], "reactors": [], "hugepages": None,
                           "memory": None, "sockets": [], "connections": []}
            rec.repair = {}     # what a repair pinned here left with the domain
            state.save(rec)
        return rec


def exported(rec: Record):
    """keep(index, entry) for what a record's NVMe-oF exports stand on: the
    exports, the SPDK controllers of their bdevs, those controllers' vfio
    binding; None when the record exports nothing."""
    exports = [e["data"] for e in rec.steps if e.get("kind") == "nvmf-export"]
    if not exports:
        return None
    controllers = {str(x.get("bdev", "")).rsplit("n", 1)[0] for x in exports}
    addresses = {p.get("traddr") for e in rec.steps if e.get("kind") == "spdk-attach"
                 and e["data"].get("name") in controllers
                 for p in e["data"].get("paths", ()) if p.get("trtype") == "PCIe"}
    return lambda _i, e: (e.get("kind") == "nvmf-export"
                          or (e.get("kind") == "spdk-attach" and e["data"].get("name") in controllers)
                          or (e.get("kind") == "vfio-bind" and e["data"].get("address") in addresses))


def check_releasable(rt: Runtime, rec: Record) -> list:
    """Before any undo: SPDK reachable when the record needs it (exit 4), and,
    unless forced, nothing the record made still in use by QEMU (exit 3): a
    release never takes half of a running domain's storage away.  The
    record's steps, decoded (None for one that cannot be: undo reports it),
    for roll_back."""
    decoded = []
    for entry in rec.steps:
        try:
            decoded.append(actions.from_json(entry))
        except ActionFailed:
            decoded.append(None)
    recorded = [step for step in decoded if step is not None]
    if any(getattr(step, "rpc_methods", ()) for step in recorded):
        rt.spdk.get_version()
    if not rt.force:
        for step in recorded:
            why = executor.in_use(step, rt)
            if why:
                raise InUse(f"domain '{rec.domain}' is still using its storage: {why}",
                            hint="stop the domain first (or vstor release --force, which leaves "
                                 "SPDK to finish when QEMU lets go)")
    return decoded


def _describe(entry: dict) -> str:
    try:
        return actions.from_json(entry).describe()
    except ActionFailed as e:
        return e.message


def roll_back(rt: Runtime, state: StateDir, rec: Record, progress, keep=None,
              steps: list | None = None) -> None:
    """Journal.rollback of the record (`steps`: as check_releasable decoded them)."""
    journal = Journal(state, rec, rt, progress)
    errors = journal.rollback(keep, steps)
    if errors:
        raise undo_failed(journal, f"domain '{rec.domain}': could not undo everything: "
                                   f"{'; '.join(errors)}", f"fix the cause, then: vstor release {rec.domain}")


def reconnect(rt: Runtime, state: StateDir, key: str, domain: str | None = None,
              uuid: str | None = None) -> list[str]:
    """libvirtd restarted while the domain runs: check what vstor made still
    exists and repair what can be repaired.  Returns one line per finding."""
    findings = []
    with state.record_lock(key), state.lock():
        rec = _load_own(state, key, domain, uuid)
        if rec is None:
            return ["vstor holds nothing for it"]
        rt = rt.of(rec)
        for entry in rec.steps:
            step = actions.from_json(entry)
            problem = executor.check(step, rt) if entry["state"] == DONE else "interrupted before it finished"
            if problem is None:
                continue
            try:
                executor.repair(step, rt)
                findings.append(f"{step.describe()}: {problem}; repaired")
                if step.kind == "qsd-export":
                    counters.add("restart", ("qemu-storage-daemon",))
            except Exception as e:
                findings.append(f"{step.describe()}: {problem}; repair failed: {e}")
        if rec.status != PREPARED and all(e["state"] == DONE for e in rec.steps):
            rec.status = PREPARED
            state.save(rec)
    if any(e.get("kind") == "qsd-export" for e in rec.steps):
        from vstor.runtime import supervise     # libvirtd restarted: so may have the host
        supervise.ensure(rt.cfg, rt.sysfs.root)
    return findings


def health(rt: Runtime, rec: Record) -> list[tuple[str, str, str | None]]:
    """(step, state, problem) for each step of a record."""
    rt = rt.of(rec)
    out = []
    for entry in rec.steps:
        try:
            step = actions.from_json(entry)
            what = step.describe()
        except ActionFailed as e:
            out.append((entry.get("kind", "step"), entry.get("state", ""), e.message))
            continue
        try:
            problem = executor.check(step, rt) if entry["state"] == DONE else "interrupted"
        except Exception as e:
            problem = f"cannot check: {str(e).splitlines()[0]}"
        out.append((what, entry["state"], problem))
    return out
