"""vfio-pci: the passthrough checks, and binding/restoring against a TEST DOUBLE
of the kernel's PCI sysfs (tests/doubles/kernel_sysfs.py)."""

import errno
import json
import os

import pytest

from tests.doubles.kernel_sysfs import KernelSysfsDouble, PciSpec
from vstor.errors import ActionFailed
from vstor.host.model import Namespace, NvmeController, PciDevice
from vstor.planner.passthrough import check_passthrough
from vstor.backends.vfio import (BindRecord, bind_to_vfio, plan_bind,
                        restore_driver)
from vstor.backends.vfio_record import record_from_json, record_to_json

NVME = "0000:5e:00.0"
PORT = "0000:5d:00.0"
PROBE = "/sys/bus/pci/drivers_probe"
OVERRIDE = f"/sys/bus/pci/devices/{NVME}/driver_override"


# -- check_passthrough ---------------------------------------------------------

def ctrl(**kw):
    base = dict(address=NVME, driver="nvme", iommu_group=40,
                namespaces=(Namespace("nvme1n1", 1),),
                group_peers=(PciDevice(PORT, pci_class="0x060400", driver="pcieport"),))
    return NvmeController(**{**base, **kw})


def check(c, **kw):
    args = dict(iommu_enabled=True, vfio_available=True, pci_allowed=(), pci_blocked=(),
                spdk_owned=False)
    return check_passthrough(c, **{**args, **kw})


def test_a_free_controller_may_go():
    assert check(ctrl()) == ()
    assert check(ctrl(group_peers=(PciDevice("0000:5e:00.1", driver=None),
                                   PciDevice("0000:5e:00.2", driver="vfio-pci")))) == ()


@pytest.mark.parametrize("why, fix", [("mounted at /srv (nvme1n1p1)", "unmount it"),
                                      ("swap (nvme1n1p2)", "swapoff it"),
                                      ("held by dm-0 (vg-data)", "remove what holds it")])
def test_a_namespace_in_use_refuses(why, fix):
    (reason,) = check(ctrl(namespaces=(Namespace("nvme1n1", 1, in_use=(why,)),)))
    assert "nvme1n1" in reason and why in reason and fix in reason


def test_the_root_disk_refuses():
    (reason,) = check(ctrl(backs_root=True))
    assert "root filesystem" in reason and NVME in reason


@pytest.mark.parametrize("blocked", [(NVME,), ("5e:00.0",), ("5E:00.0",)])
def test_pci_blocked_refuses_in_both_forms_and_wins(blocked):
    (reason,) = check(ctrl(), pci_blocked=blocked, pci_allowed=(NVME,))
    assert "PCI_BLOCKED" in reason and NVME in reason


def test_outside_a_non_empty_pci_allowed_refuses():
    (reason,) = check(ctrl(), pci_allowed=("0000:af:00.0",))
    assert "not in PCI_ALLOWED" in reason and "add it" in reason
    assert check(ctrl(), pci_allowed=("5e:00.0",)) == ()


def test_iommu_off_says_what_to_add():
    (reason,) = check(ctrl(iommu_group=None), iommu_enabled=False)
    assert "intel_iommu=on iommu=pt" in reason and "amd_iommu=on" in reason


def test_no_iommu_group_with_iommu_on_refuses():
    (reason,) = check(ctrl(iommu_group=None))
    assert "no IOMMU group" in reason


def test_vfio_missing_says_modprobe():
    assert check(ctrl(), vfio_available=False) == ("vfio-pci is not available: modprobe vfio-pci",)


def test_a_peer_on_a_host_driver_is_named_with_its_driver():
    peers = (PciDevice(PORT, pci_class="0x060400", driver="pcieport"),
             PciDevice("0000:5e:00.1", pci_class="0x020000", driver="i40e"),
             PciDevice("0000:5e:00.2", driver="pci-stub"))
    (reason,) = check(ctrl(group_peers=peers))
    assert "0000:5e:00.1" in reason and "i40e" in reason and "IOMMU group 40" in reason


def test_spdk_owned_refuses():
    (reason,) = check(ctrl(driver="uio_pci_generic"), spdk_owned=True)
    assert "SPDK" in reason and "uio_pci_generic" in reason


def test_every_reason_is_reported_at_once():
    reasons = check(ctrl(backs_root=True), iommu_enabled=False, vfio_available=False,
                    pci_blocked=(NVME,), spdk_owned=True)
    assert len(reasons) == 5


# -- the double behaves like the kernel where vfio.py relies on it ---------------

@pytest.fixture
def host(tmp_path):
    """A root port and one NVMe controller on nvme, alone in IOMMU group 40."""
    return KernelSysfsDouble.build(str(tmp_path), [
        PciSpec(PORT, pci_class="0x060400", driver="pcieport", iommu_group=40),
        PciSpec(NVME, driver="nvme", parent=PORT, iommu_group=40, numa_node=1),
    ])


def test_the_double_builds_kernel_shaped_links(host):
    link = os.readlink(host.path(f"/sys/bus/pci/devices/{NVME}"))
    assert link == f"../../../devices/pci0000:5d/{PORT}/{NVME}"
    assert os.readlink(host.path(f"/sys/devices/pci0000:5d/{PORT}/{NVME}/driver")) \
        == "../../../../bus/pci/drivers/nvme"
    assert host.exists(f"/sys/bus/pci/drivers/nvme/{NVME}")
    assert host.resolve(f"/sys/bus/pci/devices/{NVME}/iommu_group") == "/sys/kernel/iommu_groups/40"
    assert host.override_of(NVME) == "(null)"


def test_the_double_refuses_an_unbind_from_the_wrong_driver(host):
    with pytest.raises(OSError) as e:
        host.write("/sys/bus/pci/drivers/vfio-pci/unbind", NVME)
    assert e.value.errno == errno.ENODEV
    assert host.driver_of(NVME) == "nvme"


def test_the_double_probes_by_override_and_clears_with_a_newline(host):
    host.write(OVERRIDE, "vfio-pci")
    host.write(PROBE, NVME)
    assert host.driver_of(NVME) == "nvme"               # bound: probe leaves it alone
    host.write("/sys/bus/pci/drivers/nvme/unbind", NVME)
    assert host.driver_of(NVME) is None and not host.exists(f"/sys/bus/pci/drivers/nvme/{NVME}")
    host.write(PROBE, NVME)
    assert host.driver_of(NVME) == "vfio-pci"
    host.write(OVERRIDE, "")                            # no write(2): nothing changes
    assert host.override_of(NVME) == "vfio-pci"
    host.write(OVERRIDE, "\n")
    assert host.override_of(NVME) == "(null)"


# -- bind, verify, restore -----------------------------------------------------

def test_round_trip_moves_the_driver_link_and_back(host):
    record = plan_bind(host, "5e:00.0")
    assert record == BindRecord(NVME, "nvme", None)
    assert host.writes == []                            # planning writes nothing
    assert bind_to_vfio(host, record) == record
    assert host.driver_of(NVME) == "vfio-pci"
    assert os.readlink(host.path(f"/sys/bus/pci/devices/{NVME}/driver")).endswith("drivers/vfio-pci")
    assert [p for p, _ in host.writes] == [OVERRIDE, "/sys/bus/pci/drivers/nvme/unbind", PROBE]
    restore_driver(host, record)
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "(null)"
    assert host.driver_of(PORT) == "pcieport"           # the bridge never moved


def test_the_record_survives_json(host):
    record = plan_bind(host, NVME)
    assert record_from_json(json.loads(json.dumps(record_to_json(record)))) == record


def test_bind_and_restore_are_idempotent(host):
    record = bind_to_vfio(host, NVME)
    n = len(host.writes)
    bind_to_vfio(host, record)
    assert len(host.writes) == n
    restore_driver(host, record)
    n = len(host.writes)
    restore_driver(host, record)
    assert len(host.writes) == n and host.driver_of(NVME) == "nvme"


def test_a_device_already_on_vfio_is_a_no_op_record(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver="vfio-pci", iommu_group=7)])
    record = bind_to_vfio(host, NVME)
    assert record == BindRecord(NVME, "vfio-pci", None)
    restore_driver(host, record)
    assert host.writes == [] and host.driver_of(NVME) == "vfio-pci"


def test_an_unbound_device_is_left_unbound_on_restore(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver=None, iommu_group=7)])
    record = bind_to_vfio(host, NVME)
    assert host.driver_of(NVME) == "vfio-pci"
    restore_driver(host, record)
    assert host.driver_of(NVME) is None and host.override_of(NVME) == "(null)"


def test_an_original_override_comes_back(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [
        PciSpec(NVME, driver="nvme", driver_override="nvme", iommu_group=7)])
    record = bind_to_vfio(host, NVME)
    assert record.driver_override == "nvme"
    restore_driver(host, record)
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "nvme"


def bind_writes(tmp_path):
    clean = KernelSysfsDouble.build(str(tmp_path / "clean"), [PciSpec(NVME, driver="nvme", iommu_group=7)])
    bind_to_vfio(clean, NVME)
    return [p for p, _ in clean.writes]


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_failed_write_during_bind_rolls_back(tmp_path, nth):
    paths = bind_writes(tmp_path)
    assert len(paths) == 3
    host = KernelSysfsDouble.build(str(tmp_path / "t"), [PciSpec(NVME, driver="nvme", iommu_group=7)])
    record = plan_bind(host, NVME)
    host.fail_write(nth=nth)
    with pytest.raises(ActionFailed) as e:
        bind_to_vfio(host, record)
    msg = str(e.value)
    assert NVME in msg and paths[nth - 1] in msg and "EIO" in msg and "rolled back" in msg
    assert "\n" not in msg
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "(null)"


def test_a_rollback_that_fails_too_says_so_and_where_the_device_is(host):
    host.fail_write(nth=3)                              # drivers_probe during bind
    host.fail_write(nth=5)                              # drivers_probe during rollback
    with pytest.raises(ActionFailed) as e:
        bind_to_vfio(host, NVME)
    assert "rolling back failed too" in str(e.value) and "now on no driver" in str(e.value)
    assert host.override_of(NVME) == "(null)"           # what could be undone was


def test_a_probe_vfio_refuses_is_caught_by_the_check_and_rolled_back(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver="nvme", iommu_group=7)])
    host.refuse_probe(NVME, "vfio-pci")
    with pytest.raises(ActionFailed) as e:
        bind_to_vfio(host, NVME)
    assert "on no driver after writing /sys/bus/pci/drivers_probe" in str(e.value)
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "(null)"


def test_a_device_whose_unbind_fails_stays_on_its_driver(host):
    host.fail_write(path="/sys/bus/pci/drivers/nvme/unbind", err=errno.EBUSY, times=None)
    with pytest.raises(ActionFailed) as e:
        bind_to_vfio(host, NVME)
    assert "/sys/bus/pci/drivers/nvme/unbind" in str(e.value) and "EBUSY" in str(e.value)
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "(null)"


def test_vfio_not_loaded_refuses_before_any_write(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver="nvme", iommu_group=7)],
                                   drivers=("nvme",))
    with pytest.raises(ActionFailed) as e:
        bind_to_vfio(host, NVME)
    assert "modprobe vfio-pci" in str(e.value) and host.writes == []


def test_a_failed_restore_says_which_file_and_where_the_device_is(host):
    record = bind_to_vfio(host, NVME)
    host.fail_write(path=PROBE)
    with pytest.raises(ActionFailed) as e:
        restore_driver(host, record)
    msg = str(e.value)
    assert PROBE in msg and NVME in msg and "now on no driver" in msg
    restore_driver(host, record)                        # the next run finishes it
    assert host.driver_of(NVME) == "nvme"


def test_restore_finishes_a_bind_interrupted_half_way(host):
    """A crash after the unbind (no rollback ran): the persisted record undoes it."""
    record = plan_bind(host, NVME)
    host.write(OVERRIDE, "vfio-pci")
    host.write("/sys/bus/pci/drivers/nvme/unbind", NVME)
    restore_driver(host, record)
    assert host.driver_of(NVME) == "nvme" and host.override_of(NVME) == "(null)"


def test_restore_leaves_a_device_someone_else_rebound(tmp_path):
    host = KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver=None, iommu_group=7)])
    record = plan_bind(host, NVME)
    host.write(PROBE, NVME)                             # nvme took it meanwhile
    with pytest.raises(ActionFailed) as e:
        restore_driver(host, record)
    assert "left alone" in str(e.value) and host.driver_of(NVME) == "nvme"


# -- IOMMU group peers -----------------------------------------------------------

PEER = "0000:5e:00.1"
IDLE = "0000:5e:00.2"


def group_host(root):
    return KernelSysfsDouble.build(root, [
        PciSpec(PORT, pci_class="0x060400", driver="pcieport", iommu_group=40),
        PciSpec(NVME, driver="nvme", parent=PORT, iommu_group=40),
        PciSpec(PEER, driver="nvme", parent=PORT, iommu_group=40),
        PciSpec(IDLE, pci_class="0x088000", driver=None, parent=PORT, iommu_group=40),
    ])


def test_peers_on_host_drivers_move_with_it_and_come_back(tmp_path):
    host = group_host(str(tmp_path))
    record = plan_bind(host, NVME)
    assert record.peers == (BindRecord(PEER, "nvme", None),)
    bind_to_vfio(host, record)
    assert [host.driver_of(a) for a in (PORT, NVME, PEER, IDLE)] == \
        ["pcieport", "vfio-pci", "vfio-pci", None]
    restore_driver(host, record)
    assert [host.driver_of(a) for a in (PORT, NVME, PEER, IDLE)] == \
        ["pcieport", "nvme", "nvme", None]


def test_a_failure_on_any_write_of_a_group_rolls_everything_back(tmp_path):
    clean = group_host(str(tmp_path / "clean"))
    bind_to_vfio(clean, NVME)
    for nth in range(1, len(clean.writes) + 1):
        host = group_host(str(tmp_path / f"t{nth}"))
        record = plan_bind(host, NVME)
        host.fail_write(nth=nth)
        with pytest.raises(ActionFailed) as e:
            bind_to_vfio(host, record)
        assert clean.writes[nth - 1][0] in str(e.value)
        assert [host.driver_of(a) for a in (PORT, NVME, PEER, IDLE)] == \
            ["pcieport", "nvme", "nvme", None]
        assert {host.override_of(a) for a in (NVME, PEER, IDLE)} == {"(null)"}


def test_the_double_wraps_an_existing_tree(tmp_path):
    """Built once, then taken as it is (as from a layout builder): the native
    driver of a device found on vfio-pci comes from its class."""
    KernelSysfsDouble.build(str(tmp_path), [PciSpec(NVME, driver="vfio-pci", iommu_group=3)])
    host = KernelSysfsDouble(str(tmp_path))
    restore_driver(host, BindRecord(NVME, "nvme", None))
    assert host.driver_of(NVME) == "nvme"
