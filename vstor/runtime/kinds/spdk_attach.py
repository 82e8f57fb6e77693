"""spdk-attach: an SPDK bdev_nvme controller with every path of one disk's
NVMe (local PCIe or NVMe-oF), shared by the vstor domains that use it and
detached by the last."""

from __future__ import annotations

from vstor.errors import ActionFailed, DoesNotFit
from vstor.meta.names import nvme_path
from vstor.records import record, replace
from vstor.runtime.kinds.base import Kind, rpc_line

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing (every hook imports this)
if TYPE_CHECKING:
    from vstor.meta.plan import AttachPath


@record
class SpdkAttach(Kind):
    """An SPDK NVMe controller named `name`, with `paths`."""
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
        return [rpc_line("bdev_nvme_attach_controller", p.params(self.name)) for p in self.paths]

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

    def makes(self) -> str:
        return self.name

    # preflight: the default (SPDK is asked in observe, once the start is decided)

    def observe(self, rt, others) -> "SpdkAttach":
        """Whether SPDK had the controller before vstor (`found`), unless
        another domain's record holds it; a path another controller has is
        refused here, before anything changes."""
        if others.step(self.kind, self.name, finished_only=False) is not None:
            return self
        every = rt.spdk.get_nvme_controllers()
        _refuse_taken_paths(self, every)
        return replace(self, found=any(c.get("name") == self.name for c in every))

    def do(self, rt) -> None:
        """Attach every path, or add the ones a controller of that name lacks
        (an interrupted run, a path SPDK dropped).  A controller of that name
        with a path the plan does not have is not the connection the name
        stands for: refused, never merged."""
        spdk = rt.spdk
        found = spdk.get_nvme_controllers(self.name)
        missing, foreign = _path_difference(self, found) if found else (self.paths, [])
        if foreign:
            raise ActionFailed(f"SPDK's NVMe controller {self.name} has a path the plan does not: "
                               f"{foreign[0]}", hint=f"detach it (rpc.py bdev_nvme_detach_controller "
                                                     f"{self.name}) if nothing uses it")
        for path in missing:
            spdk.attach_nvme_controller(**path.params(self.name))

    def undo(self, rt, others) -> None:
        if self.found or others.step(self.kind, self.name, finished_only=True) is not None:
            return      # not vstor's, or another domain's disks still use it
        spdk = rt.spdk
        if spdk.get_nvme_controllers(self.name):
            spdk.detach_nvme_controller(self.name)

    # undo_waits: the default (RPCs: nothing to wait for beside the others)

    # in_use: the default (QEMU connects to the vhost controllers on it (spdk-vhost), not to it)

    def check(self, rt) -> str | None:
        found = rt.spdk.get_nvme_controllers(self.name)
        if not found:
            return f"SPDK has no NVMe controller {self.name}"
        missing, foreign = _path_difference(self, found)
        if foreign:
            return f"SPDK's NVMe controller {self.name} has a path the plan does not: {foreign[0]}"
        if missing:
            p = missing[0]
            return (f"SPDK's NVMe controller {self.name} lost its path "
                    f"{nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, None)}")
        return None


def _refuse_taken_paths(a: SpdkAttach, controllers: list[dict]) -> None:
    """SPDK keeps one controller per path (transport ID and host NQN): a path
    another controller already has cannot be attached under this name, and
    sharing that controller would give the disk another connection's
    settings.  Refused before anything changes."""
    for ctrl in controllers:
        if ctrl.get("name") == a.name:
            continue
        for theirs, host in _paths_of(ctrl):
            for p in a.paths:
                if (nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn) == theirs
                        and (p.trtype == "PCIe" or not (p.hostnqn and host) or p.hostnqn == host)):
                    raise DoesNotFit(
                        f"SPDK's NVMe controller {ctrl.get('name')} already has the path "
                        f"{nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, host)} that {a.name} "
                        "needs, and SPDK keeps one controller per path and host NQN",
                        hint="give the disk the same paths and reconnect settings as the disks "
                             "using it, or another hostnqn; or detach it (rpc.py "
                             f"bdev_nvme_detach_controller {ctrl.get('name')}) if nothing uses it")


def _paths_of(ctrl: dict) -> list[tuple[str, str | None]]:
    """(path, host NQN) of each path of one bdev_nvme_get_controllers entry
    (a failover controller lists its other paths as alternate_trids)."""
    out = []
    for c in ctrl.get("ctrlrs", ()):
        host = (c.get("host") or {}).get("nqn")
        for t in [c.get("trid") or {}, *c.get("alternate_trids", ())]:
            out.append((nvme_path(t.get("trtype"), t.get("traddr"), t.get("trsvcid"), t.get("subnqn")), host))
    return out


def _path_difference(a: SpdkAttach, found: list[dict]):
    """(paths of the plan SPDK lacks, paths SPDK has that the plan does not),
    from bdev_nvme_get_controllers: each path's trid and host NQN."""
    have = {key: host for ctrl in found for key, host in _paths_of(ctrl)}
    missing, mine = [], set()
    for p in a.paths:
        key = nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, None)
        mine.add(key)
        if key not in have:
            missing.append(p)
        elif p.hostnqn and have[key] and have[key] != p.hostnqn:
            return [], [nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, have[key])]
    return missing, [k for k in have if k not in mine]
