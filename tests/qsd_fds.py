"""Which qemu-storage-daemons hold a file or device open, read from their
/proc/PID/fd (vstor passes the source as a descriptor: the command line
names no path)."""

from __future__ import annotations

import os
import stat


def daemons() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().startswith("qemu-storage-d"):
                        out.append(int(entry))
            except OSError:
                pass
    return out


def held(pid: int, named_only: bool = False) -> list[os.stat_result]:
    """What `pid` holds open; `named_only`: only what has a name in a
    filesystem (not its own pipes, sockets and anonymous inodes)."""
    found = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for n in names:
        try:
            if named_only and not os.readlink(f"/proc/{pid}/fd/{n}").startswith("/"):
                continue
            found.append(os.stat(f"/proc/{pid}/fd/{n}"))
        except OSError:
            pass
    return found


def same(a: os.stat_result, b: os.stat_result) -> bool:
    if stat.S_ISBLK(a.st_mode) and stat.S_ISBLK(b.st_mode):
        return a.st_rdev == b.st_rdev
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def serving(path: str) -> list[int]:
    """The qemu-storage-daemons holding `path` (the inode it names now) open."""
    want = os.stat(path)
    return [p for p in daemons() if any(same(want, st) for st in held(p))]
