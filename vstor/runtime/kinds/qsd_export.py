"""qsd-export: a qemu-storage-daemon serving one file or block device to one
domain's QEMU over vhost-user-blk."""

from __future__ import annotations

import stat

from vstor.backends.qsd.export import QsdExport as QsdSpec
from vstor.records import record, replace
from vstor.runtime.kinds.base import Kind, Writes


@record
class QsdExport(Kind):
    """One daemon, all of it named by `export` (vstor.backends.qsd.export)."""
    export: QsdSpec
    kind = "qsd-export"
    # One daemon per disk, under a lock of its own name: a domain's daemons
    # start (and stop) side by side.
    parallel = True
    # The domain's own daemon, socket and source: done without the host lock.
    private = True

    def describe(self) -> str:
        return f"start qemu-storage-daemon for {self.export.source} on {self.export.socket_path}"

    def dry_run(self) -> list[str]:
        return self.export.dry_run_lines()

    def to_data(self) -> dict:
        return self.export.to_record()

    @classmethod
    def from_data(cls, d: dict) -> "QsdExport":
        return cls(QsdSpec.from_record(d))

    def makes(self) -> str:
        return self.export.name

    def preflight(self, rt) -> Writes | None:
        """The source opened as the daemon will open it: refused when a file
        resolves outside the image roots, or the source is missing or of
        the wrong kind."""
        if self.export.kind == "block" and rt.sysfs.root != "/":
            return None     # a block device is the host's, and an offline --host-root has none
        with rt.sources.open(self.export.kind, self.export.source) as src:
            st = src.st
        thing = ("dev", st.st_rdev) if stat.S_ISBLK(st.st_mode) else ("file", st.st_dev, st.st_ino)
        return Writes(thing, self.export.readonly, self.export.name, self.export.source)

    def observe(self, rt, others) -> "QsdExport":
        """A file source by the file it is now, symlinks followed one by one
        below an image root: what the record names.  The daemon is given
        the file it opens itself, never this name."""
        if self.export.kind != "file":
            return self
        return QsdExport(replace(self.export, source=rt.sources.resolve(self.export.source)))

    def do(self, rt) -> None:
        rt.qsd.start(self._here(rt), handover=rt.handover)

    def undo(self, rt, others) -> None:
        rt.qsd.stop(self.export)

    def undo_waits(self, rt) -> bool:
        """A daemon may be running (its pidfile is there): stopping it waits
        for it to exit, so the journal stops a domain's daemons side by
        side; with none there (gc of a domain whose daemons are long gone)
        one after the other costs less than a thread each."""
        return rt.qsd.maybe_running(self.export)

    def in_use(self, rt) -> str | None:
        if rt.qsd.clients(self.export.socket_path):
            return f"a client (QEMU) is connected to {self.export.socket_path}"
        return None

    def check(self, rt) -> str | None:
        return None if rt.qsd.alive(self.export) else "qemu-storage-daemon is not running"

    def repair(self, rt) -> None:
        rt.qsd.restart(self._here(rt))

    def _here(self, rt) -> QsdSpec:
        """The export's CPUs are the planned host's; when vstor reads another
        host's tree (VSTOR_HOST_ROOT: a capture, a test layout) they need not
        exist here, and the daemon is not pinned."""
        if rt.sysfs.root == "/" or not self.export.cpus:
            return self.export
        return replace(self.export, cpus=())
