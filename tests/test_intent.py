"""The annotated-XML contract: what parses, and the message for what does not."""

import glob
import os

import pytest

from vstor.meta.document import Domain
from vstor.errors import BadInput
from vstor.meta.intent import NvmeSource, NvmfSource
from vstor.meta.metadata import find, schema

TEMPLATES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "xml-templates", "*.xml")))


def domain(vstor_body: str, extra: str = "") -> Domain:
    return Domain.parse(f"""<domain type='kvm'><name>t1</name><memory unit='MiB'>1024</memory>
      <vcpu>2</vcpu><metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>
      {vstor_body}</vstor:vstor></metadata>{extra}<devices/></domain>""")


def bad(vstor_body: str) -> str:
    with pytest.raises(BadInput) as e:
        domain(vstor_body).intent()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_templates_parse_and_validate_against_the_shipped_schema():
    assert len(TEMPLATES) >= 4
    from lxml import etree
    for path in TEMPLATES:
        dom = Domain.load(path)
        intent = dom.intent()
        assert intent.disks, path
        assert schema().validate(etree.ElementTree(etree.fromstring(etree.tostring(find(dom.root))))), path


def test_full_nvmf_source_is_read_with_paths_and_timeouts():
    intent = domain("""<vstor:vm migratable='yes' numa='preferred'/>
      <vstor:disk target='vdc' mode='vhost' backend='spdk' queues='8' readonly='yes'>
        <vstor:nvmf transport='tcp' traddr='10.1.1.1' trsvcid='4421' subnqn='nqn.2016-06.io.spdk:c1'
                    namespace='3' hostnqn='nqn.2014-08.org.nvmexpress:uuid:1' nic='mlx5_1'>
          <vstor:path traddr='10.1.2.1'/>
          <vstor:reconnect ctrlr_loss_timeout='120'/>
        </vstor:nvmf></vstor:disk>""").intent()
    disk = intent.disks[0]
    assert intent.vm.migratable and intent.vm.numa == "preferred"
    assert (disk.target, disk.mode, disk.backend, disk.queues, disk.readonly) == ("vdc", "vhost", "spdk", 8, True)
    src = disk.source
    assert isinstance(src, NvmfSource)
    assert (src.transport, src.trsvcid, src.namespace, src.nic) == ("tcp", 4421, 3, "mlx5_1")
    assert src.paths[0].traddr == "10.1.2.1" and src.paths[0].trsvcid == 4420
    assert src.reconnect.ctrlr_loss_timeout == 120 and src.reconnect.reconnect_delay is None


def test_short_pci_address_is_normalised():
    src = domain("<vstor:disk target='vdb'><vstor:nvme controller='5E:00.0'/></vstor:disk>").intent().disks[0].source
    assert src == NvmeSource("0000:5e:00.0", 1)


@pytest.mark.parametrize("body, words", [
    ("<vstor:disk target='vdb' mode='fast'><vstor:file path='/a'/></vstor:disk>",
     ["mode='fast'", "auto, passthrough, vhost"]),
    ("<vstor:vm numa='loose'/><vstor:disk target='vdb'><vstor:file path='/a'/></vstor:disk>",
     ["numa='loose'", "strict, preferred, none"]),
    ("<vstor:disk target='sda'><vstor:file path='/a'/></vstor:disk>", ["target='sda'", "vdb"]),
    ("<vstor:disk target='vdb'><vstor:file path='/var/../etc/shadow'/></vstor:disk>", ["not a clean absolute path"]),
    ("<vstor:disk target='vdb'><vstor:file path='relative.raw'/></vstor:disk>", ["not a clean absolute path"]),
    ("<vstor:disk target='vdb'><vstor:block path='/srv/x'/></vstor:disk>", ["not under /dev"]),
    ("<vstor:disk target='vdb'><vstor:nvme controller='zz:00.0'/></vstor:disk>", ["not a PCI address"]),
    ("<vstor:disk target='vdb' queues='0'><vstor:file path='/a'/></vstor:disk>", ["queues='0'", "1 to 64"]),
    ("<vstor:disk target='vdb'/>", ["exactly one source"]),
    ("<vstor:disk target='vdb'><vstor:file path='/a'/></vstor:disk><vstor:disk target='vdb'><vstor:file path='/b'/></vstor:disk>",
     ["two <vstor:disk>", "vdb"]),
    ("<vstor:vm/>", ["no <vstor:disk>"]),
    ("<vstor:disk target='vdb' colour='red'><vstor:file path='/a'/></vstor:disk>", ["unknown attribute 'colour'"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='rdma' traddr='1.2.3.4' subnqn='cnode1'/></vstor:disk>",
     ["subnqn='cnode1'", "qualified name"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='fc' traddr='1.2.3.4' subnqn='nqn.x:y'/></vstor:disk>",
     ["transport='fc'", "rdma, tcp"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='rdma' traddr='1.2.3.4' subnqn='nqn.x:\u00a0y'/></vstor:disk>",
     ["qualified name (ASCII, at most 223 bytes)"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='rdma' traddr='1.2.3.4' subnqn='nqn." + "é" * 200 + "'/></vstor:disk>",
     ["qualified name"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='rdma' traddr='1.2.3.4' subnqn='nqn." + "x" * 220 + "'/></vstor:disk>",
     ["qualified name"]),
    ("<vstor:disk target='vdb'><vstor:nvmf transport='rdma' subnqn='nqn.x:y'/></vstor:disk>", ["no traddr"]),
    ("<vstor:disk target='vdb'><vstor:file path='/a'/><vstor:extra/></vstor:disk>", ["unexpected element <extra>"]),
])
def test_bad_metadata_names_the_element_and_what_is_allowed(body, words):
    message = bad(body)
    for w in words:
        assert w in message


def test_malformed_xml_is_one_line_with_the_line_number():
    with pytest.raises(BadInput) as e:
        Domain.parse("<domain><name>x</name>\n<memory>", "vm.xml")
    assert str(e.value).startswith("vm.xml: malformed XML") and "line" in str(e.value)


@pytest.mark.parametrize("text, words", [
    ("<domain><name>x</name>", "vm.xml: malformed XML at line 1, column 23: Premature end of data "
                               "in tag domain"),
    ("<domain>\n<name>x</nam>\n</domain>", "vm.xml: malformed XML at line 2, column 14: Opening "
                                          "and ending tag mismatch: name and nam"),
    ("<domain>\n\n<name>x\n</nam>\n</domain>", "at line 4, column 7: Opening and ending tag "
                                               "mismatch: name line 3 and nam"),
])
def test_malformed_xml_names_each_line_once(text, words):
    with pytest.raises(BadInput) as e:
        Domain.parse(text, "vm.xml")
    assert words in str(e.value) and str(e.value).count(", column") == 1


def test_a_metadata_refusal_starts_with_the_file_or_domain_it_came_from():
    body = "<vstor:disk target='vdb' queues='99'><vstor:file path='/a'/></vstor:disk>"
    text = domain(body).to_string()
    with pytest.raises(BadInput) as e:
        Domain.parse(text, "db1.xml").intent()
    assert str(e.value).startswith("db1.xml: <vstor:disk queues='99'> is out of range")
    with pytest.raises(BadInput) as e:
        Domain.parse(text.replace("<vstor:disk", "<vstor:vm/><vstor:vm/><vstor:disk", 1),
                     "domain 'db1'").intent()
    assert str(e.value).startswith("domain 'db1': ")
    two = text.replace("</metadata>", "<vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'/>"
                                      "</metadata>")
    with pytest.raises(BadInput) as e:
        Domain.parse(two, "db1.xml").has_vstor()
    assert str(e.value).startswith("db1.xml: <metadata> holds 2 <vstor:vstor> elements")


def test_entities_are_not_expanded_and_a_doctype_is_refused():
    text = """<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>
      <domain><name>&x;</name><memory>1</memory></domain>"""
    with pytest.raises(BadInput, match="a DOCTYPE is not accepted") as e:
        Domain.parse(text)
    assert "root:" not in str(e.value)


def test_domain_without_metadata_says_how_to_add_it():
    dom = Domain.parse("<domain><name>plain</name><memory>1024</memory></domain>")
    assert not dom.has_vstor()
    with pytest.raises(BadInput, match="has no vstor metadata"):
        dom.intent()


def test_unsafe_domain_name_falls_back_to_uuid_and_never_reaches_a_path():
    dom = Domain.parse("<domain><name>../../etc/x</name><uuid>1B4E28BA-2FA1-11D2-883F-0016D3CCA427</uuid>"
                       "<memory>1</memory></domain>")
    assert dom.safe_name == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    dom = Domain.parse("<domain><name>a/b</name><memory>1</memory></domain>")
    with pytest.raises(BadInput, match="cannot be used in socket names"):
        dom.safe_name


def test_memory_units():
    for unit, value, kib in (("GiB", 2, 2097152), ("MiB", 512, 524288), ("KiB", 10, 10), ("G", 1, 1048576)):
        d = Domain.parse(f"<domain><name>m</name><memory unit='{unit}'>{value}</memory></domain>")
        assert d.memory_kib == kib
