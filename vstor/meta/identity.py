"""Who a domain is, read from its XML with the standard library's expat:
its <name>, its <uuid>, and whether <metadata> holds a <vstor:vstor>.

The hook's release and reconnect need nothing else (what to undo is in the
state record), so they skip lxml and vstor's declarations (vstor.meta.document
reads the same three for everything else, and the tests hold both to one
answer).  No DTD is accepted: libvirt never writes one, and nothing in the
domain's XML is expanded or fetched.
"""

from __future__ import annotations

from xml.parsers import expat

from vstor import NS
from vstor.errors import BadInput
from vstor.meta.names import safe_key

_VSTOR = f"{NS} vstor"
_DEPTH = 256        # libxml2's own limit, which the lxml reader keeps


class Identity:
    __slots__ = ("name", "uuid", "vstor", "origin")

    def __init__(self, name: str, uuid: str | None, vstor: bool, origin: str):
        self.name, self.uuid, self.vstor, self.origin = name, uuid, vstor, origin

    @property
    def safe_name(self) -> str:
        return safe_key(self.name, self.uuid, self.origin)


def read(xml: bytes, origin: str = "domain XML") -> Identity:
    """The domain's identity; malformed XML (or a DTD) is refused (exit 2)."""
    parser = expat.ParserCreate(namespace_separator=" ")
    path: list = []
    text: dict[str, list[str]] = {}     # the first <name> and <uuid> under the root
    found = [0]

    def start(tag, _attrs):
        if not path and tag != "domain":
            shown = "{%s}%s" % tuple(tag.split(" ", 1)) if " " in tag else tag   # as lxml names it
            raise BadInput(f"{origin}: the root element is <{shown}>, not <domain>")
        if len(path) == 2 and path[1] == "metadata" and tag == _VSTOR:
            found[0] += 1
        if len(path) >= _DEPTH:
            raise BadInput(f"{origin}: the XML is nested deeper than {_DEPTH} elements")
        path.append(tag)
        if len(path) == 2 and tag in ("name", "uuid") and tag not in text:
            text[tag] = []
            path[1] = text[tag]     # collect here until it ends

    def data(chunk):
        # Any text within <name> or <uuid>, however deep, as the string value
        # of the element (libvirt's XPath string(), lxml's itertext()).
        if len(path) >= 2 and isinstance(path[1], list):
            path[1].append(chunk)

    def doctype(*_):
        raise BadInput(f"{origin}: a DOCTYPE is not accepted in domain XML")

    parser.StartElementHandler = start
    parser.EndElementHandler = lambda _tag: path.pop()
    parser.CharacterDataHandler = data
    parser.StartDoctypeDeclHandler = doctype
    try:
        parser.Parse(xml, True)
    except expat.ExpatError as e:
        raise BadInput(f"{origin}: malformed XML at line {e.lineno}, column {e.offset + 1}: "
                       f"{expat.ErrorString(e.code)}") from None
    except ValueError as e:     # an encoding expat does not read ("multi-byte encodings ...")
        raise BadInput(f"{origin}: cannot read the XML: {e}",
                       hint="libvirt writes UTF-8; write the domain XML in UTF-8") from None
    if found[0] > 1:
        raise BadInput(f"{origin}: <metadata> holds {found[0]} <vstor:vstor> elements",
                       hint="keep one: vstor reads its disks from a single element")
    name = "".join(text.get("name", ()))      # unstripped, as libvirt reads it
    if not name.strip():
        raise BadInput(f"{origin}: the domain has no <name>")
    uuid = "".join(text.get("uuid", ())).strip().lower() or None
    return Identity(name, uuid, found[0] == 1, origin)
