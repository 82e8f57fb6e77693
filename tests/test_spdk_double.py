"""The SPDK target double itself: that it speaks SPDK's framing, refuses what
SPDK's schema refuses, and behaves as SPDK's handlers do where vstor relies
on it. Driven with SPDK's own JSONRPCClient and with raw sockets."""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from spdk.rpc.client import JSONRPCClient

from tests.helpers import SHARED, unavailable
from tests.doubles.spdk_target import (FACTS, QSD_BINARY, Fabric, SpdkTargetDouble, load_facts,
                                       spdk_target_double)  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = Path(SHARED) / "spdk" / "schema.yaml"
SUBNQN = "nqn.2016-06.io.spdk:cnode1"


@pytest.fixture
def spdk(spdk_target_double):
    spdk_target_double.add_pcie("0000:5e:00.0", namespaces=2)
    spdk_target_double.add_pcie("0000:86:00.0", namespaces=1)
    spdk_target_double.add_fabric("RDMA", "192.168.100.8", "4420", SUBNQN)
    spdk_target_double.add_fabric("RDMA", "192.168.100.9", "4420", SUBNQN)
    return spdk_target_double


def raw_exchange(path: str, payload: bytes, replies: int, timeout: float = 3.0) -> list:
    """Send bytes as they are; read back `replies` JSON values."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(payload)
        s.settimeout(timeout)
        buf, out, decoder = "", [], json.JSONDecoder()
        while len(out) < replies:
            buf += s.recv(65536).decode()
            while buf.strip():
                try:
                    value, end = decoder.raw_decode(buf.lstrip())
                except json.JSONDecodeError:
                    break
                out.append(value)
                buf = buf.lstrip()[end:]
        return out


def rpc(spdk, method, params=None):
    """One request through SPDK's client, answering (result, error)."""
    client = JSONRPCClient(spdk.socket_path, timeout=5)
    try:
        client.send(method, params)
        response = client.recv()
    finally:
        client.close()
    return response.get("result"), response.get("error")


def attach_pcie(spdk, name="nvme0", traddr="0000:5e:00.0"):
    result, error = rpc(spdk, "bdev_nvme_attach_controller",
                        {"name": name, "trtype": "PCIe", "traddr": traddr})
    assert error is None
    return result


def attach_rdma(spdk, traddr, **extra):
    return rpc(spdk, "bdev_nvme_attach_controller",
               {"name": "fab0", "trtype": "RDMA", "adrfam": "IPv4", "traddr": traddr,
                "trsvcid": "4420", "subnqn": SUBNQN, **extra})


# -- the contract: the schema facts -------------------------------------------------------

def test_every_method_the_double_answers_is_in_the_schema_facts(spdk):
    facts = load_facts()
    assert set(spdk.methods) <= set(facts)
    assert set(facts) <= set(spdk.methods)


def test_the_committed_facts_match_the_schema():
    if not SCHEMA.exists():
        unavailable(f"SPDK's schema.yaml is not at {SCHEMA} (../shared/spdk next to the checkout, where CI puts it)")
    pytest.importorskip("yaml")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-spdk-facts.py"),
                           "--schema", str(SCHEMA), "--out", str(FACTS), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("method, params, error", [
    ("bdev_nvme_attach_controller", {"name": "n", "trtype": "PCIe", "traddr": "0000:5e:00.0", "bogus": 1},
     (-32603, "spdk_json_decode_object failed")),
    ("bdev_nvme_attach_controller", {"name": "n", "trtype": "PCIe"},
     (-32603, "spdk_json_decode_object failed")),
    ("bdev_nvme_attach_controller", {"name": "n", "trtype": "RDMA", "traddr": "192.168.100.8",
                                     "trsvcid": 4420}, (-32603, "spdk_json_decode_object failed")),
    ("bdev_nvme_attach_controller", {"name": "n", "trtype": "RDMA", "traddr": "192.168.100.8",
                                     "multipath": "active_active"}, (-32603, "spdk_json_decode_object failed")),
    ("bdev_nvme_attach_controller", {"name": "n", "trtype": "RDMA", "traddr": "192.168.100.8",
                                     "reconnect_delay_sec": -1}, (-32603, "spdk_json_decode_object failed")),
    ("bdev_get_bdevs", {"name": 7}, (-32603, "spdk_json_decode_object failed")),
    ("vhost_create_blk_controller", {"ctrlr": "c"}, (-32602, "Invalid argument")),
    ("vhost_create_blk_controller", {"ctrlr": "c", "dev_name": "nvme0n1", "readonly": "yes"},
     (-32602, "Invalid argument")),
    ("vhost_delete_controller", None, (-32602, "Invalid argument")),
    ("vhost_get_controllers", {"ctrlr": "c"}, (-32603, "Invalid argument")),
    ("nvmf_subsystem_add_ns", {"nqn": SUBNQN, "namespace": {"nsid": 1}}, (-32602, "Invalid parameters")),
    ("nvmf_create_transport", {"trtype": "RDMA", "no_srq": 1}, (-32602, "Invalid parameters")),
    ("spdk_get_version", {"verbose": True}, (-32602, "spdk_get_version method requires no parameters")),
    ("framework_get_reactors", {"lcore": 0}, (-32602, "`framework_get_reactors` requires no arguments")),
])
def test_what_the_schema_refuses_is_refused_as_spdk_does(spdk, method, params, error):
    result, got = rpc(spdk, method, params)
    assert result is None
    assert (got["code"], got["message"]) == error
    assert spdk.why_rejected(method, params) is not None or method in (
        "spdk_get_version", "framework_get_reactors")
    assert spdk.nvme == {} and spdk.vhost == {}


def test_unknown_method(spdk):
    assert rpc(spdk, "construct_vhost_blk_controller", {"ctrlr": "c"}) == (
        None, {"code": -32601, "message": "Method not found"})


# -- framing ------------------------------------------------------------------------------

def test_requests_back_to_back_and_split_across_writes(spdk):
    one = json.dumps({"jsonrpc": "2.0", "method": "spdk_get_version", "id": 1}, indent=2)
    two = json.dumps({"jsonrpc": "2.0", "method": "bdev_get_bdevs", "id": 2})
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(spdk.socket_path)
        s.sendall((one + two[:10]).encode())
        time.sleep(0.1)
        s.sendall(two[10:].encode())
        s.settimeout(3)
        data = b""
        while data.count(b"\n") < 2:
            data += s.recv(65536)
    replies = [json.loads(line) for line in data.decode().splitlines()]
    assert [r["id"] for r in replies] == [1, 2]
    assert replies[0]["result"]["fields"]["major"] == 26 and replies[1]["result"] == []


def test_malformed_and_invalid_requests(spdk):
    (parse,) = raw_exchange(spdk.socket_path, b'{"jsonrpc": "2.0", "method": ]', 1)
    assert parse["error"]["code"] == -32700 and parse["id"] is None
    (invalid,) = raw_exchange(spdk.socket_path, b'{"method": "spdk_get_version", "id": 4}', 1)
    assert invalid == {"jsonrpc": "2.0", "id": 4, "error": {"code": -32600, "message": "Invalid request"}}


def test_a_notification_is_done_and_not_answered(spdk):
    note = {"jsonrpc": "2.0", "method": "bdev_nvme_attach_controller",
            "params": {"name": "nvme0", "trtype": "PCIe", "traddr": "0000:5e:00.0"}}
    ask = {"jsonrpc": "2.0", "method": "bdev_get_bdevs", "id": 9}
    (reply,) = raw_exchange(spdk.socket_path, (json.dumps(note) + json.dumps(ask)).encode(), 1)
    assert reply["id"] == 9 and [b["name"] for b in reply["result"]] == ["nvme0n1", "nvme0n2"]


def test_a_batch_is_answered_as_a_list(spdk):
    batch = [{"jsonrpc": "2.0", "method": "spdk_get_version", "id": 1},
             {"jsonrpc": "2.0", "method": "bdev_get_bdevs", "params": {"name": "x"}, "id": 2}]
    (replies,) = raw_exchange(spdk.socket_path, json.dumps(batch).encode(), 1)
    assert [r["id"] for r in replies] == [1, 2]
    assert replies[1]["error"] == {"code": -19, "message": "No such device"}


def test_every_request_is_recorded_as_sent(spdk):
    rpc(spdk, "spdk_get_version")
    rpc(spdk, "bdev_get_bdevs", {"name": "x", "timeout": 0})
    rpc(spdk, "no_such_method", {"a": [1]})
    assert spdk.requests == [
        {"method": "spdk_get_version", "params": None},
        {"method": "bdev_get_bdevs", "params": {"name": "x", "timeout": 0}},
        {"method": "no_such_method", "params": {"a": [1]}},
    ]


# -- bdev_nvme ------------------------------------------------------------------------------

def test_bdevs_are_named_after_controller_and_namespace(spdk):
    assert attach_pcie(spdk) == ["nvme0n1", "nvme0n2"]
    result, _ = rpc(spdk, "bdev_get_bdevs", {"name": "nvme0n2"})
    assert result[0]["name"] == "nvme0n2"
    assert result[0]["driver_specific"]["nvme"][0]["trid"]["traddr"] == "0000:5e:00.0"


@pytest.mark.parametrize("params, error", [
    ({"name": "nvme1", "trtype": "PCIe", "traddr": "0000:99:00.0"}, (-19, "No such device")),
    ({"name": "nvme1", "trtype": "RDMA", "traddr": "192.168.100.77", "trsvcid": "4420",
      "subnqn": SUBNQN}, (-5, "Input/output error")),
    ({"name": "nvme1", "trtype": "PCIe", "traddr": "0000:5E:00.0"}, (-17, "File exists")),
    ({"name": "nvme1", "trtype": "FC", "traddr": "x"}, (-22, "Failed to parse trtype: FC")),
    ({"name": "nvme1", "trtype": "RDMA", "traddr": "192.168.100.8", "adrfam": "ipv5"},
     (-22, "Failed to parse adrfam: ipv5")),
    ({"name": "nvme1", "trtype": "RDMA", "traddr": "192.168.100.8", "trsvcid": "4420",
      "subnqn": SUBNQN, "ctrlr_loss_timeout_sec": 10, "reconnect_delay_sec": 20},
     (-22, "Invalid argument")),
])
def test_attach_failures(spdk, params, error):
    attach_pcie(spdk)
    _, got = rpc(spdk, "bdev_nvme_attach_controller", params)
    assert (got["code"], got["message"]) == error
    assert list(spdk.nvme) == ["nvme0"]


def test_second_path_is_multipath_unless_told_otherwise(spdk):
    assert attach_rdma(spdk, "192.168.100.8") == (["fab0n1"], None)
    assert attach_rdma(spdk, "192.168.100.9") == (["fab0n1"], None)
    (ctrl,), _ = rpc(spdk, "bdev_nvme_get_controllers", {"name": "fab0"})
    assert len(ctrl["ctrlrs"]) == 2


def test_failover_path_is_an_alternate_trid_and_reports_no_bdevs(spdk):
    attach_rdma(spdk, "192.168.100.8")
    assert attach_rdma(spdk, "192.168.100.9", multipath="failover") == ([], None)
    (ctrl,), _ = rpc(spdk, "bdev_nvme_get_controllers", {"name": "fab0"})
    assert [c["trid"]["traddr"] for c in ctrl["ctrlrs"]] == ["192.168.100.8"]
    assert ctrl["ctrlrs"][0]["alternate_trids"][0]["traddr"] == "192.168.100.9"


@pytest.mark.parametrize("second, error", [
    ({"traddr": "192.168.100.9", "multipath": "disable"},
     (-114, "A controller named fab0 already exists and multipath is disabled")),
    ({"traddr": "192.168.100.8", "multipath": "multipath"},
     (-114, "A controller named fab0 already exists with the specified network path")),
    ({"traddr": "192.168.100.9", "hostnqn": "nqn.2014-08.org.nvmexpress:uuid:other"},
     (-22, "A controller named fab0 already exists, but uses a different hostnqn "
           "(nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000000)")),
])
def test_adding_a_path_is_refused_like_spdk(spdk, second, error):
    attach_rdma(spdk, "192.168.100.8")
    traddr = second.pop("traddr")
    _, got = attach_rdma(spdk, traddr, **second)
    assert (got["code"], got["message"]) == error


def test_detach_errors_and_unknown_controller_query(spdk):
    attach_pcie(spdk)
    _, got = rpc(spdk, "bdev_nvme_detach_controller", {"name": "nvme9"})
    assert (got["code"], got["message"]) == (-19, "No such device")
    _, got = rpc(spdk, "bdev_nvme_detach_controller", {"name": "nvme0", "traddr": "0000:86:00.0"})
    assert (got["code"], got["message"]) == (-6, "No such device or address")
    _, got = rpc(spdk, "bdev_nvme_get_controllers", {"name": "nvme9"})
    assert (got["code"], got["message"]) == (22, "Controller nvme9 does not exist")   # sic: positive
    _, got = rpc(spdk, "bdev_get_bdevs", {"name": "nvme9n1"})
    assert (got["code"], got["message"]) == (-19, "No such device")


def test_detaching_under_a_vhost_controller_hot_removes_its_bdev(spdk):
    attach_pcie(spdk)
    rpc(spdk, "vhost_create_blk_controller", {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"})
    assert rpc(spdk, "bdev_nvme_detach_controller", {"name": "nvme0"}) == (True, None)
    (vc,), _ = rpc(spdk, "vhost_get_controllers", {"name": "vm1-vdb"})
    assert vc["backend_specific"]["block"]["bdev"] is None


# -- vhost --------------------------------------------------------------------------------

def test_vhost_socket_is_real_and_owned_like_spdks(spdk):
    attach_pcie(spdk)
    assert rpc(spdk, "vhost_create_blk_controller",
               {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1", "cpumask": "[1]"}) == (True, None)
    st = os.stat(os.path.join(spdk.vhost_dir, "vm1-vdb"))
    assert oct(st.st_mode) == "0o140755" and st.st_uid == os.getuid()
    (vc,), _ = rpc(spdk, "vhost_get_controllers")
    assert vc["cpumask"] == "0x2"


@pytest.mark.parametrize("params, error", [
    ({"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"}, (-32602, "File exists")),
    ({"ctrlr": "vm2-vdb", "dev_name": "nvme5n1"}, (-32602, "No such device")),
    ({"ctrlr": "vm2-vdb", "dev_name": "nvme0n2", "cpumask": "0x4"}, (-32602, "Invalid argument")),
    ({"ctrlr": "vm2-vdb", "dev_name": "nvme0n2", "transport": "vfio_user_virtio_blk"},
     (-32602, "Invalid argument")),
])
def test_vhost_create_refusals(spdk, params, error):
    attach_pcie(spdk)
    rpc(spdk, "vhost_create_blk_controller", {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"})
    _, got = rpc(spdk, "vhost_create_blk_controller", params)
    assert (got["code"], got["message"]) == error
    assert list(spdk.vhost) == ["vm1-vdb"]


def test_vhost_errors_for_unknown_controllers(spdk):
    _, got = rpc(spdk, "vhost_delete_controller", {"ctrlr": "vm9-vdb"})
    assert (got["code"], got["message"]) == (-32602, "No such device")
    _, got = rpc(spdk, "vhost_get_controllers", {"name": "vm9-vdb"})
    assert (got["code"], got["message"]) == (-32603, "No such device")


def test_delete_refused_while_a_real_initiator_is_connected(spdk):
    attach_pcie(spdk)
    rpc(spdk, "vhost_create_blk_controller", {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"})
    path = os.path.join(spdk.vhost_dir, "vm1-vdb")
    qemu = socket.socket(socket.AF_UNIX)
    qemu.connect(path)
    try:
        _, got = rpc(spdk, "vhost_delete_controller", {"ctrlr": "vm1-vdb"})
        assert (got["code"], got["message"]) == (-32602, "Device or resource busy")
    finally:
        qemu.close()
    assert spdk.wait_disconnected("vm1-vdb")
    assert rpc(spdk, "vhost_delete_controller", {"ctrlr": "vm1-vdb"}) == (True, None)
    assert not os.path.exists(path)


def test_stop_leaves_no_socket_behind(spdk):
    attach_pcie(spdk)
    rpc(spdk, "vhost_create_blk_controller", {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"})
    spdk.stop()
    assert not os.path.exists(spdk.socket_path)
    assert os.listdir(spdk.vhost_dir) == []


# -- NVMe-oF target -------------------------------------------------------------------------

def test_nvmf_duplicates_and_unknown_subsystems(spdk):
    assert rpc(spdk, "nvmf_create_transport", {"trtype": "RDMA"}) == (True, None)
    _, got = rpc(spdk, "nvmf_create_transport", {"trtype": "rdma"})
    assert (got["code"], got["message"]) == (-32603, "Transport type 'rdma' already exists")
    nqn = "nqn.2024-01.dev.vstor:vm1"
    rpc(spdk, "nvmf_create_subsystem", {"nqn": nqn})
    _, got = rpc(spdk, "nvmf_create_subsystem", {"nqn": nqn})
    assert (got["code"], got["message"]) == (-32603, f"Unable to create subsystem {nqn}")
    _, got = rpc(spdk, "nvmf_delete_subsystem", {"nqn": "nqn.2024-01.dev.vstor:none"})
    assert got["code"] == -32602


# -- a real vhost-user-blk backend behind the socket ----------------------------------------

VHOST_USER_GET_FEATURES = 1
VIRTIO_F_VERSION_1 = 1 << 32


@pytest.mark.skipif(not os.access(QSD_BINARY, os.X_OK), reason="qemu-storage-daemon is not installed")
def test_qsd_backed_controller_speaks_vhost_user():
    workdir = tempfile.mkdtemp(prefix="spdk-double-")
    double = SpdkTargetDouble(os.path.join(workdir, "spdk.sock"), os.path.join(workdir, "vhost"),
                              backing_dir=workdir)
    double.add_pcie("0000:5e:00.0")
    try:
        double.start()
        attach_pcie(double)
        assert rpc(double, "vhost_create_blk_controller",
                   {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1"}) == (True, None)
        pid = double.vhost["vm1-vdb"].qsd_pid
        assert os.path.getsize(double.backing_file("nvme0n1")) == 1 << 30
        with socket.socket(socket.AF_UNIX) as qemu:
            qemu.connect(os.path.join(double.vhost_dir, "vm1-vdb"))
            qemu.sendall(struct.pack("<III", VHOST_USER_GET_FEATURES, 0x1, 0))
            qemu.settimeout(5)
            reply = b""
            while len(reply) < 20:
                reply += qemu.recv(20 - len(reply))
            request, flags, size, features = struct.unpack("<IIIQ", reply)
            assert (request, size) == (VHOST_USER_GET_FEATURES, 8)
            assert features & VIRTIO_F_VERSION_1
            _, got = rpc(double, "vhost_delete_controller", {"ctrlr": "vm1-vdb"})
            assert got["message"] == "Device or resource busy"
        assert double.wait_disconnected("vm1-vdb")
        assert rpc(double, "vhost_delete_controller", {"ctrlr": "vm1-vdb"}) == (True, None)
        assert not os.path.exists(f"/proc/{pid}/cmdline") or b"qemu-storage" not in Path(
            f"/proc/{pid}/cmdline").read_bytes()
    finally:
        double.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- apps, releases and the fabric ----------------------------------------------------------

HOST = "nqn.2014-08.org.nvmexpress:uuid:6b0f6f3c-2a4e-4c1d-9e55-0a1b2c3d4e5f"


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="spdk-double-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def double(workdir, name="spdk", **kw) -> SpdkTargetDouble:
    return SpdkTargetDouble(os.path.join(workdir, f"{name}.sock"), os.path.join(workdir, name), **kw)


def ok(spdk, method, params=None):
    result, error = rpc(spdk, method, params)
    assert error is None, (method, params, error)
    return result


def vhost_on_malloc(spdk, ctrlr="vblk0"):
    ok(spdk, "bdev_malloc_create", {"name": "Malloc0", "num_blocks": 1024, "block_size": 512})
    ok(spdk, "vhost_create_blk_controller", {"ctrlr": ctrlr, "dev_name": "Malloc0"})
    return os.path.join(spdk.vhost_dir, ctrlr)


def initiator(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s


@pytest.mark.parametrize("app, vhost, nvmf", [("vhost", True, False), ("nvmf_tgt", False, True),
                                              ("spdk_tgt", True, True)])
def test_each_app_serves_its_method_families(workdir, app, vhost, nvmf):
    with double(workdir, app=app) as spdk:
        listed = ok(spdk, "rpc_get_methods")
        assert ("vhost_create_blk_controller" in listed) == vhost
        assert ("nvmf_create_subsystem" in listed) == nvmf
        assert {"bdev_nvme_attach_controller", "bdev_malloc_create", "framework_get_reactors",
                "spdk_get_version", "rpc_get_methods"} <= set(listed)
        assert set(spdk.methods) <= set(listed) and len(set(listed)) == len(listed)
        for method, served in (("vhost_get_controllers", vhost), ("nvmf_get_subsystems", nvmf)):
            _, error = rpc(spdk, method)
            assert error is None if served else error == {"code": -32601, "message": "Method not found"}
        names = [s["subsystem"] for s in ok(spdk, "framework_get_subsystems")]
        assert ("vhost_blk" in names, "nvmf" in names, "bdev" in names) == (vhost, nvmf, True)


@pytest.mark.parametrize("version, text, code", [
    ("v24.01", "SPDK v24.01", 22),
    ("v26.09", "SPDK v26.09-pre git sha1 3230130e6a", -22),
])
def test_what_each_release_says_about_itself_and_a_missing_controller(workdir, version, text, code):
    with double(workdir, version=version) as spdk:
        assert ok(spdk, "spdk_get_version")["version"] == text
        _, error = rpc(spdk, "bdev_nvme_get_controllers", {"name": "nvme0"})
        assert error == {"code": code, "message": "Controller nvme0 does not exist"}


@pytest.mark.parametrize("version", ["v24.01", "v26.09"])
def test_every_connected_initiator_is_a_session(workdir, version):
    with double(workdir, version=version) as spdk:
        path = vhost_on_malloc(spdk)
        first, second = initiator(path), initiator(path)
        try:
            (vc,) = ok(spdk, "vhost_get_controllers", {"name": "vblk0"})
            assert vc["sessions"] == [
                {"vid": 0, "id": 0, "name": "vblk0s0", "started": False, "max_queues": 0, "inflight_task_cnt": 0},
                {"vid": 1, "id": 1, "name": "vblk0s1", "started": False, "max_queues": 0, "inflight_task_cnt": 0}]
            first.close()
            deadline = time.monotonic() + 2
            while len(ok(spdk, "vhost_get_controllers")[0]["sessions"]) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [s["name"] for s in ok(spdk, "vhost_get_controllers")[0]["sessions"]] == ["vblk0s1"]
        finally:
            first.close()
            second.close()


def test_v24_01_refuses_a_delete_while_an_initiator_is_connected(workdir):
    with double(workdir, version="v24.01") as spdk:
        qemu = initiator(vhost_on_malloc(spdk))
        with qemu:
            _, error = rpc(spdk, "vhost_delete_controller", {"ctrlr": "vblk0"})
            assert error == {"code": -32602, "message": "Device or resource busy"}
        assert spdk.wait_disconnected("vblk0")
        assert ok(spdk, "vhost_delete_controller", {"ctrlr": "vblk0"}) is True


def test_v26_09_answers_a_deferred_delete_once_the_initiator_leaves(workdir):
    with double(workdir, version="v26.09") as spdk:
        path = vhost_on_malloc(spdk)
        qemu = initiator(path)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(spdk.socket_path)
            client.sendall(json.dumps({"jsonrpc": "2.0", "method": "vhost_delete_controller",
                                       "params": {"ctrlr": "vblk0"}, "id": 7}).encode())
            client.settimeout(0.3)
            with pytest.raises(socket.timeout):
                client.recv(65536)
            (vc,) = ok(spdk, "vhost_get_controllers", {"name": "vblk0"})    # still there, with its session
            assert len(vc["sessions"]) == 1 and os.path.exists(path)
            qemu.close()
            client.settimeout(3)
            assert json.loads(client.recv(65536)) == {"jsonrpc": "2.0", "id": 7, "result": True}
        assert spdk.vhost == {} and not os.path.exists(path)
        _, error = rpc(spdk, "vhost_delete_controller", {"ctrlr": "vblk0"})
        assert error == {"code": -32602, "message": "No such device"}


def test_v26_09_drops_a_deferred_answer_whose_client_has_gone(workdir):
    with double(workdir, version="v26.09") as spdk:
        vhost_on_malloc(spdk)
        spdk.mark_connected("vblk0")
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(spdk.socket_path)
            client.sendall(json.dumps({"jsonrpc": "2.0", "method": "vhost_delete_controller",
                                       "params": {"ctrlr": "vblk0"}, "id": 8}).encode())
            time.sleep(0.2)
        assert "vblk0" in spdk.vhost
        spdk.mark_connected("vblk0", False)
        deadline = time.monotonic() + 2
        while spdk.vhost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spdk.vhost == {}
        assert ok(spdk, "vhost_get_controllers") == []


@pytest.mark.parametrize("version, answer", [
    ("v24.01", ([], None)),
    ("v26.09", (None, {"code": -22, "message": "Invalid argument"})),
])
def test_a_failover_path_on_a_multipath_controller(workdir, version, answer):
    """Refused since SPDK checks that all paths of a name are configured the
    same way (recorded from v26.09 the other way round: multipath on failover)."""
    with double(workdir, version=version) as spdk:
        spdk.add_fabric("RDMA", "192.168.100.8", "4420", SUBNQN)
        spdk.add_fabric("RDMA", "192.168.100.9", "4420", SUBNQN)
        attach_rdma(spdk, "192.168.100.8", multipath="multipath")
        assert attach_rdma(spdk, "192.168.100.9", multipath="failover") == answer


def nvmf_target(workdir, fabric, **kw) -> SpdkTargetDouble:
    tgt = double(workdir, "tgt", app="nvmf_tgt", fabric=fabric, **kw).start()
    ok(tgt, "bdev_malloc_create", {"name": "Malloc0", "num_blocks": 4096, "block_size": 512})
    ok(tgt, "bdev_malloc_create", {"name": "Malloc1", "num_blocks": 8192, "block_size": 4096})
    ok(tgt, "nvmf_create_transport", {"trtype": "TCP"})
    ok(tgt, "nvmf_create_subsystem", {"nqn": SUBNQN, "allow_any_host": False})
    ok(tgt, "nvmf_subsystem_add_host", {"nqn": SUBNQN, "host": HOST})
    assert ok(tgt, "nvmf_subsystem_add_ns", {"nqn": SUBNQN, "namespace": {"bdev_name": "Malloc0"}}) == 1
    assert ok(tgt, "nvmf_subsystem_add_ns", {"nqn": SUBNQN, "namespace": {"bdev_name": "Malloc1"}}) == 2
    ok(tgt, "nvmf_subsystem_add_listener", {"nqn": SUBNQN, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "10.0.0.1", "trsvcid": "4420"}})
    return tgt


def tcp(name, trsvcid="4420", hostnqn=HOST, subnqn=SUBNQN, **extra):
    return {"name": name, "trtype": "TCP", "adrfam": "IPv4", "traddr": "10.0.0.1", "trsvcid": trsvcid,
            "subnqn": subnqn, "hostnqn": hostnqn, **extra}


def test_a_vhost_app_attaches_to_an_nvmf_tgt_over_the_fabric(workdir):
    fabric = Fabric()
    tgt = nvmf_target(workdir, fabric)
    try:
        with double(workdir, "vhost", fabric=fabric, version="v26.09") as vhost:
            assert ok(vhost, "bdev_nvme_attach_controller", tcp("nvme0")) == ["nvme0n1", "nvme0n2"]
            bdevs = {b["name"]: b for b in ok(vhost, "bdev_get_bdevs")}
            remote = {b["name"]: b for b in ok(tgt, "bdev_get_bdevs")}
            for local, there in (("nvme0n1", "Malloc0"), ("nvme0n2", "Malloc1")):
                assert [bdevs[local][k] for k in ("uuid", "num_blocks", "block_size")] == [
                    remote[there][k] for k in ("uuid", "num_blocks", "block_size")]
                assert remote[there]["claimed"] and remote[there]["claim_type"] == "exclusive_write"
            assert bdevs["nvme0n1"]["driver_specific"]["nvme"][0]["ctrlr_data"]["cntlid"] == 1
            for refused in (tcp("nvme1", hostnqn="nqn.2016-06.io.spdk:stranger"),     # not an allowed host
                            tcp("nvme1", trsvcid="4421"),                             # no listener
                            tcp("nvme1", subnqn="nqn.2016-06.io.spdk:other")):        # no such subsystem
                _, error = rpc(vhost, "bdev_nvme_attach_controller", refused)
                assert error == {"code": -5, "message": "Input/output error"}
            ok(tgt, "nvmf_create_subsystem", {"nqn": "nqn.2016-06.io.spdk:open", "allow_any_host": True})
            ok(tgt, "nvmf_subsystem_add_listener", {"nqn": "nqn.2016-06.io.spdk:open", "listen_address": {
                "trtype": "TCP", "traddr": "10.0.0.1", "trsvcid": "4420"}})
            assert ok(vhost, "bdev_nvme_attach_controller", tcp(
                "nvme1", hostnqn="nqn.2016-06.io.spdk:stranger", subnqn="nqn.2016-06.io.spdk:open")) == []
            assert ok(vhost, "bdev_nvme_detach_controller", {"name": "nvme0"}) is True
            tgt.stop()          # the target goes away: nothing answers a connect
            _, error = rpc(vhost, "bdev_nvme_attach_controller", tcp("nvme0"))
            assert error == {"code": -5, "message": "Input/output error"}
    finally:
        tgt.stop()


def test_an_app_without_nvmf_does_not_serve_on_the_fabric(workdir):
    fabric = Fabric()
    with double(workdir, "tgt", app="vhost", fabric=fabric) as other, \
            double(workdir, "vhost", fabric=fabric) as vhost:
        assert rpc(other, "nvmf_create_transport", {"trtype": "TCP"})[1]["code"] == -32601
        _, error = rpc(vhost, "bdev_nvme_attach_controller", tcp("nvme0"))
        assert error == {"code": -5, "message": "Input/output error"}
