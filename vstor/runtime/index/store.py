"""What every state record holds, kept beside the records so that a start,
a release or an attach asks only about the things it needs (is this core,
socket, volume or controller anyone else's?) and never reads every record:
its cost does not grow with the number of domains the host holds.

    <state_dir>/index/sums.json         what is bounded by the host's size:
                                        each dedicated core's and passed-through
                                        controller's holders, each reactor's
                                        load, hugepages promised and memory
                                        bound per node; the boot it belongs to
                                        and the records found damaged
    <state_dir>/index/keys/<key>.json   each record's summary as indexed
    <state_dir>/index/by/<table>/<item>/<key>
                                        one empty file per thing a record holds
                                        whose count grows with the domains
                                        (a socket, a volume, a domain's name...)
    <state_dir>/index/dirty             a change under way; found by the next
                                        run, it rebuilds the index

Everything here is derived from the records and written only by
StateDir.save and StateDir.remove, under the host lock, after the dirty
mark and around the record's own write: a run killed at any point leaves
the mark, and the next run that reads the index under the host lock
rebuilds it from the records (as it does when the index is missing or
unreadable, or was built in another boot: a power loss may have kept a
record's write and lost the index's).  A record that cannot be read when
the index is built is kept in sums.json's "damaged": every start then
refuses, as a damaged record always made it (docs/security.md), until gc
finds the records readable again.
"""

from __future__ import annotations

import contextlib
import json
import os

from vstor.runtime.state import DamagedRecord, INCOMING, _FIX

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


def _items(s: dict) -> list[tuple[str, str]]:
    """(table, item) of every thing a summary holds that is looked up one by one."""
    h = s["holding"] or {}
    out = [("name", s["domain"])]
    out += [("sock", x) for x in h.get("sockets", ())]
    out += [("spdk", x) for x in h.get("spdk_controllers", ())]
    out += [("conn", p) for p, _c in h.get("connections", ())]
    for key, _ro in h.get("volumes", ()):
        out.append(("vol", key))
        if key.startswith("nvme:"):
            out.append(("nsuser", key[5:].split("/", 1)[0]))
    out += [(f"step.{e['kind']}", e["ident"]) for e in s["shared"] if e["ident"]]
    return sorted(set(out))


def _add_sums(sums: dict, key: str, s: dict, sign: int) -> None:
    h = s["holding"] or {}
    for cpu in h.get("cpus", ()):
        _holders(sums["cpus"], str(cpu), key, s["domain"], sign)
    for addr in h.get("passthrough", ()):
        _holders(sums["pass"], addr, key, s["domain"], sign)
    for cpu in h.get("reactors", ()):
        _count(sums["reactors"], str(cpu), sign)
    if h.get("hugepages") and not s["active"]:
        node, size, count = h["hugepages"]
        _count(sums["pages"], f"{node}/{size}", sign * count)
    if h.get("memory"):
        node, kib = h["memory"]
        _count(sums["memory"], str(node), sign * kib)


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


def _empty_sums() -> dict:
    return {"boot": _boot_id(), "cpus": {}, "pass": {}, "reactors": {}, "pages": {},
            "memory": {}, "damaged": []}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _name(item: str) -> str:
    """A file name for any item: each byte that is not a letter, digit, _,
    + or - as %XX; a long one by its hash (the index never lists items
    back: they are in each key's summary)."""
    raw = str(item).encode("utf-8", "surrogateescape")
    out = "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in raw) or "%"
    if len(out) > 200:
        import hashlib
        return "#" + hashlib.sha256(raw).hexdigest()
    return out


_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")


class Index:
    """The index of one state directory (see the module's docstring)."""

    def __init__(self, state):
        self.state = state
        self.path = os.path.join(state.path, "index")
        self._sums: dict | None = None
        self._summaries: dict[str, dict | None] = {}

    def forget(self) -> None:
        """Drop what was read: another process may have changed the index
        since this one last held the host lock."""
        self._sums = None
        self._summaries = {}

    # -- reading (under the host lock) -------------------------------------

    def sums(self) -> dict:
        """sums.json, the index rebuilt first when it cannot be trusted."""
        if self._sums is None:
            self._sums = self._load_sums()
            if self._sums is None:
                self.rebuild()
        return self._sums

    def _held(self) -> bool:
        return self.state.holds_lock()

    def _load_sums(self) -> dict | None:
        if os.path.lexists(os.path.join(self.path, "dirty")):
            return None
        try:
            with open(os.path.join(self.path, "sums.json")) as f:
                sums = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(sums, dict) or sums.get("boot") != _boot_id() or \
                not all(isinstance(sums.get(k), dict) for k in ("cpus", "pass", "reactors", "pages", "memory")):
            return None
        if set(self.keys()) | set(sums.get("unread") or ()) != self._record_names():
            return None     # a record put there or removed by hand: read them all again
        return sums

    def _record_names(self) -> set[str]:
        try:
            return {n[:-5] for n in os.listdir(self.state.domains) if n.endswith(".json")}
        except FileNotFoundError:
            return set()

    def indexed(self, key: str) -> dict | None:
        """The summary of `key` the index holds (None: none)."""
        if key not in self._summaries:
            try:
                with open(os.path.join(self.path, "keys", key + ".json")) as f:
                    self._summaries[key] = json.load(f)
            except FileNotFoundError:
                self._summaries[key] = None
            except (OSError, ValueError):
                # Damaged: under the host lock, read every record again; a
                # reader without it gets "not what you have" (StateDir.save
                # then takes the lock and changes the index, rebuilding it).
                if not self._held():
                    return _UNREADABLE
                self.rebuild()
        return self._summaries.get(key)

    def holders(self, table: str, item: str) -> list[str]:
        """The keys holding `item` in `table`."""
        try:
            return sorted(os.listdir(os.path.join(self.path, "by", table, _name(item))))
        except FileNotFoundError:
            return []

    def keys(self) -> list[str]:
        try:
            return sorted(n[:-5] for n in os.listdir(os.path.join(self.path, "keys")) if n.endswith(".json"))
        except FileNotFoundError:
            return []

    def check_damaged(self) -> None:
        """Refuse (DamagedRecord) when a record could not be read when the
        index was built: what it holds is not known."""
        damaged = self.sums().get("damaged") or []
        if damaged:
            raise DamagedRecord(f"{damaged[0]}; what it holds cannot be known, so vstor decides "
                                "nothing that depends on it", hint=_FIX + ", then run: vstor gc")

    # -- changing (under the host lock) ------------------------------------

    def change(self, key: str, new: dict | None, write) -> None:
        """Run `write` (the record's own write) with the index following it:
        marked dirty before, the differences applied after."""
        self._summaries.pop(key, None)
        sums = self.sums()
        old = self.indexed(key)         # after sums(): a rebuild there read it again
        mark = os.path.join(self.path, "dirty")
        try:
            with open(mark, "w") as f:
                f.write(key)
            write()
            self._apply(self.path, sums, key, old, new)
            self._write_sums(self.path, sums)
            os.unlink(mark)
        except BaseException:
            self.forget()       # the mark stays (when it was made): the next read rebuilds
            raise

    def _apply(self, root: str, sums: dict, key: str, old: dict | None, new: dict | None) -> None:
        before = set(_items(old)) if old else set()
        after = set(_items(new)) if new else set()
        for table, item in sorted(after - before):
            d = os.path.join(root, "by", table, _name(item))
            os.makedirs(d, mode=0o700, exist_ok=True)
            open(os.path.join(d, key), "w").close()
        for table, item in sorted(before - after):
            d = os.path.join(root, "by", table, _name(item))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, key))
            with contextlib.suppress(OSError):      # another key holds it too
                os.rmdir(d)
        if old:
            _add_sums(sums, key, old, -1)
        if new:
            _add_sums(sums, key, new, +1)
        path = os.path.join(root, "keys", key + ".json")
        if new is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            _write_json(path, new)
        self._summaries[key] = new

    def _write_sums(self, root: str, sums: dict) -> None:
        _write_json(os.path.join(root, "sums.json"), sums)

    def rebuild(self, records=None, damaged: list[str] | None = None) -> None:
        """The index anew from every record (`records` and `damaged` when the
        caller has just read them under the host lock): built aside, then
        put in place."""
        if not self._held():
            with self.state.lock():
                return self.rebuild()
        if records is None:
            damaged = []
            records = self.state.records(damaged)
        self.state.drop_temporaries()
        import shutil
        new = self.path + ".new"
        shutil.rmtree(new, ignore_errors=True)
        os.makedirs(new, mode=0o700)
        sums = _empty_sums()
        sums["damaged"] = list(damaged or ())
        # The files no record came from: their going (by hand) is a change.
        sums["unread"] = sorted(self._record_names() - {r.key for r in records})
        self._summaries = {}
        for rec in records:
            self._apply(new, sums, rec.key, None, summary(rec))
        self._write_sums(new, sums)
        old = self.path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, old)
        os.rename(new, self.path)
        shutil.rmtree(old, ignore_errors=True)
        self._sums = sums

    def verify(self, records, damaged: list[str]) -> bool:
        """Does the index say exactly what `records` (every record, just read
        under the host lock) say: every summary, every sum, every item of
        every table?  Rebuilt when not; True when it was right."""
        sums = self._load_sums()
        want = _empty_sums()
        want["damaged"] = list(damaged)
        want["unread"] = sorted(self._record_names() - {r.key for r in records})
        items = set()
        for rec in records:
            s = plain(summary(rec))
            _add_sums(want, rec.key, s, +1)
            items.update((table, _name(item), rec.key) for table, item in _items(s))
        right = (sums is not None and {**sums, "boot": ""} == {**want, "boot": ""}
                 and set(self.keys()) == {r.key for r in records}
                 and all(self.indexed(r.key) == plain(summary(r)) for r in records)
                 and self._tables() == items)
        if not right:
            self.rebuild(records, damaged)
        return right

    def _tables(self) -> set[tuple[str, str, str]]:
        out = set()
        by = os.path.join(self.path, "by")
        for table in _listdir(by):
            for item in _listdir(os.path.join(by, table)):
                out.update((table, item, key) for key in _listdir(os.path.join(by, table, item)))
        return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


_UNREADABLE = {"unreadable": True}     # equal to no summary a record has


def plain(s: dict | None):
    """As JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(s)) if s is not None else None


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"), sort_keys=True)
    os.replace(tmp, path)


def reindex(state) -> bool:
    """gc's check of the index against every record, read again under the
    host lock (a record fixed or removed by hand, damaged in place, or a
    temporary file a killed save left): rebuilt when it differs.  True when
    it was right."""
    with state.lock():
        damaged: list[str] = []
        records = state.records(damaged)
        state.drop_temporaries()
        return state.index.verify(records, damaged)
