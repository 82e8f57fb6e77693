"""The libvirt elements vstor emits, each built in one place.

Every caller that puts one of these into a domain takes it from here: the
libvirt renderer (render/libvirt.py), the migration renderer
(render/migration.py), hotplug (`device_xml`) and the Nova driver
(nova/guest.py, through adapters to Nova's config classes).  Two copies of
the vhost-user disk once drifted: one kept `<readonly/>`, which libvirt
refuses on a vhostuser disk, and such Nova instances could never start.
libvirt itself is the judge of every element here
(tests/test_libvirt_accepts.py: its test driver and its schema).

Pure: a plan (or one planned disk) in, lxml elements out; no decisions.
"""

from __future__ import annotations

from lxml import etree

from vstor.host.model import format_cpulist
from vstor.meta import topology
from vstor.meta.names import GATE_FWCFG, RECONNECT_SECONDS
from vstor.meta.plan import DiskPlan, Plan

# -- devices ------------------------------------------------------------------------

def vhost_disk(disk: DiskPlan):
    """<disk type='vhostuser'> on the planned socket.  A readonly disk has no
    <readonly/>: libvirt refuses it on a vhostuser disk ("readonly is not
    supported with vhostuser disk"); the backend enforces it (qsd's export
    with writable=off, SPDK's vhost controller created readonly), and the
    guest sees a read-only device (virtio-blk's VIRTIO_BLK_F_RO)."""
    d = etree.Element("disk", type="vhostuser", device="disk")
    etree.SubElement(d, "driver", name="qemu", type="raw", queues=str(disk.queues))
    d.append(vhost_source(disk))
    etree.SubElement(d, "target", dev=disk.target, bus="virtio")
    return d


def vhost_source(disk: DiskPlan):
    """The host side of a vhost-user disk: its socket; what a migration moves."""
    src = etree.Element("source", type="unix", path=disk.socket)
    # QEMU reconnects when the backend restarts instead of failing the disk.
    etree.SubElement(src, "reconnect", enabled="yes", timeout=str(RECONNECT_SECONDS))
    return src


def gate(root, path: str) -> None:
    """vstor's fw_cfg entry (vstor.meta.names.GATE_FWCFG) naming `path`: QEMU
    reads the file before it creates any device, so a start vstor's hook did
    not prepare fails at once.  The domain's other fw_cfg entries stay."""
    sysinfo = next((s for s in root.iterfind("sysinfo") if s.get("type") == "fwcfg"), None)
    if sysinfo is None:
        sysinfo = etree.SubElement(root, "sysinfo", type="fwcfg")
    for entry in sysinfo.findall("entry"):
        if entry.get("name") == GATE_FWCFG:
            sysinfo.remove(entry)
    etree.SubElement(sysinfo, "entry", name=GATE_FWCFG, file=path)


def hostdev(address: str):
    """A PCI <hostdev> of a controller ('0000:5e:00.0')."""
    # managed='no': vstor binds vfio-pci itself, after its safety checks,
    # and gives the controller back to its driver at release.
    hd = etree.Element("hostdev", mode="subsystem", type="pci", managed="no")
    etree.SubElement(hd, "driver", name="vfio")
    etree.SubElement(hd, "source").append(topology.hostdev_source(address))
    return hd


def iommu():
    iommu = etree.Element("iommu", model="intel")
    # caching_mode lets the guest's vfio-pci (SPDK in the guest) map DMA.
    etree.SubElement(iommu, "driver", intremap="on", caching_mode="on")
    return iommu


# -- memory and CPUs -------------------------------------------------------------

# libvirt's order of <memoryBacking> children.
_MEMORY_BACKING = ("hugepages", "nosharepages", "locked", "source", "access", "allocation", "discard")


def memory_backing(mb, plan: Plan) -> None:
    """`mb` (a <memoryBacking>, the operator's other children kept) as the
    plan backs the memory: its hugepages, and shared for vhost-user."""
    for tag in ("hugepages", "source", "access"):
        for e in mb.findall(tag):
            mb.remove(e)
    if plan.hugepage_kib:
        hp = etree.Element("hugepages")
        page = etree.SubElement(hp, "page", size=str(plan.hugepage_kib), unit="KiB")
        if plan.numa != "none" and plan.node is not None:
            # the guest's NUMA cells, each placed by numatune
            page.set("nodeset", format_cpulist([c.id for c in plan.guest_cells()]))
        _put(mb, hp)
    if _vhost(plan):
        share_memory(mb)


def share_memory(mb) -> None:
    """A <memoryBacking> whose guest memory a vhost-user backend can map:
    shared access, and memfd when it has neither hugepages nor a source."""
    if mb.find("hugepages") is None and mb.find("source") is None:
        _put(mb, etree.Element("source", type="memfd"))
    access = mb.find("access")
    if access is None:
        _put(mb, etree.Element("access", mode="shared"))
    else:
        access.set("mode", "shared")


def _put(mb, e) -> None:
    rank = _MEMORY_BACKING.index(e.tag)
    later = [c for c in mb if c.tag in _MEMORY_BACKING and _MEMORY_BACKING.index(c.tag) > rank]
    if later:
        later[0].addprevious(e)
    else:
        mb.append(e)


def vcpu(v, plan: Plan) -> None:
    """<vcpu> as planned: the count, and the shared CPUs it floats on."""
    v.text = str(plan.vcpus)
    v.set("placement", "static")
    if plan.shared_cpus:
        v.set("cpuset", format_cpulist(plan.shared_cpus))
    elif "cpuset" in v.attrib:
        del v.attrib["cpuset"]


def cputune(ct, plan: Plan, iothreads=()) -> None:
    """`ct` (a <cputune>, the operator's other children kept) with the
    plan's pinning (Plan.thread_pins): a vcpupin for each vCPU whose cores
    are not the <vcpu cpuset> it would float on, the emulatorpin, and an
    iothreadpin for each of the domain's I/O threads (`iothreads`, their
    ids).  Without one, libvirt runs an I/O thread on the <vcpu cpuset>, or
    on every host CPU when there is none (qemuProcessSetupPid): on the
    dedicated vCPUs' cores.  It goes where the emulator goes."""
    for tag in ("vcpupin", "emulatorpin", "iothreadpin"):
        for e in ct.findall(tag):
            ct.remove(e)
    vcpus, emulator = plan.thread_pins()
    floating = frozenset(plan.shared_cpus)
    at = 0
    for n, cores in enumerate(vcpus):
        if cores != floating:
            ct.insert(at, etree.Element("vcpupin", vcpu=str(n), cpuset=format_cpulist(cores)))
            at += 1
    if emulator:
        ct.insert(at, etree.Element("emulatorpin", cpuset=format_cpulist(emulator)))
        at += 1
        for i in sorted(iothreads):
            ct.insert(at, etree.Element("iothreadpin", iothread=str(i), cpuset=format_cpulist(emulator)))
            at += 1


def numatune(plan: Plan):
    """<numatune> binding the guest's memory, and each of its cells, to the
    plan's host nodes; None when the plan binds none."""
    if plan.numa == "none" or plan.node is None:
        return None
    cells = plan.guest_cells()
    nt = etree.Element("numatune")
    # QEMU's own allocations: on the cells' nodes (libvirt takes one node
    # only for 'preferred': the first cell's)
    nodes = [cells[0].node] if plan.numa == "preferred" else {c.node for c in cells}
    etree.SubElement(nt, "memory", mode=plan.numa, nodeset=format_cpulist(nodes))
    for c in cells:
        etree.SubElement(nt, "memnode", cellid=str(c.id), mode=plan.numa, nodeset=str(c.node))
    return nt


def numa_cell(plan: Plan):
    """<numa> with the guest's NUMA cells, their vCPUs (a range each) and memory;
    memAccess='shared' is what lets a vhost-user backend map its memory."""
    numa = etree.Element("numa")
    for c in plan.guest_cells():
        numa.append(topology.NUMA_CELL.write({
            "id": c.id, "cpus": f"{c.vcpus[0]}-{c.vcpus[-1]}", "memory": c.memory_kib, "unit": "KiB",
            "access": "shared" if _vhost(plan) else None}))
    return numa


def _vhost(plan: Plan) -> bool:
    return any(d.mode == "vhost" for d in plan.disks)
