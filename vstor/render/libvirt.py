"""Rendering: a plan plus the operator's domain -> concrete libvirt XML.

No decisions here (they are all in the plan).  What vstor renders it owns:
the disks with the planned targets, the planned hostdevs, and the vIOMMU it
added; re-rendering first removes those, so rendering a rendered domain with
the same plan changes nothing.
"""

from __future__ import annotations

import copy

from lxml import etree

from vstor.meta.document import Domain
from vstor.host.model import format_cpulist
from vstor.meta import metadata
from vstor.meta.plan import Plan

# libvirt's own order of <domain> children; new elements go where libvirt
# would put them, so the output is stable and reads like `virsh dumpxml`.
_ORDER = ("name", "uuid", "genid", "title", "description", "metadata", "maxMemory",
          "memory", "currentMemory", "blkiotune", "memtune", "memoryBacking", "vcpu",
          "vcpus", "iothreads", "iothreadids", "cputune", "numatune", "resource",
          "sysinfo", "bootloader", "bootloader_args", "os", "idmap", "features", "cpu",
          "clock", "on_poweroff", "on_reboot", "on_crash", "pm", "perf", "devices")


def render(dom: Domain, plan: Plan, previous: Plan | None = None) -> Domain:
    root = copy.deepcopy(dom.root)
    _drop_owned(root, plan, previous)
    place(root, plan)
    devices = _child(root, "devices")
    for disk in plan.disks:
        if disk.mode == "vhost":
            devices.append(_vhost_disk(disk))
    for address in sorted({d.controller for d in plan.disks if d.mode == "passthrough"}):
        devices.append(_hostdev(address))
    if plan.viommu:
        _child(_child(root, "features"), "ioapic").set("driver", "qemu")
        devices.append(_iommu())
    _sort_devices(devices)
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
    _vcpu(root, plan)
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
    if previous is not None and previous.viommu or plan.viommu:
        for iommu in devices.findall("iommu"):
            devices.remove(iommu)


def hostdev_address(hd) -> str | None:
    """A PCI <hostdev>'s source address as '0000:5e:00.0'; None for another
    kind of hostdev or an address that is not numbers."""
    a = hd.find("source/address")
    if a is None or hd.get("type") != "pci":
        return None
    try:
        return "%04x:%02x:%02x.%x" % tuple(int(a.get(k, "0"), 0)
                                         for k in ("domain", "bus", "slot", "function"))
    except ValueError:
        return None


# -- memory and CPUs -------------------------------------------------------------

def _memory_backing(root, plan: Plan) -> None:
    mb = _child(root, "memoryBacking")
    for tag in ("hugepages", "source", "access"):
        for e in mb.findall(tag):
            mb.remove(e)
    if plan.hugepage_kib:
        hp = etree.SubElement(mb, "hugepages")
        page = etree.SubElement(hp, "page", size=str(plan.hugepage_kib), unit="KiB")
        if plan.numa != "none" and plan.node is not None:
            page.set("nodeset", "0")    # the guest's NUMA cell 0, placed by numatune
    elif any(d.mode == "vhost" for d in plan.disks):
        etree.SubElement(mb, "source", type="memfd")
    if any(d.mode == "vhost" for d in plan.disks):
        etree.SubElement(mb, "access", mode="shared")
    if len(mb) == 0:
        root.remove(mb)


_MEMORY_BACKING = ("hugepages", "nosharepages", "locked", "source", "access", "allocation", "discard")


def share_domain_memory(root) -> None:
    """The domain's memory backing (made where libvirt orders it if there is
    none), shared as share_memory makes it."""
    share_memory(_child(root, "memoryBacking"))


def share_memory(mb) -> None:
    """A <memoryBacking> whose guest memory a vhost-user backend can map:
    shared access, and memfd when it has neither hugepages nor a source."""
    def put(e):
        rank = _MEMORY_BACKING.index(e.tag)
        later = [c for c in mb if c.tag in _MEMORY_BACKING and _MEMORY_BACKING.index(c.tag) > rank]
        if later:
            later[0].addprevious(e)
        else:
            mb.append(e)
    if mb.find("hugepages") is None and mb.find("source") is None:
        put(etree.Element("source", type="memfd"))
    access = mb.find("access")
    if access is None:
        put(etree.Element("access", mode="shared"))
    else:
        access.set("mode", "shared")


def _vcpu(root, plan: Plan) -> None:
    v = _child(root, "vcpu")
    v.text = str(plan.vcpus)
    v.set("placement", "static")
    if plan.shared_cpus:
        v.set("cpuset", format_cpulist(plan.shared_cpus))
    elif "cpuset" in v.attrib:
        del v.attrib["cpuset"]


def _cputune(root, plan: Plan) -> None:
    ct = _child(root, "cputune")
    for tag in ("vcpupin", "emulatorpin"):
        for e in ct.findall(tag):
            ct.remove(e)
    at = 0
    for vcpu, cpu in enumerate(plan.vcpu_pins):
        ct.insert(at, etree.Element("vcpupin", vcpu=str(vcpu), cpuset=str(cpu)))
        at += 1
    if plan.emulator:
        ct.insert(at, etree.Element("emulatorpin", cpuset=format_cpulist(plan.emulator)))
    if len(ct) == 0:
        root.remove(ct)


def _numatune(root, plan: Plan) -> None:
    old = root.find("numatune")
    if old is not None:
        root.remove(old)
    if plan.numa == "none" or plan.node is None:
        return
    nt = _child(root, "numatune")
    etree.SubElement(nt, "memory", mode=plan.numa, nodeset=str(plan.node))
    etree.SubElement(nt, "memnode", cellid="0", mode=plan.numa, nodeset=str(plan.node))


def _cpu_numa(root, plan: Plan) -> None:
    """One guest NUMA cell holding all vCPUs and memory; memAccess='shared' is
    what lets a vhost-user backend map the guest's memory."""
    cpu = _child(root, "cpu")
    old = cpu.find("numa")
    if old is not None:
        cpu.remove(old)
    numa = etree.SubElement(cpu, "numa")
    cell = etree.SubElement(numa, "cell", id="0", cpus=f"0-{plan.vcpus - 1}",
                            memory=str(plan.memory_kib), unit="KiB")
    if any(d.mode == "vhost" for d in plan.disks):
        cell.set("memAccess", "shared")


# -- devices ------------------------------------------------------------------------

def device_xml(disk) -> str:
    """One planned disk's libvirt device, as `virsh attach-device` takes it."""
    e = _vhost_disk(disk) if disk.mode == "vhost" else _hostdev(disk.controller)
    return etree.tostring(e, pretty_print=True, encoding="unicode")


def _vhost_disk(disk):
    d = etree.Element("disk", type="vhostuser", device="disk")
    etree.SubElement(d, "driver", name="qemu", type="raw", queues=str(disk.queues))
    src = etree.SubElement(d, "source", type="unix", path=disk.socket)
    # QEMU reconnects when the backend restarts instead of failing the disk.
    etree.SubElement(src, "reconnect", enabled="yes", timeout="10")
    etree.SubElement(d, "target", dev=disk.target, bus="virtio")
    return d


def _hostdev(address: str):
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    # managed='no': vstor binds vfio-pci itself, after its safety checks,
    # and gives the controller back to its driver at release.
    hd = etree.Element("hostdev", mode="subsystem", type="pci", managed="no")
    etree.SubElement(hd, "driver", name="vfio")
    src = etree.SubElement(hd, "source")
    etree.SubElement(src, "address", domain=f"0x{domain}", bus=f"0x{bus}",
                     slot=f"0x{slot}", function=f"0x{function}")
    return hd


def _iommu():
    iommu = etree.Element("iommu", model="intel")
    # caching_mode lets the guest's vfio-pci (SPDK in the guest) map DMA.
    etree.SubElement(iommu, "driver", intremap="on", caching_mode="on")
    return iommu


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
    if e is not None:
        return e
    e = etree.Element(tag)
    if parent.tag == "domain" and tag in _ORDER:
        rank = _ORDER.index(tag)
        for i, sibling in enumerate(parent):
            if isinstance(sibling.tag, str) and sibling.tag in _ORDER and _ORDER.index(sibling.tag) > rank:
                parent.insert(i, e)
                return e
    parent.append(e)
    return e
