"""A Nova instance with a vstor disk, end to end, without the rest of
OpenStack: the guest config is built by Nova's own libvirt config classes
(nova 34.0.0, tests/nova/oracle.py) as Nova's driver would, with the
flavor's `vstor:disk.*` extra specs; vstor's driver step
(vstor.nova.guest.augment) adds the vhost-user-blk disk, shared memory and
its metadata; libvirt's schema (virt-xml-validate) accepts the domain; the
real libvirtd starts it with vstor's hook creating the qemu-storage-daemon;
the guest's pattern is read back through the disk and found in the file.
A readonly flavor disk starts too (libvirt refuses `<readonly/>` on a
vhostuser disk: the backend makes it read-only) and the guest's write is
refused."""
from __future__ import annotations

import hashlib
import subprocess
import time

import libvirt

from tests.nova import ask

from .guest import expected_pattern, job, parse_console, script_disk, script_job, script_output
from .libvirtd import read_console, wait_shutoff
from .helpers import WORK, backing, cleanup, nothing_left

SIZE = 1 << 20
NAME = "instance-0000002a"


def test_a_nova_instance_writes_through_its_vstor_disk(vstor_env, libvirt_conn, guest_image):
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


# The guest's side of a readonly disk: what its kernel was told (virtio-blk's
# read-only feature, which only the vhost-user backend can offer: libvirt
# passes nothing for it), and a write, plain and after the guest's own
# `blockdev --setrw`.
READONLY_SCRIPT = """echo "ro=$(cat /sys/block/vda/ro)"
attempt() { if dd if=/dev/zero of=/dev/vda bs=512 count=1 conv=fsync 2>/tmp/e; then echo "$1 WRITTEN";
        else echo "$1 REFUSED $(head -n 1 /tmp/e)"; fi; }
attempt plain
blockdev --setrw /dev/vda 2>/dev/null
attempt setrw
"""


def _qsd_argv(name: str) -> list[str]:
    """The command line of the qemu-storage-daemon vstor runs for `name`'s disk."""
    for pidfile in (WORK / "qsd").glob(f"{name}-*.pid"):
        try:
            with open(f"/proc/{int(pidfile.read_text())}/cmdline", "rb") as f:
                return f.read().decode().split("\0")
        except (OSError, ValueError):
            continue
    return []


def test_a_nova_instance_with_a_readonly_flavor_disk_starts_and_its_writes_are_refused(
        vstor_env, libvirt_conn, guest_image):
    disk = backing(NAME)
    script_disk(disk, READONLY_SCRIPT)
    with open(disk, "rb") as f:
        before = hashlib.sha256(f.read()).hexdigest()
    console = WORK / f"{NAME}.console"
    spec = {"name": NAME, "uuid": "9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f10", "vcpus": 1,
            "memory_kib": 256 * 1024, "machine": "q35", "acpi": True, "memballoon": False,
            "kernel": str(guest_image.kernel), "initrd": str(guest_image.initrd),
            "cmdline": f"console=ttyS0 panic=-1 quiet printk.devkmsg=on {script_job('vda')}",
            "console": str(console), "flavor": "vstor.readonly",
            # readonly: no project needed, the disk may be shared
            "extra_specs": {"vstor:disk.vdb.file.path": disk, "vstor:disk.vdb.readonly": "yes",
                            "hw:cpu_policy": "shared"}}
    got = ask({"augment": {"spec": spec, "config": str(vstor_env)}})["augmented"]
    assert "xml" in got, got
    assert "<readonly/>" not in got["xml"] and 'readonly="yes"' in got["xml"]
    try:
        cleanup(libvirt_conn, NAME)
        dom = libvirt_conn.defineXML(got["xml"])       # libvirt 9.0 refused the old <readonly/>
        dom.create()
        argv = _qsd_argv(NAME)
        wait_shutoff(dom, timeout=240)
        log = read_console(console)
        lines, rc = script_output(log)
        assert rc == 0 and not parse_console(log)["fail"], log[-3000:]
        assert lines[0] == "ro=1", lines                # the backend said read-only
        assert lines[1].startswith("plain REFUSED") and lines[2].startswith("setrw REFUSED"), lines
        export = next((a for a in argv if a.startswith("type=vhost-user-blk")), "")
        assert "writable=off" in export.split(","), argv
        with open(disk, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == before
        nothing_left(NAME)
    finally:
        cleanup(libvirt_conn, NAME)


def test_a_nova_instance_whose_flavor_asks_for_vstor_disks_without_the_driver_is_refused(
        vstor_env, libvirt_conn, guest_image):
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


# -- an SPDK NVMe-oF disk in Nova's hugepages (issue 31, item 1) ------------------------

GUEST_MIB = 256
SUBNQN = "nqn.2016-06.io.spdk:cnode1"


def _free_hugepages(mib: int):
    """Enough free 2 MiB pages for the guest; nr_hugepages as it was, after."""
    import pytest
    from pathlib import Path
    from .libvirtd import hugetlbfs_mounted
    if not hugetlbfs_mounted():
        pytest.fail("hugetlbfs is not mounted at /dev/hugepages (the libvirtd fixture mounts it)")
    pool = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
    total = int((pool / "nr_hugepages").read_text())
    need = mib // 2 - int((pool / "free_hugepages").read_text())
    if need > 0:
        (pool / "nr_hugepages").write_text(str(total + need))
    assert int((pool / "free_hugepages").read_text()) >= mib // 2, "the kernel gave no hugepages"
    return lambda: (pool / "nr_hugepages").write_text(str(total))


def test_a_nova_instance_with_an_spdk_nvmf_disk_in_novas_hugepages(vstor_env, libvirt_conn, guest_image):
    """Nova's own classes build the guest (hw:mem_page_size=2MB: 2 MiB pages,
    a NUMA cell on node 0); vstor's driver step adds the SPDK disk of an
    NVMe-oF TCP namespace; the real libvirtd starts it, vstor's hook making
    the NVMe-oF controller and the vhost-blk controller in the SPDK test
    double (checked against SPDK's schema; its controller is served by a
    real qemu-storage-daemon, so QEMU's vhost-user is real); the guest's
    pattern is read back from the namespace's backing file."""
    from tests.doubles.spdk import SpdkTargetDouble
    name = "instance-0000002b"
    conf_text = vstor_env.read_text()
    sock = WORK / "spdk.sock"
    spdk = SpdkTargetDouble(str(sock), str(WORK / "vhost"), backing_dir=str(WORK), cores=(0, 1))
    spdk.add_fabric("TCP", "127.0.0.1", "4420", SUBNQN, 1)
    vstor_env.write_text(conf_text.replace("reactors =\n", "reactors = 1\n")
                         + f"[spdk]\nrpc_socket = {sock}\n")
    give_back = _free_hugepages(GUEST_MIB)
    console = WORK / f"{name}.console"
    spec = {"name": name, "uuid": "9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f11", "vcpus": 1,
            "memory_kib": GUEST_MIB * 1024, "machine": "q35", "acpi": True, "memballoon": False,
            "page_kb": 2048, "numa_cell": True, "memory_nodes": [0],
            "kernel": str(guest_image.kernel), "initrd": str(guest_image.initrd),
            "cmdline": f"console=ttyS0 panic=-1 quiet printk.devkmsg=on "
                       f"{job('write-verify', 'vda', 778, SIZE)}",
            "console": str(console), "flavor": "vstor.spdk",
            "extra_specs": {"vstor:disk.vdb.nvmf.transport": "tcp", "vstor:disk.vdb.nvmf.traddr": "127.0.0.1",
                            "vstor:disk.vdb.nvmf.subnqn": SUBNQN, "vstor:disk.vdb.project": "p1",
                            "hw:mem_page_size": "2MB", "hw:cpu_policy": "shared"}}
    try:
        spdk.start()
        got = ask({"augment": {"spec": spec, "config": str(vstor_env)}})["augmented"]
        assert "xml" in got, got
        xml = got["xml"]
        assert 'hugepages="external"' in xml and '<page size="2048"' in xml
        path = WORK / f"{name}.xml"
        path.write_text(xml)
        valid = subprocess.run(["virt-xml-validate", str(path), "domain"], capture_output=True, text=True)
        assert valid.returncode == 0, valid.stdout + valid.stderr
        cleanup(libvirt_conn, name)
        dom = libvirt_conn.defineXML(xml)
        started = time.monotonic()
        dom.create()
        # The hook made them through SPDK's RPCs: the namespace attached over
        # TCP, its bdev served by a vhost-blk controller on reactor 1.
        attach = spdk.params_of("bdev_nvme_attach_controller")
        assert attach and attach[0]["trtype"].lower() == "tcp" and attach[0]["subnqn"] == SUBNQN
        created = spdk.params_of("vhost_create_blk_controller")
        assert len(created) == 1 and created[0]["ctrlr"] == f"{name}-vdb"
        assert int(created[0]["cpumask"], 16) == 1 << 1
        wait_shutoff(dom, timeout=240)
        log = read_console(console)
        result = parse_console(log)
        assert result["done"] and not result["fail"], log[-3000:]
        assert result["wrote"] == result["read"]
        with open(spdk.backing_file(created[0]["dev_name"]), "rb") as f:
            assert f.read(SIZE) == expected_pattern(778, SIZE)
        print(f"nova instance with an SPDK disk: start to shut off {time.monotonic() - started:.1f}s")
        nothing_left(name)                       # the hook released it
        assert f"{name}-vdb" not in spdk.vhost
    finally:
        cleanup(libvirt_conn, name)
        spdk.stop()
        give_back()
        vstor_env.write_text(conf_text)
