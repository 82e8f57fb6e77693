"""CPUs, NUMA nodes, memory and hugepage pools."""

from __future__ import annotations

from vstor.host.model import format_cpulist, parse_cpulist

from .model import Build, Cpu, parse_size
from .tree import Tree, cpumask


def write_cpus(b: Build) -> None:
    t = b.t
    smt, total = b.layout.get("smt", 1), sum(n["cores"] for n in b.nodes)
    core_index = 0
    for node in b.nodes:
        for core in range(node["cores"]):
            # Intel numbering: first threads of every core, then the second threads.
            siblings = tuple(s * total + core_index for s in range(smt))
            for cpu in siblings:
                b.cpus[cpu] = Cpu(node["id"], node.get("package", node["id"]), core, siblings)
            core_index += 1
    base, every = "/sys/devices/system/cpu", format_cpulist(b.cpus)
    for name in ("online", "possible", "present"):
        t.write(f"{base}/{name}", every)
    t.write(f"{base}/offline")
    t.write(f"{base}/isolated", format_cpulist(parse_cpulist(b.layout.get("isolated", ""))))
    for n, cpu in b.cpus.items():
        topo = f"{base}/cpu{n}/topology"
        package_cpus = [c for c, other in b.cpus.items() if other.package == cpu.package]
        t.write(f"{topo}/physical_package_id", cpu.package)
        t.write(f"{topo}/die_id", 0)
        t.write(f"{topo}/core_id", cpu.core)
        t.write(f"{topo}/thread_siblings_list", format_cpulist(cpu.siblings))
        t.write(f"{topo}/core_cpus_list", format_cpulist(cpu.siblings))
        t.write(f"{topo}/core_siblings_list", format_cpulist(package_cpus))
        t.write(f"{topo}/package_cpus_list", format_cpulist(package_cpus))
        if n:
            t.write(f"{base}/cpu{n}/online", 1)
        if b.numa:
            t.link(f"{base}/cpu{n}/node{cpu.node}", f"/sys/devices/system/node/node{cpu.node}")


def _pools(node: dict) -> dict[int, tuple[int, int]]:
    pools = {2048: (0, 0), 1048576: (0, 0)}
    for size, count in node.get("hugepages", {}).items():
        total, free = (count, count) if isinstance(count, int) else count
        pools[parse_size(size) // 1024] = (total, free)
    return pools


def write_memory(b: Build) -> None:
    t = b.t
    base, ids = "/sys/devices/system/node", [n["id"] for n in b.nodes]
    totals = {2048: [0, 0], 1048576: [0, 0]}
    mem_kib = 0
    for node in b.nodes:
        kib = parse_size(node.get("memory", "16GiB")) // 1024
        mem_kib += kib
        pools = _pools(node)
        for size, (total, free) in pools.items():
            totals.setdefault(size, [0, 0])
            totals[size][0] += total
            totals[size][1] += free
        if b.numa:
            _node_dir(b, f"{base}/node{node['id']}", node, kib, pools, ids)
    if b.numa:
        for name in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory"):
            t.write(f"{base}/{name}", format_cpulist(ids))
    for size, (total, free) in totals.items():
        _pool_dir(t, f"/sys/kernel/mm/hugepages/hugepages-{size}kB", total, free)
    pages2m = totals[2048]
    t.write("/proc/meminfo", f"MemTotal:       {mem_kib} kB\nMemFree:        {mem_kib // 2} kB\n"
            f"HugePages_Total: {pages2m[0]}\nHugePages_Free:  {pages2m[1]}\n"
            "Hugepagesize:       2048 kB")
    t.write("/proc/sys/vm/nr_hugepages", pages2m[0])


def _node_dir(b: Build, path: str, node: dict, kib: int, pools: dict,
              ids: list[int]) -> None:
    t = b.t
    cpus, n = b.node_cpus(node["id"]), node["id"]
    t.write(f"{path}/cpulist", format_cpulist(cpus))
    t.write(f"{path}/cpumap", cpumask(cpus, len(b.cpus)))
    t.write(f"{path}/distance", " ".join("10" if i == n else "21" for i in ids))
    t.write(f"{path}/meminfo", f"Node {n} MemTotal:       {kib} kB\n"
            f"Node {n} MemFree:        {kib // 2} kB\n"
            f"Node {n} HugePages_Total: {pools[2048][0]}\nNode {n} HugePages_Free:  {pools[2048][1]}")
    for size, (total, free) in pools.items():
        _pool_dir(t, f"{path}/hugepages/hugepages-{size}kB", total, free)
    for cpu in cpus:
        t.link(f"{path}/cpu{cpu}", f"/sys/devices/system/cpu/cpu{cpu}")


def _pool_dir(t: Tree, path: str, total: int, free: int) -> None:
    t.write(f"{path}/nr_hugepages", total)
    t.write(f"{path}/free_hugepages", free)
    t.write(f"{path}/surplus_hugepages", 0)
