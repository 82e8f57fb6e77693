"""Doing, undoing and checking each kind of host change (vstor.runtime.actions).

Every `do` looks before it creates (a re-run after a crash finds its own work
and takes it over); every `undo` copes with a half-done `do`.  `observe`
reads what an undo will need (where a controller was bound) before the
journal records the step: nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
import os

from vstor.backends import ownership
from vstor.errors import ActionFailed, BadInput
from vstor.meta.names import inside
from vstor.runtime import actions
from vstor.runtime.actions import QsdExport, SpdkAttach, SpdkVhost, VfioBind

encode = actions.to_json
decode = actions.from_json


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
    if isinstance(a, QsdExport) and a.export.kind == "file":
        return QsdExport(dataclasses.replace(a.export, source=resolve_image(a.export.source, rt.cfg.images)))
    return a


def resolve_image(path: str, roots) -> str:
    """The file a file source really is, symlinks followed, which must lie
    inside an image root (resolved the same way): root's own daemon never
    opens a host file a domain's author pointed at."""
    real = os.path.realpath(path)
    if not inside(real, [os.path.realpath(r) for r in roots]):
        raise BadInput(f"file source {path} resolves to {real}, outside the image roots "
                       f"({', '.join(roots) or 'none'})",
                       hint="move it under one of them, or add its directory to [paths] images")
    return real


def do(a, rt) -> None:
    if isinstance(a, VfioBind):
        from vstor.backends import vfio
        vfio.bind_to_vfio(rt.sysfs, a.original or a.address)
    elif isinstance(a, SpdkAttach):
        spdk = rt.spdk()
        if spdk.get_nvme_controllers(a.name):
            return      # attached already (another domain, or an interrupted run)
        for path in a.paths:
            spdk.attach_nvme_controller(**path.params(a.name))
    elif isinstance(a, SpdkVhost):
        _spdk_vhost(a, rt)
    elif isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.start(a.export)
    else:
        raise ActionFailed(f"vstor cannot do a {a.kind} step")


def undo(a, rt, others) -> None:
    """`others`: the other domains' records (a shared thing stays while one uses it)."""
    if isinstance(a, VfioBind):
        if _shared(others, a):
            return      # another domain's SPDK still needs it on vfio-pci
        from vstor.backends import vfio
        if a.original is not None:
            vfio.restore_driver(rt.sysfs, a.original)
    elif isinstance(a, SpdkAttach):
        if _shared(others, a):
            return
        spdk = rt.spdk()
        if spdk.get_nvme_controllers(a.name):
            spdk.detach_nvme_controller(a.name)
    elif isinstance(a, SpdkVhost):
        spdk = rt.spdk()
        if spdk.vhost_get_controllers(a.ctrlr):
            spdk.vhost_delete_controller(a.ctrlr)
    elif isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.stop(a.export)


def check(a, rt) -> str | None:
    """None when what the step made still exists and works, else why not."""
    if isinstance(a, VfioBind):
        driver = rt.sysfs.link_name(f"/sys/bus/pci/devices/{a.address}/driver")
        return None if driver == "vfio-pci" else f"{a.address} is on {driver or 'no driver'}"
    if isinstance(a, SpdkAttach):
        return None if rt.spdk().get_nvme_controllers(a.name) else \
            f"SPDK has no NVMe controller {a.name}"
    if isinstance(a, SpdkVhost):
        if not rt.spdk().vhost_get_controllers(a.ctrlr):
            return f"SPDK has no vhost controller {a.ctrlr}"
        return None if os.path.exists(a.socket) else f"socket {a.socket} is missing"
    if isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        return None if daemon.alive(a.export) else "qemu-storage-daemon is not running"
    return None


def repair(a, rt) -> None:
    """Bring back what check() found missing."""
    if isinstance(a, QsdExport):
        from vstor.backends.qsd import daemon
        daemon.restart_if_dead(a.export)
    else:
        do(a, rt)


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
    ownership.restrict_socket(a.socket, a.group)


def _shared(others, a) -> bool:
    """Does another domain's record hold a finished step on the same thing?"""
    return _others_step(others, a, finished_only=True) is not None


def _others_step(others, a, finished_only: bool) -> dict | None:
    """Another domain's journal entry of the same kind on the same thing
    (controller name or PCI address), if there is one."""
    key = "name" if a.kind == "spdk-attach" else "address"
    mine = a.to_data().get(key)
    for rec in others:
        for e in rec.steps:
            if (e["kind"] == a.kind and e["data"].get(key) == mine
                    and (e["state"] == "done" or not finished_only)):
                return e
    return None
