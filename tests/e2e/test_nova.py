"""A Nova instance with a vstor disk, end to end, without the rest of
OpenStack: the guest config is built by Nova's own libvirt config classes
(nova 34.0.0, tests/nova/oracle.py) as Nova's driver would, with the
flavor's `vstor:disk.*` extra specs; vstor's driver step
(vstor.nova.guest.augment) adds the vhost-user-blk disk, shared memory and
its metadata; libvirt's schema (virt-xml-validate) accepts the domain; the
real libvirtd starts it with vstor's hook creating the qemu-storage-daemon;
the guest's pattern is read back through the disk and found in the file."""
from __future__ import annotations

import subprocess
import time

import libvirt

from tests.nova import ask

from .guest import expected_pattern, job, parse_console
from .libvirtd import read_console, wait_shutoff
from .test_hook import WORK, backing, cleanup, nothing_left, vstor, vstor_env  # noqa: F401

SIZE = 1 << 20
NAME = "instance-0000002a"


def test_a_nova_instance_writes_through_its_vstor_disk(vstor_env, libvirt_conn, guest_image):  # noqa: F811
    disk = backing(NAME)
    console = WORK / f"{NAME}.console"
    spec = {"name": NAME, "uuid": "9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f10", "vcpus": 1,
            "memory_kib": 256 * 1024, "machine": "q35", "acpi": True, "memballoon": False,
            "kernel": str(guest_image.kernel), "initrd": str(guest_image.initrd),
            "cmdline": f"console=ttyS0 panic=-1 quiet printk.devkmsg=on "
                       f"{job('write-verify', 'vda', 777, SIZE)}",
            "console": str(console), "flavor": "vstor.file",
            "extra_specs": {"vstor:disk.vdb.file.path": disk, "vstor:disk.vdb.project": "p1",
                            "hw:cpu_policy": "shared"}}
    got = ask({"augment": {"spec": spec, "config": str(vstor_env)}})["augmented"]
    assert "xml" in got, got
    xml = got["xml"]
    path = WORK / f"{NAME}.xml"
    path.write_text(xml)
    valid = subprocess.run(["virt-xml-validate", str(path), "domain"], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    try:
        cleanup(libvirt_conn, NAME)
        dom = libvirt_conn.defineXML(xml)
        started = time.monotonic()
        dom.create()
        wait_shutoff(dom, timeout=240)
        log = read_console(console)
        result = parse_console(log)
        assert result["done"] and not result["fail"], log[-3000:]
        assert result["wrote"] == result["read"]
        with open(disk, "rb") as f:
            assert f.read(SIZE) == expected_pattern(777, SIZE)
        print(f"nova instance: start to shut off {time.monotonic() - started:.1f}s")
        nothing_left(NAME)                       # the hook released it
    finally:
        cleanup(libvirt_conn, NAME)


def test_a_nova_instance_whose_flavor_asks_for_vstor_disks_without_the_driver_is_refused(
        vstor_env, libvirt_conn, guest_image):  # noqa: F811
    """The stock driver: the flavor's vstor specs reach the domain's metadata,
    vstor's disks do not; the start fails with vstor's one line."""
    spec = {"name": NAME, "uuid": "9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f10", "vcpus": 1,
            "memory_kib": 256 * 1024, "machine": "q35", "kernel": str(guest_image.kernel),
            "initrd": str(guest_image.initrd), "cmdline": "console=ttyS0",
            "extra_specs": {"vstor:disk.vdb.file.path": str(WORK / "x.raw")}}
    xml = ask({"guest": spec})["xml"]
    try:
        cleanup(libvirt_conn, NAME)
        dom = libvirt_conn.defineXML(xml)
        try:
            dom.create()
            raise AssertionError("the start was not refused")
        except libvirt.libvirtError as e:
            assert "vstor:" in str(e) and "does not run vstor's driver" in str(e)
        assert not dom.isActive()
    finally:
        cleanup(libvirt_conn, NAME)
