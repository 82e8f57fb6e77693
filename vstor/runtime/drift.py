"""Drift: where a running libvirt domain's threads and memory are, against
where its recorded plan puts them; and the plan applied again (repair).

What the plan pins is what vstor rendered from it: each vCPU's cores and
the emulator's (Plan.thread_pins), an I/O thread on the emulator's cores
(vstor.render.elements.cputune), the memory's mode and nodes
(elements.numatune), each qemu-storage-daemon on the cores it was started
on (its qsd-export step's `cpus`), each SPDK vhost controller on its
reactor (its spdk-vhost step's).  What runs is libvirt's live answer
(vcpuPinInfo, emulatorPinInfo, ioThreadInfo, numaParameters, each with
VIR_DOMAIN_AFFECT_LIVE), each daemon thread's affinity
(/proc/PID/task/*), and SPDK's vhost_get_controllers.  A read that cannot
be made is a refusal (Unavailable), never "nothing there".

`find` is the check (`vstor status`, the metrics); `repair` puts back what
it finds (`vstor repair`), journaled as every host change is: its changes
(each with what was there) written into the domain's state record before
the first one, kept once all are made, so that `undo` (`vstor repair
--undo`) can put them back, and a run killed half-way is finished by the
next.  A Proxmox VM's threads are qemu-server's
QEMU's: vstor.pve.pinning checks and pins them.  A Nova instance's vCPU,
emulator and memory placement is Nova's (cpus='external'): only its
backends are checked.  A daemon memory policy is not planned (a daemon
allocates where it runs), so it is not checked.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from vstor import log
from vstor.cpulist import format_cpulist
from vstor.errors import ActionFailed, BadInput, DoesNotFit, InUse, Unavailable, VstorError
from vstor.host import threads
from vstor.records import record
from vstor.runtime.state import REPAIRED, REPAIRING, UNDOING

WHATS = ("vcpu", "emulator", "iothread", "numatune", "daemon", "reactor")
# libvirt's virDomainNumatuneMemMode, by value.
NUMA_MODES = ("strict", "preferred", "interleave", "restrictive")
RESTART = "stop and start the domain (it is then placed as planned)"


@record(frozen=True)
class Difference:
    """One way a running domain differs from its plan.  `item` names what
    differs (the vCPU's index, the I/O thread's id, the daemon's pid, the
    SPDK controller's name); `want` and `have` are cores (nodes for
    numatune), as the plan puts it and as it runs."""
    what: str
    message: str
    repairable: bool
    item: int | str | None = None
    want: tuple[int, ...] = ()
    have: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"what": self.what, "message": self.message, "repairable": self.repairable}


@record(frozen=True)
class DaemonThreads:
    """A qemu-storage-daemon as it runs: its threads' affinities."""
    name: str
    pid: int
    cpus: tuple[int, ...]                            # where its step started it
    tasks: tuple[tuple[int, frozenset], ...]         # (thread id, its cores)


@record(frozen=True)
class Controller:
    """An SPDK vhost controller: its planned reactor, and the cores of the
    mask SPDK reports (None: SPDK has no such controller)."""
    name: str
    reactor: int
    cores: tuple[int, ...] | None


@record(frozen=True)
class Live:
    """What runs, as read (see read)."""
    vcpus: tuple[frozenset, ...] = ()
    emulator: frozenset = frozenset()
    iothreads: tuple[tuple[int, frozenset], ...] = ()
    numa: tuple[str, tuple[int, ...]] | None = None        # (mode, nodes)
    daemons: tuple[DaemonThreads, ...] = ()
    controllers: tuple[Controller, ...] = ()
    ncpus: int = 0                                       # the host's CPUs, as libvirt maps them


# -- the comparison (pure) ----------------------------------------------------------------

def planned_numa(plan) -> tuple[str, tuple[int, ...]] | None:
    """The memory mode and nodes the plan's <numatune> binds (as
    vstor.render.elements.numatune renders it); None when it binds none."""
    from vstor.render import elements
    nt = elements.numatune(plan) if plan is not None and plan.cpus != "external" else None
    if nt is None:
        return None
    from vstor.cpulist import parse_cpulist
    memory = nt.find("memory")
    return memory.get("mode"), tuple(parse_cpulist(memory.get("nodeset")))


def compare(plan, live: Live) -> list[Difference]:
    """How `live` differs from `plan` (None: no plan placed the domain's
    own threads, only its backends are judged): one Difference each."""
    out: list[Difference] = []
    if plan is not None and plan.cpus != "external":
        vcpus, emulator = plan.thread_pins()
        for i, (want, have) in enumerate(zip(vcpus, live.vcpus)):
            if have != want:
                out.append(Difference("vcpu", f"vCPU {i} runs on CPUs {_cores(have)}, the plan pins "
                                      f"it to {_cores(want)}", True, i, _t(want), _t(have)))
        if emulator and live.emulator != emulator:
            out.append(Difference("emulator", f"emulator threads run on CPUs {_cores(live.emulator)}, "
                                  f"the plan pins them to {_cores(emulator)}", True, None,
                                  _t(emulator), _t(live.emulator)))
        for tid, have in live.iothreads if emulator else ():
            if have != emulator:
                out.append(Difference("iothread", f"I/O thread {tid} runs on CPUs {_cores(have)}, the "
                                      f"plan pins it to the emulator's {_cores(emulator)}", True, tid,
                                      _t(emulator), _t(have)))
        want_numa = planned_numa(plan)
        if want_numa is not None and live.numa is not None and live.numa != want_numa:
            (mode, nodes), (was, at) = want_numa, live.numa
            # libvirt changes a running domain's nodeset only, and only in strict mode.
            fixable = mode == was == "strict"
            out.append(Difference("numatune", f"guest memory is bound {was} to nodes {_cores(at)}, the "
                                   f"plan binds it {mode} to nodes {_cores(nodes)}"
                                   + ("" if fixable else f" (libvirt cannot change that live: {RESTART})"),
                                   fixable, None, nodes, at))
    for d in live.daemons:
        stray = {tid: have for tid, have in d.tasks if have != frozenset(d.cpus)}
        if stray:
            tid, have = min(stray.items())
            n = len(stray)
            out.append(Difference("daemon", f"qemu-storage-daemon {d.name} (pid {d.pid}): {n} "
                                  f"thread{'s' if n > 1 else ''} (thread {tid}: CPUs {_cores(have)}) "
                                  f"not on its planned CPUs {_cores(d.cpus)}", True, d.pid,
                                  tuple(d.cpus), _t(have)))
    for c in live.controllers:
        if c.cores is not None and c.cores != (c.reactor,):
            out.append(Difference("reactor", f"SPDK vhost controller {c.name} runs on reactor cores "
                                  f"{_cores(c.cores)}, the plan puts it on core {c.reactor}; SPDK "
                                  f"cannot move a controller live ({RESTART})", False, c.name,
                                  (c.reactor,), c.cores))
    return out


def _cores(cpus) -> str:
    return format_cpulist(cpus) or "none"


def _t(cpus) -> tuple[int, ...]:
    return tuple(sorted(cpus))


# -- what runs ------------------------------------------------------------------------------

def find(conn, rt, rec) -> list[Difference]:
    """How the running libvirt domain of state record `rec` differs from
    its recorded plan ([] when it runs as planned, or does not run).
    Unavailable when something it must read cannot be read.  One libvirt
    lookup, no QMP: what the metrics ask of every domain."""
    found = running(conn, rec)
    if found is None:
        return []
    dom, plan = found
    return compare(plan, read(dom, plan, rt, rec))


def running(conn, rec):
    """(libvirt's domain, its recorded plan) of the record's domain while it
    runs; None when it does not run (or is not defined).  The plan is None
    when its live XML holds none (a domain `vstor prepare` made backends
    for, started from XML vstor did not render): vstor placed none of its
    threads, and only its backends are judged."""
    libvirt = _libvirt()
    try:
        dom = conn.lookupByUUIDString(rec.uuid) if rec.uuid else conn.lookupByName(rec.domain)
        if not dom.isActive():
            return None
        xml = dom.XMLDesc(0)
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise Unavailable(f"cannot ask libvirt about domain '{rec.domain}': {_msg(e)}",
                          hint="is libvirtd running?") from None
    from vstor.meta.document import Domain
    try:
        plan = Domain.parse(xml, f"domain '{rec.domain}'").recorded_plan()
    except BadInput as e:
        raise Unavailable(f"cannot read the plan of running domain '{rec.domain}': {e.message}") from None
    if plan is not None:
        _started_with(rec, plan)
    return dom, plan


def _started_with(rec, plan) -> None:
    """The plan in the live XML (whoever may define the domain can change
    it while it runs: virsh metadata --live) must place the domain where
    its start did, as its record holds it (root's): the cores it holds,
    its node and cells, its reactors.  Otherwise drift would be judged,
    and a repair would pin, by what the domain's author wrote."""
    from vstor.meta.holding import Holding, holding_from_json
    try:
        held = holding_from_json(rec.holding)
    except (KeyError, TypeError, ValueError):
        held = None
    now = Holding.from_plan(plan, active=True)
    if held is None or any(getattr(now, f) != getattr(held, f) for f in ("node", "cpus", "cells", "reactors")):
        raise Unavailable(f"the vstor plan in running domain '{rec.domain}''s XML does not place it where "
                          "its start did (its metadata changed since): vstor judges and repairs only "
                          "the placement its start checked",
                          hint=f"stop it, then vstor apply {rec.domain} and start it")


def read(dom, plan, rt, rec) -> Live:
    """What runs of the domain `dom` (libvirt's) and of the backends its
    record `rec` holds."""
    libvirt = _libvirt()
    live = libvirt.VIR_DOMAIN_AFFECT_LIVE
    name = rec.domain
    vcpus, emulator, iothreads, numa, ncpus = (), frozenset(), (), None, 0
    if plan is not None and plan.cpus != "external":
        pins = _ask(name, "vCPU pinning", lambda: dom.vcpuPinInfo(live))
        vcpus = tuple(_set(m) for m in pins)
        ncpus = max((len(m) for m in pins), default=0)
        if plan.emulator:
            mask = _ask(name, "emulator pinning", lambda: dom.emulatorPinInfo(live))
            emulator, ncpus = _set(mask), max(ncpus, len(mask))
            iothreads = tuple((int(i), _set(m)) for i, m in
                              _ask(name, "I/O threads", lambda: dom.ioThreadInfo(live)))
        if planned_numa(plan) is not None:
            params = _ask(name, "numatune", lambda: dom.numaParameters(live))
            numa = _numa(name, params)
    return Live(vcpus, emulator, iothreads, numa, tuple(daemons(rec)), tuple(controllers(rt, rec)),
                ncpus)


def daemons(rec) -> list[DaemonThreads]:
    """Each pinned qemu-storage-daemon of the record that runs (one that
    does not is its step's problem, `vstor status` says so), vstor's own
    (its pidfile and command line), with its threads' affinities."""
    from vstor.backends.qsd import daemon
    out = []
    for export in _exports(rec):
        pid = daemon.pid(export)
        if pid is None:
            continue
        try:
            tids = threads.tasks(pid, f"qemu-storage-daemon {export.name} (pid {pid})")
        except Unavailable:
            continue        # ended since: its step's problem
        tasks = []
        for tid in sorted(tids):
            have = None if threads.kernel_worker(pid, tid) else _affinity(tid, export.name)
            if have is not None:
                tasks.append((tid, have))
        out.append(DaemonThreads(export.name, pid, tuple(export.cpus), tuple(tasks)))
    return out


def controllers(rt, rec) -> list[Controller]:
    """Each SPDK vhost controller of the record, with the cores SPDK says it runs on."""
    out = []
    steps = [a for a in _steps(rec) if a.kind == "spdk-vhost"]
    if not steps:
        return out
    spdk = rt.of(rec).spdk
    for a in steps:
        try:
            found = spdk.vhost_get_controllers(a.ctrlr)
        except Exception as e:       # noqa: BLE001 (SpdkRpcError or Unavailable: not read)
            raise Unavailable(f"cannot ask SPDK which reactor runs vhost controller {a.ctrlr}: "
                              f"{getattr(e, 'message', e)}", hint="is SPDK running? see: vstor status") from None
        cores = None
        if found:
            try:
                mask = int(str(found[0].get("cpumask")), 16)
            except ValueError:
                raise Unavailable(f"SPDK reports vhost controller {a.ctrlr}'s cpumask as "
                                  f"{str(found[0].get('cpumask'))[:40]!r}, not a mask") from None
            cores = tuple(i for i in range(mask.bit_length()) if mask >> i & 1)
        out.append(Controller(a.ctrlr, a.reactor, cores))
    return out


# -- repair ----------------------------------------------------------------------------------

@record(frozen=True)
class Change:
    """One change a repair makes: `what` of `item` (a vCPU's index, an I/O
    thread's id, a daemon's pid and its `thread`) from the cores (nodes for
    numatune) it `have`s to the ones it `want`s.  The record's `repair`
    keeps them as JSON, so that an undo puts `have` back."""
    what: str
    item: int | str | None
    have: tuple[int, ...]
    want: tuple[int, ...]
    thread: int | None = None

    def key(self) -> tuple:
        return self.what, self.item, self.thread

    def back(self) -> "Change":
        """The change that undoes this one."""
        return Change(self.what, self.item, self.want, self.have, self.thread)

    def to_json(self) -> dict:
        out = {"what": self.what, "item": self.item, "have": list(self.have), "want": list(self.want)}
        return {**out, "thread": self.thread} if self.thread is not None else out

    @classmethod
    def from_json(cls, data: dict) -> "Change":
        return cls(data["what"], data.get("item"), tuple(data["have"]), tuple(data["want"]),
                   data.get("thread"))


class UndoFailed(ActionFailed):
    """A change failed and putting back what was changed before it failed
    too: the record's repair stays unfinished, for the next run."""


def repair(conn, rt, state, host, key: str, say: Callable[[str], None],
           dry_run: bool = False) -> tuple[list[Difference], list[Difference]]:
    """Apply the plan again to the running domain of record `key`: each
    repairable difference put back as the plan says (libvirt's live APIs,
    the daemons' threads).  (what was repaired, or would be in a dry run;
    what cannot be repaired live).  Under the repair lock: two repairs of
    one domain never interleave; the record lock only while the journal is
    written (libvirt is never asked under it).  Before the first change the
    plan's cores are checked still to be the domain's (DoesNotFit, nothing
    changed) and the changes are written into the record's `repair`
    (repairing); once all are made it is done, kept for `undo`.  A change
    that fails puts back every change made before it (ActionFailed) and
    the record as it was.  A repair the record says was interrupted (or
    an undo) is finished by this one: the changes are what differs now,
    each with what it had before the first run."""
    from vstor.planner import fit
    from vstor.runtime.holders import ledger_of
    # libvirt is asked and told under the repair lock alone, never under the
    # record lock: libvirt runs a stop's release hook (which takes the
    # record lock) with the domain locked, so a repair asking libvirt under
    # the record lock would wait on the stop that waits on it.
    with state.repair_lock(key, dry_run=dry_run):
        rec = _record(state, key)
        dom, plan = _running(conn, rec, "repair")
        was = dict(rec.repair)
        earlier = []
        if was.get("status") in (REPAIRING, UNDOING):
            earlier = _changes(rec)
            say(f"a repair of {rec.domain} was interrupted: finishing it" if was["status"] == REPAIRING
                else f"an undo of {rec.domain}'s last repair was interrupted: repairing again")
        live = read(dom, plan, rt, rec)
        diffs = compare(plan, live)
        fixable = [d for d in diffs if d.repairable]
        left = [d for d in diffs if not d.repairable]
        if not fixable:
            if earlier and not dry_run:     # killed after its last change: it is done
                with state.record_lock(key):
                    _keep(state, _same(state, rec), REPAIRED, earlier)
            return [], left
        with state.record_lock(key, dry_run=dry_run), state.lock(dry_run=dry_run):
            rec = _same(state, rec) if not dry_run else rec
            problems = (fit.pin_problems(host, rt.cfg, plan, ledger_of(state, {key}, dry_run))
                        if plan is not None else _offline(fixable))
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise DoesNotFit(f"domain '{rec.domain}' cannot be pinned as planned: {problems[0]}{more}; "
                                 "nothing changed", reasons=tuple(problems),
                                 hint=f"free those CPUs, or stop the domain, vstor apply {rec.domain} "
                                      "(a new plan) and start it")
            if dry_run:
                for d in fixable:
                    say(f"would pin {_subject(d)} to {_cores(d.want)} (now {_cores(d.have)}): "
                        f"{_command(rec.domain, d)}")
                return fixable, left
            changes = planned(fixable, live)
            _keep(state, rec, REPAIRING, _merged(earlier, changes))     # before the first change
        made = _journaled(state, rec, was, lambda: _apply(dom, rec, changes, live.ncpus, say))
        with state.record_lock(key):
            _keep(state, _same(state, rec), REPAIRED, _merged(earlier, made))
        return fixable, left


def undo(conn, rt, state, key: str, say: Callable[[str], None], dry_run: bool = False) -> list[Change]:
    """Put back what the last completed repair of the running domain of
    record `key` changed (each change's `have`), only while the domain
    runs as that repair left it (each item where it `want`ed: DoesNotFit
    otherwise, naming it, nothing changed); then the record forgets that
    repair.  Journaled as a repair is (undoing, then removed); an undo
    the record says was interrupted is finished: an item already back is
    left.  What was (or would be) put back."""
    with state.repair_lock(key, dry_run=dry_run):     # libvirt under it alone (see repair)
        rec = _record(state, key)
        was = dict(rec.repair)
        status = was.get("status")
        if status == REPAIRING:
            raise BadInput(f"the last repair of domain '{rec.domain}' was interrupted: there is no "
                           "finished repair to undo", hint=f"finish it first: vstor repair {rec.domain}")
        if status not in (REPAIRED, UNDOING):
            raise BadInput(f"vstor has made no repair of domain '{rec.domain}' since it started: there "
                           "is nothing to undo", hint=f"see: vstor status {rec.domain}")
        dom, plan = _running(conn, rec, "undo")
        if status == UNDOING:
            say(f"an undo of {rec.domain}'s last repair was interrupted: finishing it")
        live = read(dom, plan, rt, rec)
        todo = []
        for c in _changes(rec):
            now = _now(live, rec, c)
            if now is None or (status == UNDOING and now == c.have):
                continue        # a daemon thread that ended; an item an interrupted undo put back
            if now != c.want:
                raise DoesNotFit(f"domain '{rec.domain}' no longer runs as its last repair left it: "
                                 f"{_subject(c)}{_thread(c)}: on {_cores(now)} now, where the repair "
                                 f"left {_cores(c.want)}; nothing changed",
                                 hint=f"vstor repair {rec.domain} --dry-run shows what differs from the plan")
            todo.append(c)
        if dry_run:
            for c in todo:
                say(f"would put {_subject(c)}{_thread(c)} back on {_cores(c.have)} (now {_cores(c.want)})")
            return todo
        with state.record_lock(key):
            rec = _same(state, rec)
            _keep(state, rec, UNDOING, _changes(rec))       # before the first change
        _journaled(state, rec, was, lambda: _apply(dom, rec, [c.back() for c in todo], live.ncpus, say,
                                                   back=True))
        with state.record_lock(key):
            rec = _same(state, rec)
            rec.repair = {}
            state.save(rec)
        return todo


def unfinished(rec) -> str | None:
    """What a repair (or its undo) that was killed left in the record, with
    its fix (`vstor status` reports it as a problem); None."""
    status = rec.repair.get("status")
    if status == REPAIRING:
        return f"a repair of {rec.domain} was interrupted (fix: vstor repair {rec.domain})"
    if status == UNDOING:
        return (f"an undo of {rec.domain}'s last repair was interrupted (fix: vstor repair {rec.domain} "
                f"--undo, or vstor repair {rec.domain})")
    return None


def planned(fixable: list[Difference], live: Live) -> list[Change]:
    """The changes that put `fixable` back: one per libvirt pin, one per
    thread of a daemon that is off its cores."""
    out = []
    for d in fixable:
        if d.what != "daemon":
            out.append(Change(d.what, d.item, d.have, d.want))
            continue
        found = next(x for x in live.daemons if x.pid == d.item)
        out += [Change("daemon", d.item, _t(have), _t(found.cpus), tid)
                for tid, have in found.tasks if have != frozenset(found.cpus)]
    return out


def _record(state, key: str):
    rec = state.load(key)
    if rec is None:
        raise BadInput(f"vstor holds nothing for domain '{key}'", hint="see: vstor status")
    return rec


def _running(conn, rec, what: str):
    found = running(conn, rec)
    if found is None:
        raise DoesNotFit(f"domain '{rec.domain}' is not running: there is nothing to {what}",
                         hint="its next start places it as planned")
    return found


def _changes(rec) -> list[Change]:
    try:
        return [Change.from_json(c) for c in rec.repair.get("changes", ())]
    except (KeyError, TypeError) as e:      # the record's shape was checked: not reached
        raise ActionFailed(f"the last repair of domain '{rec.domain}' cannot be read: {e}") from None


def _merged(earlier: list[Change], now: list[Change]) -> list[Change]:
    """`earlier`'s changes (what an interrupted run recorded, with what was
    there before it), then `now`'s others."""
    seen = {c.key() for c in earlier}
    return [*earlier, *(c for c in now if c.key() not in seen)]


def _keep(state, rec, status: str, changes: list[Change]) -> None:
    rec.repair = {"status": status, "at": time.time(), "changes": [c.to_json() for c in changes]}
    state.save(rec)


def _journaled(state, rec, was: dict, change):
    """change() (made without the record lock: see repair), with the
    record's repair put back as it `was` when it fails and everything it
    did was put back; left as written when that failed too (UndoFailed:
    the next run finishes it)."""
    try:
        return change()
    except UndoFailed:
        raise
    except BaseException:
        with state.record_lock(rec.key):
            now = state.load(rec.key)
            if now is not None and now.updated == rec.updated:
                now.repair = was
                state.save(now)
        raise


def _same(state, rec):
    """The record as `rec` read it, reloaded under its record lock; a
    refusal when a start, stop or attach changed it since (a repair looked
    at what ran then: it looks again)."""
    now = state.load(rec.key)
    if now is None or now.updated != rec.updated:
        raise InUse(f"domain '{rec.domain}' was started, stopped or changed while vstor looked at "
                    "what runs: nothing changed", hint=f"look again: vstor repair {rec.domain}")
    return now


def _now(live: Live, rec, c: Change):
    """Where the item of change `c` runs now; None for a daemon thread that
    has ended.  DoesNotFit when the domain has no such item any more."""
    if c.what == "vcpu" and isinstance(c.item, int) and 0 <= c.item < len(live.vcpus):
        return _t(live.vcpus[c.item])
    if c.what == "emulator" and live.emulator:
        return _t(live.emulator)
    if c.what == "iothread" and c.item in dict(live.iothreads):
        return _t(dict(live.iothreads)[c.item])
    if c.what == "numatune" and live.numa is not None and live.numa[0] == "strict":
        return live.numa[1]
    if c.what == "daemon":
        found = next((d for d in live.daemons if d.pid == c.item), None)
        if found is not None:
            have = dict(found.tasks).get(c.thread)
            return None if have is None else _t(have)
    raise DoesNotFit(f"domain '{rec.domain}' no longer runs as its last repair left it: it has no "
                     f"{_subject(c)} now (a daemon started again, a domain changed live); nothing changed",
                     hint="what a repair changed there is gone with it")


def _thread(c: Change) -> str:
    return f" (thread {c.thread})" if c.thread is not None else ""


def _offline(fixable: list[Difference]) -> list[str]:
    """Without a plan (only backends judged): the cores a daemon goes back
    to must be online."""
    gone = sorted({c for d in fixable for c in d.want} - threads.online())
    return [f"CPUs {format_cpulist(gone)} are not online on this host"] if gone else []


def _apply(dom, rec, changes: list[Change], ncpus: int, say, back: bool = False) -> list[Change]:
    """Make each change, in order; what was made (a daemon's threads each
    as it was moved).  A daemon's every thread goes on its planned cores,
    one started meanwhile too; `back` (an undo): only the threads the
    changes name, each on its own cores.  A change that fails puts back
    every change made before it, newest first."""
    undo: list[tuple[str, Callable[[], None]]] = []
    made: list[Change] = []
    verb = "put back" if back else "pinned"
    try:
        for c in changes:
            if c.what == "daemon":
                if any(m.what == "daemon" and m.item == c.item for m in made):
                    continue        # its threads were moved together
                mine = [x for x in changes if x.what == "daemon" and x.item == c.item]
                moved = _pin_daemon(rec, c.item, undo, {x.thread: x.want for x in mine} if back else None)
                made += moved
                said = (f"{len(moved)} thread{'s' if len(moved) != 1 else ''}" if back
                        else f"{_cores(c.want)}, {len(moved)} moved")
                say(f"{verb} {_subject(c)} ({said})" if back else f"{verb} {_subject(c)} to {said}")
            else:
                _libvirt_pin(dom, rec.domain, c, c.want, ncpus)
                undo.append((_subject(c), lambda c=c: _libvirt_pin(dom, rec.domain, c, c.have, ncpus)))
                made.append(c)
                say(f"{verb} {_subject(c)} {'on' if back else 'to'} {_cores(c.want)} (was {_cores(c.have)})")
            log.change(rec.domain, f"{'put back' if back else 'pin'} {_subject(c)} "
                                   f"{'on' if back else 'to'} {_cores(c.want)}", log.DONE)
    except BaseException as e:
        failed = []
        for what, put_back in reversed(undo):
            try:
                put_back()
                log.change(rec.domain, f"put back {what}", log.UNDONE)
            except Exception as u:      # noqa: BLE001 (each undo is tried; what failed is named)
                failed.append(f"{what}: {getattr(u, 'message', u)}")
                log.change(rec.domain, f"put back {what}", log.UNDO_FAILED, failed[-1])
        why = (e.message if isinstance(e, VstorError) else
               "interrupted" if isinstance(e, (KeyboardInterrupt, SystemExit)) else str(e))
        if failed:
            raise UndoFailed(f"{why}; putting back what was changed before failed too: "
                             f"{'; '.join(failed)}",
                             hint=f"see: vstor status {rec.domain}; then vstor repair {rec.domain}") from None
        if not isinstance(e, (ActionFailed, Unavailable)):
            raise
        raise ActionFailed(f"{why}; every change made before it was undone", hint=e.hint) from None
    return made


def _libvirt_pin(dom, name: str, d, cores, ncpus: int) -> None:
    libvirt = _libvirt()
    live = libvirt.VIR_DOMAIN_AFFECT_LIVE
    cpumap = tuple(i in cores for i in range(max([ncpus, *[c + 1 for c in cores]])))
    try:
        if d.what == "vcpu":
            dom.pinVcpuFlags(d.item, cpumap, live)
        elif d.what == "emulator":
            dom.pinEmulator(cpumap, live)
        elif d.what == "iothread":
            dom.pinIOThread(d.item, cpumap, live)
        elif d.what == "numatune":
            dom.setNumaParameters({"numa_nodeset": format_cpulist(cores)}, live)
        else:
            raise ActionFailed(f"vstor cannot repair {d.what} drift live")
    except libvirt.libvirtError as e:
        raise ActionFailed(f"libvirt refused to pin domain '{name}''s {_subject(d)} to "
                           f"{_cores(cores)}: {_msg(e)}") from None


def _pin_daemon(rec, pid: int, undo: list, where: dict | None = None) -> list[Change]:
    """Each thread of vstor's own daemon `pid` on its planned cores (or,
    `where`, each thread it names on its cores, the others left): the
    pid's threads as /proc lists them, under a pidfd (a pid reused since
    it was read is another process, never pinned).  What was moved."""
    from vstor.backends.qsd import daemon
    export = next((e for e in _exports(rec) if daemon.pid(e) == pid), None)
    who = f"qemu-storage-daemon {export.name if export else ''} (pid {pid})".replace("  ", " ")
    if export is None:
        raise Unavailable(f"{who} is no longer one of domain '{rec.domain}''s daemons: nothing pinned")
    planned_cpus = frozenset(export.cpus)
    moved: list[Change] = []

    def done(tid: int, have, want) -> None:
        undo.append((f"thread {tid} of {who}", lambda: _put(tid, have)))
        moved.append(Change("daemon", pid, _t(have), _t(want), tid))
    with threads.alive(pid, who) as alive:
        if daemon.pid(export) != pid:       # reused between the look and the pidfd
            raise Unavailable(f"{who} ended: nothing pinned")
        settled = threads.pin(pid, who, lambda tid: planned_cpus if where is None else where.get(tid),
                              alive, done)
    if not settled:
        raise ActionFailed(f"threads of {who} still moved off their cores after {threads.ROUNDS} "
                           "rounds: something else pins them")
    return moved


def _put(tid: int, cores) -> None:
    with contextlib.suppress(ProcessLookupError):       # gone since: nothing to put back
        os.sched_setaffinity(tid, cores)


def _subject(d) -> str:
    return {"vcpu": f"vCPU {d.item}", "emulator": "the emulator threads",
            "iothread": f"I/O thread {d.item}", "numatune": "the guest memory's nodes",
            "daemon": f"qemu-storage-daemon pid {d.item}'s threads",
            "reactor": f"SPDK vhost controller {d.item}"}[d.what]


def _command(name: str, d) -> str:
    """The change as the command that makes it by hand."""
    cores = _cores(d.want)
    return {"vcpu": f"virsh vcpupin {name} {d.item} {cores} --live",
            "emulator": f"virsh emulatorpin {name} {cores} --live",
            "iothread": f"virsh iothreadpin {name} {d.item} {cores} --live",
            "numatune": f"virsh numatune {name} --nodeset {cores} --live",
            "daemon": f"taskset --all-tasks --cpu-list --pid {cores} {d.item}"}.get(d.what, "")


def _steps(rec):
    from vstor.runtime import actions
    for entry in rec.steps:
        if entry.get("state") != "done":
            continue
        try:
            yield actions.from_json(entry)
        except ActionFailed:
            continue        # its own record's problem (status' steps say it)


def _exports(rec):
    return [a.export for a in _steps(rec) if a.kind == "qsd-export" and a.export.cpus]


def _affinity(tid: int, name: str) -> frozenset | None:
    try:
        return threads.affinity(tid)
    except OSError as e:
        raise Unavailable(f"cannot read the CPU affinity of thread {tid} of qemu-storage-daemon "
                          f"{name}: {e.strerror}", hint="run vstor as root") from None


def _numa(name: str, params: dict) -> tuple[str, tuple[int, ...]]:
    from vstor.cpulist import parse_cpulist
    mode = params.get("numa_mode")
    try:
        nodes = tuple(parse_cpulist(params.get("numa_nodeset") or ""))
    except ValueError:
        nodes = None
    if not isinstance(mode, int) or not 0 <= mode < len(NUMA_MODES) or nodes is None:
        raise Unavailable(f"libvirt's numatune of domain '{name}' is not one vstor can read: "
                          f"{str(params)[:120]}")
    return NUMA_MODES[mode], nodes


def _ask(name: str, what: str, call):
    libvirt = _libvirt()
    try:
        return call()
    except libvirt.libvirtError as e:
        raise Unavailable(f"cannot read domain '{name}''s live {what} from libvirt: {_msg(e)}",
                          hint="is libvirtd running? see: virsh dominfo " + name) from None


def _set(cpumap) -> frozenset:
    return frozenset(i for i, on in enumerate(cpumap) if on)


def _libvirt():
    import libvirt
    return libvirt


def _msg(e) -> str:
    return (e.get_error_message() or str(e)).splitlines()[0]
