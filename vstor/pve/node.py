"""This Proxmox node as vstor needs it: VM configs, which VMs run here,
qemu-server's per-VM lock, the snippets storage, the QEMU version.

Paths come from [pve] in vstor.conf (tests point them at a directory).
A read that fails is a refusal, never "no VM" or "not running".
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
import time
from contextlib import contextmanager

from vstor.atomic import write_file
from vstor.config import Config
from vstor.errors import BadInput, InUse, Unavailable
from vstor.formats.pve import storage as storage_mod
from vstor.formats.pve.config import MAX_BYTES, PveConfig
from vstor.formats.pve.grammar import Mappings
from vstor.formats.pve.vm import vmid_of

_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", re.ASCII)
LOCK_SECONDS = 10           # how long qemu-server waits for a VM's config lock


class Node:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.etc = cfg.pve_etc

    def is_proxmox(self) -> bool:
        return os.path.isdir(os.path.join(self.etc, "qemu-server"))

    # -- configs ------------------------------------------------------------------

    def config_path(self, vm: int, migrated_from: str | None = None) -> str:
        """This node's config of the VM, or, on a migration's target before
        the config moves, the source node's."""
        if migrated_from:
            if not _NODE.fullmatch(migrated_from):
                raise BadInput(f"PVE_MIGRATED_FROM '{migrated_from[:40]}' is not a node name")
            return os.path.join(self.etc, "nodes", migrated_from, "qemu-server", f"{vm}.conf")
        return os.path.join(self.etc, "qemu-server", f"{vm}.conf")

    def read_config(self, vm: int, path: str | None = None,
                    missing: str = "check the VMID (qm list)") -> tuple[PveConfig, str]:
        """`missing`: the hint when there is no such config."""
        path = path or self.config_path(vm)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            raise BadInput(f"VM {vm} does not exist on this node (no {path})", hint=missing) from None
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}", hint="run as root") from None
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise BadInput(f"{path} is not UTF-8 text") from None
        return PveConfig.parse(text, path), path

    def write_config(self, path: str, text: str) -> None:
        """As qemu-server writes it: a temporary file renamed over the config
        (the cluster filesystem makes the rename atomic cluster-wide)."""
        write_file(path, text, mode=None, hint="run as root")

    @contextmanager
    def lock(self, vm: int, wait: bool = True, timeout: float = LOCK_SECONDS):
        """qemu-server's lock of the VM's config (flock on
        lock-<VMID>.conf): held by every start, stop, migration and `qm set`.
        InUse when somebody holds it longer than `timeout` seconds (as
        qemu-server gives up), or at once with wait=False."""
        path = os.path.join(self.cfg.pve_lock_dir, f"lock-{vm}.conf")
        try:
            os.makedirs(self.cfg.pve_lock_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise Unavailable(f"cannot open {path}: {e.strerror}", hint="run as root") from None
        try:
            deadline = time.monotonic() + (timeout if wait else 0)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                if time.monotonic() >= deadline:
                    raise InUse(f"VM {vm}'s config is locked: a start, stop, migration or "
                                     "config change is under way", hint="try again when it is done")
                time.sleep(0.1)
            yield
        finally:
            os.close(fd)

    # -- running VMs ------------------------------------------------------------------

    def pidfile(self, vm: int) -> str:
        return os.path.join(self.cfg.pve_run_dir, f"{vm}.pid")

    def qmp_path(self, vm: int) -> str:
        """QEMU's monitor socket, as qemu-server makes it next to the pidfile."""
        return os.path.join(self.cfg.pve_run_dir, f"{vm}.qmp")

    def running(self, vm: int) -> bool:
        return self.qemu_pid(vm) is not None

    def qemu_pid(self, vm: int) -> int | None:
        """qemu-server's own test: the pid its pidfile names, if that is a
        live process started with `-pidfile <that file>`; None when not."""
        path = self.pidfile(vm)
        try:
            with open(path) as f:
                text = f.read(32).strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unavailable(f"cannot read {path}: {e.strerror}") from None
        if not (text.isascii() and text.isdigit() and len(text) <= 10):
            return None
        try:
            with open(f"/proc/{int(text)}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError as e:
            raise Unavailable(f"cannot read /proc/{text}/cmdline: {e.strerror}") from None
        want = os.path.realpath(path)
        ok = any(a == b"-pidfile" and os.path.realpath(os.fsdecode(b)) == want
                 for a, b in zip(argv, argv[1:]))
        return int(text) if ok else None

    # -- storage, QEMU ----------------------------------------------------------------------

    def snippets(self) -> storage_mod.Storage:
        path = os.path.join(self.etc, "storage.cfg")
        try:
            with open(path) as f:
                text = f.read(MAX_BYTES)
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}",
                           hint="is this a Proxmox VE node? ([pve] etc in vstor.conf)") from None
        return storage_mod.snippets_storage(storage_mod.parse(text), self.cfg.pve_storage, path)

    def pci_mappings(self):
        """/etc/pve/mapping/pci.cfg as this node reads it (qemu-server's
        mapping= lines): its name is the host name up to the first dot
        (PVE::INotify::nodename)."""
        path = os.path.join(self.etc, "mapping", "pci.cfg")
        name = os.uname().nodename.split(".")[0]
        try:
            with open(path, "rb") as f:
                return Mappings(f.read(MAX_BYTES).decode(errors="replace"), name)
        except FileNotFoundError:
            return Mappings("", name)       # no mapping at all: each one named is unresolved
        except OSError as e:
            return Mappings(None, name, e.strerror)

    def qemu_version(self) -> tuple[int, int]:
        """The version of the QEMU qemu-server starts (`kvm --version`)."""
        try:
            out = subprocess.run([self.cfg.pve_qemu, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"cannot run {self.cfg.pve_qemu} --version ({e})",
                              hint="set [pve] qemu, or pass --qemu-version 9.2") from None
        return parse_version(out, self.cfg.pve_qemu)


def parse_version(text: str, origin: str) -> tuple[int, int]:
    m = re.search(r"version (\d{1,3})\.(\d{1,3})", text)
    if not m:
        raise Unavailable(f"{origin} did not say its version", hint="pass --qemu-version 9.2")
    return int(m.group(1)), int(m.group(2))


class RunGuard:
    """Around a release of what vstor holds for `name`: for a Proxmox VM,
    its config lock taken (no start, stop or migration under way or
    beginning) and the VM checked not to run; entering gives the reason to
    leave it, or None.  Anything else passes (None)."""

    def __init__(self, node: Node, name: str):
        self.node, self.vm, self._lock = node, vmid_of(name), None

    def __enter__(self) -> str | None:
        if self.vm is None or not self.node.is_proxmox():
            return None
        lock = self.node.lock(self.vm, wait=False)
        try:
            lock.__enter__()
        except InUse:
            return "its config is locked (a start, stop or migration is under way)"
        self._lock = lock
        try:
            return "it runs on this node" if self.node.running(self.vm) else None
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> bool:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(None, None, None)
        return False
