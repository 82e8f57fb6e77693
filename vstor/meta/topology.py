"""A domain's guest NUMA topology as its XML gives it to the guest: the
cells of <cpu><numa> and the cell of each disk, from the <node> of the PCI
expander bus the disk sits behind.  This is the guest's ABI, which a live
migration keeps (libvirt checks it): the destination plans the cells the
domain has, never the ones a recorded plan claims.  Input like any domain
XML (threats.md): checked here, refused with the reason.

Each element vstor both writes and reads (a PCI address, a guest cell, an
expander bus) is declared here once, as virtinst's XMLProperty does: the
renderers (vstor.render) write it and the readers read it through the same
declaration, so the two cannot drift.
"""

from __future__ import annotations

import re

from lxml import etree

from vstor.errors import BadInput
from vstor.host.model import parse_cpulist
from vstor.meta.document import to_kib
from vstor.meta.intent import MAX_CELLS
from vstor.records import record

EXPANDERS = ("pcie-expander-bus", "pci-expander-bus")


def is_q35(machine: str) -> bool:
    """A machine type of QEMU's q35 family ('q35', 'pc-q35-7.2'): PCIe, root
    ports, pxb-pcie; any other x86 type ('pc', 'pc-i440fx-7.2') is i440fx.
    The one test of it, for libvirt's <type machine> and Proxmox's machine."""
    return machine.startswith(("q35", "pc-q35"))


# -- elements declared once for both directions ------------------------------------

class Number:
    """A number as libvirt reads it (strtoul with base 0) from 0 to `hi`,
    written as `form` makes it; `default` when the attribute is absent."""

    def __init__(self, hi: int, form: str = "%d", default: int | None = None):
        self.hi, self.form, self.default = hi, form, default

    def read(self, text: str) -> int:
        n = _number(text, self.hi)
        if n is None:
            raise ValueError(text)
        return n

    def write(self, value: int) -> str:
        return self.form % value


class Text:
    """Text as it stands; `default` when the attribute is absent."""

    def __init__(self, default: str | None = None):
        self.default = default

    @staticmethod
    def read(text: str) -> str:
        return text

    @staticmethod
    def write(value) -> str:
        return str(value)


class BadPart(ValueError):
    """A part of an element that is not what its declaration reads."""

    def __init__(self, name: str, where: str, text: str):
        super().__init__(f"<{where.replace('/@', ' ').lstrip('@')}='{text[:20]}'>")
        self.name, self.where, self.text = name, where, text


class Element:
    """One libvirt element's parts, each (name, where, kind) declared once:
    `where` is an attribute ('@bus'), an attribute of a child
    ('target/@busNr') or a child's text ('target/node').  `read` and
    `write` are both made from the declaration."""

    def __init__(self, tag: str, *parts):
        self.tag, self.parts = tag, parts

    def read(self, e, lenient: bool = False) -> dict:
        """{name: value} of `e` (a kind's default where a part is absent);
        BadPart for one its kind does not read (lenient: None for it)."""
        out = {}
        for name, where, kind in self.parts:
            path, attr = _split(where)
            at = e.find(path) if path else e
            text = (at.get(attr) if attr else at.text) if at is not None else None
            try:
                out[name] = kind.default if text is None else kind.read(text)
            except ValueError:
                if not lenient:
                    raise BadPart(name, where, text) from None
                out[name] = None
        return out

    def write(self, values: dict, **first):
        """The element with `first` (fixed attributes, in order) and each
        part of `values` that is not None, in the declaration's order."""
        e = etree.Element(self.tag, **first)
        for name, where, kind in self.parts:
            if values.get(name) is None:
                continue
            path, attr = _split(where)
            at = e
            for step in path.split("/") if path else ():
                at = at.find(step) if at.find(step) is not None else etree.SubElement(at, step)
            if attr:
                at.set(attr, kind.write(values[name]))
            else:
                at.text = kind.write(values[name])
        return e


def _split(where: str) -> tuple[str, str | None]:
    """('target', 'busNr') for 'target/@busNr', ('', 'bus') for '@bus',
    ('target/node', None) for a child's text."""
    if "@" not in where:
        return where, None
    path, attr = where.split("@")
    return path.rstrip("/"), attr


# A PCI address: a hostdev's <source><address> on the host, a device's
# <address type='pci'> in the guest.  libvirt's bounds of its parts
# (virPCIDeviceAddressIsValid); a part not given is 0.
PCI_ADDRESS = Element("address", ("domain", "@domain", Number(0xFFFF, "0x%04x", 0)),
                      ("bus", "@bus", Number(0xFF, "0x%02x", 0)), ("slot", "@slot", Number(0x1F, "0x%02x", 0)),
                      ("function", "@function", Number(7, "0x%x", 0)))
# A guest NUMA cell of <cpu><numa>: vstor gives each a range of vCPUs.
NUMA_CELL = Element("cell", ("id", "@id", Text()), ("cpus", "@cpus", Text("")), ("memory", "@memory", Text("")),
                    ("unit", "@unit", Text("KiB")), ("access", "@memAccess", Text()))
# A PCI controller; an expander bus has a bus number and the cell it is on.
PCI_CONTROLLER = Element("controller", ("index", "@index", Number(0xFF)), ("model", "@model", Text()),
                         ("bus_nr", "target/@busNr", Number(0xFF)), ("node", "target/node", Number(0xFFFF)))


def pci_address(a) -> tuple[int, int, int, int]:
    """(domain, bus, slot, function) of an <address>; BadPart for a part
    libvirt would not read."""
    parts = PCI_ADDRESS.read(a)
    return parts["domain"], parts["bus"], parts["slot"], parts["function"]


def address_element(domain: int, bus: int, slot: int, function: int, **first):
    return PCI_ADDRESS.write({"domain": domain, "bus": bus, "slot": slot, "function": function}, **first)


def guest_bus(device) -> int | None:
    """The bus (a PCI controller's index) of a device's guest <address
    type='pci'>; None when it has none or one libvirt would not read."""
    a = device.find("address[@type='pci']")
    try:
        return pci_address(a)[1] if a is not None else None
    except BadPart:
        return None


@record
class GuestCell:
    id: int
    vcpus: tuple[int, ...]
    memory_kib: int
    hugepages: int = 0
    node: None = None


def cells(root, vcpus: int, memory_kib: int, who: str) -> tuple[GuestCell, ...]:
    """The domain's guest cells, each a contiguous range of vCPUs, together
    all vCPUs and all memory; () when it has none."""
    out = []
    for i, e in enumerate(root.iterfind("cpu/numa/cell")):
        cell = NUMA_CELL.read(e)
        if i >= MAX_CELLS:
            raise _not_vstors(who)
        try:
            cpus = parse_cpulist(cell["cpus"], below=vcpus)
            kib = to_kib(cell["memory"], cell["unit"])
            cid = str(i) if cell["id"] is None else cell["id"]
            if not re.fullmatch(r"[0-9]{1,4}", cid, re.ASCII):
                raise ValueError(f"id '{cid[:20]}' is not a number")
            cid = int(cid)
        except ValueError as e:
            raise BadInput(f"{who}: guest NUMA cell {i} is not cpus/memory/unit vstor reads ({e}; at "
                           f"most {MAX_CELLS} cells of its {vcpus} vCPUs)",
                           hint="give each <cell> id, cpus, memory and unit='KiB'") from None
        out.append(GuestCell(cid, cpus, kib))
    if not out:
        return ()
    whole = [v for c in out for v in c.vcpus]       # in cell order: vCPU i's cell is the i-th range's
    if ([c.id for c in out] != list(range(len(out)))
            or whole != list(range(vcpus)) or any(c.vcpus != tuple(range(c.vcpus[0], c.vcpus[-1] + 1))
                                                   for c in out if c.vcpus)
            or any(not c.vcpus or c.memory_kib <= 0 for c in out)
            or sum(c.memory_kib for c in out) != memory_kib):
        raise _not_vstors(who)
    return tuple(out)


def _not_vstors(who: str) -> BadInput:
    return BadInput(f"{who}: its guest NUMA cells are not ones vstor gives (at most {MAX_CELLS}, "
                    "numbered from 0, each a range of vCPUs in order and some memory, together "
                    "all vCPUs and memory)", hint="migrate a domain as vstor rendered it")


def disk_cells(root, count: int) -> tuple[tuple[str, int], ...]:
    """(target, cell) of each disk, and (host PCI address, cell) of each
    passed-through PCI device, behind a PCI expander bus whose <node> is a
    guest cell; a device elsewhere (the root bus) is in cell 0."""
    by_index = {}
    for c in root.iterfind("devices/controller[@type='pci']"):
        index = PCI_CONTROLLER.read(c, lenient=True)["index"]
        if index is not None:
            by_index[index] = c
    out = []
    for d in root.iterfind("devices/disk"):
        target = d.find("target")
        if target is None or not target.get("dev"):
            continue
        node = _node(d, by_index)
        out.append((target.get("dev"), node if node is not None and 0 <= node < count else 0))
    for h in root.iterfind("devices/hostdev[@type='pci']"):
        key = hostdev_address(h)
        if key is None:
            continue
        node = _node(h, by_index)
        out.append((key, node if node is not None and 0 <= node < count else 0))
    return tuple(out)


def hostdev_address(hd) -> str | None:
    """A PCI <hostdev>'s source address as '0000:5e:00.0'; None for another
    kind of hostdev or an address that is not numbers."""
    a = hd.find("source/address")
    if a is None or hd.get("type") != "pci":
        return None
    try:
        return "%04x:%02x:%02x.%x" % pci_address(a)
    except BadPart:
        return None


def hostdev_source(address: str):
    """The <address> of a hostdev's <source> for a host address ('0000:5e:00.0')."""
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return address_element(*(int(p, 16) for p in (domain, bus, slot, function)))


def _node(device, by_index) -> int | None:
    """The <node> of the expander bus the device sits behind (through root
    ports and bridges), or None."""
    seen = set()
    e = device
    while True:
        bus = guest_bus(e) if e.find("address[@type='pci']") is not None else 0
        c = by_index.get(bus)
        if c is None or bus in seen or bus == 0:
            return None
        seen.add(bus)
        if c.get("model") in EXPANDERS:
            return PCI_CONTROLLER.read(c, lenient=True)["node"]
        e = c


def _number(text: str, hi: int) -> int | None:
    """A number of a device's address as libvirt reads it (strtoul with
    base 0: 0x hexadecimal, a leading 0 octal, else decimal), from 0 to
    `hi`; None for anything else."""
    m = re.fullmatch(r"\s*\+?(?:0[xX]([0-9a-fA-F]{1,8})|0([0-7]{0,11})|([1-9][0-9]{0,9}))", text, re.ASCII)
    if not m:
        return None
    hexadecimal, octal, decimal = m.groups()
    n = int(hexadecimal, 16) if hexadecimal else int(decimal) if decimal else int(octal or "0", 8)
    return n if n <= hi else None
