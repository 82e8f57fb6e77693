"""Rendering: golden files per template, libvirt's schema, idempotence.

Regenerate the golden files after an intended change with:
    VSTOR_REGENERATE_GOLDEN=1 python3 -m pytest tests/test_render.py
"""

import glob
import os
import shutil
import subprocess

import pytest

from tests.helpers import unavailable
from vstor.config import Config
from vstor.meta.document import Domain
from vstor.planner.ledger import Ledger
from vstor.planner import Request, plan_domain
from vstor.render.libvirt import render

HERE = os.path.dirname(__file__)
TEMPLATES = sorted(glob.glob(os.path.join(HERE, "..", "xml-templates", "*.xml")))
GOLDEN = os.path.join(HERE, "golden")
CFG = Config(reactors=(2, 18))


def rendered(host, path) -> Domain:
    dom = Domain.load(path)
    return render(dom, plan_domain(host, CFG, Request.from_domain(dom), Ledger()))


def validate_with_libvirt(path: str) -> None:
    if not shutil.which("virt-xml-validate") or not shutil.which("xmllint"):
        unavailable("virt-xml-validate or xmllint is not installed (scripts/install-deps.sh installs them)")
    out = subprocess.run(["virt-xml-validate", path, "domain"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.process
@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_template_renders_to_its_golden_file_and_libvirt_schema_accepts_it(host_model, template, tmp_path):
    text = rendered(host_model("two-socket"), template).to_string()
    golden = os.path.join(GOLDEN, os.path.basename(template).replace(".xml", "-out.xml"))
    if os.environ.get("VSTOR_REGENERATE_GOLDEN"):
        with open(golden, "w") as f:
            f.write(text)
    with open(golden) as f:
        assert text == f.read(), "rendering changed; regenerate with VSTOR_REGENERATE_GOLDEN=1 if intended"
    out = tmp_path / "out.xml"
    out.write_text(text)
    validate_with_libvirt(str(out))


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_rendering_a_rendered_domain_changes_nothing(host_model, template):
    host = host_model("two-socket")
    once = rendered(host, template)
    plan = plan_domain(host, CFG, Request.from_domain(once), Ledger())
    twice = render(once, plan, once.recorded_plan())
    assert twice.to_string() == once.to_string()


def test_the_plan_record_reads_back_as_the_same_plan(host_model):
    host = host_model("two-socket")
    dom = Domain.load(os.path.join(HERE, "..", "xml-templates", "vhost-nvmf-rdma-multipath.xml"))
    plan = plan_domain(host, CFG, Request.from_domain(dom), Ledger())
    assert render(dom, plan).recorded_plan() == plan


def test_passthrough_renders_an_unmanaged_hostdev_and_a_caching_mode_viommu(host_model):
    dom = rendered(host_model("two-socket"), os.path.join(HERE, "..", "xml-templates", "passthrough-guest-spdk.xml"))
    hd = dom.root.find("devices/hostdev")
    assert hd.get("managed") == "no"   # vstor binds vfio-pci itself, after its checks
    a = hd.find("source/address")
    assert (a.get("bus"), a.get("slot"), a.get("function")) == ("0x5e", "0x00", "0x0")
    assert dom.root.find("devices/iommu/driver").get("caching_mode") == "on"
    assert dom.root.find("features/ioapic").get("driver") == "qemu"
    assert dom.root.find("memoryBacking/hugepages/page").get("size") == "1048576"
    assert dom.root.find("memoryBacking/access") is None     # no vhost-user: no shared memory needed


def test_vhost_renders_shared_memory_socket_and_reconnect(host_model):
    dom = rendered(host_model("two-socket"), os.path.join(HERE, "..", "xml-templates", "qsd-file.xml"))
    disk = [d for d in dom.root.findall("devices/disk") if d.get("type") == "vhostuser"][0]
    assert disk.find("source").get("path") == "/run/vstor/vhost/demo1-vdb"
    assert disk.find("source/reconnect").get("enabled") == "yes"
    assert dom.root.find("memoryBacking/source").get("type") == "memfd"
    assert dom.root.find("memoryBacking/access").get("mode") == "shared"
    assert dom.root.find("cpu/numa/cell").get("memAccess") == "shared"
    assert dom.root.find("numatune/memory").get("mode") == "strict"


def test_operator_prefix_is_normalised_to_vstor(host_model):
    text = open(os.path.join(HERE, "..", "xml-templates", "qsd-file.xml")).read()
    text = text.replace("vstor:", "v:").replace("xmlns:vstor", "xmlns:v")
    dom = Domain.parse(text)
    out = render(dom, plan_domain(host_model("two-socket"), CFG, Request.from_domain(dom), Ledger()))
    s = out.to_string()
    assert "<vstor:vstor xmlns:vstor=" in s and "<v:" not in s
