"""Per-disk decisions: passthrough or vhost, and which vhost backend.

Pure: a host model, the config, the ledger and the request in; a choice with
its reasons (or the reasons it cannot be done) out.
"""

from __future__ import annotations

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, NvmeController, unservable
from vstor.meta.intent import DiskIntent, VmIntent
from vstor.meta.names import inside, volume_keys
from vstor.planner.ledger import Ledger, Overlay, held_by
from vstor.planner.volumes import controller_taken, kernel_users, names, namespace_at, two_writers, volumes_of
from vstor.planner.passthrough import USERSPACE_DRIVERS, check_passthrough
from vstor.planner.spdk_paths import attach_paths, connections_of, host_nqn
from vstor.records import record


@record
class DiskChoice:
    disk: DiskIntent
    mode: str                  # passthrough | vhost
    backend: str               # vfio | spdk | qsd
    controller: str | None     # local PCI address, when there is one
    node: int | None           # NUMA node the data path lives on
    node_from: str             # what gave the node ('NVMe 0000:5e:00.0')
    reasons: tuple[str, ...]
    bind: bool = False         # vstor moves the controller to vfio-pci
    device: str | None = None  # qsd on a namespace: its block device
    connections: tuple[tuple[str, str], ...] = ()   # NVMe-oF: (path, SPDK controller)
    attach: tuple = ()         # NVMe-oF: bdev_nvme_attach_controller's parameters per path


@record
class NoFit:
    reason: str


def check_volume(ledger: Overlay, disk: DiskIntent, keys: tuple[str, ...]) -> None:
    """Two disks of one domain on one volume (`keys`: the disk's, see
    volumes_of): both read-only, or refused (the ledger says so between
    domains; within one it is the intent's contradiction, exit 2)."""
    for key in keys:
        other = ledger.own_volumes.get(key)
        if other is not None and not (other[1] and disk.readonly):
            raise BadInput(f"disk {disk.target}: its source is also disk {other[0]}'s; two "
                           "writers would corrupt it",
                           hint="make both readonly='yes', or give each disk its own source")
    ledger.own_volumes.update((key, (disk.target, disk.readonly)) for key in keys)


def choose_all(host: Host, cfg: Config, vm: VmIntent, disks, ledger: Overlay):
    """Decide every disk in order, each one's claims taken into the
    domain's overlay `ledger`; the first NoFit stops."""
    out = []
    for disk in disks:
        check_volume(ledger, disk, volumes_of(host, disk.source))
        choice = choose(host, cfg, vm, disk, ledger)
        if isinstance(choice, NoFit):
            return choice
        ledger.take_disk(choice.backend, choice.controller, choice.connections)
        out.append(choice)
    return tuple(out)


def choose(host: Host, cfg: Config, vm: VmIntent, disk: DiskIntent, ledger: Overlay) -> DiskChoice | NoFit:
    """One disk's choice; `ledger`: the host's, with what the domain's
    earlier disks claimed (its own_* sets)."""
    _check_combination(disk)
    kind = disk.source.kind
    if kind == "nvmf":
        return _nvmf(host, cfg, disk, ledger)
    if kind in ("file", "block"):
        return _local_volume(host, cfg, disk, ledger)
    return _nvme(host, cfg, vm, disk, ledger)


def _check_combination(disk: DiskIntent) -> None:
    where = f"disk {disk.target}"
    if disk.mode == "passthrough" and disk.backend != "auto":
        raise BadInput(f"{where}: backend='{disk.backend}' applies to vhost disks, "
                       "not to passthrough", hint="drop backend or use mode='vhost'")
    if disk.mode == "vhost" and disk.guest == "spdk":
        raise BadInput(f"{where}: guest='spdk' needs the controller passed through",
                       hint="use mode='passthrough' (or 'auto') or drop guest")


# -- NVMe-oF ------------------------------------------------------------------

def _nvmf(host: Host, cfg: Config, disk: DiskIntent, ledger: Overlay) -> DiskChoice | NoFit:
    src, t = disk.source, disk.target
    if disk.mode == "passthrough":
        return NoFit(f"{t}: an NVMe-oF namespace cannot be passed through (passthrough hands a "
                     "local PCIe controller to the guest); use mode='vhost'")
    if disk.backend == "qsd":
        return NoFit(f"{t}: qemu-storage-daemon has no NVMe-oF initiator; use backend='spdk'")
    other = ledger.volume_conflict(volume_keys(src), disk.readonly)
    if other:
        return NoFit(f"{t}: namespace {src.namespace} of {src.subnqn} at {src.traddr}:{src.trsvcid} "
                     + two_writers(ledger, other))
    hostnqn = host_nqn(cfg, host, src)
    if not hostnqn:
        return NoFit(f"{t}: this host has no NVMe host NQN to attach with (no /etc/nvme/hostnqn, "
                     "no /etc/machine-id), and SPDK's default one changes at every start of SPDK; "
                     "set [nvmf] hostnqn in vstor.conf, or give the disk hostnqn=")
    attach = attach_paths(cfg, src, hostnqn)
    connections, reason = connections_of(src, attach, ledger, ledger.own_connections)
    if reason:
        return NoFit(f"{t}: {reason}")
    reasons = [f"NVMe-oF over {src.transport.upper()}: vhost-user-blk from SPDK "
               "(a remote namespace cannot be passed through)"]
    if src.paths:
        reasons.append(f"{1 + len(src.paths)} paths, attached as one multipath controller")
    node, node_from, why = _nic_node(host, src)
    if why:
        reasons.append(why)
    return DiskChoice(disk, "vhost", "spdk", None, node, node_from, tuple(reasons),
                      connections=connections, attach=attach)


def _nic_node(host: Host, src) -> tuple[int | None, str, str | None]:
    if src.nic:
        nic = host.rdma_nic(src.nic)
        if nic is None:
            known = ", ".join(n.name for n in host.rdma_nics) or "none"
            raise BadInput(f"RDMA NIC '{src.nic}' is not on this host", hint=f"known: {known}")
    elif src.transport == "rdma" and host.rdma_nics:
        nic = sorted(host.rdma_nics, key=lambda n: n.name)[0]
    else:
        return None, "", ("no RDMA NIC named: the NUMA node follows the other disks or the "
                          "freest node" if src.transport == "tcp" else
                          "this host has no RDMA NIC: SPDK cannot reach an RDMA target from it")
    if nic.numa_node < 0:
        return None, f"RDMA NIC {nic.name}", f"firmware gives RDMA NIC {nic.name} no NUMA node"
    return nic.numa_node, f"RDMA NIC {nic.name}", None


# -- files and block devices (qemu-storage-daemon) ----------------------------

def _local_volume(host: Host, cfg: Config, disk: DiskIntent, ledger: Ledger) -> DiskChoice | NoFit:
    src, t = disk.source, disk.target
    if disk.mode == "passthrough":
        return NoFit(f"{t}: a {src.kind} source cannot be passed through; passthrough needs "
                     "<vstor:nvme controller=...>")
    if disk.backend == "spdk":
        return NoFit(f"{t}: vstor serves {src.kind} sources with qemu-storage-daemon; "
                     "use backend='qsd' (or 'auto')")
    if src.kind == "file" and not inside(src.path, cfg.images):
        raise BadInput(f"disk {t}: file source {src.path} is outside the image roots "
                       f"({', '.join(cfg.images) or 'none'})",
                       hint="move it under one of them, or add its directory to [paths] images "
                            "in vstor.conf")
    other = ledger.volume_conflict(volumes_of(host, src), disk.readonly)
    if other:
        return NoFit(f"{t}: {src.path} {two_writers(ledger, other)}")
    reasons = [f"{src.kind} source: vhost-user-blk from qemu-storage-daemon (the embedded backend)"]
    node, node_from = None, ""
    if src.kind == "block":
        found = _block_use(host, src.path, ledger)
        if isinstance(found, NoFit):
            return NoFit(f"{t}: {found.reason}")
        node, node_from, why = found
        if why:
            reasons.append(why)
    return DiskChoice(disk, "vhost", "qsd", None, node, node_from, tuple(reasons))


def _block_use(host: Host, path: str, ledger: Ledger):
    name = path[len("/dev/"):]
    found = namespace_at(host, path)
    if found:
        ctrl, ns = found
        if ns.in_use:
            return NoFit(f"{path} is in use by the host ({'; '.join(ns.in_use)})")
        whole = controller_taken(ledger, ctrl.address)
        if whole:
            return NoFit(f"{path} is a namespace of NVMe controller {ctrl.address}, and {whole}")
        node = ctrl.numa_node if ctrl.numa_node >= 0 else None
        return node, f"NVMe {ctrl.address}", None
    dev = host.block_device(name)
    refused = unservable(path, dev.stacks_on if dev else ())
    if refused:
        raise BadInput(refused[0], hint=refused[1])
    if dev is None:
        # What vstor cannot see it cannot vouch for: refuse, never assume unused.
        raise BadInput(f"{path} is not a disk or partition vstor can see on this host, so it "
                       "cannot tell whether the host uses it",
                       hint="name the kernel device, like /dev/sdb or /dev/nvme0n1p3 "
                            "(not a /dev/mapper or /dev/disk/by-* link)")
    if dev.in_use:
        return NoFit(f"{path} is in use by the host ({'; '.join(dev.in_use)})")
    return None, "", None


# -- local NVMe controllers ---------------------------------------------------

def _nvme(host, cfg, vm, disk, ledger) -> DiskChoice | NoFit:
    src, t = disk.source, disk.target
    ctrl = host.controller(src.controller)
    if ctrl is None:
        known = ", ".join(c.address for c in host.controllers) or "none"
        raise BadInput(f"disk {t}: NVMe controller {src.controller} is not on this host",
                       hint=f"NVMe controllers here: {known}")
    if ctrl.driver == "nvme" and ctrl.namespace(src.namespace) is None:
        have = ", ".join(str(ns.nsid) for ns in ctrl.namespaces) or "none"
        raise BadInput(f"disk {t}: controller {ctrl.address} has no namespace {src.namespace}",
                       hint=f"its namespaces: {have}")
    node = ctrl.numa_node if ctrl.numa_node >= 0 else None
    pt = _passthrough_problems(host, cfg, vm, ctrl, ledger)
    mode, why = _pick_mode(disk, vm, pt)
    if mode is None:
        return NoFit(f"{t}: controller {ctrl.address} cannot be passed through: " + "; ".join(pt))
    reasons = [why]
    if mode == "passthrough":
        if disk.guest == "spdk":
            reasons.append("the guest runs SPDK on it: a vIOMMU with caching mode lets it bind vfio-pci")
        return DiskChoice(disk, mode, "vfio", ctrl.address, node, f"NVMe {ctrl.address}",
                          tuple(reasons), bind=True)
    backend = _pick_backend(host, cfg, disk, ctrl, ledger)
    if isinstance(backend, NoFit):
        return backend
    name, why = backend
    if name == "spdk":
        # SPDK's PCIe driver needs the controller on vfio-pci.  vstor binds it
        # unless the operator (SPDK's setup.sh) put it on a userspace driver;
        # when vstor domains share it, vstor's binding is what holds it there.
        bind = ctrl.driver not in USERSPACE_DRIVERS or bool(ledger.spdk_users.get(ctrl.address))
        return DiskChoice(disk, "vhost", "spdk", ctrl.address, node, f"NVMe {ctrl.address}",
                          (*reasons, why), bind=bind)
    return DiskChoice(disk, "vhost", "qsd", ctrl.address, node, f"NVMe {ctrl.address}",
                      (*reasons, why), device=ctrl.namespace(src.namespace).dev_path)


def _pick_mode(disk, vm, pt_problems) -> tuple[str | None, str]:
    if disk.mode == "passthrough":
        if pt_problems:
            return None, ""
        return "passthrough", "passthrough requested; the whole controller is free"
    if disk.mode == "vhost":
        return "vhost", "vhost requested"
    if vm.migratable:
        return "vhost", "migratable VM: passthrough would block live migration, so vhost"
    if vm.latency == "critical" and not pt_problems:
        return "passthrough", "latency-critical VM and the whole controller is free: passthrough"
    if vm.latency == "critical":
        return "vhost", "passthrough is not possible (" + "; ".join(pt_problems) + "), so vhost"
    return "vhost", "vhost keeps the controller shareable (latency='critical' asks for passthrough)"


def _passthrough_problems(host, cfg, vm, ctrl: NvmeController, ledger) -> list[str]:
    problems = list(check_passthrough(
        ctrl, iommu_enabled=host.iommu_enabled, vfio_available=host.vfio_available,
        pci_allowed=cfg.pci_allowed, pci_blocked=cfg.pci_blocked,
        spdk_owned=bool(ledger.spdk_users.get(ctrl.address)) or ctrl.address in ledger.own_spdk))
    if vm.migratable:
        problems.append("the VM is migratable and a passed-through device blocks live migration")
    owner = ledger.passthrough.get(ctrl.address)
    if owner:
        problems.append(f"it is passed through to domain {held_by(ledger, owner)}")
    users = kernel_users(ctrl, ledger) | ({"this VM"} if ctrl.address in ledger.own_kernel else set())
    if users:
        problems.append("its namespaces are served by qemu-storage-daemon to " + names(ledger, users))
    return problems


def _pick_backend(host, cfg, disk, ctrl, ledger):
    order = {"spdk": ("spdk",), "qsd": ("qsd",),
             "auto": (cfg.default_backend, "qsd" if cfg.default_backend == "spdk" else "spdk")}
    failures = []
    for backend in order[disk.backend]:
        check = _spdk_fit if backend == "spdk" else _qsd_fit
        problem = check(host, cfg, disk, ctrl, ledger)
        if problem is None:
            return backend, _BACKEND_WHY[backend]
        failures.append(f"{backend}: {problem}")
    return NoFit(f"{disk.target}: no vhost backend can serve controller {ctrl.address} ("
                 + "; ".join(failures) + ")")


_BACKEND_WHY = {
    "spdk": "SPDK takes the whole controller (PCIe, polled) and serves the namespace",
    "qsd": "qemu-storage-daemon serves the namespace through the kernel NVMe driver",
}


def _spdk_fit(host, cfg, disk, ctrl, ledger) -> str | None:
    owner = ledger.passthrough.get(ctrl.address)
    if owner or ctrl.address in ledger.own_passthrough:
        return f"the controller is passed through to {held_by(ledger, owner) if owner else 'this VM'}"
    users = kernel_users(ctrl, ledger) | ({"this VM"} if ctrl.address in ledger.own_kernel else set())
    if users:
        return "other namespaces are served through the kernel to " + names(ledger, users)
    # Already on a userspace driver (SPDK's setup.sh did it): vstor binds nothing,
    # so the IOMMU and vfio-pci facts do not matter for it.
    bound = ctrl.driver in USERSPACE_DRIVERS
    problems = check_passthrough(ctrl, iommu_enabled=bound or host.iommu_enabled,
                                 vfio_available=bound or host.vfio_available,
                                 pci_allowed=cfg.pci_allowed, pci_blocked=cfg.pci_blocked,
                                 spdk_owned=False)
    if problems:
        return "SPDK's PCIe driver takes the whole controller from the kernel, but " + "; ".join(problems)
    other = ledger.volume_conflict(volumes_of(host, disk.source), disk.readonly)
    if other:
        return f"namespace {disk.source.namespace} is already served to domain {held_by(ledger, other)}"
    return None


def _qsd_fit(host, cfg, disk, ctrl, ledger) -> str | None:
    if ctrl.driver != "nvme":
        return (f"the controller is on {ctrl.driver or 'no driver'}, not the kernel NVMe "
                "driver, so it has no block device")
    if ctrl.address in ledger.own_spdk:
        return "SPDK serves another namespace of it to this VM"
    whole = controller_taken(ledger, ctrl.address)
    if whole:
        return whole
    ns = ctrl.namespace(disk.source.namespace)
    if ns is None:
        return f"it has no namespace {disk.source.namespace}"
    if ns.in_use:
        return f"{ns.dev_path} is in use by the host ({'; '.join(ns.in_use)})"
    other = ledger.volume_conflict(volumes_of(host, disk.source), disk.readonly)
    if other:
        return f"{ns.dev_path} is already served to domain {held_by(ledger, other)}"
    return None
