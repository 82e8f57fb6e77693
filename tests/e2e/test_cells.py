"""A guest with two NUMA cells whose domain XML vstor renders: an annotated
domain with <vstor:vm cells='2'> and qsd file disks naming their cells,
defined with `vstor define`, started through the real libvirtd (vstor's
hook starts the qemu-storage-daemons), booted under TCG.  Inside the guest
each disk's PCI device must report its cell as numa_node and each node its
vCPUs, and the data the guest writes through every disk must be in that
disk's backing file.  Devices without a PCI address (USB, SCSI and
virtio-serial controllers, a balloon, a NIC, an RNG, a virtio tablet, a
watchdog, a panic device) sit next to the disks: libvirt places such
devices on any free root port, and a cell's spare port must still be free
after the define and after a `vstor apply`, which must change no device.
On q35 `vstor attach --persistent` of a disk of cell 1 lands on that cell's
spare port, and a second one into the same cell is refused and changes
nothing; stopped, `vstor apply` places the added disk like the others, with
a new spare, and the guest boots with it on cell 1.  On i440fx an attach is
refused (QEMU hot-plugs nothing behind its expander bus) and changes
nothing.

The host has one NUMA node: both cells are backed by host node 0 here; what
is checked is the guest's view.  The expected cells are the ones the
annotations ask for, not read back from vstor's output."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid

import libvirt
import pytest
from lxml import etree

from .guest import domain_xml, expected_pattern, job, label_disk
from .helpers import ROOT, SIZE, WORK, backing, cleanup, daemons, hooked, nothing_left, stop, vstor, wait_for_marker

NS = "https://vstor.dev/xmlns/domain/1"
V = f"{{{NS}}}"
# Cold disks by target and the cell each asks for: out of order, so that
# neither the guest's probe order nor the targets line up by accident, and
# two in cell 1 (two root ports behind one q35 expander bus).
COLD = (("vdb", 1), ("vdc", 0), ("vdd", 1))
CELL_CPUS = {0: {0}, 1: {1}}          # two vCPUs, one per cell
HOLD = 8                              # seconds the i440fx guest waits for a refused attach
# Devices libvirt addresses itself, on q35 each on a root port: one of its
# own, or the first free one there is, a cell's spare included.
UNADDRESSED = ("<controller type='usb' model='qemu-xhci'/><controller type='scsi' model='virtio-scsi'/>"
               "<controller type='virtio-serial'/><memballoon model='virtio'/>"
               "<interface type='user'><mac address='52:54:00:c0:11:5e'/><model type='virtio'/></interface>"
               "<rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>"
               "<input type='tablet' bus='virtio'/><watchdog model='i6300esb'/><panic model='isa'/>")
ELSEWHERE = ["controller-scsi", "controller-usb", "controller-virtio-serial", "input", "interface", "memballoon",
             "rng", "watchdog"]
# q35: libvirt adds a pcie-to-pci-bridge for the (conventional PCI) watchdog,
# with an index above vstor's controllers.
ELSEWHERE_Q35 = sorted(ELSEWHERE + ["controller-pci"])


@pytest.fixture(scope="module")
def cells_env(libvirt_daemons):
    """conftest's vstor_env, with housekeeping cores for shared vCPUs."""
    yield from hooked(libvirt_daemons, housekeeping="0-1")


def annotated(name: str, guest, machine: str, disks: dict[str, str], guest_job: str) -> str:
    """The test guest (2 vCPUs, 256 MiB) with <vstor:vm cells='2'> and a qsd
    file disk per target in `disks` ({target: path}, cells from COLD)."""
    root = etree.fromstring(domain_xml(name, guest, guest_job, vcpus=2, machine=machine,
                                       memory_backing=None, console_log=WORK / f"{name}.console"))
    devices = root.find("devices")
    for e in devices.findall("controller[@type='usb']") + devices.findall("memballoon"):
        devices.remove(e)       # model='none' in the kit's domain: these get devices
    devices.extend(etree.fromstring(f"<x>{UNADDRESSED}</x>"))
    meta = etree.Element("metadata")
    root.insert(1, meta)
    top = etree.SubElement(meta, V + "vstor", nsmap={"vstor": NS})
    etree.SubElement(top, V + "vm", cells="2", cpus="shared", numa="strict")
    for target, cell in COLD:
        top.append(etree.fromstring(disk_intent(target, cell, disks[target])))
    return etree.tostring(root, encoding="unicode")


def disk_intent(target: str, cell: int, path: str) -> str:
    return (f"<vstor:disk xmlns:vstor='{NS}' target='{target}' backend='qsd' cell='{cell}'>"
            f"<vstor:file path='{path}'/></vstor:disk>")


def labelled(name: str, targets) -> tuple[dict[str, str], dict[str, str]]:
    """A backing file per target, each with its own label: ({target: path}, {target: label})."""
    tag = uuid.uuid4().hex[:8]
    paths = {t: backing(f"{name}-{t}") for t in targets}
    labels = {t: f"{t}-{tag}" for t in targets}
    for t in targets:
        label_disk(paths[t], SIZE, labels[t])
    return paths, labels


def vstor_out(conf, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(conf), *args],
                          capture_output=True, text=True, cwd=ROOT)


def pci_layout(xml: str) -> dict[str, object]:
    """What libvirt made of the PCI topology: {'cells': {cell: [the
    device names (disk target, controller-TYPE or element tag) on each of its
    root ports, in port order] (i440fx: [the devices on its expander bus])},
    'elsewhere': [devices on no controller of vstor's but pcie.0/pci.0's
    built-ins]}."""
    devices = etree.fromstring(xml).find("devices")
    controllers = {int(c.get("index")): c for c in devices.iterfind("controller[@type='pci']")}
    on: dict[int, list[str]] = {}
    for e in devices:
        a = e.find("address[@type='pci']")
        if a is None or e.get("model") in ("pcie-root-port", "pcie-expander-bus", "pci-expander-bus"):
            continue        # (bridges count: a device libvirt adds one for takes a port)
        what = {"disk": lambda: e.find("target").get("dev"),
                "controller": lambda: f"controller-{e.get('type')}"}.get(e.tag, lambda: e.tag)()
        on.setdefault(int(a.get("bus"), 0), []).append(what)

    def alias(index: int) -> str:
        found = controllers[index].find("alias")
        return found.get("name") if found is not None else ""

    cells: dict[int, list] = {}
    for index, c in sorted(controllers.items()):
        if c.get("model") in ("pcie-expander-bus", "pci-expander-bus"):
            node = int(c.find("target/node").text)
            assert alias(index) == f"ua-vstor-cell{node}", etree.tostring(c)
            if c.get("model") == "pcie-expander-bus":
                ports = [i for i, p in sorted(controllers.items()) if p.get("model") == "pcie-root-port"
                         and int(p.find("address").get("bus"), 0) == index]
                assert all(alias(i).startswith(f"ua-vstor-cell{node}-port") for i in ports)
                cells[node] = [sorted(on.get(i, [])) for i in ports]
            else:
                cells[node] = sorted(on.get(index, []))
    mine = {i for i in controllers if alias(i).startswith("ua-vstor-")}
    elsewhere = sorted(d for bus, ds in on.items() if bus not in mine for d in ds
                       if d not in ("controller-sata", "controller-ide"))     # the chipset's
    return {"cells": cells, "elsewhere": elsewhere}


def check_guest(parsed: dict, labels: dict[str, str], cells: dict[str, int], paths: dict[str, str],
                seed: int) -> None:
    """Each label (each backing file) seen through a PCI device on its
    disk's cell, each cell with its vCPUs, the pattern written and read
    through every disk and found in every file."""
    assert parsed["done"] and not parsed["fail"], parsed["markers"]
    # Guests name disks in probe order: the label read through a device says
    # which backing file it is, the guest kernel's numa_node where it sits.
    seen = sorted((d["label"], d["numa_node"]) for d in parsed["disks"].values())
    assert seen == sorted((labels[t], cells[t]) for t in labels), parsed["disks"]
    assert parsed["nodes"] == CELL_CPUS
    want = hashlib.sha256(expected_pattern(seed, SIZE)).hexdigest()
    assert {dev: (io.get("wrote"), io.get("read")) for dev, io in parsed["devices"].items()} \
        == {dev: (want, want) for dev in parsed["disks"]}
    for target, path in paths.items():
        with open(path, "rb") as f:
            assert f.read(SIZE) == expected_pattern(seed, SIZE), f"{path} lacks the guest's data"
            assert f.read(512).split(b"\n")[0] == labels[target].encode(), f"{path}: label overwritten"


def define(conf, name: str, xml: str, libvirt_conn) -> str:
    """`vstor define` of the annotated domain; what it said."""
    cleanup(libvirt_conn, name)          # a leftover of an interrupted run
    path = WORK / f"{name}.xml"
    path.write_text(xml)
    return vstor(conf, "define", str(path))


def devices(xml: str) -> list[bytes]:
    """A domain's devices, in an order of their own (libvirt's moves vstor's controllers)."""
    return sorted(etree.tostring(e) for e in etree.fromstring(xml).find("devices"))


def applied_again(conf, name: str, libvirt_conn, xml: str) -> None:
    """`vstor apply` of the defined domain changes none of its devices."""
    vstor(conf, "apply", name)
    assert devices(libvirt_conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == devices(xml)


def plan_cells(xml: str) -> dict[str, int]:
    plan = etree.fromstring(xml).find(f"metadata/{V}vstor/{V}plan")
    return {d.get("target"): int(d.get("cell")) for d in plan.iterfind(f"{V}disk")}


def started(dom, request) -> float:
    t = time.monotonic()
    dom.create()
    request.node.user_properties.append(("start_seconds", round(time.monotonic() - t, 1)))
    return t


def test_q35_vstor_puts_each_disk_on_its_cell_and_hot_plugs_into_the_spare(cells_env, libvirt_conn,
                                                                           guest_image, request):
    name = "e2e-cells-q35"
    cold = dict(COLD)
    paths, labels = labelled(name, [*cold, "vde"])
    extra = backing(f"{name}-vdf")
    seed = 1 + int.from_bytes(uuid.uuid4().bytes[:3], "big")
    try:
        # The guest waits for its three disks (vda..vdc), then for the one
        # vstor attaches (vdd); then it reports and writes through all four.
        said = define(cells_env, name, annotated(name, guest_image, "q35", paths, job(
            "write-verify", "vda,vdb,vdc,vdd", seed, SIZE, timeout=180, topology=True)), libvirt_conn)
        assert "guest cells 0 on node 0, 1 on node 0" in said, said
        dom = libvirt_conn.lookupByName(name)
        inactive = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert plan_cells(inactive) == cold
        # Each disk on a root port of its cell's expander bus, the last port
        # of each cell free; the devices without an address on libvirt's own ports.
        layout = pci_layout(inactive)
        assert layout == {"cells": {0: [["vdc"], []], 1: [["vdb"], ["vdd"], []]},
                          "elsewhere": ELSEWHERE_Q35}, layout
        applied_again(cells_env, name, libvirt_conn, inactive)
        shown = vstor(cells_env, "plan", name)
        assert "NUMA cells 0 on node 0, 1 on node 0" in shown and "CELL" in shown, shown

        t0 = started(dom, request)
        assert pci_layout(dom.XMLDesc(0)) == layout      # the running domain as defined
        console = WORK / f"{name}.console"
        wait_for_marker(console, "READY dev=vdc", dom, timeout=120)
        request.node.user_properties.append(("boot_seconds", round(time.monotonic() - t0, 1)))

        # The hook made a qemu-storage-daemon per disk, whatever its cell.
        status = json.loads(vstor(cells_env, "status", "--json", name))
        assert status[0]["status"] == "prepared" and all(s["problem"] is None for s in status[0]["steps"])
        assert sorted(status[0]["holding"]["sockets"]) == [f"{WORK}/vhost/{name}-{t}" for t in sorted(cold)]

        # --persistent: the definition gets the disk where the running domain has it.
        said = vstor(cells_env, "attach", "--persistent", name, write(name, "vde", 1, paths["vde"]))
        assert "attached vde" in said, said
        for xml in (dom.XMLDesc(0), dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)):
            assert pci_layout(xml)["cells"] == {0: [["vdc"], []], 1: [["vdb"], ["vdd"], ["vde"]]}, xml
            assert plan_cells(xml) == {**cold, "vde": 1}

        # Cell 1's spare is taken: a second disk there is refused, nothing changes.
        live, held = (dom.XMLDesc(0), dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)), record(name)
        qsds = daemons(name)
        out = vstor_out(cells_env, "attach", "--persistent", name, write(name, "vdf", 1, extra))
        assert out.returncode == 3 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "no free PCI port" in out.stderr, out.stderr
        assert "guest cell 1" in out.stderr, out.stderr
        assert (dom.XMLDesc(0), dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == live
        assert record(name) == held and daemons(name) == qsds
        assert not (WORK / "vhost" / f"{name}-vdf").exists()

        parsed = wait_for_marker(console, "DONE", dom, timeout=180)
        elapsed = time.monotonic() - t0
        request.node.user_properties.append(("start_to_done_seconds", round(elapsed, 1)))
        check_guest(parsed, labels, {**cold, "vde": 1}, paths, seed)
        print(f"q35: start to DONE {elapsed:.1f}s, disks {parsed['disks']}, nodes {parsed['nodes']}")
        stop(dom)
        nothing_left(name)

        # Stopped, `vstor apply` places the added disk as a cold one of cell 1,
        # with a new spare behind it; the guest boots with all four on their cells.
        vstor(cells_env, "apply", name)
        inactive = libvirt_conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert pci_layout(inactive) == {"cells": {0: [["vdc"], []], 1: [["vdb"], ["vdd"], ["vde"], []]},
                                        "elsewhere": ELSEWHERE_Q35}
        console.write_text("")      # QEMU appends to it
        dom = libvirt_conn.lookupByName(name)
        t0 = time.monotonic()
        dom.create()
        parsed = wait_for_marker(console, "DONE", dom, timeout=120)
        request.node.user_properties.append(("second_start_to_done_seconds", round(time.monotonic() - t0, 1)))
        check_guest(parsed, labels, {**cold, "vde": 1}, paths, seed)
        stop(dom)
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def test_i440fx_vstor_puts_each_disk_on_its_cell(cells_env, libvirt_conn, guest_image, request):
    name = "e2e-cells-pc"
    cold = dict(COLD)
    paths, labels = labelled(name, cold)
    seed = 1 + int.from_bytes(uuid.uuid4().bytes[:3], "big")
    try:
        said = define(cells_env, name, annotated(name, guest_image, "pc", paths, job(
            "write-verify", "vda,vdb,vdc", seed, SIZE, hold=HOLD, topology=True)), libvirt_conn)
        assert "guest cells 0 on node 0, 1 on node 0" in said, said
        dom = libvirt_conn.lookupByName(name)
        inactive = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert plan_cells(inactive) == cold
        layout = pci_layout(inactive)
        assert layout == {"cells": {0: ["vdc"], 1: ["vdb", "vdd"]},
                          "elsewhere": ELSEWHERE}, layout
        applied_again(cells_env, name, libvirt_conn, inactive)

        t0 = started(dom, request)
        console = WORK / f"{name}.console"
        wait_for_marker(console, "HOLD", dom, timeout=120)
        # No hot-plug behind an i440fx expander bus (QEMU: "Bus ... does not
        # support hotplugging"): refused before anything is made.
        live, held, qsds = dom.XMLDesc(0), record(name), daemons(name)
        out = vstor_out(cells_env, "attach", name, write(name, "vde", 1, backing(f"{name}-vde")))
        assert dom.isActive(), "the guest's hold ended before the refusal: raise HOLD"
        assert out.returncode == 3 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "i440fx" in out.stderr, out.stderr
        assert dom.XMLDesc(0) == live and record(name) == held and daemons(name) == qsds

        parsed = wait_for_marker(console, "DONE", dom, timeout=120)
        elapsed = time.monotonic() - t0
        request.node.user_properties.append(("start_to_done_seconds", round(elapsed, 1)))
        check_guest(parsed, labels, cold, paths, seed)
        print(f"pc: start to DONE {elapsed:.1f}s, disks {parsed['disks']}, nodes {parsed['nodes']}")
        stop(dom)
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def write(name: str, target: str, cell: int, path: str) -> str:
    out = WORK / f"{name}-{target}.xml"
    out.write_text(disk_intent(target, cell, path) + "\n")
    return str(out)


def record(name: str) -> str:
    return (WORK / "state" / "domains" / f"{name}.json").read_text()
