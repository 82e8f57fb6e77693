"""vstor guest-kit end to end: a guest='spdk' domain planned on the test host
layout is rendered by vstor and defined in the real libvirtd, which gives its
hostdev a PCI address; the tiny guest then boots as a q35 domain with an
intel-iommu and, exactly where libvirt put that hostdev, QEMU's emulated NVMe
controller; the kit's script runs in it, and the controller must end on
vfio-pci in a real IOMMU group with the hugepages raised."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lxml import etree

from tests.hostlayout import build_tree
from tests.hostlayout.model import load_layout

from .guest import domain_xml, script_disk, script_job, script_output
from .helpers import cleanup as undefine
from .libvirtd import read_console, wait_shutoff

ROOT = Path(__file__).resolve().parents[2]
WORK = Path("/run/vstor-e2e-guestkit")
NAME = "e2e-guestkit"
NS = "https://vstor.dev/xmlns/domain/1"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
CONTROLLER = "0000:5e:00.0"         # on node 1 of tests/hosts/two-socket.toml
QEMU_NVME = ("0x1b36", "0x0010")    # QEMU's emulated NVMe controller


@pytest.fixture(scope="module")
def work(libvirt_daemons):
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    WORK.chmod(0o755)
    (WORK / "vstor.conf").write_text(f"[paths]\nstate_dir = {WORK}/state\n")
    yield WORK
    shutil.rmtree(WORK, ignore_errors=True)


def host_tree(ids: tuple[str, str] | None) -> str:
    """tests/hosts/two-socket.toml built, its 0000:5e:00.0 given `ids`
    (vendor, device) when asked: the host whose controller the guest gets."""
    layout = load_layout(ROOT / "tests" / "hosts" / "two-socket.toml")
    name = "two-socket"
    if ids:
        (ctrl,) = [c for c in layout["nvme"] if c["address"] == CONTROLLER]
        ctrl["vendor"], ctrl["device"] = ids
        name += "-qemu-nvme"
    out = WORK / name
    if not out.exists():
        build_tree(layout, out)
    return str(out)


def vstor(*args) -> str:
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(WORK / "vstor.conf"),
                          *args], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


# The operator's PCI topology: a switch behind the root port in slot 4, and
# the job disk on the root port in slot 3, which the guest's firmware numbers
# first.  libvirt puts the hostdev on the free switch port, libvirt's bus 3,
# which the guest numbers 4: a kit that took libvirt's bus for the guest's
# would miss it, and the path has three bridges to follow.
TOPOLOGY = """
<controller type='pci' index='0' model='pcie-root'/>
<controller type='pci' index='1' model='pcie-root-port'><address type='pci' domain='0x0000' bus='0x00' slot='0x04' function='0x0'/></controller>
<controller type='pci' index='2' model='pcie-switch-upstream-port'><address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></controller>
<controller type='pci' index='3' model='pcie-switch-downstream-port'><address type='pci' domain='0x0000' bus='0x02' slot='0x00' function='0x0'/></controller>
<controller type='pci' index='4' model='pcie-root-port'><address type='pci' domain='0x0000' bus='0x00' slot='0x03' function='0x0'/></controller>
<disk type='file' device='disk'><driver name='qemu' type='raw'/><source file='@WORK@/job.img'/>
  <target dev='vda' bus='virtio'/><address type='pci' domain='0x0000' bus='0x04' slot='0x00' function='0x0'/></disk>
"""


def annotated(guest) -> str:
    """The tiny guest as a q35 domain, its job disk vda, and one vstor disk:
    the controller passed through for SPDK in the guest."""
    xml = domain_xml(NAME, guest, "intel_iommu=on " + script_job("vda", timeout=240),
                     TOPOLOGY.replace("@WORK@", str(WORK)), memory_mib=512, vcpus=2,
                     memory_backing=None, machine="q35", console_log=WORK / "console.log")
    root = etree.fromstring(xml)
    meta = etree.fromstring(
        f"<metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:disk target='vdb' mode='passthrough' "
        f"guest='spdk'><vstor:nvme controller='{CONTROLLER}'/></vstor:disk></vstor:vstor></metadata>")
    root.find("name").addnext(meta)
    return etree.tostring(root, encoding="unicode")


def bootable(defined: str, bus: str) -> str:
    """The domain as libvirt defined it (controllers and addresses kept),
    bootable here: no vstor metadata (the hook must not take it) and so no
    prepared mark for QEMU to read (vstor's fw_cfg entry), no pinning
    or numatune for a host that is not this one, and QEMU's NVMe controller
    on root port `bus` (libvirt's alias of the controller) where the hostdev was."""
    old = etree.fromstring(defined)
    root = etree.Element("domain", old.attrib, nsmap={"qemu": QEMU_NS})
    root.extend(list(old))
    for tag in ("metadata", "sysinfo[@type='fwcfg']", "cputune", "numatune", "devices/hostdev"):
        for e in root.findall(tag):
            e.getparent().remove(e)
    nvme = WORK / "nvme.img"
    with open(nvme, "wb") as f:
        f.truncate(16 << 20)
    qemu = pwd.getpwnam("libvirt-qemu")   # libvirt labels its own disks, not this one
    os.chown(nvme, qemu.pw_uid, qemu.pw_gid)
    # JSON, like libvirt's own -device: QEMU creates every key=value -device
    # before any JSON one, so the root port would not exist yet.
    device = json.dumps({"driver": "nvme", "serial": "vstor-gk", "drive": "nvm", "bus": bus,
                         "addr": "0x0"})
    cmd = etree.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for arg in ("-drive", f"file={nvme},if=none,id=nvm,format=raw", "-device", device):
        etree.SubElement(cmd, f"{{{QEMU_NS}}}arg", value=arg)
    return etree.tostring(root, encoding="unicode")


def noiommu_kit(defined: str, tree: str) -> str:
    """The same domain without a vIOMMU (its disk guest='kernel'): the kit's
    no-IOMMU mode, which Debian's guest kernel does not have."""
    from vstor.records import replace

    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    from vstor.meta import metadata
    from vstor.meta.document import Domain
    from vstor.render import guestkit, guestscript
    dom = Domain.parse(defined)
    for e in dom.root.findall("devices/iommu"):
        e.getparent().remove(e)
    plan = dom.recorded_plan()
    metadata.store(dom.root, replace(plan, viommu=False,
                                     disks=tuple(replace(d, guest="kernel") for d in plan.disks)))
    kit = guestkit.build(dom, read_host(SysFS(tree)))
    assert kit.noiommu
    return guestscript.script(kit)


def job(kits: dict[str, str]) -> str:
    """The guest's job: each kit written out and run in order, the NVMe
    controllers' drivers and the hugepage pool shown in between."""
    out = ["show() {",
           "  for d in /sys/bus/pci/devices/*; do",
           "    [ \"$(cat $d/class)\" = 0x010802 ] || continue",
           "    echo \"NVME ${d##*/} driver=$(basename \"$(readlink $d/driver)\")"
           " group=$(basename \"$(readlink $d/iommu_group)\")\"",
           "  done",
           "  echo \"HUGEPAGES $(cat /sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages)\"",
           "}",
           "show"]
    for name, text in kits.items():
        out += [f"cat > /tmp/{name}.sh <<'VSTOR_KIT_END'", text.rstrip("\n"), "VSTOR_KIT_END",
                f"sh /tmp/{name}.sh; echo \"KIT {name} rc=$?\"", "show"]
    out.append("ls /dev/vfio | sed 's/^/VFIO /'")
    return "\n".join(out) + "\n"


def cleanup(conn, name: str = NAME) -> None:
    undefine(conn, name)


def test_the_kit_puts_the_controller_on_vfio_pci_inside_the_guest(work, libvirt_conn, guest_image):
    cleanup(libvirt_conn)
    try:
        # vstor renders the domain as planned on the test host; libvirt addresses it.
        qemu_host = host_tree(QEMU_NVME)
        (work / "annotated.xml").write_text(annotated(guest_image))
        vstor("--host-root", qemu_host, "render", str(work / "annotated.xml"), "-o", str(work / "rendered.xml"))
        libvirt_conn.defineXML((work / "rendered.xml").read_text())
        defined = libvirt_conn.lookupByName(NAME).XMLDesc(0)
        tree = etree.fromstring(defined)
        (hostdev,) = tree.iterfind("devices/hostdev")
        at = hostdev.find("address")
        assert (at.get("type"), at.get("bus"), at.get("slot")) == ("pci", "0x03", "0x00"), defined
        bus = 3                                                   # the switch's downstream port

        # The kit, from the defined domain through libvirt.
        data = json.loads(vstor("-c", "qemu:///system", "--host-root", qemu_host, "guest-kit", NAME, "--json"))
        (ctrl,) = data["controllers"]
        assert ctrl["pci_path"] == "0000:00:04.0/00.0/00.0/00.0" and ctrl["guest_address"] is None
        assert ctrl["behind"] == ["pcie-switch-downstream-port pci.3",
                                  "pcie-switch-upstream-port pci.2", "pcie-root-port pci.1"]
        assert (ctrl["vendor"], ctrl["device"]) == QEMU_NVME
        assert ctrl["core_mask"] == "0x2" and data["hugepages"] == 64 and data["hugemem_mb"] == 128
        assert data["noiommu"] is False
        kit = vstor("-c", "qemu:///system", "--host-root", qemu_host, "guest-kit", NAME)
        assert kit == data["script"]
        cloud = yaml.safe_load(vstor("-c", "qemu:///system", "--host-root", qemu_host, "guest-kit", NAME,
                                     "--cloud-init"))
        assert cloud["write_files"][0]["content"] == kit
        # The host layout as it is (an Intel controller there): the kit refuses QEMU's.
        wrong = vstor("-c", "qemu:///system", "--host-root", host_tree(None), "guest-kit", NAME)
        assert "0x8086:0x0a54" in wrong

        kits = {"noiommu": noiommu_kit(defined, qemu_host), "wrong": wrong, "kit": kit, "again": kit}
        script_disk(work / "job.img", job(kits))
        libvirt_conn.lookupByName(NAME).undefine()
        dom = libvirt_conn.defineXML(bootable(defined, f"pci.{bus}"))
        dom.create()
        try:
            wait_shutoff(dom, timeout=300)
        except TimeoutError as e:
            pytest.fail(f"{e}; console:\n{read_console(work / 'console.log')[-3000:]}")
        console = read_console(work / "console.log")
        lines, rc = script_output(console)
        assert rc == 0, console[-3000:]
        said = "\n".join(lines)

        before, *after = said.split("KIT ")
        (nvme_at,) = [w.split()[1] for w in before.splitlines() if w.startswith("NVME ")]
        assert f"NVME {nvme_at} driver=nvme" in before and "HUGEPAGES 0" in before
        assert nvme_at != f"0000:{bus:02x}:00.0"      # the guest's bus is not libvirt's index
        runs = {a.split()[0]: a for a in after}
        assert "rc=1" in runs["noiommu"].splitlines()[0], said
        assert "has no no-IOMMU mode" in said
        assert "rc=1" in runs["wrong"].splitlines()[0], said
        assert f"{nvme_at} is NVMe 0x1b36:0x0010, not 0x8086:0x0a54" in said
        assert f"NVME {nvme_at} driver=nvme" in runs["wrong"]    # refused: nothing changed

        assert "rc=0" in runs["kit"].splitlines()[0], said
        assert f"vdb: {nvme_at} on vfio-pci" in said
        assert f"PCI_ALLOWED='{nvme_at}' HUGEMEM=128 HUGENODE=0" in said
        shown = [w for w in runs["kit"].splitlines() if w.startswith("NVME ")]
        assert shown[0].startswith(f"NVME {nvme_at} driver=vfio-pci group=") and "HUGEPAGES 64" in runs["kit"]
        group = shown[0].rsplit("=", 1)[1]
        assert group.isdigit() and f"VFIO {group}" in said       # a real IOMMU group, its vfio device
        assert "rc=0" in runs["again"].splitlines()[0] and "is on vfio-pci already" in said
    finally:
        cleanup(libvirt_conn)


def test_libvirt_addresses_the_template_as_the_unit_tests_say(work, libvirt_conn, host_model):
    """tests/helpers.py adds (for tests/test_guestkit.py) the addresses libvirt
    gives the rendered passthrough-guest-spdk.xml; this libvirtd must give the same."""
    from tests.helpers import addressed, planned
    from vstor.meta.document import Domain
    from vstor.render import guestkit
    name = f"{NAME}-db1"
    host = host_model("two-socket")
    rendered = planned(host)
    rendered.root.find("name").text = name
    cleanup(libvirt_conn, name)
    try:
        libvirt_conn.defineXML(rendered.to_string())
        defined = Domain.parse(libvirt_conn.lookupByName(name).XMLDesc(0))
        kit = guestkit.build(defined, host)
        assert kit == guestkit.build(addressed(rendered), host)
        assert kit.controllers[0].pci_path == "0000:00:01.2/00.0"
    finally:
        cleanup(libvirt_conn, name)
