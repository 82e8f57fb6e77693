"""Block devices and what the host uses them for: mounts, swaps and dm/md
holders, followed up the stack; and what each stacks on, followed down it.
Every read a "not in use" or "stacks on nothing" answer rests on must
succeed: unreadable is a refusal."""

from __future__ import annotations

import posixpath
import re

from vstor.errors import Unavailable
from vstor.host.model import BlockDevice, is_listed, unvouched
from vstor.host.sysfs import SysFS, Unreadable

MAX_STACK = 16      # devices below one another; the kernel's own stacks are far shallower


class BlockUsage:
    """Mounts, swaps and holders (dm, md), followed up the stack, so that a
    partition under an LVM volume mounted at / reads as in use by the root."""

    def __init__(self, sysfs: SysFS):
        self.sysfs = sysfs
        self._dm_devices: dict[str, str] | None = None
        self.mounts = self._read_mounts()
        self.swaps = self._read_swaps()

    def _read_mounts(self) -> dict[str, list[str]]:
        mounts: dict[str, list[str]] = {}
        for line in _safety_read(self.sysfs, "/proc/self/mountinfo").splitlines():
            fields = line.split()
            # Optional fields end at a lone '-' (after the 6 fixed ones); fstype and source follow.
            if "-" not in fields[6:]:
                continue
            after = fields[fields.index("-", 6) + 1:]
            source = after[1] if len(after) > 1 else ""
            # MAJ:MIN names the device even when the source says '/dev/root'; btrfs
            # shows an anonymous 0:N there, so the source is the fallback.
            name = self._name_of_devnum(fields[2]) or self._name_of_path(unescape(source))
            if name:
                mounts.setdefault(name, [])
                mountpoint = unescape(fields[4])
                if mountpoint not in mounts[name]:
                    mounts[name].append(mountpoint)
        return mounts

    def _read_swaps(self) -> set[str]:
        swaps = set()
        for line in _safety_read(self.sysfs, "/proc/swaps").splitlines()[1:]:
            fields = line.split()
            name = self._name_of_path(unescape(fields[0])) if fields else None
            if name:
                swaps.add(name)
        return swaps

    def _name_of_devnum(self, devnum: str) -> str | None:
        if not re.fullmatch(r"\d+:\d+", devnum) or devnum.startswith("0:"):
            return None
        real = self.sysfs.resolve(f"/sys/dev/block/{devnum}")
        return posixpath.basename(real) if real else None

    def _name_of_path(self, path: str) -> str | None:
        """'/dev/nvme0n1p2' -> 'nvme0n1p2', '/dev/mapper/vg-root' -> 'dm-0'; files -> None."""
        if path.startswith("/dev/mapper/"):
            return self.dm_devices().get(path[len("/dev/mapper/"):])
        if not path.startswith("/dev/"):
            return None
        name = posixpath.basename(path)
        return name if self.sysfs.exists(f"/sys/class/block/{name}") else None

    def dm_devices(self) -> dict[str, str]:
        """dm name -> kernel name ('vg-root' -> 'dm-0')."""
        if self._dm_devices is None:
            self._dm_devices = {}
            for disk in self.sysfs.listdir("/sys/block"):
                if disk.startswith("dm-"):
                    self._dm_devices[self.sysfs.read(f"/sys/block/{disk}/dm/name", disk)] = disk
        return self._dm_devices

    def partitions(self, disk: str) -> tuple[str, ...]:
        base = f"/sys/block/{disk}"
        return tuple(e for e in self.sysfs.listdir(base)
                     if e.startswith(disk) and self.sysfs.exists(f"{base}/{e}/partition"))

    def disk_uses(self, disk: str, depth: int = 0) -> list[tuple[str, bool]]:
        """(reason, backs_root) for each way the host uses DISK or its partitions."""
        base = f"/sys/block/{disk}"
        uses = self._uses(disk, base, "", depth)
        for part in self.partitions(disk):
            uses += self._uses(part, f"{base}/{part}", f" ({part})", depth)
        return uses

    def _uses(self, name: str, path: str, label: str, depth: int) -> list[tuple[str, bool]]:
        uses = []
        if name in self.mounts:
            points = self.mounts[name]
            uses.append((f"mounted at {', '.join(points)}{label}", "/" in points))
        if name in self.swaps:
            uses.append((f"swap{label}", False))
        for holder in self.sysfs.listdir(f"{path}/holders"):
            held = f"held by {holder}{self._dm_label(holder)}"
            # Holders cannot form a cycle in the kernel; the depth bound guards odd trees.
            above = self.disk_uses(holder, depth + 1) if depth < 8 else []
            uses += [(f"{held}, {why}{label}", root) for why, root in above] or [(f"{held}{label}", False)]
        return uses

    def _dm_label(self, holder: str) -> str:
        if not holder.startswith("dm-"):
            return ""
        name = self.sysfs.read(f"/sys/block/{holder}/dm/name")
        return f" ({name})" if name else ""


def _safety_read(sysfs: SysFS, path: str) -> str:
    """A file vstor's "is this disk in use?" answers rest on: unreadable is a
    refusal, never "nothing mounted"."""
    text = sysfs.read(path)
    if text is None:
        raise Unavailable(f"cannot read {sysfs.path(path)}: vstor cannot tell which disks the "
                          "host uses", hint="run as root on the host, or capture it with "
                                            "vstor host capture")
    return text


def unescape(field: str) -> str:
    """mountinfo and /proc/swaps write space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def stack_of(sysfs: SysFS, name: str, depth: int = 0) -> tuple[str, ...]:
    """NAME and the devices below it, down to the first one vstor cannot
    vouch for (a loop, nbd, ublk or RAM device: host.model.unvouched):
    ('dm-1', 'md5', 'loop1'); () when there is none.
    Below a dm, md or bcache device are its slaves/; below a partition, its
    disk.  A listing the kernel refuses raises (Unreadable): never "nothing
    below"."""
    if unvouched(name):
        return (name,)
    if depth == MAX_STACK:
        raise Unreadable(f"/dev/{name} stacks more than {MAX_STACK} devices deep in "
                         f"{sysfs.path('/sys/class/block')}: vstor cannot tell what it stacks on",
                         hint="check the host's device stack (lsblk --inverse)")
    base = f"/sys/class/block/{name}"
    if sysfs.exists(f"{base}/partition"):
        real = sysfs.resolve(base)
        below = [posixpath.basename(posixpath.dirname(real))] if real else []
    else:
        below = sysfs.listdir(f"{base}/slaves")
    for lower in below:
        found = stack_of(sysfs, lower, depth + 1)
        if found:
            return (name, *found)
    return ()


def read_block_devices(sysfs: SysFS, usage: BlockUsage) -> tuple[BlockDevice, ...]:
    devices = []
    for disk in sysfs.listdir("/sys/block"):
        if not is_listed(disk):
            continue
        devices.append(BlockDevice(disk, sysfs.read_int(f"/sys/block/{disk}/size", 0) * 512,
                                   tuple(why for why, _ in usage.disk_uses(disk)),
                                   stack_of(sysfs, disk)))
        # A partition is in use when it is, or when its whole disk itself is
        # (an LVM PV or md member on the whole disk, say).
        whole = tuple(why for why, _ in usage._uses(disk, f"/sys/block/{disk}", "", 0))
        for part in usage.partitions(disk):
            base = f"/sys/block/{disk}/{part}"
            own = tuple(why for why, _ in usage._uses(part, base, "", 0))
            devices.append(BlockDevice(part, sysfs.read_int(f"{base}/size", 0) * 512,
                                       own + tuple(f"{why} (whole disk {disk})" for why in whole),
                                       stack_of(sysfs, part)))
    return tuple(devices)


