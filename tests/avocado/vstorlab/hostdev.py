"""The host's devices as the lab names them: present or the case is cancelled
with the reason; read back where the host can reach the guest's bytes."""
from __future__ import annotations

import configparser
import json
import os
import socket
import subprocess
import time
from pathlib import Path

from avocado.core.exceptions import TestCancel, TestError, TestFail

from .lab import Lab


def host_model(lab: Lab) -> dict:
    return lab.vstor.json("host", "show")


def nvme_controller(lab: Lab, address: str) -> dict:
    """The controller as `vstor host show` sees it; cancelled if absent."""
    if not Path("/sys/bus/pci/devices", address).exists():
        raise TestCancel(f"no PCI device {address} on this host (vstor_nvme_controller)")
    for ctrl in host_model(lab)["controllers"]:
        if ctrl["address"] == address:
            return ctrl
    raise TestCancel(f"{address} is not an NVMe controller vstor can see on this host")


def rdma_nic(lab: Lab, name: str) -> dict:
    nics = host_model(lab)["rdma_nics"]
    for nic in nics:
        if nic["name"] == name:
            return nic
    have = ", ".join(n["name"] for n in nics) or "none"
    raise TestCancel(f"no RDMA NIC {name} on this host (vstor_rdma_nic; the host has: {have})")


def spdk_socket(lab: Lab) -> str:
    """SPDK's RPC socket from vstor's config; cancelled when no SPDK answers there."""
    parser = configparser.ConfigParser()
    if lab.config:
        parser.read(lab.config)
    path = parser.get("spdk", "rpc_socket", fallback="/var/tmp/spdk.sock")
    try:
        spdk_call(path, "spdk_get_version")
    except OSError as e:
        raise TestCancel(f"no SPDK answers on {path} ([spdk] rpc_socket): {e.strerror or e}") from None
    return path


def spdk_call(path: str, method: str, params: dict | None = None, timeout: float = 10):
    """One JSON-RPC request to SPDK (its own answer, not vstor's client)."""
    request = {"jsonrpc": "2.0", "id": 1, "method": method, **({"params": params} if params else {})}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(request).encode())
        buf = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise TestFail(f"SPDK closed the connection during {method}")
            buf += chunk
            try:
                answer = json.loads(buf)
                break
            except ValueError:
                continue
    if "error" in answer:
        raise TestFail(f"SPDK {method}: {answer['error'].get('message')}")
    return answer["result"]


def namespace_device(lab: Lab, address: str, nsid: int, timeout: float = 30) -> Path:
    """/dev/nvmeXnY of the controller's namespace once the kernel's nvme driver
    has it (after vstor gave the controller back)."""
    deadline = time.monotonic() + timeout
    while True:
        for ctrl in host_model(lab)["controllers"]:
            if ctrl["address"] == address and ctrl["driver"] == "nvme":
                for ns in ctrl["namespaces"]:
                    if ns["nsid"] == nsid and Path("/dev", ns["name"]).exists():
                        return Path("/dev", ns["name"])
        if time.monotonic() > deadline:
            raise TestFail(f"namespace {nsid} of {address} is not back on the kernel's nvme "
                           f"driver {timeout:.0f}s after the domain stopped")
        time.sleep(1)


def holds_pattern(path: Path, expected: bytes) -> None:
    """The first bytes of a file or block device are exactly `expected`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.pread(fd, len(expected), 0)
    finally:
        os.close(fd)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))
        raise TestFail(f"{path} does not hold what the guest wrote: first difference at byte {at}")


def namespace_holds(test, lab: Lab, address: str, nsid: int, before: str, expected: bytes) -> None:
    """After the stop: the namespace's bytes are the guest's, when the host's
    nvme driver had the controller before (otherwise only the guest's
    read-back was checked, and the log says so)."""
    if before == "nvme":
        holds_pattern(namespace_device(lab, address, nsid), expected)
    else:
        test.log.warning("%s was on '%s' before the test: the host cannot read the "
                         "namespace back, only the guest's read-back was checked", address, before)


def storage_daemon(socket_path: str) -> int:
    """The qemu-storage-daemon serving this vhost-user socket: vstor hands
    the daemon its listening socket as a descriptor, so the name is read
    from the kernel (/proc/net/unix of the namespace vstor bound it in, this
    one, matched by the inode of each descriptor the daemon holds; a
    confined daemon's own namespace has none), not from its command line."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "comm").read_text().startswith("qemu-storage-d"):
                continue
            bound = {}
            for table in (Path("/proc/self/net/unix"), proc / "net" / "unix"):
                with open(table) as f:
                    next(f, None)
                    for line in f:
                        fields = line.split(None, 7)
                        if len(fields) == 8:
                            bound[fields[6]] = fields[7].rstrip("\n")
            inodes = set()
            for fd in (proc / "fd").iterdir():
                try:
                    inodes.add(str(os.stat(fd).st_ino))
                except OSError:
                    pass
        except OSError:
            continue
        if any(bound.get(i) == socket_path for i in inodes):
            return int(proc.name)
    raise TestFail(f"no qemu-storage-daemon serves {socket_path}")


def run_shell(command: str, what: str) -> None:
    """A lab's own command (a path down, a path up); its failure is the lab's error."""
    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise TestError(f"{what} ({command}) failed with exit {out.returncode}: "
                        f"{(out.stderr or out.stdout).strip()[-300:]}")


def wait_gone(pid: int, socket_path: str, what: str, timeout: float = 15) -> None:
    """The daemon has exited (a zombie counts as gone) and its socket is removed."""
    deadline = time.monotonic() + timeout
    while _alive(pid) or Path(socket_path).exists():
        if time.monotonic() > deadline:
            raise TestFail(f"{what}, but its qemu-storage-daemon {pid} or socket {socket_path} "
                           f"is still there after {timeout:.0f}s")
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
