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

A run that decides from the index (sums(): the ledger, the check for
damaged records, the shared steps' holders) first lists the records'
directory, once per taking of the host lock, and compares its names with
the keys indexed: a record put there or removed by hand is read (the index
rebuilt) before anything is decided.  A change (StateDir.save, remove)
does not list it: what it leaves is listed by the next decision.

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

from vstor import counters
from vstor.errors import Unavailable
from vstor.runtime.index.shape import (add_sums, boot_id, empty_sums, file_name, is_sums, is_summary,
                                       items, summary)
from vstor.runtime.recordfile import FIX, DamagedRecord, create_empty, read_json, write_text

class Index:
    """The index of one state directory (see the module's docstring).
    Its paths are put together with f-strings, not os.path.join: every
    part is a fixed name, a record key (vstor.meta.names.is_safe_name) or
    an item's file_name, none with a slash, and gc joins tens of
    thousands of them."""

    def __init__(self, state):
        self.state = state
        self.path = os.path.join(state.path, "index")
        self._sums: dict | None = None
        self._summaries: dict[str, dict | None] = {}
        self._taken = state.lock_taken()     # what is cached was read under this taking
        self._listed = False        # the records' names compared with the keys, under this taking

    def forget_key(self, key: str) -> None:
        self._summaries.pop(key, None)

    def forget(self) -> None:
        """Drop what was read: another process may have changed the index
        since this one last held the host lock."""
        self._sums = None
        self._summaries = {}
        self._listed = False

    # -- reading (under the host lock) -------------------------------------

    def _fresh(self) -> None:
        """Forget what was read under an earlier taking of the host lock:
        another process may have changed the index since."""
        if self._taken != self.state.lock_taken():
            self.forget()
            self._taken = self.state.lock_taken()

    def sums(self, listed: bool = True) -> dict:
        """sums.json, the index rebuilt first when it cannot be trusted;
        with `listed` (what a decision reads), also when the records'
        names are not the keys indexed."""
        self._fresh()
        if self._sums is None:
            self._sums = self._load_sums()
        if self._sums is not None and listed and not self._listed:
            if not self._same_names(self._sums):
                self._sums = None
            self._listed = self._held()
        if self._sums is None:
            self.rebuild()
        return self._sums

    def _held(self) -> bool:
        return self.state.holds_lock()

    def trusted(self) -> dict | None:
        """sums.json if the index can be trusted as it is (the records'
        names listed), else None (read only: nothing is rebuilt)."""
        self._fresh()
        if self._sums is None:
            self._sums = self._load_sums()
        if self._sums is not None and not self._same_names(self._sums):
            return None
        return self._sums

    def _load_sums(self) -> dict | None:
        if os.path.lexists(os.path.join(self.path, "dirty")):
            return None
        try:
            sums = read_json(os.path.join(self.path, "sums.json"))
        except (OSError, ValueError):
            return None
        if not is_sums(sums) or sums["boot"] != boot_id():
            return None
        return sums

    def _same_names(self, sums: dict) -> bool:
        """The records' directory holds the records indexed (and those
        unread at the last rebuild): none put there or removed by hand."""
        keys = self.keys()
        return keys is not None and set(keys) | set(sums.get("unread") or ()) == self._record_names()

    def _record_names(self) -> set[str]:
        try:
            return {n[:-5] for n in os.listdir(self.state.domains) if n.endswith(".json")}
        except FileNotFoundError:
            return set()

    def indexed(self, key: str, rebuild: bool = True) -> dict | None:
        """The summary of `key` the index holds (None: none).  A keys file
        that cannot be read, or is missing while its record is there, is
        damage: under the host lock (and `rebuild`) every record is read
        again; otherwise UNREADABLE, which no summary equals (StateDir.save
        then takes the lock and changes the index, rebuilding it)."""
        self._fresh()
        if key not in self._summaries:
            try:
                s = read_json(f"{self.path}/keys/{key}.json")
                if not is_summary(s):
                    raise ValueError("not a summary as vstor writes it")
                self._summaries[key] = s
            except FileNotFoundError:
                if not os.path.lexists(f"{self.state.domains}/{key}.json"):
                    self._summaries[key] = None
                    return None
                return self._damaged_key(key, rebuild)
            except (OSError, ValueError):
                return self._damaged_key(key, rebuild)
        return self._summaries.get(key)

    def _damaged_key(self, key: str, rebuild: bool):
        if not (rebuild and self._held()):
            return UNREADABLE
        self.rebuild()          # fills the summaries again, this key's with them
        return self._summaries.get(key)

    def holders(self, table: str, item: str) -> list[str]:
        """The keys holding `item` in `table`.  A part of by/ that is not a
        directory (a file, a FIFO, a link in a loop) is damage: under the
        host lock the index is rebuilt and asked again."""
        path = f"{self.path}/by/{table}/{file_name(item)}"
        for again in (True, False):
            try:
                return sorted(os.listdir(path))
            except FileNotFoundError:
                return []
            except OSError as e:
                if not (again and self._held()):
                    raise Unavailable(f"cannot read the index {path}: {e.strerror}",
                                      hint="see what is at that name (vstor makes only directories in "
                                           "index/by); vstor gc builds the index again") from None
                self.rebuild()
        return []

    def keys(self) -> list[str] | None:
        """The keys indexed; None when keys/ is there but cannot be listed
        (not a directory, a link in a loop): the index is then damaged."""
        try:
            return sorted(n[:-5] for n in os.listdir(os.path.join(self.path, "keys")) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        except OSError:
            return None

    def check_damaged(self) -> None:
        """Refuse (DamagedRecord) when a record could not be read when the
        index was built: what it holds is not known."""
        damaged = self.sums().get("damaged") or []
        if damaged:
            raise DamagedRecord(f"{damaged[0]}; what it holds cannot be known, so vstor decides "
                                "nothing that depends on it", hint=FIX + ", then run: vstor gc")

    # -- changing (under the host lock) ------------------------------------

    def change(self, key: str, new: dict | None, write) -> None:
        """Run `write` (the record's own write) with the index following it:
        marked dirty before, the differences applied after."""
        self.forget_key(key)
        sums = self.sums(listed=False)
        old = self.indexed(key)         # after sums(): a rebuild there read it again
        mark = os.path.join(self.path, "dirty")
        try:
            create_empty(mark, key)
            write()
            try:
                if self._apply(self.path, sums, key, old, new):
                    self._write_sums(self.path, sums)
            except OSError:     # by/ or a name in it not as vstor made it: the records say it all
                self.rebuild()
                return
            os.unlink(mark)
        except BaseException:
            self.forget()       # the mark stays (when it was made): the next read rebuilds
            raise

    def _apply(self, root: str, sums: dict, key: str, old: dict | None, new: dict | None) -> bool:
        """`key`'s entries from `old` to `new`; True when the sums changed
        (sums.json is then to be written)."""
        before = set(items(old)) if old else set()
        after = set(items(new)) if new else set()
        for table, item in sorted(after - before):
            d = f"{root}/by/{table}/{file_name(item)}"
            os.makedirs(d, mode=0o700, exist_ok=True)
            create_empty(f"{d}/{key}")
        for table, item in sorted(before - after):
            d = f"{root}/by/{table}/{file_name(item)}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{d}/{key}")
            with contextlib.suppress(OSError):      # another key holds it too
                os.rmdir(d)
        moved = False
        if old:
            moved = add_sums(sums, key, old, -1)
        if new:
            moved = add_sums(sums, key, new, +1) or moved
        path = f"{root}/keys/{key}.json"
        if new is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            _write_json(path, new)
        self._summaries[key] = new
        return moved

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
        counters.add("rebuild", ())
        self.state.drop_temporaries()
        new = self.path + ".new"
        _discard(new)
        os.makedirs(new, mode=0o700)
        sums = empty_sums()
        sums["damaged"] = list(damaged or ())
        # The files no record came from: their going (by hand) is a change.
        sums["unread"] = sorted(self._record_names() - {r.key for r in records})
        self._summaries = {}
        for rec in records:
            self._apply(new, sums, rec.key, None, summary(rec))
        self._write_sums(new, sums)
        old = self.path + ".old"
        _discard(old)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, old)
        os.rename(new, self.path)
        _discard(old)
        self._sums = sums
        self._listed = self._held()

    def verify(self, records, damaged: list[str]) -> bool:
        """Does the index say exactly what `records` (every record, just read
        under the host lock) say: every summary, every sum, every item of
        every table?  Rebuilt when not; True when it was right."""
        sums = self._load_sums()
        want = empty_sums()
        want["damaged"] = list(damaged)
        want["unread"] = sorted(self._record_names() - {r.key for r in records})
        entries = set()
        # Read from their files, so plain JSON already (StateDir.save makes its own plain).
        summaries = {rec.key: summary(rec) for rec in records}
        for key, s in summaries.items():
            add_sums(want, key, s, +1)
            entries.update((table, file_name(item), key) for table, item in items(s))
        keys = self.keys()
        right = (sums is not None and {**sums, "boot": ""} == {**want, "boot": ""}
                 and keys is not None and set(keys) == set(summaries)
                 and all(self.indexed(key) == s for key, s in summaries.items())
                 and self._tables() == entries)
        if not right:
            self.rebuild(records, damaged)
        return right

    def _tables(self) -> set[tuple[str, str, str]]:
        out = set()
        by = f"{self.path}/by"
        for table in _listdir(by):
            for item in _listdir(f"{by}/{table}"):
                out.update((table, item, key) for key in _listdir(f"{by}/{table}/{item}"))
        return out


def _discard(path: str) -> None:
    """What a killed rebuild left at `path` (index.new, index.old), or
    whatever else is at that name: a link goes, never what it points at
    (shutil.rmtree refuses a link, and the makedirs or rename after it
    then failed every run)."""
    import shutil       # the hook's release path reads the index: only a rebuild needs it
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


UNREADABLE = {"unreadable": True}     # equal to no summary a record has


def plain(s: dict | None):
    """As JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(s)) if s is not None else None


def _write_json(path: str, data) -> None:
    write_text(path, json.dumps(data, separators=(",", ":"), sort_keys=True))  # json's C encoder


def reindex(state, records=None, damaged: list[str] | None = None) -> bool:
    """gc's check of the index against every record (a record fixed or
    removed by hand, damaged in place, or a temporary file a killed save
    left): rebuilt when it differs.  `records` and `damaged`: every record,
    just read by the caller under the host lock it holds; else read here
    under it.  True when it was right."""
    with state.lock():
        if records is None:
            damaged = []
            records = state.records(damaged)
        state.drop_temporaries()
        return state.index.verify(records, list(damaged or ()))
