"""Is a file or block source the same storage on two hosts?  Each host
describes its own copy (opened safely: never a FIFO, a device that acts on
open, or a symlink swapped in; a file only inside the image roots; a block
device only one of the host model's, looked at before it is opened), and the
two descriptions are compared: same path, kind and size, and the same
filesystem (type and mount source, as /proc/self/mountinfo says), or both
under storage the operator declared shared on both hosts ([migrate] shared)."""

from __future__ import annotations

import os
import re
import stat

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host import sources
from vstor.host.blocks import stack_of
from vstor.host.model import is_listed, unservable
from vstor.host.sysfs import SysFS
from vstor.meta.names import inside

# Filesystems every host that mounts them sees the same.
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "ceph", "fuse.cephfs", "glusterfs",
                        "fuse.glusterfs", "gpfs", "ocfs2", "gfs2", "lustre", "beegfs",
                        "fuse.beegfs", "virtiofs"})
_ESCAPE = re.compile(rb"\\([0-7]{3})")
_KERNEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:!-]{0,63}")


def describe(cfg: Config, kind: str, path: str, sysfs: SysFS) -> dict:
    """This host's copy of a source: {path, kind, size, fstype, mount, shared_root}."""
    if kind == "file":
        # Walked component by component below an image root and never opened
        # for reading (vstor.host.sources): its size is the inode's.
        with sources.open_file(path, cfg.images) as src:
            real, size = src.resolved, src.st.st_size
    else:
        real, expect = path, _block_device(sysfs, path)     # looked at before it is opened
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise BadInput(f"{kind} source {path} does not exist") from None
        except OSError as e:
            raise BadInput(f"cannot open {kind} source {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not (stat.S_ISBLK(st.st_mode) and st.st_rdev == expect):
                raise BadInput(f"{path} changed while it was opened", hint="try again")
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    fstype, source = mount_of(real) if kind == "file" else ("block", real)
    roots = [r for r in (os.path.realpath(x) for x in cfg.migrate_shared) if real == r or inside(real, [r])]
    return {"path": path, "kind": kind, "size": size, "fstype": fstype or "", "mount": source or "",
            "shared_root": roots[0] if roots else ""}


def _block_device(sysfs: SysFS, path: str) -> int:
    """The device number of a block source, looked at before anything opens
    it: /dev/NAME for a disk or partition NAME of the host model, stacked on
    nothing the planner refuses (host.model.unservable), a block device node
    (never a link, a character device or a FIFO) of the number sysfs gives
    NAME."""
    name = path[len("/dev/"):] if path.startswith("/dev/") else ""
    known = _KERNEL_NAME.fullmatch(name) and is_listed(name)
    devnum = sysfs.read(f"/sys/class/block/{name}/dev") if known else None
    refused = unservable(path, stack_of(sysfs, name) if devnum is not None else ())
    if refused:
        raise BadInput(refused[0], hint=refused[1])
    if devnum is None:
        raise BadInput(f"{path} is not a disk or partition vstor can see on this host",
                       hint="name the kernel device, like /dev/sdb or /dev/nvme0n1p3")
    m = re.fullmatch(r"(\d+):(\d+)", devnum.strip())
    if m is None:
        raise BadInput(f"sysfs gives {name} no device number ('{devnum.strip()}')")
    expect = os.makedev(int(m.group(1)), int(m.group(2)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadInput(f"block source {path} does not exist") from None
    except OSError as e:
        raise BadInput(f"cannot look at block source {path}: {e.strerror}") from None
    if not stat.S_ISBLK(st.st_mode):
        raise BadInput(f"{path} is not a block device")
    if st.st_rdev != expect:
        raise BadInput(f"{path} is not the device the kernel calls {name} ({os.major(st.st_rdev)}:"
                       f"{os.minor(st.st_rdev)}, not {devnum.strip()})")
    return expect


def shared(mine: dict) -> tuple[bool, str]:
    """(can another host see this source at the same path, in words)."""
    if mine["shared_root"]:
        return True, f"under the shared storage {mine['shared_root']} ([migrate] shared)"
    if mine["fstype"] in NETWORK_FS:
        return True, f"on a {mine['fstype']} filesystem ({mine['mount']})"
    what = "block device" if mine["kind"] == "block" else f"{mine['fstype'] or 'unknown'} filesystem"
    return False, f"on a local {what}"


def differs(theirs: dict, mine: dict) -> str | None:
    """None when `mine` (this host's) is the storage `theirs` describes; else why not."""
    if mine["size"] != theirs.get("size"):
        return f"has it with another size ({mine['size']} bytes, not {theirs.get('size')})"
    if mine["shared_root"] and theirs.get("shared_root"):
        return None         # both operators say so
    if mine["fstype"] in NETWORK_FS and (mine["fstype"], mine["mount"]) == (theirs.get("fstype"), theirs.get("mount")):
        return None
    if theirs.get("shared_root"):
        # The source's operator declared it shared; this host's did not (the
        # same local names on both, /dev/vda say, prove nothing).
        return (f"has {theirs['shared_root']} on {_where(mine)}, not in its [migrate] shared "
                f"(add {theirs['shared_root']} to [migrate] shared in its vstor.conf, if it is the same "
                "storage there)")
    if (mine["fstype"], mine["mount"]) == (theirs.get("fstype"), theirs.get("mount")):
        local = "block device" if mine.get("kind") == "block" else "filesystem"
        return (f"has its own {_where(mine)} at that path (a local {local} is another disk on each host: "
                "put it on storage both hosts see, listed in [migrate] shared on both)")
    return f"has it on {_where(mine)}, not on {_where(theirs)}"


def _where(d: dict) -> str:
    return f"{d.get('fstype') or 'unknown'} {d.get('mount') or ''}".strip()


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str | None, str | None]:
    """(filesystem type, mount source) of the mount that holds `path`: the
    longest mount point above it (the last one mounted there, if several)."""
    best, found = b"", (None, None)
    target = os.fsencode(path)
    with open(mountinfo, "rb") as f:
        for line in f:
            fields = line.split()
            sep = fields.index(b"-")
            point = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
            if (target == point or target.startswith(point.rstrip(b"/") + b"/")) and len(point) >= len(best):
                best = point
                found = (os.fsdecode(fields[sep + 1]), os.fsdecode(fields[sep + 2]))
    return found
