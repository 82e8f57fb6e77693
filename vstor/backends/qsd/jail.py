"""The confinement a qemu-storage-daemon starts in: run by vstor (as root)
as `python3 -I -S jail.py OPTIONS -- DAEMON ARGV`, it confines itself and
then executes the daemon, which keeps all of it.

The daemon parses guest virtqueues: a guest that takes it over must gain
nothing a guest's QEMU would not have.  So, in this order:
- pinned to the daemon's CPUs (--cpus), as taskset would;
- new mount, network, IPC and UTS namespaces: no network at all (a fresh
  network namespace has only a loopback that is down), and a view of the
  filesystem that is read-only everywhere, with the image roots (--hide)
  covered by empty directories, so that no other domain's image can even
  be named;
- its pidfile (--pidfile): the one file it writes, vstor's file bound
  writable where the daemon names it (in this view its directory holds the
  pidfile alone, and every directory above it may be searched);
- the uid and gid of its own (--uid), no supplementary groups, every
  capability dropped from the bounding set (and so none effective, none
  permitted), no_new_privs;
- a seccomp filter (libseccomp, SCMP_ACT_ALLOW by default) that refuses
  every new socket and every new namespace, and the calls no storage
  daemon makes and
  every escape needs: ptrace and other processes' memory, mounts and
  namespaces, modules, kexec, BPF, perf, keyrings, file handles.

What the daemon serves it does not open by name: vstor opened the source
and bound the sockets, and hands them over as descriptors; the source is
reopened through /proc/self/fd/N, which the kernel checks against the
source's owner and ACL (vstor.backends.qsd.grant gives this uid its entry).
The descriptors were opened outside this view, on mounts that stay
writable, so the daemon can write its disk and nothing else.

Standard library only, run with -I -S: nothing of vstor's or the site's is
imported, and the daemon's start costs one small interpreter.  Every
failure is one line on stderr and exit status 125 (vstor reports it).
"""

import ctypes
import os
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_MOUNT_SETATTR = 442          # the same number on every architecture (since Linux 5.12)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
CLONE_NEW = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
FAILED = 125

# Refused with EPERM: what a compromised daemon would need to reach past
# its own disk, and what qemu-storage-daemon never calls.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "mount_setattr",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "name_to_handle_at", "open_by_handle_at",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "iopl", "ioperm", "uselib", "lookup_dcookie",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
)


class Failed(Exception):
    pass


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _ArgCmp(ctypes.Structure):     # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _call(what: str, result: int) -> int:
    if result < 0:
        raise Failed(f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    _call(f"mount {target}", _libc.mount(
        source and source.encode(), target.encode(), fstype and fstype.encode(),
        ctypes.c_ulong(flags), data and data.encode()))


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    _call(f"mount_setattr {path}", _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
        ctypes.c_uint(flags), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))))


def view(hide: list[str], pidfile: str | None, binary: str = "/") -> None:
    """The namespaces and the read-only view of the filesystem."""
    for path in hide:
        if os.path.commonpath([path, binary]) == path:
            raise Failed(f"image root {path} holds {binary}, which cannot be hidden from the "
                         "daemon: narrow [paths] images")
    _call("unshare", _libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS))
    _mount(None, "/", None, MS_REC | MS_PRIVATE)       # nothing done here reaches the host
    real = os.open(pidfile, os.O_PATH | os.O_NOFOLLOW) if pidfile else -1
    for path in hide:
        if os.path.isdir(path):
            _mount("vstor-hidden", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "mode=0755,size=64k,nr_inodes=64")
    if pidfile:
        # Its directory as the daemon sees it: the pidfile alone, below the
        # first directory of the path it could not search (root's 0700, say)
        # or its own directory, replaced in its view.
        where = os.path.dirname(pidfile)
        os.makedirs(where, mode=0o755, exist_ok=True)   # in a hiding tmpfs, when a root holds it
        _mount("vstor-run", _cover(where), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "mode=0755,size=64k,nr_inodes=64")
        os.makedirs(where, mode=0o755, exist_ok=True)
        os.close(os.open(pidfile, os.O_CREAT | os.O_WRONLY, 0o600))
    _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    if pidfile:
        _mount(f"/proc/self/fd/{real}", pidfile, None, MS_BIND)
        _setattr(pidfile, 0, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY)
        os.close(real)


def _cover(where: str) -> str:
    """The directory to replace so that the daemon reaches `where`: the
    first one on its path that others may not search, else `where`."""
    path = "/"
    for part in where.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            return path
    return where


def identity(uid: int) -> None:
    """Its own uid and gid, no groups, no capabilities, no_new_privs."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _call(f"dropping capability {cap}", _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)     # leaves no capability effective or permitted
    _call("no_new_privs", _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def seccomp() -> None:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        raise Failed("libseccomp.so.2 is missing (apt install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise Failed("seccomp_init failed")

    def rule(name: str, errno: int, *cmps: _ArgCmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return          # not a call of this architecture
        arr = (_ArgCmp * max(len(cmps), 1))(*cmps)
        if lib.seccomp_rule_add_array(ctx, 0x00050000 | errno, nr, len(cmps), arr) < 0:
            raise Failed(f"seccomp rule for {name} refused")

    for name in DENIED:
        rule(name, EPERM)
    # qemu-storage-daemon makes no socket of its own (vstor hands it both):
    # none at all, so not even a Unix socket to a host service.
    for name in ("socket", "socketpair"):
        rule(name, EAFNOSUPPORT)
    # No new namespace through clone either (unshare is denied above);
    # clone3 hides its flags in memory, so it answers ENOSYS and glibc
    # falls back to clone, as container runtimes have it.
    for flag in CLONE_NEW:
        rule("clone", EPERM, _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    rule("clone3", ENOSYS)
    if lib.seccomp_load(ctx) < 0:
        raise Failed("seccomp_load failed")


def _parse(argv: list[str]) -> tuple[int, list[int], str | None, list[str], list[str]]:
    uid, cpus, pidfile, hide = None, [], None, []
    i = 0
    while i < len(argv) and argv[i] != "--":
        opt, value = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if opt == "--uid" and value.isdigit():
            uid = int(value)
        elif opt == "--cpus" and value:
            cpus = [int(c) for c in value.split(",")]
        elif opt == "--pidfile" and os.path.isabs(value):
            pidfile = value
        elif opt == "--hide" and os.path.isabs(value):
            hide.append(value)
        else:
            raise Failed(f"bad option {opt!r} {value!r}")
        i += 2
    command = argv[i + 1:]
    if uid is None or uid == 0 or not command:
        raise Failed("usage: jail.py --uid UID [--cpus LIST] [--pidfile FILE] [--hide DIR]... "
                     "-- COMMAND...")
    return uid, cpus, pidfile, hide, command


def main(argv: list[str]) -> int:
    try:
        uid, cpus, pidfile, hide, command = _parse(argv)
        if cpus:
            os.sched_setaffinity(0, cpus)
        view(hide, pidfile, command[0])
        identity(uid)
        seccomp()
        os.execv(command[0], command)
    except (Failed, OSError, ValueError) as e:
        print(f"vstor confinement: {e}", file=sys.stderr)
    return FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
