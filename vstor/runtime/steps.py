"""Doing, undoing and checking each kind of host change (vstor.runtime.actions).

Every `do` looks before it creates (a re-run after a crash finds its own work
and takes it over); every `undo` copes with a half-done `do`.  `observe`
reads what an undo will need (where a controller was bound) before the
journal records the step: nothing here decides anything.
"""

from __future__ import annotations

import os
import stat

from vstor import records
from vstor.backends import ownership
from vstor.errors import ActionFailed, DoesNotFit, InUse
from vstor.meta.names import nvme_path
from vstor.runtime import actions
from vstor.runtime.actions import NvmfExport, QsdExport, SpdkAttach, SpdkVhost, VfioBind

encode = actions.to_json
decode = actions.from_json
# Kinds whose consecutive steps the journal does (and undoes) side by side:
# one qemu-storage-daemon per disk, each under a lock of its own name.
PARALLEL = frozenset({QsdExport.kind})
# Kinds that change only the domain's own things (names derived from its
# own, on resources the plan already placed): done without the host lock.
# A controller's binding, an SPDK NVMe controller and an NVMe-oF export can
# be shared between domains, so they are done under it.
PRIVATE = frozenset({QsdExport.kind, SpdkVhost.kind})


def preflight(steps: list, rt) -> None:
    """The read-only checks a dry run makes too, so it never says yes to a
    start that would be refused: a file source that resolves outside the
    image roots, a source that is missing or of the wrong kind; and no two
    of the steps writing one file or device, however it is named (a
    symlink, a second path): their daemons start side by side, so neither's
    look for another writer sees the other (the planner refuses the same
    path written twice)."""
    from vstor.host import sources
    seen: dict[tuple, QsdExport] = {}
    for a in steps:
        if not isinstance(a, QsdExport):
            continue
        if a.export.kind == "block" and rt.sysfs.root != "/":
            continue        # a block device is the host's, and an offline --host-root has none
        with sources.open_source(a.export.kind, a.export.source, rt.cfg.images,
                                 sources.sysfs_kernel_name(rt.sysfs)) as src:
            st = src.st
        key = ("dev", st.st_rdev) if stat.S_ISBLK(st.st_mode) else ("file", st.st_dev, st.st_ino)
        other = seen.get(key)
        if other is not None and not (other.export.readonly and a.export.readonly):
            raise DoesNotFit(f"{a.export.name} and {other.export.name} are one "
                             f"{'device' if key[0] == 'dev' else 'file'} ({a.export.source} and "
                             f"{other.export.source}): two writers would corrupt it",
                             hint="give each disk its own source, or make both readonly='yes'")
        seen[key] = a


def observe(a, rt, others):
    """The action with the host facts its undo needs, read now (no writes).
    A controller another domain's record already moved keeps that record's
    original: where it was before vstor, not vfio-pci (whichever domain
    releases last puts it back)."""
    if isinstance(a, VfioBind) and a.original is None:
        theirs = _others_step(others, a, finished_only=False)
        if theirs is not None and "peers" in theirs["data"]:
            return actions.with_original(a, actions.from_json(theirs).original)
        from vstor.backends import vfio
        return actions.with_original(a, vfio.plan_bind(rt.sysfs, a.address))
    if isinstance(a, SpdkAttach) and _others_step(others, a, finished_only=False) is None:
        every = rt.spdk().get_nvme_controllers()
        _refuse_taken_paths(a, every)
        return records.replace(a, found=any(c.get("name") == a.name for c in every))
    if isinstance(a, QsdExport) and a.export.kind == "file":
        return QsdExport(records.replace(a.export, source=resolve_image(a.export.source, rt.cfg.images)))
    return a


def resolve_image(path: str, roots) -> str:
    """The file a file source is now, symlinks followed one by one below
    an image root (vstor.host.sources): what the record names.  The daemon
    is given the file start() opens itself, never this name."""
    from vstor.host import sources
    with sources.open_file(path, roots) as src:
        return src.resolved


def _qsd_policy(rt) -> dict:
    """What a qemu-storage-daemon's source may be: below the image roots, or
    the block device this host's sysfs names as the path does."""
    from vstor.host import sources
    return {"roots": rt.cfg.images, "kernel_name": sources.sysfs_kernel_name(rt.sysfs)}


def do(a, rt) -> None:
    if isinstance(a, VfioBind):
        from vstor.backends import vfio
        vfio.bind_to_vfio(rt.sysfs, a.original or a.address)
    elif isinstance(a, SpdkAttach):
        _spdk_attach(a, rt)
    elif isinstance(a, SpdkVhost):
        _spdk_vhost(a, rt)
    elif isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.start(_on_this_machine(a.export, rt), handover=rt.handover, **_qsd_policy(rt))
    elif isinstance(a, NvmfExport):
        _nvmf_export(a, rt)
    else:
        raise ActionFailed(f"vstor cannot do a {a.kind} step")


def undo(a, rt, others) -> None:
    """`others`: what the other domains hold (vstor.runtime.holders): a
    shared thing stays while one uses it."""
    if isinstance(a, VfioBind):
        if _shared(others, a):
            return      # another domain's SPDK still needs it on vfio-pci
        from vstor.backends import vfio
        if a.original is not None:
            vfio.restore_driver(rt.sysfs, a.original)
    elif isinstance(a, SpdkAttach):
        if a.found or _shared(others, a):
            return
        spdk = rt.spdk()
        if spdk.get_nvme_controllers(a.name):
            spdk.detach_nvme_controller(a.name)
    elif isinstance(a, SpdkVhost):
        spdk = rt.spdk()
        sessions = spdk.vhost_sessions(a.ctrlr)
        if sessions is None:
            return
        if sessions and not rt.force:
            # SPDK would retry the deletion until QEMU lets go, logging a line
            # per retry: never sent while QEMU is connected, unless forced.
            raise InUse(f"QEMU is still connected to SPDK vhost controller {a.ctrlr}",
                               hint="stop the domain first")
        spdk.vhost_delete_controller(a.ctrlr, wait=rt.cfg.spdk_timeout)
    elif isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.stop(a.export)
    elif isinstance(a, NvmfExport):
        spdk = rt.spdk()
        found = spdk.nvmf_get_subsystems(a.nqn)
        if found and found[0].get("serial_number") == _serial(a.nqn):    # vstor's, not one refused
            spdk.nvmf_delete_subsystem(a.nqn)     # its namespace, listener and host go with it


def in_use(a, rt) -> str | None:
    """Why undoing `a` now would take something from a running QEMU, or None."""
    if isinstance(a, SpdkVhost) and rt.spdk().vhost_sessions(a.ctrlr):
        return f"QEMU is connected to SPDK vhost controller {a.ctrlr}"
    if isinstance(a, QsdExport):
        from vstor.backends.qsd import proc
        if proc.unix_peers(a.export.socket_path):
            return f"a client (QEMU) is connected to {a.export.socket_path}"
    return None


def check(a, rt) -> str | None:
    """None when what the step made still exists and works, else why not."""
    if isinstance(a, VfioBind):
        driver = rt.sysfs.link_name(f"/sys/bus/pci/devices/{a.address}/driver")
        return None if driver == "vfio-pci" else f"{a.address} is on {driver or 'no driver'}"
    if isinstance(a, SpdkAttach):
        found = rt.spdk().get_nvme_controllers(a.name)
        if not found:
            return f"SPDK has no NVMe controller {a.name}"
        missing, foreign = _path_difference(a, found)
        if foreign:
            return f"SPDK's NVMe controller {a.name} has a path the plan does not: {foreign[0]}"
        if missing:
            p = missing[0]
            return f"SPDK's NVMe controller {a.name} lost its path {nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, None)}"
        return None
    if isinstance(a, SpdkVhost):
        if not rt.spdk().vhost_get_controllers(a.ctrlr):
            return f"SPDK has no vhost controller {a.ctrlr}"
        return None if os.path.exists(a.socket) else f"socket {a.socket} is missing"
    if isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        return None if daemon.alive(a.export) else "qemu-storage-daemon is not running"
    if isinstance(a, NvmfExport):
        found = rt.spdk().nvmf_get_subsystems(a.nqn)
        return None if found else f"SPDK has no NVMe-oF subsystem {a.nqn}"
    return None


def _on_this_machine(export, rt):
    """The export's CPUs are the planned host's; when vstor reads another
    host's tree (VSTOR_HOST_ROOT: a capture, a test layout) they need not
    exist here, and the daemon is not pinned."""
    return export if rt.sysfs.root == "/" or not export.cpus else records.replace(export, cpus=())


def repair(a, rt) -> None:
    """Bring back what check() found missing."""
    if isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.restart_if_dead(_on_this_machine(a.export, rt), **_qsd_policy(rt))
    else:
        do(a, rt)


def _spdk_attach(a: SpdkAttach, rt) -> None:
    """Attach every path, or add the ones a controller of that name lacks (an
    interrupted run, a path SPDK dropped).  A controller of that name with a
    path the plan does not have is not the connection the name stands for:
    refused, never merged."""
    spdk = rt.spdk()
    found = spdk.get_nvme_controllers(a.name)
    missing, foreign = _path_difference(a, found) if found else (a.paths, [])
    if foreign:
        raise ActionFailed(f"SPDK's NVMe controller {a.name} has a path the plan does not: "
                           f"{foreign[0]}", hint=f"detach it (rpc.py bdev_nvme_detach_controller "
                                                 f"{a.name}) if nothing uses it")
    for path in missing:
        spdk.attach_nvme_controller(**path.params(a.name))


def _refuse_taken_paths(a: SpdkAttach, controllers: list[dict]) -> None:
    """SPDK keeps one controller per path (transport ID and host NQN): a path
    another controller already has cannot be attached under this name, and
    sharing that controller would give the disk another connection's
    settings.  Refused before anything changes."""
    for ctrl in controllers:
        if ctrl.get("name") == a.name:
            continue
        for theirs, host in _paths_of(ctrl):
            for p in a.paths:
                if (nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn) == theirs
                        and (p.trtype == "PCIe" or not (p.hostnqn and host) or p.hostnqn == host)):
                    raise DoesNotFit(
                        f"SPDK's NVMe controller {ctrl.get('name')} already has the path "
                        f"{nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, host)} that {a.name} "
                        "needs, and SPDK keeps one controller per path and host NQN",
                        hint="give the disk the same paths and reconnect settings as the disks "
                             "using it, or another hostnqn; or detach it (rpc.py "
                             f"bdev_nvme_detach_controller {ctrl.get('name')}) if nothing uses it")


def _paths_of(ctrl: dict) -> list[tuple[str, str | None]]:
    """(path, host NQN) of each path of one bdev_nvme_get_controllers entry
    (a failover controller lists its other paths as alternate_trids)."""
    out = []
    for c in ctrl.get("ctrlrs", ()):
        host = (c.get("host") or {}).get("nqn")
        for t in [c.get("trid") or {}, *c.get("alternate_trids", ())]:
            out.append((nvme_path(t.get("trtype"), t.get("traddr"), t.get("trsvcid"), t.get("subnqn")), host))
    return out


def _path_difference(a: SpdkAttach, found: list[dict]):
    """(paths of the plan SPDK lacks, paths SPDK has that the plan does not),
    from bdev_nvme_get_controllers: each path's trid and host NQN."""
    have = {key: host for ctrl in found for key, host in _paths_of(ctrl)}
    missing, mine = [], set()
    for p in a.paths:
        key = nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, None)
        mine.add(key)
        if key not in have:
            missing.append(p)
        elif p.hostnqn and have[key] and have[key] != p.hostnqn:
            return [], [nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, have[key])]
    return missing, [k for k in have if k not in mine]


def _spdk_vhost(a: SpdkVhost, rt) -> None:
    spdk = rt.spdk()
    existing = spdk.vhost_get_controllers(a.ctrlr)
    if existing:
        bdev = (existing[0].get("backend_specific", {}).get("block", {}) or {}).get("bdev")
        if bdev != a.bdev:
            # bdev None: SPDK hot-removed it (its NVMe controller was detached),
            # and every I/O through this controller now fails.
            raise ActionFailed(f"SPDK vhost controller {a.ctrlr} exists but serves "
                               f"{bdev or 'a removed bdev'}, not {a.bdev}",
                               hint=f"delete it: vstor release, or rpc.py vhost_delete_controller {a.ctrlr}")
    else:
        # SPDK makes the socket in its -S directory; QEMU must be able to reach
        # into it (the directory is shared by every domain and kept).
        ownership.ensure_dir(os.path.dirname(a.socket), a.group)
        spdk.vhost_create_blk_controller(ctrlr=a.ctrlr, dev_name=a.bdev, cpumask=a.cpumask,
                                         readonly=a.readonly or None)
    if not os.path.lexists(a.socket):
        where = os.path.dirname(a.socket)
        raise ActionFailed(f"SPDK made vhost controller {a.ctrlr} but no socket {a.socket}: its -S "
                           f"directory is not [paths] vhost_dir {where}",
                           hint=f"start SPDK's vhost app with -S {where}, or set [paths] vhost_dir "
                                f"in {rt.cfg.file} to SPDK's")
    ownership.restrict_socket(a.socket, a.group)


def _nvmf_export(a: NvmfExport, rt) -> None:
    """Look, then make what is missing: a re-run after a crash finds its own
    subsystem; one of that name serving another bdev is not vstor's export."""
    spdk = rt.spdk()
    try:
        spdk.nvmf_create_transport(a.trtype)
    except Exception as e:      # SPDK keeps one transport per type: "already exists"
        if "already exists" not in str(e):
            raise
    found = spdk.nvmf_get_subsystems(a.nqn)
    if not found:
        spdk.nvmf_create_subsystem(a.nqn, serial_number=_serial(a.nqn),
                                   model_number="vstor migration export", allow_any_host=False)
        found = spdk.nvmf_get_subsystems(a.nqn)
    sub = found[0] if found else {}
    namespaces = {ns.get("bdev_name") for ns in sub.get("namespaces", ())}
    if namespaces - {a.bdev}:
        raise ActionFailed(f"SPDK's NVMe-oF subsystem {a.nqn} serves {', '.join(sorted(namespaces))}, "
                           f"not {a.bdev}", hint=f"rpc.py nvmf_delete_subsystem {a.nqn} if nothing uses it")
    admitted = {h.get("nqn") for h in sub.get("hosts", ())} - {a.host}
    if sub.get("allow_any_host") or admitted:
        # Only the migration's own host NQN: any other admitted could reach the disk.
        raise ActionFailed(f"SPDK's NVMe-oF subsystem {a.nqn} admits "
                           f"{'any host' if sub.get('allow_any_host') else ', '.join(sorted(admitted))}, "
                           f"not only {a.host}", hint=f"rpc.py nvmf_delete_subsystem {a.nqn} if nothing uses it")
    if not namespaces:
        spdk.nvmf_subsystem_add_ns(a.nqn, a.bdev, nsid=1)
    if not any(la.get("traddr") == a.traddr and str(la.get("trsvcid")) == str(a.trsvcid)
               for la in sub.get("listen_addresses", ())):
        spdk.nvmf_subsystem_add_listener(a.nqn, a.trtype, a.traddr, str(a.trsvcid), adrfam=a.adrfam)
    if a.host not in {h.get("nqn") for h in sub.get("hosts", ())}:
        spdk.nvmf_subsystem_add_host(a.nqn, a.host)


def _serial(nqn: str) -> str:
    import hashlib      # NVMe: 20 ASCII; tells vstor's export from another's
    return "VS" + hashlib.sha256(nqn.encode()).hexdigest()[:18].upper()


def _shared(others, a) -> bool:
    """Does another domain's record hold a finished step on the same thing?"""
    return _others_step(others, a, finished_only=True) is not None


def _others_step(others, a, finished_only: bool) -> dict | None:
    """Another domain's journal entry of the same kind on the same thing
    (controller name or PCI address), if there is one (vstor.runtime.holders)."""
    return others.step(a.kind, actions.identity(a)[1], finished_only)
