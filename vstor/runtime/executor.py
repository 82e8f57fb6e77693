"""The executor: what the journal and the lifecycle call to carry out steps,
and the Runtime each step is given: the host operations.

What a step does is its kind's class's (vstor.runtime.kinds); the functions
here hand it the Runtime, the only way a kind reaches the host.  Every `do`
looks before it creates (a re-run after a crash finds its own work and
takes it over); every `undo` copes with a half-done `do`.  The journal
calls `do` and `undo` through this module (tests/crash_child.py wraps them
to kill the process at every point).
"""

from __future__ import annotations

import copy
import os
import time

from vstor.config import Config
from vstor.errors import DoesNotFit
from vstor.runtime import kinds
from vstor.runtime.kinds.base import Writes

encode = kinds.to_json
decode = kinds.from_json
# Kinds whose consecutive steps the journal does (and undoes) side by side,
# and kinds done without the host lock: as each kind's class says.
PARALLEL = frozenset(kind for kind, cls in kinds.KINDS.items() if cls.parallel)
PRIVATE = frozenset(kind for kind, cls in kinds.KINDS.items() if cls.private)


class Runtime:
    """What a run's steps may do to the host, the only way a step kind
    reaches it: the config, the host's sysfs, and one attribute per backend
    with this host's policy filled in (the image roots, the block devices
    its sysfs names): `spdk` (the client, connected on first use, once per
    Runtime), `qsd`, `vfio`, and the `sources` and socket `ownership` the
    backends share. Each backend's module is imported when first used: a
    release that stops daemons never loads vfio."""

    def __init__(self, cfg: Config, sysfs, dry_run: bool = False, spdk_factory=None,
                 force: bool = False, handover: bool = False):
        self.cfg = cfg
        self.sysfs = sysfs
        self.dry_run = dry_run
        # The destination of a live migration: the source host's backend of
        # the same disk may hold a shared source until its QEMU stops.
        self.handover = handover
        # release --force: undo even what QEMU still uses (SPDK then finishes
        # a vhost controller's deletion when QEMU lets go).
        self.force = force
        self._spdk_factory = spdk_factory
        self._spdk = None
        self.sources = Sources(cfg.images, sysfs)
        self.ownership = Ownership()
        self.vfio = Vfio(sysfs)
        self.qsd = Qsd(self.sources, since=None)

    def looking_once(self) -> "Runtime":
        """This runtime for a run that stops many daemons and starts none
        (gc): one look through /proc (for daemons that lost their pidfile,
        and at /proc/net/unix for QEMU's connections) serves every stop and
        every check for a connected QEMU, not one per daemon. A QEMU that
        connects after the look connects to a domain that started since gc
        asked what runs: its start changed its record, which gc then leaves."""
        out = copy.copy(self)
        out.qsd = Qsd(self.sources, since=time.monotonic())
        return out

    def of(self, rec) -> "Runtime":
        """This runtime for undoing or checking what `rec` (a state record)
        holds: its SPDK steps ask the SPDK application they were made through."""
        if not getattr(rec, "spdk_socket", None) or rec.spdk_socket == self.cfg.spdk_socket:
            return self
        from vstor import records
        out = copy.copy(self)
        out.cfg = records.replace(self.cfg, spdk_socket=rec.spdk_socket)
        out._spdk = None
        return out

    @property
    def spdk(self):
        if self._spdk is None:
            if self._spdk_factory:
                self._spdk = self._spdk_factory()
            else:
                from vstor.backends.spdk import SpdkClient
                self._spdk = SpdkClient(self.cfg.spdk_socket, timeout=self.cfg.spdk_timeout,
                                        dry_run=self.dry_run, vhost_dir=self.cfg.vhost_dir,
                                        config=self.cfg.file)
        return self._spdk


class Sources:
    """File and block device sources as the backends are given them
    (vstor.host.sources): below the image roots, or the block device this
    host's sysfs names as the path does."""

    def __init__(self, images, sysfs):
        self.images = images
        self.sysfs = sysfs

    def policy(self) -> dict:
        from vstor.host import sources
        return {"roots": self.images, "kernel_name": sources.sysfs_kernel_name(self.sysfs)}

    def open(self, kind: str, path: str):
        """The source held open, as the daemon will be given it; a context manager."""
        from vstor.host import sources
        return sources.open_source(kind, path, **self.policy())

    def resolve(self, path: str) -> str:
        """The file a file source is now, symlinks followed one by one below
        an image root."""
        from vstor.host import sources
        with sources.open_file(path, self.images) as src:
            return src.resolved


class Ownership:
    """Who may reach a vhost-user socket (vstor.backends.ownership)."""

    def ensure_dir(self, path: str, group: str) -> None:
        from vstor.backends import ownership
        ownership.ensure_dir(path, group)

    def restrict_socket(self, path: str, group: str) -> None:
        from vstor.backends import ownership
        ownership.restrict_socket(path, group)


class Vfio:
    """An NVMe controller handed to vfio-pci and back (vstor.backends.vfio)."""

    def __init__(self, sysfs):
        self.sysfs = sysfs

    def plan(self, address: str):
        """Where the controller and its IOMMU group peers are now."""
        from vstor.backends import vfio
        return vfio.plan_bind(self.sysfs, address)

    def bind(self, target) -> None:
        from vstor.backends import vfio
        vfio.bind_to_vfio(self.sysfs, target)

    def restore(self, original) -> None:
        from vstor.backends import vfio
        vfio.restore_driver(self.sysfs, original)


class Qsd:
    """qemu-storage-daemons (vstor.backends.qsd). `since`: a look through
    /proc made after this moment (time.monotonic()) serves every call
    (Runtime.looking_once); None: each asks anew."""

    def __init__(self, sources: Sources, since: float | None):
        self.sources = sources
        self.since = since

    def start(self, export, handover: bool) -> None:
        from vstor.backends.qsd import daemon
        daemon.start(export, handover=handover, **self.sources.policy())

    def stop(self, export) -> None:
        from vstor.backends.qsd import daemon
        daemon.stop(export, since=self.since)

    def maybe_running(self, export) -> bool:
        """Its pidfile is there (a daemon that lost it is found by stop)."""
        return os.path.lexists(export.pidfile)

    def alive(self, export) -> bool:
        from vstor.backends.qsd import daemon
        return daemon.alive(export)

    def restart(self, export) -> None:
        """Start the daemon again if it died; a live one is left alone."""
        from vstor.backends.qsd import daemon
        daemon.restart_if_dead(export, **self.sources.policy())

    def clients(self, socket_path: str) -> int:
        """How many peers are connected to a listening Unix socket."""
        from vstor.backends.qsd import proc
        return proc.unix_peers(socket_path, since=self.since)


def preflight(steps: list, rt) -> None:
    """The read-only checks a dry run makes too (each step's own), so it
    never says yes to a start that would be refused; and no two of the
    steps writing one file or device, however it is named (a symlink, a
    second path): their daemons start side by side, so neither's look for
    another writer sees the other (the planner refuses the same path
    written twice)."""
    seen: dict[tuple, Writes] = {}
    for step in steps:
        mine = step.preflight(rt)
        if mine is None:
            continue
        other = seen.get(mine.thing)
        if other is not None and not (other.readonly and mine.readonly):
            what = "device" if mine.thing[0] == "dev" else "file"
            raise DoesNotFit(f"{mine.name} and {other.name} are one {what} ({mine.path} and "
                             f"{other.path}): two writers would corrupt it",
                             hint="give each disk its own source, or make both readonly='yes'")
        seen[mine.thing] = mine


def observe(step, rt, others):
    """The step with the host facts its undo needs, read now (no writes).
    `others`: what the other domains hold (vstor.runtime.holders)."""
    return step.observe(rt, others)


def do(step, rt) -> None:
    step.do(rt)


def undo(step, rt, others) -> None:
    """`others`: what the other domains hold: a shared thing stays while one uses it."""
    step.undo(rt, others)


def undo_waits(step, rt) -> bool:
    """Undoing the step may wait on something (side by side then)."""
    return step.undo_waits(rt)


def in_use(step, rt) -> str | None:
    """Why undoing the step now would take something from a running QEMU, or None."""
    return step.in_use(rt)


def check(step, rt) -> str | None:
    """None when what the step made still exists and works, else why not."""
    return step.check(rt)


def repair(step, rt) -> None:
    """Bring back what check() found missing."""
    step.repair(rt)
