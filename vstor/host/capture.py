"""`vstor host capture`: save exactly the sysfs/procfs files vstor reads.

`read_host` runs once over a recording `SysFS`; every path it read, listed or
checked is then stored in a .tar.gz with the kernel's symlinks kept as
symlinks (and what they point at), so that `read_host(SysFS(<extracted>))`
on another machine builds the same host model.  Listed directories keep only
their links and subdirectories: the regular files in them are stored when
vstor read them, never otherwise (sysfs has write-only and huge attributes:
config, resource*, rom, remove).
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
import time

from vstor.errors import BadInput
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS

# /proc/self is a link to the reading process's pid: stored as a plain
# directory so that an extracted capture reads the same from any process.
_PLAIN_DIRS = ("/proc/self", "/proc/thread-self")
_MAX_LINKS = 40     # the kernel's own limit on links followed in one lookup


class _RecordingSysFS(SysFS):
    """A SysFS that also remembers what each listdir returned."""

    def __init__(self, root: str):
        super().__init__(root, record=set())
        self.listed: dict[str, list[str]] = {}

    def listdir(self, host_path: str) -> list[str]:
        entries = super().listdir(host_path)
        self.listed[host_path] = entries
        return entries


def capture(sysfs_root: str, out_path: str) -> list[str]:
    """Write OUT_PATH (.tar.gz) holding what read_host reads under SYSFS_ROOT;
    returns the captured host paths."""
    sysfs = _RecordingSysFS(sysfs_root)
    read_host(sysfs)
    plan = _Plan(sysfs)
    for host_path in sorted(sysfs.record):
        real = plan.walk(host_path)
        if real is not None and host_path in sysfs.listed:
            plan.add_entries(real, sysfs.listed[host_path])
    try:
        plan.write(out_path)
    except OSError as e:
        raise BadInput(f"cannot write the capture to {out_path}: {e.strerror or e}") from e
    return plan.paths()


class _Plan:
    """The directories, symlinks and files to store, by host path."""

    def __init__(self, sysfs: SysFS):
        self.sysfs = sysfs
        self.dirs: set[str] = set()
        self.links: dict[str, str] = {}
        self.files: set[str] = set()

    def _lstat(self, host_path: str) -> os.stat_result | None:
        try:
            return os.lstat(self.sysfs.path(host_path))
        except OSError:
            return None     # vanished, or never there: absent in the capture too

    def walk(self, host_path: str) -> str | None:
        """Store every component of HOST_PATH, following (and keeping) symlinks
        the way the kernel resolves them; returns the real path it ends at."""
        pending = list(reversed(host_path.strip("/").split("/")))
        current, followed = "", 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                current = posixpath.dirname(current).rstrip("/")
                continue
            path = f"{current}/{name}"
            st = self._lstat(path)
            if st is None:
                return None
            if stat.S_ISLNK(st.st_mode) and path not in _PLAIN_DIRS:
                followed += 1
                if followed > _MAX_LINKS:
                    return None
                target = self._keep_link(path)
                if target.startswith("/"):
                    current = ""
                pending.extend(reversed(target.split("/")))
                continue
            if stat.S_ISDIR(st.st_mode) or path in _PLAIN_DIRS:
                self.dirs.add(path)
            elif not pending:
                self.files.add(path)
            current = path
        return current or "/"

    def _keep_link(self, path: str) -> str:
        target = os.readlink(self.sysfs.path(path))
        if target.startswith("/"):
            # sysfs links are relative; an absolute one would leave the extracted root.
            self.links[path] = posixpath.relpath(target, posixpath.dirname(path))
        else:
            self.links[path] = target
        return target

    def add_entries(self, real_dir: str, entries: list[str]) -> None:
        base = "" if real_dir == "/" else real_dir
        for name in entries:
            path = f"{base}/{name}"
            st = self._lstat(path)
            if st is None or path in self.files:
                continue
            if stat.S_ISLNK(st.st_mode) and path not in _PLAIN_DIRS:
                self._keep_link(path)
            elif stat.S_ISDIR(st.st_mode) or path in _PLAIN_DIRS:
                self.dirs.add(path)

    def paths(self) -> list[str]:
        return sorted(self.dirs | set(self.links) | self.files)

    def _all_dirs(self) -> list[str]:
        dirs = set(self.dirs)
        for path in self.paths():
            parent = posixpath.dirname(path)
            while parent not in ("/", "") and parent not in dirs:
                dirs.add(parent)
                parent = posixpath.dirname(parent)
        return sorted(dirs)

    def write(self, out_path: str) -> None:
        now = int(time.time())
        with tarfile.open(out_path, "w:gz") as tar:
            for path in self._all_dirs():
                tar.addfile(_info(path, tarfile.DIRTYPE, now, 0o755))
            for path in sorted(self.links):
                info = _info(path, tarfile.SYMTYPE, now, 0o777)
                info.linkname = self.links[path]
                tar.addfile(info)
            for path in sorted(self.files):
                data = self._content(path)
                info = _info(path, tarfile.REGTYPE, now, 0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    def _content(self, path: str) -> bytes:
        try:
            with open(self.sysfs.path(path), "rb") as f:
                return f.read()
        except OSError:
            # Checked for existence only, or refuses to be read (a write-only
            # attribute): its presence is what vstor looked at.
            return b""


def _info(path: str, kind: bytes, mtime: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path.lstrip("/"))
    info.type, info.mtime, info.mode = kind, mtime, mode
    return info
