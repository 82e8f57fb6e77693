"""nvmf-export: a bdev exported over NVMe-oF by this host's SPDK for a
migration's destination (local NVMe made migratable)."""

from __future__ import annotations

from vstor.errors import ActionFailed
from vstor.records import record
from vstor.runtime.kinds.base import Kind, rpc_line


@record
class NvmfExport(Kind):
    """One subsystem, its one namespace, one listener, and only the
    migration's own host NQN allowed (never allow_any_host;
    migration.source.new_hostnqn).  SPDK takes the namespace only after the
    vhost controller has the bdev (the other order fails: "already
    claimed")."""
    nqn: str
    bdev: str
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: int
    host: str
    kind = "nvmf-export"
    whole_domain = True     # made by a migration's preparation, for the domain: no attach undoes it
    # Under the host lock: SPDK's NVMe-oF target is the host's, shared by every domain's exports.
    rpc_methods = ("nvmf_create_transport", "nvmf_create_subsystem", "nvmf_subsystem_add_ns",
                   "nvmf_subsystem_add_listener", "nvmf_subsystem_add_host",
                   "nvmf_delete_subsystem", "nvmf_get_subsystems")

    def describe(self) -> str:
        return (f"export bdev {self.bdev} over NVMe-oF as {self.nqn} on {self.trtype} "
                f"{self.traddr}:{self.trsvcid} for {self.host}")

    def listen_address(self) -> dict:
        return {"trtype": self.trtype, "adrfam": self.adrfam, "traddr": self.traddr,
                "trsvcid": str(self.trsvcid)}

    def dry_run(self) -> list[str]:
        return [rpc_line("nvmf_create_transport", {"trtype": self.trtype}),
                rpc_line("nvmf_create_subsystem", {"nqn": self.nqn, "allow_any_host": False}),
                rpc_line("nvmf_subsystem_add_ns", {"nqn": self.nqn, "namespace": {"bdev_name": self.bdev, "nsid": 1}}),
                rpc_line("nvmf_subsystem_add_listener", {"nqn": self.nqn, "listen_address": self.listen_address()}),
                rpc_line("nvmf_subsystem_add_host", {"nqn": self.nqn, "host": self.host})]

    def to_data(self) -> dict:
        return {"nqn": self.nqn, "bdev": self.bdev, "trtype": self.trtype, "adrfam": self.adrfam,
                "traddr": self.traddr, "trsvcid": self.trsvcid, "host": self.host}

    @classmethod
    def from_data(cls, d: dict) -> "NvmfExport":
        return cls(str(d["nqn"]), str(d["bdev"]), str(d["trtype"]), str(d["adrfam"]),
                   str(d["traddr"]), int(d["trsvcid"]), str(d["host"]))

    def makes(self) -> str:
        return self.nqn

    # preflight: the default (the migration's own preflight checked both ends)

    # observe: the default (its undo tells vstor's subsystem by its serial number)

    def do(self, rt) -> None:
        """Look, then make what is missing: a re-run after a crash finds its
        own subsystem; one of that name serving another bdev is not vstor's
        export."""
        spdk = rt.spdk
        try:
            spdk.nvmf_create_transport(self.trtype)
        except Exception as e:      # SPDK keeps one transport per type: "already exists"
            if "already exists" not in str(e):
                raise
        found = spdk.nvmf_get_subsystems(self.nqn)
        if not found:
            spdk.nvmf_create_subsystem(self.nqn, serial_number=_serial(self.nqn),
                                       model_number="vstor migration export", allow_any_host=False)
            found = spdk.nvmf_get_subsystems(self.nqn)
        sub = found[0] if found else {}
        namespaces = {ns.get("bdev_name") for ns in sub.get("namespaces", ())}
        fix = f"rpc.py nvmf_delete_subsystem {self.nqn} if nothing uses it"
        if namespaces - {self.bdev}:
            raise ActionFailed(f"SPDK's NVMe-oF subsystem {self.nqn} serves "
                               f"{', '.join(sorted(namespaces))}, not {self.bdev}", hint=fix)
        admitted = {h.get("nqn") for h in sub.get("hosts", ())} - {self.host}
        if sub.get("allow_any_host") or admitted:
            # Only the migration's own host NQN: any other admitted could reach the disk.
            raise ActionFailed(f"SPDK's NVMe-oF subsystem {self.nqn} admits "
                               f"{'any host' if sub.get('allow_any_host') else ', '.join(sorted(admitted))}, "
                               f"not only {self.host}", hint=fix)
        if not namespaces:
            spdk.nvmf_subsystem_add_ns(self.nqn, self.bdev, nsid=1)
        if not any(la.get("traddr") == self.traddr and str(la.get("trsvcid")) == str(self.trsvcid)
                   for la in sub.get("listen_addresses", ())):
            spdk.nvmf_subsystem_add_listener(self.nqn, self.trtype, self.traddr, str(self.trsvcid),
                                             adrfam=self.adrfam)
        if self.host not in {h.get("nqn") for h in sub.get("hosts", ())}:
            spdk.nvmf_subsystem_add_host(self.nqn, self.host)

    def undo(self, rt, others) -> None:
        spdk = rt.spdk
        found = spdk.nvmf_get_subsystems(self.nqn)
        if found and found[0].get("serial_number") == _serial(self.nqn):    # vstor's, not one refused
            spdk.nvmf_delete_subsystem(self.nqn)     # its namespace, listener and host go with it

    # undo_waits: the default (RPCs: nothing to wait for beside the others)

    # in_use: the default (QEMU here does not use it; the migration's destination does)

    def check(self, rt) -> str | None:
        return None if rt.spdk.nvmf_get_subsystems(self.nqn) else f"SPDK has no NVMe-oF subsystem {self.nqn}"


def _serial(nqn: str) -> str:
    import hashlib      # NVMe: 20 ASCII; tells vstor's export from another's
    return "VS" + hashlib.sha256(nqn.encode()).hexdigest()[:18].upper()
