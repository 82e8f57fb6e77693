"""The e2e infrastructure on its own, without vstor: a real qemu-storage-daemon
serves a file as vhost-user-blk, libvirt boots the test guest on it, and the
guest's writes must land in the file."""
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

import pytest

from .conftest import unavailable
from .guest import domain_xml, expected_pattern, job, parse_console
from .libvirtd import hugetlbfs_mounted, read_console, wait_shutoff

SIZE = 1 << 20
GUEST_MIB = 256
QEMU_USER = "libvirt-qemu"


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="vstor-e2e-", dir="/tmp"))
    # QEMU runs as libvirt-qemu and must traverse to the socket (mkdtemp gives 0700).
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def vhost_disk(workdir: Path):
    """A fresh 64 MiB raw file exported by qemu-storage-daemon on a socket QEMU can use."""
    disk, sock, pidfile = workdir / "disk.raw", workdir / "vhost.sock", workdir / "qsd.pid"
    with open(disk, "wb") as f:
        f.truncate(64 << 20)
    qsd = subprocess.run([
        "qemu-storage-daemon",
        "--blockdev", f"driver=file,node-name=file0,filename={disk}",
        "--blockdev", "driver=raw,node-name=disk0,file=file0",
        "--export", f"type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,"
                    f"addr.path={sock},writable=on",
        "--pidfile", str(pidfile), "--daemonize",
    ], capture_output=True, text=True)
    assert qsd.returncode == 0, f"qemu-storage-daemon failed: {qsd.stderr}"
    pid = int(pidfile.read_text())
    try:
        # qsd runs as root and creates the socket root-owned: QEMU (libvirt-qemu)
        # would get "Permission denied", and with reconnect on, a start that hangs.
        qemu = pwd.getpwnam(QEMU_USER)
        os.chown(sock, qemu.pw_uid, qemu.pw_gid)
        sock.chmod(0o660)
        yield disk, sock
    finally:
        _stop(pid)


def _stop(pid: int, timeout: float = 10) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture
def hugepages():
    """Enough free 2 MiB pages for one guest; nr_hugepages restored afterwards."""
    if not hugetlbfs_mounted():
        unavailable("hugetlbfs is not mounted at /dev/hugepages (mount it before libvirtd starts)")
    pool = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
    total = int((pool / "nr_hugepages").read_text())
    need = GUEST_MIB // 2 - int((pool / "free_hugepages").read_text())
    if need > 0:
        (pool / "nr_hugepages").write_text(str(total + need))
        if int((pool / "free_hugepages").read_text()) < GUEST_MIB // 2:
            (pool / "nr_hugepages").write_text(str(total))
            unavailable(f"the kernel could not allocate {GUEST_MIB // 2} free 2 MiB hugepages")
    yield
    (pool / "nr_hugepages").write_text(str(total))


@pytest.fixture(params=["memfd", "hugepages"])
def backing(request) -> str:
    if request.param == "hugepages":
        request.getfixturevalue("hugepages")
    return request.param


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


def test_guest_writes_land_in_the_exported_file(backing, guest_image, domain, vhost_disk,
                                                  workdir, request):
    disk, sock = vhost_disk
    seed = int.from_bytes(os.urandom(3), "big")
    console = workdir / "console.log"
    disk_xml = f"""<disk type='vhostuser' device='disk'>
      <driver name='qemu' type='raw'/>
      <source type='unix' path='{sock}'><reconnect enabled='yes' timeout='10'/></source>
      <target dev='vda' bus='virtio'/>
    </disk>"""
    name = f"vstor-smoke-{backing}-{uuid.uuid4().hex[:8]}"
    dom = domain(domain_xml(name, guest_image, job("write-verify", seed=seed, size=SIZE),
                            disk_xml, memory_mib=GUEST_MIB, console_log=console,
                            memory_backing=backing))

    started = time.monotonic()
    dom.create()
    wait_shutoff(dom, timeout=240)
    elapsed = time.monotonic() - started

    log = read_console(console)
    result = parse_console(log)
    request.node.user_properties.append(("boot_and_io_seconds", round(elapsed, 1)))
    print(f"{backing}: start to shut off {elapsed:.1f}s, guest uptime {result['done_uptime']}s")
    assert result["done"] and not result["fail"], log[-3000:]
    want = hashlib.sha256(expected_pattern(seed, SIZE)).hexdigest()
    assert result["wrote"] == result["read"] == want
    with open(disk, "rb") as f:
        assert f.read(SIZE) == expected_pattern(seed, SIZE)
