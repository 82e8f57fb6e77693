"""A domain's guest NUMA topology as its XML gives it to the guest: the
cells of <cpu><numa> and the cell of each disk, from the <node> of the PCI
expander bus the disk sits behind.  This is the guest's ABI, which a live
migration keeps (libvirt checks it): the destination plans the cells the
domain has, never the ones a recorded plan claims.  Input like any domain
XML (threats.md): checked here, refused with the reason.
"""

from __future__ import annotations

from vstor.errors import BadInput
from vstor.host.model import parse_cpulist
from vstor.meta.intent import MAX_CELLS
from vstor.records import record

_EXPANDERS = ("pcie-expander-bus", "pci-expander-bus")
_UNITS = {"b": 1 / 1024, "bytes": 1 / 1024, "KiB": 1, "k": 1, "KB": 1000 / 1024, "MiB": 1024,
          "M": 1024, "MB": 1000000 / 1024, "GiB": 1024 ** 2, "G": 1024 ** 2}


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
        try:
            cpus = tuple(sorted(parse_cpulist(e.get("cpus", ""))))
            kib = int(e.get("memory", "")) * _UNITS[e.get("unit", "KiB")]
            cid = int(e.get("id", str(i)))
        except (ValueError, KeyError):
            raise BadInput(f"{who}: guest NUMA cell {i} is not cpus/memory/unit vstor reads",
                           hint="give each <cell> id, cpus, memory and unit='KiB'") from None
        out.append(GuestCell(cid, cpus, int(kib)))
    if not out:
        return ()
    whole = sorted(v for c in out for v in c.vcpus)
    if ([c.id for c in out] != list(range(len(out))) or len(out) > MAX_CELLS
            or whole != list(range(vcpus)) or any(c.vcpus != tuple(range(c.vcpus[0], c.vcpus[-1] + 1))
                                                   for c in out if c.vcpus)
            or any(not c.vcpus for c in out) or sum(c.memory_kib for c in out) != memory_kib):
        raise BadInput(f"{who}: its guest NUMA cells are not ones vstor gives (at most {MAX_CELLS}, "
                       "numbered from 0, each a range of vCPUs, together all vCPUs and memory)",
                       hint="migrate a domain as vstor rendered it")
    return tuple(out)


def disk_cells(root, count: int) -> tuple[tuple[str, int], ...]:
    """(target, cell) of each disk behind a PCI expander bus whose <node> is
    a guest cell; a disk elsewhere (the root bus) is in cell 0."""
    by_index = {}
    for c in root.iterfind("devices/controller[@type='pci']"):
        try:
            by_index[int(c.get("index", ""))] = c
        except ValueError:
            continue
    out = []
    for d in root.iterfind("devices/disk"):
        target = d.find("target")
        if target is None or not target.get("dev"):
            continue
        node = _node(d, by_index)
        out.append((target.get("dev"), node if node is not None and 0 <= node < count else 0))
    return tuple(out)


def _node(device, by_index) -> int | None:
    """The <node> of the expander bus the device sits behind (through root
    ports and bridges), or None."""
    seen = set()
    e = device
    while True:
        a = e.find("address[@type='pci']")
        try:
            bus = int(a.get("bus", "0"), 0) if a is not None else 0
        except ValueError:
            return None
        c = by_index.get(bus)
        if c is None or bus in seen or bus == 0:
            return None
        seen.add(bus)
        if c.get("model") in _EXPANDERS:
            node = c.find("target/node")
            try:
                return int(node.text) if node is not None else None
            except (TypeError, ValueError):
                return None
        e = c
