"""Can a domain live-migrate, disk by disk, and why not.  Pure: the source's
recorded plan, what the source knows of each local source (on storage the
destination sees, or not) and the destination's answer in; a verdict out.

    ready              the destination can serve it as it is
    can be made ready  vstor can make it so (local NVMe under SPDK: exported
                       over NVMe-oF from the source)
    cold only          shut down here, start there (passthrough)
    impossible         not without moving the data (a local file)

Before the destination is asked, this host says what each disk needs there
(`source_side`): attach (an NVMe-oF namespace it attaches too), export (local
NVMe under SPDK, exported from here), shared (a file or block device the
destination must see on the same storage), copy (on local storage: its data
would have to be copied, which vstor does not do), cold (passed through),
re-plan (local NVMe under qemu-storage-daemon), relayed (another host's NVMe).

`vstor migrate check --json` prints `report`: one object, version 1,

    {"version": 1, "domain": str, "destination": str,
     "answered": bool,              # did the destination answer?
     "error": str | null,           # why not (then verdict/live/cold are null)
     "verdict": str | null, "live": bool | null, "cold": bool | null,
     "disks": [{"target": str, "needs": str, "source": str,   # this host's side
                "verdict": str | null, "reason": str | null, "fix": str | null}],
     "destination_problems": [str], "placement": [str]}
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


@record
class DiskNeed:
    """What a disk needs on the destination, as this host alone can tell."""
    target: str
    needs: str
    reason: str


def source_side(plan: Plan, shared: dict[str, tuple[bool, str]], relayed: set[str],
                export_address: bool) -> tuple[DiskNeed, ...]:
    """Per disk, before the destination is asked.  `shared`: as for judge;
    `relayed`: targets that read another host's NVMe through its export."""
    out = []
    for d in plan.disks:
        src = d.source
        if d.target in relayed:
            need, why = "relayed", f"it reads another host's local NVMe through {src.traddr}'s export"
        elif d.mode == "passthrough":
            need, why = "cold", f"NVMe {d.controller} is passed through: shut down here, start there"
        elif src.kind == "nvmf":
            need, why = "attach", f"the destination attaches NVMe-oF {src.subnqn} namespace {src.namespace}"
        elif src.kind == "nvme" and d.backend == "spdk":
            need, why = "export", (f"local NVMe {src.controller} namespace {src.namespace}: this host exports "
                                   "it over NVMe-oF" + ("" if export_address else
                                                        " (set [migrate] export_address here first)"))
        elif src.kind == "nvme":
            need, why = "re-plan", (f"local NVMe {src.controller} under qemu-storage-daemon cannot be "
                                    "exported: re-plan it with backend='spdk'")
        else:
            on_shared, where = shared.get(d.target) or (False, "not looked at")
            need = "shared" if on_shared else "copy"
            why = (f"{src.path} is {where}: the destination must see it at the same path" if on_shared
                   else f"{src.path} is {where}: its data would have to be copied, which vstor does not do")
        out.append(DiskNeed(d.target, need, why))
    return tuple(out)


def report(domain: str, destination: str, side: tuple[DiskNeed, ...], verdict: "Verdict | None",
           error: str | None = None) -> dict:
    """The `migrate check --json` object (see the module's docstring)."""
    theirs = {d.target: d for d in verdict.disks} if verdict else {}
    disks = []
    for n in side:
        v = theirs.get(n.target)
        disks.append({"target": n.target, "needs": n.needs, "source": n.reason,
                      "verdict": v.verdict if v else None, "reason": v.reason if v else None,
                      "fix": v.fix if v else None})
    return {"version": 1, "domain": domain, "destination": destination,
            "answered": verdict is not None, "error": error,
            "verdict": verdict.verdict if verdict else None, "live": verdict.live if verdict else None,
            "cold": verdict.cold if verdict else None, "disks": disks,
            "destination_problems": list(verdict.problems) if verdict else [],
            "placement": list(verdict.placement) if verdict else []}


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
