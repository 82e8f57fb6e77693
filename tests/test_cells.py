"""Guests with several NUMA cells (vstor.planner.cells): judged by the host
model read from sysfs (which node each CPU, controller and hugepage pool is
on), libvirt's own parser and schema for what is rendered, and the start
check, on layouts with disks on two and three nodes."""

import copy
import itertools
import random

import pytest
from lxml import etree

from tests.test_libvirt_accepts import accepted, conn  # noqa: F401  (libvirt's test driver)
from tests.test_planner import SPDK_CFG, nvme, qsd_file, request
from vstor.config import Config
from vstor.errors import BadInput, DoesNotFit
from vstor.meta.document import Domain
from vstor.meta.metadata import Metadata, digest
from vstor.meta.xmlmodel import canonical
from vstor.planner import Request, fit, plan_domain
from vstor.meta.intent import DiskIntent, NvmeSource
from vstor.planner.hotplug import plan_attach
from vstor.planner.ledger import Holding, Ledger
from vstor.records import replace
from vstor.render import buses
from vstor.render.libvirt import render, with_spares

CFG3 = Config(reactors=(7, 15, 23))


def node_of(host, cpu: int) -> int:
    return next(n.id for n in host.nodes if cpu in n.cpus)


def controller_node(host, address: str) -> int:
    return next(c.numa_node for c in host.controllers if c.address == address)


def check_cells(host, cfg, plan) -> None:
    """What the host model says must hold of every plan with cells."""
    assert [c.id for c in plan.cells] == list(range(len(plan.cells)))
    assert sorted(v for c in plan.cells for v in c.vcpus) == list(range(plan.vcpus))
    assert sum(c.memory_kib for c in plan.cells) == plan.memory_kib
    for c in plan.cells:
        pins = [plan.vcpu_pins[v] for v in c.vcpus] if plan.vcpu_pins else []
        assert all(node_of(host, p) == c.node for p in pins), (c, pins)
        if plan.hugepage_kib:
            assert c.hugepages * plan.hugepage_kib == c.memory_kib
    for d in plan.disks:
        cell = plan.disk_cell(d)
        if d.controller and plan.numa == "strict":
            assert controller_node(host, d.controller) == cell.node
        if d.reactor is not None:
            assert node_of(host, d.reactor) == cell.node
    assert not set(plan.dedicated_cpus) & set(cfg.reactors)


def test_disks_on_two_nodes_give_two_cells_each_on_its_devices_node(host_model):
    host = host_model("two-socket")
    req = request(nvme("0000:3b:00.0", backend="spdk") + nvme("0000:5e:00.0", target="vdc", backend="spdk"),
                  vm="<vstor:vm hugepages='2M'/>", vcpus=6, memory_mib=6144)
    plan = plan_domain(host, SPDK_CFG, req, Ledger())
    check_cells(host, SPDK_CFG, plan)
    assert [(c.node, c.vcpus, c.hugepages) for c in plan.cells] == [(0, (0, 1, 2), 1536), (1, (3, 4, 5), 1536)]
    assert [(d.target, d.cell, d.reactor) for d in plan.disks] == [("vdb", 0, 2), ("vdc", 1, 18)]
    assert Holding.from_plan(plan).hugepages == ((0, 2048, 1536), (1, 2048, 1536))
    assert fit.problems(host, SPDK_CFG, req, plan, Ledger()) == []


def test_disks_on_three_nodes_give_three_cells_and_libvirt_takes_the_domain(host_model, conn, tmp_path):  # noqa: F811
    host = host_model("three-node")
    disks = (nvme("0000:41:00.0", backend="qsd") + nvme("0000:81:00.0", target="vdc", backend="qsd")
             + nvme("0000:c1:00.0", target="vdd", backend="qsd"))
    req = request(disks, vcpus=7, memory_mib=7000)
    plan = plan_domain(host, CFG3, req, Ledger())
    check_cells(host, CFG3, plan)
    assert [len(c.vcpus) for c in plan.cells] == [3, 2, 2]
    assert [c.node for c in plan.cells] == [0, 1, 2]
    assert [d.cell for d in plan.disks] == [0, 1, 2]
    assert Holding.from_plan(plan).memory == tuple((c.node, c.memory_kib) for c in plan.cells)
    dom = Domain.parse(request_xml(disks, vcpus=7, memory_mib=7000))
    parsed = accepted(conn, render(dom, plan).to_string(), tmp_path)
    try:
        cells = parsed.findall("cpu/numa/cell")
        assert [(c.get("id"), c.get("cpus")) for c in cells] == [("0", "0-2"), ("1", "3-4"), ("2", "5-6")]
        assert [(m.get("cellid"), m.get("nodeset")) for m in parsed.findall("numatune/memnode")] == \
            [("0", "0"), ("1", "1"), ("2", "2")]
        assert parsed.find("numatune/memory").get("nodeset") == "0-2"
    finally:
        conn.lookupByName("vm1").undefine()


def request_xml(disks, vm="", name="vm1", vcpus=4, memory_mib=8192, machine="q35") -> str:
    return (f"<domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>"
            f"<vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>"
            f"{vm}{disks}</vstor:vstor></metadata><os><type arch='x86_64' machine='{machine}'>hvm</type>"
            "</os><devices/></domain>")


def test_a_number_of_cells_on_a_one_node_host_puts_every_cell_on_that_node(host_model):
    host = host_model("laptop")
    files = qsd_file("/var/lib/vstor/images/a.raw") + qsd_file("/var/lib/vstor/images/b.raw", target="vdc", cell="1")
    req = request(files, vm="<vstor:vm cells='2' cpus='shared'/>", vcpus=2, memory_mib=1024)
    plan = plan_domain(host, Config(), req, Ledger())
    assert [(c.node, c.vcpus, c.memory_kib) for c in plan.cells] == [(0, (0,), 524288), (0, (1,), 524288)]
    assert [d.cell for d in plan.disks] == [0, 1]
    assert Holding.from_plan(plan).memory == ((0, 1048576),)
    assert fit.problems(host, Config(), req, plan, Ledger()) == []


def test_cells_sharing_a_node_never_share_a_core(host_model):
    host = host_model("three-node")
    req = request(qsd_file() + qsd_file("/var/lib/vstor/images/b.raw", target="vdc", cell="3"),
                  vm="<vstor:vm cells='4' hugepages='2M'/>", vcpus=8, memory_mib=4096)
    plan = plan_domain(host, CFG3, req, Ledger())
    check_cells(host, CFG3, plan)
    assert len(set(plan.dedicated_cpus)) == len(plan.vcpu_pins) + len(plan.reserved)
    assert sorted({c.node for c in plan.cells}) == [0, 1, 2]     # the freest nodes first, then again


@pytest.mark.parametrize("vm, disks, words", [
    ("<vstor:vm cells='4'/>", "", "3 vCPUs for 4 guest NUMA cells"),
    ("<vstor:vm cells='2' numa='none' cpus='shared' hugepages='none'/>", "", "numa='none'"),
    ("<vstor:vm cells='2'/>", nvme("0000:c1:00.0", target="vdd", backend="qsd"),
     "none of its 2 guest cells is there"),
    ("", nvme("0000:c1:00.0", target="vdd", backend="qsd", cell="1"), "guest cell 1 cannot be on host node 1 and on node 2"),
    ("<vstor:vm cells='2'/>", qsd_file("/var/lib/vstor/images/c.raw", target="vdd", cell="2"),
     "a disk is in guest cell 2; the guest has 2 cells"),
])
def test_cells_that_cannot_be_made_are_bad_input_naming_the_cell(host_model, vm, disks, words):
    host = host_model("three-node")
    base = nvme("0000:41:00.0", backend="qsd") + nvme("0000:81:00.0", target="vdc", backend="qsd", cell="1")
    with pytest.raises(BadInput) as e:
        plan_domain(host, CFG3, request(base + disks, vm=vm, vcpus=3, memory_mib=3072), Ledger())
    assert words in str(e.value) and e.value.hint and "\n" not in str(e.value)


def test_a_cell_whose_node_is_full_is_refused_naming_the_cell(host_model):
    host = host_model("three-node")
    big = request(nvme("0000:81:00.0", backend="qsd", readonly="yes"), name="big", vcpus=12, memory_mib=1024)
    held = Ledger([Holding.from_plan(plan_domain(host, CFG3, big, Ledger()), active=True)])
    req = request(nvme("0000:41:00.0", backend="qsd") + nvme("0000:81:00.0", target="vdc", backend="qsd",
                                                             readonly="yes"), vcpus=4, memory_mib=2048)
    with pytest.raises(DoesNotFit) as e:
        plan_domain(host, CFG3, req, held)
    assert "guest cell 1 (2 vCPUs, 1024 MiB): node 1:" in str(e.value)


def test_the_start_check_names_the_cell_whose_cores_another_domain_took(host_model):
    host = host_model("two-socket")
    req = request(nvme("0000:3b:00.0", backend="qsd") + nvme("0000:5e:00.0", target="vdc", backend="qsd"))
    plan = plan_domain(host, SPDK_CFG, req, Ledger())
    thief = Holding("thief", None, True, 1, frozenset(plan.vcpu_pins[2:3]), (), (), (),
                    frozenset(), frozenset(), frozenset(), frozenset())
    out = fit.problems(host, SPDK_CFG, req, plan, Ledger([thief]))
    assert out and out[0].startswith("guest cell 1: CPUs") and "thief" in out[0]


def test_a_cell_plan_with_fewer_pins_than_vcpus_is_refused_not_a_crash(host_model):
    """A forged plan whose pins run out before its cells' vCPUs do: each cell
    takes the pins there are, and the start check names the first cell they
    do not fit (it raised StopIteration, an internal error, before)."""
    host = host_model("two-socket")
    req = request(nvme("0000:3b:00.0", backend="qsd") + nvme("0000:5e:00.0", target="vdc", backend="qsd"))
    plan = plan_domain(host, SPDK_CFG, req, Ledger())
    assert len(plan.cells) == 2
    for pins in (plan.vcpu_pins[:1], plan.vcpu_pins[:3]):
        out = fit.problems(host, SPDK_CFG, req, replace(plan, vcpu_pins=pins), Ledger())
        assert out and all(line.startswith("guest cell ") for line in out), out


def test_a_one_node_guest_is_one_cell_of_the_same_shape(host_model):
    """One plan shape: a one-node plan records no <cell> (as vstor always
    wrote it) and reads as one CellPlan, the type a plan with cells holds."""
    from vstor.meta.plan import CellPlan
    host = host_model("two-socket")
    one = plan_domain(host, SPDK_CFG, request(nvme("0000:5e:00.0", backend="spdk"),
                                              vm="<vstor:vm hugepages='2M'/>", vcpus=2), Ledger())
    two = plan_domain(host, SPDK_CFG, request(nvme("0000:3b:00.0", backend="spdk") + nvme(
        "0000:5e:00.0", target="vdc", backend="spdk"), vm="<vstor:vm hugepages='2M'/>"), Ledger())
    assert not one.cells and len(two.cells) == 2
    assert {type(c) for c in one.guest_cells() + two.guest_cells()} == {CellPlan}
    assert one.guest_cells() == (CellPlan(0, one.node, (0, 1), one.memory_kib, one.hugepages, one.emulator),)
    assert one.disk_cell(one.disks[0]).id == 0


def test_a_one_cell_plan_made_before_cells_still_passes_the_start_check(host_model):
    """A domain planned before guests had cells keeps its plan: the start
    check takes a recorded one-node plan as one (re-planning is the
    operator's call, `vstor apply`)."""
    host = host_model("two-socket")
    disks = nvme("0000:3b:00.0", backend="qsd") + nvme("0000:5e:00.0", target="vdc", backend="qsd")
    req = request(disks, vm="<vstor:vm numa='preferred'/>")
    assert plan_domain(host, SPDK_CFG, req, Ledger()).cells         # planned today: two cells
    one = plan_domain(host, SPDK_CFG, request(disks, vm="<vstor:vm numa='preferred' cells='one'/>"), Ledger())
    old = replace(one, digest=digest(req.intent))                   # as recorded before cells
    assert not old.cells and fit.problems(host, SPDK_CFG, req, old, Ledger()) == []


def test_an_intent_without_cells_keeps_the_digest_plans_were_made_for():
    """Unset, cells and cell stay out of the canonical form: plans recorded
    before they existed still match their metadata."""
    req = request(nvme("0000:3b:00.0"))
    assert b"cell" not in canonical(Metadata(req.intent.vm, req.intent.disks))


def one_owner_each(holdings) -> dict[int, str]:
    """CPU -> the one holding that has it (asserted: never two)."""
    owners: dict[int, str] = {}
    for h in holdings:
        for cpu in h.cpus:
            assert cpu not in owners, f"CPU {cpu} of {h.domain} is {owners[cpu]}'s"
            owners[cpu] = h.domain
    return owners


def test_spread_guests_mixed_with_one_node_guests_never_share_a_core(host_model):
    """A placement simulation: random guests, some spread over the nodes of
    their disks, planned one after another against the ledger of the ones
    before, until the host is full."""
    host = host_model("three-node")
    rng = random.Random(24)
    addrs = ["0000:41:00.0", "0000:81:00.0", "0000:c1:00.0"]
    holdings, spread = [], 0
    for i in range(60):
        n = rng.choice([1, 1, 2, 3])
        picked = rng.sample(addrs, n)
        disks = "".join(nvme(a, target=f"vd{'bcd'[k]}", backend="qsd", readonly="yes")
                        for k, a in enumerate(picked))
        vm = rng.choice(["", "<vstor:vm hugepages='2M'/>", "<vstor:vm cpus='shared'/>"])
        req = request(disks, vm=vm, name=f"g{i}", vcpus=rng.choice([n, 3, 4]), memory_mib=2048)
        try:
            plan = plan_domain(host, CFG3, req, Ledger(holdings))
        except DoesNotFit:
            continue
        spread += bool(plan.cells)
        if plan.cells:
            check_cells(host, CFG3, plan)
        holdings.append(Holding.from_plan(plan, active=rng.random() < 0.5))
    owners = one_owner_each(holdings)
    assert spread >= 5 and len(holdings) >= 10
    assert not set(owners) & set(CFG3.reactors)
    for node in host.nodes:
        for pool in node.hugepages:
            promised = sum(c for h in holdings for (n, s, c) in h.hugepages if (n, s) == (node.id, pool.size_kib))
            assert promised <= pool.free


def test_a_live_migration_keeps_the_guests_cells_on_a_host_of_other_nodes(host_model):
    """The destination plans the cells the arriving XML gives the guest
    (its ABI), on its own nodes: two cells on a one-node host."""
    disks = (qsd_file("/var/lib/vstor/images/a.raw") +
             qsd_file("/var/lib/vstor/images/b.raw", target="vdc", cell="1"))
    vm = "<vstor:vm cells='2' cpus='shared' migratable='yes'/>"
    dom = Domain.parse(request_xml(disks, vm=vm, vcpus=3, memory_mib=2048))
    source = render(dom, plan_domain(host_model("two-socket"), SPDK_CFG, Request.from_domain(dom), Ledger()))
    # the destination's metadata asks for one cell now: the arriving guest keeps its two
    arriving = Domain.parse(source.to_string().replace("cells=\"2\"", "cells=\"one\""))
    here = plan_domain(host_model("laptop"), Config(), Request.keeping_cells(arriving), Ledger())
    assert [(c.node, c.vcpus) for c in here.cells] == [(0, (0, 1)), (0, (2,))]
    assert [d.cell for d in here.disks] == [0, 1]


@pytest.mark.parametrize("cells, words", [
    ("<cell id='0' cpus='0,2' memory='1048576' unit='KiB'/><cell id='1' cpus='1,3' memory='1048576' unit='KiB'/>",
     "are not ones vstor gives"),
    ("<cell id='0' cpus='0-1' memory='1048576' unit='KiB'/><cell id='1' cpus='2-3' memory='1' unit='KiB'/>",
     "are not ones vstor gives"),
    ("<cell id='0' cpus='0-1' memory='x' unit='KiB'/>", "is not cpus/memory/unit vstor reads"),
    ("<cell id='0' cpus='0-1' memory='1' unit='parsecs'/>", "is not cpus/memory/unit vstor reads"),
])
def test_arriving_cells_vstor_does_not_give_are_refused(cells, words):
    xml = request_xml(qsd_file(), vm="<vstor:vm cells='2'/>", vcpus=4, memory_mib=2048).replace(
        "</os>", f"</os><cpu><numa>{cells}</numa></cpu>")
    with pytest.raises(BadInput) as e:
        Request.keeping_cells(Domain.parse(xml))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_hot_plugged_disk_goes_to_the_cell_of_its_devices_node(host_model):
    host = host_model("three-node")
    disks = nvme("0000:41:00.0", backend="qsd") + nvme("0000:c1:00.0", target="vdc", backend="qsd")
    req = request(disks, vcpus=4, memory_mib=2048)
    plan = plan_domain(host, CFG3, req, Ledger())
    assert [c.node for c in plan.cells] == [0, 2]
    new = plan_attach(host, CFG3, req, plan, DiskIntent(target="vdd", source=NvmeSource("0000:c1:00.0", 1),
                                                        readonly=True), Ledger())
    assert new.disk("vdd").cell == 1 and new.cells == plan.cells
    with pytest.raises(DoesNotFit) as e:        # node 1 has no cell of this guest
        plan_attach(host, CFG3, req, plan, DiskIntent(target="vdd", source=NvmeSource("0000:81:00.0", 1)),
                    Ledger())
    assert "its guest cell 0 is on node 0 (numa='strict')" in str(e.value)
    with pytest.raises(BadInput) as e:
        plan_attach(host, CFG3, req, plan, DiskIntent(target="vdd", source=NvmeSource("0000:81:00.0", 1),
                                                      cell=2), Ledger())
    assert "names guest cell 2; domain 'vm1' has cells 0-1" in str(e.value)


def test_preferred_cells_give_qemus_own_memory_one_node_as_libvirt_requires(host_model, conn, tmp_path):  # noqa: F811
    host = host_model("two-socket")
    disks = nvme("0000:3b:00.0", backend="qsd") + nvme("0000:5e:00.0", target="vdc", backend="qsd")
    dom = Domain.parse(request_xml(disks, vm="<vstor:vm numa='preferred'/>"))
    plan = plan_domain(host, SPDK_CFG, Request.from_domain(dom), Ledger())
    parsed = accepted(conn, render(dom, plan).to_string(), tmp_path)
    try:
        assert parsed.find("numatune/memory").attrib == {"mode": "preferred", "nodeset": "0"}
        assert [m.get("nodeset") for m in parsed.findall("numatune/memnode")] == ["0", "1"]
    finally:
        conn.lookupByName("vm1").undefine()


def test_a_nova_instance_keeps_novas_cells_and_gets_none_of_vstors(host_model):
    """Nova's flavor makes an instance's cells (hw:numa_nodes): vstor plans
    one, and never adds expander buses, whatever cells Nova's XML has."""
    xml = request_xml(qsd_file(), vm="<vstor:vm cpus='external' numa='none' hugepages='none'/>", vcpus=4,
                      memory_mib=2048).replace(
        "</os>", "</os><cpu><numa><cell id='0' cpus='0-1' memory='1048576' unit='KiB'/>"
                 "<cell id='1' cpus='2-3' memory='1048576' unit='KiB'/></numa></cpu>")
    nova = replace(Request.keeping_cells(Domain.parse(xml)), external_cpus=True)   # as a Nova domain's
    assert not plan_domain(host_model("two-socket"), SPDK_CFG, nova, Ledger()).cells
    asks = Domain.parse(xml.replace("numa='none'", "numa='none' cells='2'"))
    with pytest.raises(BadInput) as e:
        plan_domain(host_model("two-socket"), SPDK_CFG, replace(Request.from_domain(asks), external_cpus=True),
                    Ledger())
    assert "guest NUMA cells of a Nova instance are its flavor's" in str(e.value)


# What libvirt 9.0 did with these devices, none with a PCI address, next to a
# two-cell q35 guest of vstor's (tests/e2e/test_cells.py, real libvirtd): it
# gave each a pcie-root-port of its own (the NIC pci.1, the USB controller
# pci.2, SCSI pci.3, virtio-serial pci.4, the balloon pci.5, the RNG pci.6),
# filling the indices below vstor's first controller, or else taking the first
# free port there is: a cell's spare.
UNADDRESSED = ("<controller type='usb' model='qemu-xhci'/><controller type='scsi' model='virtio-scsi'/>"
               "<controller type='virtio-serial'/><memballoon model='virtio'/>"
               "<interface type='user'><model type='virtio'/></interface>"
               "<rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>")
TWO_CELLS_FILES = (qsd_file("/var/lib/vstor/images/b.raw", cell="1")
                   + qsd_file("/var/lib/vstor/images/c.raw", target="vdc", cell="0")
                   + qsd_file("/var/lib/vstor/images/d.raw", target="vdd", cell="1"))


def two_cell_domain(host_model, devices: str):
    xml = request_xml(TWO_CELLS_FILES, vm="<vstor:vm cells='2' cpus='shared'/>", vcpus=2, memory_mib=256)
    dom = Domain.parse(xml.replace("<devices/>", f"<devices>{devices}</devices>"))
    return dom, plan_domain(host_model("laptop"), Config(), Request.from_domain(dom), Ledger())


def vstor_controllers(dom) -> list[tuple]:
    return [(c.get("index"), c.get("model"), c.find("alias").get("name"))
            for c in dom.root.iterfind("devices/controller[@type='pci']") if c.find("alias") is not None]


def test_libvirt_places_the_devices_first_and_a_cells_spare_port_comes_after_them(host_model):
    """vstor models no part of libvirt's allocator: the domain it gives
    libvirt to place has its cells' controllers at the lowest free indices
    and no spare port a device without an address could take (libvirt 9.0
    put a virtio tablet, an RNG, a NIC on a cell's spare); the spares go
    into what libvirt returned, above every port libvirt made."""
    dom, plan = two_cell_domain(host_model, UNADDRESSED)
    assert [(d.target, d.cell) for d in plan.disks] == [("vdb", 1), ("vdc", 0), ("vdd", 1)]
    first = render(dom, plan, spares=False)
    assert vstor_controllers(first) == [
        ("1", "pcie-expander-bus", "ua-vstor-cell0"), ("2", "pcie-root-port", "ua-vstor-cell0-port0"),
        ("3", "pcie-expander-bus", "ua-vstor-cell1"), ("4", "pcie-root-port", "ua-vstor-cell1-port0"),
        ("5", "pcie-root-port", "ua-vstor-cell1-port1")]
    assert all(buses.free_port(first.root.find("devices"), cell) is None for cell in (0, 1))
    addressed = libvirt_addressed(first)
    spared = with_spares(addressed)
    assert vstor_controllers(spared)[5:] == [("12", "pcie-root-port", "ua-vstor-cell0-port1"),
                                             ("13", "pcie-root-port", "ua-vstor-cell1-port2")]
    assert [int(buses.free_port(spared.root.find("devices"), c).get("bus"), 16) for c in (0, 1)] == [12, 13]
    assert with_spares(spared).to_string() == spared.to_string()      # one spare a cell
    # `vstor render` (one step) has them too, above its cells' controllers
    assert [c[0] for c in vstor_controllers(render(dom, plan))] == ["1", "2", "3", "4", "5", "6", "7"]
    # model='none': no device, no port (what the e2e guests have); nothing changes with the devices
    none = "<controller type='usb' model='none'/><memballoon model='none'/><input type='tablet' bus='virtio'/>"
    dom, plan = two_cell_domain(host_model, none)
    assert vstor_controllers(render(dom, plan, spares=False))[0][0] == "1"


# The domain as libvirt 9.0 returns it after the define of vstor's render
# without spares (tests/e2e/test_cells.py, real libvirtd): vstor's
# controllers as it rendered them (1-5), and a root port of libvirt's for
# each device without an address above them (the NIC pci.6, the USB
# controller pci.7, SCSI pci.8, virtio-serial pci.9, the balloon pci.10,
# the RNG pci.11).
def pci(bus: int, slot: int = 0, function: int = 0, extra: str = "") -> str:
    return (f"<address type='pci' domain='0x0000' bus='0x{bus:02x}' slot='0x{slot:02x}'"
            f" function='0x{function:x}'{extra}/>")


LIBVIRT_ADDRESSED = "".join([
    f"<controller type='usb' index='0' model='qemu-xhci'>{pci(7)}</controller>",
    f"<controller type='scsi' index='0' model='virtio-scsi'>{pci(8)}</controller>",
    f"<controller type='virtio-serial' index='0'>{pci(9)}</controller>",
    f"<controller type='sata' index='0'>{pci(0, 0x1f, 2)}</controller>",
    "<controller type='pci' index='0' model='pcie-root'/>",
    *(f"<controller type='pci' index='{i}' model='pcie-root-port'><model name='pcie-root-port'/>"
      f"<target chassis='{i}' port='0x{0x12 + i:x}'/>{pci(0, 3, i - 6, extra)}</controller>"
      for i, extra in zip(range(6, 12), [" multifunction='on'"] + [""] * 5)),
    f"<interface type='user'><mac address='52:54:00:c0:11:5e'/><model type='virtio'/>{pci(6)}</interface>",
    f"<memballoon model='virtio'>{pci(10)}</memballoon>",
    f"<rng model='virtio'><backend model='random'>/dev/urandom</backend>{pci(11)}</rng>",
])


def libvirt_addressed(rendered: Domain) -> Domain:
    """`rendered` (of UNADDRESSED) as libvirt returns it after its define."""
    devices = etree.fromstring(f"<devices>{LIBVIRT_ADDRESSED}</devices>")
    for e in rendered.root.find("devices"):
        if e.tag == "disk" or e.find("alias") is not None:      # vstor's, as libvirt kept them
            devices.append(copy.deepcopy(e))
    root = copy.deepcopy(rendered.root)
    root.replace(root.find("devices"), devices)
    return Domain(root, "libvirt's XML")


def test_a_domain_libvirt_has_addressed_renders_to_the_same_controllers(host_model):
    """vstor apply of a defined domain: its controllers come back at the
    indices libvirt holds, the spares too (they grew by three root ports
    per apply before)."""
    dom, plan = two_cell_domain(host_model, UNADDRESSED)
    first = with_spares(libvirt_addressed(render(dom, plan, spares=False)))
    again = render(first, plan, spares=False)
    assert vstor_controllers(again) == vstor_controllers(first)[:5]
    assert vstor_controllers(with_spares(again)) == vstor_controllers(first)
    addresses = {e.find("target").get("dev"): etree.tostring(e.find("address"))
                 for e in again.root.iterfind("devices/disk")}
    assert addresses == {e.find("target").get("dev"): etree.tostring(e.find("address"))
                         for e in first.root.iterfind("devices/disk")}
    assert len(with_spares(again).root.findall("devices/controller[@model='pcie-root-port']")) == 6 + 5


def test_vstors_controllers_keep_their_indices_below_controllers_libvirt_added_above_them():
    """libvirt 9.0, a two-cell guest of vstor's (its controllers 11-17) with
    an i6300esb watchdog (conventional PCI) and an ISA panic device: libvirt
    added root ports 1-10 and 18 and, for the watchdog, a pcie-to-pci-bridge
    19 on port 1.  vstor apply put its controllers above those (at 21, and
    libvirt filled 11-20 with root ports) before.  A device without an
    address (the RNG) moves none of them: libvirt places it before any
    spare is made."""
    devices = etree.fromstring(
        "<devices><controller type='pci' index='0' model='pcie-root'/>"
        + "".join(f"<controller type='pci' index='{i}' model='pcie-root-port'>{pci(0, 4 + i // 8, i % 8)}"
                  "</controller>" for i in (*range(1, 11), 18))
        + f"<controller type='pci' index='19' model='pcie-to-pci-bridge'>{pci(1)}</controller>"
        + f"<watchdog model='i6300esb' action='reset'>{pci(0x13, 1)}</watchdog><panic model='isa'/>"
        + f"<memballoon model='virtio'>{pci(6)}</memballoon><controller type='usb' model='none'/></devices>")
    assert list(itertools.islice(buses.free_indices(devices), 8)) == [11, 12, 13, 14, 15, 16, 17, 20]
    devices.append(etree.fromstring("<rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>"))
    assert list(itertools.islice(buses.free_indices(devices), 8)) == [11, 12, 13, 14, 15, 16, 17, 20]
    # a PCI controller without an index: libvirt numbers it, the lowest free one
    devices.append(etree.fromstring("<controller type='pci' model='pcie-root-port'/>"))
    assert list(itertools.islice(buses.free_indices(devices), 3)) == [12, 13, 14]
