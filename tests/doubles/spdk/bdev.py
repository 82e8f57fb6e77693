"""bdevs: malloc bdevs, and NVMe controllers attached with bdev_nvme (local
PCIe from the ``add_pcie`` inventory, NVMe-oF from the ``add_fabric``
inventory or from an nvmf_tgt double on the shared ``Fabric``).

bdev_nvme_attach_controller, as recorded from v26.09-pre
(vhost-attach-and-serve.jsonl) and read in module/bdev/nvme/bdev_nvme_rpc.c:
when the name exists, in this order: multipath "disable" -114 ("... and
multipath is disabled"); the same traddr+trsvcid as the controller's first
path -114 ("... with the specified network path": only the network path is
compared, so a changed hostnqn, subnqn or timeout there is not applied and
not reported either); another subnqn -22; another hostnqn -22; PI options
-22. Then (bdev_nvme_create) a trid+hostnqn some controller already has as a
path -17 "File exists"; inconsistent reconnect knobs -22; a path whose mode
(multipath or failover) is not the controller's -22 "Invalid argument"
(v26.09; v24.01 lets them mix, as the SPDK source of its time did). Only
then the connect: a failed one is -5 (-19 for a PCIe address there is no
device at); it uses up a cntlid on the target (so the recorded cntlids come
out the same). Multipath (the default when ``multipath`` is omitted) adds a
path and answers every bdev name; failover adds an alternate trid and answers
[]; a trid that is already an alternate is -114 "Operation already in
progress" in v26.09, -17 "File exists" in v24.01 (bdev_nvme_add_secondary_trid
then returned -EEXIST).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from errno import EALREADY, EEXIST, EINVAL, EIO, ENODEV, ENXIO, ETIMEDOUT

from tests.doubles.spdk.nvmf import Connection, RemoteNamespace
from tests.doubles.spdk.schema import RpcError, errno_error

TRTYPES = {"pcie": "PCIe", "rdma": "RDMA", "tcp": "TCP"}
ADRFAMS = {"ipv4": "IPv4", "ipv6": "IPv6", "ib": "IB", "fc": "FC", "intra_host": "INTRA_HOST"}
# When a request names no hostnqn, SPDK uses its default one (made from a UUID
# at start; a fixed one here), so two paths attached without one compare equal.
DEFAULT_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000000"
BLOCK_SIZE = 512
NUM_BLOCKS = 2 * 1024 * 1024    # 1 GiB per namespace of the add_pcie/add_fabric inventory


@dataclass(frozen=True)
class Trid:
    """A transport ID: one path to a controller."""
    trtype: str
    traddr: str
    adrfam: str | None = None
    trsvcid: str | None = None
    subnqn: str | None = None

    def key(self) -> tuple:
        return (self.trtype, self.traddr.lower(), self.trsvcid or "", self.subnqn or "")

    def trid(self) -> dict:
        t = {"trtype": self.trtype}
        for name in ("adrfam", "traddr", "trsvcid", "subnqn"):
            if getattr(self, name):
                t[name] = getattr(self, name)
        return t


@dataclass
class Path:
    """One nvme_ctrlr: a connected path."""
    trid: Trid
    conn: Connection


@dataclass
class NvmeController:
    name: str
    hostnqn: str
    multipath: bool
    paths: list[Path] = field(default_factory=list)        # one nvme_ctrlr each
    alternates: list[Trid] = field(default_factory=list)   # failover trids of the first one

    @property
    def namespaces(self) -> tuple[int, ...]:
        return tuple(ns.nsid for ns in self.paths[0].conn.namespaces) if self.paths else ()

    def all_paths(self) -> list[Trid]:
        return [p.trid for p in self.paths] + self.alternates


@dataclass
class Bdev:
    name: str
    uuid: str
    num_blocks: int
    block_size: int
    product_name: str = "Malloc disk"
    ctrlr: NvmeController | None = None
    nsid: int | None = None


class BdevLayer:
    """The bdev_* handlers of SpdkTargetDouble (a mixin)."""

    def bdev_names(self) -> list[str]:
        return [*self.malloc, *(f"{c.name}n{nsid}" for c in self.nvme.values() for nsid in c.namespaces)]

    def _bdev(self, name: str) -> Bdev | None:
        """By name or by alias (its UUID), as spdk_bdev_get_by_name finds it."""
        for bdev in self._all_bdevs():
            if name in (bdev.name, bdev.uuid):
                return bdev
        return None

    def _all_bdevs(self):
        yield from self.malloc.values()
        for c in self.nvme.values():
            for ns in c.paths[0].conn.namespaces if c.paths else ():
                yield Bdev(f"{c.name}n{ns.nsid}", ns.uuid, ns.num_blocks, ns.block_size,
                           "NVMe disk", c, ns.nsid)

    def _get_bdevs(self, p: dict):
        if "name" not in p:
            return [self._bdev_info(b) for b in self._all_bdevs()]
        bdev = self._bdev(p["name"])
        if bdev is not None:
            return [self._bdev_info(bdev)]
        if not p.get("timeout"):
            raise errno_error(ENODEV)       # spdk_bdev_open_async -> -ENODEV

        def probe():
            found = self._bdev(p["name"])
            return None if found is None else [self._bdev_info(found)]
        return Poll(p["timeout"] / 1000, probe, errno_error(ETIMEDOUT))

    def _malloc_create(self, p: dict) -> str:
        if p["num_blocks"] == 0:
            raise RpcError(-EINVAL, "Disk num_blocks must be greater than 0")
        if p["block_size"] % 512:
            raise errno_error(EINVAL)
        name = p.get("name")
        if not name:
            name = f"Malloc{self._malloc_count}"
        self._malloc_count += 1
        if self._bdev(name) is not None or (p.get("uuid") and self._bdev(p["uuid"]) is not None):
            raise errno_error(EEXIST)       # spdk_bdev_register
        self.malloc[name] = Bdev(name, p.get("uuid") or str(uuidlib.uuid4()),
                                 p["num_blocks"], p["block_size"])
        return name

    def _malloc_delete(self, p: dict) -> bool:
        if p["name"] not in self.malloc:
            raise errno_error(ENODEV)
        del self.malloc[p["name"]]
        self._hot_removed({p["name"]})
        return True

    def _hot_removed(self, names: set[str]) -> None:
        """Bdevs went away under their users: a vhost-blk controller keeps
        going with no bdev (lib/vhost/vhost_blk.c hot-removes, it does not
        refuse), an NVMe-oF namespace on one goes."""
        for name in names:
            self.claims.pop(name, None)
            self._forget_namespaces_of(name)
        for vc in self.vhost.values():
            if vc.bdev in names:
                vc.bdev = None

    # -- bdev_nvme ----------------------------------------------------------------------

    def _attach(self, p: dict) -> list[str]:
        trtype = TRTYPES.get(p["trtype"].lower())
        if trtype is None:
            raise RpcError(-EINVAL, f"Failed to parse trtype: {p['trtype']}")
        adrfam = p.get("adrfam")
        if adrfam is not None and adrfam.lower() not in ADRFAMS:
            raise RpcError(-EINVAL, f"Failed to parse adrfam: {adrfam}")
        path = Trid(trtype, p["traddr"], ADRFAMS.get((adrfam or "").lower()),
                    p.get("trsvcid"), p.get("subnqn"))
        hostnqn = p.get("hostnqn") or DEFAULT_HOSTNQN
        mode = p.get("multipath", "multipath")      # the handler's default, whatever the schema text says
        existing = self.nvme.get(p["name"])
        if existing is not None:
            self._check_new_path(existing, path, hostnqn, mode, p)
        if any(q.trid.key() == path.key() and c.hostnqn == hostnqn
               for c in self.nvme.values() for q in c.paths):
            raise errno_error(EEXIST)       # bdev_nvme_create: nvme_ctrlr_get(trid, hostnqn)
        _check_reconnect(p.get("ctrlr_loss_timeout_sec", 0), p.get("reconnect_delay_sec", 0),
                         p.get("fast_io_fail_timeout_sec", 0))
        if (self.release.same_mode_paths and existing is not None
                and existing.multipath != (mode == "multipath")):
            raise errno_error(EINVAL)       # "All controllers with the same name must be configured the same way"
        conn = self._probe(path, hostnqn, p["name"])
        if existing is None:
            c = NvmeController(p["name"], hostnqn, mode == "multipath", [Path(path, conn)])
            self.nvme[c.name] = c
            return [f"{c.name}n{nsid}" for nsid in c.namespaces]
        if mode != "multipath":
            if any(path.key() == q.key() for q in existing.alternates):
                raise errno_error(self.release.known_alternate_errno)   # bdev_nvme_add_secondary_trid
            _compare_namespaces(existing, conn)
            existing.alternates.append(path)
            return []                            # a failover trid populates no bdevs
        _compare_namespaces(existing, conn)
        existing.paths.append(Path(path, conn))
        return [f"{existing.name}n{nsid}" for nsid in existing.namespaces]

    def _check_new_path(self, c: NvmeController, path: Trid, hostnqn: str, mode: str, p: dict) -> None:
        if mode == "disable":
            raise RpcError(-EALREADY, f"A controller named {c.name} already exists and multipath is disabled")
        first = c.paths[0].trid
        if (path.traddr, path.trsvcid or "") == (first.traddr, first.trsvcid or ""):
            raise RpcError(-EALREADY, f"A controller named {c.name} already exists with the specified network path")
        if (path.subnqn or "") != (first.subnqn or ""):
            raise RpcError(-EINVAL, f"A controller named {c.name} already exists, but uses a different subnqn ({first.subnqn or ''})")
        if hostnqn != c.hostnqn:
            raise RpcError(-EINVAL, f"A controller named {c.name} already exists, but uses a different hostnqn ({c.hostnqn})")
        if p.get("prchk_reftag") or p.get("prchk_guard"):
            raise RpcError(-EINVAL, f"A controller named {c.name} already exists. To add a path, do not specify PI options.")

    def _probe(self, path: Trid, hostnqn: str, name: str) -> Connection:
        """Connect: the inventory first, then the fabric."""
        if path.trtype == "PCIe":
            if path.traddr.lower() not in self.pcie:
                raise errno_error(ENODEV)   # spdk_nvme_connect_async finds no device
            return self._inventory_connection(path, name, self.pcie[path.traddr.lower()])
        if path.key() in self.fabrics:
            return self._inventory_connection(path, name, self.fabrics[path.key()])
        found = None
        if self.fabric is not None:
            found = self.fabric.connect(path.trtype, path.traddr, path.trsvcid, path.subnqn, hostnqn)
        if found is None:
            raise errno_error(EIO)          # the connect fails: unreachable, refused, unknown NQN
        return found

    def _inventory_connection(self, path: Trid, name: str, nsids: tuple[int, ...]) -> Connection:
        self._cntlids[path.key()] = self._cntlids.get(path.key(), 0) + 1
        namespaces = tuple(RemoteNamespace(nsid, str(uuidlib.uuid5(uuidlib.NAMESPACE_URL,
                                                                   f"spdk-double:{name}n{nsid}")),
                                           NUM_BLOCKS, BLOCK_SIZE) for nsid in nsids)
        return Connection(self._cntlids[path.key()], path.subnqn or "", "SPDK test double",
                          "SPDKDOUBLE0001", self.release.firmware, namespaces)

    def _detach(self, p: dict) -> bool:
        c = self.nvme.get(p["name"])
        if c is None:
            raise errno_error(ENODEV)       # bdev_nvme_delete: no such nvme_bdev_ctrlr
        wanted = [q for q in c.all_paths() if _path_matches(q, p)]
        if not wanted:
            raise errno_error(ENXIO)
        names = {f"{c.name}n{nsid}" for nsid in c.namespaces}
        c.paths = [q for q in c.paths if q.trid not in wanted]
        c.alternates = [q for q in c.alternates if q not in wanted]
        while not c.paths and c.alternates:     # failover to the next trid
            trid = c.alternates.pop(0)
            try:
                c.paths.append(Path(trid, self._probe(trid, c.hostnqn, c.name)))
            except RpcError:
                continue
        if not c.paths:
            del self.nvme[c.name]
            self._hot_removed(names)
        return True

    def _get_nvme_controllers(self, p: dict) -> list:
        if "name" in p:
            c = self.nvme.get(p["name"])
            if c is None:
                # +EINVAL before v26.05, -EINVAL since (module/bdev/nvme/bdev_nvme_rpc.c).
                raise RpcError(self.release.missing_ctrlr_code, f"Controller {p['name']} does not exist")
            return [_controller_info(c)]
        return [_controller_info(c) for c in self.nvme.values()]

    # -- what bdev_get_bdevs says -------------------------------------------------------

    def _bdev_info(self, b: Bdev) -> dict:
        nvme = b.ctrlr is not None
        claim = self.claims.get(b.name)
        info = {"name": b.name, "aliases": [b.uuid], "product_name": b.product_name,
                "block_size": b.block_size, "num_blocks": b.num_blocks}
        info.update(dict.fromkeys(("preferred_write_alignment", "preferred_write_granularity"), int(nvme)))
        info["optimal_write_size"] = 256 if nvme else 0
        info.update(dict.fromkeys(("preferred_unmap_alignment", "preferred_unmap_granularity"), int(nvme)))
        info.update({"uuid": b.uuid, "numa_id": -1,
                     "assigned_rate_limits": {"rw_ios_per_sec": 0, "rw_mbytes_per_sec": 0,
                                              "r_mbytes_per_sec": 0, "w_mbytes_per_sec": 0},
                     "claimed": claim is not None})
        if claim is not None:
            info["claim_type"] = claim[0]
        info["zoned"] = False
        info["supported_io_types"] = dict(NVME_IO if nvme else MALLOC_IO)
        if not nvme:
            info["driver_specific"] = {}
            return info
        if b.ctrlr.paths[0].trid.trtype != "PCIe":
            info["memory_domains"] = [{"dma_device_type": "DMA"}]
        info["driver_specific"] = {"nvme": [_path_info(q, b.nsid) for q in b.ctrlr.paths],
                                   "mp_policy": "active_passive"}
        return info


class Poll:
    """A result that is not there yet: the server asks ``probe`` (under the
    double's lock) until it answers or ``seconds`` pass, then raises ``error``."""

    def __init__(self, seconds: float, probe, error: RpcError):
        self.seconds, self.probe, self.error = seconds, probe, error


IO_TYPES = ("read", "write", "unmap", "flush", "reset", "nvme_admin", "nvme_io", "nvme_io_md",
            "write_zeroes", "zcopy", "get_zone_info", "zone_management", "zone_append", "compare",
            "compare_and_write", "abort", "seek_hole", "seek_data", "copy", "nvme_iov_md",
            "nvme_nssr", "write_uncorrectable")
MALLOC_IO = {t: t in ("read", "write", "unmap", "flush", "reset", "write_zeroes", "zcopy",
                      "compare", "abort", "copy") for t in IO_TYPES}
NVME_IO = {t: t in ("read", "write", "unmap", "flush", "reset", "nvme_admin", "nvme_io",
                    "write_zeroes", "compare", "compare_and_write", "abort", "copy") for t in IO_TYPES}


def _path_info(q: Path, nsid: int) -> dict:
    info = {"pci_address": q.trid.traddr} if q.trid.trtype == "PCIe" else {}
    info.update({
        "trid": q.trid.trid(),
        "ctrlr_data": {"cntlid": q.conn.cntlid, "vendor_id": "0x8086",
                       "model_number": q.conn.model_number, "serial_number": q.conn.serial_number,
                       "firmware_revision": q.conn.firmware_revision, "subnqn": q.conn.subnqn,
                       "oacs": {"security": 0, "format": 0, "firmware": 0, "ns_manage": 0},
                       "multi_ctrlr": True, "ana_reporting": False},
        "vs": {"nvme_version": "2.0"},
        "ns_data": {"id": nsid, "can_share": True}})
    return info


def _controller_info(c: NvmeController) -> dict:
    ctrlrs = []
    for i, q in enumerate(c.paths):
        ctrlr = {"state": "enabled", "trid": q.trid.trid()}
        if i == 0 and c.alternates:
            ctrlr["alternate_trids"] = [t.trid() for t in c.alternates]
        ctrlr["cntlid"] = q.conn.cntlid
        ctrlr["host"] = {"nqn": c.hostnqn, "addr": "", "svcid": "", "no_shn_notification": False}
        ctrlrs.append(ctrlr)
    return {"name": c.name, "ctrlrs": ctrlrs}


def _compare_namespaces(c: NvmeController, conn: Connection) -> None:
    """bdev_nvme_compare_namespaces: a new path must show the same namespaces."""
    if {(ns.nsid, ns.uuid) for ns in conn.namespaces} != {(ns.nsid, ns.uuid)
                                                          for ns in c.paths[0].conn.namespaces}:
        raise errno_error(EINVAL)


def _check_reconnect(loss: int, delay: int, fast_fail: int) -> None:
    """bdev_nvme_check_io_error_resiliency_params: the three knobs depend on each other."""
    ok = True
    if loss < -1:
        ok = False
    elif loss == -1:
        ok = delay != 0 and (fast_fail == 0 or fast_fail >= delay)
    elif loss != 0:
        ok = delay != 0 and delay <= loss and (fast_fail == 0 or delay <= fast_fail <= loss)
    elif delay != 0 or fast_fail != 0:
        ok = False
    if not ok:
        raise errno_error(EINVAL)


def _path_matches(q: Trid, p: dict) -> bool:
    """bdev_nvme_delete: every transport field given must match (subnqn
    exactly, the others case-insensitively)."""
    for name in ("trtype", "traddr", "adrfam", "trsvcid"):
        if p.get(name) is not None and (getattr(q, name) or "").lower() != p[name].lower():
            return False
    return p.get("subnqn") is None or q.subnqn == p["subnqn"]
