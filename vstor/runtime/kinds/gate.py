"""gate: the file a domain's QEMU reads before it creates any device
(vstor's fw_cfg entry, vstor.meta.names.GATE_FWCFG), written last by the
prepare and removed first by the release: a start that vstor's hook did
not prepare (no hook, a removed package) fails at once, naming vstor, where
QEMU would otherwise wait for the vhost-user sockets for ever."""

from __future__ import annotations

from vstor.records import record
from vstor.runtime.kinds.base import Kind


@record
class Gate(Kind):
    path: str
    domain: str
    group: str = "kvm"
    kind = "gate"
    private = True      # the domain's own file: no other domain's plan depends on it
    # Written beside the domain's last daemons (one journal write fewer per
    # start and stop): QEMU reads it only once the whole prepare has returned,
    # and a failure of any step of the group removes it with the rest.
    parallel = True
    whole_domain = True

    def describe(self) -> str:
        return f"mark {self.domain} prepared for QEMU ({self.path})"

    def dry_run(self) -> list[str]:
        return [f"write {self.path} (QEMU reads it first: fw_cfg opt/dev.vstor/prepared)"]

    def to_data(self) -> dict:
        return {"path": self.path, "domain": self.domain, "group": self.group}

    @classmethod
    def from_data(cls, d: dict) -> "Gate":
        return cls(str(d["path"]), str(d["domain"]), str(d.get("group", "kvm")))

    def makes(self) -> str:
        return self.path

    def do(self, rt) -> None:
        rt.ownership.mark(self.path, self.group)

    def undo(self, rt, others) -> None:
        rt.ownership.unmark(self.path)

    def check(self, rt) -> str | None:
        return None if rt.ownership.marked(self.path) else f"{self.path}, which QEMU's start reads, is gone"
