"""spdk-vhost: an SPDK vhost-blk controller serving one bdev to one
domain's QEMU, its socket handed to the QEMU group only."""

from __future__ import annotations

import os

from vstor.errors import ActionFailed, InUse
from vstor.records import record
from vstor.runtime.kinds.base import Kind, rpc_line


@record
class SpdkVhost(Kind):
    """A vhost-blk controller `ctrlr` serving `bdev` on one reactor core."""
    ctrlr: str
    bdev: str
    reactor: int
    readonly: bool
    socket: str
    group: str
    kind = "spdk-vhost"
    # The domain's own controller, on a reactor the plan already placed.
    private = True
    rpc_methods = ("vhost_create_blk_controller", "vhost_get_controllers", "vhost_delete_controller")

    @property
    def cpumask(self) -> str:
        return hex(1 << self.reactor)

    def describe(self) -> str:
        return f"create SPDK vhost controller {self.ctrlr} for bdev {self.bdev}"

    def dry_run(self) -> list[str]:
        params = {"ctrlr": self.ctrlr, "dev_name": self.bdev, "cpumask": self.cpumask}
        if self.readonly:
            params["readonly"] = True
        return [f"install -d -o root -g {self.group} -m 0750 {os.path.dirname(self.socket)}",
                rpc_line("vhost_create_blk_controller", params),
                f"chown root:{self.group} {self.socket}", f"chmod 0660 {self.socket}"]

    def to_data(self) -> dict:
        return {"ctrlr": self.ctrlr, "bdev": self.bdev, "cpumask": self.cpumask,
                "readonly": self.readonly, "socket": self.socket, "group": self.group}

    @classmethod
    def from_data(cls, d: dict) -> "SpdkVhost":
        mask = int(d["cpumask"], 16)
        if mask <= 0 or mask & (mask - 1):
            raise ActionFailed(f"state record: SPDK cpumask {d['cpumask']!r} is not one core")
        return cls(d["ctrlr"], d["bdev"], mask.bit_length() - 1, bool(d["readonly"]),
                   d["socket"], d["group"])

    def makes(self) -> str:
        return self.ctrlr

    # preflight: the default (SPDK is asked once the start is decided (rpc_methods))

    # observe: the default (its undo needs nothing read before)

    def do(self, rt) -> None:
        spdk = rt.spdk
        existing = spdk.vhost_get_controllers(self.ctrlr)
        if existing:
            bdev = (existing[0].get("backend_specific", {}).get("block", {}) or {}).get("bdev")
            if bdev != self.bdev:
                # bdev None: SPDK hot-removed it (its NVMe controller was detached),
                # and every I/O through this controller now fails.
                raise ActionFailed(f"SPDK vhost controller {self.ctrlr} exists but serves "
                                   f"{bdev or 'a removed bdev'}, not {self.bdev}",
                                   hint=f"delete it: vstor release, or rpc.py vhost_delete_controller {self.ctrlr}")
        else:
            # SPDK makes the socket in its -S directory; QEMU must be able to reach
            # into it (the directory is shared by every domain and kept).
            rt.ownership.ensure_dir(os.path.dirname(self.socket), self.group)
            spdk.vhost_create_blk_controller(ctrlr=self.ctrlr, dev_name=self.bdev, cpumask=self.cpumask,
                                             readonly=self.readonly or None)
        if not os.path.lexists(self.socket):
            where = os.path.dirname(self.socket)
            raise ActionFailed(f"SPDK made vhost controller {self.ctrlr} but no socket {self.socket}: its -S "
                               f"directory is not [paths] vhost_dir {where}",
                               hint=f"start SPDK's vhost app with -S {where}, or set [paths] vhost_dir "
                                    f"in {rt.cfg.file} to SPDK's")
        rt.ownership.restrict_socket(self.socket, self.group)

    def undo(self, rt, others) -> None:
        spdk = rt.spdk
        sessions = spdk.vhost_sessions(self.ctrlr)
        if sessions is None:
            return
        if sessions and not rt.force:
            # SPDK would retry the deletion until QEMU lets go, logging a line
            # per retry: never sent while QEMU is connected, unless forced.
            raise InUse(f"QEMU is still connected to SPDK vhost controller {self.ctrlr}",
                        hint="stop the domain first")
        spdk.vhost_delete_controller(self.ctrlr, wait=rt.cfg.spdk_timeout)

    # undo_waits: the default (RPCs: nothing to wait for beside the others)

    def in_use(self, rt) -> str | None:
        if rt.spdk.vhost_sessions(self.ctrlr):
            return f"QEMU is connected to SPDK vhost controller {self.ctrlr}"
        return None

    def check(self, rt) -> str | None:
        if not rt.spdk.vhost_get_controllers(self.ctrlr):
            return f"SPDK has no vhost controller {self.ctrlr}"
        return None if os.path.exists(self.socket) else f"socket {self.socket} is missing"

    def repair(self, rt) -> None:
        self.do(rt)
