"""vfio-bind: a controller moved to vfio-pci, for passthrough or for SPDK's
PCIe driver, and put back where it was."""

from __future__ import annotations

from vstor.backends.vfio_record import BindRecord, record_from_json, record_to_json
from vstor.records import record, replace
from vstor.runtime.kinds.base import Kind


@record
class VfioBind(Kind):
    """A controller on vfio-pci, with its IOMMU group peers.  `original` is
    where they were, read before the record is written (observe)."""
    address: str
    original: BindRecord | None = None
    kind = "vfio-bind"
    # Not private (the default): two domains' SPDK disks can sit on one controller.

    def describe(self) -> str:
        return f"bind {self.address} to vfio-pci"

    def dry_run(self) -> list[str]:
        dev = f"/sys/bus/pci/devices/{self.address}"
        return [f"echo vfio-pci > {dev}/driver_override",
                f"echo {self.address} > {dev}/driver/unbind",
                f"echo {self.address} > /sys/bus/pci/drivers_probe"]

    def to_data(self) -> dict:
        return record_to_json(self.original) if self.original else {"address": self.address}

    @classmethod
    def from_data(cls, d: dict) -> "VfioBind":
        return cls(d["address"], record_from_json(d) if "peers" in d else None)

    def makes(self) -> str:
        return self.address

    # preflight: the default (the planner placed the controller; nothing to open)

    def observe(self, rt, others) -> "VfioBind":
        """With where the controller is now.  A controller another domain's
        record already moved keeps that record's original: where it was
        before vstor, not vfio-pci (whichever domain releases last puts it
        back)."""
        if self.original is not None:
            return self
        theirs = others.step(self.kind, self.address, finished_only=False)
        if theirs is not None and "peers" in theirs["data"]:
            return replace(self, original=self.from_data(theirs["data"]).original)
        return replace(self, original=rt.vfio.plan(self.address))

    def do(self, rt) -> None:
        rt.vfio.bind(self.original or self.address)

    def undo(self, rt, others) -> None:
        if others.step(self.kind, self.address, finished_only=True) is not None:
            return      # another domain's SPDK still needs it on vfio-pci
        if self.original is not None:
            rt.vfio.restore(self.original)

    # undo_waits: the default (sysfs writes: nothing to wait for beside the others)

    # in_use: the default (a binding has no client vstor can count)

    def check(self, rt) -> str | None:
        driver = rt.sysfs.link_name(f"/sys/bus/pci/devices/{self.address}/driver")
        return None if driver == "vfio-pci" else f"{self.address} is on {driver or 'no driver'}"

    def repair(self, rt) -> None:
        self.do(rt)
