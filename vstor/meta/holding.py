"""What one vstor domain holds on the host (cores, reactors, hugepages,
controllers, volumes, sockets, NVMe-oF paths): made from its plan, kept in
its state record as JSON, read back into the ledger (vstor.planner.ledger).

Apart from the planner package, so that reading a state record (every
hook's release) does not start the planner.
"""

from __future__ import annotations

from vstor.meta.names import nvme_path, volume_keys
from vstor.records import record

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing (every hook imports this)
if TYPE_CHECKING:
    from vstor.meta.plan import Plan


@record
class Holding:
    domain: str
    uuid: str | None
    active: bool                      # running now (its hugepages are already taken)
    node: int | None
    cpus: frozenset[int]              # dedicated vCPU cores and reserved siblings
    reactors: tuple[int, ...]
    hugepages: tuple[int, int, int] | None   # (node, page KiB, count)
    memory: tuple[int, int] | None    # (node, KiB) of ordinary memory bound to a node
    passthrough: frozenset[str]       # PCI addresses handed to the guest
    spdk_controllers: frozenset[str]  # local PCI addresses SPDK attaches for it
    volumes: frozenset[tuple[str, bool]]  # (volume key, read-only)
    sockets: frozenset[str]
    # (NVMe-oF path with host NQN, SPDK controller): SPDK has one per path.
    connections: frozenset[tuple[str, str]] = frozenset()

    @classmethod
    def from_plan(cls, plan: Plan, active: bool = False) -> "Holding":
        pages = None
        if plan.hugepage_kib and plan.hugepages and plan.node is not None:
            pages = (plan.node, plan.hugepage_kib, plan.hugepages)
        memory = None
        if not plan.hugepage_kib and plan.numa != "none" and plan.node is not None:
            memory = (plan.node, plan.memory_kib)
        return cls(
            domain=plan.domain, uuid=plan.uuid, active=active, node=plan.node,
            cpus=plan.dedicated_cpus,
            reactors=tuple(d.reactor for d in plan.disks if d.reactor is not None),
            hugepages=pages, memory=memory,
            passthrough=frozenset(d.controller for d in plan.disks
                                  if d.mode == "passthrough" and d.controller),
            spdk_controllers=frozenset(d.controller for d in plan.disks
                                       if d.backend == "spdk" and d.controller),
            volumes=frozenset((key, d.readonly) for d in plan.disks for key in volume_keys(d.source)),
            sockets=frozenset(d.socket for d in plan.disks if d.socket),
            connections=frozenset(connections(plan.disks)),
        )


def connections(disks) -> list[tuple[str, str]]:
    """(path, SPDK controller) of each path of each NVMe-oF disk."""
    return [(nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, p.hostnqn), d.spdk_controller)
            for d in disks if d.source.kind == "nvmf" for p in d.attach]


def holding_to_json(h: Holding) -> dict:
    return {"domain": h.domain, "uuid": h.uuid, "node": h.node, "cpus": sorted(h.cpus),
            "reactors": list(h.reactors), "hugepages": list(h.hugepages) if h.hugepages else None,
            "memory": list(h.memory) if h.memory else None,
            "passthrough": sorted(h.passthrough), "spdk_controllers": sorted(h.spdk_controllers),
            "volumes": sorted([k, ro] for k, ro in h.volumes), "sockets": sorted(h.sockets),
            "connections": sorted([p, c] for p, c in h.connections)}


def holding_from_json(d: dict, active: bool = True) -> Holding:
    return Holding(domain=d["domain"], uuid=d.get("uuid"), active=active, node=d.get("node"),
                   cpus=frozenset(d.get("cpus", ())), reactors=tuple(d.get("reactors", ())),
                   hugepages=tuple(d["hugepages"]) if d.get("hugepages") else None,
                   memory=tuple(d["memory"]) if d.get("memory") else None,
                   passthrough=frozenset(d.get("passthrough", ())),
                   spdk_controllers=frozenset(d.get("spdk_controllers", ())),
                   volumes=frozenset((k, ro) for k, ro in d.get("volumes", ())),
                   sockets=frozenset(d.get("sockets", ())),
                   connections=frozenset((p, c) for p, c in d.get("connections", ())))
