"""SpdkTargetDouble: the double itself, its lifecycle and the framework
methods; the method families live in bdev.py, vhost.py and nvmf.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from tests.doubles.spdk.apps import APPS, RELEASES, rpc_methods, subsystems
from tests.doubles.spdk.bdev import TRTYPES, BdevLayer, NvmeController, Trid
from tests.doubles.spdk.nvmf import Fabric, NvmfTarget, Subsystem
from tests.doubles.spdk.schema import FACTS, load_facts
from tests.doubles.spdk.server import JsonRpcServer
from tests.doubles.spdk.vhost import VhostController, VhostTarget

QSD_BINARY = "/usr/bin/qemu-storage-daemon"


class SpdkTargetDouble(JsonRpcServer, BdevLayer, VhostTarget, NvmfTarget):
    """A JSON-RPC server on ``socket_path`` that behaves like an SPDK app.

    ``app``: "vhost" (default), "nvmf_tgt" or "spdk_tgt"; ``version``:
    "v24.01" (default, for now) or "v26.09" (see the package docstring);
    ``version_text`` overrides what spdk_get_version reports after "SPDK v".
    ``cores``: the app's -m mask; ``vhost_dir``: its -S directory.
    ``fabric``: a Fabric shared with other doubles (nvmf_tgt/spdk_tgt ones
    serve on it, any one attaches through it).
    Inventory of this double alone: ``add_pcie(traddr, namespaces)`` and
    ``add_fabric(trtype, traddr, trsvcid, subnqn, namespaces)`` (namespaces:
    a count or nsids). ``backing_dir``: serve each vhost controller with a
    real qemu-storage-daemon exporting ``<backing_dir>/<bdev>.raw``."""

    def __init__(self, socket_path: str, vhost_dir: str | None = None, *, app: str = "vhost",
                 version: str = "v24.01", version_text: str | None = None,
                 cores: tuple[int, ...] = (0, 1), fabric: Fabric | None = None,
                 facts: Path | str = FACTS, backing_dir: str | None = None,
                 qsd_binary: str = QSD_BINARY):
        if app not in APPS:
            raise ValueError(f"app must be one of {sorted(APPS)}, not {app!r}")
        if version not in RELEASES:
            raise ValueError(f"version must be one of {sorted(RELEASES)}, not {version!r}")
        if vhost_dir is None and "vhost" in APPS[app]:
            raise ValueError(f"an SPDK {app} app needs a vhost_dir (its -S directory)")
        self.socket_path = str(socket_path)
        self.vhost_dir = str(vhost_dir) if vhost_dir is not None else None
        self.app, self.families = app, APPS[app]
        self.version, self.release = version, RELEASES[version]
        self.version_text = version_text or self.release.text
        self.cores = tuple(cores)
        self.fabric = fabric
        self.facts = load_facts(facts)
        self.backing_dir = backing_dir
        self.qsd_binary = qsd_binary
        self.requests: list[dict] = []
        self.faults: dict[str, list] = {}
        self.pcie: dict[str, tuple[int, ...]] = {}
        self.fabrics: dict[tuple, tuple[int, ...]] = {}
        self.malloc: dict = {}
        self.nvme: dict[str, NvmeController] = {}
        self.vhost: dict[str, VhostController] = {}
        self.claims: dict[str, tuple[str, str]] = {}      # bdev -> (claim type, module)
        self.transports: dict[str, dict] = {}
        self.subsystems: dict[str, Subsystem] = {}
        self._malloc_count = 0
        self._cntlids: dict[tuple, int] = {}
        self._vids: set[int] = set()
        self._vid_lock = threading.Lock()
        self._watching = False
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._stopping.set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._handlers = {
            "spdk_get_version": self._get_version,
            "rpc_get_methods": self._get_methods,
            "framework_get_reactors": self._get_reactors,
            "framework_get_subsystems": self._get_subsystems_of_framework,
            "bdev_get_bdevs": self._get_bdevs,
            "bdev_malloc_create": self._malloc_create,
            "bdev_malloc_delete": self._malloc_delete,
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
            "nvmf_subsystem_add_host": self._add_host,
            "nvmf_delete_subsystem": self._delete_subsystem,
            "nvmf_get_subsystems": self._get_subsystems,
        }
        if fabric is not None and "nvmf" in self.families:
            fabric.join(self)

    def fail(self, method: str, code: int = -5, message: str = "Input/output error",
             times: int = 1) -> None:
        """Fault injection: the next `times` calls of `method` answer this error
        (after the schema check, as SPDK's handler would)."""
        self.faults[method] = [code, message, times]

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this app answers (and the double models)."""
        return tuple(m for m in self._handlers if self.serves(m))

    @property
    def running(self) -> bool:
        return not self._stopping.is_set()

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

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> SpdkTargetDouble:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> SpdkTargetDouble:
        """Listen on socket_path (again, after stop(): an SPDK restart that
        kept its state; a fresh double is a restart that did not)."""
        self._threads = []
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        if self.vhost_dir is not None and "vhost" in self.families:
            os.makedirs(self.vhost_dir, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self._stopping.clear()
        self._spawn(self._serve)
        return self

    def stop(self) -> None:
        """Stop answering and remove every socket; what was recorded stays
        (deferred answers are dropped)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        with self._lock:
            for vc in list(self.vhost.values()):
                self._tear_down(vc)
            self.vhost.clear()
            self._watching = False
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- framework ----------------------------------------------------------------------

    def _get_version(self, p: dict) -> dict:
        m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?([^ ]*)(?: git sha1 (\w+))?", self.version_text)
        major, minor, patch, suffix, commit = m.groups()
        fields = {"major": int(major), "minor": int(minor), "patch": int(patch or 0), "suffix": suffix}
        if commit:
            fields["commit"] = commit
        return {"version": f"SPDK v{self.version_text}", "fields": fields}

    def _get_methods(self, p: dict) -> list[str]:
        return rpc_methods(self.app)

    def _get_subsystems_of_framework(self, p: dict) -> list[dict]:
        return subsystems(self.app)

    def _get_reactors(self, p: dict) -> dict:
        reactors = [{"lcore": core, "numa_id": 0, "tid": os.getpid(), "busy": 0, "idle": 0,
                     "in_interrupt": False, "irq": 0, "sys": 0, "usr": 0,
                     "lw_threads": [{"name": "app_thread", "id": 1, "cpumask": f"{1 << core:x}",
                                     "elapsed": 0}] if core == self.cores[0] else []}
                    for core in self.cores]
        return {"tick_rate": 2_000_000_000, "pid": os.getpid(), "reactors": reactors}


@pytest.fixture
def spdk_target_double():
    """A started SpdkTargetDouble with an empty inventory, under a short
    directory in /tmp (a Unix socket path must fit in 108 bytes):
    ``<dir>/spdk.sock`` and ``<dir>/vhost/``. Add inventory, then connect.
    An spdk_tgt (the tests using it drive both vhost and NVMe-oF), still
    reporting "SPDK v26.09-pre" as the double did before it had versions."""
    workdir = tempfile.mkdtemp(prefix="spdk-double-")
    double = SpdkTargetDouble(os.path.join(workdir, "spdk.sock"), os.path.join(workdir, "vhost"),
                              app="spdk_tgt", version_text="26.09-pre")
    try:
        yield double.start()
    finally:
        double.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _nsids(namespaces: int | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(namespaces, int):
        return tuple(range(1, namespaces + 1))
    return tuple(namespaces)
