"""The RelaxNG schema of vstor's metadata, derived from its declaration
(vstor.meta.xmlmodel) and shipped as vstor/schema/vstor.rng for operators'
xmllint.  Regenerate it with: python3 -m vstor.meta.schema [FILE]"""

from __future__ import annotations

import sys

from lxml import etree

from vstor import NS, PREFIX
from vstor.meta.metadata import SCHEMA_FILE, Metadata
from vstor.meta.types import RNG, XSD, FreeText, rng
from vstor.meta.xmlmodel import Attr, Choice, Texts, attr_name, element_fields


def schema_text() -> str:
    head = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<!-- vstor's element in a libvirt domain's <metadata>, namespace "
            f"{NS}, prefix \"{PREFIX}\".\n"
            "     Generated from vstor/meta (python3 -m vstor.meta.schema): do not edit. -->\n")
    return head + etree.tostring(grammar(Metadata), pretty_print=True, encoding="unicode")


def grammar(root_cls) -> etree._Element:
    """The RelaxNG grammar of `root_cls` and everything under it."""
    g = etree.Element(f"{{{RNG}}}grammar", nsmap={None: RNG}, ns=NS, datatypeLibrary=XSD)
    defined: dict[type, str] = {}
    start = rng(g, "start")
    rng(start, "ref", name=_define(g, root_cls, defined))
    return g


def _define(g, cls, defined) -> str:
    if cls in defined:
        return defined[cls]
    name = cls.__name__
    defined[cls] = name
    d = rng(g, "define", name=name)
    el = rng(d, "element", name=cls.xml_tag)
    for f, spec in element_fields(cls):
        if isinstance(spec, Attr):
            holder = el if spec.required else rng(el, "optional")
            spec.type.rng(rng(holder, "attribute", name=attr_name(f, spec)))
    content = [(f, s) for f, s in element_fields(cls) if not isinstance(s, Attr)]
    if not content:
        if not len(el):
            rng(el, "empty")
        return name
    box = rng(el, "interleave") if len(content) > 1 and not cls.xml_ordered else el
    for f, spec in content:
        if isinstance(spec, Texts):
            FreeText().rng(rng(rng(box, "zeroOrMore"), "element", name=spec.tag))
        elif isinstance(spec, Choice):
            c = rng(box, "choice")
            for sub in spec.classes:
                rng(c, "ref", name=_define(g, sub, defined))
        else:
            wrap = ("oneOrMore" if spec.min else "zeroOrMore") if spec.many else "optional"
            rng(rng(box, wrap), "ref", name=_define(g, spec.cls, defined))
    return name


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    path = argv[0] if argv else SCHEMA_FILE
    with open(path, "w") as f:
        f.write(schema_text())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
