"""Passing an NVMe controller to vfio-pci and giving it back, through sysfs.

Whether a controller may leave the host is the planner's question
(vstor.planner.passthrough, pure); `plan_bind` records where a controller (and the IOMMU group
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
  not: whether that is safe is the planner's question, asked first.
"""

from __future__ import annotations

import errno

from vstor.backends.vfio_record import BindRecord
from vstor.errors import ActionFailed
from vstor.host.model import PciDevice
from vstor.host.sysfs import SysFS
from vstor.meta.names import normalise_bdf
from vstor.planner.passthrough import VFIO, viable as _viable
from vstor.records import replace

PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"


# -- the record --------------------------------------------------------------

def plan_bind(sysfs: SysFS, address: str) -> BindRecord:
    """Read (write nothing) where `address` and its group peers are now."""
    address = normalise_bdf(address)
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
