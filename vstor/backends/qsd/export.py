"""What one qemu-storage-daemon is: its source, sockets, files and command line.

A QsdExport names everything about one daemon: the file or block device it
serves, the vhost-user socket QEMU connects to, and its files in the run
directory (`<name>.pid`, `<name>.qmp`).  The record (`to_record`/`from_record`)
is all vstor's state directory needs to find the daemon again after vstor
itself has exited.

Pure: nothing here reads or changes the host; `vstor.backends.qsd.daemon`
does that.
"""

from __future__ import annotations

import os.path
import shlex
import sys

from vstor import records
from vstor.errors import ActionFailed, BadInput
from vstor.records import record

RECORD_VERSION = 1
EXPORT_ID = "exp0"
JAIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail.py")
SOCKET_MAX = 107            # sizeof(sun_path) - 1
NAME_MAX = 96
# '+' is allowed because vstor's disk names are "<domain safe name>-<target>"
# and domain safe names may hold it (vstor.domain); none of these characters
# is special in a path or in a QEMU option string.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")


@record
class QsdExport:
    run_dir: str
    name: str
    source: str
    kind: str                       # file | block
    socket_path: str
    readonly: bool = False
    queues: int = 1
    qemu_user: str = "libvirt-qemu"
    qemu_group: str = "kvm"
    binary: str = "/usr/bin/qemu-storage-daemon"
    # O_DIRECT for the source; None = decide at start (block devices: yes;
    # files: only where the filesystem accepts O_DIRECT, see vstor.host.sources.Source.direct_works).
    direct: bool | None = None
    # The CPUs the daemon's threads run on: the VM's emulator (housekeeping)
    # cores, never a dedicated vCPU core or a reactor; () = not pinned
    # (the platform places the VM, as Nova does).
    cpus: tuple[int, ...] = ()
    # Confined (vstor.backends.qsd.jail): the range of uids one of which the
    # daemon runs as, leased by name (vstor.backends.qsd.grant); None: it
    # runs as root, as records of a vstor before confinement say.
    users: tuple[int, int] | None = None

    def __post_init__(self):
        _validate(self)

    @property
    def pidfile(self) -> str:
        return os.path.join(self.run_dir, self.name + ".pid")

    @property
    def qmp_path(self) -> str:
        return os.path.join(self.run_dir, self.name + ".qmp")

    # -- the command line ----------------------------------------------------------------

    def argv(self, source_fd: int | str, socket_fd: int | str, qmp_fd: int | str,
             native_aio: bool = True) -> list[str]:
        """The daemon's command line.  It names no path of the source and
        none of the sockets: vstor opened the source and made the listening
        sockets (the vhost-user one and the monitor's), and the daemon
        inherits the descriptors under these numbers (`/proc/self/fd/N`
        reopens that very inode; addr.type=fd and the chardev's fd= listen
        on the socket as it is).  `native_aio=False`: the thread
        pool even with O_DIRECT (the host's AIO events are used up)."""
        direct = self.kind == "block" or bool(self.direct)
        # aio=native needs O_DIRECT (QEMU refuses it otherwise); without it the
        # thread pool is the only mode that works on every kernel and filesystem.
        node = [f"driver={'host_device' if self.kind == 'block' else 'file'}", "node-name=file0",
                f"filename=/proc/self/fd/{source_fd}", f"cache.direct={_on(direct)}",
                f"aio={'native' if direct and native_aio else 'threads'}"]
        fmt = ["driver=raw", "node-name=disk0", "file=file0"]
        # read-only nodes open the source O_RDONLY and take only a shared lock,
        # so two readonly disks may share one source; writers pass guest TRIM on.
        extra = ["read-only=on"] if self.readonly else ["discard=unmap"]
        export = [f"type=vhost-user-blk,id={EXPORT_ID},node-name=disk0", "addr.type=fd",
                  f"addr.str={socket_fd}", f"writable={_on(not self.readonly)}",
                  f"num-queues={self.queues}"]
        return [self.binary,
                "--blockdev", ",".join(node + extra),
                "--blockdev", ",".join(fmt + extra),
                "--export", ",".join(export),
                "--chardev", f"socket,id=qmp0,fd={qmp_fd},server=on,wait=off",
                "--monitor", "chardev=qmp0",
                "--pidfile", self.pidfile,
                "--daemonize"]

    def jail(self, uid: int | str, hide=()) -> list[str]:
        """The confined daemon's command line comes after this: vstor's
        jail (vstor.backends.qsd.jail), which pins it to its CPUs, runs it
        as `uid` in a read-only view of the filesystem with `hide` (the
        image roots) covered, and drops everything else it could use."""
        cpus = ["--cpus", ",".join(map(str, self.cpus))] if self.cpus else []
        return [sys.executable or "/usr/bin/python3", "-I", "-S", JAIL, "--uid", str(uid), *cpus,
                "--pidfile", self.pidfile, *(x for root in hide for x in ("--hide", root)), "--"]

    def dry_run_lines(self, hide=()) -> list[str]:
        """What starting this export does, as shell-like lines; SRC_FD,
        SOCK_FD and QMP_FD stand for the descriptor numbers the daemon
        inherits, UID for the uid leased to it.  An unresolved `direct`
        shows as argv() renders it (off for files); daemon.dry_run probes
        the filesystem first."""
        g = self.qemu_group
        what = ("a regular file below an image root, no symlink followed out of it"
                if self.kind == "file" else "the kernel's block device, checked against sysfs")
        note = ([f"# at start: cache.direct=on,aio=native instead, if {self.source}'s filesystem "
                 "takes O_DIRECT"] if self.direct is None and self.kind == "file" else [])
        src = shlex.quote(self.source)
        if self.users is None:
            prefix = ["taskset", "--cpu-list", ",".join(map(str, self.cpus))] if self.cpus else []
            confine = []
        else:
            prefix = self.jail("UID", hide)
            confine = [f"# UID: the lowest uid of {self.users[0]}-{self.users[1]} no other daemon "
                       f"holds, leased in {os.path.join(self.run_dir, 'users')}",
                       f"# vstor gives UID the ACL entry user:UID:{'r' if self.readonly else 'rw'} "
                       f"on {src}, and creates {self.pidfile} owned by UID",
                       "# the jail hides every image root ([paths] images) with --hide ROOT"]
        return [f"install -d -o root -g {g} -m 0750 {shlex.quote(self.run_dir)}",
                f"# vstor opens source={src} itself as SRC_FD ({what})",
                f"# vstor binds {shlex.quote(self.socket_path)} itself, root:{g} 0660, and passes "
                "it listening as SOCK_FD",
                f"# vstor binds {shlex.quote(self.qmp_path)} itself, root 0600, as QMP_FD",
                *confine,
                shlex.join(prefix + self.argv("SRC_FD", "SOCK_FD", "QMP_FD")), *note]

    # -- the record ----------------------------------------------------------------------

    def to_record(self) -> dict:
        return {"version": RECORD_VERSION, **records.asdict(self)}

    @classmethod
    def from_record(cls, rec: dict) -> "QsdExport":
        if not isinstance(rec, dict):
            raise BadInput("qemu-storage-daemon record is not a JSON object")
        if rec.get("version", RECORD_VERSION) != RECORD_VERSION:
            raise ActionFailed(f"qemu-storage-daemon record version {rec.get('version')!r} "
                               "is not one this vstor reads", hint="use the vstor that wrote it")
        missing = sorted(_REQUIRED - rec.keys())
        if missing:
            raise BadInput(f"qemu-storage-daemon record lacks {', '.join(missing)}")
        fields = {k: v for k, v in rec.items() if k in _FIELDS}
        for name in ("cpus", "users"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        return cls(**fields)


_FIELDS = frozenset(f.name for f in records.fields(QsdExport))
_REQUIRED = frozenset(f.name for f in records.fields(QsdExport) if f.default is records.MISSING)


def _validate(e: QsdExport) -> None:
    def bad(what: str, hint: str | None = None):
        raise BadInput(f"qemu-storage-daemon export: {what}", hint=hint)

    for field in ("run_dir", "name", "source", "kind", "socket_path", "qemu_user",
                  "qemu_group", "binary"):
        value = getattr(e, field)
        if not isinstance(value, str) or not value or "\0" in value:
            bad(f"{field} must be a non-empty string")
    if not (set(e.name) <= _NAME_CHARS) or ".." in e.name or e.name.startswith(".") \
            or len(e.name) > NAME_MAX:
        bad(f"name {e.name!r} is not safe in a file name",
            hint=f"use up to {NAME_MAX} of A-Z a-z 0-9 _ . + - (no leading '.', no '..')")
    for field in ("run_dir", "source", "socket_path", "binary"):
        path = getattr(e, field)
        if not os.path.isabs(path) or os.path.normpath(path) != path:
            bad(f"{field} {path!r} is not a clean absolute path")
    for path in (e.socket_path, e.qmp_path):
        if len(path.encode()) > SOCKET_MAX:
            bad(f"socket path {path} is longer than a Unix socket allows ({SOCKET_MAX} bytes)",
                hint="shorten the name or the directory")
    if e.kind not in ("file", "block"):
        bad(f"kind {e.kind!r} is neither 'file' nor 'block'")
    if not isinstance(e.queues, int) or isinstance(e.queues, bool) or not 1 <= e.queues <= 1024:
        bad(f"queues {e.queues!r} must be an integer from 1 to 1024")
    if not isinstance(e.readonly, bool) or e.direct not in (None, True, False):
        bad("readonly and direct must be true or false")
    if not isinstance(e.cpus, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 65536 for c in e.cpus):
        bad(f"cpus {e.cpus!r} must be a list of CPU numbers")
    if e.users is not None and not (
            isinstance(e.users, tuple) and len(e.users) == 2
            and all(isinstance(u, int) and not isinstance(u, bool) for u in e.users)
            and 1000 <= e.users[0] <= e.users[1] < 2**31 - 1):
        bad(f"users {e.users!r} must be a range of unprivileged uids")
    if e.socket_path in (e.pidfile, e.qmp_path):
        bad(f"socket path {e.socket_path} collides with the daemon's own files")


# -- QEMU option strings ---------------------------------------------------------------------

def _on(flag: bool) -> str:
    return "on" if flag else "off"


def option_value(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg == option:
            return argv[i + 1]
    return None


def export_opts(argv: list[str]) -> dict[str, str]:
    """The options that say what a daemon serves (filename, addr.*,
    writable), from its command line."""
    blockdev, export = option_value(argv, "--blockdev") or "", option_value(argv, "--export") or ""
    keep = ("filename", "addr.type", "addr.path", "addr.str", "writable")
    opts = dict(o.split("=", 1) for o in _split(blockdev) + _split(export) if "=" in o)
    return {k: v for k, v in opts.items() if k in keep}


def _split(opts: str) -> list[str]:
    return [part.replace("\0", ",") for part in opts.replace(",,", "\0").split(",")]
