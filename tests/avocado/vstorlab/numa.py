"""NUMA locality of a running vstor domain, judged by libvirt's answers
(capabilities, vcpupin, emulatorpin, numatune) and the kernel's (the QEMU
threads' CPU affinity, where its guest memory pages are)."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from avocado.core.exceptions import TestFail
from lxml import etree

from . import hostdev
from .guestrun import NS, GuestDomain

LOG = logging.getLogger("avocado.test")


@dataclass(frozen=True)
class Placement:
    node: int
    pins: tuple[int, ...]          # vCPU i on pins[i]
    emulator: frozenset[int]


def cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}"""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def planned(dom: GuestDomain) -> Placement:
    """The placement vstor recorded in the running domain's plan."""
    plan = dom.live_xml().find(f"metadata/{{{NS}}}vstor/{{{NS}}}plan")
    if plan is None:
        raise TestFail(f"{dom.name} runs without a vstor plan in its metadata")
    pins = tuple(int(c) for c in plan.get("pins", "").split(",") if c)
    return Placement(int(plan.get("node")), pins, frozenset(cpulist(plan.get("emulator", ""))))


def node_cpus(dom: GuestDomain, node: int) -> set[int]:
    caps = etree.fromstring(dom.lab.virsh("capabilities").encode())
    cell = caps.find(f"host/topology/cells/cell[@id='{node}']")
    if cell is None:
        raise TestFail(f"libvirt's capabilities have no NUMA cell {node}")
    return {int(c.get("id")) for c in cell.iterfind("cpus/cpu")}


def check(dom: GuestDomain, device_node: int | None = None, kernel: bool = True) -> Placement:
    """vCPUs, emulator threads and guest memory on the planned node, which is
    the device's node when the device has one (sysfs -1: no node). `kernel`:
    also the kernel's answers (QEMU's threads and pages), for a domain here."""
    place = planned(dom)
    if device_node is not None and device_node >= 0 and place.node != device_node:
        raise TestFail(f"{dom.name} was placed on node {place.node}, its device is on node {device_node}")
    cpus = node_cpus(dom, place.node)
    _vcpus(dom, place, cpus, kernel)
    emulator = _pinned(dom.lab.virsh("emulatorpin", dom.name, "--live"))
    _within("emulator threads (virsh emulatorpin)", emulator, set(place.emulator) & cpus or cpus)
    _memory(dom, place.node, kernel)
    LOG.info("NUMA: %s on node %d (CPUs %s): vCPUs %s, emulator %s", dom.name, place.node,
             sorted(cpus), list(place.pins), sorted(emulator))
    return place


def threads_within(pid: int, allowed: set[int], what: str) -> None:
    """Every thread of process `pid` may run only on `allowed` CPUs."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        _within(f"{what} thread {task.name}", cpulist(_status(task, "Cpus_allowed_list")), allowed)


def reactor(spdk: str, dom: GuestDomain, place: Placement) -> None:
    """SPDK's own answer: the vhost controller of the domain's disk exists,
    polled on the planned reactor, a core of the domain's node, over the
    planned bdev."""
    disk = dom.live_xml().find(f"metadata/{{{NS}}}vstor/{{{NS}}}plan/{{{NS}}}disk")
    name = Path(disk.get("socket")).name
    found = [c for c in hostdev.spdk_call(spdk, "vhost_get_controllers") if c["ctrlr"] == name]
    if not found:
        raise TestFail(f"SPDK has no vhost controller {name}")
    mask = int(found[0]["cpumask"], 16)
    cores = {i for i in range(mask.bit_length()) if mask >> i & 1}
    if cores != {int(disk.get("reactor"))} or not cores <= node_cpus(dom, place.node):
        raise TestFail(f"SPDK polls {name} on cores {sorted(cores)}; planned: reactor "
                       f"{disk.get('reactor')} on node {place.node}")
    if not hostdev.spdk_call(spdk, "bdev_get_bdevs", {"name": disk.get("bdev")}):
        raise TestFail(f"SPDK has no bdev {disk.get('bdev')}")


def _vcpus(dom: GuestDomain, place: Placement, cpus: set[int], kernel: bool) -> None:
    lines = [ln.split(None, 1) for ln in dom.lab.virsh("vcpupin", dom.name, "--live").splitlines()
             if ln.strip()]
    pinned = {int(v.rstrip(":")): cpulist(a) for v, a in lines}
    for vcpu, affinity in pinned.items():
        want = {place.pins[vcpu]} if vcpu < len(place.pins) else cpus
        _within(f"vCPU {vcpu} (virsh vcpupin)", affinity, want & cpus)
    if not kernel:
        return
    pid = dom.qemu_pid()
    seen = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        found = re.fullmatch(r"CPU (\d+)/(KVM|TCG)", _comm(task))
        if found:
            seen += 1
            vcpu = int(found.group(1))
            _within(f"vCPU {vcpu} thread {task.name} (kernel)",
                    cpulist(_status(task, "Cpus_allowed_list")), pinned.get(vcpu, cpus))
    if not seen:
        raise TestFail(f"no vCPU threads ('CPU n/KVM' or 'CPU n/TCG') in QEMU {pid} of {dom.name}")


def _memory(dom: GuestDomain, node: int, kernel: bool) -> None:
    said = dict(ln.split(":", 1) for ln in dom.lab.virsh("numatune", dom.name, "--live").splitlines()
                if ":" in ln)
    nodeset = said.get("numa_nodeset", "").strip()
    if nodeset and cpulist(nodeset) != {node}:
        raise TestFail(f"{dom.name}'s memory is bound to nodes {nodeset} (virsh numatune), not {node}")
    if not kernel:
        return
    # The guest's RAM is QEMU's largest mapping: all its pages on the node.
    biggest: dict[int, int] = {}
    for line in Path(f"/proc/{dom.qemu_pid()}/numa_maps").read_text().splitlines():
        pages = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"\bN(\d+)=(\d+)", line)}
        if sum(pages.values()) > sum(biggest.values()):
            biggest = pages
    elsewhere = {n: p for n, p in biggest.items() if n != node}
    if elsewhere:
        raise TestFail(f"{dom.name}'s guest memory has pages on nodes {elsewhere} (numa_maps), "
                       f"not only on node {node}")


def _pinned(text: str) -> set[int]:
    """The CPU list virsh emulatorpin prints ('*: 0-3', or '0-3' with -q)."""
    lines = [ln.split(":")[-1].strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) != 1 or not re.fullmatch(r"[0-9,-]+", lines[0]):
        raise TestFail(f"cannot read virsh's pinning: {text.strip()!r}")
    return cpulist(lines[0])


def _within(what: str, got: set[int], allowed: set[int]) -> None:
    if not got or not got <= allowed:
        raise TestFail(f"{what} may run on CPUs {sorted(got)}, outside {sorted(allowed)}")


def _status(task: Path, key: str) -> str:
    for line in (task / "status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _comm(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except OSError:
        return ""
