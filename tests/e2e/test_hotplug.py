"""Hot-plug end to end: a running TCG guest under the real libvirtd gets a
vstor disk (a real qemu-storage-daemon behind it), writes and reads it, and
sees it go again; the host then holds nothing for it.  A refused attach
changes neither the domain nor the host."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lxml import etree

from .guest import expected_pattern, job
from .helpers import (ROOT, SIZE, WORK, annotated, backing, cleanup, daemons, define, nothing_left, stop,
                      vstor, wait_for_marker)

NS = "https://vstor.dev/xmlns/domain/1"


def with_root_ports(xml: str, n: int = 2) -> str:
    """q35 hot-plugs PCIe devices into free root ports only."""
    root = etree.fromstring(xml)
    devices = root.find("devices")
    etree.SubElement(devices, "controller", type="pci", index="0", model="pcie-root")
    for _ in range(n):
        etree.SubElement(devices, "controller", type="pci", model="pcie-root-port")
    return etree.tostring(root, encoding="unicode")


def disk_file(name: str, target: str, path: str) -> str:
    out = WORK / f"{name}-{target}.xml"
    out.write_text(f"<vstor:disk xmlns:vstor='{NS}' target='{target}' backend='qsd'>"
                   f"<vstor:file path='{path}'/></vstor:disk>\n")
    return str(out)


def refused(conf, *args) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(conf), *args],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out


def record(name: str) -> dict:
    return json.loads((WORK / "state" / "domains" / f"{name}.json").read_text())


def test_a_disk_is_hot_plugged_written_read_and_unplugged(vstor_env, libvirt_conn, guest_image):
    name = "e2e-hot"
    first, added = backing(name), backing(f"{name}-2")
    try:
        # The guest waits for vda (its vstor disk from the start) and then for
        # vdb, which appears only when vstor attaches it; then it waits for vdb to go.
        xml = annotated(name, guest_image, first,
                        job("write-verify", "vda,vdb", 5151, SIZE, timeout=240, unplug="vdb"))
        define(vstor_env, with_root_ports(xml), name)
        dom = libvirt_conn.lookupByName(name)
        dom.create()
        console = WORK / f"{name}.console"
        wait_for_marker(console, "READY dev=vda", dom, timeout=180)
        assert daemons(name) == [f"{WORK}/qsd/{name}-vdb.pid"]

        # A refused attach (its source is the disk vdb already uses) changes nothing.
        live, held = dom.XMLDesc(0), record(name)
        out = refused(vstor_env, "attach", name, disk_file(name, "vdc", first))
        assert out.returncode == 3 and "vdc cannot be added" in out.stderr, out.stderr
        assert dom.XMLDesc(0) == live and record(name) == held
        assert daemons(name) == [f"{WORK}/qsd/{name}-vdb.pid"]

        said = vstor(vstor_env, "attach", name, disk_file(name, "vdc", added))
        assert said.strip().endswith(")") and "attached vdc" in said
        assert daemons(name) == sorted([f"{WORK}/qsd/{name}-vdb.pid", f"{WORK}/qsd/{name}-vdc.pid"])
        tree = etree.fromstring(dom.XMLDesc(0))
        sockets = [s.get("path") for s in tree.iterfind("devices/disk[@type='vhostuser']/source")]
        assert sockets == [f"{WORK}/vhost/{name}-vdb", f"{WORK}/vhost/{name}-vdc"]
        plan = tree.find(f"metadata/{{{NS}}}vstor/{{{NS}}}plan")
        assert [d.get("target") for d in plan.iter(f"{{{NS}}}disk")] == ["vdb", "vdc"]
        assert len(record(name)["holding"]["sockets"]) == 2

        parsed = wait_for_marker(console, "AWAIT-UNPLUG", dom, timeout=240)
        assert parsed["devices"]["vdb"]["wrote"] == parsed["devices"]["vdb"]["read"]
        with open(added, "rb") as f:      # the guest's vdb is vstor's vdc: its bytes, in its file
            assert f.read(SIZE) == expected_pattern(5151, SIZE)

        vstor(vstor_env, "detach", name, "vdc", "--timeout", "90")
        wait_for_marker(console, "GONE dev=vdb", dom, timeout=60)
        assert daemons(name) == [f"{WORK}/qsd/{name}-vdb.pid"]
        assert not (WORK / "vhost" / f"{name}-vdc").exists()
        assert [s for s in record(name)["holding"]["sockets"]] == [f"{WORK}/vhost/{name}-vdb"]
        tree = etree.fromstring(dom.XMLDesc(0))
        assert [t.get("dev") for t in tree.iterfind("devices/disk/target")] == ["vdb"]
        assert [d.get("target") for d in tree.iter(f"{{{NS}}}disk")
                if d.getparent().tag == f"{{{NS}}}vstor"] == ["vdb"]

        wait_for_marker(console, "DONE", dom, timeout=90)
        stop(dom)
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def test_attach_and_detach_refuse_a_domain_that_is_not_running(vstor_env, libvirt_conn, guest_image):
    name = "e2e-hot-off"
    try:
        define(vstor_env, annotated(name, guest_image, backing(name), job("read", "vda")), name)
        out = refused(vstor_env, "attach", name, disk_file(name, "vdc", backing(f"{name}-2")))
        assert out.returncode == 3 and "is not running" in out.stderr, out.stderr
        out = refused(vstor_env, "detach", name, "vdb")
        assert out.returncode == 3 and "is not running" in out.stderr, out.stderr
    finally:
        cleanup(libvirt_conn, name)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert not daemons("e2e-hot")
