"""The source's side of a live migration: what this host knows of each
disk's source (on storage the destination can see?), the verdict with the
destination's answer, the destination prepared, and the migration recorded
in the domain's state record until it is finished or aborted."""

from __future__ import annotations

import os
import socket

from vstor.config import Config
from vstor.errors import BadInput, DoesNotFit
from vstor.meta.document import Domain
from vstor.meta.names import inside
from vstor.migration.peer import Peer
from vstor.migration.verdict import MAKE_READY, Verdict, judge

# Filesystems every host that mounts them sees the same: a file on one of
# them is on storage a migration's destination can see (if it mounts it too).
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "ceph", "fuse.cephfs", "glusterfs",
                        "fuse.glusterfs", "gpfs", "ocfs2", "gfs2", "lustre", "beegfs",
                        "fuse.beegfs", "virtiofs"})


def plan_of(dom: Domain):
    plan = dom.recorded_plan()
    if plan is None:
        raise BadInput(f"domain '{dom.name}' has no vstor plan", hint=f"run: vstor apply {dom.name}")
    return plan


def shared(cfg: Config, path: str) -> tuple[bool, str]:
    """(can another host see this source at the same path, in words)."""
    real = os.path.realpath(path)
    roots = [r for r in cfg.migrate_shared if real == r or inside(real, [r])]
    if roots:
        return True, f"under the shared storage {roots[0]} ([migrate] shared)"
    fstype = mount_type(real)
    if fstype in NETWORK_FS:
        return True, f"on a {fstype} filesystem"
    return False, f"on a local {fstype or 'unknown'} filesystem"


def mount_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The filesystem type of the mount that holds `path` (the longest mount
    point above it)."""
    best, kind = "", None
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            point = fields[4].encode().decode("unicode_escape")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[sep + 1]
    return kind


def files_to_check(plan) -> dict:
    """The file and block sources the destination must see, with their sizes."""
    out = {}
    for d in plan.disks:
        if d.source.kind in ("file", "block"):
            real = os.path.realpath(d.source.path)
            with open(real, "rb") as f:
                size = f.seek(0, os.SEEK_END)
            out[d.target] = {"path": d.source.path, "size": size, "kind": d.source.kind}
    return out


def check(cfg: Config, dom: Domain, peer: Peer) -> Verdict:
    return _check(cfg, dom, peer)[0]


def _check(cfg: Config, dom: Domain, peer: Peer):
    """(verdict, the destination's answer, its SPDK's host NQN).  Local NVMe
    under SPDK is asked about as the NVMe-oF namespace this host would
    export it as, which needs the destination's host NQN first."""
    plan = plan_of(dom)
    files = files_to_check(plan)
    facts = {t: shared(cfg, f["path"]) for t, f in files.items()}
    hostnqn, imports = None, {}
    if cfg.export_address and any(d.source.kind == "nvme" and d.backend == "spdk" for d in plan.disks):
        hostnqn = peer.call("facts").get("hostnqn")
        imports = {t: x for t, (_, x) in exports_for(cfg, dom, plan, hostnqn).items()}
    there = peer.call("check", xml=dom.to_string(), files=files, imports=imports)
    seen = {t: there.get("seen", {}).get(t, "did not say") for t in files}
    verdict = judge(plan, facts, seen, peer.host, there.get("problems", ()), there.get("placement", ()))
    return verdict, there, hostnqn


def exports_for(cfg: Config, dom: Domain, plan, hostnqn: str | None) -> dict:
    """target -> (the NvmfExport step, the import the destination plans with)
    for each local NVMe disk under SPDK; {} until both ends are known."""
    from vstor.runtime.actions import NvmfExport
    if not (cfg.export_address and hostnqn):
        return {}
    out = {}
    for d in plan.disks:
        if d.source.kind == "nvme" and d.backend == "spdk" and d.mode == "vhost":
            nqn = f"nqn.2016-06.io.vstor:migrate:{dom.safe_name}-{d.target}"
            adrfam = "IPv6" if ":" in cfg.export_address else "IPv4"
            step = NvmfExport(nqn, d.bdev, cfg.export_transport.upper(), adrfam,
                              cfg.export_address, cfg.export_port, hostnqn)
            out[d.target] = (step, {"transport": cfg.export_transport, "traddr": cfg.export_address,
                                    "trsvcid": str(cfg.export_port), "adrfam": adrfam.lower(),
                                    "subnqn": nqn, "namespace": "1", "hostnqn": hostnqn})
    return out


def prepare(cfg: Config, state, dom: Domain, peer: Peer, dest_uri: str, rt=None,
            cold: bool = False) -> tuple[Verdict, str]:
    """The destination's backends made and held, local NVMe exported to it
    first; the XML the domain will arrive with.  Refused, with every reason,
    unless the verdict allows it; a failure on either side undoes both."""
    verdict, there, hostnqn = _check(cfg, dom, peer)
    if cold:
        raise DoesNotFit("a cold migration's reservation (--cold) is not built yet",
                         hint="shut the domain down, then vstor define it on the destination")
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
        if not hostnqn:
            raise DoesNotFit(f"{peer.host} names no host NQN for its SPDK, and an export allows "
                             "only a named host", hint=f"set [nvmf] hostnqn in vstor.conf on {peer.host}")
        exports = exports_for(cfg, dom, plan_of(dom), hostnqn)
    added = _export(state, dom, rt, [step for step, _ in exports.values()]) if exports else []
    try:
        answer = peer.call("prepare", xml=dom.to_string(), imports={t: x for t, (_, x) in exports.items()},
                           **{"from": socket.gethostname()})
    except BaseException:
        _unexport(state, dom.safe_name, rt, added)
        raise
    _remember(state, dom, {"role": "outgoing", "to": peer.host, "uri": dest_uri})
    return verdict, answer["xml"]


def _export(state, dom: Domain, rt, steps) -> list[str]:
    """The exports journaled in the domain's record (it runs here); the NQNs
    this call added (a re-run finds the earlier ones and adds nothing)."""
    from vstor.runtime.journal import Journal
    from vstor.runtime.lifecycle import own_record
    with state.lock():
        rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
        if rec is None or rec.status != "prepared":
            raise DoesNotFit(f"domain '{dom.name}' does not run here on backends vstor made "
                             f"({rec.status if rec else 'no record'}): nothing to export",
                             hint=f"start it here first, or migrate it cold")
        have = {e["data"].get("nqn") for e in rec.steps if e.get("kind") == "nvmf-export"}
        new = [s for s in steps if s.nqn not in have]
        if new:
            rt.spdk().require({m for s in new for m in s.rpc_methods})
            Journal(state, rec, rt, lambda m: print(f"  {m}")).extend(new)
        return [s.nqn for s in new]


def unexport_all(state, name: str, rt) -> int:
    """Undo every export a running domain's record holds (the migration was
    aborted); how many there were."""
    for rec in state.records():
        if rec.domain == name and rec.status == "prepared":
            nqns = [e["data"].get("nqn") for e in rec.steps if e.get("kind") == "nvmf-export"]
            _unexport(state, rec.key, rt, nqns)
            return len(nqns)
    return 0


def _unexport(state, key: str, rt, nqns: list[str]) -> None:
    """Undo the exports this prepare added (the destination refused)."""
    from vstor.runtime.journal import Journal
    if not nqns:
        return
    with state.lock():
        rec = state.load(key)
        if rec is None:
            return
        status = rec.status
        Journal(state, rec, rt).rollback(
            keep=lambda _i, e: not (e.get("kind") == "nvmf-export" and e["data"].get("nqn") in nqns))
        if rec.steps:
            rec.status = status
            state.save(rec)


def forget(state, dom_name: str) -> None:
    """The migration is over (finished or aborted): the source's record, if
    the domain still has one here, no longer names it."""
    with state.lock():
        for rec in state.records():
            if rec.domain == dom_name and rec.migration:
                rec.migration = {}
                state.save(rec)


def _remember(state, dom: Domain, migration: dict) -> None:
    with state.lock():
        rec = state.load(dom.safe_name)
        if rec is not None and rec.domain == dom.name:
            rec.migration = migration
            state.save(rec)


def recorded_destination(state, name: str) -> str | None:
    for rec in state.records():
        if rec.domain == name and rec.migration.get("role") == "outgoing":
            return rec.migration.get("to")
    return None
