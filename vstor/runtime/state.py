"""The state directory: one JSON record per domain of everything vstor did for
it, written atomically before each change, and three kinds of lock:

- the planning lock serialises every run that plans what a domain will hold
  and records the plan (apply, define, pve apply, attach, a migration's
  incoming side): taken before the ledger is read, let go once the plan is
  written (the domain definition, the Proxmox config and plan, the record),
  so two runs never plan the same cores, memory or device;
- the host lock serialises every process that decides what a domain holds
  (the ledger is read and a record written under it), and every change to
  state two domains share (a controller's binding, an SPDK NVMe controller,
  an NVMe-oF export);
- a record lock per domain serialises everything that reads and writes that
  domain's record: a domain's own daemons start and stop under it alone, so
  other domains are planned meanwhile.

Order: the planning lock, then a record lock, then the host lock, never the
other way round (planning() refuses to be taken under the other two).  A
Proxmox VM's config lock (qemu-server's) comes before all three: qemu-server
holds it around the hookscript, pve apply takes it first.

    <state_dir>/plan.lock         the planning lock (flock(2) of the file)
    <state_dir>/lock              the host lock (flock(2) of the file), and
                                  the record locks (a byte of it per domain)
    <state_dir>/domains/<key>.json
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from vstor.errors import BadInput, Unavailable
from vstor.locking import flocked, range_locked, try_range
from vstor.meta.names import is_safe_name
from vstor.records import field, record
from vstor.runtime.index import Index, plain, summary
# The statuses and DamagedRecord are named here too, where a record's readers look.
from vstor.runtime.recordfile import (EXPORTING, FIX, INCOMING, PREPARED, PREPARING,  # noqa: F401
                                      RECORD_FORMAT, RELEASING, REPAIRED, REPAIRING, UNDOING,
                                      DamagedRecord, NotAFile,
                                      check_format, check_shape, check_trusted, make_dirs, read_json,
                                      write_text)


@record(frozen=False)
class Record:
    key: str                      # the domain's safe name: the file name
    domain: str
    uuid: str | None
    status: str = PREPARING
    holding: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    updated: float = 0.0
    # A migration under way: {"role": "incoming", "xml": ..., "from": ...} on
    # the destination, {"role": "outgoing", "to": ..., "xml_file": ...} on the source.
    migration: dict = field(default_factory=dict)
    # The SPDK application its SPDK steps were made through (its JSON-RPC
    # socket): their undo asks the same one, whatever vstor.conf says now.
    spdk_socket: str | None = None
    # The last repair of the running domain's pinning (vstor.runtime.drift):
    # {"status": "repairing" | "done" | "undoing", "at": its time,
    # "changes": [{"what", "item", "have", "want"}, ...]}, written before its
    # first change; kept once done, for `vstor repair --undo`.
    repair: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"format": RECORD_FORMAT, "key": self.key, "domain": self.domain, "uuid": self.uuid,
               "status": self.status, "holding": self.holding, "steps": self.steps,
               "updated": self.updated}
        if self.spdk_socket:
            out["spdk_socket"] = self.spdk_socket
        if self.repair:
            out["repair"] = self.repair
        return {**out, "migration": self.migration} if self.migration else out

    @classmethod
    def from_json(cls, data: dict) -> "Record":
        return cls(key=data["key"], domain=data["domain"], uuid=data.get("uuid"),
                   status=data.get("status", PREPARING), holding=data.get("holding", {}),
                   steps=list(data.get("steps", [])), updated=data.get("updated", 0.0),
                   migration=dict(data.get("migration") or {}), spdk_socket=data.get("spdk_socket"),
                   repair=dict(data.get("repair") or {}))


class StateDir:
    def __init__(self, path: str):
        self.path = path
        self.domains = os.path.join(path, "domains")
        self.lock_file = os.path.join(path, "lock")       # the host lock and the record locks
        self._index = None

    def trusted(self) -> "StateDir":
        """Refuse (Unavailable) a state directory anyone but root may change
        (recordfile.check_trusted); every use of the directory asks first."""
        check_trusted(self.path)
        return self

    @property
    def index(self):
        """What every record holds, kept beside them (vstor.runtime.index)."""
        if self._index is None:
            # One per directory in a process: two StateDirs of one path in
            # one taking of the host lock must not keep two views of it.
            where = os.path.realpath(self.path)
            self.trusted()
            self._index = _INDEXES.get(where) or _INDEXES.setdefault(where, Index(self))
        return self._index

    def _ensure(self) -> None:
        self.trusted()
        try:
            make_dirs(self.domains, private=(self.path, self.domains))
        except OSError as e:
            raise Unavailable(f"cannot create state directory {self.path}: {e.strerror}",
                              hint="run as root or set [paths] state_dir in vstor.conf") from None
        self.trusted()      # what was made: a name on the way may have been someone else's by then

    @contextlib.contextmanager
    def lock(self, timeout: float = 60.0, dry_run: bool = False):
        """Exclusive host-wide lock: two vstor processes never allocate at once.
        A dry run creates nothing: without a state directory there is nothing
        to lock against.  Re-entrant within a process."""
        path = self.lock_file
        if (dry_run and not os.path.isdir(self.path)) or _HELD.get(path):
            yield self
            return
        self._ensure()
        with flocked(path, f"{self.path}/lock", timeout, create=True), _holding(path):
            _TAKEN[path] = _TAKEN.get(path, 0) + 1      # what was read before may have changed
            yield self

    @contextlib.contextmanager
    def planning(self, timeout: float = 120.0, dry_run: bool = False):
        """The planning lock (see the module's docstring).  A dry run records
        nothing and takes none.  Re-entrant within a process."""
        path = os.path.join(self.path, "plan.lock")
        if dry_run or _HELD.get(path):
            yield self
            return
        under = [p for p in _HELD if p.startswith(self.path + os.sep)]
        if under:
            raise RuntimeError(f"the planning lock is taken before {under[0]}, never under it")
        self._ensure()
        with flocked(path, f"the planning lock {path} (another vstor run is planning)",
                     timeout, create=True), _holding(path):
            yield self

    @contextlib.contextmanager
    def record_lock(self, key: str, timeout: float = 120.0, dry_run: bool = False):
        """One domain's record, exclusively (see the module's docstring).
        Re-entrant within a process."""
        held = f"{self._file(key)}#lock"
        if (dry_run and not os.path.isdir(self.path)) or _HELD.get(held):
            yield self
            return
        self._ensure()
        with range_locked(self.lock_file, key,
                          f"the state record of '{key}' (a vstor run for it is under way):",
                          timeout), _holding(held):
            if not dry_run:     # what a killed save of this record left (its record is whole)
                _drop(self._file(key) + ".tmp")
            yield self

    @contextlib.contextmanager
    def repair_lock(self, key: str, dry_run: bool = False):
        """One `vstor repair` of a domain at a time, refused at once when
        another holds it (a byte of <state_dir>/repair.lock).  Taken before
        the record lock, and held while libvirt is asked and told: the hooks
        never take it, so a stop's release waiting for the record lock never
        waits on a repair that waits on libvirt (which runs that release
        with the domain locked)."""
        if dry_run and not os.path.isdir(self.path):
            yield self
            return
        self._ensure()
        path = os.path.join(self.path, "repair.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise Unavailable(f"cannot lock {path}: {e.strerror}", hint="run as root") from None
        try:
            if not try_range(fd, key):
                from vstor.errors import InUse
                raise InUse(f"another vstor repair of '{key}' is under way",
                            hint=f"let it finish (vstor status {key})")
            yield self
        finally:
            os.close(fd)        # and with it the byte

    def holds_lock(self) -> bool:
        """This process holds the host lock."""
        return bool(_HELD.get(self.lock_file))

    def lock_taken(self) -> int:
        """How many times this process has taken the host lock: what it read
        of shared state under an earlier one may have changed since."""
        return _TAKEN.get(self.lock_file, 0)

    def busy(self, key: str) -> bool:
        """A run holds the domain's record lock right now (in another process)."""
        if _HELD.get(f"{self._file(key)}#lock"):
            return False
        self.trusted()
        try:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            return not try_range(fd, key)
        finally:
            os.close(fd)        # and with it the byte, if it was taken

    def drop_temporaries(self) -> None:
        """A record is saved under its record lock, so a temporary file
        whose record nobody holds is what a killed writer left: its record
        (the file it was to replace) is still whole.  Only names save()
        makes.  Each record lock drops its own; this (the index's rebuild,
        gc) the ones of records nobody locked since."""
        self.trusted()
        try:
            names = os.listdir(self.domains)
        except FileNotFoundError:
            return
        for name in names:
            if name.endswith(".json.tmp") and is_safe_name(name[:-9]) and not self.busy(name[:-9]):
                with contextlib.suppress(OSError):      # a directory there is not save()'s
                    os.unlink(os.path.join(self.domains, name))

    def _file(self, key: str) -> str:
        if not is_safe_name(key):
            raise BadInput(f"'{key}' cannot name a state record")
        return f"{self.domains}/{key}.json"     # a safe name: no slash in it

    def load(self, key: str) -> Record | None:
        """The record, None when there is none; a damaged one blocks its
        domain (DamagedRecord, exit 4); records() says what else it blocks."""
        path = self._file(key)
        self.trusted()
        try:
            data = read_json(path)
            check_format(data, path)
            rec = Record.from_json(data)
            check_shape(rec)
        except FileNotFoundError:
            return None
        except NotAFile as e:
            raise DamagedRecord(f"state record {path} is damaged ({e.strerror})", hint=FIX) from None
        except OSError as e:
            raise Unavailable(f"cannot read state record {path}: {e.strerror}",
                              hint="run vstor as root") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DamagedRecord(f"state record {path} is damaged ({type(e).__name__}: {e})",
                                hint=FIX) from None
        if rec.key != key:
            raise DamagedRecord(f"state record {path} is damaged (it says key {rec.key!r})",
                                hint=FIX)
        return rec

    def unchanged(self, rec: Record) -> bool:
        """The record's file says just what `rec` (read by load(), and so
        checked) says, compared as read, without making and checking a
        Record again (gc asks it of every record it releases).  False also
        when the file cannot be read, or is of an older format: load() then
        says why, or reads it."""
        self.trusted()
        try:
            return read_json(self._file(rec.key)) == rec.to_json()
        except (OSError, ValueError):
            return False

    def records(self, damaged: list[str] | None = None) -> list[Record]:
        """Every record.  A damaged one (or a file whose name cannot be a
        record's) holds what nobody can tell, so by default it refuses
        (DamagedRecord, exit 4): whoever reads every record decides from
        them what is free or unused, and must not take "unreadable" for
        "holds nothing".  Only a reader that reports it and decides nothing
        from the rest alone (status, gc, which then leaves what it may own)
        passes `damaged`: it is left where it is and named there."""
        self.trusted()
        try:
            names = sorted(os.listdir(self.domains))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                rec = self.load(name[:-5])
            except (DamagedRecord, BadInput) as e:
                what = e.message if isinstance(e, DamagedRecord) else \
                    f"{os.path.join(self.domains, name)}: {e.message}"
                if damaged is None:
                    raise DamagedRecord(f"{what}; what it holds cannot be known, so vstor decides "
                                        "nothing that depends on it", hint=FIX) from None
                damaged.append(str(e) if isinstance(e, DamagedRecord) else what)
                continue
            if rec is not None:
                out.append(rec)
        return out

    def save(self, rec: Record) -> None:
        """Atomic: write a temporary file, fsync it, rename it over the
        record.  A change to what the record holds (vstor.runtime.index.summary)
        goes into the index too, under the host lock."""
        self._ensure()
        rec.updated = time.time()
        self._change(rec.key, rec, lambda: self._write(rec))

    def _write(self, rec: Record) -> None:
        path = self._file(rec.key)
        # One line, by json's C encoder: indenting takes its Python one, ten
        # times the cost, at every save (python3 -m json.tool FILE shows it
        # indented).
        text = json.dumps(rec.to_json(), sort_keys=True, separators=(",", ":")) + "\n"
        try:
            write_text(path, text, sync=True)
        except OSError as e:
            raise Unavailable(f"cannot write state record {path}: {e.strerror}",
                              hint="see what is at that name; vstor writes only regular files "
                                   "there") from None
        _fsync_dir(self.domains)

    def remove(self, key: str) -> None:
        self._change(key, None, lambda: self._unlink(key))

    def _unlink(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(key))
        _fsync_dir(self.domains)

    def _change(self, key: str, rec: Record | None, write) -> None:
        new = plain(summary(rec))
        if new is not None:     # a removal changes the index (unless it lacked the key)
            self.index.forget_key(key)      # as the index says now, not as this process read it
            if self.index.indexed(key) == new:
                write()     # holds what it held: its own record lock is enough
                return
        with self.lock():
            self.index.change(key, new, write)


_HELD: dict[str, int] = {}      # lock paths this process holds (re-entrancy)
_INDEXES: dict = {}             # the Index of each state directory (StateDir.index)
_TAKEN: dict[str, int] = {}     # how many times each was taken (not re-entered)


@contextlib.contextmanager
def _holding(path: str):
    _HELD[path] = _HELD.get(path, 0) + 1
    try:
        yield
    finally:
        _HELD[path] -= 1
        if not _HELD[path]:
            del _HELD[path]


def _drop(tmp: str) -> None:
    """A record's temporary file, gone; anything else at its name (a
    directory) is not save()'s to remove, and no save could be made."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise Unavailable(f"cannot write state records: {tmp}: {e.strerror}",
                          hint="see what is at that name; vstor writes only regular files there") from None


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
