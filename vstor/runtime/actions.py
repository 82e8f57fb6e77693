"""From a plan to the host changes that carry it out: typed, pure records.

`build(plan, cfg)` is a function of the plan and the config alone: it reads
nothing and decides nothing (every decision is in the plan).  Each step is
an instance of its kind's class (vstor.runtime.kinds), which knows its
record, its dry run and how it is done and undone, given the host
operations; on disk (the journal) it is JSON through `to_json`/`from_json`,
in the same shapes earlier vstor versions wrote.
"""

from __future__ import annotations

from vstor.backends.qsd.export import QsdExport as QsdSpec
from vstor.runtime.kinds import KINDS, Step, from_json, identity, to_json
from vstor.runtime.kinds.gate import Gate
from vstor.runtime.kinds.nvmf_export import NvmfExport
from vstor.runtime.kinds.qsd_export import QsdExport
from vstor.runtime.kinds.spdk_attach import SpdkAttach
from vstor.runtime.kinds.spdk_vhost import SpdkVhost
from vstor.runtime.kinds.vfio_bind import VfioBind

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing (every hook imports this)
if TYPE_CHECKING:   # the plan's declarations (lxml) only where a plan is read
    from vstor.config import Config
    from vstor.meta.plan import Plan

Action = Step
__all__ = ["KINDS", "Action", "Gate", "NvmfExport", "QsdExport", "SpdkAttach", "SpdkVhost", "VfioBind",
           "build", "from_json", "identity", "to_json"]


def build(plan: Plan, cfg: Config, gate: str | None = None) -> list[Step]:
    """The host changes, in order, that carry out `plan`; with `gate`, last,
    the prepared mark there (vstor.runtime.kinds.gate)."""
    out: list[Step] = []
    bound: set[str] = set()
    attached: set[str] = set()
    for disk in plan.disks:
        if disk.bind and disk.controller not in bound:
            out.append(VfioBind(disk.controller))
            bound.add(disk.controller)
        if disk.backend == "spdk":
            if disk.spdk_controller not in attached:
                out.append(SpdkAttach(disk.spdk_controller, disk.attach))
                attached.add(disk.spdk_controller)
            out.append(SpdkVhost(disk.vhost_name, disk.bdev, disk.reactor, disk.readonly,
                                 disk.socket, cfg.qemu_group))
        elif disk.backend == "qsd":
            src = disk.source
            kind, path = ("block", disk.device) if src.kind == "nvme" else (src.kind, src.path)
            out.append(QsdExport(QsdSpec(
                run_dir=cfg.qsd_dir, name=disk.vhost_name, source=path, kind=kind,
                socket_path=disk.socket, readonly=disk.readonly, queues=disk.queues,
                qemu_user=cfg.qemu_user, qemu_group=cfg.qemu_group,
                cpus=tuple(plan.disk_cell(disk).emulator),     # its cell's node's
                users=cfg.daemon_users if cfg.confine else None)))
    if gate:
        out.append(Gate(gate, plan.domain, cfg.qemu_group))
    return out
