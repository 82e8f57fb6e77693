"""Passing an NVMe controller to vfio-pci and giving it back, through sysfs.

`check_passthrough` decides (pure, on the host model) whether a controller may
leave the host; `plan_bind` records where a controller (and the IOMMU group
peers that would have to move with it) are now, before anything changes;
`bind_to_vfio` and `restore_driver` make the change and its undo, each
verifying the kernel really did it.

Kernel quirks handled here:
- Binding by `driver_override` + `drivers_probe`, never `new_id`: new_id adds
  the vendor:device id to vfio-pci's dynamic id table, so vfio-pci grabs EVERY
  device with that id (the host's other controllers of the same model, and any
  hot-plugged later); driver_override names exactly one device.
- driver_override is written BEFORE the unbind: once it is set only the named
  driver may match the device, so nothing (udev, autoprobe) can hand it back to
  nvme between the unbind and our probe.
- A driver whose probe fails does not fail the write to drivers_probe: the
  driver core only logs it (dmesg).  So every bind and restore reads the
  `driver` link back and compares.
- driver_override is cleared by writing '\\n', not '': Python's write('') makes
  no write(2) call at all, so the kernel would never see it.  Cleared, it reads
  '(null)'.
- Unbinding the nvme driver yanks every namespace from the host, mounted or
  not: whether that is safe is `check_passthrough`'s question, asked first.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, replace

from vstor.errors import ActionFailed
from vstor.host.model import NvmeController, PciDevice
from vstor.host.sysfs import SysFS

VFIO = "vfio-pci"
PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
# vfio accepts a group only when every member is on a vfio driver, on no
# driver, on pci-stub, or is a bridge (drivers/vfio: vfio_dev_driver_allowed).
VIABLE_PEER_DRIVERS = (None, VFIO, "pci-stub")


def normalize_address(address: str) -> str:
    """'5E:00.0' -> '0000:5e:00.0' (SPDK's lists accept both forms)."""
    address = address.strip().lower()
    return address if address.count(":") == 2 else "0000:" + address


# -- deciding ---------------------------------------------------------------

def check_passthrough(ctrl: NvmeController, *, iommu_enabled: bool, vfio_available: bool,
                      pci_allowed: tuple[str, ...], pci_blocked: tuple[str, ...],
                      spdk_owned: bool) -> tuple[str, ...]:
    """Why `ctrl` cannot go to vfio-pci now, one reason with its fix each;
    () when it can."""
    reasons = [_usage_reason(ns.name, why) for ns in ctrl.namespaces for why in ns.in_use]
    if ctrl.backs_root:
        reasons.append(f"{ctrl.address} holds the host's root filesystem: the host would "
                       "lose its root disk; choose another controller")
    reasons += _pci_list_reasons(ctrl.address, pci_allowed, pci_blocked)
    if not iommu_enabled:
        reasons.append("the IOMMU is off: add intel_iommu=on iommu=pt (or amd_iommu=on) "
                       "to the kernel command line and reboot")
    elif ctrl.iommu_group is None:
        reasons.append(f"{ctrl.address} is in no IOMMU group: the IOMMU does not cover it "
                       "(check the firmware's VT-d/AMD-Vi setting)")
    if not vfio_available:
        reasons.append("vfio-pci is not available: modprobe vfio-pci")
    reasons += [_peer_reason(ctrl, peer) for peer in ctrl.group_peers if not _viable(peer)]
    if spdk_owned:
        reasons.append(f"SPDK is using {ctrl.address} (on {ctrl.driver or 'no driver'}): "
                       "detach it from SPDK (stop the domains it serves) first, or give "
                       "this disk the spdk backend too")
    return tuple(reasons)


_USAGE_FIXES = (("mounted", "unmount it"), ("swap", "swapoff it"),
                ("held by", "remove what holds it (LVM, dm, md)"))


def _usage_reason(ns_name: str, why: str) -> str:
    fix = next((f for prefix, f in _USAGE_FIXES if why.startswith(prefix)), "stop using it")
    return (f"namespace {ns_name} is in use by the host ({why}): passthrough takes the whole "
            f"controller away, so {fix} first")


def _pci_list_reasons(address: str, allowed, blocked) -> list[str]:
    # setup.sh semantics: PCI_BLOCKED wins; an empty PCI_ALLOWED allows all.
    address = normalize_address(address)
    if address in {normalize_address(a) for a in blocked}:
        return [f"{address} is in PCI_BLOCKED ([pci] blocked): remove it from there to allow it"]
    if allowed and address not in {normalize_address(a) for a in allowed}:
        return [f"{address} is not in PCI_ALLOWED ([pci] allowed): add it there to allow it"]
    return []


def _viable(peer: PciDevice) -> bool:
    return peer.is_bridge or peer.driver in VIABLE_PEER_DRIVERS


def _peer_reason(ctrl: NvmeController, peer: PciDevice) -> str:
    return (f"IOMMU group {ctrl.iommu_group} of {ctrl.address} also holds {peer.address} "
            f"(on {peer.driver}), which would have to leave the host too: unbind it from "
            f"{peer.driver} or move the controller to a slot with its own IOMMU group")


# -- the record --------------------------------------------------------------

@dataclass(frozen=True)
class BindRecord:
    """Where a device was before vstor moved it: enough to put it back.
    `peers` are the group members that move with it (same fields, no peers)."""
    address: str
    driver: str | None              # None: it was bound to nothing
    driver_override: str | None     # None: '(null)', not set
    peers: tuple["BindRecord", ...] = ()

    def devices(self) -> tuple["BindRecord", ...]:
        return (self,) + self.peers


def record_to_json(record: BindRecord) -> dict:
    return {"address": record.address, "driver": record.driver,
            "driver_override": record.driver_override,
            "peers": [record_to_json(p) for p in record.peers]}


def record_from_json(data: dict) -> BindRecord:
    return BindRecord(data["address"], data.get("driver"), data.get("driver_override"),
                      tuple(record_from_json(p) for p in data.get("peers", ())))


def plan_bind(sysfs: SysFS, address: str) -> BindRecord:
    """Read (write nothing) where `address` and its group peers are now."""
    address = normalize_address(address)
    if not sysfs.exists(f"{PCI_DEVICES}/{address}"):
        raise ActionFailed(f"there is no PCI device {address} ({PCI_DEVICES}/{address} is missing)")
    peers = tuple(_snapshot(sysfs, p) for p in _group_peers(sysfs, address)
                  if _must_move(sysfs, p))
    return replace(_snapshot(sysfs, address), peers=peers)


def _snapshot(sysfs: SysFS, address: str) -> BindRecord:
    return BindRecord(address, _driver(sysfs, address), _override(sysfs, address))


def _group_peers(sysfs: SysFS, address: str) -> list[str]:
    group = sysfs.resolve(f"{PCI_DEVICES}/{address}/iommu_group")
    if group is None:
        return []
    return [p for p in sysfs.listdir(f"{group}/devices") if p != address]


def _must_move(sysfs: SysFS, address: str) -> bool:
    peer = PciDevice(address, pci_class=sysfs.read(f"{PCI_DEVICES}/{address}/class", ""),
                     driver=_driver(sysfs, address))
    return not _viable(peer)


def _driver(sysfs: SysFS, address: str) -> str | None:
    return sysfs.link_name(f"{PCI_DEVICES}/{address}/driver")


def _override(sysfs: SysFS, address: str) -> str | None:
    value = sysfs.read(f"{PCI_DEVICES}/{address}/driver_override")
    return None if value in (None, "", "(null)") else value


# -- doing and undoing -------------------------------------------------------

class _StepFailed(Exception):
    """One sysfs write (or its check) failed; the text names the file."""


def _write(sysfs: SysFS, path: str, value: str) -> None:
    try:
        sysfs.write(path, value)
    except OSError as e:
        code = errno.errorcode.get(e.errno, str(e.errno))
        raise _StepFailed(f"writing '{value.strip()}' to {path}: "
                          f"{e.strerror or e} ({code})") from None


def _expect(sysfs: SysFS, address: str, want: str | None, after: str) -> None:
    now = _driver(sysfs, address)
    if now != want:
        raise _StepFailed(f"{address} is on {now or 'no driver'} after writing {after}, "
                          f"not {want or 'no driver'} (dmesg says why)")


def bind_to_vfio(sysfs: SysFS, target: BindRecord | str) -> BindRecord:
    """Move the device (and the peers its record names) to vfio-pci; on a failure
    put back what moved and raise ActionFailed.  Pass the record from
    `plan_bind`, persisted first, so an interrupted run can be undone; an
    address plans on the spot."""
    record = target if isinstance(target, BindRecord) else plan_bind(sysfs, target)
    if not sysfs.exists(f"{PCI_DRIVERS}/{VFIO}"):
        raise ActionFailed(f"cannot bind {record.address}: vfio-pci is not loaded "
                           f"({PCI_DRIVERS}/{VFIO} is missing)", hint="modprobe vfio-pci")
    moved: list[BindRecord] = []
    for dev in record.devices():
        moved.append(dev)
        try:
            _bind_one(sysfs, dev.address)
        except _StepFailed as failure:
            what = dev.address if dev is record else \
                f"{dev.address} (IOMMU group peer of {record.address})"
            raise ActionFailed(f"binding {what} to vfio-pci failed: {failure}; "
                               + _roll_back(sysfs, moved)) from None
    return record


def _bind_one(sysfs: SysFS, address: str) -> None:
    current = _driver(sysfs, address)
    if current == VFIO:
        return
    if _override(sysfs, address) != VFIO:
        _write(sysfs, f"{PCI_DEVICES}/{address}/driver_override", VFIO)
    if current is not None:
        _write(sysfs, f"{PCI_DRIVERS}/{current}/unbind", address)
    _write(sysfs, DRIVERS_PROBE, address)
    _expect(sysfs, address, VFIO, DRIVERS_PROBE)


def _roll_back(sysfs: SysFS, moved: list[BindRecord]) -> str:
    failures = _restore_all(sysfs, moved)
    if failures:
        return "rolling back failed too: " + "; ".join(failures)
    return "rolled back: " + ", ".join(
        f"{d.address} is on {d.driver or 'no driver'} again" for d in moved)


def restore_driver(sysfs: SysFS, record: BindRecord) -> None:
    """Put the device (and its moved peers) back where `record` says they were;
    a device already there is left alone.  Raises ActionFailed naming the file
    that failed and where the device is now."""
    failures = _restore_all(sysfs, list(record.devices()))
    if failures:
        raise ActionFailed(f"returning {record.address} to {record.driver or 'no driver'} "
                           "failed: " + "; ".join(failures))


def _restore_all(sysfs: SysFS, records: list[BindRecord]) -> list[str]:
    # Best effort, in reverse: one device that will not go back must not keep
    # the others on vfio-pci.
    failures = []
    for rec in reversed(records):
        try:
            _restore_one(sysfs, rec)
        except _StepFailed as failure:
            failures.append(f"{failure} ({rec.address} is now on "
                            f"{_driver(sysfs, rec.address) or 'no driver'})")
    return failures


def _restore_one(sysfs: SysFS, rec: BindRecord) -> None:
    address = rec.address
    current = _driver(sysfs, address)
    if current not in (rec.driver, VFIO, None):
        # Someone else bound it since: unbinding a driver we did not put there
        # could take a disk away from the host.
        raise _StepFailed(f"{address} is on {current}, where vstor did not put it: left alone")
    if _override(sysfs, address) != rec.driver_override:
        _write(sysfs, f"{PCI_DEVICES}/{address}/driver_override", rec.driver_override or "\n")
    if current == rec.driver:
        return
    if current == VFIO:
        _write(sysfs, f"{PCI_DRIVERS}/{VFIO}/unbind", address)
    if rec.driver is not None:
        # With the override back to what it was, the original driver matches again.
        _write(sysfs, DRIVERS_PROBE, address)
    _expect(sysfs, address, rec.driver,
            DRIVERS_PROBE if rec.driver else f"{PCI_DRIVERS}/{VFIO}/unbind")
