"""A bench's own sanity, checked at the end of its quick mode (`--quick`).

A quick run takes the same code paths as a full one with tiny counts, so
that a bench broken by a change of vstor fails CI (tests/test_bench.py runs
each bench that way) instead of rotting until someone re-measures.  Its
figures mean nothing; what it checks is that the bench still works:

- every figure it promised was measured (a positive, finite number: a
  section that silently skipped or timed nothing is caught);
- it left nothing behind: for every path the bench worked under, the path
  itself is gone, and no process holds it (in its command line, as its
  working directory or root, or as an open descriptor: a daemon started with
  its source or socket handed over names neither), and nothing is mounted
  there.

The last line of a quick run is `quick: ok (...)`, or `quick: FAILED: ...`
with exit status 1.  A full run checks nothing here and prints no such line.
"""

from __future__ import annotations

import math
import os
import sys

# Every bench's vstor.conf ends with this: a bench measures vstor's own runs,
# and the supervisor (vstor.runtime.supervise) is a process of its own that
# outlives them by design, which the leak check here would find.  Its cost
# to a start is the look at its lock (ensure), under 0.1 ms.
NO_SUPERVISOR = "[vhost]\nsupervise = no\n"


class Sanity:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.figures: list[tuple[str, float]] = []
        self.paths: list[str] = []
        self.problems: list[str] = []

    def figure(self, label: str, value: float) -> float:
        """Record one measured figure; returns it unchanged."""
        self.figures.append((label, value))
        return value

    def watch(self, path: str) -> str:
        """A path the bench works under: it must be gone when the bench ends."""
        self.paths.append(os.path.realpath(path))
        return path

    def problem(self, what: str) -> None:
        """Something the bench saw go wrong that does not raise by itself."""
        self.problems.append(what)

    def finish(self, expected: int) -> None:
        """In quick mode: check, print the verdict, exit 1 on a problem."""
        if not self.quick:
            return
        problems = list(self.problems)
        if len(self.figures) != expected:
            problems.append(f"{len(self.figures)} figures measured, {expected} expected")
        problems += [f"figure '{label}' is {value!r}" for label, value in self.figures
                     if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0)]
        problems += leftovers(self.paths)
        if problems:
            print("quick: FAILED: " + "; ".join(problems), flush=True)
            sys.exit(1)
        where = (f"nothing left under {', '.join(self.paths)}" if self.paths
                 else "it works under no path")
        print(f"quick: ok ({len(self.figures)} figures; {where})", flush=True)


def leftovers(paths: list[str]) -> list[str]:
    """What of `paths` is still on the machine: the paths themselves,
    processes holding something below them, mounts there."""
    out = [f"{p} still exists" for p in paths if os.path.lexists(p)]
    out += [f"process {pid} ({what}) holds {held}" for pid, what, held in holders(paths)]
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f]
    except OSError:
        mounts = []
    out += [f"{m} is still mounted" for m in mounts if any(_below(m, p) for p in paths)]
    return out


def holders(paths: list[str]) -> list[tuple[int, str, str]]:
    """(pid, command, what it holds) of every other process that names a
    path below one of `paths` in its command line, or has its working
    directory, root or an open descriptor there."""
    if not paths:
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue        # gone meanwhile
        held = [a for a in argv if any(p in a for p in paths)]
        links = ["cwd", "root"] + [f"fd/{n}" for n in _fds(pid)]
        for link in links:
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if any(_below(target, p) for p in paths):
                held.append(f"{link} -> {target}")
        if held:
            found.append((pid, " ".join(argv)[:80], held[0]))
    return found


def _fds(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# A yardstick's start of one daemon as vstor starts it (bench_hook's and
# bench_storm's scripts include it): the source opened and the vhost-user
# and QMP sockets bound and listening, handed over as descriptors; the
# pidfile made for the confined daemon's uid.  The process and what the
# caller must keep open until it has started.
YARDSTICK_START = """
def start(argv, pidfile, source, path, uid):
    import socket, subprocess
    fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
    socks = []
    for where in (path, pidfile[:-4] + ".qmp"):
        sock = socket.socket(socket.AF_UNIX)
        if os.path.exists(where):
            os.unlink(where)
        sock.bind(where)
        sock.listen()
        socks.append(sock)
    pid = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.fchown(pid, uid, uid)
    os.close(pid)
    fds = {"SRC_FD": fd, "SOCK_FD": socks[0].fileno(), "QMP_FD": socks[1].fileno()}
    for name, n in fds.items():
        argv = [a.replace(name, str(n)) for a in argv]
    return subprocess.Popen(argv, pass_fds=tuple(fds.values())), [fd, *socks]
"""

