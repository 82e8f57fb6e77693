"""SPDK and NVMe-oF disks for Nova instances (issue 31, item 1), the pure
parts: what a flavor's hw:mem_page_size means to vstor (as Nova's own
nova.virt.hardware reads it), the plan of an SPDK disk in Nova's hugepages,
the one-line refusals, and what a flavor asks of Placement.  Nova's own
classes judge the driver's side in tests/test_nova_driver.py."""

from __future__ import annotations

import re

import pytest
from lxml import etree

from vstor.config import Config
from vstor.errors import BadInput
from vstor.meta.document import Domain
from vstor.nova import disks, placement
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.records import replace

NVMF = {"vstor:disk.vdb.nvmf.transport": "rdma", "vstor:disk.vdb.nvmf.traddr": "192.168.100.8",
        "vstor:disk.vdb.nvmf.subnqn": "nqn.2016-06.io.spdk:cnode1", "vstor:disk.vdb.readonly": "yes"}
LOCAL = {"vstor:disk.vdb.nvme.controller": "0000:60:00.0", "vstor:disk.vdb.backend": "spdk",
         "vstor:disk.vdb.readonly": "yes"}


# nova.virt.hardware._get_numa_pagesize_constraint: 'large', 'small', 'any',
# a bare number (KiB), or a size oslo's string_to_bytes reads (IEC units).
@pytest.mark.parametrize("value, large", [
    ("large", True), ("2MB", True), ("1GB", True), ("2MiB", True), ("2048", True),
    ("1048576", True), ("small", False), ("any", False), ("4KB", False), ("4", False),
    ("", False), ("huge", False), ("2 MB", False), ("1024KB", False), ("9" * 40, False),
])
def test_what_counts_as_large_pages(value, large):
    assert disks.large_pages({"hw:mem_page_size": value}) is large
    vm = disks.element({**NVMF, "hw:mem_page_size": value}).find("{*}vm")
    assert vm.get("hugepages") == ("external" if large else "none")


def _request(specs, page_kib=None, name="instance-1") -> Request:
    return Request(name=name, safe_name=name, uuid=None, vcpus=2, memory_kib=2 << 20, machine="q35",
                   intent=disks.intent_of(specs), external_cpus=True, platform_page_kib=page_kib,
                   title=f"instance '{name}'",
                   vhost_memory="platform-hugepages" if page_kib else "memfd")


@pytest.mark.parametrize("specs", [NVMF, LOCAL], ids=["nvmf-rdma", "local-nvme"])
def test_an_spdk_disk_plans_in_novas_hugepages(host_model, specs):
    plan = plan_domain(host_model("two-socket"), Config(reactors=(2, 18)),
                       _request({**specs, "hw:mem_page_size": "large"}, 2048), Ledger())
    d = plan.disks[0]
    assert (d.mode, d.backend) == ("vhost", "spdk") and d.reactor in (2, 18)
    assert plan.hugepage_kib is None and plan.hugepages == 0 and plan.cpus == "external"
    assert any("Nova's hugepages" in r and "vstor places none" in r for r in plan.reasons)


@pytest.mark.parametrize("specs, page_kib, message", [
    ({}, 2048, "instance 'instance-1': an SPDK disk needs the guest's memory in hugepages, and its flavor "
               "asks for none"),
    ({"hw:mem_page_size": "small"}, None, "an SPDK disk needs the guest's memory in hugepages"),
    ({"hw:mem_page_size": "large"}, None, "the flavor asks for large pages (hw:mem_page_size) but "
                                          "the guest's memory is not hugepage-backed"),
    ({"hw:mem_page_size": "large"}, 4, "its guest memory is in 4 KiB pages; SPDK maps guest memory "
                                       "in 2 MiB units"),
])
def test_an_spdk_disk_without_large_pages_is_refused(host_model, specs, page_kib, message):
    with pytest.raises(BadInput, match=re.escape(message)) as e:
        plan_domain(host_model("two-socket"), Config(reactors=(2, 18)),
                    _request({**NVMF, **specs}, page_kib), Ledger())
    assert e.value.hint.startswith("set hw:mem_page_size=large")


def test_large_pages_with_qsd_disks_alone_start_on_memfd_when_nova_gives_none(host_model):
    """(review) an image's hw_mem_page_size=small narrows the flavor's
    'large': a qemu-storage-daemon disk needs no hugepages, so the instance
    starts as it did before SPDK disks came to Nova."""
    specs = {"vstor:disk.vdb.file.path": "/var/lib/vstor/images/db.raw", "vstor:disk.vdb.readonly": "yes",
             "hw:mem_page_size": "large"}
    req = replace(_request(specs, None), vhost_memory="memfd")
    plan = plan_domain(host_model("two-socket"), Config(), req, Ledger())
    assert plan.disks[0].backend == "qsd" and plan.hugepage_kib is None
    assert any("memfd" in r for r in plan.reasons), plan.reasons


def test_hugepages_external_is_for_nova_alone(host_model):
    req = _request({**NVMF, "hw:mem_page_size": "large"}, 2048)
    intent = replace(req.intent, vm=replace(req.intent.vm, cpus="dedicated", numa="strict"))
    with pytest.raises(BadInput, match="hugepages='external' is for Nova instances"):
        plan_domain(host_model("two-socket"), Config(reactors=(2, 18)),
                    replace(req, external_cpus=False, intent=intent), Ledger())


NOVA_XML = """<domain type='kvm'><name>instance-1</name><memory>2097152</memory><vcpu>2</vcpu>
<metadata><nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'/>{vstor}</metadata>
{backing}<os><type machine='q35'>hvm</type></os></domain>"""


@pytest.mark.parametrize("backing, page", [
    ("", None),
    ("<memoryBacking><hugepages><page size='2048' unit='KiB' nodeset='0'/></hugepages></memoryBacking>", 2048),
    ("<memoryBacking><hugepages><page size='1' unit='G'/></hugepages></memoryBacking>", 1048576),
    ("<memoryBacking><hugepages/></memoryBacking>", 2048),
    # Two guest cells, only cell 0's memory in hugepages: not hugepage-backed.
    ("<memoryBacking><hugepages><page size='2048' unit='KiB' nodeset='0'/></hugepages></memoryBacking>"
     "<cpu><numa><cell id='0' cpus='0' memory='1048576'/><cell id='1' cpus='1' memory='1048576'/>"
     "</numa></cpu>", None),
    ("<memoryBacking><hugepages><page size='2048' unit='KiB' nodeset='0-1'/></hugepages></memoryBacking>"
     "<cpu><numa><cell id='0' cpus='0' memory='1048576'/><cell id='1' cpus='1' memory='1048576'/>"
     "</numa></cpu>", 2048),
])
def test_the_hook_reads_novas_pages_from_the_domain(backing, page):
    """The hook's request of a Nova domain: its hugepages as its XML says
    (what the planner's refusal above is judged on at a start)."""
    vstor = etree.tostring(disks.element({**NVMF, "hw:mem_page_size": "large"})).decode()
    dom = Domain(etree.fromstring(NOVA_XML.format(backing=backing, vstor=vstor)), "test")
    req = Request.from_domain(dom)
    assert req.platform_page_kib == page and req.external_cpus
    assert req.vhost_memory == ("platform-hugepages" if page else "memfd")


def test_a_flavor_with_an_spdk_disk_asks_for_large_pages_and_its_transport():
    asks = placement.disk_flavor_specs(NVMF, "db.fast")
    assert asks == {"hw:mem_page_size": "large", "resources:CUSTOM_VSTOR_VHOST_SPDK": "1",
                    "trait:CUSTOM_VSTOR_SPDK": "required", "trait:CUSTOM_VSTOR_NVMF_RDMA": "required"}
    assert placement.disk_flavor_specs({**NVMF, "hw:mem_page_size": "1GB"}, "f") == {
        k: v for k, v in asks.items() if k != "hw:mem_page_size"}
    assert placement.disk_flavor_specs(NVMF, "f", page="2MB")["hw:mem_page_size"] == "2MB"
    line = placement.disk_flavor_command(NVMF, "db.fast")[1]
    assert "--property hw:mem_page_size=large" in line


@pytest.mark.parametrize("extra, message", [
    ({"hw:mem_page_size": "small"}, "disk vdb is an SPDK disk; an SPDK disk needs the guest's "
                                    "memory in hugepages"),
    ({"hw:mem_page_size": "any"}, "an SPDK disk needs the guest's memory in hugepages"),
    ({"vstor:numa": "tight"}, "vstor:numa='tight' is not preferred or strict"),
])
def test_a_flavor_whose_spdk_disk_could_not_start_is_refused(extra, message):
    with pytest.raises(BadInput, match=message):
        placement.disk_flavor_specs({**NVMF, **extra}, "db.fast")


def test_the_provider_file_offers_spdk_where_reactors_are(host_model):
    v = placement.view(host_model("two-socket"), Config(reactors=(2, 18)), 0, qsd_installed=True)
    assert {i.resource_class for i in v.inventories} == {"CUSTOM_VSTOR_VHOST_QSD",
                                                         "CUSTOM_VSTOR_VHOST_SPDK"}
    assert {"CUSTOM_VSTOR_SPDK", "CUSTOM_VSTOR_NVMF_RDMA", "CUSTOM_VSTOR_NVMF_TCP"} <= {
        t for t, _ in v.traits}
    none = placement.view(host_model("two-socket"), Config(), 0, qsd_installed=True)
    assert ("CUSTOM_VSTOR_VHOST_SPDK", "no SPDK reactor cores ([cpu] reactors)") in none.not_offered
