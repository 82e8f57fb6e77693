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
from vstor.runtime.drift import Controller, DaemonThreads, Difference, Live

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


def test_a_failed_change_puts_back_every_change_made_before_it():
    pytest.importorskip("libvirt")
    from vstor.errors import ActionFailed
    rec = type("Rec", (), {"domain": "vm1", "steps": []})()
    diffs = [Difference("vcpu", "m", True, 1, (5,), (0, 1)), Difference("emulator", "m", True, None, (0, 1), (4,))]
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
