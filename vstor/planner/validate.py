"""Is a recorded plan still good on the host as it is now?  Run at `prepare`,
just before anything is changed: the host may have moved on since the domain
was defined (a disk mounted, hugepages taken, cores handed to another VM)."""

from __future__ import annotations

from vstor.config import Config
from vstor.planner.ledger import Ledger, volume_key
from vstor.host.model import Host, format_cpulist
from vstor.meta.plan import Plan
from vstor.backends.vfio import check_passthrough
from vstor.planner.disks import USERSPACE_DRIVERS, NoFit, _block_use


def validate(host: Host, cfg: Config, plan: Plan, running: Ledger) -> list[str]:
    """Problems, each one line; empty when the plan can be carried out now.
    `running` holds what the other running vstor domains have."""
    running = running.without(plan.domain, plan.uuid)
    problems = _cpus(host, cfg, plan, running)
    problems += _memory(host, plan)
    for disk in plan.disks:
        problems += _disk(host, cfg, disk, running)
    return problems


def _cpus(host: Host, cfg: Config, plan: Plan, running: Ledger) -> list[str]:
    online = {c.id for c in host.cpus}
    wanted = set(plan.dedicated_cpus) | set(plan.emulator) | set(plan.shared_cpus)
    out = []
    gone = sorted(wanted - online)
    if gone:
        out.append(f"CPUs {format_cpulist(gone)} are not online on this host")
    taken = {cpu: running.cpu_owner[cpu] for cpu in plan.dedicated_cpus if cpu in running.cpu_owner}
    for owner in sorted(set(taken.values())):
        cpus = format_cpulist(c for c, o in taken.items() if o == owner)
        out.append(f"dedicated CPUs {cpus} are held by running domain '{owner}'")
    clash = sorted(plan.dedicated_cpus & set(cfg.reactors))
    if clash:
        out.append(f"CPUs {format_cpulist(clash)} are SPDK reactor cores now")
    return out


def _memory(host: Host, plan: Plan) -> list[str]:
    if not plan.hugepage_kib or plan.node is None:
        return []
    node = host.node(plan.node)
    pool = node.pool(plan.hugepage_kib) if node else None
    free = pool.free if pool else 0
    if free < plan.hugepages:
        return [f"node {plan.node} has {free} free {plan.hugepage_kib} KiB hugepages, "
                f"the domain needs {plan.hugepages}"]
    return []


def _disk(host: Host, cfg: Config, disk, running: Ledger) -> list[str]:
    t = disk.target
    out = []
    if disk.socket and disk.socket in running.sockets:
        out.append(f"{t}: socket {disk.socket} belongs to running domain '{running.sockets[disk.socket]}'")
    other = running.volume_conflict(volume_key(disk), disk.readonly)
    if other:
        out.append(f"{t}: its volume is in use by running domain '{other}'")
    if disk.controller is None:
        return out + _block(host, disk)
    ctrl = host.controller(disk.controller)
    if ctrl is None:
        return out + [f"{t}: NVMe controller {disk.controller} is gone from this host"]
    owner = running.passthrough.get(ctrl.address)
    if owner:
        out.append(f"{t}: controller {ctrl.address} is passed through to running domain '{owner}'")
    if disk.backend == "vfio" or (disk.backend == "spdk" and ctrl.driver not in USERSPACE_DRIVERS
                                  and not running.spdk_users.get(ctrl.address)):
        out += [f"{t}: {p}" for p in check_passthrough(
            ctrl, iommu_enabled=host.iommu_enabled, vfio_available=host.vfio_available,
            pci_allowed=cfg.pci_allowed, pci_blocked=cfg.pci_blocked,
            spdk_owned=disk.backend == "vfio" and bool(running.spdk_users.get(ctrl.address)))]
    if disk.backend == "qsd":
        ns = ctrl.namespace(disk.source.namespace)
        if ctrl.driver != "nvme" or ns is None:
            out.append(f"{t}: controller {ctrl.address} is on {ctrl.driver or 'no driver'}, "
                       "so its namespace has no block device")
        elif ns.in_use:
            out.append(f"{t}: {ns.dev_path} is in use by the host ({'; '.join(ns.in_use)})")
    return out


def _block(host: Host, disk) -> list[str]:
    if disk.source.kind != "block":
        return []
    found = _block_use(host, disk.source.path)
    return [f"{disk.target}: {found.reason}"] if isinstance(found, NoFit) else []
