"""The host changes vstor makes, one Step each (see vstor.journal).

Every `do` looks before it creates (a re-run after a crash finds its own work
and takes it over); every `undo` copes with a half-done `do`.
"""

from __future__ import annotations

import contextlib
import grp
import os

from vstor.errors import ActionFailed
from vstor.runtime.journal import Step, register


@register
class VfioBind(Step):
    """A controller on vfio-pci: for passthrough, or for SPDK's PCIe driver.
    data: the vfio BindRecord (address, original driver and driver_override),
    taken before the first write so undo knows where to return it."""
    kind = "vfio-bind"

    @classmethod
    def planned(cls, rt, address: str) -> "VfioBind":
        from vstor.backends import vfio
        return cls(vfio.record_to_json(vfio.plan_bind(rt.sysfs, address)))

    def describe(self) -> str:
        return f"bind {self.data['address']} to vfio-pci"

    def do(self, rt) -> None:
        from vstor.backends import vfio
        vfio.bind_to_vfio(rt.sysfs, vfio.record_from_json(self.data))

    def undo(self, rt) -> None:
        from vstor.backends import vfio
        if any(_shares(r, self) for r in rt.other_records()):
            return      # another running domain's SPDK still needs it on vfio-pci
        vfio.restore_driver(rt.sysfs, vfio.record_from_json(self.data))

    def check(self, rt) -> str | None:
        driver = rt.sysfs.link_name(f"/sys/bus/pci/devices/{self.data['address']}/driver")
        return None if driver == "vfio-pci" else f"{self.data['address']} is on {driver or 'no driver'}"


@register
class SpdkAttach(Step):
    """An SPDK bdev_nvme controller (local PCIe, or NVMe-oF with every path).
    Shared: the last vstor domain using it detaches it.
    data: name, paths (list of attach params), owned (whether vstor attached it)."""
    kind = "spdk-attach"

    def describe(self) -> str:
        return f"attach SPDK NVMe controller {self.data['name']}"

    def do(self, rt) -> None:
        spdk = rt.spdk()
        name = self.data["name"]
        if spdk.get_nvme_controllers(name):
            return      # attached already (another domain, or an interrupted run)
        for params in self.data["paths"]:
            spdk.attach_nvme_controller(**params)

    def undo(self, rt) -> None:
        if any(_shares(r, self) for r in rt.other_records()):
            return
        spdk = rt.spdk()
        if spdk.get_nvme_controllers(self.data["name"]):
            spdk.detach_nvme_controller(self.data["name"])

    def check(self, rt) -> str | None:
        if rt.spdk().get_nvme_controllers(self.data["name"]):
            return None
        return f"SPDK has no NVMe controller {self.data['name']}"


@register
class SpdkVhost(Step):
    """An SPDK vhost-blk controller serving one bdev on the planned reactor,
    its socket handed to the QEMU group only.
    data: ctrlr, bdev, cpumask, readonly, socket, group."""
    kind = "spdk-vhost"

    def describe(self) -> str:
        return f"create SPDK vhost controller {self.data['ctrlr']} for bdev {self.data['bdev']}"

    def do(self, rt) -> None:
        spdk = rt.spdk()
        d = self.data
        existing = spdk.vhost_get_controllers(d["ctrlr"])
        if existing:
            bdev = (existing[0].get("backend_specific", {}).get("block", {}) or {}).get("bdev")
            if bdev != d["bdev"]:
                # bdev None: SPDK hot-removed it (its NVMe controller was detached),
                # and every I/O through this controller now fails.
                raise ActionFailed(f"SPDK vhost controller {d['ctrlr']} exists but serves "
                                   f"{bdev or 'a removed bdev'}, not {d['bdev']}",
                                   hint=f"delete it: vstor release, or rpc.py vhost_delete_controller {d['ctrlr']}")
        else:
            spdk.vhost_create_blk_controller(ctrlr=d["ctrlr"], dev_name=d["bdev"],
                                             cpumask=d["cpumask"], readonly=d["readonly"] or None)
        if not rt.dry_run:
            restrict_socket(d["socket"], d["group"])

    def undo(self, rt) -> None:
        spdk = rt.spdk()
        if spdk.vhost_get_controllers(self.data["ctrlr"]):
            spdk.vhost_delete_controller(self.data["ctrlr"])

    def check(self, rt) -> str | None:
        if not rt.spdk().vhost_get_controllers(self.data["ctrlr"]):
            return f"SPDK has no vhost controller {self.data['ctrlr']}"
        if not os.path.exists(self.data["socket"]):
            return f"socket {self.data['socket']} is missing"
        return None


@register
class QsdExport(Step):
    """A qemu-storage-daemon exporting one file or block device as
    vhost-user-blk.  data: the daemon's own record (vstor.qsd)."""
    kind = "qsd-export"

    def _export(self, rt):
        from vstor.backends.qsd import QsdExport as Export
        return Export.from_record(self.data)

    def describe(self) -> str:
        return f"start qemu-storage-daemon for {self.data.get('source')} on {self.data.get('socket_path')}"

    def do(self, rt) -> None:
        if rt.dry_run:
            return
        self._export(rt).start()

    def undo(self, rt) -> None:
        if rt.dry_run:
            return
        self._export(rt).stop()

    def check(self, rt) -> str | None:
        return None if self._export(rt).alive() else "qemu-storage-daemon is not running"

    def repair(self, rt) -> None:
        self._export(rt).restart_if_dead()


def _shares(rec, step: Step) -> bool:
    """Does another domain's record hold a finished step on the same thing?"""
    key = "name" if step.kind == "spdk-attach" else "address"
    return any(e["kind"] == step.kind and e["state"] == "done"
               and e["data"].get(key) == step.data.get(key) for e in rec.steps)


def restrict_socket(path: str, group: str) -> None:
    """The QEMU user's group may connect, nobody else: root:<group> 0660.
    SPDK creates its sockets root-owned 0755, which QEMU (libvirt-qemu) cannot use."""
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ActionFailed(f"group '{group}' does not exist",
                           hint="set [qemu] group in vstor.conf to the group QEMU runs as") from None
    try:
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
    except OSError as e:
        raise ActionFailed(f"cannot restrict socket {path}: {e.strerror}") from None


def ensure_socket_dir(path: str, group: str) -> None:
    """root:<group> 0750: QEMU can reach sockets inside, other users cannot."""
    os.makedirs(path, mode=0o750, exist_ok=True)
    with contextlib.suppress(KeyError):
        os.chown(path, 0, grp.getgrnam(group).gr_gid)
    os.chmod(path, 0o750)
