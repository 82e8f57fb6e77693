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
    plan = plan_of(dom)
    files = files_to_check(plan)
    facts = {t: shared(cfg, f["path"]) for t, f in files.items()}
    there = peer.call("check", xml=dom.to_string(), files=files)
    seen = {t: there.get("seen", {}).get(t, "did not say") for t in files}
    return judge(plan, facts, seen, peer.host, there.get("problems", ()), there.get("placement", ()))


def prepare(cfg: Config, state, dom: Domain, peer: Peer, dest_uri: str, cold: bool = False) -> tuple[Verdict, str]:
    """The destination's backends made and held; the XML the domain will
    arrive with.  Refused, with every reason, unless the verdict allows it."""
    verdict = check(cfg, dom, peer)
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
    if any(d.verdict == MAKE_READY for d in verdict.disks):
        raise DoesNotFit(f"domain '{dom.name}': exporting local NVMe over NVMe-oF for a migration "
                         "is not built yet", hint="migrate it cold, or put the disk on NVMe-oF")
    answer = peer.call("prepare", xml=dom.to_string(), **{"from": socket.gethostname()})
    _remember(state, dom, {"role": "outgoing", "to": peer.host, "uri": dest_uri})
    return verdict, answer["xml"]


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
