"""Declaring an element of the vstor namespace once, and deriving the rest.

An element is a frozen record (vstor.records) marked with @element("tag"); each of its
fields says how it appears in XML: `attr(...)` (an attribute with a value
type), `child(...)` (an optional single element), `children(...)` (a list of
elements), `choice(...)` (exactly one of several elements), `texts(...)` (a
list of text elements).  From that one declaration come:

- parsing (`parse`), with messages that name the element, the attribute and
  what is allowed;
- serialising (`build`), in declaration order;
- the RelaxNG schema (vstor.meta.schema), shipped as vstor/schema/vstor.rng.

This is the only module that reads or writes elements of the vstor
namespace (in the spirit of virtinst's XMLBuilder/XMLProperty).  The
schema and the parser are checked against each other by the tests; the one
rule the schema cannot say (`unique=`) is the parser's alone.
"""

from __future__ import annotations

import functools

from lxml import etree

from vstor import NS, PREFIX
from vstor.errors import BadInput
from vstor.meta.types import Invalid
from vstor.records import field, fields, record

Q = "{%s}" % NS
_WS = " \t\r\n"


# -- field declarations ----------------------------------------------------------------

@record
class Attr:
    type: object
    required: bool
    name: str | None


@record
class _Child:
    cls: type
    many: bool                       # children(): a tuple
    min: int = 0
    missing: tuple[str, str] | None = None    # (message, hint) when under min
    unique: str | None = None        # field that must differ between the children


@record
class Choice:
    classes: tuple[type, ...]
    label: str


@record
class Texts:
    tag: str


def attr(type, *, required=False, default=None, name=None):
    return field(default=default, metadata={"xml": Attr(type, required, name)})


def child(cls, *, default=None):
    return field(default=default, metadata={"xml": _Child(cls, many=False)})


def children(cls, *, min=0, missing=None, unique=None):
    return field(default=(), metadata={
        "xml": _Child(cls, many=True, min=min, missing=missing, unique=unique)})


def choice(*classes, label: str):
    return field(default=None, metadata={"xml": Choice(classes, label)})


def texts(tag: str):
    return field(default=(), metadata={"xml": Texts(tag)})


def element(tag: str, *, where: str | None = None, ordered: bool = False):
    """Class decorator: the element's tag, the attribute (if any) that names
    an instance in messages about its content ('disk target=vdb'), and whether
    its children come in declaration order (records vstor writes) or in any
    order (what operators write)."""
    def mark(cls):
        cls.xml_tag, cls.xml_where, cls.xml_ordered = tag, where, ordered
        return cls
    return mark


@functools.cache
def element_fields(cls) -> tuple:
    """(field, its XML spec) of a declared class, in declaration order;
    derived once per class (every parse asks it of every element)."""
    return tuple((f, f.metadata["xml"]) for f in fields(cls) if "xml" in f.metadata)


def attr_name(f, spec) -> str:
    return spec.name or f.name


@functools.cache
def _attrs(cls) -> dict:
    """Each attribute's name -> (field, spec)."""
    return {attr_name(f, s): (f, s) for f, s in element_fields(cls) if isinstance(s, Attr)}


@functools.cache
def _child_tags(cls) -> tuple[str, ...]:
    tags = []
    for _f, spec in element_fields(cls):
        if isinstance(spec, _Child):
            tags.append(spec.cls.xml_tag)
        elif isinstance(spec, Choice):
            tags += [c.xml_tag for c in spec.classes]
        elif isinstance(spec, Texts):
            tags.append(spec.tag)
    return tuple(tags)


# -- parsing --------------------------------------------------------------------------------

class _Reader:
    """What parse needs of a declared class, derived once per class (every
    parse of every element asks it)."""

    def __init__(self, cls):
        self.attrs: dict[str, tuple[str, object]] = {}   # XML name -> (field, value type)
        self.required = frozenset(attr_name(f, s) for f, s in element_fields(cls)
                                  if isinstance(s, Attr) and s.required)
        self.tags: dict[str, tuple[str, int]] = {}       # Clark tag -> (local name, rank of its field)
        self.kids: list[tuple[str, object]] = []         # (field, spec) read from child elements
        for rank, (f, spec) in enumerate(element_fields(cls)):
            if isinstance(spec, Attr):
                self.attrs[attr_name(f, spec)] = (f.name, spec.type)
                continue
            if isinstance(spec, _Child):
                local = (spec.cls.xml_tag,)
            elif isinstance(spec, Choice):
                local = tuple(c.xml_tag for c in spec.classes)
            else:
                local = (spec.tag,)
            self.tags.update((_CLARK + t, (t, rank)) for t in local)
            self.kids.append((f.name, spec))


_reader = functools.cache(_Reader)


def parse(cls, e: etree._Element, where: str = "", **known):
    """An element -> an instance of its declared class, or BadInput.
    `known`: the fields the element does not hold (a plan's domain, which
    the document around it says).  Of several problems, the one said is
    the first of: an unknown attribute, a child element (text, an entity,
    an undeclared element, the order), an attribute (in declaration
    order), then each child's own."""
    reader = _reader(cls)
    tag = cls.xml_tag
    pre = f"{where}: " if where else ""
    values = known
    wrong = False
    for name, text in e.items():
        found = reader.attrs.get(name)
        if found is None:
            raise BadInput(f"{pre}<vstor:{tag}> has unknown attribute '{_shown(_local(name))}'",
                           hint="allowed: " + (", ".join(sorted(reader.attrs)) or "none"))
        try:
            values[found[0]] = found[1].parse(text, name)
        except Invalid:
            wrong = True        # said after the child elements' problems, as below
    kids = _element_children(cls, e, reader.tags, pre)
    if wrong or not reader.required.issubset(e.keys()):
        _refuse_attributes(cls, e, pre)
    if cls.xml_where and e.get(cls.xml_where) is not None:
        where = f"<vstor:{tag} {cls.xml_where}='{e.get(cls.xml_where)}'>"
    for fname, spec in reader.kids:
        if isinstance(spec, _Child):
            values[fname] = _parse_children(cls, spec, kids.get(spec.cls.xml_tag, ()), where)
        elif isinstance(spec, Choice):
            found = [(c, k) for c in spec.classes for k in kids.get(c.xml_tag, ())]
            if len(found) != 1:
                raise BadInput(f"{where or tag} needs exactly one {spec.label} element",
                               hint="one of " + ", ".join(f"<vstor:{c.xml_tag}>" for c in spec.classes))
            values[fname] = parse(*found[0], where)
        else:
            values[fname] = tuple(_text_of(k, spec.tag, pre) for k in kids.get(spec.tag, ()))
    return cls(**values)


def _refuse_attributes(cls, e, pre) -> None:
    """The first attribute, in declaration order, that is missing or wrong."""
    for name, (f, spec) in _attrs(cls).items():
        text = e.get(name)
        if text is None:
            if spec.required:
                raise BadInput(f"{pre}<vstor:{cls.xml_tag}> has no {name} attribute", hint=f"add {name}='...'")
            continue
        try:
            spec.type.parse(text, name)
        except Invalid as bad:
            raise BadInput(f"{pre}<vstor:{cls.xml_tag} {name}='{_shown(text)}'> {bad.problem}",
                           hint=bad.hint) from None


def _parse_children(cls, spec: _Child, found, where):
    tag = spec.cls.xml_tag
    if not spec.many:
        if len(found) > 1:
            raise BadInput(f"vstor metadata has more than one <vstor:{tag}> element in "
                           f"<vstor:{cls.xml_tag}>", hint="keep one")
        return parse(spec.cls, found[0], where) if found else None
    if len(found) < spec.min:
        message, hint = spec.missing or (f"<vstor:{cls.xml_tag}> needs a <vstor:{tag}>", "add one")
        raise BadInput(message, hint=hint)
    items = tuple(parse(spec.cls, k, where) for k in found)
    if spec.unique:
        seen = set()
        for item in items:
            key = getattr(item, spec.unique)
            if key in seen:
                raise BadInput(f"two <vstor:{tag}> elements use {spec.unique} '{key}'",
                               hint=f"give each {tag} its own {spec.unique}")
            seen.add(key)
    return items


def _element_children(cls, e, tags: dict, pre) -> dict[str, list]:
    """The child elements by local name, each list in document order; text,
    entities, elements the class does not declare and (in a record vstor
    writes) elements out of declaration order are refused, comments and
    processing instructions skipped."""
    tag = cls.xml_tag
    _no_text(e.text, tag, pre)
    kids: dict[str, list] = {}
    last, disorder = None, None
    for k in e:
        _no_text(k.tail, tag, pre)
        found = tags.get(k.tag)
        if found is None:
            if isinstance(k, etree._Entity):
                raise BadInput(f"{pre}<vstor:{tag}> holds an entity reference &{_shown(k.name)};",
                               hint="vstor metadata takes no entities; write the value itself")
            if not isinstance(k.tag, str):
                continue            # comments, processing instructions
            allowed = _child_tags(cls)
            raise BadInput(f"{pre}<vstor:{tag}> has unexpected element <{_shown(_local(k.tag))}>",
                           hint="allowed: " + (", ".join(f"<vstor:{a}>" for a in allowed) or "none"))
        if last is not None and found[1] < last[1] and disorder is None:
            disorder = (last[0], found[0])
        last = found
        kids.setdefault(found[0], []).append(k)
    if disorder and cls.xml_ordered:
        raise BadInput(f"{pre}<vstor:{tag}> has <vstor:{disorder[1]}> after <vstor:{disorder[0]}>",
                       hint="vstor writes this record in a fixed order: re-plan instead of editing it")
    return kids


def _no_text(text, tag, pre) -> None:
    if text and text.strip(_WS):
        raise BadInput(f"{pre}<vstor:{tag}> holds text '{_shown(text.strip()[:40])}'", hint="remove it")


def _text_of(k, tag, pre) -> str:
    if not len(k) and not k.keys():
        return k.text or ""         # the common case: text alone
    if k.attrib:
        raise BadInput(f"{pre}<vstor:{tag}> has unknown attribute '{_local(next(iter(k.attrib)))}'",
                       hint="allowed: none")
    if any(isinstance(c, etree._Entity) or isinstance(c.tag, str) for c in k):
        raise BadInput(f"{pre}<vstor:{tag}> holds an element", hint="text only")
    return "".join(k.itertext())


def _shown(text: str) -> str:
    """A value from the document, as a message may repeat it: one line, short."""
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= 80 else text[:77] + "..."


_CLARK = "{" + NS + "}"       # a vstor element's tag, as lxml writes it: {namespace}local


def _local(name: str) -> str:
    """'{namespace}local' or 'local' -> 'local' (lxml's Clark notation)."""
    return name.rpartition("}")[2]


# -- serialising ----------------------------------------------------------------------------

def build(value, *, defaults: bool = False) -> etree._Element:
    """An instance -> its element.  Attributes equal to the field's default are
    left out unless `defaults` (the canonical form digests are taken of)."""
    cls = type(value)
    e = etree.Element(Q + cls.xml_tag, nsmap={PREFIX: NS})
    for f, spec in element_fields(cls):
        v = getattr(value, f.name)
        if isinstance(spec, Attr):
            if v is None or (v == f.default and not defaults and not spec.required):
                continue
            e.set(attr_name(f, spec), spec.type.format(v))
        elif isinstance(spec, Texts):
            for text in v:
                etree.SubElement(e, Q + spec.tag).text = text
        elif v is not None:
            for item in (v if isinstance(spec, _Child) and spec.many else (v,)):
                e.append(build(item, defaults=defaults))
    return e


def canonical(value) -> bytes:
    """Exclusive C14N of the element with every attribute spelled out."""
    return etree.tostring(build(value, defaults=True), method="c14n", exclusive=True)
