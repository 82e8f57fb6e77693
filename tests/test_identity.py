"""vstor.meta.identity: the domain's name, UUID and vstor element as the
hook's release and reconnect read them (expat, no lxml).

The oracle for name and UUID is libvirt's own parser (the test:///default
driver): a domain defined there and dumped back, as libvirtd hands it to the
hook, must read as libvirt names it.  Everything else is held to the answer
of vstor.meta.document.Domain, which prepare uses, refusals included: the
two readers of one domain never disagree about whose record to release."""

from __future__ import annotations

import glob
import os

import libvirt
import pytest

from vstor import NS
from vstor.errors import BadInput
from vstor.meta.document import Domain
from vstor.meta.identity import read

ROOT = os.path.join(os.path.dirname(__file__), "..")
TEMPLATES = sorted(glob.glob(os.path.join(ROOT, "xml-templates", "*.xml")))
VSTOR = f"<vstor:vstor xmlns:vstor='{NS}'><vstor:disk target='vdb'><vstor:file path='/a'/></vstor:disk></vstor:vstor>"


def _libvirt_dump(xml: str) -> tuple[str, str, str]:
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML(xml)
        try:
            return dom.XMLDesc(0), dom.name(), dom.UUIDString()
        finally:
            dom.undefine()
    finally:
        conn.close()


def _minimal(name: str, metadata: str = VSTOR) -> str:
    return (f"<domain type='test'><name>{name}</name><memory>65536</memory><vcpu>1</vcpu>"
            f"<os><type>hvm</type></os><metadata>{metadata}</metadata></domain>")


@pytest.mark.parametrize("xml", [open(p).read() for p in TEMPLATES]
                         + [_minimal(n) for n in ("web&amp;db", "caf\u00e9 1", "a b", "x.y_z-1+2",
                                                   "&lt;vstor:vstor&gt;", "  spaced  ")],
                         ids=[os.path.basename(p) for p in TEMPLATES]
                         + ["amp", "unicode", "space", "safe", "escaped-tag", "spaced"])
def test_as_libvirt_names_it(xml):
    dumped, name, uuid = _libvirt_dump(xml.replace("type='kvm'", "type='test'"))
    who = read(dumped.encode())
    assert (who.name, who.uuid) == (name, uuid.lower())
    dom = Domain.parse(dumped)
    assert (who.name, who.uuid, who.vstor) == (dom.name, dom.uuid, dom.has_vstor())
    assert who.vstor        # every template and case here is annotated
    try:
        assert who.safe_name == dom.safe_name
    except BadInput as e:
        with pytest.raises(BadInput) as theirs:
            dom.safe_name
        assert e.message.split(": ", 1)[1] == theirs.value.message.split(": ", 1)[1]


U = "3f1c7c52-6d3e-4d5e-9d7a-0c1f2e3d4b5a"
SAME = [
    f"<domain><name>a</name><uuid>{U.upper()}</uuid><metadata>{VSTOR}</metadata></domain>",
    f"<domain><name>a b</name><uuid>{U}</uuid></domain>",
    "<domain><name>a b</name><uuid>not-a-uuid</uuid></domain>",
    "<domain><name>a</name><name>b</name></domain>",               # the first one
    "<domain><name><![CDATA[cd]]></name></domain>",
    "<domain><name>a<!-- c -->b</name></domain>",
    "<domain><name>a<?pi x?>b</name></domain>",
    "<domain><devices><name>x</name></devices><name>y</name></domain>",  # only the root's child
    f"<domain><name>a</name><metadata><app xmlns='urn:x'>{VSTOR}</app></metadata></domain>",
    f"<domain><name>a</name><metadata>{VSTOR}{VSTOR}</metadata></domain>",
    f"<domain><name>a</name><metadata><vstor xmlns='{NS}'/></metadata></domain>",
    "<domain><name>a</name><metadata><vstor xmlns='urn:other'/></metadata></domain>",
    f"<domain xmlns:v='{NS}'><name>a</name><v:metadata><v:vstor/></v:metadata></domain>",
    "<domain><name> </name></domain>",
    "<domain/>",
    "<domaine><name>a</name></domaine>",
    f"<domain xmlns='{NS}'><name>a</name></domain>",
    "<domain><name>a</name>",
    "<domain><name>a</nom></domain>",
    "",
    "<domain><name>a&unknown;</name></domain>",
    "<?xml version='1.0' encoding='UTF-8'?><domain><name>\u00e9</name></domain>",
    "<domain><name>a<b>c</b>d</name></domain>",                   # the element's string value
    "<domain><uuid><x>3f1c7c52-6d3e-4d5e-9d7a-0c1f2e3d4b5a</x></uuid><name>a</name></domain>",
    "<!DOCTYPE domain [<!ENTITY n 'web'>]><domain><name>&n;</name></domain>",   # both refuse
    "<!DOCTYPE domain><domain><name>a</name></domain>",
    "<domain><name>a</name>" + "<x>" * 300 + "</x>" * 300 + "</domain>",        # both refuse
    "<domain><name>a</name>" + "<x>" * 200 + "</x>" * 200 + "</domain>",        # both read
]


def _answer(reader):
    try:
        who = reader()
        return ("ok", who.name, who.uuid, who.safe_name if _safe(who) else None,
                who.vstor if hasattr(who, "vstor") else who.has_vstor())
    except BadInput:
        return ("refused",)


def _safe(who) -> bool:
    try:
        who.safe_name
        return True
    except BadInput:
        return False


@pytest.mark.parametrize("xml", SAME)
def test_reads_what_the_lxml_reader_reads_or_refuses_what_it_refuses(xml):
    assert _answer(lambda: read(xml.encode())) == _answer(lambda: Domain.parse(xml))


@pytest.mark.parametrize("doctype", [
    "<!DOCTYPE domain>",
    "<!DOCTYPE domain [<!ENTITY n 'x'>]>",
    "<!DOCTYPE domain SYSTEM 'file:///etc/shadow'>",
    "<!DOCTYPE d [<!ENTITY a 'aaaaaaaaaa'><!ENTITY b '&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;'>"
    "<!ENTITY c '&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;'>]>",
])
def test_a_dtd_is_refused_before_anything_is_expanded_or_fetched(doctype):
    with pytest.raises(BadInput, match="DOCTYPE is not accepted"):
        read(f"{doctype}<domain><name>&c;</name></domain>".encode())


def test_an_encoding_expat_cannot_read_is_a_refusal_not_a_traceback():
    with pytest.raises(BadInput, match="cannot read the XML: multi-byte encodings"):
        read("<?xml version='1.0' encoding='Shift_JIS'?><domain><name>a</name></domain>".encode())


def test_a_root_in_a_namespace_is_named_as_the_lxml_reader_names_it():
    xml = f"<vstor xmlns='{NS}'><name>a</name></vstor>"
    with pytest.raises(BadInput) as ours:
        read(xml.encode())
    with pytest.raises(BadInput) as theirs:
        Domain.parse(xml)
    assert ours.value.message == theirs.value.message == f"domain XML: the root element is <{{{NS}}}vstor>, not <domain>"


def test_malformed_xml_says_where():
    with pytest.raises(BadInput) as e:
        read(b"<domain>\n<name>a</nom></domain>", "domain 'a'")
    assert e.value.message.startswith("domain 'a': malformed XML at line 2, column ")
