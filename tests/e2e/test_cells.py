"""A guest with two NUMA cells and vhost-user-blk disks on both, each disk
behind a PCI expander bus of its cell (real libvirtd, QEMU under TCG and
qemu-storage-daemon): the guest kernel must see each disk's PCI device on
that disk's node and each node with its CPUs, and the data it writes through
every disk must land in its backing file; on q35 a disk hot-plugged onto a
spare root port of a cell lands on that cell too.

The host has one NUMA node: both cells are backed by host node 0 here; what
is checked is the guest's view.  The domain XML comes from cells_domain_xml()
alone."""
from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import libvirt
import pytest
from lxml import etree

from .guest import Guest, expected_pattern, job, label_disk, parse_console
from .libvirtd import read_console, wait_shutoff

SIZE = 1 << 20
CELL_MIB = 128
QEMU_USER = "libvirt-qemu"
# Two cells of one vCPU each; the disks on them out of order, so that
# neither the guest's probe order nor target names line up by accident, and
# two on one cell (two root ports behind one q35 expander bus).
CELLS = ((0,), (1,))
DISK_CELLS = (1, 0, 1)


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="vstor-e2e-cells-", dir="/tmp"))
    path.chmod(0o755)    # QEMU (libvirt-qemu) must reach the sockets
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def exports(workdir: Path):
    """export(i, label) -> (file, socket): a 64 MiB raw file carrying `label`
    after the job's region, served by its own qemu-storage-daemon."""
    pids = []

    def export(i: int, label: str) -> tuple[Path, Path]:
        disk, sock, pidfile = workdir / f"disk{i}.raw", workdir / f"vhost{i}.sock", workdir / f"qsd{i}.pid"
        with open(disk, "wb") as f:
            f.truncate(64 << 20)
        label_disk(disk, SIZE, label)
        qsd = subprocess.run([
            "qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=file0,filename={disk}",
            "--blockdev", "driver=raw,node-name=disk0,file=file0",
            "--export", f"type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,"
                        f"addr.path={sock},writable=on",
            "--pidfile", str(pidfile), "--daemonize",
        ], capture_output=True, text=True)
        assert qsd.returncode == 0, f"qemu-storage-daemon failed: {qsd.stderr}"
        pids.append(int(pidfile.read_text()))
        qemu = pwd.getpwnam(QEMU_USER)
        os.chown(sock, qemu.pw_uid, qemu.pw_gid)
        sock.chmod(0o660)
        return disk, sock

    yield export
    for pid in pids:
        _stop(pid)


def _stop(pid: int, timeout: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def vhost_disk_xml(sock: Path, dev: str, bus: int, slot: int) -> str:
    return f"""<disk type='vhostuser' device='disk'>
      <driver name='qemu' type='raw' queues='1'/>
      <source type='unix' path={quoteattr(str(sock))}><reconnect enabled='yes' timeout='10'/></source>
      <target dev='{dev}' bus='virtio'/>
      <address type='pci' bus='{bus}' slot='{slot}' function='0'/>
    </disk>"""


def cells_domain_xml(name: str, guest: Guest, cmdline_job: str, machine: str,
                     cells: tuple[tuple[int, ...], ...], disks: list[tuple[Path | None, int]],
                     console: Path) -> str:
    """A TCG domain with one guest cell per entry of `cells` (its vCPUs, all
    memory bound to host node 0) and a vhost-user-blk disk per (socket, cell)
    of `disks`, behind an expander bus of that cell: on q35 a
    pcie-expander-bus with a pcie-root-port per disk (socket None: the port
    alone, alias ua-vstor-portN, for a disk hot-plugged later), on pc a
    pci-expander-bus with the disks in its slots.  Controller indices follow
    pcie-root/pci-root (0) without gaps (libvirt fills a gap with controllers
    of its own), each parent before its children (QEMU: "Bus ... not found").
    Each expander bus gets a busNr with room for its own bus and one per root
    port behind it, from 255 down: libvirt 9.0 leaves only two bus numbers per
    expander bus, and a guest with two root ports behind one never gets past
    its firmware."""
    vcpus = sum(len(c) for c in cells)
    cell_xml = "".join(
        f"<cell id='{i}' cpus='{','.join(map(str, c))}' memory='{CELL_MIB}' unit='MiB' memAccess='shared'/>"
        for i, c in enumerate(cells))
    memnodes = "".join(f"<memnode cellid='{i}' mode='strict' nodeset='0'/>" for i in range(len(cells)))
    model = {"q35": "pcie-expander-bus", "pc": "pci-expander-bus"}[machine]
    controllers, disk_xml = [], []
    bus_of_cell, top = {}, 256
    for i in range(len(cells)):
        ports = sum(1 for _, cell in disks if cell == i) if machine == "q35" else 1
        top -= 1 + ports
        bus_of_cell[i] = index = len(controllers) + 1
        controllers.append(f"<controller type='pci' index='{index}' model='{model}'>"
                           f"<alias name='ua-vstor-cell{i}'/>"
                           f"<target busNr='{top}'><node>{i}</node></target></controller>")
    for n, (sock, cell) in enumerate(disks):
        # The n-th disk of its cell: that slot of the cell's bus, or of its root port.
        bus, slot = bus_of_cell[cell], sum(1 for _, c in disks[:n] if c == cell)
        if machine == "q35":
            controllers.append(f"<controller type='pci' index='{len(controllers) + 1}' model='pcie-root-port'>"
                               f"<alias name='ua-vstor-port{n}'/>"
                               f"<address type='pci' bus='{bus}' slot='{slot}' function='0'/></controller>")
            bus, slot = len(controllers), 0
        if sock is not None:
            disk_xml.append(vhost_disk_xml(sock, f"vd{chr(ord('a') + n)}", bus, slot))
    cmdline = f"console=ttyS0 panic=-1 quiet printk.devkmsg=on {cmdline_job}"
    return f"""<domain type='qemu'>
  <name>{escape(name)}</name>
  <memory unit='MiB'>{CELL_MIB * len(cells)}</memory>
  <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>
  <vcpu>{vcpus}</vcpu>
  <numatune><memory mode='strict' nodeset='0'/>{memnodes}</numatune>
  <os>
    <type arch='x86_64' machine='{machine}'>hvm</type>
    <kernel>{escape(str(guest.kernel))}</kernel>
    <initrd>{escape(str(guest.initrd))}</initrd>
    <cmdline>{escape(cmdline)}</cmdline>
  </os>
  <features><acpi/></features>
  <cpu><topology sockets='{len(cells)}' dies='1' cores='{vcpus // len(cells)}' threads='1'/>
    <numa>{cell_xml}</numa></cpu>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <console type='file'><source path={quoteattr(str(console))}/><target type='serial'/></console>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
    {"".join(controllers)}
    {"".join(disk_xml)}
  </devices>
</domain>
"""


@pytest.fixture
def domain(libvirt_conn):
    """Defines domains from XML; destroys and undefines them afterwards."""
    defined = []

    def define(xml: str):
        dom = libvirt_conn.defineXML(xml)
        defined.append(dom.name())
        return dom

    yield define
    for name in defined:
        dom = libvirt_conn.lookupByName(name)
        if dom.isActive():
            dom.destroy()
        dom.undefine()


def labelled_exports(exports, cells: tuple[int, ...]) -> tuple[list[str], list[Path], list[Path]]:
    """One export per entry of `cells` (the cell its disk goes to): labels, files, sockets."""
    tag = uuid.uuid4().hex[:8]
    labels = [f"disk{n}-cell{cell}-{tag}" for n, cell in enumerate(cells)]
    files, socks = zip(*(exports(n, label) for n, label in enumerate(labels)))
    return labels, list(files), list(socks)


def check_guest(log: str, labels: list[str], disk_cells: tuple[int, ...], files: list[Path],
                seed: int) -> dict:
    """The topology job's report and the backing files, judged: each label
    (each backing file) seen through a PCI device on its disk's cell, each
    cell with its CPUs, the pattern written and read through every disk and
    found in every file."""
    result = parse_console(log)
    assert result["done"] and not result["fail"], log[-3000:]
    # Guests name disks in probe order: the label read through a device says
    # which backing file it is, the guest kernel's numa_node where it sits.
    seen = sorted((d["label"], d["numa_node"]) for d in result["disks"].values())
    assert seen == sorted(zip(labels, disk_cells)), result["disks"]
    assert result["nodes"] == {i: set(cpus) for i, cpus in enumerate(CELLS)}
    want = hashlib.sha256(expected_pattern(seed, SIZE)).hexdigest()
    assert {dev: (io.get("wrote"), io.get("read")) for dev, io in result["devices"].items()} \
        == {dev: (want, want) for dev in result["disks"]}
    for disk, label in zip(files, labels):
        with open(disk, "rb") as f:
            assert f.read(SIZE) == expected_pattern(seed, SIZE), f"{disk} lacks the guest's data"
            assert f.read(512).split(b"\n")[0] == label.encode(), f"{disk}: label block overwritten"
    return result


@pytest.mark.parametrize("machine", ["q35", "pc"])
def test_each_disk_is_on_its_cell_in_the_guest(machine, guest_image, exports, domain,
                                               workdir, request):
    labels, files, socks = labelled_exports(exports, DISK_CELLS)
    seed = int.from_bytes(os.urandom(3), "big")
    console = workdir / "console.log"
    devs = ",".join(f"vd{chr(ord('a') + n)}" for n in range(len(socks)))
    dom = domain(cells_domain_xml(f"vstor-cells-{machine}-{uuid.uuid4().hex[:8]}", guest_image,
                                  job("write-verify", dev=devs, seed=seed, size=SIZE, topology=True),
                                  machine, CELLS, list(zip(socks, DISK_CELLS)), console))

    started = time.monotonic()
    dom.create()
    wait_shutoff(dom, timeout=120)   # a guest whose firmware hangs on its buses never shuts off
    elapsed = time.monotonic() - started
    request.node.user_properties.append(("boot_and_io_seconds", round(elapsed, 1)))
    result = check_guest(read_console(console), labels, DISK_CELLS, files, seed)
    print(f"{machine}: start to shut off {elapsed:.1f}s, guest uptime {result['done_uptime']}s,"
          f" disks {result['disks']}, nodes {result['nodes']}")


def test_a_hotplugged_disk_lands_on_its_cell(guest_image, exports, domain, workdir, libvirt_conn):
    """q35 only: a pc expander bus takes no hot-plug ("Bus ... does not
    support hotplugging"), and PCI controllers cannot be hot-plugged, so the
    cell's root port is there from the start."""
    disk_cells = (0, 1)
    labels, files, socks = labelled_exports(exports, disk_cells)
    seed = int.from_bytes(os.urandom(3), "big")
    console = workdir / "console.log"
    dom = domain(cells_domain_xml(f"vstor-cells-plug-{uuid.uuid4().hex[:8]}", guest_image,
                                  job("write-verify", dev="vda,vdb", seed=seed, size=SIZE, topology=True),
                                  "q35", CELLS, [(socks[0], 0), (None, 1)], console))
    dom.create()
    deadline = time.monotonic() + 60
    while "READY dev=vda" not in read_console(console):   # booted, waiting for vdb
        assert time.monotonic() < deadline and dom.isActive(), read_console(console)[-3000:]
        time.sleep(0.2)
    (port,) = [c for c in etree.fromstring(dom.XMLDesc(0)).iterfind("devices/controller")
               if c.find("alias") is not None and c.find("alias").get("name") == "ua-vstor-port1"]
    dom.attachDeviceFlags(vhost_disk_xml(socks[1], "vdb", int(port.get("index")), 0),
                          libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_shutoff(dom, timeout=120)
    result = check_guest(read_console(console), labels, disk_cells, files, seed)
    print(f"hot-plug: disks {result['disks']}")
