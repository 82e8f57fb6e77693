"""Where a PCI device was before vstor moved it to vfio-pci: taken before the
first write and kept in the journal, so the undo knows where to return it.
Pure data (the pure step records hold it)."""

from __future__ import annotations

from vstor.records import record



@record
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
