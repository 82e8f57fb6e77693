"""SpdkTargetDouble: a TEST DOUBLE of an SPDK application (spdk_tgt / vhost).

Not SPDK. The test machines have no SPDK (Debian does not package it), so
this is a JSON-RPC 2.0 server on a real Unix socket that answers the methods
vstor sends the way SPDK's own handlers do, as read in SPDK's source:

- framing: what ``spdk.rpc.client.JSONRPCClient`` sends and reads (JSON
  objects back to back on a stream socket, no delimiter required);
- every request is checked against vstor/data/spdk_methods.json (generated
  from SPDK's schema.yaml): unknown method -32601; unknown parameter,
  missing required one or wrong type -> the decode failure *that method's
  handler* answers (not always -32602, see DECODE_FAILURE);
- bdev_nvme: bdevs ``<ctrlr>n<nsid>`` from a configured inventory of PCIe
  controllers and NVMe-oF subsystems; a second attach under the same name
  adds a path (multipath by default, failover on request), EALREADY when
  multipath is "disable" or the path is the same one;
- vhost: a real listening socket ``<vhost_dir>/<ctrlr>`` (mode 0755, like
  SPDK's), or with ``backing_dir`` a real qemu-storage-daemon exporting a
  file as vhost-user-blk there, so a real QEMU can connect; delete refused
  with EBUSY while an initiator is connected (a real client on the socket,
  or one marked with ``mark_connected``);
- detaching an NVMe controller whose bdev a vhost controller serves
  succeeds, and the vhost controller is left with ``bdev: null``: SPDK
  hot-removes the bdev under vhost-blk, it does not refuse (lib/vhost/vhost_blk.c).

Every request received is recorded in ``requests`` (method and params, as
sent) for tests to assert exact parameters.
"""

from __future__ import annotations

import codecs
import copy
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from errno import EALREADY, EBUSY, EEXIST, EINVAL, EIO, ENODEV, ENXIO
from pathlib import Path

import pytest

FACTS = Path(__file__).resolve().parents[2] / "vstor" / "data" / "spdk_methods.json"
QSD_BINARY = "/usr/bin/qemu-storage-daemon"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND = -32700, -32600, -32601
INVALID_PARAMS, INTERNAL_ERROR = -32602, -32603

_DECODE = (INTERNAL_ERROR, "spdk_json_decode_object failed")
# What each handler answers when spdk_json_decode_object fails (module/bdev/
# nvme/bdev_nvme_rpc.c, lib/bdev/bdev_rpc.c, lib/vhost/vhost_rpc.c, lib/nvmf/
# nvmf_rpc.c, lib/rpc/rpc.c, lib/event/app_rpc.c).
DECODE_FAILURE = {
    "bdev_nvme_attach_controller": _DECODE,
    "bdev_nvme_detach_controller": _DECODE,
    "bdev_nvme_get_controllers": _DECODE,
    "bdev_get_bdevs": _DECODE,
    "vhost_create_blk_controller": (INVALID_PARAMS, os.strerror(EINVAL)),
    "vhost_delete_controller": (INVALID_PARAMS, os.strerror(EINVAL)),
    "vhost_get_controllers": (INTERNAL_ERROR, os.strerror(EINVAL)),
    "spdk_get_version": (INVALID_PARAMS, "spdk_get_version method requires no parameters"),
    "framework_get_reactors": (INVALID_PARAMS, "`framework_get_reactors` requires no arguments"),
}
NVMF_DECODE = (INVALID_PARAMS, "Invalid parameters")

TRTYPES = {"pcie": "PCIe", "rdma": "RDMA", "tcp": "TCP"}
ADRFAMS = {"ipv4": "IPv4", "ipv6": "IPv6", "ib": "IB", "fc": "FC", "intra_host": "INTRA_HOST"}
# When a request names no hostnqn, SPDK uses its default one (made from a UUID
# at start; a fixed one here), so two paths attached without one compare equal.
DEFAULT_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000000"


class RpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def errno_error(code: int) -> RpcError:
    """SPDK's spdk_jsonrpc_send_error_response(request, -errno, spdk_strerror(errno))."""
    return RpcError(-code, os.strerror(code))


# -- the schema contract --------------------------------------------------------------------

_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1), "uint8": (0, 2**8 - 1),
               "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}


def load_facts(path: Path | str = FACTS) -> dict[str, dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["methods"]


def check_params(spec: dict, params) -> str | None:
    """Why params do not decode under spec (a method's or an object's), or None."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return "params must be an object"
    for name in params:
        if name not in spec:
            return f"unknown parameter '{name}'"
    for name, fact in spec.items():
        if name in params:
            why = check_value(fact, params[name])
            if why:
                return f"'{name}': {why}"
        elif fact["required"]:
            return f"missing required parameter '{name}'"
    return None


def check_value(fact: dict, value) -> str | None:
    kind = fact["type"]
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"expected {kind}, got {value!r}"
    if kind == "string":
        return None if isinstance(value, str) else f"expected a string, got {value!r}"
    if kind == "boolean":
        return None if isinstance(value, bool) else f"expected a boolean, got {value!r}"
    if kind == "uuid":
        return None if isinstance(value, str) and _is_uuid(value) else f"expected a UUID, got {value!r}"
    if kind == "enum":
        return None if value in fact["values"] else f"expected one of {fact['values']}, got {value!r}"
    if kind == "object":
        return check_params(fact["fields"], value) if isinstance(value, dict) else "expected an object"
    if kind in ("array", "bitmask"):
        return _check_list(fact, value)
    return f"type {kind} is not modelled by the double"


def _check_list(fact: dict, value) -> str | None:
    if not isinstance(value, list):
        return "expected an array"
    if fact["type"] == "bitmask":
        bad = [v for v in value if v not in fact["values"]]
        return f"unknown values {bad}" if bad else None
    if len(value) > fact["items"]["max_count"]:
        return "too many items"
    for item in value:
        why = check_value(fact["items"], item)
        if why:
            return why
    return None


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


# -- what the target holds ------------------------------------------------------------------

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
        t = {"trtype": self.trtype, "traddr": self.traddr}
        for name in ("adrfam", "trsvcid", "subnqn"):
            if getattr(self, name):
                t[name] = getattr(self, name)
        return t


@dataclass
class NvmeController:
    name: str
    hostnqn: str
    namespaces: tuple[int, ...]
    paths: list[Trid] = field(default_factory=list)        # one nvme_ctrlr each (multipath)
    alternates: list[Trid] = field(default_factory=list)   # failover trids of the first one

    def all_paths(self) -> list[Trid]:
        return self.paths + self.alternates


@dataclass
class VhostController:
    name: str
    bdev: str | None
    cpumask: int
    readonly: bool
    packed_ring: bool
    socket_path: str
    server: threading.Thread | None = None      # holds the socket when no qsd does
    closing: threading.Event = field(default_factory=threading.Event)
    qsd_pid: int | None = None
    marked_connected: bool = False


BLOCK_SIZE = 512
NUM_BLOCKS = 2 * 1024 * 1024    # 1 GiB per namespace unless configured


# -- the double -----------------------------------------------------------------------------

class SpdkTargetDouble:
    """A JSON-RPC server on ``socket_path`` that behaves like SPDK for vstor.

    Inventory: ``add_pcie(traddr, namespaces)`` and ``add_fabric(trtype,
    traddr, trsvcid, subnqn, namespaces)`` (namespaces: a count or nsids).
    ``backing_dir``: serve each vhost controller with a real
    qemu-storage-daemon exporting ``<backing_dir>/<bdev>.raw``."""

    def __init__(self, socket_path: str, vhost_dir: str, *, cores: tuple[int, ...] = (0, 1),
                 version: str = "26.09-pre", facts: Path | str = FACTS,
                 backing_dir: str | None = None, qsd_binary: str = QSD_BINARY):
        self.socket_path = str(socket_path)
        self.vhost_dir = str(vhost_dir)
        self.cores = tuple(cores)
        self.version = version
        self.facts = load_facts(facts)
        self.backing_dir = backing_dir
        self.qsd_binary = qsd_binary
        self.requests: list[dict] = []
        self.faults: dict[str, list] = {}
        self.pcie: dict[str, tuple[int, ...]] = {}
        self.fabrics: dict[tuple, tuple[int, ...]] = {}
        self.nvme: dict[str, NvmeController] = {}
        self.vhost: dict[str, VhostController] = {}
        self.transports: dict[str, dict] = {}
        self.subsystems: dict[str, dict] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._handlers = {
            "spdk_get_version": self._get_version,
            "framework_get_reactors": self._get_reactors,
            "bdev_get_bdevs": self._get_bdevs,
            "bdev_nvme_attach_controller": self._attach,
            "bdev_nvme_detach_controller": self._detach,
            "bdev_nvme_get_controllers": self._get_nvme_controllers,
            "vhost_create_blk_controller": self._create_vhost,
            "vhost_delete_controller": self._delete_vhost,
            "vhost_get_controllers": self._get_vhost,
            "nvmf_create_transport": self._create_transport,
            "nvmf_create_subsystem": self._create_subsystem,
            "nvmf_subsystem_add_ns": self._add_ns,
            "nvmf_subsystem_add_listener": self._add_listener,
            "nvmf_delete_subsystem": self._delete_subsystem,
            "nvmf_get_subsystems": self._get_subsystems,
        }

    def fail(self, method: str, code: int = -5, message: str = "Input/output error",
             times: int = 1) -> None:
        """Fault injection: the next `times` calls of `method` answer this error
        (after the schema check, as SPDK's handler would)."""
        self.faults[method] = [code, message, times]

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    # -- inventory ----------------------------------------------------------------------

    def add_pcie(self, traddr: str, namespaces: int | tuple[int, ...] = 1) -> SpdkTargetDouble:
        self.pcie[traddr.lower()] = _nsids(namespaces)
        return self

    def add_fabric(self, trtype: str, traddr: str, trsvcid: str, subnqn: str,
                   namespaces: int | tuple[int, ...] = 1) -> SpdkTargetDouble:
        path = Trid(TRTYPES.get(trtype.lower(), trtype), traddr, None, trsvcid, subnqn)
        self.fabrics[path.key()] = _nsids(namespaces)
        return self

    # -- what tests look at -------------------------------------------------------------

    def params_of(self, method: str) -> list:
        """The params of every request for method, in order (None when omitted)."""
        return [r["params"] for r in self.requests if r["method"] == method]

    def methods_called(self) -> list[str]:
        return [r["method"] for r in self.requests]

    def mark_connected(self, ctrlr: str, connected: bool = True) -> None:
        """Pretend an initiator (QEMU) is connected to vhost controller ctrlr."""
        with self._lock:
            self.vhost[ctrlr].marked_connected = connected

    def is_connected(self, ctrlr: str) -> bool:
        vc = self.vhost[ctrlr]
        return vc.marked_connected or _unix_peers(vc.socket_path) > 0

    def wait_disconnected(self, ctrlr: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.is_connected(ctrlr):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def backing_file(self, bdev: str) -> str:
        return os.path.join(self.backing_dir or "", f"{bdev}.raw")

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> SpdkTargetDouble:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> SpdkTargetDouble:
        """Listen on socket_path (again, after stop(): an SPDK restart)."""
        self._stopping.clear()
        self._threads = []
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        os.makedirs(self.vhost_dir, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self._spawn(self._serve)
        return self

    def stop(self) -> None:
        """Stop answering and remove every socket; what was recorded stays."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._lock:
            for vc in list(self.vhost.values()):
                self._tear_down(vc)
            self.vhost.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the JSON-RPC server ------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._spawn(self._converse, conn)

    def _converse(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        buf = ""
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with conn:
            while not self._stopping.is_set():
                try:
                    data = conn.recv(65536)
                except socket.timeout:
                    if buf.strip():
                        # An unparsable request that no further bytes completed.
                        conn.sendall(_encode(_error(None, PARSE_ERROR, "Parse error")))
                        buf = ""
                    continue
                except OSError:
                    return
                if not data:
                    return
                buf += text.decode(data)
                buf = self._answer_all(conn, buf)

    def _answer_all(self, conn: socket.socket, buf: str) -> str:
        decoder = json.JSONDecoder()
        while buf.strip():
            buf = buf.lstrip()
            try:
                request, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                return buf      # incomplete, so far
            buf = buf[end:]
            reply = self.answer(request)
            if reply is not None:
                conn.sendall(_encode(reply))
        return buf

    def answer(self, request):
        """The response to one decoded request, or to a JSON-RPC 2.0 batch (what
        SPDK's client sends in batch mode); None for notifications."""
        if isinstance(request, list):
            replies = [r for r in (self._answer_one(item) for item in request) if r is not None]
            return replies or (None if request else _error(None, INVALID_REQUEST, "Invalid request"))
        return self._answer_one(request)

    def _answer_one(self, request) -> dict | None:
        if (not isinstance(request, dict) or request.get("jsonrpc") != "2.0"
                or not isinstance(request.get("method"), str)):
            rid = request.get("id") if isinstance(request, dict) else None
            return _error(rid, INVALID_REQUEST, "Invalid request")
        method, params, rid = request["method"], request.get("params"), request.get("id")
        with self._lock:
            self.requests.append({"method": method, "params": copy.deepcopy(params)})
            try:
                result = self._dispatch(method, params)
            except RpcError as e:
                return None if "id" not in request else _error(rid, e.code, e.message)
            except Exception as e:     # a bug in the double: say so rather than hang the client
                return _error(rid, INTERNAL_ERROR, f"SPDK target double failed: {e!r}")
        return None if "id" not in request else {"jsonrpc": "2.0", "id": rid, "result": result}

    def _dispatch(self, method: str, params):
        handler = self._handlers.get(method)
        if handler is None or method not in self.facts:
            raise RpcError(METHOD_NOT_FOUND, "Method not found")
        spec = self.facts[method]["params"]
        failure = DECODE_FAILURE.get(method, NVMF_DECODE)
        if not spec and params is not None:
            raise RpcError(*failure)        # these handlers refuse any params object
        if check_params(spec, params) is not None:
            raise RpcError(*failure)
        fault = self.faults.get(method)
        if fault and fault[2] > 0:
            fault[2] -= 1
            raise RpcError(fault[0], fault[1])
        return handler(params or {})

    def why_rejected(self, method: str, params) -> str | None:
        """The schema's reason for refusing params (tests use it to explain)."""
        return check_params(self.facts[method]["params"], params)

    # -- framework ----------------------------------------------------------------------

    def _get_version(self, p: dict) -> dict:
        major, minor, patch, suffix = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)", self.version).groups()
        return {"version": f"SPDK v{self.version}",
                "fields": {"major": int(major), "minor": int(minor), "patch": int(patch or 0),
                           "suffix": suffix}}

    def _get_reactors(self, p: dict) -> dict:
        reactors = [{"lcore": core, "busy": 0, "idle": 0, "in_interrupt": False,
                     "irq": 0, "sys": 0, "usr": 0,
                     "lw_threads": [{"name": "app_thread", "id": 1, "cpumask": "1", "elapsed": 0}]
                     if core == self.cores[0] else []}
                    for core in self.cores]
        return {"tick_rate": 2_000_000_000, "pid": os.getpid(), "reactors": reactors}

    # -- bdevs and NVMe controllers -----------------------------------------------------

    def bdev_names(self) -> list[str]:
        return [f"{c.name}n{nsid}" for c in self.nvme.values() for nsid in c.namespaces]

    def _bdev(self, name: str) -> dict | None:
        for c in self.nvme.values():
            for nsid in c.namespaces:
                if f"{c.name}n{nsid}" == name:
                    return _bdev_info(c, nsid)
        return None

    def _get_bdevs(self, p: dict) -> list:
        if "name" in p:
            info = self._bdev(p["name"])
            if info is None:
                raise errno_error(ENODEV)     # spdk_bdev_open_async -> -ENODEV
            return [info]
        return [self._bdev(name) for name in self.bdev_names()]

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
            self._check_new_path(existing, path, hostnqn, mode)
        if any(path.key() == q.key() for c in self.nvme.values() for q in c.all_paths()):
            raise errno_error(EEXIST)       # bdev_nvme_create: trid already attached
        _check_reconnect(p.get("ctrlr_loss_timeout_sec", 0), p.get("reconnect_delay_sec", 0),
                         p.get("fast_io_fail_timeout_sec", 0))
        namespaces = self._probe(path)
        if existing is None:
            self.nvme[p["name"]] = NvmeController(p["name"], hostnqn, namespaces, [path])
            return [f"{p['name']}n{nsid}" for nsid in namespaces]
        if namespaces != existing.namespaces:
            raise errno_error(EINVAL)       # bdev_nvme_compare_namespaces
        if mode == "multipath":
            existing.paths.append(path)
            return [f"{existing.name}n{nsid}" for nsid in namespaces]
        existing.alternates.append(path)
        return []                            # a failover trid populates no bdevs

    def _check_new_path(self, c: NvmeController, path: Trid, hostnqn: str, mode: str) -> None:
        if mode == "disable":
            raise RpcError(-EALREADY, f"A controller named {c.name} already exists and multipath is disabled")
        first = c.paths[0]
        if (path.traddr, path.trsvcid or "") == (first.traddr, first.trsvcid or ""):
            raise RpcError(-EALREADY, f"A controller named {c.name} already exists with the specified network path")
        if (path.subnqn or "") != (first.subnqn or ""):
            raise RpcError(-EINVAL, f"A controller named {c.name} already exists, but uses a different subnqn ({first.subnqn or ''})")
        if hostnqn != c.hostnqn:
            raise RpcError(-EINVAL, f"A controller named {c.name} already exists, but uses a different hostnqn ({c.hostnqn})")

    def _probe(self, path: Trid) -> tuple[int, ...]:
        if path.trtype == "PCIe":
            if path.traddr.lower() not in self.pcie:
                raise errno_error(ENODEV)   # spdk_nvme_connect_async finds no device
            return self.pcie[path.traddr.lower()]
        if path.key() not in self.fabrics:
            raise errno_error(EIO)          # the probe ends without attaching
        return self.fabrics[path.key()]

    def _detach(self, p: dict) -> bool:
        c = self.nvme.get(p["name"])
        if c is None:
            raise errno_error(ENODEV)       # bdev_nvme_delete: no such nvme_bdev_ctrlr
        wanted = [q for q in c.all_paths() if _path_matches(q, p)]
        if not wanted:
            raise errno_error(ENXIO)
        c.paths = [q for q in c.paths if q not in wanted]
        c.alternates = [q for q in c.alternates if q not in wanted]
        if not c.paths and c.alternates:
            c.paths.append(c.alternates.pop(0))     # failover to the next trid
        if not c.paths:
            self._remove_controller(c)
        return True

    def _remove_controller(self, c: NvmeController) -> None:
        gone = {f"{c.name}n{nsid}" for nsid in c.namespaces}
        del self.nvme[c.name]
        for vc in self.vhost.values():
            if vc.bdev in gone:
                vc.bdev = None      # vhost-blk hot-removes the bdev; requests fail from now on

    def _get_nvme_controllers(self, p: dict) -> list:
        if "name" in p:
            c = self.nvme.get(p["name"])
            if c is None:
                # Sic: a positive EINVAL (module/bdev/nvme/bdev_nvme_rpc.c).
                raise RpcError(EINVAL, f"Controller {p['name']} does not exist")
            return [_controller_info(c)]
        return [_controller_info(c) for c in self.nvme.values()]

    # -- vhost --------------------------------------------------------------------------

    def _create_vhost(self, p: dict) -> bool:
        name, dev = p["ctrlr"], p["dev_name"]
        if p.get("transport", "vhost_user_blk") != "vhost_user_blk":
            raise RpcError(INVALID_PARAMS, os.strerror(EINVAL))
        if self._bdev(dev) is None:
            raise RpcError(INVALID_PARAMS, os.strerror(ENODEV))     # spdk_bdev_open_ext first
        if name in self.vhost:
            raise RpcError(INVALID_PARAMS, os.strerror(EEXIST))     # vhost_dev_register
        mask = self._cpumask(p.get("cpumask"))
        path = os.path.join(self.vhost_dir, name)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise RpcError(INVALID_PARAMS, os.strerror(EIO))        # not a socket: refused
        vc = VhostController(name, dev, mask, bool(p.get("readonly")), bool(p.get("packed_ring")), path)
        self._serve_vhost(vc)
        self.vhost[name] = vc
        return True

    def _cpumask(self, text: str | None) -> int:
        app_mask = sum(1 << core for core in self.cores)
        if text is None:
            return app_mask
        mask = _parse_cpumask(text)
        if mask is None or mask == 0 or mask & ~app_mask:
            raise RpcError(INVALID_PARAMS, os.strerror(EINVAL))
        return mask

    def _serve_vhost(self, vc: VhostController) -> None:
        if os.path.lexists(vc.socket_path):
            os.unlink(vc.socket_path)       # a stale socket is replaced, as rte_vhost does
        if self.backing_dir:
            vc.qsd_pid = self._start_qsd(vc)
        else:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(vc.socket_path)
            listener.listen(4)
            vc.server = threading.Thread(target=self._hold_initiators, args=(vc, listener), daemon=True)
            vc.server.start()
        os.chmod(vc.socket_path, 0o755)     # what SPDK 26.09 was seen to create

    def _hold_initiators(self, vc: VhostController, listener: socket.socket) -> None:
        """Accept initiators and keep them until they hang up, like rte_vhost.
        This thread alone closes the sockets, once told to by vc.closing."""
        peers: list[socket.socket] = []
        try:
            while not (vc.closing.is_set() or self._stopping.is_set()):
                ready, _, _ = select.select([listener, *peers], [], [], 0.05)
                for s in ready:
                    if s is listener:
                        peers.append(listener.accept()[0])
                    elif not _drain(s):
                        peers.remove(s)
                        s.close()
        finally:
            for s in (*peers, listener):
                s.close()

    def _start_qsd(self, vc: VhostController) -> int:
        image = self.backing_file(vc.bdev)
        if not os.path.exists(image):
            info = self._bdev(vc.bdev)
            with open(image, "wb") as f:
                f.truncate(info["block_size"] * info["num_blocks"])
        pidfile = os.path.join(self.backing_dir, f"{vc.name}.pid")
        subprocess.run([
            self.qsd_binary,
            "--blockdev", f"driver=file,node-name=f0,filename={image}",
            "--blockdev", "driver=raw,node-name=d0,file=f0",
            "--export", f"type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,"
                        f"addr.path={vc.socket_path},writable={'off' if vc.readonly else 'on'}",
            "--pidfile", pidfile, "--daemonize"], check=True, capture_output=True, timeout=30)
        with open(pidfile, encoding="ascii") as f:
            return int(f.read().strip())

    def _delete_vhost(self, p: dict) -> bool:
        vc = self.vhost.get(p["ctrlr"])
        if vc is None:
            raise RpcError(INVALID_PARAMS, os.strerror(ENODEV))
        if self.is_connected(vc.name):
            raise RpcError(INVALID_PARAMS, os.strerror(EBUSY))    # "has still valid connection"
        self._tear_down(vc)
        del self.vhost[vc.name]
        return True

    def _tear_down(self, vc: VhostController) -> None:
        if vc.server is not None:
            vc.closing.set()
            vc.server.join(timeout=5)
            vc.server = None
        if vc.qsd_pid is not None:
            _stop_process(vc.qsd_pid)
            vc.qsd_pid = None
        if os.path.lexists(vc.socket_path):
            os.unlink(vc.socket_path)

    def _get_vhost(self, p: dict) -> list:
        if "name" in p:
            vc = self.vhost.get(p["name"])
            if vc is None:
                raise RpcError(INTERNAL_ERROR, os.strerror(ENODEV))
            return [_vhost_info(vc)]
        return [_vhost_info(vc) for vc in self.vhost.values()]

    # -- NVMe-oF target -----------------------------------------------------------------

    def _create_transport(self, p: dict) -> bool:
        trtype = p["trtype"].upper()
        if trtype in self.transports:
            raise RpcError(INTERNAL_ERROR, f"Transport type '{p['trtype']}' already exists")
        self.transports[trtype] = dict(p)
        return True

    def _create_subsystem(self, p: dict) -> bool:
        if p["nqn"] in self.subsystems:
            raise RpcError(INTERNAL_ERROR, f"Unable to create subsystem {p['nqn']}")
        self.subsystems[p["nqn"]] = {
            "nqn": p["nqn"], "subtype": "NVMe", "listen_addresses": [],
            "allow_any_host": bool(p.get("allow_any_host")), "hosts": [],
            "serial_number": p.get("serial_number", "00000000000000000000"),
            "model_number": p.get("model_number", "SPDK bdev Controller"),
            "max_namespaces": p.get("max_namespaces", 32), "namespaces": []}
        return True

    def _subsystem(self, nqn: str) -> dict:
        if nqn not in self.subsystems:
            raise RpcError(INVALID_PARAMS, f"Subsystem with NQN '{nqn}' not found")
        return self.subsystems[nqn]

    def _add_ns(self, p: dict) -> int:
        sub = self._subsystem(p["nqn"])
        ns = p["namespace"]
        used = {n["nsid"] for n in sub["namespaces"]}
        nsid = ns.get("nsid") or next(i for i in range(1, len(used) + 2) if i not in used)
        if self._bdev(ns["bdev_name"]) is None or nsid in used:
            raise RpcError(INTERNAL_ERROR, "Invalid parameters")   # "Unable to add ns"
        sub["namespaces"].append({"nsid": nsid, "bdev_name": ns["bdev_name"], "name": ns["bdev_name"]})
        return nsid

    def _add_listener(self, p: dict) -> bool:
        sub = self._subsystem(p["nqn"])
        sub["listen_addresses"].append(dict(p["listen_address"]))
        return True

    def _delete_subsystem(self, p: dict) -> bool:
        self._subsystem(p["nqn"])
        del self.subsystems[p["nqn"]]
        return True

    def _get_subsystems(self, p: dict) -> list:
        if "nqn" in p:
            return [copy.deepcopy(self._subsystem(p["nqn"]))]
        return copy.deepcopy(list(self.subsystems.values()))


@pytest.fixture
def spdk_target_double():
    """A started SpdkTargetDouble with an empty inventory, under a short
    directory in /tmp (a Unix socket path must fit in 108 bytes):
    ``<dir>/spdk.sock`` and ``<dir>/vhost/``. Add inventory, then connect."""
    workdir = tempfile.mkdtemp(prefix="spdk-double-")
    double = SpdkTargetDouble(os.path.join(workdir, "spdk.sock"), os.path.join(workdir, "vhost"))
    try:
        yield double.start()
    finally:
        double.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- helpers --------------------------------------------------------------------------------

def _nsids(namespaces: int | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(namespaces, int):
        return tuple(range(1, namespaces + 1))
    return tuple(namespaces)


def _check_reconnect(loss: int, delay: int, fast_fail: int) -> None:
    """bdev_nvme_check_multipath_params: the three reconnect knobs depend on each other."""
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


def _parse_cpumask(text: str) -> int | None:
    """spdk_cpuset_parse: a hex mask (0x optional) or a [list] of cores and ranges."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        mask = 0
        for part in filter(None, text[1:-1].split(",")):
            low, _, high = part.partition("-")
            if not low.strip().isdigit() or (high and not high.strip().isdigit()):
                return None
            for core in range(int(low), int(high or low) + 1):
                mask |= 1 << core
        return mask
    try:
        return int(text, 16)
    except ValueError:
        return None


def _bdev_info(c: NvmeController, nsid: int) -> dict:
    name = f"{c.name}n{nsid}"
    return {
        "name": name, "aliases": [], "product_name": "NVMe disk",
        "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS,
        "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"spdk-double:{name}")),
        "assigned_rate_limits": {"rw_ios_per_sec": 0, "rw_mbytes_per_sec": 0,
                                 "r_mbytes_per_sec": 0, "w_mbytes_per_sec": 0},
        "claimed": False, "zoned": False,
        "supported_io_types": {"read": True, "write": True, "unmap": True, "flush": True,
                               "reset": True, "nvme_admin": True, "nvme_io": True},
        "driver_specific": {"nvme": [{"trid": q.trid(), "ns_data": {"id": nsid}}
                                     for q in c.paths]},
    }


def _controller_info(c: NvmeController) -> dict:
    ctrlrs = [{"state": "enabled", "trid": q.trid(), "cntlid": i + 1, "host": {"nqn": c.hostnqn}}
              for i, q in enumerate(c.paths)]
    if c.alternates:
        ctrlrs[0]["alternate_trids"] = [q.trid() for q in c.alternates]
    return {"name": c.name, "ctrlrs": ctrlrs}


def _vhost_info(vc: VhostController) -> dict:
    return {"ctrlr": vc.name, "cpumask": f"0x{vc.cpumask:x}", "delay_base_us": 0,
            "iops_threshold": 60000, "socket": vc.socket_path,
            "backend_specific": {"block": {"readonly": vc.readonly, "bdev": vc.bdev,
                                           "transport": "vhost_user_blk"}}}


def _error(rid, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def _encode(reply) -> bytes:
    return (json.dumps(reply) + "\n").encode("utf-8")


def _drain(s: socket.socket) -> bool:
    """Read what an initiator sent; False once it hung up."""
    try:
        return bool(s.recv(4096))
    except OSError:
        return False


def _unix_peers(path: str) -> int:
    """Connected server-side sockets bound to path (/proc/net/unix state 02/03):
    counts initiators of our own listener and of a qemu-storage-daemon alike."""
    count = 0
    try:
        with open("/proc/net/unix", encoding="utf-8") as f:
            next(f)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].rstrip("\n") == path and fields[5] in ("02", "03"):
                    count += 1
    except OSError:
        return 0
    return count


def _stop_process(pid: int) -> None:
    """Stop a qemu-storage-daemon this double started (by its pid)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False
