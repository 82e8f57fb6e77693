"""What one state record contributes to the index (vstor.runtime.index):
its summary, the items looked up one by one, its part of the bounded sums,
and the file name of any item.  Pure functions of a record."""

from __future__ import annotations

import functools

from vstor.meta.holding import node_amounts
from vstor.runtime.recordfile import INCOMING

# Step kinds two domains may share (a controller's vfio binding, an SPDK
# NVMe controller, an NVMe-oF export): another domain's entry is asked for
# by kind and identity (vstor.runtime.holders).
SHARED = frozenset({"vfio-bind", "spdk-attach", "nvmf-export"})


def summary(rec) -> dict | None:
    """What the index keeps of a record: who, what it holds, and its
    entries of the shared kinds (their identity with them)."""
    if rec is None:
        return None
    shared = []
    for e in rec.steps:
        if e.get("kind") in SHARED:
            shared.append({**e, "ident": _ident(e)})
    return {"domain": rec.domain, "uuid": rec.uuid, "active": rec.status != INCOMING,
            "holding": rec.holding, "shared": shared}


def _ident(entry: dict) -> str:
    from vstor.runtime.actions import from_json, identity
    try:
        return identity(from_json(entry))[1]
    except Exception:       # noqa: BLE001 (unreadable: its own record's problem; never matches)
        return ""


def items(s: dict) -> list[tuple[str, str]]:
    """(table, item) of every thing a summary holds that is looked up one by one."""
    h = s["holding"] or {}
    # By the holding's name when it has one: the planner's Ledger.without
    # matches what a holding says (its plan's domain and UUID).
    out = [("name", h.get("domain") or s["domain"])]
    out += [("sock", x) for x in h.get("sockets", ())]
    out += [("spdk", x) for x in h.get("spdk_controllers", ())]
    out += [("conn", p) for p, _c in h.get("connections", ())]
    for key, _ro in h.get("volumes", ()):
        out.append(("vol", key))
        if key.startswith("nvme:"):
            out.append(("nsuser", key[5:].split("/", 1)[0]))
    out += [(f"step.{e['kind']}", e["ident"]) for e in s["shared"] if e["ident"]]
    return sorted(set(out))


def add_sums(sums: dict, key: str, s: dict, sign: int) -> bool:
    """Add (sign +1) or take away (-1) what a summary holds to the bounded
    sums; True when that changed a table (most domains hold no dedicated
    core, passed-through controller, reactor, promise or bound memory)."""
    h = s["holding"] or {}
    holders = [("cpus", str(cpu)) for cpu in h.get("cpus", ())]
    holders += [("pass", addr) for addr in h.get("passthrough", ())]
    counts = [("reactors", str(cpu), sign) for cpu in h.get("reactors", ())]
    if not s["active"]:
        counts += [("pages", f"{node}/{size}", sign * count)
                   for node, size, count in node_amounts(h.get("hugepages"))]
    counts += [("memory", str(node), sign * kib) for node, kib in node_amounts(h.get("memory"))]
    for table, item in holders:
        _holders(sums[table], item, key, s["domain"], sign)
    for table, item, n in counts:
        _count(sums[table], item, n)
    return bool(holders or counts)


def _holders(table: dict, item: str, key: str, domain: str, sign: int) -> None:
    lst = [x for x in table.get(item, ()) if x[0] != key]
    if sign > 0:
        lst = sorted(lst + [[key, domain]])
    if lst:
        table[item] = lst
    else:
        table.pop(item, None)


def _count(table: dict, item: str, n: int) -> None:
    table[item] = table.get(item, 0) + n
    if not table[item]:
        del table[item]


def empty_sums() -> dict:
    return {"boot": boot_id(), "cpus": {}, "pass": {}, "reactors": {}, "pages": {},
            "memory": {}, "damaged": []}


@functools.cache        # one boot per process: asked at every change of the index
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def file_name(item: str) -> str:
    """A file name for any item: each byte that is not a letter, digit, _,
    + or - as %XX; a long one by its hash (the index never lists items
    back: they are in each key's summary)."""
    raw = str(item).encode("utf-8", "surrogatepass")
    out = "".join(map(_ESCAPED.__getitem__, raw)) or "%"
    if len(out) > 200:
        import hashlib
        return "#" + hashlib.sha256(raw).hexdigest()
    return out


_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")
_ESCAPED = tuple(chr(b) if b in _PLAIN else f"%{b:02X}" for b in range(256))
