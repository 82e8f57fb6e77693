"""Reads (and the few writes) of sysfs and procfs, under a root that tests and
offline planning point elsewhere.

Every path is given as the host sees it ('/sys/bus/pci/devices'); `SysFS`
joins it to its root.  The kernel's sysfs symlinks are relative, so a captured
or synthetic tree resolves them inside the root too.

A path that is not there (never was on this kernel, or a device that vanished
between a listdir and a read: ENOENT/ENODEV/ENXIO/ENOTDIR) reads as the
default: absence is an answer.  A read the kernel refuses (EACCES/EPERM, or
EIO/EINVAL from a driver) is not: vstor decides what is safe to take from
what it reads, so it raises Unreadable (exit 4) and the action is refused.
A read that decides nothing (a model name, a hostname) says `optional=True`
and gets the default instead.
"""

from __future__ import annotations

import errno
import os
import stat

from vstor.errors import Unavailable

_GONE = (errno.ENOENT, errno.ENODEV, errno.ENXIO, errno.ENOTDIR)
_REFUSED_OPTIONAL = (errno.EACCES, errno.EPERM, errno.EIO, errno.EINVAL)


class Unreadable(Unavailable):
    """The host refused a read vstor needs: never taken as "nothing there"."""


def _refused(host_path: str, e: OSError) -> Unreadable:
    hint = ("run vstor as root" if e.errno in (errno.EACCES, errno.EPERM)
            else "check the device and the kernel log (dmesg)")
    return Unreadable(f"cannot read {host_path}: {e.strerror}", hint=hint)


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

    def read(self, host_path: str, default: str | None = None, optional: bool = False) -> str | None:
        self._touch(host_path)
        try:
            with open(self.path(host_path), "rb") as f:
                return f.read().decode("utf-8", "replace").strip()
        except OSError as e:
            if e.errno in _GONE or isinstance(e, IsADirectoryError):
                return default
            if optional and e.errno in _REFUSED_OPTIONAL:
                return default
            raise _refused(host_path, e) from None

    def read_int(self, host_path: str, default: int | None = None, base: int = 10,
                 optional: bool = False) -> int | None:
        text = self.read(host_path, optional=optional)
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
            raise _refused(host_path, e) from None

    def _stat(self, host_path: str, follow: bool):
        self._touch(host_path)
        try:
            return os.stat(self.path(host_path), follow_symlinks=follow)
        except OSError as e:
            if e.errno in _GONE or e.errno == errno.ELOOP:
                return None
            raise _refused(host_path, e) from None

    def exists(self, host_path: str) -> bool:
        return self._stat(host_path, follow=False) is not None

    def is_dir(self, host_path: str) -> bool:
        st = self._stat(host_path, follow=True)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def link_name(self, host_path: str) -> str | None:
        """The last component of a symlink's target ('driver' -> 'nvme')."""
        self._touch(host_path)
        try:
            return os.path.basename(os.readlink(self.path(host_path)))
        except OSError as e:
            if e.errno in _GONE or e.errno == errno.EINVAL:     # EINVAL: not a link
                return None
            raise _refused(host_path, e) from None

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
