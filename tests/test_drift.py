"""Drift (vstor.runtime.drift): what runs against what the plan places, as
pure comparisons of a plan with what was read; what libvirt is given for
each domain's I/O threads; the check that a repair's cores are still the
domain's; and a repair that fails half-way putting back what it changed.
The live side, with a real libvirtd, QEMU and qemu-storage-daemon, is
tests/e2e/test_drift.py."""

from __future__ import annotations

import os

import pytest
from lxml import etree

from vstor.config import Config
from vstor.meta.document import Domain
from vstor.meta.holding import Holding
from vstor.meta.plan import CellPlan, Plan
from vstor.planner import Request, fit, plan_domain
from vstor.planner.ledger import Ledger
from vstor.pve import pinning
from vstor.records import replace
from vstor.render import elements
from vstor.render.libvirt import iothread_ids, render
from vstor.runtime import drift
from vstor.runtime.drift import Change, Controller, DaemonThreads, Difference, Live

HERE = os.path.dirname(__file__)
TEMPLATE = os.path.join(HERE, "..", "xml-templates", "qsd-file.xml")
CFG = Config(reactors=(2, 18))

PLAN = Plan(cpus="dedicated", vcpus=2, vcpu_pins=(4, 5), emulator=(0, 1), node=0, numa="strict",
            domain="vm1")


def s(*cpus) -> frozenset:
    return frozenset(cpus)


def as_planned(**over) -> Live:
    base = dict(vcpus=(s(4), s(5)), emulator=s(0, 1), iothreads=((1, s(0, 1)),),
                numa=("strict", (0,)), ncpus=8,
                daemons=(DaemonThreads("vm1-vdb", 4711, (0, 1), ((4711, s(0, 1)), (4712, s(0, 1)))),),
                controllers=(Controller("vm1-vdc", 2, (2,)),))
    return Live(**{**base, **over})


def test_a_domain_that_runs_as_planned_has_no_difference():
    assert drift.compare(PLAN, as_planned()) == []


def test_a_moved_vcpu_is_named_with_where_it_runs_and_where_the_plan_puts_it():
    [d] = drift.compare(PLAN, as_planned(vcpus=(s(4), s(0, 1, 2, 3))))
    assert (d.what, d.item, d.repairable, d.want, d.have) == ("vcpu", 1, True, (5,), (0, 1, 2, 3))
    assert d.message == "vCPU 1 runs on CPUs 0-3, the plan pins it to 5"
    assert d.to_json() == {"what": "vcpu", "message": d.message, "repairable": True}


def test_moved_emulator_and_iothreads_each_are_a_difference():
    found = drift.compare(PLAN, as_planned(emulator=s(4), iothreads=((1, s(0, 1)), (2, s(0, 1, 4, 5)))))
    assert [(d.what, d.item) for d in found] == [("emulator", None), ("iothread", 2)]
    assert found[0].message == "emulator threads run on CPUs 4, the plan pins them to 0-1"
    assert found[1].message == "I/O thread 2 runs on CPUs 0-1,4-5, the plan pins it to the emulator's 0-1"


def test_numatune_nodes_are_repairable_in_strict_mode_only():
    [d] = drift.compare(PLAN, as_planned(numa=("strict", (1,))))
    assert (d.what, d.repairable, d.want, d.have) == ("numatune", True, (0,), (1,))
    assert d.message == "guest memory is bound strict to nodes 1, the plan binds it strict to nodes 0"
    [d] = drift.compare(PLAN, as_planned(numa=("interleave", (0,))))
    assert not d.repairable and "libvirt cannot change that live: stop and start" in d.message


def test_a_daemon_with_a_stray_thread_is_one_difference_naming_a_thread():
    daemon = DaemonThreads("vm1-vdb", 4711, (0, 1), ((4711, s(0, 1)), (4712, s(3)), (4713, s(0))))
    [d] = drift.compare(PLAN, as_planned(daemons=(daemon,)))
    assert (d.what, d.item, d.repairable, d.want, d.have) == ("daemon", 4711, True, (0, 1), (3,))
    assert d.message == ("qemu-storage-daemon vm1-vdb (pid 4711): 2 threads (thread 4712: CPUs 3) "
                         "not on its planned CPUs 0-1")


def test_an_spdk_controller_on_another_reactor_is_not_repairable_live():
    [d] = drift.compare(PLAN, as_planned(controllers=(Controller("vm1-vdc", 2, (18,)),)))
    assert (d.what, d.item, d.repairable) == ("reactor", "vm1-vdc", False)
    assert "runs on reactor cores 18, the plan puts it on core 2" in d.message
    assert "stop and start the domain" in d.message
    # a controller SPDK does not have is its step's problem (vstor status), not drift
    assert drift.compare(PLAN, as_planned(controllers=(Controller("vm1-vdc", 2, None),))) == []


def test_a_nova_instance_is_judged_by_its_backends_only():
    nova = replace(PLAN, cpus="external")
    assert drift.compare(nova, as_planned(vcpus=(s(0), s(0)), emulator=s(7), numa=("strict", (1,)))) == []
    assert [d.what for d in drift.compare(nova, as_planned(
        daemons=(DaemonThreads("vm1-vdb", 9, (0, 1), ((9, s(5)),)),)))] == ["daemon"]


def test_a_domain_started_without_a_plan_is_judged_by_its_backends_only():
    """`vstor prepare FILE`, then a start from XML vstor did not render:
    vstor placed none of its threads, its daemons it did."""
    assert drift.compare(None, as_planned(vcpus=(s(0), s(0)), emulator=s(7))) == []
    daemon = DaemonThreads("vm1-vdb", 9, (0, 1), ((9, s(5)),))
    assert [d.what for d in drift.compare(None, as_planned(daemons=(daemon,)))] == ["daemon"]


def test_shared_vcpus_of_cells_are_judged_on_their_cells_cores():
    plan = Plan(cpus="shared", vcpus=2, shared_cpus=(0, 1, 16, 17), emulator=(0, 1, 16, 17), node=0,
                cells=(CellPlan(0, 0, (0,), 512, 0, (0, 1)), CellPlan(1, 1, (1,), 512, 0, (16, 17))))
    assert plan.thread_pins() == pinning.wanted(plan) == ((s(0, 1), s(16, 17)), s(0, 1, 16, 17))
    live = Live(vcpus=(s(0, 1), s(0, 1, 16, 17)), emulator=s(0, 1, 16, 17))
    [d] = drift.compare(plan, live)
    assert (d.what, d.item, d.want) == ("vcpu", 1, (16, 17))
    # and libvirt is told so: a vcpupin per vCPU off the <vcpu cpuset> it would float on
    ct = etree.Element("cputune")
    elements.cputune(ct, plan)
    assert [(p.get("vcpu"), p.get("cpuset")) for p in ct.findall("vcpupin")] == [("0", "0-1"), ("1", "16-17")]


def test_a_shared_guest_of_one_cell_floats_on_its_vcpu_cpuset_alone():
    plan = Plan(cpus="shared", vcpus=2, shared_cpus=(0, 1), emulator=(0, 1), node=0)
    ct = etree.Element("cputune")
    elements.cputune(ct, plan)
    assert ct.findall("vcpupin") == [] and ct.find("emulatorpin").get("cpuset") == "0-1"


# -- I/O threads: pinned with the emulator ---------------------------------------------------

def _with_iothreads(text: str) -> Domain:
    with open(TEMPLATE) as f:
        xml = f.read().replace("<vcpu>1</vcpu>", "<vcpu>1</vcpu>" + text)
    return Domain.parse(xml, "template")


def test_iothread_ids_are_read_as_libvirt_reads_them():
    def ids(text):
        return iothread_ids(etree.fromstring(f"<domain>{text}</domain>"))
    assert ids("") == ()
    assert ids("<iothreads>2</iothreads>") == (1, 2)
    assert ids("<iothreads>3</iothreads><iothreadids><iothread id='5'/><iothread id='1'/></iothreadids>") \
        == (5, 1, 2)
    assert ids("<iothreadids><iothread id='4'/></iothreadids>") == (4,)


def test_every_iothread_a_domain_declares_is_pinned_with_the_emulator(host_model):
    dom = _with_iothreads("<iothreads>2</iothreads><iothreadids><iothread id='7'/></iothreadids>")
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    out = render(dom, plan).root
    emulator = out.find("cputune/emulatorpin").get("cpuset")
    assert [(p.get("iothread"), p.get("cpuset")) for p in out.findall("cputune/iothreadpin")] == \
        [("1", emulator), ("7", emulator)]
    # rendering the rendered domain changes nothing (no second pin)
    again = render(Domain(out, "rendered"), plan).root
    assert len(again.findall("cputune/iothreadpin")) == 2


# -- the check before a repair -----------------------------------------------------------------

def test_a_repair_refuses_a_core_another_domain_holds_now_or_that_is_offline(host_model):
    host = host_model("two-socket")
    with open(TEMPLATE) as f:
        dom = Domain.parse(f.read(), "template")
    plan = plan_domain(host, CFG, Request.from_domain(dom), Ledger())
    assert fit.pin_problems(host, CFG, plan, Ledger()) == []
    thief = Holding.from_plan(replace(plan, domain="thief", uuid=None), active=True)
    [line] = fit.pin_problems(host, CFG, plan, Ledger([thief]))
    assert f"CPUs {plan.vcpu_pins[0]}" in line and "held by domain" in line and "thief" in line
    gone = replace(plan, vcpu_pins=(200,))
    assert any("200" in line and "not online" in line for line in fit.pin_problems(host, CFG, gone, Ledger()))


# -- a repair that fails half-way ----------------------------------------------------------------

class _Dom:
    """libvirt's domain object as a repair uses it; `refuse`: the call that fails."""

    def __init__(self, refuse: str | None = None):
        self.calls, self.refuse = [], refuse

    def _call(self, name, *args):
        import libvirt
        if name == self.refuse and not any(c[0] == name for c in self.calls):
            self.calls.append((name, "refused"))
            raise libvirt.libvirtError("Requested operation is not valid")
        self.calls.append((name, *args))

    def pinVcpuFlags(self, i, cpumap, flags):
        self._call("pinVcpuFlags", i, cpumap)

    def pinEmulator(self, cpumap, flags):
        self._call("pinEmulator", cpumap)


def test_a_failed_change_puts_back_every_change_made_before_it(quiet_log):
    pytest.importorskip("libvirt")
    from vstor.errors import ActionFailed
    rec = type("Rec", (), {"domain": "vm1", "steps": []})()
    diffs = [Change("vcpu", 1, (0, 1), (5,)), Change("emulator", None, (4,), (0, 1))]
    dom, said = _Dom(refuse="pinEmulator"), []
    with pytest.raises(ActionFailed) as e:
        drift._apply(dom, rec, diffs, 6, said.append)
    assert "every change made before it was undone" in str(e.value) and "emulator" in str(e.value)
    assert dom.calls == [("pinVcpuFlags", 1, (False,) * 5 + (True,)), ("pinEmulator", "refused"),
                         ("pinVcpuFlags", 1, (True, True, False, False, False, False))]
    assert said == ["pinned vCPU 1 to 5 (was 0-1)"]
    dom = _Dom()
    drift._apply(dom, rec, diffs, 6, said.append)
    assert [c[0] for c in dom.calls] == ["pinVcpuFlags", "pinEmulator"]


# -- the repair journaled: its record, an interrupted run, its undo ---------------------------

@pytest.fixture
def quiet_log(monkeypatch):
    """vstor.log's lines go nowhere (a pure test opens no syslog socket)."""
    from vstor import log
    monkeypatch.setattr(log, "_sinks", [])


def _cpumap(cores, n=64) -> tuple:
    return tuple(i in cores for i in range(n))


class _Running:
    """libvirt's running domain as find, repair and undo ask it: its live
    XML (the plan in it) and its pins, which the pin calls change;
    `refuse`: the one call that fails."""

    def __init__(self, xml: str, plan: Plan, refuse: str | None = None):
        vcpus, emulator = plan.thread_pins()
        self.xml, self.refuse, self.calls = xml, refuse, []
        self.vcpus, self.emulator, self.iothreads = [set(v) for v in vcpus], set(emulator), {1: set(emulator)}
        self.nodes = drift.planned_numa(plan)[1]

    def isActive(self):
        return 1

    def XMLDesc(self, flags):
        return self.xml

    def vcpuPinInfo(self, flags):
        return [_cpumap(v) for v in self.vcpus]

    def emulatorPinInfo(self, flags):
        return _cpumap(self.emulator)

    def ioThreadInfo(self, flags):
        return [(i, _cpumap(c)) for i, c in self.iothreads.items()]

    def numaParameters(self, flags):
        return {"numa_mode": 0, "numa_nodeset": ",".join(map(str, self.nodes))}

    def _change(self, name):
        import libvirt
        self.calls.append(name)
        if name == self.refuse:
            raise libvirt.libvirtError("Requested operation is not valid")

    def pinVcpuFlags(self, i, cpumap, flags):
        self._change("pinVcpuFlags")
        self.vcpus[i] = {c for c, on in enumerate(cpumap) if on}

    def pinEmulator(self, cpumap, flags):
        self._change("pinEmulator")
        self.emulator = {c for c, on in enumerate(cpumap) if on}

    def pinIOThread(self, i, cpumap, flags):
        self._change("pinIOThread")
        self.iothreads[i] = {c for c, on in enumerate(cpumap) if on}


@pytest.fixture
def running(host_model, tmp_path, quiet_log):
    """A running domain vstor holds (its record, no steps) and libvirt's
    answers for it, as planned; the arguments repair and undo take."""
    pytest.importorskip("libvirt")
    from vstor.runtime.state import Record, StateDir
    host = host_model("two-socket")
    with open(TEMPLATE) as f:
        dom = Domain.parse(f.read(), "template")
    plan = plan_domain(host, CFG, Request.from_domain(dom), Ledger())
    live = _Running(render(dom, plan).to_string(), plan)
    state = StateDir(str(tmp_path / "state"))
    from vstor.meta.holding import holding_to_json
    state.save(Record(key=dom.safe_name, domain=dom.name, uuid=dom.uuid, status="prepared",
                      holding=holding_to_json(Holding.from_plan(plan, active=True))))
    e = type("Env", (), {})()
    e.dom, e.plan, e.host, e.state, e.key, e.name = live, plan, host, state, dom.safe_name, dom.name
    e.conn = type("Conn", (), {"lookupByUUIDString": lambda _s, _u: live, "lookupByName": lambda _s, _n: live})()
    e.rt = type("Rt", (), {"cfg": CFG})()
    e.said = []
    e.repair = lambda dry_run=False: drift.repair(e.conn, e.rt, state, host, e.key, e.said.append, dry_run)
    e.undo = lambda dry_run=False: drift.undo(e.conn, e.rt, state, e.key, e.said.append, dry_run)
    e.record = lambda: state.load(e.key)
    return e


def _moved(e) -> tuple[set, set]:
    """vCPU 0 and the emulator moved off the plan; what they were."""
    was = set(e.dom.vcpus[0]), set(e.dom.emulator)
    e.dom.vcpus[0], e.dom.emulator = {7}, {6, 7}
    return was


def test_a_repair_record_round_trips_and_an_old_record_without_one_still_loads(running, tmp_path):
    from vstor.runtime.index import summary
    from vstor.runtime.state import Record
    rec = running.record()
    assert rec.repair == {} and "repair" not in rec.to_json()       # kept only when set
    rec.repair = {"status": "done", "at": 1.5, "changes": [
        Change("vcpu", 0, (7,), (4,)).to_json(), Change("daemon", 4711, (3,), (0, 1), 4712).to_json()]}
    before = summary(rec)
    running.state.save(rec)
    again = running.record()
    assert again.repair == rec.repair and Record.from_json(again.to_json()) == again
    assert running.state.unchanged(again)                          # gc's comparison, as read
    assert summary(again) == before                                # the index sees no new key
    assert [Change.from_json(c) for c in again.repair["changes"]][1].thread == 4712
    for bad in ({"status": "fixing", "at": 1, "changes": []}, {"status": "done", "at": 1, "changes": [{}]},
                {"status": "done", "at": 1, "changes": [{"what": "vcpu", "item": 0, "have": [-1], "want": [1]}]}):
        rec.repair = bad
        with pytest.raises(ValueError):
            from vstor.runtime.recordfile import check_shape
            check_shape(rec)


def test_a_repair_is_recorded_before_its_first_change_and_kept_once_done(running):
    vcpu, emulator = _moved(running)
    seen = []
    pin = running.dom.pinVcpuFlags

    def pin_looking(i, cpumap, flags):
        seen.append(running.record().repair)      # what the record says as the change is made
        pin(i, cpumap, flags)
    running.dom.pinVcpuFlags = pin_looking
    done, left = running.repair()
    assert [d.what for d in done] == ["vcpu", "emulator"] and left == []
    assert seen[0]["status"] == "repairing"
    assert [(c["what"], c["have"], c["want"]) for c in seen[0]["changes"]] == \
        [("vcpu", [7], sorted(vcpu)), ("emulator", [6, 7], sorted(emulator))]
    rec = running.record()
    assert rec.repair["status"] == "done" and rec.repair["changes"] == seen[0]["changes"]
    assert running.dom.vcpus[0] == vcpu and running.dom.emulator == emulator


def test_a_repair_that_fails_leaves_the_record_as_it_was(running):
    _moved(running)
    running.dom.refuse = "pinEmulator"
    from vstor.errors import ActionFailed
    with pytest.raises(ActionFailed, match="every change made before it was undone"):
        running.repair()
    assert running.record().repair == {} and running.dom.vcpus[0] == {7}      # put back


def test_an_interrupted_repair_is_finished_by_the_next_with_what_was_there_before(running):
    vcpu, emulator = _moved(running)
    # killed after its record and its first change (vCPU 0), before the emulator's
    rec = running.record()
    rec.repair = {"status": "repairing", "at": 1.0, "changes": [
        Change("vcpu", 0, (7,), tuple(sorted(vcpu))).to_json(),
        Change("emulator", None, (6, 7), tuple(sorted(emulator))).to_json()]}
    running.state.save(rec)
    running.dom.vcpus[0] = set(vcpu)
    from vstor.cli.runtime import _unfinished_repair
    assert _unfinished_repair(running.record()) == \
        f"a repair of {running.name} was interrupted (fix: vstor repair {running.name})"
    done, _ = running.repair()
    assert running.said[0] == f"a repair of {running.name} was interrupted: finishing it"
    assert [d.what for d in done] == ["emulator"] and running.dom.calls == ["pinEmulator"]
    rec = running.record()
    assert rec.repair["status"] == "done" and _unfinished_repair(rec) is None
    assert [c["have"] for c in rec.repair["changes"]] == [[7], [6, 7]]      # the undo puts back both
    running.undo()
    assert running.dom.vcpus[0] == {7} and running.dom.emulator == {6, 7}
    assert running.record().repair == {}


def test_killed_after_its_last_change_the_next_repair_marks_it_done(running):
    rec = running.record()
    rec.repair = {"status": "repairing", "at": 1.0, "changes": [Change("vcpu", 0, (7,), (4,)).to_json()]}
    running.state.save(rec)
    assert running.repair() == ([], [])
    assert running.record().repair["status"] == "done" and running.dom.calls == []


def test_undo_puts_back_what_the_repair_found_and_forgets_it(running):
    _moved(running)
    running.repair()
    running.said.clear()
    back = running.undo(dry_run=True)
    assert [c.what for c in back] == ["vcpu", "emulator"] and running.record().repair["status"] == "done"
    assert running.said[0].startswith("would put vCPU 0 back on 7") and running.dom.vcpus[0] != {7}
    running.undo()
    assert running.dom.vcpus[0] == {7} and running.dom.emulator == {6, 7}
    assert running.record().repair == {}
    assert [d.what for d in drift.find(running.conn, running.rt, running.record())] == ["vcpu", "emulator"]


def test_undo_refuses_with_nothing_to_undo_or_an_interrupted_repair(running):
    from vstor.errors import BadInput
    with pytest.raises(BadInput, match="no repair of domain .* since it started: there is nothing to undo") as e:
        running.undo()
    assert e.value.exit_code == 2 and e.value.hint
    rec = running.record()
    rec.repair = {"status": "repairing", "at": 1.0, "changes": []}
    running.state.save(rec)
    with pytest.raises(BadInput, match="was interrupted") as e:
        running.undo()
    assert e.value.hint == f"finish it first: vstor repair {running.name}"


def test_undo_refuses_when_an_item_moved_since_the_repair(running):
    from vstor.errors import DoesNotFit
    _moved(running)
    running.repair()
    running.dom.emulator = {3}
    running.dom.calls.clear()
    with pytest.raises(DoesNotFit, match="the emulator threads: on 3 now, where the repair left ") as e:
        running.undo()
    assert e.value.exit_code == 3 and "nothing changed" in e.value.message
    assert running.dom.calls == [] and running.record().repair["status"] == "done"


def test_an_undo_that_fails_puts_back_and_keeps_the_repair(running):
    from vstor.errors import ActionFailed
    _moved(running)
    running.repair()
    kept = running.record().repair
    running.dom.refuse = "pinEmulator"
    with pytest.raises(ActionFailed, match="every change made before it was undone"):
        running.undo()
    assert running.record().repair == kept
    assert not drift.find(running.conn, running.rt, running.record())       # as the repair left it


def test_a_killed_undo_is_finished_by_the_next_undo_or_undone_by_a_repair(running):
    vcpu, emulator = _moved(running)
    running.repair()
    rec = running.record()
    rec.repair = {**rec.repair, "status": "undoing"}       # killed after vCPU 0 was put back
    running.state.save(rec)
    running.dom.vcpus[0] = {7}
    assert "--undo" in drift.unfinished(rec)
    running.said.clear()
    running.undo()
    assert running.said[0] == f"an undo of {running.name}'s last repair was interrupted: finishing it"
    assert [line.split(" on ")[0] for line in running.said[1:]] == ["put back the emulator threads"]
    assert running.dom.emulator == {6, 7} and running.record().repair == {}
    # the same, undone by a repair instead: the record is the first repair's again
    running.repair()
    first = running.record().repair["changes"]
    rec = running.record()
    rec.repair = {**rec.repair, "status": "undoing"}
    running.state.save(rec)
    running.dom.vcpus[0] = {7}
    running.repair()
    assert running.record().repair["status"] == "done" and running.record().repair["changes"] == first
    assert running.dom.vcpus[0] == vcpu


def test_a_record_made_at_prepare_holds_no_repair():
    from vstor.runtime.state import Record
    assert Record(key="vm1", domain="vm1", uuid=None).repair == {}


def test_a_plan_changed_in_the_live_xml_is_never_what_drift_is_judged_by(running):
    """Whoever may define the domain can rewrite its live metadata (virsh
    metadata --live): a plan whose cores are not the ones its start took is
    refused, so neither status nor repair follow it onto another's cores."""
    from vstor import records
    from vstor.errors import Unavailable
    forged = records.replace(running.plan, vcpu_pins=tuple(c + 1 for c in running.plan.vcpu_pins))
    running.dom.xml = render(Domain.parse(running.dom.xml, "live"), forged).to_string()
    with pytest.raises(Unavailable, match="does not place it where its start did"):
        running.repair()
    with pytest.raises(Unavailable, match="does not place it where its start did"):
        drift.find(running.conn, running.rt, running.record())



def test_a_repair_never_pins_onto_cores_its_start_would_not_give(host_model):
    """The emulator's and shared vCPUs' cores are checked as the start checks
    them (the placement's own), not only to be online: a plan putting them
    on another domain's dedicated cores is refused before anything moves."""
    from vstor import records
    from vstor.planner import fit
    host = host_model("two-socket")
    with open(TEMPLATE) as f:
        dom = Domain.parse(f.read(), "template")
    victim = plan_domain(host, CFG, Request.from_domain(dom), Ledger())
    held = records.replace(Holding.from_plan(records.replace(victim, domain="victim",
                                                             uuid="11111111-1111-1111-1111-111111111111"),
                                             active=True), volumes=frozenset(), sockets=frozenset())
    me = plan_domain(host, CFG, Request.from_domain(dom), Ledger([held]))
    assert fit.pin_problems(host, CFG, me, Ledger([held])) == []
    onto = records.replace(me, emulator=tuple(victim.vcpu_pins))
    assert fit.pin_problems(host, CFG, onto, Ledger([held]))
    shared = records.replace(me, cpus="shared", shared_cpus=tuple(victim.vcpu_pins), vcpu_pins=(), reserved=())
    assert fit.pin_problems(host, CFG, shared, Ledger([held]))
