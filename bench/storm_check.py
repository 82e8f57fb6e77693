"""What a boot storm (bench/storm.py) must leave: after prepare, each
domain holding exactly what its plan gave it and no two domains sharing a
core, a socket, a volume or a daemon, read back twice (from vstor's state
records, and from the running daemons themselves: their CPU affinity, the
sockets they listen on, the files they hold open); after release, nothing.

Each function returns a list of problems, one line each; [] when it held.
The oracles are the plans the storm's domains were made with and the
kernel's view of the processes, never vstor's own answers alone.
"""

from __future__ import annotations

import glob
import os
from itertools import combinations

from bench.sanity import holders
from bench.storm import World, daemons_under, pidfile_of


def prepared(world: World, names: list[str]) -> list[str]:
    """`names` prepared, the rest of the world's domains not (nothing of
    theirs left either); nothing shared."""
    return from_records(world, names) + from_daemons(world, names) + files_of_others(world, names)


def files_of_others(world: World, names: list[str]) -> list[str]:
    """Sockets, pid files, monitors and uid leases of domains not in
    `names` (the directories' lock files, .lock, stay as the directories
    do; the leases' directory goes with its last lease)."""
    from vstor.backends.qsd import grant
    out = []
    for where in (world.cfg.vhost_dir, world.cfg.qsd_dir):
        for f in sorted(os.listdir(where)) if os.path.isdir(where) else ():
            if where == world.cfg.qsd_dir and f == os.path.basename(grant.users_dir(where)):
                leases = [(u, grant.lease_name(where, u)) for u in sorted(os.listdir(grant.users_dir(where)))]
                out += [f"uid lease {u} of {name or '?'} left" for u, name in leases
                        if not any(name.startswith(n + "-") for n in names)]
                if not leases and not names:
                    out.append(f"{where}/{f} left")
            elif not f.startswith(".") and not any(f.startswith(n + "-") for n in names):
                out.append(f"{where}/{f} left")
    return out


def released(world: World) -> list[str]:
    """Nothing of any domain left: no daemon, socket, pid file, monitor,
    state record, nor any process holding something under the world."""
    from vstor.runtime.state import StateDir
    out = [f"daemon {pid} still runs ({pidfile_of(argv)})" for pid, argv in daemons_under(world.work)]
    out += [f"state record of {r.domain} left ({r.status})" for r in StateDir(world.cfg.state_dir).records()]
    out += [f"{p} left" for p in glob.glob(os.path.join(world.cfg.state_dir, "domains", "*"))]
    out += files_of_others(world, [])
    out += [f"process {pid} ({what}) holds {held}" for pid, what, held in holders([world.work])]
    return out


# -- the state records ----------------------------------------------------------------------

def from_records(world: World, names: list[str]) -> list[str]:
    from vstor.runtime.state import StateDir
    out = []
    held: dict[str, dict[str, set]] = {}
    for rec in StateDir(world.cfg.state_dir).records():
        exports = [e["data"] for e in rec.steps if e.get("kind") == "qsd-export"]
        held[rec.domain] = {
            "cores": set(rec.holding.get("cpus", ())),
            "sockets": {e["socket_path"] for e in exports} | set(rec.holding.get("sockets", ())),
            "volumes": {e["source"] for e in exports},
            "pid files": {os.path.join(e["run_dir"], e["name"] + ".pid") for e in exports},
            "daemon cores": {c for e in exports for c in e.get("cpus", ())},
        }
        if rec.status != "prepared":
            out.append(f"record of {rec.domain} is {rec.status}, not prepared")
        if len(exports) != len(world.sources[rec.domain]):
            out.append(f"record of {rec.domain} has {len(exports)} daemons, "
                       f"not {len(world.sources[rec.domain])}")
    if sorted(held) != sorted(names):
        out.append(f"records of {sorted(held)}, expected {sorted(names)}")
    for name in set(held) & set(names):
        want = {"cores": world.dedicated(name), "sockets": set(world.sockets(name)),
                "volumes": set(world.sources[name])}
        out += [f"record of {name} holds {what} {sorted(held[name][what])}, its plan "
                f"{sorted(want[what])}" for what in want if held[name][what] != want[what]]
    for a, b in combinations(sorted(held), 2):
        for what in ("cores", "sockets", "volumes", "pid files"):
            shared = held[a][what] & held[b][what]
            if shared:
                out.append(f"{a} and {b} both hold {what} {sorted(shared)}")
        for x, y in ((a, b), (b, a)):
            if held[x]["daemon cores"] & held[y]["cores"]:
                out.append(f"{x}'s daemons are pinned to {y}'s dedicated cores "
                           f"{sorted(held[x]['daemon cores'] & held[y]['cores'])}")
    return out


# -- the running daemons ------------------------------------------------------------------------

def from_daemons(world: World, names: list[str]) -> list[str]:
    """Each planned disk of `names` served by exactly one daemon, which
    listens on that disk's socket alone and holds that disk's file alone;
    no other daemon under the world."""
    by_socket, by_source = {}, {}       # -> (domain, target), or the set of them
    for name in world.names:
        for d, source in zip(world.plans[name].disks, world.sources[name]):
            by_socket[d.socket] = (name, d.target)
            by_source.setdefault(source, set()).add((name, d.target))
    expected = {(n, d.target) for n in names for d in world.plans[n].disks}
    unix = _listening()
    affinity = os.sched_getaffinity(0)      # the hooks' (started from here)
    out, served = [], {}
    for pid, argv in daemons_under(world.work):
        fds = _fds(pid)
        socks = {unix[i] for i in fds.values() if i in unix and unix[i].startswith(world.cfg.vhost_dir + "/")}
        files = {t for t in fds.values() if t.startswith(world.images + "/")}
        disks = {by_socket.get(s, ("?", s)) for s in socks}
        who = f"daemon {pid} ({os.path.basename(pidfile_of(argv))})"
        if len(socks) != 1 or len(files) != 1 or not disks <= by_source.get(min(files, default=""), set()):
            out.append(f"{who} listens on {sorted(socks)} and holds {sorted(files)}: "
                       "not one disk's socket and file")
        for disk in disks:
            served.setdefault(disk, []).append(pid)
        # The runtime pins a daemon to its plan's emulator cores on the
        # planned host; on the synthetic one it runs where its hook ran.
        want = affinity if world.root != "/" else {
            c for name, _ in disks if name in world.plans for c in world.plans[name].emulator}
        cpus = _allowed(pid)
        if cpus is not None and cpus != want:
            out.append(f"{who} runs on CPUs {sorted(cpus)}, not {sorted(want)}")
    for disk in sorted(expected):
        if len(served.get(disk, ())) != 1:
            out.append(f"{disk[0]} {disk[1]} is served by {len(served.get(disk, ()))} daemons")
    out += [f"{disk[0]} {disk[1]} is served (pids {pids}) though it should not be"
            for disk, pids in sorted(served.items()) if disk not in expected]
    return out


def _listening() -> dict[str, str]:
    """'socket:[inode]' -> path of every listening Unix socket."""
    found = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) >= 8 and int(cols[3], 16) & 0x10000:       # __SO_ACCEPTCON
                found[f"socket:[{cols[6]}]"] = cols[7]
    return found


def _fds(pid: int) -> dict[str, str]:
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for n in names:
        try:
            out[n] = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            pass
    return out


def _allowed(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except OSError:
        return None
