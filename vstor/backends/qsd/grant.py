"""A confined daemon's uid, and its way into its source.

Each confined qemu-storage-daemon runs as a uid of its own, from the range
`[vhost] daemon_users` names (vstor.backends.qsd.jail).  The uid is leased
to the daemon's name by a file `<qsd_dir>/users/<uid>` made with O_EXCL (so
two starts never share one), holding what the grant below touched; a
restart of the same daemon keeps it; `stop` gives it back.  A uid some
process runs as is never leased (another vstor's daemon, under another
qsd_dir, or anybody's): a stop kills every process of its daemon's uid.

The daemon reopens its source through /proc/self/fd/N (QEMU's file drivers
open by name), and the kernel checks that reopening against the source's
owner, mode and ACL.  So the uid is given one POSIX ACL entry on the
source, `user:UID:rw-` (`r--` for a read-only disk), as libvirt's DAC
driver gives QEMU's user the image, but without changing the owner: a
second holder (another domain's read-only disk on the same file, or the
destination of a live migration on shared storage) adds its own entry
beside it, and each takes back only its own.  The ACL's mask is widened to
let the entry in; vstor refuses a file whose mask limits what its other
entries already grant, since widening it would grant them more.
Taking the entry back leaves the effective access of everyone else as it
was: with no other named entry left, the ACL is the file's mode again.

Written as the kernel keeps it (the system.posix_acl_access attribute,
<linux/posix_acl_xattr.h>): a version word and sorted (tag, perm, id)
entries; a file without the attribute has the ACL its mode describes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct

from vstor.errors import ActionFailed

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF
R, W = 4, 2
_HEADER, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")


# -- the uid --------------------------------------------------------------------------------

def users_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "users")


def lease(run_dir: str, name: str, users: tuple[int, int]) -> int:
    """The uid leased to daemon `name`: the one it already holds, else the
    lowest free one of `users` (first, last)."""
    held = leased(run_dir, name)
    if held is not None:
        return held[0]
    where = users_dir(run_dir)
    running = uids_running(users)
    for _ in range(3):      # the directory goes with its last lease (revoke)
        os.makedirs(where, mode=0o700, exist_ok=True)
        taken = {int(f) for f in os.listdir(where) if f.isdigit()} | running
        for uid in range(users[0], users[1] + 1):
            if uid in taken:
                continue
            try:
                fd = os.open(os.path.join(where, str(uid)),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue        # taken by a start beside this one
            except FileNotFoundError:
                break           # its directory went meanwhile: made again
            with open(fd, "w") as f:
                json.dump({"name": name}, f)
            return uid
        else:
            break
    raise ActionFailed(f"no uid of [vhost] daemon_users {users[0]}-{users[1]} is free for "
                       f"qemu-storage-daemon {name}: every one is leased or runs a process",
                       hint="widen daemon_users in vstor.conf, or run vstor gc")


def uids_running(users: tuple[int, int]) -> set[int]:
    """The uids of `users` some process on the host runs as (real,
    effective, saved or filesystem): another vstor's daemons (another
    qsd_dir, its own leases), or anyone's.  A daemon never gets such a uid:
    its stop kills every process of its uid."""
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and line.split()[1:2] in ([b"Z"], [b"X"]):
                        break       # a zombie holds nothing and runs nothing
                    if line.startswith(b"Uid:"):
                        out.update(u for u in map(int, line.split()[1:5]) if users[0] <= u <= users[1])
                        break
        except (FileNotFoundError, ProcessLookupError):
            continue        # ended meanwhile
    return out


def leased(run_dir: str, name: str) -> tuple[int, dict] | None:
    """(uid, what its lease holds) of daemon `name`, if it holds one."""
    where = users_dir(run_dir)
    try:
        files = os.listdir(where)
    except FileNotFoundError:
        return None
    for f in files:
        if not f.isdigit():
            continue
        info = _read_lease(os.path.join(where, f))
        if info.get("name") == name:
            return int(f), info
    return None


def lease_name(run_dir: str, uid: str) -> str:
    """The daemon's name lease `uid` holds ("" if unreadable)."""
    name = _read_lease(os.path.join(users_dir(run_dir), uid)).get("name")
    return name if isinstance(name, str) else ""


def _read_lease(path: str) -> dict:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _write_lease(run_dir: str, uid: int, info: dict) -> None:
    path = os.path.join(users_dir(run_dir), str(uid))
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


# -- the source's ACL -----------------------------------------------------------------------

def grant(run_dir: str, uid: int, fd: int, writable: bool, shown: str) -> None:
    """Give `uid` its entry on the source open at `fd`; what it touched
    goes into the lease first, so an interrupted start is undone by the
    next stop."""
    st = os.fstat(fd)
    held = _read_lease(os.path.join(users_dir(run_dir), str(uid)))
    path = os.readlink(f"/proc/self/fd/{fd}")
    _write_lease(run_dir, uid, {**held, "path": path, "dev": st.st_dev, "ino": st.st_ino})
    entries = _acl(fd, st, shown)
    need = R | (W if writable else 0)
    others = [(t, p, i) for t, p, i in entries if (t, i) != (USER, uid)]
    mask = next((p for t, p, _ in entries if t == MASK), None)
    granted = _granted(others)
    if mask is not None and granted & ~mask:
        raise ActionFailed(f"{shown} has an ACL whose mask limits what its entries grant; "
                           "letting the confined daemon in would widen it for them",
                           hint=f"give the daemon's uid {uid} its entry yourself "
                                f"(setfacl -m u:{uid}:{'rw' if writable else 'r'} {shown}), "
                                "or set [vhost] confine = no")
    new_mask = (mask if mask is not None else granted) | need
    entries = [e for e in others if e[0] != MASK] + [(USER, need, uid), (MASK, new_mask, NO_ID)]
    _set(fd, entries, shown)


def revoke(run_dir: str, uid: int, held_at: str | None = None) -> None:
    """Take back `uid`'s entry from the source its lease names (only from
    that very file: its device and inode), then give the uid back.
    `held_at`: /proc/PID/fd/N of the daemon still holding it, which
    reaches the file even if it was renamed since."""
    lease_path = os.path.join(users_dir(run_dir), str(uid))
    info = _read_lease(lease_path)
    if isinstance(info.get("path"), str):
        with _reopened(info, held_at) as fd:
            if fd is not None:
                st = os.fstat(fd)
                entries = _acl(fd, st, info["path"])
                if any((t, i) == (USER, uid) for t, _, i in entries):
                    mask = next((p for t, p, _ in entries if t == MASK), 7)
                    rest = [e for e in entries if (e[0], e[2]) != (USER, uid) and e[0] != MASK]
                    if any(t in (USER, GROUP) for t, _, _ in rest):
                        # Never wider than it is now: the owner may have narrowed it since.
                        rest.append((MASK, mask & _granted(rest), NO_ID))
                    _set(fd, rest, info["path"])
            else:
                # That file is not where the lease says (renamed while its
                # daemon was dead, a descriptor the daemon swapped): its
                # entry may still be on it, so the uid stays leased, out of
                # reach of any other daemon, until a gc finds the file again.
                from vstor import log
                log.note(info.get("name", "?"), f"uid {uid} keeps its lease: its ACL entry "
                         f"could not be taken back from {info['path']} (not that file any more)",
                         log.WARNING)
                return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lease_path)
    with contextlib.suppress(OSError):
        os.rmdir(users_dir(run_dir))     # when it was the last


@contextlib.contextmanager
def _reopened(info: dict, held_at: str | None):
    """The file the lease names, if it is still that file (a regular file
    or a block device, of the recorded device and inode), held O_PATH: a
    name an image root's writer re-pointed is looked at, never opened (a
    tape or a terminal would notice an open)."""
    for path, flags in ((held_at, 0), (info["path"], os.O_NOFOLLOW)):
        if path is None:
            continue
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC | flags)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if ((stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode))
                    and (st.st_dev, st.st_ino) == (info.get("dev"), info.get("ino"))):
                yield fd
                return
        finally:
            os.close(fd)
    yield None


def _by_fd(fd: int) -> str:
    """The file open at `fd`, by a name that reaches it whatever its path
    does now: the source may be open O_PATH (vstor.host.sources), which
    f*xattr refuse."""
    return f"/proc/self/fd/{fd}"


def _granted(entries) -> int:
    """What the mask must let through: the owning group's and every named entry's."""
    out = 0
    for tag, perm, _ in entries:
        if tag in (GROUP_OBJ, USER, GROUP):
            out |= perm
    return out


def _acl(fd: int, st: os.stat_result, shown: str) -> list[tuple[int, int, int]]:
    try:
        raw = os.getxattr(_by_fd(fd), XATTR)
    except OSError as e:
        if e.errno == errno.ENODATA:
            mode = st.st_mode
            return [(USER_OBJ, mode >> 6 & 7, NO_ID), (GROUP_OBJ, mode >> 3 & 7, NO_ID),
                    (OTHER, mode & 7, NO_ID)]
        raise _no_acl(shown, e) from None
    if len(raw) < _HEADER.size or (len(raw) - _HEADER.size) % _ENTRY.size \
            or _HEADER.unpack_from(raw)[0] != VERSION:
        raise ActionFailed(f"{shown}: its ACL is not one vstor reads (version or size)")
    return [_ENTRY.unpack_from(raw, off) for off in range(_HEADER.size, len(raw), _ENTRY.size)]


def _set(fd: int, entries, shown: str) -> None:
    entries = sorted(entries, key=lambda e: (e[0], e[2]))      # the kernel's order
    raw = _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)
    try:
        os.setxattr(_by_fd(fd), XATTR, raw)
    except OSError as e:
        raise _no_acl(shown, e) from None


def _no_acl(shown: str, e: OSError) -> ActionFailed:
    if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
        return ActionFailed(f"{shown}'s filesystem keeps no POSIX ACL, so the confined "
                            "qemu-storage-daemon cannot be let in",
                            hint="put the image on a filesystem with ACLs (ext4, xfs, btrfs, "
                                 "tmpfs), or set [vhost] confine = no")
    return ActionFailed(f"cannot change {shown}'s ACL: {e.strerror}")
