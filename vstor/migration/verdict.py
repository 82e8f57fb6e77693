"""Can a domain live-migrate, disk by disk, and why not.  Pure: the source's
recorded plan, what the source knows of each local source (on storage the
destination sees, or not) and the destination's answer in; a verdict out.

    ready              the destination can serve it as it is
    can be made ready  vstor can make it so (local NVMe under SPDK: exported
                       over NVMe-oF from the source)
    cold only          shut down here, start there (passthrough)
    impossible         not without moving the data (a local file)
"""

from __future__ import annotations

from vstor.meta.plan import DiskPlan, Plan
from vstor.records import field, record

READY, MAKE_READY, COLD, IMPOSSIBLE = "ready", "can be made ready", "cold only", "impossible"
_ORDER = (READY, MAKE_READY, COLD, IMPOSSIBLE)


@record
class DiskVerdict:
    target: str
    verdict: str
    reason: str
    fix: str | None = None

    def to_json(self) -> dict:
        return {"target": self.target, "verdict": self.verdict, "reason": self.reason, "fix": self.fix}


@record
class Verdict:
    domain: str
    destination: str
    disks: tuple[DiskVerdict, ...]
    # Why the destination cannot take the domain now (cores, memory, ...).
    problems: tuple[str, ...] = ()
    # What the destination's plan would be, in one line each.
    placement: tuple[str, ...] = field(default=())

    @property
    def verdict(self) -> str:
        return max((d.verdict for d in self.disks), key=_ORDER.index, default=READY)

    @property
    def live(self) -> bool:
        """Can `vstor migrate prepare` go ahead for a live migration?"""
        return self.verdict in (READY, MAKE_READY) and not self.problems

    @property
    def cold(self) -> bool:
        """Can `vstor migrate prepare --cold` reserve the destination?"""
        return self.verdict != IMPOSSIBLE and not self.problems

    def to_json(self) -> dict:
        return {"domain": self.domain, "destination": self.destination, "verdict": self.verdict,
                "live": self.live, "disks": [d.to_json() for d in self.disks],
                "destination_problems": list(self.problems), "placement": list(self.placement)}


def judge(plan: Plan, shared: dict[str, tuple[bool, str]], seen: dict[str, str | None],
          destination: str, problems=(), placement=()) -> Verdict:
    """`shared`: target -> (on storage the destination can see, why) for file
    and block disks, as the source found it; `seen`: target -> None when the
    destination sees the same source, else why not."""
    disks = tuple(_disk(d, shared.get(d.target), seen.get(d.target, "was not asked"), destination,
                        plan.domain) for d in plan.disks)
    return Verdict(plan.domain, destination, disks, tuple(problems), tuple(placement))


def _disk(d: DiskPlan, shared, seen: str | None, dest: str, domain: str) -> DiskVerdict:
    src = d.source
    if d.mode == "passthrough":
        return DiskVerdict(d.target, COLD, f"NVMe {d.controller} is passed through to the guest, "
                           "and libvirt cannot live-migrate a PCI device",
                           f"vstor migrate prepare {domain} --to {dest} --cold, then shut it "
                           "down here and start it there")
    if src.kind == "nvmf":
        return DiskVerdict(d.target, READY, f"NVMe-oF {src.subnqn} namespace {src.namespace}: "
                           f"{dest} attaches the same subsystem")
    if src.kind == "nvme" and d.backend == "spdk":
        return DiskVerdict(d.target, MAKE_READY, f"local NVMe {src.controller} namespace "
                           f"{src.namespace} under SPDK: exported over NVMe-oF from this host "
                           "for the destination")
    if src.kind == "nvme":
        return DiskVerdict(d.target, IMPOSSIBLE, f"local NVMe {src.controller} namespace "
                           f"{src.namespace} is served by qemu-storage-daemon, which cannot "
                           "export it to another host", "re-plan it with backend='spdk' "
                           "(SPDK exports it over NVMe-oF)")
    on_shared, why = shared or (False, "not looked at")
    if not on_shared:
        return DiskVerdict(d.target, IMPOSSIBLE, f"{src.path} is {why}, which {dest} cannot see",
                           "put it on storage both hosts see and list that in [migrate] shared")
    if seen is not None:
        fix = (f"add that root to [migrate] shared in vstor.conf on {dest}" if "[migrate] shared" in seen
               else f"mount the same storage at the same path on {dest}")
        return DiskVerdict(d.target, IMPOSSIBLE, f"{src.path} is {why}, but {dest} {seen}", fix)
    return DiskVerdict(d.target, READY, f"{src.path} is {why}, and {dest} sees it")
