"""The host-wide ledger: what every other vstor domain holds.

Built from the plans recorded in defined domains and the state directory's
records of running ones; the planner consults it so that no core is
dedicated twice, no vCPU lands on a reactor, and no controller, volume or
socket is handed out twice.  Pure data: loading lives in `vstor.runtime.inventory`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vstor.meta.names import nvme_path, volume_keys
from vstor.meta.plan import Plan


@dataclass(frozen=True)
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


class Ledger:
    """Indexes over a set of holdings, built once (linear in their number)."""

    def __init__(self, holdings: tuple[Holding, ...] | list[Holding] = ()):
        self.holdings = tuple(holdings)
        self.cpu_owner: dict[int, str] = {}
        self.reactor_load: Counter[int] = Counter()
        self.passthrough: dict[str, str] = {}
        self.spdk_users: dict[str, list[str]] = {}
        self.volumes: dict[str, list[tuple[str, bool]]] = {}
        self.sockets: dict[str, str] = {}
        self.connections: dict[str, list[tuple[str, str]]] = {}   # path -> [(controller, domain)]
        self._pages: Counter[tuple[int, int]] = Counter()
        self._bound: Counter[int] = Counter()
        for h in self.holdings:
            self._index(h)

    def _index(self, h: Holding) -> None:
        for cpu in h.cpus:
            self.cpu_owner.setdefault(cpu, h.domain)
        self.reactor_load.update(h.reactors)
        for addr in h.passthrough:
            self.passthrough.setdefault(addr, h.domain)
        for addr in h.spdk_controllers:
            self.spdk_users.setdefault(addr, []).append(h.domain)
        for key, ro in h.volumes:
            self.volumes.setdefault(key, []).append((h.domain, ro))
        for sock in h.sockets:
            self.sockets.setdefault(sock, h.domain)
        for path, controller in h.connections:
            self.connections.setdefault(path, []).append((controller, h.domain))
        if h.hugepages and not h.active:
            node, size, count = h.hugepages
            self._pages[(node, size)] += count
        if h.memory:
            # Running or not: ordinary memory is counted against the node's
            # size, not its free memory (which the page cache moves).
            self._bound[h.memory[0]] += h.memory[1]

    def without(self, domain: str, uuid: str | None = None) -> "Ledger":
        """The ledger minus the domain being planned (re-planning is not a
        conflict): its name, and its UUID when both say one.  A holding with
        this UUID under another name stays: it is another domain's, or a
        borrowed UUID must not hide it."""
        keep = [h for h in self.holdings
                if not (h.domain == domain and (uuid is None or h.uuid is None or h.uuid == uuid))]
        if len(keep) == len(self.holdings):
            return self
        return Ledger(keep)

    def path_conflict(self, path: str, controller: str) -> str | None:
        """The domain whose SPDK controller of another name has this path."""
        return next((domain for name, domain in self.connections.get(path, ())
                     if name != controller), None)

    def promised_hugepages(self, node: int, size_kib: int) -> int:
        """Pages planned for defined domains that are not running: still in the
        free pool, but spoken for."""
        return self._pages[(node, size_kib)]

    def bound_memory_kib(self, node: int) -> int:
        """Ordinary (not hugepage) memory the domains hold bound to `node`."""
        return self._bound[node]

    def volume_conflict(self, keys: tuple[str, ...], readonly: bool) -> str | None:
        """The domain that already writes (or would be written under) this
        volume: one that holds any of its keys."""
        for key in keys:
            for domain, ro in self.volumes.get(key, ()):
                if not (ro and readonly):
                    return domain
        return None


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
