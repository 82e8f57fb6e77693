"""One declaration, two readers: vstor's parser (vstor.meta.xmlmodel) and
libxml2's RelaxNG validator reading the shipped vstor/schema/vstor.rng must
accept and reject the same documents.  The documents are generated: valid
ones (the templates, a rendered plan) and every single-step mutation of
them (each attribute set to values of every kind, attributes and elements
removed, duplicated, added, text inserted), a sample of a few thousand in all."""

import copy
import glob
import os
import random

import pytest
from lxml import etree

from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.document import Domain
from vstor.meta.metadata import Metadata, find
from vstor.meta.schema import schema_text
from vstor.meta.xmlmodel import Q, parse

HERE = os.path.dirname(__file__)
NS = "https://vstor.dev/xmlns/domain/1"

VALUES = [
    "", " ", "x", "yes", "no", "YES", " yes", "auto", "strict", "preferred", "none", "dedicated",
    "shared", "2M", "1G", "normal", "critical", "passthrough", "vhost", "spdk", "qsd", "vfio",
    "kernel", "rdma", "tcp", "RDMA", "TCP", "PCIe", "ipv4", "IPv4", "ipv6", "IPv6", "multipath", "2", "1",
    "0", "-1", "+1", " 1", "1 ", "01", "007", "1.0", "1e3", "64", "65", "65535", "65536", "4294967295",
    "4294967296", "\u0663", "vdb", "vda", "vdzzz", "vdzzzz", "sda", "vdB",
    "/a", "/var/lib/libvirt/images/x.raw", "/a/../b", "/a/./b", "/a//b", "/a/", "/", "/.hidden",
    "/..x", "/.", "/a/..", "a/b", "/a b", "/a,b", "/dev/nvme0n1", "/dev/../etc/shadow", "/dev/",
    "/dev/mapper/vg-lv", "0000:5e:00.0", "5E:00.0", "5e:00.0", "zz:00.0", "0000:5e:00.8",
    "nqn.2016-06.io.spdk:cnode1", "nqn.", "nqn.a b", "cnode1", "nqn.x:" + "y" * 220, "mlx5_0",
    "10.0.0.1", "fe80::1", "host_name-1.example", "a" * 256, "0-3,8", "3", "3-", "1,2", "1,,2",
    "sha256:" + "a" * 64, "sha256:" + "A" * 64, "sha256:abc", "vs_0000_5e_00_0", "vs nvme",
    "vm1-vdb", "0-3", "4,5,6",
]


def _templates():
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "..", "xml-templates", "*.xml"))):
        out.append(copy.deepcopy(find(Domain.load(path).root)))
    for path in sorted(glob.glob(os.path.join(HERE, "golden", "*-out.xml"))):
        out.append(copy.deepcopy(find(Domain.load(path).root)))     # with a rendered plan
    return out


def _verdicts(elem):
    doc = etree.fromstring(etree.tostring(elem))
    by_schema = metadata.schema().validate(etree.ElementTree(doc))
    try:
        parse(Metadata, doc)
        by_parser, why = True, ""
    except BadInput as e:
        by_parser, why = False, str(e)
    return by_schema, by_parser, why


def _mutations(base, rng):
    """Every single-step change of `base`, plus random two-step ones."""
    elements = [e for e in base.iter() if isinstance(e.tag, str)]
    for i, e in enumerate(elements):
        def variant(change):
            doc = copy.deepcopy(base)
            target = [x for x in doc.iter() if isinstance(x.tag, str)][i]
            change(target, doc)
            return doc
        for name in list(e.attrib):
            yield variant(lambda t, d, n=name: t.attrib.pop(n))
            for v in VALUES:
                yield variant(lambda t, d, n=name, v=v: t.set(n, v))
        for name in ("target", "path", "controller", "namespace", "queues", "colour", "reactor",
                     "socket", "version", "digest", "pins", "kib"):
            if name not in e.attrib:
                yield variant(lambda t, d, n=name: t.set(n, "vdb"))
                yield variant(lambda t, d, n=name: t.set(n, "1"))
        yield variant(lambda t, d: t.set("{urn:other}x", "1"))
        yield variant(lambda t, d: t.set(Q + "target", "vdb"))
        yield variant(lambda t, d: setattr(t, "text", "hello"))
        yield variant(lambda t, d: setattr(t, "text", "\n  "))
        yield variant(lambda t, d: t.append(etree.Comment("note")))
        yield variant(lambda t, d: t.append(etree.Element("{urn:other}extra")))
        yield variant(lambda t, d: t.append(etree.Element(Q + "extra")))
        for tag in ("vm", "disk", "nvme", "file", "block", "nvmf", "path", "reconnect", "plan",
                    "reason", "attach"):
            yield variant(lambda t, d, tag=tag: t.append(etree.Element(Q + tag)))
        if e.getparent() is not None:
            yield variant(lambda t, d: t.getparent().remove(t))
            yield variant(lambda t, d: t.getparent().append(copy.deepcopy(t)))
            yield variant(lambda t, d: t.getparent().insert(0, t))     # moved first
            yield variant(lambda t, d: setattr(t, "tail", "x"))
    for _ in range(200):        # two changes at once
        doc = copy.deepcopy(base)
        for _ in range(2):
            t = rng.choice([x for x in doc.iter() if isinstance(x.tag, str)])
            if t.attrib and rng.random() < 0.8:
                t.set(rng.choice(list(t.attrib)), rng.choice(VALUES))
            elif t.getparent() is not None:
                t.getparent().remove(t)
        yield doc


def _duplicate_targets(elem) -> bool:
    for parent in (elem, *elem.findall(Q + "plan")):
        targets = [d.get("target") for d in parent.findall(Q + "disk")]
        if len(targets) != len(set(targets)):
            return True
    return False


def test_the_shipped_schema_is_generated_from_the_declaration():
    with open(metadata.SCHEMA_FILE) as f:
        assert f.read() == schema_text(), \
            "vstor/schema/vstor.rng is stale: python3 -m vstor.meta.schema"


@pytest.mark.slow
def test_schema_and_parser_accept_and_reject_the_same_documents():
    rng = random.Random(7)
    bases = _templates()
    assert len(bases) >= 8
    checked = accepted = 0
    disagreements = []
    for base in bases:
        assert _verdicts(base)[:2] == (True, True)
        docs = list(_mutations(base, rng))
        if base.find(Q + "plan") is not None:
            # libxml2 takes ~25 ms to reject a mutated plan record (it is quick
            # on the rest): a fixed sample of those keeps this test to seconds.
            docs = rng.sample(docs, min(len(docs), 200))
        for doc in docs:
            by_schema, by_parser, why = _verdicts(doc)
            checked += 1
            accepted += by_parser
            if by_schema != by_parser:
                # The one rule RelaxNG cannot say: targets are unique.
                if by_schema and not by_parser and _duplicate_targets(doc) and "two <vstor:" in why:
                    continue
                disagreements.append((by_schema, by_parser, why, etree.tostring(doc)[:600]))
    assert checked > 4000 and 0.05 < accepted / checked < 0.95
    assert disagreements == [], f"{len(disagreements)} disagreements, first: {disagreements[0]}"


@pytest.mark.parametrize("value", ["/var/../etc/shadow", "/a/./b", "/a//b", "/a/", "relative"])
def test_unclean_paths_are_refused_by_both(value):
    elem = etree.fromstring(f"<vstor:vstor xmlns:vstor='{NS}'><vstor:disk target='vdb'>"
                            f"<vstor:file path='{value}'/></vstor:disk></vstor:vstor>")
    assert _verdicts(elem)[:2] == (False, False)
