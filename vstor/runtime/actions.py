"""From a plan to the host changes that carry it out: typed, pure records.

`build(plan, cfg)` is a function of the plan and the config alone: it reads
nothing and decides nothing (every decision is in the plan).  Each record
knows how to describe itself and what a dry run shows for it; doing it is
vstor.runtime.steps' job.  On disk (the journal) a record is JSON through
`to_json`/`from_json`, in the same shapes earlier vstor versions wrote.
"""

from __future__ import annotations

import json
import os

from vstor.backends.qsd.export import QsdExport as QsdSpec
from vstor.backends.vfio_record import BindRecord, record_from_json, record_to_json
from vstor.errors import ActionFailed, VstorError
from vstor.records import record, replace

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing (every hook imports this)
if TYPE_CHECKING:   # the plan's declarations (lxml) only where a plan is read
    from vstor.config import Config
    from vstor.meta.plan import AttachPath, Plan


@record
class VfioBind:
    """A controller on vfio-pci (passthrough, or SPDK's PCIe driver).
    `original` is where it and its IOMMU group peers were, read before the
    record is written (steps.observe)."""
    address: str
    original: BindRecord | None = None
    kind = "vfio-bind"

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


@record
class SpdkAttach:
    """An SPDK bdev_nvme controller with every path; shared by the vstor
    domains that use it, detached by the last."""
    name: str
    paths: tuple[AttachPath, ...]
    # A controller of that name was in SPDK before this step and no vstor
    # record held it: used, never detached (vstor did not make it).
    found: bool = False
    kind = "spdk-attach"
    rpc_methods = ("bdev_nvme_attach_controller", "bdev_nvme_get_controllers",
                   "bdev_nvme_detach_controller")

    def describe(self) -> str:
        return f"attach SPDK NVMe controller {self.name}"

    def dry_run(self) -> list[str]:
        return [_rpc("bdev_nvme_attach_controller", p.params(self.name)) for p in self.paths]

    def to_data(self) -> dict:
        data = {"name": self.name, "paths": [p.params(self.name) for p in self.paths]}
        return {**data, "found": True} if self.found else data

    @classmethod
    def from_data(cls, d: dict) -> "SpdkAttach":
        from vstor.meta.plan import AttachPath
        paths = []
        for p in d["paths"]:
            p = {k: v for k, v in p.items() if k != "name"}
            if "trsvcid" in p:
                p["trsvcid"] = int(p["trsvcid"])
            paths.append(AttachPath(**p))
        return cls(d["name"], tuple(paths), found=d.get("found") is True)


@record
class SpdkVhost:
    """An SPDK vhost-blk controller serving one bdev on one reactor; its
    socket handed to the QEMU group only."""
    ctrlr: str
    bdev: str
    reactor: int
    readonly: bool
    socket: str
    group: str
    kind = "spdk-vhost"
    rpc_methods = ("vhost_create_blk_controller", "vhost_get_controllers", "vhost_delete_controller")

    @property
    def cpumask(self) -> str:
        return hex(1 << self.reactor)

    def describe(self) -> str:
        return f"create SPDK vhost controller {self.ctrlr} for bdev {self.bdev}"

    def dry_run(self) -> list[str]:
        params = {"ctrlr": self.ctrlr, "dev_name": self.bdev, "cpumask": self.cpumask}
        if self.readonly:
            params["readonly"] = True
        return [f"install -d -o root -g {self.group} -m 0750 {os.path.dirname(self.socket)}",
                _rpc("vhost_create_blk_controller", params),
                f"chown root:{self.group} {self.socket}", f"chmod 0660 {self.socket}"]

    def to_data(self) -> dict:
        return {"ctrlr": self.ctrlr, "bdev": self.bdev, "cpumask": self.cpumask,
                "readonly": self.readonly, "socket": self.socket, "group": self.group}

    @classmethod
    def from_data(cls, d: dict) -> "SpdkVhost":
        mask = int(d["cpumask"], 16)
        if mask <= 0 or mask & (mask - 1):
            raise ActionFailed(f"state record: SPDK cpumask {d['cpumask']!r} is not one core")
        return cls(d["ctrlr"], d["bdev"], mask.bit_length() - 1, bool(d["readonly"]),
                   d["socket"], d["group"])


@record
class QsdExport:
    """A qemu-storage-daemon exporting one file or block device."""
    export: QsdSpec
    kind = "qsd-export"

    def describe(self) -> str:
        return f"start qemu-storage-daemon for {self.export.source} on {self.export.socket_path}"

    def dry_run(self) -> list[str]:
        return self.export.dry_run_lines()

    def to_data(self) -> dict:
        return self.export.to_record()

    @classmethod
    def from_data(cls, d: dict) -> "QsdExport":
        return cls(QsdSpec.from_record(d))


@record
class NvmfExport:
    """A bdev exported over NVMe-oF by this host's SPDK for a migration's
    destination (local NVMe made migratable): one subsystem, its one
    namespace, one listener, and only the migration's own host NQN allowed
    (never allow_any_host; migration.source.new_hostnqn).  SPDK takes the namespace only after the vhost
    controller has the bdev (the other order fails: "already claimed")."""
    nqn: str
    bdev: str
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: int
    host: str
    kind = "nvmf-export"
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
        return [_rpc("nvmf_create_transport", {"trtype": self.trtype}),
                _rpc("nvmf_create_subsystem", {"nqn": self.nqn, "allow_any_host": False}),
                _rpc("nvmf_subsystem_add_ns", {"nqn": self.nqn, "namespace": {"bdev_name": self.bdev, "nsid": 1}}),
                _rpc("nvmf_subsystem_add_listener", {"nqn": self.nqn, "listen_address": self.listen_address()}),
                _rpc("nvmf_subsystem_add_host", {"nqn": self.nqn, "host": self.host})]

    def to_data(self) -> dict:
        return {"nqn": self.nqn, "bdev": self.bdev, "trtype": self.trtype, "adrfam": self.adrfam,
                "traddr": self.traddr, "trsvcid": self.trsvcid, "host": self.host}

    @classmethod
    def from_data(cls, d: dict) -> "NvmfExport":
        return cls(str(d["nqn"]), str(d["bdev"]), str(d["trtype"]), str(d["adrfam"]),
                   str(d["traddr"]), int(d["trsvcid"]), str(d["host"]))


Action = VfioBind | SpdkAttach | SpdkVhost | QsdExport | NvmfExport
KINDS = {cls.kind: cls for cls in (VfioBind, SpdkAttach, SpdkVhost, QsdExport, NvmfExport)}


def to_json(action: Action, state: str) -> dict:
    return {"kind": action.kind, "state": state, "data": action.to_data()}


def from_json(entry: dict) -> Action:
    try:
        return KINDS[entry["kind"]].from_data(entry["data"])
    except (KeyError, TypeError, ValueError, AttributeError, VstorError) as e:
        raise ActionFailed(f"state record holds a step vstor cannot read "
                           f"({entry.get('kind')!r}: {type(e).__name__} {e})",
                           hint="it was written by another vstor version") from None


_KEYS = {"vfio-bind": lambda a: a.address, "spdk-attach": lambda a: a.name,
         "spdk-vhost": lambda a: a.ctrlr, "qsd-export": lambda a: a.export.name,
         "nvmf-export": lambda a: a.nqn}


def identity(action: Action) -> tuple[str, str]:
    """What a step makes, whatever it observed: (kind, name); two steps with
    one identity make the same thing (a controller two disks share)."""
    return action.kind, _KEYS[action.kind](action)


def build(plan: Plan, cfg: Config) -> list[Action]:
    """The host changes, in order, that carry out `plan`."""
    out: list[Action] = []
    bound: set[str] = set()
    attached: set[str] = set()
    for disk in plan.disks:
        if disk.bind and disk.controller not in bound:
            out.append(VfioBind(disk.controller))
            bound.add(disk.controller)
        if disk.backend == "spdk":
            if disk.spdk_controller not in attached:
                out.append(SpdkAttach(disk.spdk_controller, disk.attach))
                attached.add(disk.spdk_controller)
            out.append(SpdkVhost(disk.vhost_name, disk.bdev, disk.reactor, disk.readonly,
                                 disk.socket, cfg.qemu_group))
        elif disk.backend == "qsd":
            src = disk.source
            kind, path = ("block", disk.device) if src.kind == "nvme" else (src.kind, src.path)
            out.append(QsdExport(QsdSpec(
                run_dir=cfg.qsd_dir, name=disk.vhost_name, source=path, kind=kind,
                socket_path=disk.socket, readonly=disk.readonly, queues=disk.queues,
                qemu_user=cfg.qemu_user, qemu_group=cfg.qemu_group,
                cpus=tuple(plan.emulator))))
    return out


def with_original(action: VfioBind, original: BindRecord) -> VfioBind:
    return replace(action, original=original)


def _rpc(method: str, params: dict) -> str:
    return "SPDK RPC: " + json.dumps({"method": method, "params": params}, sort_keys=True)
