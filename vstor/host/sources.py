"""Opening a disk source once, safely: the file or block device vstor checks
is the very one qemu-storage-daemon serves.

Whoever may place images in an image root may also rename, replace and
symlink there at any moment (the threat model), so a name checked now can
mean another file a moment later.  Here a source is walked from `/` one
component at a time, each opened with O_PATH|O_NOFOLLOW relative to the
directory before it; a symlink is read and its target walked the same way
(like the kernel, at most 40 of them); `..` goes back along the directories
already held, never through the kernel's own `..`.  Nothing is ever opened
for reading here, so a FIFO, a socket or a device that acts on open is
never opened at all: the last component stays an O_PATH descriptor, and
fstat on it decides.  The daemon inherits that descriptor and opens
`/proc/self/fd/N`, which the kernel resolves to the same inode, never to a
name (vstor.backends.qsd.daemon).

No dependency on os.path.realpath: it resolves by name, and every name it
resolves may have changed by the time it returns.
"""

from __future__ import annotations

import errno
import os
import stat

from vstor.errors import BadInput, Unavailable

MAX_LINKS = 40          # the kernel's own limit (MAXSYMLINKS)
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class Source:
    """A source held open as an O_PATH descriptor, with what was checked."""

    def __init__(self, fd: int, path: str, resolved: str, kind: str, st: os.stat_result):
        self.fd, self.path, self.resolved, self.kind, self.st = fd, path, resolved, kind, st

    @property
    def proc_path(self) -> str:
        """The name this process (and a child that inherits the descriptor
        under the same number) opens to reach exactly this inode."""
        return f"/proc/self/fd/{self.fd}"

    def direct_works(self) -> bool:
        """Does the filesystem take O_DIRECT?  tmpfs before Linux 6.6 and some
        FUSE filesystems refuse it with EINVAL, and qsd with cache.direct=on
        would then fail to open the file at all.  Asked of the inode itself
        (a regular file: opening it has no side effect and never blocks)."""
        if not stat.S_ISREG(self.st.st_mode):
            return True
        try:
            fd = os.open(self.proc_path, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        os.close(fd)
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_file(path: str, roots) -> Source:
    """A file source: a regular file whose every directory, symlinks
    followed component by component, lies inside one of the image roots
    (`[paths] images`, root's config: the roots themselves are trusted)."""
    fd, resolved, chain = _walk(path)
    try:
        st = _fstat(fd, resolved, path)
        if not _inside_a_root(resolved, chain, roots, path):
            raise BadInput(f"file source {path} resolves to {resolved}, outside the image roots "
                           f"({', '.join(roots) or 'none'})",
                           hint="move it under one of them, or add its directory to [paths] images")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"disk source {path} is {_what(st.st_mode)}, not a regular file",
                           hint="an image must be a regular file (qemu-img create -f raw PATH "
                                "SIZE); use <vstor:block> for block devices")
    except BaseException:
        os.close(fd)
        for _name, d in chain:
            os.close(d)
        raise
    for _name, d in chain:
        os.close(d)
    return Source(fd, path, resolved, "file", st)


def foresee(plan, roots) -> None:
    """Refuse at plan time, as its start would, a plan's file source whose
    symlinks lead outside the image roots, or that is not a regular file.
    Walked as a start walks it and opened for nothing.  A file that is not
    there yet is the start's to refuse: an image may be made after the
    domain is defined."""
    for disk in plan.disks:
        if disk.source.kind == "file":
            try:
                open_file(disk.source.path, roots).close()
            except _Missing:
                pass


def open_block(path: str, kernel_name) -> Source:
    """A block source: `/dev/<kernel name>` itself (never a link), a block
    device whose device number the host's sysfs names with that same kernel
    name (`kernel_name(st_rdev)`), so the device the planner judged unused
    is the one opened."""
    name = path[len("/dev/"):] if path.startswith("/dev/") else ""
    if not name or "/" in name:
        raise BadInput(f"block source {path} is not /dev/<kernel name>",
                       hint="name the kernel device, like /dev/sdb or /dev/nvme0n1p3")
    try:
        fd = os.open(path, _PATH)
    except OSError as e:
        raise BadInput(f"disk source {path}: {e.strerror}", hint=f"fix <vstor:block path='{path}'>") \
            from None
    try:
        st = _fstat(fd, path, path)
        if not stat.S_ISBLK(st.st_mode):
            raise BadInput(f"disk source {path} is {_what(st.st_mode)}, not a block device",
                           hint="use <vstor:file> for image files")
        found = kernel_name(st.st_rdev)
        if found != name:
            raise BadInput(f"disk source {path} is device {os.major(st.st_rdev)}:"
                           f"{os.minor(st.st_rdev)}, which this host's sysfs names "
                           f"{found or 'nothing'}, not {name}",
                           hint="a node under /dev that is not the kernel's own is refused; "
                                "name the kernel device")
    except BaseException:
        os.close(fd)
        raise
    return Source(fd, path, path, "block", st)


def open_source(kind: str, path: str, roots, kernel_name) -> Source:
    return open_file(path, roots) if kind == "file" else open_block(path, kernel_name)


def sysfs_kernel_name(sysfs):
    """st_rdev -> the kernel name sysfs gives that block device, or None."""
    def name(rdev: int) -> str | None:
        real = sysfs.resolve(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
        return os.path.basename(real) if real else None
    return name


# -- the walk ------------------------------------------------------------------------------

def _walk(path: str) -> tuple[int, str, list[tuple[str, int]]]:
    """(O_PATH fd of what `path` names, the path it resolved to, the held
    directories from `/` down to its parent as (name, fd))."""
    if not path.startswith("/") or "\0" in path:
        raise BadInput(f"file source {path!r} is not an absolute path")
    chain: list[tuple[str, int]] = []
    try:
        chain.append(("", _open_at(None, "/", path)))
        todo = path.split("/")[::-1]
        links = 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if len(chain) > 1:
                    os.close(chain.pop()[1])
                continue
            fd = _open_at(chain[-1][1], part, path)
            try:
                target = _link_target(fd, part, path)
            except BaseException:
                os.close(fd)
                raise
            if target is None:
                chain.append((part, fd))
                continue
            os.close(fd)
            links += 1
            if links > MAX_LINKS:
                raise BadInput(f"file source {path}: too many levels of symbolic links")
            if target.startswith("/"):
                while len(chain) > 1:
                    os.close(chain.pop()[1])
            todo.extend(target.split("/")[::-1])
        if len(chain) < 2:
            raise BadInput(f"file source {path} names a directory, not a file")
        last_name, last = chain.pop()
        resolved = "/" + "/".join(name for name, _ in chain[1:] + [(last_name, last)])
        return last, resolved, chain
    except BaseException:
        for _name, d in chain:
            os.close(d)
        raise


def _open_at(dir_fd: int | None, name: str, path: str) -> int:
    try:
        return os.open(name, _PATH | (os.O_DIRECTORY if dir_fd is None else 0), dir_fd=dir_fd)
    except OSError as e:
        raise _refusal(e, name, path) from None


def _link_target(fd: int, name: str, path: str) -> str | None:
    """What the link held open says (not what its name says now); None
    when it is not a link."""
    try:
        if not stat.S_ISLNK(os.fstat(fd).st_mode):
            return None
        return os.readlink("", dir_fd=fd)
    except OSError as e:
        raise _refusal(e, name, path) from None


def _fstat(fd: int, name: str, path: str) -> os.stat_result:
    try:
        return os.fstat(fd)
    except OSError as e:
        raise _refusal(e, name, path) from None


def _refusal(e: OSError, name: str, path: str) -> BadInput | Unavailable:
    """An OS error on the way to `path` (at `name`), as what it says of the
    source.  Any of them may come from a name that changed under the walk:
    an entry of /proc whose process ended answers ENOENT or ESRCH."""
    if e.errno == errno.ENOENT:
        return _Missing(f"disk source {path}: No such file or directory",
                        hint=f"create it (qemu-img create -f raw {path} SIZE) or fix "
                             f"<vstor:file path='{path}'>")
    if e.errno in (errno.EACCES, errno.EPERM):
        return Unavailable(f"cannot look at {name} on the way to {path}: {e.strerror}",
                           hint="run vstor as root")
    return BadInput(f"disk source {path}: {e.strerror or e}")


class _Missing(BadInput):
    """A name on the way to a source, or the source, is not there."""


def _inside_a_root(resolved: str, chain: list[tuple[str, int]], roots, path: str) -> bool:
    """Is `resolved` strictly below a root, and is the directory held at
    that root's depth the root itself (same device and inode)?  The held
    chain, not the name, is what was walked."""
    for root in roots:
        real = os.path.realpath(root)       # root's own config: trusted to name it
        parts = [p for p in real.split("/") if p]
        names = [n for n, _ in chain[1:]]
        if names[:len(parts)] != parts:
            continue
        try:
            want = os.stat(real)
        except OSError:
            continue
        held = _fstat(chain[len(parts)][1], real, path)
        if (held.st_dev, held.st_ino) == (want.st_dev, want.st_ino) and stat.S_ISDIR(held.st_mode):
            return True
    return False


def _what(mode: int) -> str:
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file"),
                        (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a file"
