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
    hugepages: tuple[tuple[int, int, int], ...]   # (node, page KiB, count) per node
    memory: tuple[tuple[int, int], ...]   # (node, KiB) of ordinary memory bound, per node
    passthrough: frozenset[str]       # PCI addresses handed to the guest
    spdk_controllers: frozenset[str]  # local PCI addresses SPDK attaches for it
    volumes: frozenset[tuple[str, bool]]  # (volume key, read-only)
    sockets: frozenset[str]
    # (NVMe-oF path with host NQN, SPDK controller): SPDK has one per path.
    connections: frozenset[tuple[str, str]] = frozenset()
    cells: tuple[tuple[int, int], ...] = ()      # (guest cell, host node) of a guest with several

    @classmethod
    def from_plan(cls, plan: Plan, active: bool = False) -> "Holding":
        cells = [c for c in plan.guest_cells() if c.node is not None]
        pages = memory = ()
        if plan.hugepage_kib:
            pages = _per_node((c.node, plan.hugepage_kib, c.hugepages) for c in cells if c.hugepages)
        elif plan.numa != "none":
            memory = _per_node((c.node, c.memory_kib) for c in cells)
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
            cells=tuple((c.id, c.node) for c in plan.cells),
        )


def _per_node(amounts) -> tuple:
    """(node, ..., amount) summed per node (cells may share a host node)."""
    out: dict[tuple, int] = {}
    for *key, n in amounts:
        out[tuple(key)] = out.get(tuple(key), 0) + n
    return tuple((*k, n) for k, n in sorted(out.items()))


def node_amounts(value) -> list:
    """A record's hugepages or memory as a list of per-node lists: records
    written before guests had several cells hold one flat list."""
    if not value:
        return []
    return [list(v) for v in value] if isinstance(value[0], list) else [list(value)]


def connections(disks) -> list[tuple[str, str]]:
    """(path, SPDK controller) of each path of each NVMe-oF disk."""
    return [(nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, p.hostnqn), d.spdk_controller)
            for d in disks if d.source.kind == "nvmf" for p in d.attach]


def holding_to_json(h: Holding) -> dict:
    return {"domain": h.domain, "uuid": h.uuid, "node": h.node, "cpus": sorted(h.cpus),
            "reactors": list(h.reactors), "hugepages": [list(p) for p in h.hugepages] or None,
            "memory": [list(m) for m in h.memory] or None,
            "passthrough": sorted(h.passthrough), "spdk_controllers": sorted(h.spdk_controllers),
            "volumes": sorted([k, ro] for k, ro in h.volumes), "sockets": sorted(h.sockets),
            "connections": sorted([p, c] for p, c in h.connections),
            "cells": [list(c) for c in h.cells]}


def holding_from_json(d: dict, active: bool = True) -> Holding:
    """A holding as holding_to_json wrote it (and as older vstors did:
    node_amounts).  Every field is checked for the shape vstor writes, so
    a record that is not what vstor wrote is damaged (ValueError,
    TypeError), never half read."""
    if not isinstance(d, dict):
        raise TypeError("the holding is not an object")
    if not isinstance(d["domain"], str) or not (d.get("uuid") is None or isinstance(d["uuid"], str)) \
            or not (d.get("node") is None or _count(d["node"])):
        raise ValueError("the holding's domain, uuid or node is not what vstor writes")
    return Holding(domain=d["domain"], uuid=d.get("uuid"), active=active, node=d.get("node"),
                   cpus=frozenset(_items(d, "cpus", _count)),
                   reactors=tuple(_items(d, "reactors", _count)),
                   hugepages=tuple(map(tuple, _rows(node_amounts(_items(d, "hugepages", _any)), 3,
                                                    "hugepages"))),
                   memory=tuple(map(tuple, _rows(node_amounts(_items(d, "memory", _any)), 2, "memory"))),
                   passthrough=frozenset(_items(d, "passthrough", _text)),
                   spdk_controllers=frozenset(_items(d, "spdk_controllers", _text)),
                   volumes=frozenset(map(tuple, _items(d, "volumes", _pair(_text, _flag)))),
                   sockets=frozenset(_items(d, "sockets", _text)),
                   connections=frozenset(map(tuple, _items(d, "connections", _pair(_text, _text)))),
                   cells=tuple(map(tuple, _items(d, "cells", _pair(_count, _count)))))


def _count(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 62


def _text(v) -> bool:
    return isinstance(v, str)


def _flag(v) -> bool:
    return isinstance(v, bool)


def _any(v) -> bool:
    return True


def _pair(first, second):
    return lambda v: isinstance(v, list) and len(v) == 2 and first(v[0]) and second(v[1])


def _items(d: dict, key: str, ok) -> list:
    value = d.get(key, [])
    if value is None and key in ("hugepages", "memory"):    # holding_to_json's "none"
        value = []
    if not isinstance(value, list) or not all(ok(v) for v in value):
        raise ValueError(f"the holding's {key} is not what vstor writes")
    return value


def _rows(rows: list, width: int, key: str) -> list:
    if not all(len(r) == width and all(_count(n) for n in r) for r in rows):
        raise ValueError(f"the holding's {key} is not what vstor writes")
    return rows
