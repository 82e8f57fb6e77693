"""What SPDK is told for a disk (bdev_nvme_attach_controller's parameters,
one call per path), and how remote controllers are shared: SPDK keeps one
controller per path and host NQN, so two disks share one exactly when every
attach parameter of every path matches, and a disk whose path another
controller of other settings already has cannot start.  Pure."""

from __future__ import annotations

from vstor.config import Config
from vstor.meta.intent import Reconnect
from vstor.meta.names import nvme_path, spdk_controller_name
from vstor.meta.plan import AttachPath
from vstor.planner.ledger import Ledger


def host_nqn(cfg: Config, host, src) -> str | None:
    """The host NQN a remote disk attaches with: the disk's, [nvmf] hostnqn,
    or the host's own (host.read.read_hostnqn).  Always one, never SPDK's
    default: SPDK makes that from a random UUID at every start of its app,
    so no target could be told to allow it and vstor could not know it."""
    return src.hostnqn or cfg.hostnqn or host.hostnqn


def attach_paths(cfg: Config, src, hostnqn: str | None = None) -> tuple[AttachPath, ...]:
    """bdev_nvme_attach_controller parameters, one call per path; `hostnqn`
    (host_nqn's) for a remote one: None only for a plan recorded before
    vstor always sent one (fit re-derives it as it was)."""
    if src.kind == "nvme":
        return (AttachPath(trtype="PCIe", traddr=src.controller),)
    r = src.reconnect or Reconnect()
    common = dict(trtype=src.transport.upper(), adrfam={"ipv4": "IPv4", "ipv6": "IPv6"}[src.adrfam],
                  subnqn=src.subnqn, hostnqn=hostnqn,
                  multipath="multipath" if src.paths else None,
                  ctrlr_loss_timeout_sec=_pick(r.ctrlr_loss_timeout, cfg.ctrlr_loss_timeout_sec),
                  reconnect_delay_sec=_pick(r.reconnect_delay, cfg.reconnect_delay_sec),
                  fast_io_fail_timeout_sec=_pick(r.fast_io_fail_timeout, cfg.fast_io_fail_timeout_sec))
    paths = [(src.traddr, src.trsvcid), *((p.traddr, p.trsvcid) for p in src.paths)]
    return tuple(AttachPath(traddr=addr, trsvcid=port, **common) for addr, port in paths)


def _pick(value, default):
    return default if value is None else value


def connections_of(src, attach: tuple[AttachPath, ...], ledger: Ledger, mine: dict[str, str]):
    """((path, controller) for each path of a remote disk attached with
    `attach`, why it cannot have them or None).  `mine`: the paths this
    domain's earlier disks took."""
    name = spdk_controller_name(src, attach)
    connections = tuple((nvme_path(p.trtype, p.traddr, p.trsvcid, p.subnqn, p.hostnqn), name)
                        for p in attach)
    for path, _ in connections:
        other = ledger.path_conflict(path, name)
        who = f"domain '{other}'" if other else None
        if mine.get(path, name) != name:
            who = "another disk of this domain"
        if who:
            return connections, (f"SPDK keeps one NVMe-oF controller per path and host NQN, and {who} "
                                 f"reaches {path} with other paths, multipath or reconnect settings; "
                                 "give both disks the same <vstor:nvmf> paths and reconnect settings "
                                 "(they then share one controller), or another hostnqn")
    return connections, None
