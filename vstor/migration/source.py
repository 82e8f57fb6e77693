"""The source's side of a live migration: what this host knows of each
disk's source (on storage the destination can see?), the verdict with the
destination's answer, the destination prepared, and the migration recorded
in the domain's state record until it is finished or aborted."""

from __future__ import annotations

import socket
import uuid

from vstor import records
from vstor.config import Config
from vstor.errors import DoesNotFit, Unavailable
from vstor.meta.document import Domain
from vstor.meta.names import MIGRATION_SUBNQN, migration_subnqn
from vstor.migration import storage
from vstor.migration.peer import Peer
from vstor.migration.verdict import IMPOSSIBLE, MAKE_READY, DiskVerdict, Verdict, judge, source_side
from vstor.runtime.actions import NvmfExport
from vstor.runtime.journal import Journal
from vstor.runtime.lifecycle import own_record, plan_of as checked, release


def imported(plan) -> dict:
    """target -> the NVMe-oF namespace a disk of this host's plan reads
    another host's local NVMe through (it arrived here by migration)."""
    return {d.target: d.source for d in plan.disks
            if d.source.kind == "nvmf" and d.source.subnqn.startswith(MIGRATION_SUBNQN)}


def plan_of(dom: Domain):
    """The domain's plan, made for its metadata as it is (lifecycle.plan_of's
    check), with each disk's source as the metadata says: a plan in a
    domain's XML is input, and nothing on this host is opened on its word."""
    req, plan = checked(dom)
    intent = {d.target: d.source for d in req.intent.disks}
    disks = []
    for d in plan.disks:
        src = intent[d.target]
        imported = src.kind == "nvme" and d.source.kind == "nvmf"     # it came here over NVMe-oF
        disks.append(d if imported else records.replace(d, source=src))
    return records.replace(plan, disks=tuple(disks))


def files_to_check(cfg: Config, plan, sysfs) -> dict:
    """This host's description of each file and block source (storage.describe)."""
    return {d.target: storage.describe(cfg, d.source.kind, d.source.path, sysfs)
            for d in plan.disks if d.source.kind in ("file", "block")}


def check(cfg: Config, dom: Domain, peer: Peer, sysfs, looked=None) -> Verdict:
    return _check(cfg, dom, peer, sysfs, looked=looked)[0]


def look(cfg: Config, dom: Domain, sysfs):
    """This host's side, before the destination is asked: (plan, files,
    each file's storage facts, what each disk needs on the destination)."""
    plan = plan_of(dom)
    files = files_to_check(cfg, plan, sysfs)
    facts = {t: storage.shared(f) for t, f in files.items()}
    return plan, files, facts, source_side(plan, facts, set(imported(plan)), bool(cfg.export_address))


def _check(cfg: Config, dom: Domain, peer: Peer, sysfs, cold: bool = False,
           hostnqn: str | None = None, looked=None):
    """(verdict, the destination's answer, the migration's host NQN).  Local
    NVMe under SPDK is asked about as the NVMe-oF namespace this host would
    export it as, to the migration's own host NQN (`hostnqn`, or a new one).
    `looked`: what look() found, if it ran already."""
    plan, files, facts, _ = looked or look(cfg, dom, sysfs)
    imports = {}
    if not cold and cfg.export_address and any(d.source.kind == "nvme" and d.backend == "spdk"
                                               for d in plan.disks):
        hostnqn = hostnqn or new_hostnqn()
        imports = {t: x for t, (_, x) in exports_for(cfg, dom, plan, hostnqn).items()}
    there = peer.call("check", xml=dom.to_string(), files=files, imports=imports, cold=cold)
    said = expect(there, "seen", dict, {})
    seen = {t: said.get(t, "did not say") if isinstance(said.get(t), (str, type(None))) else "did not say"
            for t in files}
    problems = [p for p in expect(there, "problems", list, []) if isinstance(p, str)]
    if not cold:
        problems += _mismatches(plan, expect(there, "disks", dict, {}), peer.host)
    placement = [p for p in expect(there, "placement", list, []) if isinstance(p, str)]
    verdict = judge(plan, facts, seen, peer.host, problems, placement)
    relayed = imported(plan)
    if relayed:     # another host's disk: only that host's export serves it, to this host alone
        disks = tuple(DiskVerdict(d.target, IMPOSSIBLE, f"it reads another host's local NVMe through "
                                  f"{relayed[d.target].traddr}'s export {relayed[d.target].subnqn}, "
                                  "which serves this host alone",
                                  "shut it down and start it on the host that has the NVMe")
                      if d.target in relayed else d for d in verdict.disks)
        verdict = records.replace(verdict, disks=disks)
    return verdict, there, hostnqn


def expect(answer: dict, key: str, kind: type, default):
    """answer[key] if it is a `kind` (a destination's answer is checked like any input)."""
    value = answer.get(key, default)
    if value is not default and not isinstance(value, kind):
        raise Unavailable(f"vstor on the destination answered {key} that is not a {kind.__name__}",
                          hint="install the same vstor version on both hosts")
    return value


def _mismatches(plan, theirs: dict, host: str) -> list[str]:
    """Both ends of a vhost-user migration serve each disk alike (the guest's
    device must not change under it): the same mode, backend, queues, readonly."""
    out = []
    for d in plan.disks:
        there = theirs.get(d.target)
        if not isinstance(there, dict) or d.mode != "vhost":
            continue
        for key in ("mode", "backend", "queues", "readonly"):
            if there.get(key) != getattr(d, key):
                out.append(f"{d.target}: {host} would serve it with {key} {there.get(key)!r}, this host "
                           f"does with {getattr(d, key)!r}; pin {key} in the disk's metadata")
                break
    return out


def new_hostnqn() -> str:
    """A host NQN for one migration alone: what its exports admit, and what
    the destination's SPDK attaches them with.  Not the destination's own
    host NQN (every domain there attaches with that one, so any of them
    could reach the export by its predictable name after the move): a
    random UUID nobody can guess, recorded in the export steps here and in
    the arriving domain's plan there."""
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"


def recorded_hostnqn(state, dom: Domain) -> str | None:
    """The host NQN an earlier run of this migration's prepare exported to
    (a re-run keeps it: the destination may have attached with it)."""
    rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
    hosts = sorted({e["data"].get("host") for e in (rec.steps if rec else ())
                    if e.get("kind") == "nvmf-export"} - {None})
    return hosts[0] if hosts else None


def exports_for(cfg: Config, dom: Domain, plan, hostnqn: str | None) -> dict:
    """target -> (the NvmfExport step, the import the destination plans with)
    for each local NVMe disk under SPDK; {} until both ends are known."""
    if not (cfg.export_address and hostnqn):
        return {}
    out = {}
    for d in plan.disks:
        if d.source.kind == "nvme" and d.backend == "spdk" and d.mode == "vhost":
            nqn = migration_subnqn(dom.safe_name, d.target)
            adrfam = "IPv6" if ":" in cfg.export_address else "IPv4"
            step = NvmfExport(nqn, d.bdev, cfg.export_transport.upper(), adrfam,
                              cfg.export_address, cfg.export_port, hostnqn)
            out[d.target] = (step, {"transport": cfg.export_transport, "traddr": cfg.export_address,
                                    "trsvcid": str(cfg.export_port), "adrfam": adrfam.lower(),
                                    "subnqn": nqn, "namespace": "1", "hostnqn": hostnqn})
    return out


def preflight(cfg: Config, state, dom: Domain, peer: Peer, sysfs, cold: bool = False):
    """Everything prepare checks before it acts, acting on nothing (the
    destination is asked its read-only `check`): (verdict, the exports this
    host would make: target -> (NvmfExport step, import)).  Refused, with
    every reason, unless the verdict allows the migration."""
    verdict, _, hostnqn = _check(cfg, dom, peer, sysfs, cold, None if cold else recorded_hostnqn(state, dom))
    elsewhere = recorded_destination(state, dom.name)
    if elsewhere not in (None, peer.host):
        raise DoesNotFit(f"domain '{dom.name}' is already prepared to migrate to {elsewhere}",
                         hint=f"vstor migrate abort {dom.name} first")
    if cold:
        if not verdict.cold:
            reasons = [f"{d.target}: {d.reason}" for d in verdict.disks if d.verdict == "impossible"]
            reasons += list(verdict.problems)
            raise DoesNotFit(f"domain '{dom.name}' cannot move to {peer.host}: {reasons[0]}",
                             reasons=tuple(reasons), hint="see vstor migrate check")
        return verdict, {}
    if not verdict.live:
        reasons = [f"{d.target}: {d.verdict}: {d.reason}" for d in verdict.disks if d.verdict != "ready"]
        reasons += list(verdict.problems)
        fix = next((d.fix for d in verdict.disks if d.fix), None)
        raise DoesNotFit(f"domain '{dom.name}' cannot live-migrate to {peer.host}: {reasons[0]}",
                         hint=(fix or "see vstor migrate check").replace("{domain}", dom.name),
                         reasons=tuple(reasons))
    exports = {}
    if any(d.verdict == MAKE_READY for d in verdict.disks):
        if not cfg.export_address:
            raise DoesNotFit(f"domain '{dom.name}' has local NVMe to export to {peer.host}, and this "
                             "host has no export address", hint=f"set [migrate] export_address in {cfg.file}")
        exports = exports_for(cfg, dom, plan_of(dom), hostnqn)
    return verdict, exports


def prepare(cfg: Config, state, dom: Domain, peer: Peer, dest_uri: str, rt=None,
            cold: bool = False) -> tuple[Verdict, str]:
    """The destination's backends made and held, local NVMe exported to it
    first; the XML the domain will arrive with.  Refused as preflight
    refuses; a failure on either side undoes both."""
    verdict, exports = preflight(cfg, state, dom, peer, rt.sysfs, cold)
    if cold:
        xml = _arriving(peer, dom, peer.call("prepare", xml=dom.to_string(), cold=True,
                                             **{"from": socket.gethostname()}))
        _remember(state, dom, {"role": "outgoing", "to": peer.host, "uri": dest_uri, "cold": "yes"})
        return verdict, xml
    added = _export(state, dom, rt, [step for step, _ in exports.values()]) if exports else []
    try:
        xml = _arriving(peer, dom, peer.call("prepare", xml=dom.to_string(), **{"from": socket.gethostname()},
                                             imports={t: x for t, (_, x) in exports.items()}))
    except BaseException:
        _unexport(state, dom.safe_name, rt, added)
        raise
    _remember(state, dom, {"role": "outgoing", "to": peer.host, "uri": dest_uri})
    return verdict, xml


def _arriving(peer: Peer, dom: Domain, answer: dict) -> str:
    """The XML the destination's prepare answered with (it holds something now)."""
    xml = expect(answer, "xml", str, None)
    if not xml:
        raise Unavailable(f"vstor on {peer.host} prepared {dom.name} but sent no XML",
                          hint=f"vstor migrate abort {dom.name} --to {peer.host}")
    return xml


def _export(state, dom: Domain, rt, steps) -> list[str]:
    """The exports journaled in the domain's record (it runs here); the NQNs
    this call added (a re-run finds the earlier ones and adds nothing)."""
    with state.planning(), state.record_lock(dom.safe_name), state.lock():
        rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
        if rec is None or rec.status != "prepared":
            raise DoesNotFit(f"domain '{dom.name}' does not run here on backends vstor made "
                             f"({rec.status if rec else 'no record'}): nothing to export",
                             hint="start it here first, or migrate it cold")
        have = {e["data"].get("nqn") for e in rec.steps if e.get("kind") == "nvmf-export"}
        new = [s for s in steps if s.nqn not in have]
        rt = rt.of(rec)     # one SPDK application per domain: the one its bdevs are in
        if new:
            rt.spdk.require({m for s in new for m in s.rpc_methods})
            Journal(state, rec, rt, lambda m: print(f"  {m}")).extend(new)
        return [s.nqn for s in new]


def unexport_all(state, name: str, rt) -> int:
    """Undo every export a running domain's record holds (the migration was
    aborted); how many there were."""
    for rec in state.records():
        nqns = [e["data"].get("nqn") for e in rec.steps if e.get("kind") == "nvmf-export"]
        if rec.domain == name and rec.status == "prepared":
            _unexport(state, rec.key, rt, nqns)
            return len(nqns)
        if rec.domain == name and rec.status == "exporting":    # it stopped here, never moved
            release(rt, state, rec.key, drop_exports=True, domain=rec.domain, uuid=rec.uuid)
            return len(nqns)
    return 0


def _unexport(state, key: str, rt, nqns: list[str]) -> None:
    """Undo the exports this prepare added (the destination refused)."""
    if not nqns:
        return
    with state.record_lock(key), state.lock():
        rec = state.load(key)
        if rec is None:
            return
        status = rec.status
        Journal(state, rec, rt.of(rec)).rollback(
            keep=lambda _i, e: not (e.get("kind") == "nvmf-export" and e["data"].get("nqn") in nqns))
        if rec.steps:
            rec.status = status
            state.save(rec)


def forget(state, dom_name: str) -> None:
    """The migration is over (finished or aborted): the source's record, if
    the domain still has one here, no longer names it."""
    for found in state.records():
        if found.domain == dom_name and found.migration:
            with state.record_lock(found.key):
                rec = state.load(found.key)
                if rec is not None and rec.domain == dom_name and rec.migration:
                    rec.migration = {}
                    state.save(rec)


def _remember(state, dom: Domain, migration: dict) -> None:
    with state.record_lock(dom.safe_name):
        rec = state.load(dom.safe_name)
        if rec is not None and rec.domain == dom.name:
            rec.migration = migration
            state.save(rec)


def recorded_destination(state, name: str) -> str | None:
    for rec in state.records():
        if rec.domain == name and rec.migration.get("role") == "outgoing":
            return rec.migration.get("to")
    return None
