"""Reads (and the few writes) of sysfs and procfs, under a root that tests and
offline planning point elsewhere.

Every path is given as the host sees it ('/sys/bus/pci/devices'); `SysFS`
joins it to its root.  The kernel's sysfs symlinks are relative, so a captured
or synthetic tree resolves them inside the root too.  Reads tolerate a device
vanishing between a listdir and a read (ENOENT/ENODEV), and attributes the
kernel refuses to show (EINVAL/EIO/EACCES): they return the default.
"""

from __future__ import annotations

import errno
import os

_GONE = (errno.ENOENT, errno.ENODEV, errno.ENXIO, errno.EINVAL, errno.EIO,
         errno.EACCES, errno.EPERM, errno.ENOTDIR)


class SysFS:
    def __init__(self, root: str = "/", record: set[str] | None = None):
        self.root = os.path.abspath(root)
        # When given, every host path read, listed or resolved is added here
        # (used by `vstor host capture` to save exactly what vstor reads).
        self.record = record

    def path(self, host_path: str) -> str:
        if not host_path.startswith("/"):
            raise ValueError(f"host path must be absolute: {host_path!r}")
        if self.root == "/":
            return host_path
        return self.root + host_path

    def _touch(self, host_path: str) -> None:
        if self.record is not None:
            self.record.add(host_path)

    def read(self, host_path: str, default: str | None = None) -> str | None:
        self._touch(host_path)
        try:
            with open(self.path(host_path), "rb") as f:
                return f.read().decode("utf-8", "replace").strip()
        except OSError as e:
            if e.errno in _GONE or isinstance(e, IsADirectoryError):
                return default
            raise

    def read_int(self, host_path: str, default: int | None = None, base: int = 10) -> int | None:
        text = self.read(host_path)
        if text is None or text == "":
            return default
        try:
            return int(text, base)
        except ValueError:
            return default

    def listdir(self, host_path: str) -> list[str]:
        self._touch(host_path)
        try:
            return sorted(os.listdir(self.path(host_path)))
        except OSError as e:
            if e.errno in _GONE:
                return []
            raise

    def exists(self, host_path: str) -> bool:
        self._touch(host_path)
        return os.path.lexists(self.path(host_path))

    def is_dir(self, host_path: str) -> bool:
        self._touch(host_path)
        return os.path.isdir(self.path(host_path))

    def link_name(self, host_path: str) -> str | None:
        """The last component of a symlink's target ('driver' -> 'nvme')."""
        self._touch(host_path)
        try:
            return os.path.basename(os.readlink(self.path(host_path)))
        except OSError as e:
            if e.errno in _GONE:
                return None
            raise

    def resolve(self, host_path: str) -> str | None:
        """The host path a symlinked path really is, or None if it is gone."""
        self._touch(host_path)
        real = os.path.realpath(self.path(host_path))
        if not os.path.lexists(real):
            return None
        if self.root == "/":
            return real
        if real == self.root:
            return "/"
        if not real.startswith(self.root + "/"):
            return None     # a link that leaves the root: not ours to follow
        return real[len(self.root):]

    def write(self, host_path: str, value: str) -> None:
        """Write a sysfs attribute; errors propagate (the caller undoes)."""
        with open(self.path(host_path), "w") as f:
            f.write(value)
