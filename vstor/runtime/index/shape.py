"""What one state record contributes to the index (vstor.runtime.index):
its summary, the items looked up one by one, its part of the bounded sums,
and the file name of any item.  Pure functions of a record."""

from __future__ import annotations

import functools
import re

from vstor.meta.holding import holding_from_json, node_amounts
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


# -- what the index trusts of its files (root's, but a hand or a crash may have
# left anything there): the shape the functions above make, or a rebuild ------

def is_summary(s) -> bool:
    """Shaped as summary() makes it, as JSON gives it back."""
    if not (isinstance(s, dict) and isinstance(s.get("domain"), str) and type(s.get("active")) is bool
            and "uuid" in s and (s["uuid"] is None or isinstance(s["uuid"], str))
            and isinstance(s.get("holding"), dict) and isinstance(s.get("shared"), list)):
        return False
    if not all(isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("ident"), str)
               and e.get("state") in ("doing", "done") and isinstance(e.get("data"), dict)
               for e in s["shared"]):
        return False
    try:
        if s["holding"]:
            holding_from_json(s["holding"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def is_sums(s) -> bool:
    """Shaped as empty_sums() and add_sums make it (and the index's rebuild:
    `unread`), as JSON gives it back."""
    if not isinstance(s, dict) or not isinstance(s.get("boot"), str):
        return False
    holders, counts = ("cpus", "pass"), ("reactors", "pages", "memory")
    if not all(isinstance(s.get(t), dict) for t in holders + counts):
        return False
    pair = lambda x: isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x)  # noqa: E731
    if not all(isinstance(lst, list) and lst and all(map(pair, lst)) for t in holders for lst in s[t].values()):
        return False
    if not all(type(n) is int for t in counts for n in s[t].values()):
        return False
    keys = {"cpus": _NUMBER, "reactors": _NUMBER, "memory": _NUMBER, "pages": _PAGES}
    if not all(form.fullmatch(k) for t, form in keys.items() for k in s[t]):
        return False
    return all(isinstance(s.get(t, []), list) and all(isinstance(x, str) for x in s.get(t, []))
               for t in ("damaged", "unread"))


_NUMBER = re.compile(r"[0-9]{1,12}", re.ASCII)
_PAGES = re.compile(r"[0-9]{1,12}/[0-9]{1,12}", re.ASCII)


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
