"""The index asked as the planner's ledger and as vstor.runtime.holders
(vstor.runtime.index.store keeps it): what every record but the asking
domain's holds, looked up one thing at a time."""

from __future__ import annotations

from collections import Counter

from vstor.runtime.index.shape import add_sums
from vstor.runtime.index.store import Index


class IndexLedger:
    """The planner's Ledger (vstor.planner.ledger), asked of the index: what
    every record but `exclude`'s holds."""

    def __init__(self, index: Index, exclude: frozenset[str] = frozenset()):
        self.index = index
        self.exclude = frozenset(exclude)
        sums = index.sums()
        if self.exclude:
            # The sums less what the excluded keys add to them, by the one
            # function that adds it (a copy of each table: add_sums replaces
            # their entries, never changes one in place).
            sums = {k: dict(v) if isinstance(v, dict) else v for k, v in sums.items()}
            for key in self.exclude:
                s = index.indexed(key)
                if s:
                    add_sums(sums, key, s, -1)
        self.cpu_owner = _owners(sums["cpus"], int)
        self.passthrough = _owners(sums["pass"], str)
        self.reactor_load: Counter[int] = Counter({int(c): n for c, n in sums["reactors"].items()})
        self._pages = Counter(sums["pages"])
        self._bound = Counter(sums["memory"])
        self.sockets = _Lookup(self, "sock")
        self.spdk_users = _Users(self, "spdk")

    def _domain(self, key: str) -> str:
        s = self.index.indexed(key)
        return s["domain"] if s else key

    def _keys(self, table: str, item: str) -> list[str]:
        return [k for k in self.index.holders(table, item) if k not in self.exclude]

    def without(self, domain: str, uuid: str | None = None) -> "IndexLedger":
        drop = set()
        for key in self._keys("name", domain):
            s = self.index.indexed(key)
            if not s:
                continue
            h = s["holding"] or {}
            theirs = h.get("uuid") if h.get("domain") else s.get("uuid")     # as Ledger.without: the holding's
            if (h.get("domain") or s["domain"]) == domain and (uuid is None or theirs is None or theirs == uuid):
                drop.add(key)
        return IndexLedger(self.index, self.exclude | drop) if drop else self

    @property
    def holdings(self) -> tuple:
        """Every holding: reads every key (a planner's whole-host view only)."""
        from vstor.meta.holding import holding_from_json
        out = []
        for key in self.index.keys() or ():
            s = self.index.indexed(key)
            if key not in self.exclude and s and s["holding"]:
                out.append(holding_from_json(s["holding"], active=s["active"]))
        return tuple(out)

    def running(self, domain: str) -> bool | None:
        for key in self._keys("name", domain):
            s = self.index.indexed(key)
            if s:
                return s["active"]
        return None

    def path_conflict(self, path: str, controller: str) -> str | None:
        for key in self._keys("conn", path):
            s = self.index.indexed(key) or {"holding": {}}
            if any(p == path and c != controller for p, c in s["holding"].get("connections", ())):
                return s["domain"]
        return None

    def promised_hugepages(self, node: int, size_kib: int) -> int:
        return self._pages[f"{node}/{size_kib}"]

    def bound_memory_kib(self, node: int) -> int:
        return self._bound[str(node)]

    def volume_conflict(self, keys: tuple[str, ...], readonly: bool) -> str | None:
        for vkey in keys:
            for key in self._keys("vol", vkey):
                s = self.index.indexed(key) or {"holding": {}}
                for k, ro in s["holding"].get("volumes", ()):
                    if k == vkey and not (ro and readonly):
                        return s["domain"]
        return None

    def namespace_users(self, address: str) -> set[str]:
        """The domains with a volume on a namespace of the NVMe controller at
        `address` (served by the kernel's driver or SPDK's)."""
        return {self._domain(k) for k in self._keys("nsuser", address)}


def _owners(table: dict, cast) -> dict:
    """item -> the first of its holders' domains."""
    return {cast(item): lst[0][1] for item, lst in table.items() if lst}


class _Lookup:
    """item -> the domain holding it (the first), asked one item at a time."""

    def __init__(self, ledger: IndexLedger, table: str):
        self.ledger, self.table = ledger, table

    def get(self, item, default=None):
        keys = self.ledger._keys(self.table, item)
        return self.ledger._domain(keys[0]) if keys else default

    def __contains__(self, item) -> bool:
        return bool(self.ledger._keys(self.table, item))

    def __getitem__(self, item):
        found = self.get(item)
        if found is None:
            raise KeyError(item)
        return found


class _Users(_Lookup):
    """item -> every domain holding it."""

    def get(self, item, default=None):
        keys = self.ledger._keys(self.table, item)
        return [self.ledger._domain(k) for k in keys] if keys else default


class FromIndex:
    """vstor.runtime.holders' question, asked of the index: another
    domain's journal entry on a shared thing; and whether a record could
    not be read (then nothing shared is undone)."""

    def __init__(self, index: Index, exclude: str):
        self.index, self.exclude = index, exclude

    def step(self, kind: str, ident: str, finished_only: bool) -> dict | None:
        self.index.sums()       # the records' names checked first (a record put there by hand)
        for key in self.index.holders(f"step.{kind}", ident):
            if key == self.exclude:
                continue
            s = self.index.indexed(key) or {"shared": []}
            for e in s["shared"]:
                if (e["kind"] == kind and e["ident"] == ident
                        and (e["state"] == "done" or not finished_only)):
                    return {k: v for k, v in e.items() if k != "ident"}
        return None

    @property
    def damaged(self) -> list[str]:
        return list(self.index.sums().get("damaged") or [])
