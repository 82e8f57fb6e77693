"""A snapshot of what vstor may touch on a host, to prove a refused request
changed nothing: directory trees (type, mode, owner, content hash, symlink
target), single paths a hostile input points at, the PCI part of a sysfs
tree (symlink targets and file contents), the qemu-storage-daemon
processes, and what an SPDK target double holds.

    before = take(...); run(); assert diff(before, take(...)) == []
"""

from __future__ import annotations

import hashlib
import os
import stat

_MAX_HASHED = 4 << 20        # bigger regular files are compared by size and mtime only


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "link"), (stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"),
                       (stat.S_ISSOCK, "sock"), (stat.S_ISFIFO, "fifo"), (stat.S_ISBLK, "blk"),
                       (stat.S_ISCHR, "chr")):
        if test(mode):
            return name
    return "other"


def _hash(path: str, size: int) -> str:
    if size > _MAX_HASHED:
        return f"(large, {size} bytes)"
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return f"(unreadable: {e.strerror})"


def path_state(path: str, content: bool = True):
    """One path, not followed: None when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return ("error", e.strerror)
    kind = _kind(st.st_mode)
    out = [kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_ino]
    if kind == "link":
        out.append(os.readlink(path))
    elif kind == "file":
        out += [st.st_size, st.st_mtime_ns]
        if content:
            out.append(_hash(path, st.st_size))
    elif kind in ("blk", "chr"):
        out.append(st.st_rdev)
    return tuple(out)


# A state directory's index (vstor.runtime.index) is derived from its
# records and rewritten whole: what it says counts, not which inode says it.
DERIVED = "index"
# What vstor counted for its metrics (vstor.counters): a refusal is counted
# there, as it is logged; a count is not a change to the host.
COUNTED = "metrics"


def _counts(path: str) -> bool:
    """A state directory's metrics/, holding only what vstor.counters and
    vstor.metrics.totals write there."""
    return os.path.basename(path) == COUNTED and set(os.listdir(path)) <= {
        "events", "events.old", "totals.json", "lock"}


def tree_state(root: str, content: bool = True) -> dict:
    """Every entry under root (root included), by path; symlinks not followed.
    Below root/index (DERIVED), a file by its content alone."""
    out = {root: path_state(root, content)}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _counts(os.path.join(dirpath, d))]
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            out[p] = path_state(p, content)
            rel = os.path.relpath(p, root)
            if (rel == DERIVED or rel.startswith(DERIVED + os.sep)) and out[p] and out[p][0] in ("file", "dir"):
                kind, mode, uid, gid = out[p][:4]
                out[p] = (kind, mode, uid, gid) + ((out[p][-1],) if kind == "file" and content else ())
    return out


CONTROL_FILES = {"driver_override", "bind", "unbind", "new_id", "remove_id", "drivers_probe",
                 "drivers_autoprobe", "remove", "rescan", "reset", "enable"}


def sysfs_state(host_root: str) -> dict:
    """The PCI part of a sysfs tree (sys/bus/pci and sys/devices/pci*): every
    symlink's target (driver, iommu_group, the drivers' device links), the
    content of every file vstor or the kernel's driver core could write
    (driver_override, bind, unbind, new_id, drivers_probe, ...), and the type,
    mode, size and mtime of every other entry."""
    out = {}
    sys_dir = os.path.join(host_root, "sys")
    bases = [os.path.join(sys_dir, "bus", "pci")]
    devices = os.path.join(sys_dir, "devices")
    if os.path.isdir(devices):
        bases += [os.path.join(devices, d) for d in sorted(os.listdir(devices)) if d.startswith("pci")]
    for base in bases:
        out[base] = path_state(base)
        for dirpath, dirs, files in os.walk(base):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                out[p] = path_state(p, content=name in CONTROL_FILES)
    return out


def qsd_processes(mentioning=()) -> dict[int, str]:
    """pid -> cmdline of every process whose cmdline names qemu-storage-daemon
    (and, when `mentioning` is given, one of those strings: other test runs on
    the same machine start their own daemons)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"qemu-storage-daemon" in cmd:
            text = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
            if not mentioning or any(m in text for m in mentioning):
                out[int(entry)] = text
    return out


def spdk_state(spdk) -> dict:
    """What an SPDK target double holds, and the changing RPCs it was sent."""
    if spdk is None:
        return {}
    with spdk._lock:
        changes = [r["method"] for r in spdk.requests
                   if not r["method"].endswith(("get_version", "_get_controllers", "get_bdevs",
                                                "get_reactors", "get_subsystems"))]
        return {"spdk:nvme": tuple(sorted(spdk.nvme)), "spdk:vhost": tuple(sorted(spdk.vhost)),
                "spdk:changing-rpcs": len(changes)}


def take(*, trees=(), paths=(), host_root=None, spdk=None, processes_mentioning=()) -> dict:
    snap = {}
    for t in trees:
        snap.update({f"tree:{k}": v for k, v in tree_state(t).items()})
    for p in paths:
        snap[f"path:{p}"] = path_state(p)
    if host_root:
        snap.update({f"sysfs:{k}": v for k, v in sysfs_state(host_root).items()})
    snap.update({f"qsd-pid:{pid}": cmd for pid, cmd in qsd_processes(processes_mentioning).items()})
    snap.update(spdk_state(spdk))
    return snap


def diff(before: dict, after: dict) -> list[str]:
    """One line per change: added, removed or changed entries."""
    out = []
    for k in sorted(set(before) | set(after)):
        a, b = before.get(k, "(absent)"), after.get(k, "(absent)")
        if k not in before:
            out.append(f"added   {k}: {b}")
        elif k not in after:
            out.append(f"removed {k}: {a}")
        elif a != b:
            out.append(f"changed {k}: {a} -> {b}")
    return out
