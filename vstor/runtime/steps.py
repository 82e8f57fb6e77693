"""The executor: what the journal and the lifecycle call to carry out steps,
and the host operations each step is given.

What a step does is its kind's class's (vstor.runtime.kinds); the functions
here hand it HostOps, the only way a kind reaches the host.  Every `do`
looks before it creates (a re-run after a crash finds its own work and
takes it over); every `undo` copes with a half-done `do`.  The journal
calls `do` and `undo` through this module (tests/crash_child.py wraps them
to kill the process at every point).
"""

from __future__ import annotations

from vstor.errors import DoesNotFit
from vstor.runtime import kinds
from vstor.runtime.kinds.base import Writes

encode = kinds.to_json
decode = kinds.from_json
# Kinds whose consecutive steps the journal does (and undoes) side by side,
# and kinds done without the host lock: as each kind's class says.
PARALLEL = frozenset(kind for kind, cls in kinds.KINDS.items() if cls.parallel)
PRIVATE = frozenset(kind for kind, cls in kinds.KINDS.items() if cls.private)


class HostOps:
    """What a step may do to the host: the runtime's sysfs, SPDK (connected
    on first use, once per Runtime) and config, and the backends'
    operations with this host's policy filled in (the image roots, the
    block devices its sysfs names).  Each backend is imported when first
    used: a release that stops daemons never loads vfio."""

    def __init__(self, rt):
        self.sysfs, self.cfg, self.force, self.handover = rt.sysfs, rt.cfg, rt.force, rt.handover
        self.spdk = rt.spdk
        self.looked_since = rt.looked_since

    def vfio_plan(self, address: str):
        """Where the controller and its IOMMU group peers are now."""
        from vstor.backends import vfio
        return vfio.plan_bind(self.sysfs, address)

    def vfio_bind(self, target) -> None:
        from vstor.backends import vfio
        vfio.bind_to_vfio(self.sysfs, target)

    def vfio_restore(self, original) -> None:
        from vstor.backends import vfio
        vfio.restore_driver(self.sysfs, original)

    def qsd_start(self, export, handover: bool) -> None:
        from vstor.backends.qsd import daemon
        daemon.start(export, handover=handover, **self._policy())

    def qsd_stop(self, export) -> None:
        from vstor.backends.qsd import daemon
        daemon.stop(export, since=self.looked_since)

    def qsd_maybe_running(self, export) -> bool:
        """Its pidfile is there (a daemon that lost it is found by stop)."""
        import os
        return os.path.lexists(export.pidfile)

    def qsd_alive(self, export) -> bool:
        from vstor.backends.qsd import daemon
        return daemon.alive(export)

    def qsd_restart(self, export) -> None:
        """Start the daemon again if it died; a live one is left alone."""
        from vstor.backends.qsd import daemon
        daemon.restart_if_dead(export, **self._policy())

    def clients(self, socket_path: str) -> int:
        """How many peers are connected to a listening Unix socket."""
        from vstor.backends.qsd import proc
        return proc.unix_peers(socket_path, since=self.looked_since)

    def ensure_dir(self, path: str, group: str) -> None:
        from vstor.backends import ownership
        ownership.ensure_dir(path, group)

    def restrict_socket(self, path: str, group: str) -> None:
        from vstor.backends import ownership
        ownership.restrict_socket(path, group)

    def open_source(self, kind: str, path: str):
        """A file or block device source held open (vstor.host.sources), as
        the daemon will be given it; a context manager."""
        from vstor.host import sources
        return sources.open_source(kind, path, **self._policy())

    def resolve_image(self, path: str) -> str:
        """The file a file source is now, symlinks followed one by one below
        an image root (vstor.host.sources)."""
        from vstor.host import sources
        with sources.open_file(path, self.cfg.images) as src:
            return src.resolved

    def _policy(self) -> dict:
        """What a qemu-storage-daemon's source may be: below the image roots, or
        the block device this host's sysfs names as the path does."""
        from vstor.host import sources
        return {"roots": self.cfg.images, "kernel_name": sources.sysfs_kernel_name(self.sysfs)}


def preflight(steps: list, rt) -> None:
    """The read-only checks a dry run makes too (each step's own), so it
    never says yes to a start that would be refused; and no two of the
    steps writing one file or device, however it is named (a symlink, a
    second path): their daemons start side by side, so neither's look for
    another writer sees the other (the planner refuses the same path
    written twice)."""
    ops = HostOps(rt)
    seen: dict[tuple, Writes] = {}
    for step in steps:
        mine = step.preflight(ops)
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
    return step.observe(HostOps(rt), others)


def do(step, rt) -> None:
    step.do(HostOps(rt))


def undo(step, rt, others) -> None:
    """`others`: what the other domains hold: a shared thing stays while one uses it."""
    step.undo(HostOps(rt), others)


def undo_waits(step, rt) -> bool:
    """Undoing the step may wait on something (side by side then)."""
    return step.undo_waits(HostOps(rt))


def in_use(step, rt) -> str | None:
    """Why undoing the step now would take something from a running QEMU, or None."""
    return step.in_use(HostOps(rt))


def check(step, rt) -> str | None:
    """None when what the step made still exists and works, else why not."""
    return step.check(HostOps(rt))


def repair(step, rt) -> None:
    """Bring back what check() found missing."""
    step.repair(HostOps(rt))
