"""A libvirt domain document: parsing, the few facts the planner needs, and
access to vstor's element in <metadata>.  No decisions are made here."""

from __future__ import annotations

import re

from lxml import etree

from vstor import NS, PREFIX
from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.intent import DiskIntent, Intent
from vstor.meta.names import GATE_FWCFG, safe_key
from vstor.meta.plan import Plan
from vstor.meta import xmlmodel

# libvirt's memory units, in bytes: integers, so no value of any length
# reaches a float.
_UNITS = {
    "b": 1, "bytes": 1, "KB": 1000, "k": 1024, "KiB": 1024, "MB": 1000**2, "M": 1024**2,
    "MiB": 1024**2, "GB": 1000**3, "G": 1024**3, "GiB": 1024**3, "TB": 1000**4, "T": 1024**4,
    "TiB": 1024**4,
}
# The most memory vstor reads anywhere (a domain's, a guest cell's, a
# Proxmox VM's): 1 EiB, below libvirt's own limit (2^63 - 1 bytes, "value
# too large" beyond) and far above what any host's physical address width
# can hold.
MAX_MEMORY_KIB = 2**50


def to_kib(text: str, unit: str) -> int:
    """An amount of memory in a libvirt unit, in whole KiB (a part of a KiB
    dropped); ValueError for a unit vstor does not read, for anything but
    ASCII digits, and for more than MAX_MEMORY_KIB."""
    if unit not in _UNITS:
        raise ValueError(f"unit '{unit[:20]}' is not one vstor reads ({', '.join(_UNITS)})")
    if not re.fullmatch(r"[0-9]{1,20}", text.strip(), re.ASCII):
        raise ValueError(f"memory '{text[:20]}' is not a whole number of at most 20 digits")
    kib = int(text) * _UNITS[unit] // 1024
    if kib > MAX_MEMORY_KIB:
        raise ValueError(f"memory {text.strip()} {unit} is more than 1 EiB")
    return kib


def xml_parser() -> etree.XMLParser:
    # Domain XML comes from operators and from libvirt: never expand entities
    # or fetch anything it points at.
    return etree.XMLParser(resolve_entities=False, no_network=True,
                           remove_blank_text=True, huge_tree=False)


def syntax_error(e: etree.XMLSyntaxError) -> str:
    """'malformed XML at line L, column C: what': lxml appends ', line L,
    column C' to libxml2's message, which may name the same line itself
    ('Premature end of data in tag domain line 1'): each line is said once."""
    line, column = e.position if e.position else (e.lineno, 0)
    msg = re.sub(r",? line [0-9]+, column [0-9]+$", "", e.msg or "").strip()
    msg = re.sub(rf" line {line}\b", "", msg)
    return f"malformed XML at line {line}" + (f", column {column}" if column else "") + f": {msg}"


class Domain:
    def __init__(self, root: etree._Element, origin: str = "domain XML"):
        if root.tag != "domain":
            raise BadInput(f"{origin}: the root element is <{root.tag}>, not <domain>")
        self.root = root
        self.origin = origin

    @classmethod
    def parse(cls, text: str | bytes, origin: str = "domain XML") -> "Domain":
        if isinstance(text, str):
            text = text.encode()
        try:
            root = etree.fromstring(text, xml_parser())
        except etree.XMLSyntaxError as e:
            raise BadInput(f"{origin}: {syntax_error(e)}") from None
        if root.getroottree().docinfo.doctype:
            # libvirt never writes one; an entity declared in it would read
            # one way here and be refused by the hook's release (identity.py).
            raise BadInput(f"{origin}: a DOCTYPE is not accepted in domain XML")
        return cls(root, origin)

    @classmethod
    def load(cls, path: str) -> "Domain":
        try:
            with open(path, "rb") as f:
                return cls.parse(f.read(), path)
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}") from None

    def to_string(self) -> str:
        return etree.tostring(self.root, pretty_print=True, encoding="unicode")

    # -- facts -------------------------------------------------------------
    @property
    def name(self) -> str:
        # All of its text (a comment inside does not cut it), unstripped:
        # as libvirt reads it, which keeps spaces around a name.
        found = self.root.find("name")
        name = "".join(found.itertext()) if found is not None else ""
        if not name.strip():
            raise BadInput(f"{self.origin}: the domain has no <name>")
        return name

    @property
    def uuid(self) -> str | None:
        found = self.root.find("uuid")
        text = "".join(found.itertext()).strip() if found is not None else ""
        return text.lower() or None

    @property
    def safe_name(self) -> str:
        return safe_key(self.name, self.uuid, self.origin)

    @property
    def vcpus(self) -> int:
        text = (self.root.findtext("vcpu") or "1").strip()
        if not re.fullmatch(r"[0-9]{1,4}", text, re.ASCII) or not 1 <= int(text) <= 4096:
            raise BadInput(f"{self.origin}: <vcpu> is '{text[:20]}', not a number from 1 to 4096")
        return int(text)

    @property
    def memory_kib(self) -> int:
        e = self.root.find("memory")
        if e is None or not (e.text or "").strip():
            raise BadInput(f"{self.origin}: the domain has no <memory>")
        unit = e.get("unit", "KiB")
        if unit not in _UNITS:
            raise BadInput(f"{self.origin}: <memory unit='{unit[:20]}'> is not a libvirt unit")
        text = e.text.strip()
        try:
            kib = to_kib(text, unit)
        except ValueError:
            kib = 0
        if kib < 1:
            raise BadInput(f"{self.origin}: <memory> is '{text[:20]}', not an amount of memory "
                           "from 1 KiB to 1 EiB")
        return kib

    @property
    def machine(self) -> str:
        e = self.root.find("os/type")
        return e.get("machine", "") if e is not None else ""

    def hugepage_kib(self) -> int | None:
        """The page size of the guest memory's <hugepages> (the smallest one
        named), KiB; None when its memory is not hugepage-backed."""
        hp = self.root.find("memoryBacking/hugepages")
        if hp is None:
            return None
        if not self._all_cells_in(hp):
            return None         # some guest cell's memory is ordinary: not hugepage-backed
        sizes = []
        for page in hp.iterfind("page"):
            try:
                sizes.append(to_kib(page.get("size", ""), page.get("unit", "KiB")))
            except ValueError:
                raise BadInput(f"{self.origin}: <hugepages><page size='{page.get('size', '')[:20]}'> "
                               "is not a page size") from None
        return min(sizes) if sizes else 2048       # libvirt: the host's default size

    def _all_cells_in(self, hp) -> bool:
        """Every guest NUMA cell's memory is in the <hugepages>: a <page>
        without a nodeset covers them all, else their nodesets must."""
        from vstor.cpulist import parse_cpulist
        pages = hp.findall("page")
        if not pages or any(p.get("nodeset") is None for p in pages):
            return True
        cells = {c.get("id", "") for c in self.root.iterfind("cpu/numa/cell")} or {"0"}
        covered: set[str] = set()
        for p in pages:
            try:
                covered.update(str(n) for n in parse_cpulist(p.get("nodeset", "")))
            except ValueError:
                raise BadInput(f"{self.origin}: <hugepages><page nodeset='{p.get('nodeset')[:20]}'> "
                               "is not a list of guest cells") from None
        return cells <= covered

    # -- vstor metadata (read through vstor.meta.metadata only) --------------
    def is_nova(self) -> bool:
        """Nova generated it: <nova:instance> in <metadata> (any version)."""
        meta = self.root.find("metadata")
        return meta is not None and any(
            isinstance(e.tag, str) and e.tag.startswith("{http://openstack.org/xmlns/libvirt/nova/")
            and e.tag.endswith("}instance") for e in meta)

    def has_vstor(self) -> bool:
        return self._find() is not None

    def gate(self) -> str | None:
        """The file of vstor's fw_cfg entry (vstor.meta.names.GATE_FWCFG), as
        the XML names it (whoever wrote it: checked where it is used)."""
        for entry in self.root.iterfind("sysinfo[@type='fwcfg']/entry"):
            if entry.get("name") == GATE_FWCFG:
                return entry.get("file") or ""
        return None

    def _find(self):
        try:
            return metadata.find(self.root)
        except BadInput as e:
            raise BadInput(f"{self.origin}: {e.message}", hint=e.hint) from None

    def intent(self) -> Intent:
        """The operator's vstor elements; a refusal starts with where they
        came from (the file, or the domain)."""
        elem = self._find()
        if elem is None:
            raise BadInput(f"{self.origin}: domain '{self.name}' has no vstor metadata",
                           hint=f"add <metadata><{PREFIX}:vstor xmlns:{PREFIX}='{NS}'>...")
        try:
            return metadata.load_intent(elem)
        except BadInput as e:
            raise BadInput(f"{self.origin}: {e.message}", hint=e.hint) from None

    def recorded_plan(self) -> Plan | None:
        """The plan a rendered domain carries, or None if it was never planned."""
        elem = self._find()
        return None if elem is None else metadata.load_plan(elem, self.name, self.uuid)


def load_disk(path: str) -> DiskIntent:
    """A file holding one <vstor:disk> element (what `vstor attach` adds)."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    try:
        root = etree.fromstring(text, xml_parser())
    except etree.XMLSyntaxError as e:
        raise BadInput(f"{path}: {syntax_error(e)}") from None
    if root.tag != f"{{{NS}}}disk":
        raise BadInput(f"{path}: the root element is <{etree.QName(root).localname}>"
                       f"{' in another namespace' if etree.QName(root).namespace else ''}, "
                       f"not <{PREFIX}:disk>",
                       hint=f"write <{PREFIX}:disk xmlns:{PREFIX}='{NS}' target='vdc'> with one source")
    try:
        return xmlmodel.parse(DiskIntent, root)
    except BadInput as e:
        raise BadInput(f"{path}: {e.message}", hint=e.hint) from None
