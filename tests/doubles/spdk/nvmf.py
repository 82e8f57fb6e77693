"""The NVMe-oF target side (nvmf_tgt, spdk_tgt) and the fabric between doubles.

A ``Fabric`` is the network: every double given the same one can reach the
others' listeners. An ``nvmf_tgt`` (or ``spdk_tgt``) double on it accepts
connections on (trtype, traddr, trsvcid) wherever one of its subsystems
listens, for that subsystem's NQN, from a host its ``allow_any_host`` or
``hosts`` admit; the controller the initiator gets has that subsystem's
namespaces (as they are at connect time) and the next cntlid of the
subsystem. Anything else (no listener, unknown NQN, host not allowed) is a
failed connect, which the initiator answers -5 (recorded).

Recorded (nvmf-target-setup.jsonl, export-claim-order.jsonl): nothing here is
idempotent; a namespace claims its bdev exclusive_write; a ``:uuid:`` host
NQN must carry a 36-character UUID; listeners and hosts are listed newest
first; the discovery subsystem is listed first.
"""

from __future__ import annotations

import re
import threading
import uuid as uuidlib
from dataclasses import dataclass, field

from tests.doubles.spdk.schema import INTERNAL_ERROR, INVALID_PARAMS, RpcError, is_uuid

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"
NVMF_MODULE = "NVMe-oF Target"
_NQN = re.compile(r"nqn\.\d{4}-(0[1-9]|1[0-2])\.[A-Za-z0-9][A-Za-z0-9-]*(\.[A-Za-z0-9-]+)*(:.+)?")
_INVALID = RpcError(INVALID_PARAMS, "Invalid parameters")


def nqn_is_valid(nqn: str) -> bool:
    """lib/nvmf/subsystem.c nvmf_nqn_is_valid, as far as the recordings need it."""
    if not nqn.isascii() or len(nqn) > 223:
        return False
    if nqn.startswith(UUID_NQN_PREFIX):
        rest = nqn[len(UUID_NQN_PREFIX):]
        return len(rest) == 36 and is_uuid(rest)       # "uuid is not the correct length"
    return nqn == DISCOVERY_NQN or _NQN.fullmatch(nqn) is not None


@dataclass(frozen=True)
class RemoteNamespace:
    nsid: int
    uuid: str
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class Connection:
    """What an initiator learns when a connect succeeds: one NVMe controller."""
    cntlid: int
    subnqn: str
    model_number: str
    serial_number: str
    firmware_revision: str
    namespaces: tuple[RemoteNamespace, ...]


class Fabric:
    """The network between doubles (TCP and RDMA alike): which NVMe-oF
    targets answer a connect. Shared by the doubles given it."""

    def __init__(self):
        self._targets: list = []
        self._lock = threading.Lock()

    def join(self, target) -> None:
        with self._lock:
            if target not in self._targets:
                self._targets.append(target)

    def leave(self, target) -> None:
        with self._lock:
            if target in self._targets:
                self._targets.remove(target)

    def connect(self, trtype: str, traddr: str, trsvcid: str | None, subnqn: str | None,
                hostnqn: str) -> Connection | None:
        with self._lock:
            targets = list(self._targets)
        for target in targets:
            found = target.accept_connect(trtype, traddr, trsvcid or "", subnqn or "", hostnqn)
            if found is not None:
                return found
        return None


@dataclass
class Subsystem:
    nqn: str
    serial_number: str
    model_number: str
    allow_any_host: bool
    max_namespaces: int
    min_cntlid: int
    max_cntlid: int
    hosts: list[str] = field(default_factory=list)          # newest first
    listeners: list[dict] = field(default_factory=list)     # newest first
    namespaces: dict[int, dict] = field(default_factory=dict)
    next_cntlid: int = 0

    def listens_on(self, trtype: str, traddr: str, trsvcid: str) -> bool:
        return any((a["trtype"], a["traddr"], a["trsvcid"]) == (trtype.upper(), traddr, trsvcid)
                   for a in self.listeners)

    def info(self) -> dict:
        return {
            "nqn": self.nqn, "subtype": "NVMe", "listen_addresses": [dict(a) for a in self.listeners],
            "allow_any_host": self.allow_any_host, "hosts": [{"nqn": h} for h in self.hosts],
            "serial_number": self.serial_number, "model_number": self.model_number,
            "max_namespaces": self.max_namespaces, "passthrough": False,
            "min_cntlid": self.min_cntlid, "max_cntlid": self.max_cntlid,
            "dmrsl": 2097152, "wzsl": 12,
            "namespaces": [{"nsid": nsid, "bdev_name": ns["bdev_name"], "name": ns["bdev_name"],
                            "nguid": uuidlib.UUID(ns["uuid"]).hex.upper(), "uuid": ns["uuid"]}
                           for nsid, ns in sorted(self.namespaces.items())],
        }


DISCOVERY_INFO = {"nqn": DISCOVERY_NQN, "subtype": "Discovery", "listen_addresses": [],
                  "allow_any_host": True, "hosts": []}


class NvmfTarget:
    """The nvmf_* handlers of SpdkTargetDouble (a mixin: the double's lock,
    bdevs and release are its own)."""

    def _create_transport(self, p: dict) -> bool:
        trtype = p["trtype"].upper()
        if trtype in self.transports:
            raise RpcError(INTERNAL_ERROR, f"Transport type '{p['trtype']}' already exists")
        self.transports[trtype] = dict(p)
        return True

    def _create_subsystem(self, p: dict) -> bool:
        nqn = p["nqn"]
        if nqn in self.subsystems or nqn == DISCOVERY_NQN or not nqn_is_valid(nqn):
            raise RpcError(INTERNAL_ERROR, f"Unable to create subsystem {nqn}")
        low, high = p.get("min_cntlid", 1), p.get("max_cntlid", 0xFFEF)
        if not 1 <= low <= high <= 0xFFEF:
            raise RpcError(INTERNAL_ERROR, f"Unable to create subsystem {nqn}")
        self.subsystems[nqn] = Subsystem(
            nqn, p.get("serial_number", "00000000000000000000"),
            p.get("model_number", "SPDK bdev Controller"), bool(p.get("allow_any_host", False)),
            p.get("max_namespaces", 32), low, high, next_cntlid=low)
        return True

    def _subsystem(self, nqn: str) -> Subsystem:
        if nqn not in self.subsystems:
            raise RpcError(INVALID_PARAMS, f"Subsystem with NQN '{nqn}' not found")
        return self.subsystems[nqn]

    def _add_ns(self, p: dict) -> int:
        sub = self._subsystem(p["nqn"])
        ns = p["namespace"]
        bdev = self._bdev(ns["bdev_name"])
        wanted = ns.get("nsid") or next(i for i in range(1, len(sub.namespaces) + 2)
                                        if i not in sub.namespaces)
        if (bdev is None                                  # "cannot be opened, error=-19"
                or self.claims.get(bdev.name)             # "already claimed: type exclusive_write"
                or wanted in sub.namespaces or wanted > sub.max_namespaces):
            raise _INVALID
        self.claims[bdev.name] = ("exclusive_write", NVMF_MODULE)
        sub.namespaces[wanted] = {"bdev_name": bdev.name, "uuid": ns.get("uuid") or bdev.uuid}
        return wanted

    def _add_listener(self, p: dict) -> bool:
        sub = self._subsystem(p["nqn"])
        given = p["listen_address"]
        trtype = given.get("trtype", "").upper()
        address = {"trtype": trtype, "adrfam": given.get("adrfam", "IPv4"),
                   "traddr": given.get("traddr", ""), "trsvcid": given.get("trsvcid", "")}
        if trtype not in self.transports or sub.listens_on(trtype, address["traddr"], address["trsvcid"]):
            raise _INVALID                  # no such transport / "Listener already exists"
        sub.listeners.insert(0, address)
        return True

    def _add_host(self, p: dict) -> bool:
        sub = self._subsystem(p["nqn"])
        host = p["host"]
        if not nqn_is_valid(host) or host in sub.hosts:
            raise RpcError(INTERNAL_ERROR, "Internal error")
        sub.hosts.insert(0, host)
        return True

    def _delete_subsystem(self, p: dict) -> bool:
        sub = self._subsystem(p["nqn"])
        for ns in sub.namespaces.values():
            self.claims.pop(ns["bdev_name"], None)
        del self.subsystems[sub.nqn]
        return True

    def _get_subsystems(self, p: dict) -> list:
        if "nqn" in p:
            if p["nqn"] == DISCOVERY_NQN:
                return [dict(DISCOVERY_INFO)]
            return [self._subsystem(p["nqn"]).info()]
        return [dict(DISCOVERY_INFO)] + [s.info() for s in self.subsystems.values()]

    def _forget_namespaces_of(self, bdev_name: str) -> None:
        """A bdev went away (hot remove): the namespaces on it go too."""
        for sub in self.subsystems.values():
            for nsid in [n for n, ns in sub.namespaces.items() if ns["bdev_name"] == bdev_name]:
                del sub.namespaces[nsid]

    # -- what the fabric asks -------------------------------------------------------------

    def accept_connect(self, trtype: str, traddr: str, trsvcid: str, subnqn: str,
                       hostnqn: str) -> Connection | None:
        with self._lock:
            if not self.running or trtype.upper() not in self.transports:
                return None
            sub = self.subsystems.get(subnqn)
            if sub is None or not sub.listens_on(trtype, traddr, trsvcid):
                return None
            if not (sub.allow_any_host or hostnqn in sub.hosts):
                return None         # the target rejects the Fabrics CONNECT
            cntlid = sub.next_cntlid
            sub.next_cntlid = cntlid + 1 if cntlid < sub.max_cntlid else sub.min_cntlid
            namespaces = []
            for nsid, ns in sorted(sub.namespaces.items()):
                bdev = self._bdev(ns["bdev_name"])
                if bdev is not None:
                    namespaces.append(RemoteNamespace(nsid, ns["uuid"], bdev.num_blocks, bdev.block_size))
            return Connection(cntlid, sub.nqn, sub.model_number, sub.serial_number,
                              self.release.firmware, tuple(namespaces))
