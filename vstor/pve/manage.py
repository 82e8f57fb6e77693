"""A Proxmox VM's plan, made and checked with the same planner as a libvirt
domain's: load the VM (config + vstor intent), plan it against this node and
what the other VMs hold, and say which config lines carry the plan."""

from __future__ import annotations

import glob
import os
import re
import sys

from vstor.config import Config
from vstor.errors import BadInput, VstorError
from vstor.formats.pve import grammar
from vstor.formats.pve.config import PveConfig
from vstor.formats.pve.vm import count_of, name_of
from vstor.host.model import Host
from vstor.meta.plan import Plan
from vstor.planner import Request, fit, plan_domain
from vstor.planner.ledger import Holding, Ledger
from vstor.pve import snippet
from vstor.pve.node import Node
from vstor.pve.request import request_of
from vstor.records import field, record, replace
from vstor.render import pve as render
from vstor.runtime.holders import holding_of
from vstor.runtime.inventory import load_ledger
from vstor.runtime.state import StateDir


@record(frozen=False)
class Vm:
    vmid: int
    conf: PveConfig
    conf_path: str
    intent_path: str
    req: Request
    recorded: Plan | None        # the plan `vstor pve apply` last wrote
    earlier: Plan | None = None  # the plan before it, while its config write is pending
    guard: render.Guard = field(default_factory=render.Guard)

    @property
    def previous(self) -> tuple[Plan, ...]:
        """The plans whose lines the config may carry."""
        return tuple(p for p in (self.recorded, self.earlier) if p is not None)

    @property
    def fix(self) -> str:
        return self.req.fix


def intent_dir(node: Node) -> str:
    return node.snippets().snippets


def load(node: Node, vmid: int, conf_path: str | None = None, intent_path: str | None = None,
         tolerant: bool = False, conf: PveConfig | None = None,
         missing: str = "check the VMID (qm list)") -> Vm:
    """tolerant: a damaged plan record reads as none (apply re-plans); a
    start must refuse it.  conf: the config, already read from conf_path.
    missing: the hint when there is no config."""
    path = conf_path or node.config_path(vmid)
    if conf is None:
        conf, path = node.read_config(vmid, path, missing)
    ipath = intent_path or snippet.path_of(intent_dir(node), vmid)
    req = request_of(vmid, conf, snippet.intent_of(snippet.read(ipath, vmid)))
    plans = []
    for where in (snippet.plan_path(ipath), snippet.prev_path(ipath)):
        try:
            plans.append(snippet.read_plan(ipath, req.name, req.uuid, f"run: {req.fix}", where))
        except BadInput:
            if not tolerant and not plans:
                raise
            plans.append(None)
    guard = render.Guard(frozenset(claimed_controllers(node, _records(node), skip=vmid)),
                         node.pci_mappings())
    return Vm(vmid, conf, path, ipath, req, plans[0], plans[1], guard)


def _records(node: Node):
    return StateDir(node.cfg.state_dir).records()


def make_plan(host: Host, cfg: Config, vm: Vm, ledger: Ledger) -> Plan:
    plan = plan_domain(host, cfg, vm.req, ledger)
    if not plan.cells:
        return plan
    _check_sockets(vm, plan)
    # What a guest with cells cannot get on Proxmox: a hostpciN line has no bus option.
    disks = tuple(replace(d, reasons=d.reasons + (
        f"in guest cell {plan.disk_cell(d).id} (host node {plan.disk_cell(d).node}), but on "
        "qemu-server's own PCI buses (a hostpciN line has no bus option): the guest sees the "
        "controller on no NUMA node",)) if d.mode == "passthrough" else d for d in plan.disks)
    return replace(plan, disks=disks)


def _check_sockets(vm: Vm, plan: Plan) -> None:
    """A guest cell's vCPUs within one of the VM's sockets: QEMU numbers
    vCPUs socket by socket (cores per socket each), and a guest node
    holding vCPUs of two sockets is a topology no real machine has (Linux
    then warns of a broken topology and schedules across it)."""
    where = f"VM {vm.vmid}"
    sockets, cores = count_of(vm.conf, "sockets", where), count_of(vm.conf, "cores", where)
    if sockets < 2:
        return
    for cell in plan.cells:
        held = sorted({v // cores for v in cell.vcpus})
        if len(held) > 1:
            raise BadInput(f"{where}: guest cell {cell.id} would hold vCPUs of sockets "
                           f"{', '.join(map(str, held))} (sockets: {sockets}, cores: {cores}); "
                           "a guest cell's vCPUs must be within one socket",
                           hint=f"give the VM as many cells as sockets (or a multiple that divides "
                                f"its cores), or one socket: qm set {vm.vmid} --sockets 1 "
                                f"--cores {sockets * cores}")


def recorded_plan(vm: Vm) -> Plan:
    """The plan to start with: made for this intent and size, or refused."""
    if vm.recorded is None:
        raise BadInput(f"VM {vm.vmid} has a vstor intent but no plan", hint=f"run: {vm.fix}")
    fit.check_made_for(vm.recorded, vm.req)
    return vm.recorded


def new_config(vm: Vm, plan: Plan, qemu: tuple[int, int]) -> tuple[str, list[str]]:
    """The config text with every vstor key as `plan` says; the keys changed.
    A numaN, hugepages or affinity line vstor did not write is never
    replaced: refused with the line named."""
    want = render.render(vm.conf, plan, vm.previous, qemu, vm.vmid, vm.guard)
    ours = [render.placement(p) for p in vm.previous]
    changed = []
    for key, value in want.items():
        have = vm.conf.get(key)
        if have == value:
            continue
        if key in render.PLACEMENT_KEYS and have is not None and all(o[key] != have for o in ours):
            raise BadInput(f"VM {vm.vmid}: '{key}: {have[:60]}' is a line of yours; vstor writes {key} "
                           "from its plan and replaces no line it did not write",
                           hint=f"qm set {vm.vmid} --delete {key}, then apply again")
        changed.append(key)
        if value is None:
            vm.conf.delete(key)
        else:
            vm.conf.set(key, value)
    return vm.conf.to_text(), changed


def check_config(vm: Vm, plan: Plan, qemu: tuple[int, int], starting: bool = False) -> None:
    """The config still carries the plan (a user with VM.Config rights can
    change numaN, hostpci or memory; root can change anything).  starting:
    qemu-server has already decided to start the VM, which it does under
    `lock: migrate` (a migration's target), `backup` (vzdump of a stopped
    VM), `suspended` (a resume): the lock is not vstor's to judge then."""
    if vm.conf.get("lock") and not starting:
        raise BadInput(f"VM {vm.vmid} is locked ({vm.conf.get('lock')[:20]})",
                       hint=f"wait for it, or: qm unlock {vm.vmid}")
    drift = render.drift(vm.conf, plan, qemu, vm.vmid, vm.guard)
    if drift:
        raise BadInput(f"VM {vm.vmid}'s config does not carry its vstor plan ({', '.join(drift)} "
                       "changed since vstor pve apply)", hint=f"run: {vm.fix}")


def holdings(node: Node, skip: int | None = None) -> list[Holding]:
    """What every other vstor VM whose config is on this node was planned
    to hold, running or not (a stopped VM keeps its cores for its next start);
    while a config write is pending, the devices of the plan before too."""
    out = []
    try:
        where = intent_dir(node)
    except BadInput:
        return out
    for path in sorted(glob.glob(os.path.join(glob.escape(where), "vstor-*.plan.xml"))):
        m = re.fullmatch(r"vstor-([1-9][0-9]{2,8})\.plan\.xml", os.path.basename(path))
        if not m or int(m.group(1)) == skip:
            continue
        vmid = int(m.group(1))
        if not os.path.exists(node.config_path(vmid)):
            continue        # another node's VM (a shared storage holds every node's)
        try:
            plan = snippet.read_plan(snippet.path_of(where, vmid), name_of(vmid), None, "")
        except VstorError as e:
            print(f"vstor: warning: ledger skips VM {vmid}: {e}", file=sys.stderr)
            continue
        if plan is not None:
            out.append(_with_earlier(Holding.from_plan(plan, active=node.running(vmid)),
                                     snippet.prev_path(snippet.path_of(where, vmid)), vmid))
    return out


def _with_earlier(held: Holding, prev: str, vmid: int) -> Holding:
    """The controllers and volumes of the plan whose lines the config may
    still carry (an apply killed before its config) stay held with the new."""
    try:
        earlier = snippet.read_plan("", name_of(vmid), None, "", prev)
    except VstorError:
        earlier = None
    if earlier is None:
        return held
    old = Holding.from_plan(earlier)
    return replace(held, passthrough=held.passthrough | old.passthrough, volumes=held.volumes | old.volumes,
                   spdk_controllers=held.spdk_controllers | old.spdk_controllers)


def ledger(node: Node, records, skip: int | None = None) -> Ledger:
    base = load_ledger(None, records)
    known = {h.domain for h in base.holdings}
    return Ledger(list(base.holdings) + [h for h in holdings(node, skip) if h.domain not in known])


def vstor_vms(node: Node) -> list[int]:
    """The VMs on this node with a vstor intent."""
    out = []
    for path in glob.glob(os.path.join(glob.escape(intent_dir(node)), "vstor-*.xml")):
        m = re.fullmatch(r"vstor-([1-9][0-9]{2,8})\.xml", os.path.basename(path))
        if m and os.path.exists(node.config_path(int(m.group(1)))):
            out.append(int(m.group(1)))
    return sorted(out)


def carries_vstor(conf: PveConfig, claimed: set[str], mappings: grammar.Mappings,
                  vm: int) -> str | None:
    """What in a config without a vstor intent is vstor's (a clone or a
    restore of a vstor VM, say): its args pairs, or a hostpci line passing a
    controller a vstor plan or record holds (`claimed`), read as qemu-server
    reads it (any key order, short or full address, a whole slot, a `;`
    list, a mapping: one that cannot be resolved is refused)."""
    if render.has_vstor_args(conf.get("args")):
        return "args hold vstor's vhost-user disks"
    for key in render.HOSTPCI_KEYS:
        if conf.get(key) is not None:
            ids = grammar.handed(key, conf.get(key), mappings, f"VM {vm}: {key}")
            taken = sorted(c for c in claimed if grammar.names(ids, c))
            if taken:
                return f"{key} passes {taken[0]} through, which vstor holds for a VM"
    return None


def claimed_controllers(node: Node, records, skip: int | None = None) -> set[str]:
    """Every local controller a vstor plan on this node (and the plan before
    it, while its config write is pending) or a state record holds; of all
    VMs but `skip`."""
    held = holdings(node, skip) + [holding_of(r) for r in records
                                   if r.holding and (skip is None or r.domain != name_of(skip))]
    out = set()
    for h in held:
        out |= h.passthrough | h.spdk_controllers
        out |= {key[5:].split("/")[0] for key, _ in h.volumes if key.startswith("nvme:")}
    return out


def write(node: Node, vm: Vm, plan: Plan, old: str, new: str, qemu: tuple[int, int],
          changed: list[str] = ()) -> None:
    """The plan record first (the next start and the other VMs' plans read
    it), with the placement keys vstor wrote (`changed` now, and before: a
    superset until the config is written), then the config.  The plan whose lines the config carries stays
    beside it until the config is written, so a run killed in between
    leaves no line of the old plan that is not known as vstor's."""
    prev = snippet.prev_path(vm.intent_path)
    if new != old and vm.recorded is not None and (
            vm.earlier is None or not render.drift(PveConfig.parse(old), vm.recorded, qemu, vm.vmid)):
        snippet.write(prev, snippet.plan_bytes(vm.recorded))
    snippet.write(snippet.plan_path(vm.intent_path), snippet.plan_bytes(plan))
    # Keys without a plan recorded are a killed unapply's leftovers: none is vstor's line.
    before = (snippet.read_written(vm.intent_path) or set()) if vm.previous else set()
    keys = {k for k in render.PLACEMENT_KEYS if k in changed or k in before}
    # Written even empty: no file means an older vstor's plan, whose every
    # placement line equal to the plan's unapply takes as vstor's.
    snippet.write_written(vm.intent_path, keys)
    if new != old:
        node.write_config(vm.conf_path, new)
    now = PveConfig.parse(new)
    final = {k for k in keys if now.get(k) is not None}
    if final != keys:       # the superset written above, narrowed now the config is written
        snippet.write_written(vm.intent_path, final)
    snippet.remove(prev)
