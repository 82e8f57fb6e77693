"""The arithmetic of a guest's PCI expander buses (QEMU's pxb-pcie on q35,
pxb on i440fx; libvirt's pcie-expander-bus and pci-expander-bus), one per
guest cell, written once for libvirt (render/buses.py) and Proxmox
(render/pve_cells.py).

Bus numbers are given from `top` down, each expander bus with room below
the next one's for what is behind it: on q35 one bus per root port; on
i440fx the PCI bridge QEMU puts behind a pxb (libvirt 9.0's own busNr
leaves one, and a guest with two ports behind one bus then hangs in its
firmware).  The guest's firmware numbers the root bus's own ports and
bridges from 1 up, below them.

Pure: the devices of each cell in, bus numbers and slots out.
"""

from __future__ import annotations

from vstor.records import record

SLOTS = 32          # device numbers on a PCI bus


@record
class Expander:
    cell: int
    bus_nr: int
    devices: tuple          # the cell's devices, in slot (q35: root port) order
    ports: int              # q35: root ports behind it, the devices' and then the spares; i440fx: 0


class Full(ValueError):
    """A cell with more devices than its expander bus has slots."""

    def __init__(self, cell: int, devices: int, slots: int):
        super().__init__(f"guest cell {cell} has {devices} devices; its expander bus has {slots} slots")
        self.cell, self.devices, self.slots = cell, devices, slots


def expanders(cells, q35: bool, *, top: int = 256, spares: int = 0, first_slot: int = 0) -> list[Expander]:
    """An Expander for each (cell, devices) of `cells`, in order.  `spares`:
    the empty root ports each takes on q35 (for hot-plug); `first_slot`:
    the lowest slot a device takes on i440fx.  Full for a cell whose
    devices (and spares) need more slots than a bus has."""
    out, bus_nr = [], top
    for cell, devices in cells:
        ports = len(devices) + spares if q35 else 0
        slots = SLOTS if q35 else SLOTS - first_slot
        if (ports if q35 else len(devices)) > slots:
            raise Full(cell, len(devices), slots)
        bus_nr -= 1 + (ports if q35 else 1)
        out.append(Expander(cell, bus_nr, tuple(devices), ports))
    return out
