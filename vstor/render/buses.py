"""Where a guest with several NUMA cells sees each disk: behind a PCI
expander bus of the disk's cell, whose <node> the guest's firmware reports,
so the guest's kernel puts the device (and its queues and buffers) on that
node.  q35: a pcie-expander-bus per cell with a pcie-root-port per device
and one spare for hot-plug; i440fx: a pci-expander-bus per cell with the
devices on it.  A guest with one cell keeps its devices where libvirt puts
them.  The bus numbers: render/expander.py, shared with Proxmox.

libvirt decides PCI addresses; vstor does not model its allocator.  Its
controllers take the lowest indices nothing of the domain's holds (a
controller's, a bus an address names), leaving to libvirt as many as it
numbers controllers given without one (virDomainControllerFindUnusedIndex,
at parse: the lowest unused), so they collide with nothing libvirt
assigns and leave no gap (libvirt fills a gap of indices with root ports
of its own).  libvirt places a device without an address on the lowest
free port it finds, a cell's spare included; so `vstor define` and `vstor
apply` define the domain without the spares first (`render(...,
spares=False)`), let libvirt place every device, and then add the spares
(`spares`) to what libvirt returned, above every port it made.

Every controller vstor adds carries a user alias (`ua-vstor-...`, which
libvirt keeps), so a later render or a hot-plug knows its own.  Facts
measured with libvirt 9.0 and QEMU 7.2 (tests/e2e/test_cells.py): a q35
device needs a root port (not the expander bus itself); a parent
controller needs a lower index than its children; PCI controllers cannot
be hot-plugged (so the spare is made at define); i440fx's pxb takes no
hot-plugged device.

Pure: a plan and the domain's devices in, elements out.
"""

from __future__ import annotations

import re

from lxml import etree

from vstor.errors import BadInput
from vstor.meta.plan import Plan
from vstor.meta.topology import EXPANDERS, PCI_ADDRESS, PCI_CONTROLLER, address_element, guest_bus
from vstor.render import expander

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


def layout(plan: Plan, q35: bool, devices):
    """(controllers, {(kind, key): guest <address>}) for a plan with cells;
    ([], {}) for one with a single cell.  `devices`: the domain's <devices>
    without vstor's own controllers.  BadInput when the cells' devices need
    more indices, slots or bus numbers than PCI has."""
    if len(plan.guest_cells()) < 2:
        return [], {}
    placed = devices_of(plan)
    cells = [(c.id, [(kind, key) for cell, kind, key in placed if cell == c.id]) for c in plan.guest_cells()]
    try:
        laid = expander.expanders(cells, q35, top=top_bus(devices), spares=1 if q35 else 0)
    except expander.Full as e:
        raise _full(plan, f"{e}{' (one for the spare root port)' if q35 else ''}") from None
    free = free_indices(devices)
    controllers, addresses = [], {}
    for bus in laid:
        index = next(free)
        controllers.append(_controller(index, "pcie-expander-bus" if q35 else "pci-expander-bus",
                                       f"cell{bus.cell}", bus_nr=bus.bus_nr, node=bus.cell))
        for slot, device in enumerate(bus.devices):
            if q35:
                port = next(free)
                controllers.append(_controller(port, "pcie-root-port", f"cell{bus.cell}-port{slot}",
                                               plug=(index, slot)))
                addresses[device] = address(port, 0)
            else:
                addresses[device] = address(index, slot)
    # The root bus's own ports and bridges take the bus numbers from 1 up
    # (one per controller of the domain's at most): the expanders' ranges
    # lie above.  The spares to come need an index each.
    highest = max(int(c.get("index")) for c in controllers) + (len(laid) if q35 else 0)
    low, theirs = laid[-1].bus_nr, max(_in_use(devices)[0])
    if highest > 255 or low <= theirs:
        raise _full(plan, f"its {len(placed)} devices in {len(laid)} cells need PCI controller indices "
                          f"up to {highest} and bus numbers down to {low} (at most 255, and above "
                          f"the domain's own controllers, up to {theirs})")
    return controllers, addresses


def spares(devices, who: str) -> None:
    """A spare root port (where a hot-plugged disk of its cell goes) behind
    each of vstor's q35 expander buses whose ports all hold a device, at
    the lowest free index above its bus: into a domain libvirt has
    addressed, it is above every port libvirt made, and stays free."""
    held = {guest_bus(e) for e in devices if isinstance(e.tag, str)} - {None}
    ports: dict[int, list] = {}
    for c in devices.iterfind("controller[@type='pci']"):
        if own(c) and c.get("model") == "pcie-root-port":
            ports.setdefault(guest_bus(c), []).append(c)
    for bus in list(devices.iterfind("controller[@type='pci'][@model='pcie-expander-bus']")):
        parts = PCI_CONTROLLER.read(bus, lenient=True)
        mine = ports.get(parts["index"], [])
        if not own(bus) or parts["index"] is None or any(
                PCI_CONTROLLER.read(p, lenient=True)["index"] not in held for p in mine):
            continue
        index = next(i for i in free_indices(devices) if i > parts["index"])
        if index > 255:
            raise BadInput(f"{who}: no PCI controller index is left for the spare root port of guest "
                           f"cell {parts['node']} (at most 255)", hint="give the guest fewer devices")
        slot = 1 + max((_slot(p) for p in mine), default=-1)
        devices.append(_controller(index, "pcie-root-port", f"cell{parts['node']}-port{slot}",
                                   plug=(parts["index"], slot)))


def _slot(port) -> int:
    a = port.find("address[@type='pci']")
    return (PCI_ADDRESS.read(a, lenient=True)["slot"] or 0) if a is not None else 0


def _full(plan: Plan, why: str):
    return BadInput(f"domain '{plan.domain}': {why}",
                    hint="put fewer disks in a cell or the guest, or use cells='one'")


def top_bus(devices) -> int:
    """The lowest bus number an expander bus of the domain's own takes (256:
    none): vstor numbers its buses below it."""
    out = 256
    for c in devices.iterfind("controller[@type='pci']"):
        if own(c) or c.get("model") not in EXPANDERS:
            continue
        bus_nr = PCI_CONTROLLER.read(c, lenient=True)["bus_nr"]
        out = min(out, 254 if bus_nr is None else bus_nr)   # 254: libvirt's for the first one without
    return out


def _in_use(devices) -> tuple[set[int], int]:
    """(the PCI controller indices the domain holds: its controllers' and
    the buses its devices' addresses name; how many of its PCI controllers
    have no index, which libvirt numbers itself)."""
    used, unindexed = {0}, 0
    for c in devices.iterfind("controller[@type='pci']"):
        index = PCI_CONTROLLER.read(c, lenient=True)["index"]
        if index is None:
            unindexed += 1
        else:
            used.add(index)
    used |= {guest_bus(e) for e in devices if isinstance(e.tag, str)} - {None}
    return used, unindexed


def free_indices(devices):
    """The indices free for vstor's controllers, lowest first: the first
    free ones are left to the controllers libvirt numbers itself."""
    used, unindexed = _in_use(devices)
    index = 0
    while True:
        index += 1
        if index in used:
            continue
        if unindexed:
            unindexed -= 1
            continue
        yield index


# Devices that are not on a PCI bus (libvirt gives them no PCI address).
_NOT_PCI = {"emulator", "serial", "console", "channel", "graphics", "parallel", "smartcard", "tpm",
            "hub", "redirdev", "audio", "lease", "input", "video", "controller"}


def _waiting(devices) -> int:
    """How many root ports a q35 domain's devices take at define: those
    libvirt has yet to address, and the USB controller and memory balloon
    libvirt adds when the domain has none.  Only for counting the spare
    ports of a domain libvirt has yet to define (`spare_ports`); no index
    of vstor's depends on it."""
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
        if isinstance(e.tag, str) and guest_bus(e) in gone and not own(e):
            e.remove(e.find("address[@type='pci']"))


def address(bus: int, slot: int):
    return address_element(0, bus, slot, 0, type="pci")


def _controller(index: int, model: str, name: str, *, bus_nr=None, node=None, plug=None):
    c = PCI_CONTROLLER.write({"index": index, "model": model, "bus_nr": bus_nr, "node": node}, type="pci")
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
    used = {guest_bus(e) for e in devices if isinstance(e.tag, str)} - {None}
    for c in devices.iterfind("controller[@type='pci']"):
        target = c.find("target")
        if c.get("model") not in _PORTS or (target is not None and target.get("hotplug") == "off"):
            continue
        index = PCI_CONTROLLER.read(c, lenient=True)["index"]
        if index not in used:
            alias = c.find("alias")
            found = _CELL_PORT.match((alias.get("name") or "") if alias is not None else "")
            yield (int(found.group(1)) if found else None), index
