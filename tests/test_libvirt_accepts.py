"""libvirt itself judges every element vstor emits (vstor/render/elements.py),
for every template in xml-templates/ (as written and with every disk
readonly), as the libvirt renderer, the migration renderer and hotplug emit
it, and for every shape of Nova flavor (Nova's own config classes build the
guest, tests/nova/oracle.py): the domain defines through libvirt's test
driver (`test:///default`, which runs libvirt's own parser and validation:
it refuses `<readonly/>` on a vhostuser disk, as libvirtd does),
`virt-xml-validate` accepts it, and what libvirt parsed back holds every
element vstor built (libvirt drops an element it does not know without a
word)."""

import copy
import glob
import os
import re

import pytest
from lxml import etree

from tests.helpers import accepted
from tests.nova import ask
from vstor.config import Config
from vstor.host.model import parse_cpulist
from vstor.meta.document import Domain
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.render.libvirt import device_xml, render, with_spares
from vstor.render.migration import render_incoming

libvirt = pytest.importorskip("libvirt")

HERE = os.path.dirname(__file__)
TEMPLATES = sorted(glob.glob(os.path.join(HERE, "..", "xml-templates", "*.xml")))
CFG = Config(reactors=(2, 18))
# What vstor builds, where libvirt keeps it in a domain.
BUILT = ("devices/disk[@type='vhostuser']", "devices/hostdev", "devices/iommu", "memoryBacking",
         "vcpu", "cputune", "numatune", "cpu/numa")


def holds(theirs, ours) -> bool:
    """Every attribute and child of `ours` is in `theirs` (libvirt adds its
    own: aliases, addresses, defaults), numbers compared as numbers."""
    def same(a, b):
        return a == b or any(f(a) is not None and f(a) == f(b) for f in (_number, _cpus))
    if theirs.tag != ours.tag or not all(same(theirs.get(k), v) for k, v in ours.attrib.items()):
        return False
    if (ours.text or "").strip() and (ours.text or "").strip() != (theirs.text or "").strip():
        return False
    return all(any(holds(t, o) for t in theirs) for o in ours)


def _number(s):
    try:
        return int(s, 0) if s is not None and re.fullmatch(r"(0x)?[0-9a-fA-F]+", s) else None
    except ValueError:
        return None


def _cpus(s):
    try:
        return parse_cpulist(s) if s is not None else None
    except ValueError:
        return None


def assert_libvirt_holds_what_vstor_built(sent: etree._Element, parsed: etree._Element,
                                          built=BUILT) -> None:
    for path in built:
        for ours in sent.findall(path):
            found = parsed.findall(path)
            assert any(holds(t, ours) for t in found), (
                f"libvirt did not keep {etree.tostring(ours, encoding='unicode')}; it has "
                + "".join(etree.tostring(t, encoding="unicode") for t in found))


def _readonly(text: str) -> str:
    return re.sub(r"<vstor:disk ", "<vstor:disk readonly='yes' ", text)


def _template(path: str, readonly: bool) -> Domain:
    with open(path) as f:
        text = f.read()
    return Domain.parse(_readonly(text) if readonly else text, path)


SHAPES = [(t, ro) for t in TEMPLATES for ro in (False, True)]
IDS = [os.path.basename(t) + ("-readonly" if ro else "") for t, ro in SHAPES]


@pytest.mark.parametrize("template, readonly", SHAPES, ids=IDS)
def test_libvirt_accepts_every_rendered_template(conn, host_model, tmp_path, template, readonly):
    dom = _template(template, readonly)
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    assert all(d.readonly == readonly for d in plan.disks)
    out = render(dom, plan)
    parsed = accepted(conn, out.to_string(), tmp_path)
    try:
        assert_libvirt_holds_what_vstor_built(out.root, parsed)
        assert out.root.find("devices/disk[@type='vhostuser']/readonly") is None
    finally:
        conn.lookupByName(plan.domain).undefine()


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_libvirt_accepts_both_steps_of_a_define(conn, host_model, tmp_path, template):
    """`vstor define`: the domain without its cells' spare ports, then, as
    libvirt returned it, with them."""
    dom = _template(template, False)
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    first = render(dom, plan, spares=False)
    parsed = accepted(conn, first.to_string(), tmp_path)
    try:
        addressed = Domain(parsed, "libvirt's XML")
        second = with_spares(addressed)
        assert_libvirt_holds_what_vstor_built(first.root, parsed)
        assert (second.to_string() != addressed.to_string()) == (len(plan.guest_cells()) > 1)
        assert_libvirt_holds_what_vstor_built(second.root, accepted(conn, second.to_string(), tmp_path))
    finally:
        conn.lookupByName(plan.domain).undefine()


@pytest.mark.parametrize("template, readonly", SHAPES, ids=IDS)
def test_libvirt_accepts_every_device_hotplug_gives_it(conn, host_model, tmp_path, template, readonly):
    """device_xml, as `vstor attach` hands it to libvirt, in the operator's
    domain (the test driver has no attach-device: the device is defined
    with the domain, through the same parser)."""
    dom = _template(template, readonly)
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    for disk in plan.disks:
        root = copy.deepcopy(dom.root)
        device = etree.fromstring(device_xml(disk))
        root.find("devices").append(device)
        parsed = accepted(conn, etree.tostring(root, encoding="unicode"), tmp_path)
        try:
            assert any(holds(t, device) for t in parsed.find("devices")), disk.target
        finally:
            conn.lookupByName(plan.domain).undefine()


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_libvirt_accepts_the_iothreadpins_of_a_domain_with_iothreads(conn, host_model, tmp_path, template):
    """A domain that declares I/O threads gets an iothreadpin for each, on
    the emulator's cores (elements.cputune): libvirt would otherwise run
    them on the dedicated vCPUs' cores."""
    dom = _template(template, False)
    iothreads = etree.fromstring("<iothreads>2</iothreads>")
    dom.root.find("vcpu").addnext(iothreads)
    iothreads.addnext(etree.fromstring("<iothreadids><iothread id='3'/></iothreadids>"))
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    out = render(dom, plan)
    parsed = accepted(conn, out.to_string(), tmp_path)
    try:
        assert_libvirt_holds_what_vstor_built(out.root, parsed)
        pins = {(p.get("iothread"), p.get("cpuset")) for p in parsed.iterfind("cputune/iothreadpin")}
        assert {i for i, _ in pins} == {"1", "3"}
        assert {c for _, c in pins} == {parsed.find("cputune/emulatorpin").get("cpuset")}
    finally:
        conn.lookupByName(plan.domain).undefine()


VHOST_TEMPLATES = [(t, ro) for t, ro in SHAPES if "passthrough" not in t]


@pytest.mark.parametrize("template, readonly", VHOST_TEMPLATES,
                         ids=[i for i, (t, _) in zip(IDS, SHAPES) if "passthrough" not in t])
def test_libvirt_accepts_what_a_migrating_domain_arrives_with(conn, host_model, tmp_path, template, readonly):
    dom = _template(template, readonly)
    plan = plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger())
    live = render(dom, plan)
    there = plan_domain(host_model("two-socket"), Config(reactors=(2, 18), vhost_dir="/run/there"),
                        Request.from_domain(live), Ledger())
    arriving = render_incoming(live, there)
    parsed = accepted(conn, arriving.to_string(), tmp_path)
    try:
        assert_libvirt_holds_what_vstor_built(arriving.root, parsed)
        sockets = {d.get("path") for d in parsed.iterfind("devices/disk[@type='vhostuser']/source")}
        assert sockets == {d.socket for d in there.disks} and all(s.startswith("/run/there/") for s in sockets)
    finally:
        conn.lookupByName(plan.domain).undefine()


# -- Nova --------------------------------------------------------------------------------

NOVA = {"name": "instance-0000002a", "uuid": "9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f10", "vcpus": 2,
        "memory_kib": 1 << 20, "machine": "q35"}
FILE = {"vstor:disk.vdb.file.path": "{images}/db.raw", "vstor:disk.vdb.project": "p1"}
RO_FILE = {"vstor:disk.vdb.file.path": "{images}/db.raw", "vstor:disk.vdb.readonly": "yes"}
FLAVORS = {
    "file": ({}, FILE),
    "readonly": ({}, RO_FILE),
    "readonly-shared-with-project": ({}, {**RO_FILE, "vstor:disk.vdb.project": "p1"}),
    "hugepages": ({"page_kb": 2048, "numa_cell": True}, FILE),
    "hugepages-readonly": ({"page_kb": 2048, "numa_cell": True}, RO_FILE),
    "dedicated-pinned-numa": ({"pins": [0, 1], "memory_nodes": {0}, "numa_cell": True},
                              {**FILE, "hw:cpu_policy": "dedicated"}),
    "queues-and-two-disks": ({}, {**FILE, "vstor:disk.vdb.queues": "4",
                                  "vstor:disk.vdc.file.path": "{images}/logs.raw",
                                  "vstor:disk.vdc.readonly": "yes"}),
    "nova-pci-passthrough-beside": ({"hostdevs": ["0000:5e:00.0"]}, FILE),
    "nvme-namespace-qsd": ({"host": "two-socket"}, {"vstor:disk.vdb.nvme.controller": "0000:5f:00.0",
                                                    "vstor:disk.vdb.nvme.namespace": "1",
                                                    "vstor:disk.vdb.backend": "qsd",
                                                    "vstor:disk.vdb.project": "p1"}),
    "nvme-namespace-readonly-hugepages": ({"host": "two-socket", "page_kb": 2048, "numa_cell": True},
                                          {"vstor:disk.vdb.nvme.controller": "0000:5f:00.0",
                                           "vstor:disk.vdb.readonly": "yes"}),
}


@pytest.fixture
def nova_conf(tmp_path):
    path = tmp_path / "vstor.conf"
    path.write_text(f"[paths]\nstate_dir = {tmp_path}/state\nvhost_dir = {tmp_path}/vhost\n"
                    f"images = {tmp_path}\n[cpu]\nreactors = 2,18\n")
    for name in ("db.raw", "logs.raw"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    return path


@pytest.mark.parametrize("shape", FLAVORS, ids=str)
def test_libvirt_accepts_every_nova_flavor_shape(conn, nova_conf, tmp_path, host_layout, shape):
    extra, specs = FLAVORS[shape]
    spec = {**NOVA, **{k: (sorted(v) if isinstance(v, set) else v) for k, v in extra.items() if k != "host"},
            "extra_specs": {k: v.format(images=tmp_path) for k, v in specs.items()}}
    req = {"spec": spec, "config": str(nova_conf)}
    if "host" in extra:
        req["host_root"] = host_layout(extra["host"])
    got = ask({"augment": req})["augmented"]
    assert "xml" in got, got
    sent = etree.fromstring(got["xml"])
    parsed = accepted(conn, got["xml"], tmp_path)
    try:
        # vstor's part of a Nova guest: its disks and the memory's sharing
        # (Nova's pinning and NUMA stay Nova's).
        assert_libvirt_holds_what_vstor_built(sent, parsed, ("devices/disk[@type='vhostuser']",
                                                             "memoryBacking"))
        vhost = sent.findall("devices/disk[@type='vhostuser']")
        assert [d.find("target").get("dev") for d in vhost] == got["disks"]
        assert all(d.find("readonly") is None for d in vhost)
        # readonly is the backend's: it travels in the plan the hook reads.
        plan = Domain.parse(got["xml"]).recorded_plan()
        assert {d.target: d.readonly for d in plan.disks} == {
            t: specs.get(f"vstor:disk.{t}.readonly") == "yes" for t in got["disks"]}
    finally:
        conn.lookupByName(NOVA["name"]).undefine()
