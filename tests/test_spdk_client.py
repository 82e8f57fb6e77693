"""vstor.spdk against the SPDK target double, over a real Unix socket, with
SPDK's own Python client doing the framing."""

import io
import json
import os
import socket
import threading

import pytest

from tests.doubles.spdk_target import check_params, load_facts, spdk_target_double  # noqa: F401
from vstor.errors import EXIT_ACTION_FAILED, EXIT_UNAVAILABLE, ActionFailed, InUse, Unavailable
from vstor.backends.spdk import SpdkClient, SpdkRpcError

SUBNQN = "nqn.2016-06.io.spdk:cnode1"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0031-3510-8052-b4c04f4d4e31"
RECONNECT = {"ctrlr_loss_timeout_sec": 60, "reconnect_delay_sec": 5, "fast_io_fail_timeout_sec": 30}


@pytest.fixture
def spdk(spdk_target_double):
    """The double with a local controller (2 namespaces) and one NVMe-oF
    subsystem reachable over RDMA and TCP on two portals each."""
    d = spdk_target_double
    d.add_pcie("0000:5e:00.0", namespaces=2)
    for trtype in ("RDMA", "TCP"):
        for traddr in ("192.168.100.8", "192.168.100.9"):
            d.add_fabric(trtype, traddr, "4420", SUBNQN, namespaces=1)
    return d


@pytest.fixture
def client(spdk):
    with SpdkClient(spdk.socket_path, timeout=5) as c:
        yield c


def fabric(trtype, traddr="192.168.100.8", **extra):
    return {"name": "fab0", "trtype": trtype, "traddr": traddr, "adrfam": "IPv4",
            "trsvcid": "4420", "subnqn": SUBNQN, **extra}


# -- exact parameters ---------------------------------------------------------------------

def test_local_pcie_attach_sends_only_what_was_given(spdk, client):
    bdevs = client.attach_nvme_controller("nvme0", "PCIe", "0000:5e:00.0")
    assert bdevs == ["nvme0n1", "nvme0n2"]
    assert spdk.params_of("bdev_nvme_attach_controller") == [
        {"name": "nvme0", "trtype": "PCIe", "traddr": "0000:5e:00.0"}]


@pytest.mark.parametrize("trtype", ["RDMA", "TCP"])
def test_fabric_attach_with_hostnqn_and_reconnect_timeouts(spdk, client, trtype):
    bdevs = client.attach_nvme_controller("fab0", trtype, "192.168.100.8", adrfam="IPv4",
                                          trsvcid="4420", subnqn=SUBNQN, hostnqn=HOSTNQN,
                                          **RECONNECT)
    assert bdevs == ["fab0n1"]
    assert spdk.params_of("bdev_nvme_attach_controller") == [
        fabric(trtype, hostnqn=HOSTNQN, **RECONNECT)]


def test_multipath_second_path_joins_the_same_bdev(spdk, client):
    for traddr in ("192.168.100.8", "192.168.100.9"):
        assert client.attach_nvme_controller(
            "fab0", "RDMA", traddr, adrfam="IPv4", trsvcid="4420", subnqn=SUBNQN,
            hostnqn=HOSTNQN, multipath="multipath", **RECONNECT) == ["fab0n1"]
    assert spdk.params_of("bdev_nvme_attach_controller")[1] == fabric(
        "RDMA", "192.168.100.9", hostnqn=HOSTNQN, multipath="multipath", **RECONNECT)
    (ctrl,) = client.get_nvme_controllers("fab0")
    assert [c["trid"]["traddr"] for c in ctrl["ctrlrs"]] == ["192.168.100.8", "192.168.100.9"]
    assert [b["name"] for b in client.call("bdev_get_bdevs")] == ["fab0n1"]


def test_detach_one_path_keeps_the_controller(spdk, client):
    for traddr in ("192.168.100.8", "192.168.100.9"):
        client.attach_nvme_controller("fab0", "RDMA", traddr, adrfam="IPv4", trsvcid="4420",
                                      subnqn=SUBNQN, multipath="multipath")
    client.detach_nvme_controller("fab0", trtype="RDMA", traddr="192.168.100.9",
                                  trsvcid="4420", subnqn=SUBNQN)
    assert spdk.params_of("bdev_nvme_detach_controller") == [
        {"name": "fab0", "trtype": "RDMA", "traddr": "192.168.100.9", "trsvcid": "4420",
         "subnqn": SUBNQN}]
    (ctrl,) = client.get_nvme_controllers("fab0")
    assert [c["trid"]["traddr"] for c in ctrl["ctrlrs"]] == ["192.168.100.8"]
    client.detach_nvme_controller("fab0")
    assert client.get_nvme_controllers("fab0") == []


def test_vhost_controller_round_trip(spdk, client):
    client.attach_nvme_controller("nvme0", "PCIe", "0000:5e:00.0")
    client.vhost_create_blk_controller("vm1-vdb", "nvme0n1", cpumask="0x2", readonly=True)
    assert spdk.params_of("vhost_create_blk_controller") == [
        {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1", "cpumask": "0x2", "readonly": True}]
    (vc,) = client.vhost_get_controllers("vm1-vdb")
    assert vc["backend_specific"]["block"] == {"readonly": True, "bdev": "nvme0n1",
                                               "transport": "vhost_user_blk"}
    assert vc["socket"] == os.path.join(spdk.vhost_dir, "vm1-vdb")
    client.vhost_delete_controller("vm1-vdb")
    assert client.vhost_get_controllers("vm1-vdb") == []


def test_nvmf_export_of_a_local_namespace(spdk, client):
    client.attach_nvme_controller("nvme0", "PCIe", "0000:5e:00.0")
    nqn = "nqn.2024-01.dev.vstor:vm1-vdb"
    client.nvmf_create_transport("RDMA", no_srq=True, max_srq_depth=None)
    client.nvmf_create_subsystem(nqn, serial_number="VSTOR0001", allow_any_host=True)
    assert client.nvmf_subsystem_add_ns(nqn, "nvme0n1") == 1
    client.nvmf_subsystem_add_listener(nqn, "RDMA", "192.168.100.1", "4420", adrfam="IPv4")
    assert spdk.params_of("nvmf_create_transport") == [{"trtype": "RDMA", "no_srq": True}]
    assert spdk.params_of("nvmf_subsystem_add_ns") == [
        {"nqn": nqn, "namespace": {"bdev_name": "nvme0n1"}}]
    assert spdk.params_of("nvmf_subsystem_add_listener") == [
        {"nqn": nqn, "listen_address": {"trtype": "RDMA", "adrfam": "IPv4",
                                        "traddr": "192.168.100.1", "trsvcid": "4420"}}]
    (sub,) = client.nvmf_get_subsystems(nqn)
    assert sub["namespaces"][0]["bdev_name"] == "nvme0n1"
    client.nvmf_delete_subsystem(nqn)
    assert client.nvmf_get_subsystems(nqn) == []


def test_every_helper_sends_what_the_schema_accepts(spdk, client):
    client.get_version()
    client.framework_get_reactors()
    client.attach_nvme_controller("fab0", "TCP", "192.168.100.8", adrfam="IPv4", trsvcid="4420",
                                  subnqn=SUBNQN, hostnqn=HOSTNQN, multipath="multipath", **RECONNECT)
    client.get_nvme_controllers()
    client.vhost_create_blk_controller("vm1-vdb", "fab0n1", cpumask="0x1", packed_ring=True)
    client.vhost_get_controllers()
    client.vhost_delete_controller("vm1-vdb")
    client.detach_nvme_controller("fab0", trtype="TCP", traddr="192.168.100.8", adrfam="IPv4",
                                  trsvcid="4420", subnqn=SUBNQN)
    facts = load_facts()
    assert len(spdk.requests) == 8
    for r in spdk.requests:
        assert check_params(facts[r["method"]]["params"], r["params"]) is None, r


# -- "not found" is an empty answer, not an error -------------------------------------------

def test_gets_for_unknown_names_answer_empty(spdk, client):
    assert client.get_nvme_controllers("nvme9") == []
    assert client.vhost_get_controllers("vm9-vdb") == []
    # ... and SPDK did answer errors, which the client read as "not found".
    assert [r["method"] for r in spdk.requests] == [
        "bdev_nvme_get_controllers", "vhost_get_controllers"]


# -- SPDK's errors ------------------------------------------------------------------------

def test_unknown_method_is_an_rpc_error_with_its_code(client):
    with pytest.raises(SpdkRpcError) as e:
        client.call("bdev_nvme_attach_controllers", {"name": "x"})
    assert (e.value.method, e.value.code, e.value.rpc_message) == (
        "bdev_nvme_attach_controllers", -32601, "Method not found")
    assert isinstance(e.value, ActionFailed) and e.value.exit_code == EXIT_ACTION_FAILED
    assert "\n" not in str(e.value)


def test_bad_params_carry_the_code_the_method_answers(client):
    with pytest.raises(SpdkRpcError) as e:
        client.call("vhost_create_blk_controller", {"ctrlr": "vm1-vdb"})   # no dev_name
    assert (e.value.code, e.value.rpc_message) == (-32602, "Invalid argument")
    with pytest.raises(SpdkRpcError) as e:
        client.call("bdev_nvme_attach_controller", {"name": "x", "trtype": "PCIe", "traddr": 5})
    assert (e.value.code, e.value.rpc_message) == (-32603, "spdk_json_decode_object failed")


def test_semantic_errors_carry_spdks_code(spdk, client):
    client.attach_nvme_controller("fab0", "RDMA", "192.168.100.8", adrfam="IPv4", trsvcid="4420",
                                  subnqn=SUBNQN)
    with pytest.raises(SpdkRpcError) as e:
        client.attach_nvme_controller("fab0", "RDMA", "192.168.100.9", adrfam="IPv4",
                                      trsvcid="4420", subnqn=SUBNQN, multipath="disable")
    assert e.value.code == -114
    assert e.value.rpc_message == "A controller named fab0 already exists and multipath is disabled"
    with pytest.raises(SpdkRpcError) as e:
        client.vhost_create_blk_controller("vm1-vdb", "nvme7n1")
    assert (e.value.code, e.value.rpc_message) == (-32602, "No such device")


def test_delete_refused_while_qemu_is_connected(spdk, client):
    client.attach_nvme_controller("nvme0", "PCIe", "0000:5e:00.0")
    client.vhost_create_blk_controller("vm1-vdb", "nvme0n1")
    spdk.mark_connected("vm1-vdb")
    with pytest.raises(InUse) as e:         # SPDK's -32602 "Device or resource busy": in use, exit 3
        client.vhost_delete_controller("vm1-vdb")
    assert e.value.exit_code == 3 and "an initiator (QEMU) is still connected" in str(e.value)
    assert "stop the domain's QEMU" in str(e.value)
    spdk.mark_connected("vm1-vdb", False)
    client.vhost_delete_controller("vm1-vdb")


# -- SPDK not there -----------------------------------------------------------------------

def test_missing_socket_is_unavailable_in_one_line(tmp_path):
    path = str(tmp_path / "spdk.sock")
    with pytest.raises(Unavailable) as e:
        SpdkClient(path).get_version()
    assert str(e.value) == (
        f"SPDK is not reachable at {path}: no such socket (start SPDK's vhost app with "
        f"-r {path} -S /run/vstor/vhost, or set [spdk] rpc_socket in /etc/vstor/vstor.conf)")
    assert e.value.exit_code == EXIT_UNAVAILABLE


def test_stale_socket_is_connection_refused(tmp_path):
    path = str(tmp_path / "spdk.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)         # bound, never listening: what a crashed SPDK leaves behind
    dead.close()
    with pytest.raises(Unavailable) as e:
        SpdkClient(path, vhost_dir="/srv/vhost").get_version()
    assert e.value.message == f"SPDK is not reachable at {path}: connection refused (a stale socket: SPDK is not running)"
    assert "-S /srv/vhost" in e.value.hint


def test_a_plain_file_is_not_a_socket(tmp_path):
    path = tmp_path / "spdk.sock"
    path.write_text("")
    with pytest.raises(Unavailable, match="not a socket"):
        SpdkClient(str(path)).get_version()


def test_an_spdk_that_never_answers_times_out(tmp_path):
    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(1)
    held = []
    accepter = threading.Thread(target=lambda: held.append(mute.accept()[0]), daemon=True)
    accepter.start()
    try:
        with pytest.raises(Unavailable) as e:
            SpdkClient(path, timeout=0.3).get_version()
        assert str(e.value).startswith(f"SPDK at {path}: no answer to spdk_get_version within 0.3 s")
        assert "\n" not in str(e.value)
    finally:
        accepter.join(timeout=2)
        for s in held:
            s.close()
        mute.close()


def test_the_client_reconnects_after_spdk_restarts(spdk, client):
    assert client.get_version() == "SPDK v26.09-pre"
    spdk.stop()
    with pytest.raises(Unavailable):
        client.get_version()
    spdk.start()
    assert client.get_version() == "SPDK v26.09-pre"


# -- dry run ------------------------------------------------------------------------------

def test_dry_run_prints_requests_and_sends_nothing(spdk):
    out = io.StringIO()
    dry = SpdkClient(spdk.socket_path, dry_run=True, out=out)
    assert dry.get_nvme_controllers("nvme0") == []
    assert dry.attach_nvme_controller("nvme0", "PCIe", "0000:5e:00.0") == []
    dry.vhost_create_blk_controller("vm1-vdb", "nvme0n1", cpumask="0x2")
    assert dry.vhost_get_controllers() == []
    assert spdk.requests == []
    lines = out.getvalue().splitlines()
    assert all(line.startswith("SPDK RPC (dry run): ") for line in lines)
    sent = [json.loads(line.split(": ", 1)[1]) for line in lines]
    assert sent == dry.requests == [
        {"method": "bdev_nvme_get_controllers", "params": {"name": "nvme0"}},
        {"method": "bdev_nvme_attach_controller",
         "params": {"name": "nvme0", "trtype": "PCIe", "traddr": "0000:5e:00.0"}},
        {"method": "vhost_create_blk_controller",
         "params": {"ctrlr": "vm1-vdb", "dev_name": "nvme0n1", "cpumask": "0x2"}},
        {"method": "vhost_get_controllers"},
    ]


def test_dry_run_needs_no_spdk(tmp_path):
    dry = SpdkClient(str(tmp_path / "absent.sock"), dry_run=True, out=io.StringIO())
    assert dry.get_version() == "(dry run)"
    assert dry.framework_get_reactors() == {"reactors": []}


@pytest.mark.parametrize("app, status, words", [
    ("vhost", "warn", "supported v24.01 to v26.09; its -S directory cannot be read"),
    ("nvmf_tgt", "fail", "has no vhost_create_blk_controller, vhost_delete_controller, vhost_get_controllers"),
])
def test_doctor_names_the_app_what_it_lacks_and_the_supported_range(tmp_path, app, status, words):
    from tests.doubles.spdk_target import SpdkTargetDouble
    from vstor.backends.spdk_app import SUPPORTED, app_facts
    from vstor.config import Config
    from vstor.host.doctor import check_spdk
    from vstor.runtime.actions import SpdkAttach, SpdkVhost
    double = SpdkTargetDouble(str(tmp_path / "s.sock"), str(tmp_path / "vhost"), app=app,
                              version="v26.09").start()
    try:
        with SpdkClient(double.socket_path) as client:
            facts = app_facts(client, SpdkAttach.rpc_methods + SpdkVhost.rpc_methods)
        check = check_spdk(Config(spdk_socket=double.socket_path, default_backend="spdk"),
                           lambda: facts, SUPPORTED)
    finally:
        double.stop()
    assert check.status == status and words in check.detail
    assert check.detail.startswith("SPDK v26.09-pre git sha1 3230130e6a (")      # not "SPDK SPDK"
