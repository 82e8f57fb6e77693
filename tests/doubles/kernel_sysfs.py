"""TEST DOUBLE: a SysFS over a temporary tree whose writes to the PCI control
files behave like the kernel's, so vfio binding can be tested without a kernel.

Not a kernel: it models only what vstor writes, after the driver core
(drivers/base/bus.c, dd.c) and the PCI core (drivers/pci/pci-driver.c,
pci-sysfs.c):

- `/sys/bus/pci/drivers/<drv>/unbind` with a device not bound to <drv> (or no
  such device) fails with ENODEV; otherwise the device's `driver` symlink and
  the driver directory's link to the device disappear.
- `/sys/bus/pci/drivers_probe` with an unknown device fails with ENODEV; a
  device that has a driver is left alone; an unbound one goes to the driver
  named in its `driver_override` when set (and stays unbound if no such driver
  is loaded: the override is then the only driver allowed to match), else to
  its native driver (the one whose id table matches it: nvme for an NVMe
  controller).  A driver whose probe fails leaves the device unbound and the
  write still succeeds, as the driver core only logs probe errors; vfio-pci's
  probe fails for a device without an IOMMU group and for a bridge, and
  `refuse_probe()` makes any driver fail for a device.
- `driver_override` takes a driver name; a write of only '\\n' clears it, and
  a cleared one reads '(null)'.  Writing '' through `write()` changes nothing:
  Python's write('') never makes a write(2) call, so the kernel never sees it.
- `bind`, `new_id` and `remove_id` are not modelled: writing them raises
  NotImplementedError rather than pretending.

Faults: `fail_write(nth=N)` makes the Nth write from now raise OSError,
`fail_write(path=P)` makes writes to P (as given, or the file it resolves to)
raise; each fires `times` times (None: always).  Every successful write is
logged in `writes` as (host path as given, value).

Two ways to get one: `KernelSysfsDouble.build(root, [PciSpec(...), ...])`
writes a minimal tree first; `KernelSysfsDouble(root)` takes an existing tree
(e.g. one from a layout builder) as it is.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from vstor.host.sysfs import SysFS

PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
DEFAULT_DRIVERS = ("nvme", "vfio-pci", "pcieport")
NATIVE_BY_CLASS = {"0x010802": "nvme", "0x060400": "pcieport"}


@dataclass(frozen=True)
class PciSpec:
    """One PCI function of the tree `build` writes."""
    address: str                    # '0000:5e:00.0'
    pci_class: str = "0x010802"
    driver: str | None = None       # bound at the start
    native: str | None = None       # default: by class (nvme, pcieport)
    iommu_group: int | None = None
    parent: str | None = None       # upstream bridge's address (also a PciSpec)
    driver_override: str | None = None
    numa_node: int = -1
    vendor: str = "0x8086"
    device: str = "0x0a54"


@dataclass
class _Fault:
    nth: int | None         # the write number (since creation) that fails
    path: str | None
    err: int
    times: int | None       # how many more times it fires; None: always


class KernelSysfsDouble(SysFS):
    def __init__(self, root: str, native: dict[str, str | None] | None = None):
        super().__init__(root)
        self.writes: list[tuple[str, str]] = []
        self._attempts = 0
        self._faults: list[_Fault] = []
        self._refused: set[tuple[str, str]] = set()
        self._native = dict(native or {})
        for address in self.listdir(PCI_DEVICES):
            if address not in self._native:
                self._native[address] = self._guess_native(address)

    # -- building --------------------------------------------------------

    @classmethod
    def build(cls, root: str, devices: list[PciSpec],
              drivers: tuple[str, ...] = DEFAULT_DRIVERS) -> "KernelSysfsDouble":
        plain = SysFS(root)
        for drv in drivers:
            for name in ("bind", "unbind", "new_id", "remove_id"):
                _put(plain, f"{PCI_DRIVERS}/{drv}/{name}", "")
        _put(plain, DRIVERS_PROBE, "")
        _put(plain, "/sys/bus/pci/drivers_autoprobe", "1\n")
        by_address = {d.address: d for d in devices}
        for spec in devices:
            _write_device(plain, spec, _device_dir(spec, by_address))
        return cls(root, {d.address: d.native or NATIVE_BY_CLASS.get(d.pci_class)
                          for d in devices})

    def _guess_native(self, address: str) -> str | None:
        driver = self.driver_of(address)
        if driver and driver != "vfio-pci":
            return driver
        return NATIVE_BY_CLASS.get(self.read(f"{PCI_DEVICES}/{address}/class", ""))

    # -- test controls ---------------------------------------------------

    def fail_write(self, *, nth: int | None = None, path: str | None = None,
                   err: int = errno.EIO, times: int | None = 1) -> None:
        if (nth is None) == (path is None):
            raise ValueError("give nth or path")
        if nth is not None:
            nth += self._attempts       # counted from now
        self._faults.append(_Fault(nth, path, err, times))

    def refuse_probe(self, address: str, driver: str) -> None:
        self._refused.add((address, driver))

    def driver_of(self, address: str) -> str | None:
        return self.link_name(f"{PCI_DEVICES}/{address}/driver")

    def override_of(self, address: str) -> str | None:
        return self.read(f"{PCI_DEVICES}/{address}/driver_override")

    # -- the kernel's side of write(2) -----------------------------------

    def write(self, host_path: str, value: str) -> None:
        if value == "":
            return      # no write(2) happens at all
        self._attempts += 1
        real = self.resolve(host_path)
        self._maybe_fail(host_path, real)
        if real is None:
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), self.path(host_path))
        self._store(real, value)
        self.writes.append((host_path, value))

    def _maybe_fail(self, given: str, real: str | None) -> None:
        for fault in self._faults:
            hit = (fault.nth == self._attempts if fault.nth is not None
                   else fault.path in (given, real))
            if hit and fault.times != 0:
                if fault.times is not None:
                    fault.times -= 1
                raise OSError(fault.err, os.strerror(fault.err))

    def _store(self, real: str, value: str) -> None:
        name = _kernel_string(value)
        parent, leaf = os.path.split(real)
        if real == DRIVERS_PROBE:
            return self._probe(name)
        if os.path.dirname(parent) == PCI_DRIVERS:
            if leaf == "unbind":
                return self._unbind(os.path.basename(parent), name)
            if leaf in ("bind", "new_id", "remove_id"):
                raise NotImplementedError(f"the double does not model {real}")
        if leaf == "driver_override":
            with open(self.path(real), "w") as f:
                f.write((name or "(null)") + "\n")
            return
        with open(self.path(real), "w") as f:
            f.write(value)

    def _unbind(self, driver: str, address: str) -> None:
        if self.driver_of(address) != driver:
            # drivers/base/bus.c unbind_store: not bound to this driver
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        os.unlink(self.path(f"{self._device_dir(address)}/driver"))
        os.unlink(self.path(f"{PCI_DRIVERS}/{driver}/{address}"))

    def _probe(self, address: str) -> None:
        if not self.exists(f"{PCI_DEVICES}/{address}"):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        if self.driver_of(address) is not None:
            return      # bus_rescan_devices_helper only attaches unbound devices
        override = self.override_of(address)
        driver = override if override not in (None, "(null)") else self._native.get(address)
        if driver is None or not self.is_dir(f"{PCI_DRIVERS}/{driver}"):
            return
        if not self._probe_succeeds(address, driver):
            return      # really_probe: error logged, write still succeeds
        _attach(self, self._device_dir(address), driver)

    def _probe_succeeds(self, address: str, driver: str) -> bool:
        if (address, driver) in self._refused:
            return False
        if driver == "vfio-pci":
            # vfio_pci_probe: only normal-header functions in an IOMMU group
            is_bridge = self.read(f"{PCI_DEVICES}/{address}/class", "").startswith("0x0604")
            has_group = self.exists(f"{PCI_DEVICES}/{address}/iommu_group")
            return has_group and not is_bridge
        return True

    def _device_dir(self, address: str) -> str:
        return self.resolve(f"{PCI_DEVICES}/{address}")


def _kernel_string(value: str) -> str:
    """What a store() sees: the kernel strips one trailing newline."""
    return value[:-1] if value.endswith("\n") else value


def _put(sysfs: SysFS, host_path: str, text: str) -> None:
    path = sysfs.path(host_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _link(sysfs: SysFS, host_link: str, host_target: str) -> None:
    """A relative symlink, as sysfs shows them (../../../devices/...)."""
    link = sysfs.path(host_link)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.relpath(host_target, os.path.dirname(host_link)), link)


def _attach(sysfs: SysFS, device_dir: str, driver: str) -> None:
    address = os.path.basename(device_dir)
    _link(sysfs, f"{device_dir}/driver", f"{PCI_DRIVERS}/{driver}")
    _link(sysfs, f"{PCI_DRIVERS}/{driver}/{address}", device_dir)


def _device_dir(spec: PciSpec, by_address: dict[str, PciSpec]) -> str:
    if spec.parent is None:
        domain, bus, _ = spec.address.split(":")
        return f"/sys/devices/pci{domain}:{bus}/{spec.address}"
    return f"{_device_dir(by_address[spec.parent], by_address)}/{spec.address}"


def _write_device(sysfs: SysFS, spec: PciSpec, dev: str) -> None:
    for name, text in (("vendor", spec.vendor), ("device", spec.device),
                       ("class", spec.pci_class), ("numa_node", str(spec.numa_node)),
                       ("driver_override", spec.driver_override or "(null)")):
        _put(sysfs, f"{dev}/{name}", text + "\n")
    _link(sysfs, f"{PCI_DEVICES}/{spec.address}", dev)
    if spec.iommu_group is not None:
        group = f"/sys/kernel/iommu_groups/{spec.iommu_group}"
        _link(sysfs, f"{dev}/iommu_group", group)
        _link(sysfs, f"{group}/devices/{spec.address}", dev)
    if spec.driver is not None:
        _attach(sysfs, dev, spec.driver)
