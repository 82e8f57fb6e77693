"""Rendering: a plan plus the operator's domain -> concrete libvirt XML.

No decisions here (they are all in the plan).  What vstor renders it owns:
the disks with the planned targets, the planned hostdevs, the vIOMMU it
added and the PCI expander buses of a guest with several cells
(render/buses.py); re-rendering first removes those, so rendering a
rendered domain with the same plan changes nothing.
"""

from __future__ import annotations

import copy

from lxml import etree

from vstor.meta.document import Domain
from vstor.meta import metadata
from vstor.meta.plan import Plan
from vstor.render import buses, elements
from vstor.meta.topology import PCI_CONTROLLER, hostdev_address, is_q35   # hostdev_address: its readers import it from here

# libvirt's own order of <domain> children; new elements go where libvirt
# would put them, so the output is stable and reads like `virsh dumpxml`.
_ORDER = ("name", "uuid", "genid", "title", "description", "metadata", "maxMemory",
          "memory", "currentMemory", "blkiotune", "memtune", "memoryBacking", "vcpu",
          "vcpus", "iothreads", "iothreadids", "cputune", "numatune", "resource",
          "sysinfo", "bootloader", "bootloader_args", "os", "idmap", "features", "cpu",
          "clock", "on_poweroff", "on_reboot", "on_crash", "pm", "perf", "devices")


def render(dom: Domain, plan: Plan, previous: Plan | None = None, spares: bool = True,
           gate: str | None = None) -> Domain:
    """The domain as the plan renders it.  spares=False: without the spare
    root ports of a q35 guest's cells, for libvirt to place the domain's
    devices first; `with_spares` then adds them (render/buses.py).  `gate`:
    the file vstor's prepare writes (vstor.meta.names.gate_path), which the
    domain's QEMU then reads first (elements.gate)."""
    root = copy.deepcopy(dom.root)
    _drop_owned(root, plan, previous)
    place(root, plan)
    if gate:
        elements.gate(root, gate)
    devices = _child(root, "devices")
    controllers, addresses = buses.layout(plan, is_q35(dom.machine), devices)
    devices.extend(controllers)
    for disk in plan.disks:
        if disk.mode == "vhost":
            devices.append(_at(elements.vhost_disk(disk), addresses.get(("disk", disk.target))))
    for address in sorted({d.controller for d in plan.disks if d.mode == "passthrough"}):
        devices.append(_at(elements.hostdev(address), addresses.get(("hostdev", address))))
    if plan.viommu:
        _child(_child(root, "features"), "ioapic").set("driver", "qemu")
        devices.append(elements.iommu())
    if spares:
        buses.spares(devices, f"domain '{plan.domain}'")
    _sort_devices(devices)
    return Domain(root, dom.origin)


def with_spares(dom: Domain) -> Domain:
    """A domain vstor rendered without its spare root ports (and libvirt
    then addressed), with them: above every port libvirt made, so no device
    of the domain's takes one."""
    root = copy.deepcopy(dom.root)
    buses.spares(_child(root, "devices"), f"domain '{dom.name}'")
    return Domain(root, dom.origin)


def place(root, plan: Plan) -> None:
    """The host side of the domain as the plan places it: memory backing,
    vCPUs and their pinning, numatune, the guest's NUMA cell, and the plan
    itself; what a migration may change (libvirt's ABI check allows it)."""
    if plan.cpus == "external":
        # Nova's: its pinning, NUMA cells and memory backing stay as Nova made
        # them, shared for vhost-user (Nova's migration strips the sharing).
        if any(d.mode == "vhost" for d in plan.disks):
            share_domain_memory(root)
        _record(root, plan)
        return
    _memory_backing(root, plan)
    elements.vcpu(_child(root, "vcpu"), plan)
    _cputune(root, plan)
    _numatune(root, plan)
    _cpu_numa(root, plan)
    _record(root, plan)


# -- ownership -----------------------------------------------------------------

def _drop_owned(root, plan: Plan, previous: Plan | None) -> None:
    plans = [p for p in (plan, previous) if p is not None]
    targets = {d.target for p in plans for d in p.disks}
    hostdevs = {d.controller for p in plans for d in p.disks if d.mode == "passthrough"}
    devices = root.find("devices")
    if devices is None:
        return
    for disk in devices.findall("disk"):
        target = disk.find("target")
        if target is not None and target.get("dev") in targets:
            devices.remove(disk)
    for hd in devices.findall("hostdev"):
        if hostdev_address(hd) in hostdevs:
            devices.remove(hd)
    gone = set()
    for c in devices.findall("controller"):
        if buses.own(c):
            # read as libvirt reads it (its declaration): '²' and 4,400
            # digits pass isdigit() and then fail int()
            index = PCI_CONTROLLER.read(c, lenient=True)["index"]
            if index is not None:
                gone.add(index)
            devices.remove(c)
    buses.orphans(devices, gone)
    if previous is not None and previous.viommu or plan.viommu:
        for iommu in devices.findall("iommu"):
            devices.remove(iommu)


# -- memory and CPUs (the elements: vstor/render/elements.py) ----------------------

def _memory_backing(root, plan: Plan) -> None:
    mb = _child(root, "memoryBacking")
    elements.memory_backing(mb, plan)
    if len(mb) == 0:
        root.remove(mb)


def share_domain_memory(root) -> None:
    """The domain's memory backing (made where libvirt orders it if there is
    none), shared as elements.share_memory makes it."""
    elements.share_memory(_child(root, "memoryBacking"))


def _cputune(root, plan: Plan) -> None:
    ct = _child(root, "cputune")
    elements.cputune(ct, plan, iothread_ids(root))
    if len(ct) == 0:
        root.remove(ct)


def iothread_ids(root) -> tuple[int, ...]:
    """The ids of the I/O threads a domain declares, as libvirt reads them
    (virDomainDefParseIOThreads): each <iothreadids><iothread id>, then, up
    to the <iothreads> count, the lowest ids not listed."""
    listed = []
    for e in root.iterfind("iothreadids/iothread"):
        try:
            listed.append(int(e.get("id", "")))
        except ValueError:
            continue        # libvirt refuses the domain: nothing of it to pin
    count = root.find("iothreads")
    try:
        want = int((count.text or "").strip()) if count is not None else 0
    except ValueError:
        want = 0
    ids = list(dict.fromkeys(i for i in listed if i > 0))
    taken, n = set(ids), 1
    while len(ids) < min(want, 4096):
        if n not in taken:
            ids.append(n)
        n += 1
    return tuple(ids)


def _numatune(root, plan: Plan) -> None:
    old = root.find("numatune")
    if old is not None:
        root.remove(old)
    nt = elements.numatune(plan)
    if nt is not None:
        _insert(root, nt)


def _cpu_numa(root, plan: Plan) -> None:
    cpu = _child(root, "cpu")
    old = cpu.find("numa")
    if old is not None:
        cpu.remove(old)
    cpu.append(elements.numa_cell(plan))


# -- devices ------------------------------------------------------------------------

def device_xml(disk, address=None) -> str:
    """One planned disk's libvirt device, as `virsh attach-device` takes it
    (at `address`, a guest PCI address, when given)."""
    e = elements.vhost_disk(disk) if disk.mode == "vhost" else elements.hostdev(disk.controller)
    return etree.tostring(_at(e, address), pretty_print=True, encoding="unicode")


def _at(device, address):
    """`device` with its guest PCI address, when the plan places it."""
    if address is not None:
        device.append(address)
    return device


def _sort_devices(devices) -> None:
    """Keep disks together where the first one was: the operator's own disks
    in their order, then vstor's in plan order."""
    disks = [e for e in devices if e.tag == "disk"]
    if not disks:
        return
    first = list(devices).index(disks[0])
    for e in disks:
        devices.remove(e)
    for i, e in enumerate(disks):
        devices.insert(first + i, e)


# -- the plan record ----------------------------------------------------------------

def _record(root, plan: Plan) -> None:
    metadata.store(root, plan)


def _child(parent, tag: str):
    e = parent.find(tag)
    return e if e is not None else _insert(parent, etree.Element(tag))


def _insert(parent, e):
    """`e` appended to `parent`, or for a <domain> child where libvirt orders it."""
    if parent.tag == "domain" and e.tag in _ORDER:
        rank = _ORDER.index(e.tag)
        for i, sibling in enumerate(parent):
            if isinstance(sibling.tag, str) and sibling.tag in _ORDER and _ORDER.index(sibling.tag) > rank:
                parent.insert(i, e)
                return e
    parent.append(e)
    return e
