"""Where a guest with several NUMA cells sees each disk: behind a PCI
expander bus of the disk's cell, whose <node> the guest's firmware reports,
so the guest's kernel puts the device (and its queues and buffers) on that
node.  q35: a pcie-expander-bus per cell with a pcie-root-port per device
and one spare for hot-plug; i440fx: a pci-expander-bus per cell with the
devices on it.  A guest with one cell keeps its devices where libvirt puts
them.

Every controller vstor adds carries a user alias (`ua-vstor-...`, which
libvirt keeps), so a later render or a hot-plug knows its own.  Bus numbers
are given from 255 down, each expander bus with room for its root ports.
Facts measured with libvirt 9.0 and QEMU 7.2 (tests/e2e/test_cells.py): a
q35 device needs a root port (not the expander bus itself); a parent
controller needs a lower index than its children; PCI controllers cannot
be hot-plugged (so the spare is made at define); i440fx's pxb takes no
hot-plugged device; libvirt places a device without an address on any free
root port, vstor's spare included (see `first_index`).

Pure: a plan and the domain's existing controller indices in, elements out.
"""

from __future__ import annotations

import re

from lxml import etree

from vstor.errors import BadInput
from vstor.meta.plan import Plan

ALIAS = "ua-vstor-"


def own(e) -> bool:
    alias = e.find("alias")
    return alias is not None and (alias.get("name") or "").startswith(ALIAS)


def devices_of(plan: Plan) -> list[tuple[int, str, str]]:
    """(cell, kind, key) of each guest device vstor places: a vhost-user disk
    by target, a passed-through controller by its host address."""
    out, seen = [], set()
    for d in plan.disks:
        key = d.target if d.mode == "vhost" else d.controller
        if key in seen:
            continue
        seen.add(key)
        out.append((plan.disk_cell(d).id, "disk" if d.mode == "vhost" else "hostdev", key))
    return out


def layout(plan: Plan, q35: bool, first_index: int, top: int = 256):
    """(controllers, {(kind, key): guest <address>}) for a plan with cells;
    ([], {}) for one with a single cell.  `top`: the lowest bus number the
    domain's own expander buses take (vstor's go below it).  BadInput when
    the cells' devices need more indices, slots or bus numbers than PCI has."""
    if len(plan.guest_cells()) < 2:
        return [], {}
    placed = devices_of(plan)
    controllers, addresses = [], {}
    index, bus_nr = first_index, top
    for cell in plan.guest_cells():
        mine = [(kind, key) for c, kind, key in placed if c == cell.id]
        if len(mine) + q35 > 32:
            raise _full(plan, f"guest cell {cell.id} has {len(mine)} devices; its expander bus has "
                              f"32 slots{' (one for the spare root port)' if q35 else ''}")
        # Bus numbers below it up to the next one's are its hierarchy's: one
        # per root port on q35; i440fx's pxb holds a bridge QEMU adds (libvirt
        # 9.0's own busNr leaves one, and a guest with two ports behind one
        # bus then hangs in its firmware).
        bus_nr -= 2 + len(mine) if q35 else 2
        expander = index
        controllers.append(_controller(expander, "pcie-expander-bus" if q35 else "pci-expander-bus",
                                       f"cell{cell.id}", bus_nr=bus_nr, node=cell.id))
        index += 1
        for slot, device in enumerate(mine + ([(None, "spare")] if q35 else [])):
            if q35:
                controllers.append(_controller(index, "pcie-root-port", f"cell{cell.id}-port{slot}",
                                               plug=(expander, slot)))
                where = (index, 0)
                index += 1
            else:
                where = (expander, slot)
            if device[0] is not None:
                addresses[device] = address(*where)
    # The root bus's own ports and bridges take the bus numbers from 1 up
    # (one per controller below vstor's): the expanders' ranges lie above.
    if index - 1 > 255 or bus_nr < first_index:
        raise _full(plan, f"its {len(placed)} devices in {len(plan.guest_cells())} cells need "
                          f"PCI controller indices up to {index - 1} and bus numbers down to {bus_nr} "
                          "(at most 255, and above the root bus's)")
    return controllers, addresses


def _full(plan: Plan, why: str):
    return BadInput(f"domain '{plan.domain}': {why}",
                    hint="put fewer disks in a cell or the guest, or use cells='one'")


def top_bus(devices) -> int:
    """The lowest bus number an expander bus of the domain's own takes (256:
    none): vstor numbers its buses below it."""
    out = 256
    for c in devices.iterfind("controller[@type='pci']"):
        if own(c) or c.get("model") not in ("pcie-expander-bus", "pci-expander-bus"):
            continue
        try:
            out = min(out, int(c.find("target").get("busNr")))
        except (AttributeError, TypeError, ValueError):
            out = min(out, 254)     # libvirt's choice for the first one without busNr
    return out


# Devices that are not on a PCI bus (libvirt gives them no PCI address).
_NOT_PCI = {"emulator", "serial", "console", "channel", "graphics", "parallel", "smartcard", "tpm",
            "hub", "redirdev", "audio", "lease", "input", "video", "controller"}


def first_index(devices, q35: bool, count: int = 1) -> int:
    """The index of vstor's first controller (of `count`, contiguous): the
    lowest with none of the domain's PCI controllers among them and, on
    q35, as many free indices below as libvirt may need root ports for
    devices it has yet to address.  libvirt fills a gap of indices with
    root ports of its own and places an unaddressed device on the first
    free port, which is then one of those and never a cell's spare.  A
    domain libvirt has addressed gets vstor's controllers at the same
    indices again (libvirt 9.0 keeps the controllers it added, some above
    vstor's: a pcie-to-pci-bridge for a conventional PCI device)."""
    used, unindexed = {0}, 0
    for c in devices.iterfind("controller[@type='pci']"):
        try:
            used.add(int(c.get("index")))
        except (TypeError, ValueError):
            unindexed += 1          # libvirt numbers it: one of the free indices
    for a in devices.iterfind("*/address[@type='pci']"):
        try:                        # a bus a device of the operator's names is never vstor's
            used.add(int(a.get("bus", "0"), 0))
        except ValueError:
            continue
    need = unindexed + (_waiting(devices) if q35 else 0)
    first, free_below = 1, 0
    while free_below < need or used & set(range(first, first + count)):
        free_below += first not in used
        first += 1
    return first


def _waiting(devices) -> int:
    """How many root ports a q35 domain's devices take at define: those
    libvirt has yet to address, and the USB controller and memory balloon
    libvirt adds when the domain has none."""
    need = sum(1 for e in devices if isinstance(e.tag, str) and _waits_for_port(e))
    return need + sum(1 for path in ("controller[@type='usb']", "memballoon") if devices.find(path) is None)


def _waits_for_port(e) -> bool:
    """A device libvirt has yet to give a PCI address (model='none': no device)."""
    if e.find("address") is not None or own(e) or e.get("model") == "none":
        return False
    if e.tag == "controller":
        return e.get("type") in ("usb", "scsi", "virtio-serial")
    if e.tag == "input":
        return e.get("bus") == "virtio"
    if e.tag == "panic":
        return e.get("model") == "pvpanic"
    return e.tag not in _NOT_PCI


def orphans(devices, gone: set[int]) -> None:
    """Drop the guest address of a device libvirt put on a controller of
    vstor's that a new render replaces: libvirt addresses it again."""
    for e in devices:
        a = e.find("address[@type='pci']") if isinstance(e.tag, str) else None
        try:
            on = int(a.get("bus", "0"), 0) if a is not None else None
        except ValueError:
            continue
        if on in gone and not own(e):
            e.remove(a)


def address(bus: int, slot: int):
    return etree.Element("address", type="pci", domain="0x0000", bus=f"0x{bus:02x}",
                         slot=f"0x{slot:02x}", function="0x0")


def _controller(index: int, model: str, name: str, *, bus_nr=None, node=None, plug=None):
    c = etree.Element("controller", type="pci", index=str(index), model=model)
    if bus_nr is not None:
        target = etree.SubElement(c, "target", busNr=str(bus_nr))
        etree.SubElement(target, "node").text = str(node)
    etree.SubElement(c, "alias", name=ALIAS + name)
    if plug is not None:
        c.append(address(*plug))
    return c


def free_port(devices, cell: int):
    """The guest <address> of a spare root port of `cell` no device uses
    (where a hot-plugged disk goes), or None."""
    index = next((i for k, i in _free_ports(devices) if k == cell and i is not None), None)
    return None if index is None else address(index, 0)


def spare_ports(devices, cells: int) -> tuple[int, ...]:
    """Per guest cell, the q35 ports a hot-plugged disk can take: a guest
    with cells takes one on its cell's own ports (vstor's, by alias), one
    with a single cell on any of the domain's, less those the devices
    libvirt has yet to address take at define (none in a running domain's
    XML, which libvirt has addressed)."""
    free: dict[int | None, int] = {}
    for cell, _ in _free_ports(devices):
        free[cell] = free.get(cell, 0) + 1
    if cells > 1:
        return tuple(free.get(k, 0) for k in range(cells))
    return (max(free.get(None, 0) - _waiting(devices), 0),)


_PORTS = ("pcie-root-port", "pcie-switch-downstream-port")
_CELL_PORT = re.compile(rf"{ALIAS}cell([0-9]+)-")


def _free_ports(devices):
    """(vstor's guest cell or None, index) of each port a q35 guest takes a
    hot-plugged device on: a root port (or a switch's downstream port) no
    device sits on, hot-plug not off (index None: libvirt numbers it)."""
    used = set()
    for a in devices.iterfind("*/address[@type='pci']"):
        try:
            used.add(int(a.get("bus", "0"), 0))
        except ValueError:
            continue
    for c in devices.iterfind("controller[@type='pci']"):
        target = c.find("target")
        if c.get("model") not in _PORTS or (target is not None and target.get("hotplug") == "off"):
            continue
        try:
            index = int(c.get("index"))
        except (TypeError, ValueError):
            index = None
        if index not in used:
            alias = c.find("alias")
            found = _CELL_PORT.match((alias.get("name") or "") if alias is not None else "")
            yield (int(found.group(1)) if found else None), index
