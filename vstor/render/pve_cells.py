"""Where a Proxmox guest with several NUMA cells sees each vhost-user disk:
behind a PCI expander bus of the disk's cell (QEMU's `numa_node`, which
the guest's firmware reports), written into `args` after the -chardevs and
before the -device of each disk, so the guest's kernel puts the device (its
queues and buffers) on that cell.  A guest with one cell keeps its disks
where qemu-server's QEMU puts them.

q35: a `pxb-pcie` per cell with a `pcie-root-port` per disk; i440fx: a
`pxb` per cell (QEMU puts a PCI bridge behind it) with the disks on it.
Only cells with a vhost disk get a bus.  What must not collide with
qemu-server's own devices (its pve-q35-4.0.cfg, PVE::QemuServer::PCI):

- the expander buses are the functions of one root-bus slot qemu-server
  never fills: 0x8 on q35's pcie.0 (its devices there are 0x1, 0x9-0x19
  and the chipset's 0x1a-0x1f; QEMU gives a device without an address,
  a virtio-iommu-pci say, the lowest free slot: 0x2 first), 0x1a on
  i440fx's pci.0 (qemu-server's `vga3`, the fourth display of a Windows
  guest with `vga: qxl4`, which is refused);
- bus numbers from 255 down, each expander bus with room for what is
  behind it (its root ports; the PCI bridge of a pxb): the firmware
  numbers qemu-server's bridges and root ports from 1 up;
- a root port's chassis is the number of the bus behind it, above
  qemu-server's chassis 1-16 (its ich9-pcie-port-N).

Pure: a plan and the machine type in, QEMU option values out.
"""

from __future__ import annotations

import re
from collections import Counter

from vstor.errors import BadInput
from vstor.meta.plan import Plan
from vstor.meta.topology import is_q35
from vstor.render import expander

ID = "vstor-"
Q35_SLOT = 0x8
I440FX_SLOT = 0x1a


def buses(plan: Plan, machine: str) -> tuple[list[str], dict[str, str]]:
    """(-device values of the expander buses and root ports, in order;
    {target: ',bus=...,addr=...' for its vhost-user-blk-pci}).  Nothing
    for a plan with one cell."""
    if len(plan.guest_cells()) < 2:
        return [], {}
    q35 = is_q35(machine)
    cells = [(c.id, [d.target for d in plan.disks if d.mode == "vhost" and plan.disk_cell(d).id == c.id])
             for c in plan.guest_cells()]
    try:        # i440fx: slot 0 of a pxb is its bridge's
        laid = expander.expanders([c for c in cells if c[1]], q35, first_slot=0 if q35 else 1)
    except expander.Full as e:
        raise BadInput(f"{plan.domain}: guest cell {e.cell} has {e.devices} vhost disks; its "
                       f"expander bus has {e.slots} slots",
                       hint="put fewer disks in the cell, or give the guest more cells") from None
    if len(laid) > 8:           # MAX_CELLS is 8: cannot happen
        raise BadInput(f"{plan.domain}: more than 8 guest cells with vhost disks",
                       hint="give the guest at most 8 cells")
    out: list[str] = []
    where: dict[str, str] = {}
    for function, bus in enumerate(laid):
        if bus.bus_nr < 64:         # qemu-server's own bridges and ports are far below
            raise BadInput(f"{plan.domain}: guest cell {bus.cell}: too many vhost disks for the PCI "
                           "bus numbers of the guest's expander buses", hint="give the VM fewer disks")
        name = f"{ID}cell{bus.cell}"
        model, root, slot = ("pxb-pcie", "pcie.0", Q35_SLOT) if q35 else ("pxb", "pci.0", I440FX_SLOT)
        out.append(f"{model},id={name},bus_nr={bus.bus_nr},numa_node={bus.cell},bus={root},"
                   f"addr=0x{slot:x}.{function},multifunction=on")
        for i, target in enumerate(bus.devices):
            if q35:
                port = f"{name}-{target}"
                out.append(f"pcie-root-port,id={port},bus={name},addr=0x{i:x},"
                           f"chassis={bus.bus_nr + 1 + i}")
                where[target] = f",bus={port},addr=0x0"
            else:
                where[target] = f",bus={name},addr=0x{i + 1:x}"
    return out, where


def check_machine(conf, plan: Plan, machine: str, vm: int) -> None:
    """Refused: a config whose own devices take the slot of vstor's buses."""
    if not buses(plan, machine)[0] or is_q35(machine):
        return
    parts = (conf.get("vga") or "").split(",")
    types = [p.removeprefix("type=") for p in parts if "=" not in p or p.startswith("type=")]
    if "qxl4" in types:
        raise BadInput(f"VM {vm}: vga qxl4 takes PCI slot 0x1a of an i440fx guest (its fourth "
                       "display), where vstor puts the expander buses of the guest's cells",
                       hint=f"qm set {vm} --vga qxl3 (or --machine q35), then apply again")


_T = r"vd[a-z]{1,3}"
_CHARDEV = re.compile(rf"socket,id=vstor-({_T}),path=/[A-Za-z0-9_./+-]+,reconnect(-ms)?=[0-9]{{1,9}}")
_DEVICE = re.compile(rf"vhost-user-blk-pci,id=vstor-({_T}),chardev=vstor-\1,num-queues=[0-9]{{1,2}}"
                     rf"(,bus=vstor-cell[0-7](-\1)?,addr=0x[0-9a-f]{{1,2}})?")
_PXB = re.compile(r"pxb(-pcie)?,id=vstor-cell([0-7]),bus_nr=[0-9]{1,3},numa_node=\2,bus=pcie?\.0,"
                  r"addr=0x[0-9a-f]{1,2}\.[0-7],multifunction=on")
_PORT = re.compile(rf"pcie-root-port,id=vstor-cell([0-7])-{_T},bus=vstor-cell\1,addr=0x[0-9a-f]{{1,2}},"
                   r"chassis=[0-9]{1,3}")


def check_vstor_part(tokens: list[str], vm: int) -> None:
    """vstor's suffix of args: only options exactly as vstor writes them,
    a -chardev and a -device for each disk."""
    chardevs, devices = Counter(), Counter()
    for i in range(0, len(tokens), 2):
        opt, value = tokens[i], (tokens[i + 1] if i + 1 < len(tokens) else "")
        chardev = opt == "-chardev" and _CHARDEV.fullmatch(value)
        device = opt == "-device" and _DEVICE.fullmatch(value)
        bus = opt == "-device" and (_PXB.fullmatch(value) or _PORT.fullmatch(value))
        if not (chardev or device or bus):
            _not_ours(f"{opt} {value}", vm)
        if chardev:
            chardevs[chardev.group(1)] += 1
        if device:
            devices[device.group(1)] += 1
    if chardevs != devices or any(n > 1 for n in chardevs.values()):
        _not_ours(" ".join(tokens), vm)


def _not_ours(said: str, vm: int) -> None:
    raise BadInput(f"VM {vm}: args has '{said[:60]}' among the arguments with vstor's id prefix "
                   f"'{ID}', which vstor did not write",
                   hint="vstor's -chardev/-device arguments come last: put your own arguments "
                        "before them, with ids of your own, then apply again")
