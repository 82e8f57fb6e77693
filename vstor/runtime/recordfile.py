"""A state record's file: what is checked before vstor trusts it (the
directory it lies in, that it is a regular file, its format, its shape), the
refusal when it cannot be (DamagedRecord), and the one reader and writer of
vstor's own files in the state directory (records, the index, the plans
cache): never through a symbolic link, never blocking on a FIFO or a device.
vstor.runtime.state keeps the records."""

from __future__ import annotations

import errno
import json
import os
import re
import stat

from vstor.errors import Unavailable


class DamagedRecord(Unavailable):
    """A state record that cannot be read: what it holds is unknown, so its
    domain, and every decision that needs every record, is refused until an
    operator looks at it (docs/security.md)."""


FIX = "inspect it, undo by hand what it lists, then remove it"

# A record's status.  PREPARED: what the plan needs is made.
PREPARING, PREPARED, RELEASING = "preparing", "prepared", "releasing"
# Backends made ahead of an incoming live migration (vstor migrate prepare):
# held for the domain until it arrives (then prepared) or the migration is
# aborted or fails (then released).
INCOMING = "incoming"
# The domain left by live migration and reads its disk through this host's
# NVMe-oF export: the export and what it stands on stay until it is gone.
EXPORTING = "exporting"
# A repair of a running domain's pinning (the record's `repair`, vstor.runtime.drift):
# written before its first change, done once every change is made; undoing
# while `vstor repair --undo` puts back what it changed.  A record left
# repairing or undoing is a run that was killed: the next one finishes it.
REPAIRING, REPAIRED, UNDOING = "repairing", "done", "undoing"

# The layout of a record file, written into it as "format".  0: a record
# from before the field (vstor 0.1.0 wrote none), read as it always was.
# An upgrade that changes the layout raises this and keeps reading every
# older format (domains that started before the upgrade stop after it);
# an older vstor refuses a newer record rather than guess what it holds.
RECORD_FORMAT = 1


def check_format(data, path: str) -> None:
    fmt = data.get("format", 0) if isinstance(data, dict) else 0
    if type(fmt) is not int or not 0 <= fmt <= RECORD_FORMAT:
        from vstor import __version__
        raise DamagedRecord(f"state record {path} has format {fmt!r}, which vstor {__version__} "
                            f"cannot read (it reads 0 to {RECORD_FORMAT}): a newer vstor wrote it",
                            hint="install that vstor again, or a newer one: going back to an older "
                                 "vstor while it holds backends is not supported")


def check_shape(rec) -> None:
    """What the rest of vstor relies on in a record; TypeError/ValueError if not."""
    from vstor.meta.holding import holding_from_json
    if not all(isinstance(v, str) for v in (rec.key, rec.domain, rec.status)):
        raise TypeError("key, domain and status must be strings")
    for e in rec.steps:
        if not (isinstance(e, dict) and isinstance(e.get("kind"), str)
                and e.get("state") in ("doing", "done") and isinstance(e.get("data"), dict)):
            raise ValueError(f"a step is not {{kind, state, data}}: {str(e)[:60]}")
    if not isinstance(rec.holding, dict):
        raise TypeError("holding is not an object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in rec.migration.items()):
        raise TypeError("migration is not an object of strings")
    if rec.spdk_socket is not None and not (isinstance(rec.spdk_socket, str)
                                            and rec.spdk_socket.startswith("/")
                                            and len(rec.spdk_socket) < 108 and "\0" not in rec.spdk_socket):
        raise ValueError("spdk_socket is not the absolute path of a Unix socket")
    if rec.repair:
        _check_repair(rec.repair)
    if rec.holding:
        holding_from_json(rec.holding)


def _check_repair(repair) -> None:
    if not (isinstance(repair, dict) and repair.get("status") in (REPAIRING, REPAIRED, UNDOING)
            and type(repair.get("at")) in (int, float) and isinstance(repair.get("changes"), list)):
        raise ValueError(f"repair is not {{status, at, changes}}: {str(repair)[:60]}")
    for c in repair["changes"]:
        if not (isinstance(c, dict) and isinstance(c.get("what"), str)
                and (c.get("item") is None or type(c["item"]) in (int, str))
                and type(c.get("thread", 0)) is int and _cpus(c.get("have")) and _cpus(c.get("want"))):
            raise ValueError(f"a repair's change is not {{what, item, have, want}}: {str(c)[:60]}")


def _cpus(value) -> bool:
    """A list of CPU (or node) numbers."""
    return isinstance(value, list) and all(type(x) is int and 0 <= x < 1 << 16 for x in value)


# -- the state directory and vstor's files in it -----------------------------

def check_trusted(path: str) -> None:
    """The state directory is trusted because root alone can change it
    (docs/security.md): every directory the kernel passes through to reach
    it (every link on the way followed as the kernel follows it) is root's
    and writable by nobody else (a sticky one, as /tmp, above it may be:
    nobody else can rename root's entry there), every link on the way is
    root's, and so are the state directory itself and its domains/ and
    index/.  What does not exist yet is made by vstor (0700) inside what
    was checked.  Unavailable (exit 4) otherwise."""
    if path in _TRUSTED:
        return
    real = _resolved(path)
    if real is None:
        return          # not made yet: checked again at every use
    st = _lstat(path, real)
    if st.st_mode & 0o022:
        _untrusted(path, real, f"is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}")
    for sub in ("domains", "index"):
        try:
            st = os.lstat(os.path.join(real, sub))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise Unavailable(f"cannot check state directory {path}: {sub}: {e.strerror}",
                              hint="run vstor as root") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            _untrusted(path, os.path.join(real, sub), "is not a directory only root can write")
    _TRUSTED.add(path)


_TRUSTED: set[str] = set()      # checked whole in this process


def _resolved(path: str) -> str | None:
    """Where `path` leads, walked a name at a step as the kernel walks it,
    each directory entered and each link followed checked on the way (a
    link is judged in the directory that holds it, which was checked
    first); None when a name on the way does not exist yet."""
    todo = [p for p in os.path.join(os.getcwd(), path).split("/") if p not in ("", ".")]
    here, links = "/", 0
    _checked(path, here, _lstat(path, here))
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = os.path.dirname(here)        # `here` has no link in it: checked already
            continue
        step = os.path.join(here, name)
        try:
            st = os.lstat(step)
            target = os.readlink(step) if stat.S_ISLNK(st.st_mode) else None
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unavailable(f"cannot check state directory {path}: {step}: {e.strerror}",
                              hint="run vstor as root") from None
        if target is not None:
            links += 1
            if st.st_uid != 0 or links > 40:
                _untrusted(path, step, f"is a symbolic link owned by uid {st.st_uid}" if st.st_uid
                           else "is a symbolic link in a loop", f"chown -h root:root {step}")
            todo[:0] = [p for p in target.split("/") if p not in ("", ".")]
            here = "/" if target.startswith("/") else here
            continue
        _checked(path, step, st)
        here = step
    return here


def _lstat(path: str, p: str) -> os.stat_result:
    try:
        return os.lstat(p)
    except OSError as e:
        raise Unavailable(f"cannot check state directory {path}: {p}: {e.strerror}",
                          hint="run vstor as root") from None


def _checked(path: str, p: str, st: os.stat_result) -> None:
    """A directory on the way: root's, and nobody else may write it but
    where it is sticky (the state directory itself is judged again)."""
    if not stat.S_ISDIR(st.st_mode):
        _untrusted(path, p, "is not a directory")
    if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        _untrusted(path, p, f"is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}")


class UntrustedState(Unavailable):
    """A state directory someone but root may change (check_trusted): a
    refusal even where a state directory vstor may not read is only a
    warning (planning as a user who is not root)."""


def _untrusted(path: str, where: str, why: str, fix: str = ""):
    raise UntrustedState(f"state directory {path} is not root's alone: {where} {why}, so whoever owns "
                         "it could forge what vstor holds",
                         hint=f"{fix or f'chown root:root {where} && chmod go-w {where}'}; or set [paths] "
                              "state_dir in vstor.conf to a directory only root can write")


def make_dirs(path: str, private) -> None:
    """`path` and what is missing above it, with their modes whatever the
    umask (a daemon's 0 would leave them writable by all, which the state
    directory's check then refuses): those in `private` 0700, the others
    0755 (above the state directory may also lie the socket directory QEMU
    must reach)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        mode = 0o700 if d in private else 0o755
        try:
            os.mkdir(d, mode)
        except FileExistsError:         # another vstor made it meanwhile
            continue
        os.chmod(d, mode)


class NotAFile(OSError):
    """One of vstor's files in the state directory is something else."""


def read_text(path: str) -> str:
    """A file vstor wrote in the state directory (FileNotFoundError when
    there is none, as open() says).  NotAFile when the name is a symbolic link, a directory, a FIFO, a
    device or a socket: opened without following a link and without
    blocking, and judged by what was opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _NOT_FILES:
            raise NotAFile(e.errno, f"it is {_NOT_FILES[e.errno]}, not a file vstor wrote") from None
        raise
    try:
        st = os.fstat(fd)
        kind = stat.S_IFMT(st.st_mode)
        if kind != stat.S_IFREG:
            raise NotAFile(errno.EINVAL, f"it is {_KINDS.get(kind, 'not a regular file')}, "
                                         "not a file vstor wrote")
        # os.read, not a file object around the descriptor: half the cost,
        # and gc reads several of these files per record.  Read to the end:
        # the size fstat gave is only the first read's.
        chunks = []
        while chunk := os.read(fd, max(st.st_size + 1, 4096)):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


def read_json(path: str):
    """read_text, parsed.  JSON nested too deep for Python's parser is
    ValueError, as any other that is not what vstor writes; so is a string
    with a NUL or half a surrogate pair, which no domain's XML can hold
    (its escapes passed them to libvirt's lookup and to print(), both
    internal errors at `vstor status`)."""
    text = read_text(path)
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to be what vstor writes") from None
    if "\\u" in text and any(_NOT_WRITTEN.search(s) for s in _strings(data)):    # only an escape makes one
        raise ValueError("it holds a NUL or half a surrogate pair, which vstor never writes")
    return data


_NOT_WRITTEN = re.compile("[\0\ud800-\udfff]")     # json.loads joins whole pairs: what is left is half


def _strings(data):
    """Every key and string in parsed JSON (not recursing: it may nest as
    deep as the parser went)."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            todo += x.keys()
            todo += x.values()
        elif isinstance(x, list):
            todo += x


_NOT_FILES = {errno.ELOOP: "a symbolic link", errno.ENXIO: "a socket"}
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def write_text(path: str, text: str, sync: bool = False, shared: bool = False) -> None:
    """Replace `path` whole: a temporary file beside it, made anew (never
    through a link someone left at its name), renamed over it.  `shared`:
    written without a lock, so each process's temporary name is its own."""
    tmp = f"{path}.{os.getpid()}.tmp" if shared else f"{path}.tmp"
    try:
        os.unlink(tmp)          # a killed writer's, or a link: the name goes, not its target
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, text)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def create_empty(path: str, content: str = "") -> None:
    """A marker file at `path`, made or truncated, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, content)
    finally:
        os.close(fd)


def _write_all(fd: int, text: str) -> None:
    """os.write until all of `text` is written (a file object around the
    descriptor costs more than the write of a small file itself)."""
    data = memoryview(text.encode())
    while data:
        data = data[os.write(fd, data):]
