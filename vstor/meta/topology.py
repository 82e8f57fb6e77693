"""A domain's guest NUMA topology as its XML gives it to the guest: the
cells of <cpu><numa> and the cell of each disk, from the <node> of the PCI
expander bus the disk sits behind.  This is the guest's ABI, which a live
migration keeps (libvirt checks it): the destination plans the cells the
domain has, never the ones a recorded plan claims.  Input like any domain
XML (threats.md): checked here, refused with the reason.
"""

from __future__ import annotations

import re

from vstor.errors import BadInput
from vstor.host.model import parse_cpulist
from vstor.meta.document import to_kib
from vstor.meta.intent import MAX_CELLS
from vstor.records import record

_EXPANDERS = ("pcie-expander-bus", "pci-expander-bus")


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
        text = e.get("cpus", "")
        if i >= MAX_CELLS:
            raise _not_vstors(who)
        try:
            cpus = parse_cpulist(text, below=vcpus)
            kib = to_kib(e.get("memory", ""), e.get("unit", "KiB"))
            cid = e.get("id", str(i))
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
        index = _number(c.get("index", ""), 0xFF)
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
    parts = tuple(_number(a.get(k, "0"), hi) for k, hi in _PCI_FIELDS)
    return None if None in parts else "%04x:%02x:%02x.%x" % parts


def _node(device, by_index) -> int | None:
    """The <node> of the expander bus the device sits behind (through root
    ports and bridges), or None."""
    seen = set()
    e = device
    while True:
        a = e.find("address[@type='pci']")
        bus = _number(a.get("bus", "0"), 0xFF) if a is not None else 0
        c = by_index.get(bus)
        if c is None or bus in seen or bus == 0:
            return None
        seen.add(bus)
        if c.get("model") in _EXPANDERS:
            node = c.find("target/node")
            return _number(node.text or "", 0xFFFF) if node is not None else None
        e = c


# libvirt's bounds of a PCI address's parts (virPCIDeviceAddressIsValid).
_PCI_FIELDS = (("domain", 0xFFFF), ("bus", 0xFF), ("slot", 0x1F), ("function", 7))


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
