"""NUMA placement: which node, which cores, which hugepages, which reactor.

Pure functions over the host model and the ledger.  Each returns its result or
a NoFit that says what is short, never raises from deep inside.
"""

from __future__ import annotations

from collections import Counter

from vstor.config import Config
from vstor.host.model import Host, NumaNode, format_cpulist
from vstor.planner.disks import NoFit
from vstor.planner.ledger import Ledger, held_by
from vstor.records import record


@record
class CpuPlacement:
    vcpu_pins: tuple[int, ...]
    reserved: tuple[int, ...]
    shared: tuple[int, ...]
    emulator: tuple[int, ...]
    reasons: tuple[str, ...]


def housekeeping(host: Host, cfg: Config, node: NumaNode) -> tuple[int, ...]:
    """Cores for emulator threads and shared vCPUs on a node: the configured
    ones, or else the node's first physical core with its SMT siblings."""
    if cfg.housekeeping is not None:
        return tuple(c for c in node.cpus if c in cfg.housekeeping)
    if not node.cpus:
        return ()
    first = host.cpu(node.cpus[0])
    return tuple(sorted(first.siblings)) if first else (node.cpus[0],)


def all_housekeeping(host: Host, cfg: Config) -> frozenset[int]:
    out: set[int] = set()
    for node in host.nodes:
        out.update(housekeeping(host, cfg, node))
    return frozenset(out)


def dedicated_pool(host: Host, cfg: Config, node: NumaNode, ledger: Ledger,
                   not_ours: frozenset[int]) -> tuple[int, ...]:
    """CPUs of the node a dedicated vCPU may take now."""
    isolated = {c.id for c in host.cpus if c.isolated}
    online = {c.id for c in host.cpus}
    pool = []
    for cpu in node.cpus:
        if cpu not in online or cpu in not_ours or cpu in ledger.cpu_owner:
            continue
        if isolated and cpu not in isolated:
            continue        # the host isolates CPUs: dedicated vCPUs come from those only
        pool.append(cpu)
    return tuple(pool)


def ranked_nodes(host: Host, cfg: Config, ledger: Ledger) -> list[NumaNode]:
    """Host nodes, the most free dedicated cores first (ties: lowest id)."""
    not_ours = frozenset(cfg.reactors)
    return sorted(host.nodes, key=lambda n: (-len(dedicated_pool(host, cfg, n, ledger, not_ours)), n.id))


def place_cpus(host: Host, cfg: Config, node: NumaNode, vcpus: int, policy: str,
               ledger: Ledger, only: frozenset[int] | None = None,
               pins_at: str = "") -> CpuPlacement | NoFit:
    """`only`: take from these CPUs alone (the start check asks whether a
    recorded placement is the one this function makes from its own CPUs).
    `pins_at`: who pins the vCPU threads, when not the platform at the start."""
    if policy == "external":
        return CpuPlacement((), (), (), (), ("the vCPUs are the platform's to place (Nova pins "
                                             "them, by the flavor's hw:cpu_policy): vstor places none",))
    hk = tuple(c for c in housekeeping(host, cfg, node) if c not in cfg.reactors)
    if policy == "shared":
        if not hk:
            return NoFit(f"node {node.id} has no housekeeping cores for shared vCPUs "
                         "(set [cpu] housekeeping in vstor.conf)")
        cpus = format_cpulist(hk)
        return CpuPlacement((), (), hk, hk, (f"shared vCPUs float on node {node.id}'s "
                                             f"housekeeping cores {cpus}, with the emulator",))
    not_ours = all_housekeeping(host, cfg) | frozenset(cfg.reactors)
    pool = dedicated_pool(host, cfg, node, ledger, not_ours)
    if only is not None:
        pool = tuple(c for c in pool if c in only)
    picked = _whole_cores(host, pool, vcpus)
    if isinstance(picked, NoFit):
        who = holders(ledger, node.cpus)
        return NoFit(f"node {node.id}: {picked.reason}" + (f"; cores held by {who}" if who else ""))
    pins, reserved = picked
    pinned = f"to be pinned 1:1 {pins_at}" if pins_at else "pinned 1:1"
    reasons = [f"{vcpus} vCPU{'s' if vcpus != 1 else ''} {pinned} to dedicated cores "
               f"{format_cpulist(pins)} on node {node.id}"]
    if reserved:
        reasons.append(f"SMT siblings {format_cpulist(reserved)} kept idle so no other VM "
                       "shares those physical cores")
    if hk:
        emulator = hk
        reasons.append(f"emulator threads on housekeeping cores {format_cpulist(hk)}")
    else:
        emulator = tuple(sorted(pins))
        reasons.append(f"node {node.id} has no housekeeping cores: emulator threads share "
                       "the VM's own cores")
    return CpuPlacement(pins, reserved, (), emulator, tuple(reasons))


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def holders(ledger: Ledger, cpus, most: int = 3) -> str:
    """The domains holding any of `cpus`, as a refusal names them:
    'web1 (not running), db2 (running)', the first `most`, then how many
    more.  A domain that is not running holds its cores by its plan, while
    it is defined (or reserved for an incoming migration)."""
    names = list(dict.fromkeys(ledger.cpu_owner[c] for c in cpus if c in ledger.cpu_owner))
    said = ", ".join(held_by(ledger, name) for name in names[:most])
    return said + (f" and {len(names) - most} more" if len(names) > most else "")


def _whole_cores(host: Host, pool: tuple[int, ...], vcpus: int):
    """Take whole physical cores (every SMT sibling free) lowest first."""
    free = set(pool)
    cores: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for cpu_id in pool:
        if cpu_id in seen:
            continue
        cpu = host.cpu(cpu_id)
        siblings = tuple(sorted(cpu.siblings)) if cpu and cpu.siblings else (cpu_id,)
        seen.update(siblings)
        if all(s in free for s in siblings):
            cores.append(siblings)
    threads = [t for core in cores for t in core]
    if len(threads) < vcpus:
        return NoFit(f"{counted(len(cores), 'whole free core')} ({counted(len(threads), 'thread')}) "
                     f"for dedicated vCPUs, the VM needs {vcpus} (free cores or use cpus='shared')")
    pins: list[int] = []
    reserved: list[int] = []
    for core in cores:
        if len(pins) >= vcpus:
            break
        for t in core:
            (pins if len(pins) < vcpus else reserved).append(t)
    return tuple(pins), tuple(reserved)


def place_hugepages(node: NumaNode, size_kib: int, memory_kib: int,
                    ledger: Ledger, grow: Config | None = None) -> int | NoFit:
    """The number of pages to take from the node's pool, or what is short.
    grow: the platform raises the pool at the VM's start (Proxmox does, on
    the VM's host node): free pages plus what the node's free memory can
    still be made into count."""
    count = memory_kib // size_kib
    pool = node.pool(size_kib)
    path = f"/sys/devices/system/node/node{node.id}/hugepages/hugepages-{size_kib}kB/nr_hugepages"
    if pool is None:
        return NoFit(f"node {node.id} has no {size_kib} KiB hugepage pool (is the page size "
                     "supported and hugetlbfs set up?)")
    promised = ledger.promised_hugepages(node.id, size_kib)
    free = pool.free - promised
    if free >= count:
        return count
    if grow is not None:
        room = _room_kib(grow, node, ledger)
        if free + room // size_kib >= count:       # promises beyond the free pages come from room too
            return count
        return NoFit(f"node {node.id} cannot give {count} {size_kib} KiB hugepages: {max(free, 0)} "
                     f"are free and its memory outside the pools holds {max(room, 0) // size_kib} more "
                     "(free memory on the node, or lower [memory] reserved)")
    extra = f", {promised} of them promised to defined domains" if promised else ""
    return NoFit(f"node {node.id} has {pool.free} free {size_kib} KiB hugepages{extra}; "
                 f"the VM needs {count} (raise {path} to {pool.total + count - free})")


def _room_kib(cfg: Config, node: NumaNode, ledger: Ledger) -> int:
    """The node's memory outside its hugepage pools, less what the host keeps
    ([memory] reserved) and what the ledger's domains hold bound to it."""
    pools = sum(p.total * p.size_kib for p in node.hugepages)
    return node.memory_kib - pools - cfg.memory_reserved_mib * 1024 - ledger.bound_memory_kib(node.id)


def place_memory(cfg: Config, node: NumaNode, memory_kib: int, ledger: Ledger) -> None | NoFit:
    """Room on the node for a VM's ordinary memory bound there: the node's
    memory outside its hugepage pools, less what the host keeps ([memory]
    reserved) and what the ledger's domains hold bound to it."""
    pools = sum(p.total * p.size_kib for p in node.hugepages)
    reserved = cfg.memory_reserved_mib * 1024
    held = ledger.bound_memory_kib(node.id)
    room = node.memory_kib - pools - reserved - held
    if memory_kib <= room:
        return None
    mib = lambda kib: f"{max(kib, 0) // 1024} MiB"     # noqa: E731
    return NoFit(f"node {node.id} has {mib(room)} of memory left for VMs outside its hugepage "
                 f"pools ({mib(node.memory_kib)}, {mib(pools)} in hugepage pools, {mib(reserved)} "
                 f"kept for the host, {mib(held)} bound to other domains); the VM needs "
                 f"{mib(memory_kib)} (use hugepages, numa='none', or another host)")


def reactor_candidates(cfg: Config, node: NumaNode | None, strict: bool):
    """The reactor cores a vhost controller of a VM on `node` may use, with a
    note when they are off the node; or NoFit."""
    if not cfg.reactors:
        return NoFit("no SPDK reactor cores configured: set [cpu] reactors in vstor.conf "
                     "to the cores of SPDK's -m mask")
    local = [c for c in cfg.reactors if node is None or c in node.cpus]
    if local:
        return local, ""
    if strict:
        return NoFit(f"no SPDK reactor core on node {node.id}: add one of its cores to "
                     "[cpu] reactors and to SPDK's -m mask")
    return list(cfg.reactors), f"no reactor on node {node.id}; "


def place_reactor(cfg: Config, node: NumaNode | None, strict: bool,
                  load: Counter[int]) -> tuple[int, str] | NoFit:
    """The SPDK reactor core for one vhost controller: on the VM's node, the
    least loaded one (ties: lowest id)."""
    found = reactor_candidates(cfg, node, strict)
    if isinstance(found, NoFit):
        return found
    local, where = found
    best = min(local, key=lambda c: (load[c], c))
    return best, f"{where}SPDK reactor core {best} ({load[best]} other vhost controllers on it)"


def cpu_problems(host: Host, cfg: Config, node: NumaNode, cpus, ledger: Ledger) -> list[str]:
    """Why CPUs placed earlier are not free for dedicated vCPUs now: the
    same pool `place_cpus` takes from, with the reason for each CPU outside it."""
    not_ours = all_housekeeping(host, cfg) | frozenset(cfg.reactors)
    pool = set(dedicated_pool(host, cfg, node, ledger, not_ours))
    online = {c.id for c in host.cpus}
    isolated = {c.id for c in host.cpus if c.isolated}
    why: dict[str, list[int]] = {}
    for cpu in sorted(set(cpus) - pool):
        if cpu not in online:
            reason = "are not online on this host"
        elif cpu not in node.cpus:
            reason = f"are not on node {node.id}"
        elif cpu in cfg.reactors:
            reason = "are SPDK reactor cores now"
        elif cpu in not_ours:
            reason = "are housekeeping cores now"
        elif cpu in ledger.cpu_owner:
            reason = f"are held by domain {held_by(ledger, ledger.cpu_owner[cpu])}"
        elif isolated and cpu not in isolated:
            reason = "are not among the host's isolated CPUs"
        else:
            reason = "are not free"
        why.setdefault(reason, []).append(cpu)
    return [f"CPUs {format_cpulist(c)} {reason}" for reason, c in why.items()]
