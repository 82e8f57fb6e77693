"""The index of holdings (vstor.runtime.index) against the records it is
derived from.

The judge is the ledger the planner always had, built from every record
(vstor.planner.ledger.Ledger over holding_of each record): after any
sequence of saves and removes, a rebuild from the records finds nothing to
change (verify), and every question the planner and the steps ask gets the
same answer from the index as from the records.  A run killed at any write
of the index, a damaged or missing index, one from another boot, and
records put there or removed by hand all end in an index that says what
the records say.  Flatness is checked structurally: a start opens no other
domain's record, and gc loads each record a bounded number of times."""

import builtins
import json
import os
import random
import signal

import pytest

from vstor.planner.ledger import Ledger
from vstor.runtime import holders
from vstor.runtime import index as idx
from vstor.runtime.holders import FromRecords, holding_of
from vstor.runtime.index import shape
from vstor.runtime.state import INCOMING, PREPARED, DamagedRecord, Record, StateDir

CTRLS = [f"0000:{b:02x}:00.0" for b in range(0x10, 0x16)]


def _holding(r: random.Random, name: str) -> dict:
    node = r.randrange(2)
    disks = r.randrange(0, 4)
    vols = []
    for i in range(disks):
        if r.random() < 0.3:
            vols.append([f"nvme:{r.choice(CTRLS)}/{r.randrange(1, 3)}", r.random() < 0.5])
        else:
            vols.append([f"file:/images/{r.choice(['a', 'b', 'c', name])}-{i}.raw", r.random() < 0.5])
    return {"domain": name, "uuid": None, "node": node,
            "cpus": sorted(r.sample(range(64), r.randrange(0, 3))),
            "reactors": [r.choice((2, 18)) for _ in range(r.randrange(0, 3))],
            "hugepages": [node, 2048, r.randrange(1, 512)] if r.random() < 0.4 else None,
            "memory": [node, r.randrange(1, 8) << 20] if r.random() < 0.4 else None,
            "passthrough": sorted(set(r.sample(CTRLS, r.randrange(0, 2)))),
            "spdk_controllers": sorted(set(r.sample(CTRLS, r.randrange(0, 2)))),
            "volumes": sorted(vols),
            "sockets": sorted({f"/run/vstor/vhost/{r.choice([name, 'shared'])}-vd{c}" for c in "bcd"[:disks]}),
            "connections": sorted([f"rdma://10.0.0.{r.randrange(3)}:4420/nqn.x", f"vs_nvmf_{r.randrange(3)}"]
                                  for _ in range(r.randrange(0, 2)))}


def _steps(r: random.Random, h: dict) -> list[dict]:
    out = []
    for addr in h["spdk_controllers"]:
        out.append({"kind": "vfio-bind", "state": r.choice(("doing", "done")), "data": {"address": addr}})
        out.append({"kind": "spdk-attach", "state": r.choice(("doing", "done")),
                    "data": {"name": "vs_" + addr.replace(":", "_").replace(".", "_"),
                             "paths": [{"name": "x", "trtype": "PCIe", "traddr": addr}]}})
    return out


def _record(r: random.Random, name: str) -> Record:
    h = _holding(r, name)
    return Record(key=name, domain=name, uuid=None, status=r.choice((PREPARED, INCOMING, "preparing")),
                  holding=h, steps=_steps(r, h))


def _oracle(state: StateDir, exclude=()) -> Ledger:
    return Ledger([holding_of(rec) for rec in state.records() if rec.holding and rec.key not in exclude])


def _same_answers(state: StateDir, r: random.Random, names: list[str]) -> None:
    """Every question the planner and the steps ask, asked of both."""
    for exclude in [(), (r.choice(names),)]:
        with state.lock():
            view = idx.IndexLedger(state.index, frozenset(exclude))
            truth = _oracle(state, exclude)
            drop = r.choice(names)
            view, truth = view.without(drop), truth.without(drop)
            assert dict(view.cpu_owner) == dict(truth.cpu_owner)
            assert +view.reactor_load == +truth.reactor_load
            assert dict(view.passthrough) == dict(truth.passthrough)
            for addr in CTRLS:
                assert sorted(view.spdk_users.get(addr, ())) == sorted(truth.spdk_users.get(addr, ()))
                assert view.namespace_users(addr) == truth.namespace_users(addr)
            for node in (0, 1):
                assert view.promised_hugepages(node, 2048) == truth.promised_hugepages(node, 2048)
                assert view.bound_memory_kib(node) == truth.bound_memory_kib(node)
            for name in names + ["shared"]:
                sock = f"/run/vstor/vhost/{name}-vdb"
                assert (sock in view.sockets) == (sock in truth.sockets)
            for vol in ["file:/images/a-0.raw", "file:/images/b-1.raw", f"nvme:{CTRLS[0]}/1"]:
                for ro in (False, True):
                    assert (view.volume_conflict((vol,), ro) is None) == (truth.volume_conflict((vol,), ro) is None)
            for i in range(3):
                path = f"rdma://10.0.0.{i}:4420/nqn.x"
                assert (view.path_conflict(path, "vs_nvmf_0") is None) == \
                    (truth.path_conflict(path, "vs_nvmf_0") is None)
            mine = exclude[0] if exclude else "nobody"
            others = FromRecords([rec for rec in state.records() if rec.key != mine])
            asked = idx.FromIndex(state.index, mine)
            for addr in CTRLS:
                name = "vs_" + addr.replace(":", "_").replace(".", "_")
                for kind, ident in (("vfio-bind", addr), ("spdk-attach", name)):
                    for done in (False, True):
                        assert (asked.step(kind, ident, done) is None) == (others.step(kind, ident, done) is None)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_says_what_the_records_say_after_any_sequence(tmp_path, seed):
    r = random.Random(seed)
    state = StateDir(str(tmp_path / "state"))
    names = [f"vm{i}" for i in range(8)]
    for _ in range(40):
        name = r.choice(names)
        if r.random() < 0.3:
            state.remove(name)
        else:
            state.save(_record(r, name))
        if r.random() < 0.25:
            _same_answers(state, r, names)
    damaged: list[str] = []
    with state.lock():
        assert state.index.verify(state.records(damaged), damaged), "a rebuild changed the index"
    _same_answers(state, r, names)


def _fill(state: StateDir, seed: int, count: int = 6) -> list[str]:
    r = random.Random(seed)
    names = [f"vm{i}" for i in range(count)]
    for name in names:
        state.save(_record(r, name))
    return names


def _right(state: StateDir) -> bool:
    """The index, read as a run reads it (rebuilt if it must be), says what the records say."""
    with state.lock():
        state.index.sums()
        damaged: list[str] = []
        return state.index.verify(state.records(damaged), damaged)


WRITES = ("makedirs", "unlink", "rmdir", "replace", "rename")


def _killed_at(state: StateDir, k: int, change) -> int:
    """Run `change` in a child that dies (SIGKILL) at its k-th write inside
    the index (or its record's); the exit status."""
    pid = os.fork()
    if pid == 0:
        count = [0]

        def counting(fn):
            def wrapped(*a, **kw):
                count[0] += 1
                if count[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*a, **kw)
            return wrapped
        for name in WRITES:
            setattr(os, name, counting(getattr(os, name)))
        real_open = builtins.open
        builtins.open = lambda f, mode="r", *a, **kw: (counting(real_open) if "w" in mode else real_open)(f, mode, *a, **kw)
        try:
            change()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.process
@pytest.mark.parametrize("what", ["save", "change", "remove"])
def test_a_run_killed_at_any_write_of_the_index_leaves_one_the_next_run_makes_right(tmp_path, what):
    r = random.Random(7)
    k, killed = 1, 0
    while True:
        state = StateDir(str(tmp_path / f"s{k}"))
        names = _fill(state, 3)
        change = {"save": lambda: state.save(_record(r, "new")),
                  "change": lambda: state.save(_record(r, names[0])),
                  "remove": lambda: state.remove(names[1])}[what]
        status = _killed_at(state, k, change)
        if status == 0:
            break       # k is past the last write: every point was tried
        assert os.WIFSIGNALED(status), status
        killed += 1
        assert _right(state), f"killed at write {k}: the next run's index is not the records'"
        _same_answers(StateDir(state.path), r, names + ["new"])
        k += 1
    assert killed >= 5


def test_a_damaged_missing_or_stale_index_is_rebuilt_from_the_records(tmp_path):
    state = StateDir(str(tmp_path / "state"))
    names = _fill(state, 11)
    r = random.Random(11)
    index = os.path.join(state.path, "index")
    damage = [
        lambda: open(os.path.join(index, "sums.json"), "w").write("{"),
        lambda: open(os.path.join(index, "sums.json"), "w").write("[]"),
        lambda: open(os.path.join(index, "keys", "vm0.json"), "w").write("\0\0"),
        lambda: os.rename(index, index + ".gone"),
        lambda: json.dump({**json.load(open(os.path.join(index, "sums.json"))), "boot": "another boot"},
                          open(os.path.join(index, "sums.json") + ".x", "w")) or
        os.replace(os.path.join(index, "sums.json") + ".x", os.path.join(index, "sums.json")),
        lambda: open(os.path.join(index, "dirty"), "w").close(),
    ]
    for harm in damage:
        harm()
        fresh = StateDir(state.path)       # a new run
        _same_answers(fresh, r, names)
        assert _right(fresh)


def test_what_only_a_full_read_can_see_is_set_right_by_gc(tmp_path):
    """An entry of a table removed by hand is not seen by a start (it asks
    one item at a time); gc's reindex compares every entry and rebuilds."""
    state = StateDir(str(tmp_path / "state"))
    rec = _record(random.Random(3), "vm0")
    rec.holding["sockets"] = ["/run/vstor/vhost/vm0-vdb"]
    state.save(rec)
    by = os.path.join(state.path, "index", "by", "sock")
    (entry,) = os.listdir(by)
    os.unlink(os.path.join(by, entry, "vm0"))
    assert not idx.reindex(state)           # found wrong, rebuilt
    assert idx.reindex(state)
    with state.lock():
        assert "/run/vstor/vhost/vm0-vdb" in idx.IndexLedger(state.index).sockets


def test_records_put_there_or_removed_by_hand_are_seen_by_the_next_start(tmp_path):
    state = StateDir(str(tmp_path / "state"))
    _fill(state, 5, count=2)
    rec = Record(key="byhand", domain="byhand", uuid=None, status=PREPARED,
                 holding={**_holding(random.Random(1), "byhand"), "cpus": [63]})
    with open(os.path.join(state.domains, "byhand.json"), "w") as f:
        json.dump(rec.to_json(), f)
    with StateDir(state.path).lock() as fresh:
        assert idx.IndexLedger(fresh.index).cpu_owner.get(63) == "byhand"
    os.unlink(os.path.join(state.domains, "byhand.json"))
    with StateDir(state.path).lock() as fresh:
        assert 63 not in idx.IndexLedger(fresh.index).cpu_owner


def test_a_record_damaged_by_hand_stops_every_start_until_it_is_dealt_with(tmp_path):
    state = StateDir(str(tmp_path / "state"))
    _fill(state, 5, count=2)
    with open(os.path.join(state.domains, "broken.json"), "w") as f:
        f.write("{")
    for _ in range(2):      # the rebuild that found it, and the runs after it
        with StateDir(state.path).lock() as fresh, pytest.raises(DamagedRecord) as e:
            holders.ledger_of(fresh, {"vm0"})
        assert "broken.json is damaged" in str(e.value) and "vstor gc" in e.value.hint
    os.unlink(os.path.join(state.domains, "broken.json"))
    with StateDir(state.path).lock() as fresh:
        holders.ledger_of(fresh, {"vm0"})       # removed by hand: seen, and starts go again


def test_a_start_opens_no_other_domains_record_and_gc_reads_each_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Structural flatness: what a start, a release and a change read of the
    state directory does not grow with the records besides its own."""
    state = StateDir(str(tmp_path / "state"))
    r = random.Random(5)
    for i in range(60):
        state.save(_record(r, f"vm{i}"))
    opened = []
    real_open = builtins.open

    def watching(f, *a, **kw):
        if isinstance(f, str) and f.startswith(state.domains) and f.endswith(".json"):
            opened.append(os.path.basename(f))
        return real_open(f, *a, **kw)
    monkeypatch.setattr(builtins, "open", watching)
    fresh = StateDir(state.path)
    with fresh.record_lock("vm0"), fresh.lock():
        ledger = holders.ledger_of(fresh, {"vm0"})
        ledger.without("vm0")
        [ledger.cpu_owner.get(c) for c in range(64)]
        "/run/vstor/vhost/vm7-vdb" in ledger.sockets
        ledger.volume_conflict(("file:/images/a-0.raw",), False)
        holders.holders_of(fresh, "vm0").step("vfio-bind", CTRLS[0], True)
        fresh.save(_record(r, "vm0"))
        fresh.remove("vm1")
    assert opened == [], opened
    loads = []
    real_load = StateDir.load
    monkeypatch.setattr(StateDir, "load", lambda self, key: loads.append(key) or real_load(self, key))
    idx.reindex(StateDir(state.path))
    assert len(loads) <= len(os.listdir(state.domains)), "a reindex reads each record once"


def test_names_of_anything_are_file_names_and_never_collide():
    items = ["", ".", "..", "/", "a/b", "a%2Fb", "x" * 300, "x" * 301, "é", "\udcff", "-", "a b", "%"]
    names = [shape.file_name(i) for i in items]
    assert len(set(names)) == len(items)
    for n in names:
        assert n not in (".", "..") and "/" not in n and 0 < len(n) <= 200 and "\0" not in n


def test_a_hand_change_in_the_same_clock_tick_as_vstors_writes_is_seen(tmp_path):
    """A record put there by hand right after a save of vstor's (and before
    the next one, within the kernel's coarse clock's tick) is still found by
    the next start: each decision lists the records' names."""
    state = StateDir(str(tmp_path / "state"))
    _fill(state, 9, count=2)
    for hand in range(20):
        rec = state.load("vm0")
        rec.updated = 0
        state.save(rec)         # changes nothing indexed: no host lock, the directory marked
        name = f"byhand{hand}"
        body = Record(key=name, domain=name, uuid=None, status=PREPARED,
                      holding={"domain": name, "cpus": [40 + hand % 20]}).to_json()
        with open(os.path.join(state.domains, name + ".json"), "w") as f:
            json.dump(body, f)
        state.save(state.load("vm1"))       # another unchanged save after the hand's
        with StateDir(state.path).lock() as fresh:
            assert idx.IndexLedger(fresh.index).cpu_owner.get(40 + hand % 20) == name
        os.unlink(os.path.join(state.domains, name + ".json"))


# -- (review i28) an index file of bytes that are not UTF-8 -----------------------------------------

@pytest.mark.parametrize("name", ["dirty", "sums.json", "keys/vm1.json"])
def test_an_index_file_that_is_not_utf8_is_rebuilt_not_an_internal_error(tmp_path, name):
    """What a torn write or a bad disk leaves in vstor's own index files is
    read as any other damage to them: the index is read again from the
    records (a UnicodeDecodeError from the index's stamp, since gone, was
    an internal error at every save)."""
    from vstor.runtime.state import _INDEXES
    state = StateDir(str(tmp_path / "state"))
    state.save(Record("vm1", "vm1", None, status=PREPARED))
    with open(tmp_path / "state" / "index" / name, "wb") as f:
        f.write(b"\xff\xfe")
    os.utime(tmp_path / "state" / "domains", None)      # the records' directory changed since
    _INDEXES.clear()
    again = StateDir(state.path)
    again.save(Record("vm2", "vm2", None, status=PREPARED))
    assert sorted(r.key for r in again.records()) == ["vm1", "vm2"]
    assert again.index.indexed("vm1") is not None


# -- an index file not shaped as vstor writes it (issue 28's fresh pass over record files) ---------

def _edit_json(path: str, change) -> None:
    with open(path) as f:
        s = json.load(f)
    change(s)
    with open(path, "w") as f:
        json.dump(s, f)


def _summary_of(index: str, key: str, change) -> None:
    _edit_json(os.path.join(index, "keys", key + ".json"), change)


def _sums_of(index: str, change) -> None:
    _edit_json(os.path.join(index, "sums.json"), change)


def _keys_made(index: str, make) -> None:
    import shutil
    shutil.rmtree(os.path.join(index, "keys"))
    make(os.path.join(index, "keys"))


MISSHAPEN = {
    # a summary: its fields were read without a look (KeyError, TypeError at plan and release)
    "summary-without-active": lambda i: _summary_of(i, "vm0", lambda s: s.pop("active")),
    "summary-without-shared": lambda i: _summary_of(i, "vm0", lambda s: s.pop("shared")),
    "summary-holding-a-number": lambda i: _summary_of(i, "vm0", lambda s: s.update(holding=1.5)),
    "summary-holding-misshapen": lambda i: _summary_of(i, "vm0", lambda s: s.update(holding={"domain": "vm0",
                                                                                          "cpus": "x"})),
    "summary-domain-a-list": lambda i: _summary_of(i, "vm0", lambda s: s.update(domain=[])),
    "summary-shared-a-number": lambda i: _summary_of(i, "vm0", lambda s: s.update(shared=[5])),
    "summary-is-a-record": lambda i: _summary_of(i, "vm0", lambda s: s.clear() or s.update(
        key="vm0", domain="vm0", status="prepared", steps=[])),
    # the sums: only their tables' types were looked at
    "sums-cpu-holders-a-number": lambda i: _sums_of(i, lambda s: s["cpus"].update({"1": 5})),
    "sums-reactor-not-a-cpu": lambda i: _sums_of(i, lambda s: s["reactors"].update({"x": 1})),
    "sums-memory-a-string": lambda i: _sums_of(i, lambda s: s["memory"].update({"0": "x"})),
    "sums-pages-a-float": lambda i: _sums_of(i, lambda s: s["pages"].update({"0/2048": 1.5})),
    "sums-unread-a-number": lambda i: _sums_of(i, lambda s: s.update(unread=5)),
    "sums-damaged-a-number": lambda i: _sums_of(i, lambda s: s.update(damaged=5)),
    # keys/ itself: os.listdir raised NotADirectoryError or ELOOP at every start
    "keys-a-file": lambda i: _keys_made(i, lambda p: open(p, "w").close()),
    "keys-a-fifo": lambda i: _keys_made(i, os.mkfifo),
    "keys-a-link-in-a-loop": lambda i: _keys_made(i, lambda p: os.symlink(p, p)),
    # by/ and its tables: listed one item at a time (NotADirectoryError, ELOOP at prepare and release)
    "by-a-file": lambda i: _by_made(i, "", lambda p: open(p, "w").close()),
    "by-name-a-fifo": lambda i: _by_made(i, "name", os.mkfifo),
    "by-name-a-link-in-a-loop": lambda i: _by_made(i, "name", lambda p: os.symlink(p, p)),
}


def _by_made(index: str, table: str, make) -> None:
    import shutil
    path = os.path.join(index, "by", table) if table else os.path.join(index, "by")
    shutil.rmtree(path)
    make(path)


@pytest.mark.parametrize("harm", MISSHAPEN)
def test_an_index_file_not_shaped_as_vstor_writes_it_is_rebuilt_not_an_internal_error(tmp_path, harm):
    """Each file of the index is trusted only in the shape vstor writes;
    anything else is damage, which the index is rebuilt from the records
    for, as for any other: planning, a start's ledger, a save and a
    removal all go on and say what the records say."""
    from vstor.runtime.state import _INDEXES
    state = StateDir(str(tmp_path / "state"))
    names = _fill(state, 28, count=3)
    MISSHAPEN[harm](os.path.join(state.path, "index"))
    _INDEXES.clear()
    fresh = StateDir(state.path)        # a new run
    assert sorted(r.key for r in holders.recorded(fresh)) == names      # what planning reads
    _INDEXES.clear()
    fresh = StateDir(state.path)
    with fresh.lock():                  # a start's ledger, and what it asks of another's entry
        ledger = holders.ledger_of(fresh, {"vm2"})
        assert dict(ledger.cpu_owner) == dict(_oracle(fresh, ("vm2",)).cpu_owner)
        assert ledger.without("vm0").running("vm1") == _oracle(fresh, ("vm2",)).without("vm0").running("vm1")
        others = FromRecords([r for r in fresh.records() if r.key != "vm2"])
        for addr in CTRLS:
            assert (holders.holders_of(fresh, "vm2").step("vfio-bind", addr, False) is None) == \
                (others.step("vfio-bind", addr, False) is None)
    fresh.save(_record(random.Random(29), "vm0"))
    fresh.remove("vm1")
    assert _right(fresh)
