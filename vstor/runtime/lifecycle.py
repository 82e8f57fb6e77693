"""A domain's host side over its life: prepare before QEMU starts, release
after it stops, reconnect when libvirtd restarts, gc for what nobody runs.

Everything happens under the state directory's lock, so two domains being
prepared at once never get the same core, socket or controller.
"""

from __future__ import annotations

from typing import Callable

from vstor.config import Config
from vstor.meta.document import Domain
from vstor.errors import ActionFailed, BadInput, DoesNotFit
from vstor.runtime.inventory import recorded_plan
from vstor.runtime.journal import DONE, Journal, Step, step_from_json
from vstor.planner.ledger import Holding, Ledger, holding_from_json, holding_to_json
from vstor.host.model import Host
from vstor.meta.plan import Plan
from vstor.runtime.state import PREPARED, Record, StateDir
from vstor.runtime.steps import QsdExport, SpdkAttach, SpdkVhost, VfioBind, ensure_socket_dir
from vstor.planner.disks import USERSPACE_DRIVERS


class Runtime:
    """What steps touch: sysfs, SPDK (connected on first use), the config."""

    def __init__(self, cfg: Config, sysfs, dry_run: bool = False, spdk_factory=None):
        self.cfg = cfg
        self.sysfs = sysfs
        self.dry_run = dry_run
        self._spdk_factory = spdk_factory
        self._spdk = None
        self.others: list[Record] = []

    def spdk(self):
        if self._spdk is None:
            if self._spdk_factory:
                self._spdk = self._spdk_factory()
            else:
                from vstor.backends.spdk import SpdkClient
                self._spdk = SpdkClient(self.cfg.spdk_socket, timeout=self.cfg.spdk_timeout,
                                        dry_run=self.dry_run)
        return self._spdk

    def other_records(self) -> list[Record]:
        return self.others

    def load_others(self, state: StateDir, key: str) -> None:
        """What every other domain holds, for steps that share a resource."""
        self.others = [r for r in state.records() if r.key != key]


# -- from a plan to steps ---------------------------------------------------------------

def build_steps(rt: Runtime, host: Host, plan: Plan) -> list[Step]:
    steps: list[Step] = []
    bound: set[str] = set()
    attached: set[str] = set()
    for disk in plan.disks:
        if disk.mode == "passthrough" or (disk.backend == "spdk" and disk.controller):
            ctrl = host.controller(disk.controller)
            if disk.controller not in bound and (ctrl is None or ctrl.driver not in USERSPACE_DRIVERS
                                                  or disk.mode == "passthrough"):
                steps.append(VfioBind.planned(rt, disk.controller))
            bound.add(disk.controller)
        if disk.backend == "spdk":
            if disk.spdk_controller not in attached:
                steps.append(SpdkAttach({"name": disk.spdk_controller,
                                         "paths": attach_params(rt.cfg, disk)}))
                attached.add(disk.spdk_controller)
            steps.append(SpdkVhost({"ctrlr": disk.vhost_name, "bdev": disk.bdev,
                                    "cpumask": hex(1 << disk.reactor), "readonly": disk.readonly,
                                    "socket": disk.socket, "group": rt.cfg.qemu_group}))
        elif disk.backend == "qsd":
            steps.append(QsdExport(_qsd_record(rt.cfg, disk)))
    return steps


def attach_params(cfg: Config, disk) -> list[dict]:
    """bdev_nvme_attach_controller parameters, one call per path."""
    src = disk.source
    name = disk.spdk_controller
    if src.kind == "nvme":
        return [{"name": name, "trtype": "PCIe", "traddr": src.controller}]
    common = {"name": name, "trtype": src.transport.upper(), "adrfam": src.adrfam.upper().replace("IPV", "IPv"),
              "subnqn": src.subnqn,
              "ctrlr_loss_timeout_sec": _pick(src.ctrlr_loss_timeout, cfg.ctrlr_loss_timeout_sec),
              "reconnect_delay_sec": _pick(src.reconnect_delay, cfg.reconnect_delay_sec),
              "fast_io_fail_timeout_sec": _pick(src.fast_io_fail_timeout, cfg.fast_io_fail_timeout_sec)}
    hostnqn = src.hostnqn or cfg.hostnqn
    if hostnqn:
        common["hostnqn"] = hostnqn
    if src.paths:
        common["multipath"] = "multipath"
    paths = [(src.traddr, src.trsvcid), *((p.traddr, p.trsvcid) for p in src.paths)]
    return [{**common, "traddr": addr, "trsvcid": str(port)} for addr, port in paths]


def _pick(value, default):
    return default if value is None else value


def _qsd_record(cfg: Config, disk) -> dict:
    from vstor.backends.qsd import QsdExport as Export
    src = disk.source
    if src.kind == "nvme":
        raise BadInput(f"{disk.target}: qsd on an NVMe namespace needs its block device; "
                       "re-plan with vstor apply")
    return Export(run_dir=cfg.qsd_dir, name=disk.vhost_name, source=src.path, kind=src.kind,
                  socket_path=disk.socket, readonly=disk.readonly, queues=disk.queues,
                  qemu_user=cfg.qemu_user, qemu_group=cfg.qemu_group).to_record()


# -- the operations ----------------------------------------------------------------------

def plan_of(dom: Domain) -> Plan:
    plan = recorded_plan(dom)
    if plan is None:
        raise BadInput(f"domain '{dom.name}' has vstor metadata but no plan",
                       hint=f"run: vstor apply {dom.name}")
    return plan


def running_ledger(state: StateDir) -> Ledger:
    return Ledger([holding_from_json(r.holding) for r in state.records() if r.holding])


def prepare(rt: Runtime, state: StateDir, host: Host, dom: Domain,
            progress: Callable[[str], None] | None = None) -> Record:
    from vstor.planner.validate import validate
    plan = plan_of(dom)
    key = dom.safe_name
    with state.lock():
        leftover = state.load(key)
        if leftover is not None:
            # A run that never released (crash, or an interrupted prepare):
            # undo what it left, then start clean.
            _rollback(rt, state, leftover, progress)
        problems = validate(host, rt.cfg, plan, running_ledger(state))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise DoesNotFit(f"domain '{dom.name}' cannot start: {problems[0]}{more}",
                             reasons=tuple(problems))
        if any(d.backend == "spdk" for d in plan.disks) and not rt.dry_run:
            rt.spdk().get_version()     # SPDK missing: say so before touching anything
        rt.load_others(state, key)
        rec = Record(key=key, domain=dom.name, uuid=dom.uuid,
                     holding=holding_to_json(Holding.from_plan(plan, active=True)))
        if rt.dry_run:
            for step in build_steps(rt, host, plan):
                (progress or print)(f"would {step.describe()}")
                step.do(rt)
            return rec
        ensure_socket_dir(rt.cfg.vhost_dir, rt.cfg.qemu_group)
        state.save(rec)     # holds the resources while preparing: a concurrent prepare sees them
        Journal(state, rec, rt, progress).run(build_steps(rt, host, plan))
        return rec


def release(rt: Runtime, state: StateDir, key: str,
            progress: Callable[[str], None] | None = None) -> Record | None:
    with state.lock():
        rec = state.load(key)
        if rec is None:
            return None
        if rt.dry_run:
            for entry in reversed(rec.steps):
                (progress or print)(f"would undo: {step_from_json(entry).describe()}")
            return rec
        _rollback(rt, state, rec, progress)
        return rec


def _rollback(rt: Runtime, state: StateDir, rec: Record, progress) -> None:
    rt.load_others(state, rec.key)
    errors = Journal(state, rec, rt, progress).rollback()
    if errors:
        raise ActionFailed(f"domain '{rec.domain}': could not undo everything: {'; '.join(errors)}",
                           hint=f"fix the cause, then: vstor release {rec.domain}")


def reconnect(rt: Runtime, state: StateDir, key: str) -> list[str]:
    """libvirtd restarted while the domain runs: check what vstor made still
    exists and repair what can be repaired.  Returns one line per finding."""
    findings = []
    with state.lock():
        rec = state.load(key)
        if rec is None:
            return ["vstor holds nothing for it"]
        rt.load_others(state, key)
        for entry in rec.steps:
            step = step_from_json(entry)
            problem = step.check(rt) if entry["state"] == DONE else "interrupted before it finished"
            if problem is None:
                continue
            try:
                step.repair(rt)
                findings.append(f"{step.describe()}: {problem}; repaired")
            except Exception as e:
                findings.append(f"{step.describe()}: {problem}; repair failed: {e}")
        if rec.status != PREPARED and all(e["state"] == DONE for e in rec.steps):
            rec.status = PREPARED
            state.save(rec)
    return findings


def health(rt: Runtime, rec: Record) -> list[tuple[str, str, str | None]]:
    """(step, state, problem) for each step of a record."""
    rt.others = []
    out = []
    for entry in rec.steps:
        step = step_from_json(entry)
        try:
            problem = step.check(rt) if entry["state"] == DONE else "interrupted"
        except Exception as e:
            problem = f"cannot check: {str(e).splitlines()[0]}"
        out.append((step.describe(), entry["state"], problem))
    return out
