"""Hot-plug of a vstor disk into a running domain, and its unplug.

attach: plan the disk against the domain's running placement (pure,
vstor.planner.hotplug), make its backend (the journal's extend: a failure
undoes only the new steps), then hand the device to the guest (`guest`, a
virt.LiveDomain); a refused device undoes the backend.  The domain's live
metadata carries the new intent and plan, so every later step (release,
status, migration) reads it as if the disk had been there from the start.

detach: the guest lets go first (the device removed by QEMU, waited for),
then the backend goes; a guest that does not let go leaves everything as it
was.  Steps another disk still stands on (a shared SPDK controller, a bind)
stay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vstor.errors import ActionFailed, BadInput, DoesNotFit, InUse
from vstor.host.model import Host
from vstor.host.read import read_host
from vstor.meta import topology
from vstor.meta import metadata
from vstor.meta.document import Domain
from vstor.meta.intent import DiskIntent
from vstor.meta.plan import Plan
from vstor.planner.hotplug import HOTPLUGGED, plan_attach, plan_detach
from vstor.planner.ledger import Holding, holding_to_json
from vstor.records import replace
from vstor.render import buses
from vstor.render.libvirt import device_xml
from vstor.runtime import actions, supervise
from vstor.runtime import executor
from vstor.runtime.executor import Runtime
from vstor.runtime.holders import holders_of, ledger_of
from vstor.runtime.journal import Journal, undo_failed
from vstor.runtime.lifecycle import own_record, plan_of
from vstor.runtime.recorded import private_only
from vstor.runtime.state import PREPARED, StateDir


def attach(rt: Runtime, state: StateDir, host: Host, dom: Domain, disk: DiskIntent, guest,
           persistent: bool = False, progress: Callable[[str], None] | None = None) -> Plan:
    """Add `disk` to the running domain `dom`; the new plan.  The domain is
    read again from `guest` under its record lock: another attach or detach
    may have changed its live metadata since `dom` was read."""
    say = progress or print
    with contextlib.ExitStack() as planning:
        planning.enter_context(state.planning(dry_run=rt.dry_run))
        with state.record_lock(dom.safe_name, dry_run=rt.dry_run):
            return _attach(rt, state, host, guest.current(), disk, guest, persistent, say, progress,
                           planning)


def _attach(rt, state, host, dom, disk, guest, persistent, say, progress, planning) -> Plan:
    with contextlib.ExitStack() as host_lock:
        host_lock.enter_context(state.lock(dry_run=rt.dry_run))
        req, plan = plan_of(dom)
        problem = pci_hotplug_problem(dom) or _no_port(dom, plan)
        if problem:
            raise DoesNotFit(problem[0], hint=problem[1])
        if persistent:
            _check_persistent(guest, dom, plan)
        rec = _running_record(state, dom)
        rt = rt.of(rec)     # one SPDK application per domain: the one its steps were made through
        if not rt.dry_run:
            dom = _unplugged(guest, dom, say)
            req, plan = plan_of(dom)
            if _undo_interrupted(rt, state, dom, rec, plan, progress):
                host = read_host(rt.sysfs)      # the undo moved things (a binding): look again
        new = plan_attach(host, rt.cfg, req, plan, disk, ledger_of(state, (), rt.dry_run))
        added = new.disk(disk.target)
        have = {actions.identity(actions.from_json(e)) for e in rec.steps}
        steps = [s for s in actions.build(replace(new, disks=(added,)), rt.cfg)
                 if actions.identity(s) not in have]
        executor.preflight(steps, rt)
        xml = device_xml(added, _port(dom, new, added))
        if rt.dry_run:
            for step in steps:
                say(f"would {step.describe()}")
                for line in step.dry_run():
                    say(f"    {line}")
            say(f"would attach to {dom.name}{' (live and persistent)' if persistent else ' (live)'}:")
            say("    " + xml.strip().replace("\n", "\n    "))
            return new
        methods = {m for step in steps for m in getattr(step, "rpc_methods", ())}
        if methods:
            rt.spdk.require(methods)
        others = holders_of(state, rec.key)
        steps = [executor.observe(step, rt, others) for step in steps]
        before, first = rec.holding, len(rec.steps)
        rec.holding = holding_to_json(Holding.from_plan(new, active=True))
        state.save(rec)     # held from now: a concurrent prepare sees the new disk's share
        planning.close()    # planned and recorded
        if private_only(step.kind for step in steps):
            host_lock.close()   # as prepare: decided and recorded; its daemon starts under the record lock
        journal = Journal(state, rec, rt, progress)
        try:
            journal.extend(steps)
            guest.attach(xml, _metadata(dom, new, add=disk), persistent)
        except BaseException as e:
            errors = _undo_steps(rt, state, rec, lambda i, _e: i < first, progress, holding=before)
            if errors:
                raise ActionFailed(f"domain '{dom.name}': {disk.target} was not added, and undoing "
                                   f"its backend failed: {'; '.join(errors)}",
                                   hint=f"fix the cause, then: vstor release {dom.name} after it stops") from e
            if isinstance(e, ActionFailed) and not _q35(dom):     # libvirt's hint is for q35
                raise ActionFailed(e.message, hint="an i440fx guest takes hot-plugged devices in the free "
                                   "slots of pci.0 (32 in all) or of a pci-bridge controller: free a slot, "
                                   "or add a pci-bridge while it is stopped") from None
            raise
    if any(step.kind == "qsd-export" for step in steps):
        supervise.ensure(rt.cfg, rt.sysfs.root)
    return new


def _port(dom: Domain, plan: Plan, disk):
    """Where a disk of a guest with several cells goes: a spare root port
    behind its cell's expander bus (q35); None: where libvirt puts it."""
    if not plan.cells:
        return None
    cell = plan.disk_cell(disk).id
    if not _q35(dom):
        raise DoesNotFit(f"{disk.target} cannot be added to domain '{dom.name}' live: an i440fx "
                         f"guest hot-plugs on pci.0 only, where the guest would see it on no NUMA node "
                         f"(its cell {cell}'s devices sit on a pci-expander-bus)",
                         hint="stop the domain, add the disk to its metadata, vstor apply, start it")
    port = buses.free_port(dom.root.find("devices"), cell)
    if port is None:
        raise DoesNotFit(f"{disk.target} cannot be added to domain '{dom.name}' live: guest cell {cell} "
                         "has no free PCI port (vstor gives each cell one spare, and it is taken)",
                         hint="stop the domain, add the disk to its metadata, vstor apply (a new "
                              "spare), start it")
    return port


def spare_ports(dom: Domain, cells: int) -> tuple[int, ...] | None:
    """Per guest cell, how many disks the guest (as its XML says: libvirt's
    live XML of a running one) can be given live: a q35 guest's empty root
    ports (vstor render/buses.py); none for an i440fx guest with cells;
    None for an i440fx guest without (it takes them in the free slots of
    pci.0, which libvirt's refusal names)."""
    if not _q35(dom):
        return (0,) * cells if cells > 1 else None
    devices = dom.root.find("devices")
    return buses.spare_ports(devices if devices is not None else dom.root.makeelement("devices"), cells)


def _no_port(dom: Domain, plan: Plan) -> tuple[str, str] | None:
    """(why, fix) when a q35 guest with one cell has no free root port:
    libvirt would refuse the device after the backend was made.  A guest
    with cells is looked at in its disk's cell (_port)."""
    if plan.cells or spare_ports(dom, 1) != (0,):
        return None
    return (f"domain '{dom.name}' has no free PCIe root port, where a q35 guest takes a hot-plugged disk",
            f"give it spare ports while it is stopped (virsh edit {dom.name}: one <controller type='pci' "
            "model='pcie-root-port'/> per disk to add live; libvirt adds none), then start it; or add the "
            f"disk to its metadata, vstor apply {dom.name} and start it")


def _q35(dom: Domain) -> bool:
    found = dom.root.find("os/type")
    return topology.is_q35((found.get("machine") if found is not None else "") or "")


def pci_hotplug_problem(dom: Domain) -> tuple[str, str] | None:
    """(why, fix) when the running guest, as its XML says, cannot take a
    hot-plugged PCI device (every vstor disk is one: vhost-user-blk-pci or
    a passed-through controller); None when it can.  An i440fx guest
    ('pc', 'pc-i440fx-*') hot-plugs on pci.0 through ACPI (PIIX4's ACPI PCI
    hot-plug): without <acpi/>, or with hot-plug off on pci-root, QEMU has
    no hot-plug for the device; both are set when the guest starts.  A q35
    guest hot-plugs into a free pcie-root-port (libvirt's refusal says so)."""
    found = dom.root.find("os/type")
    arch = found.get("arch") if found is not None else None
    if _q35(dom) or arch not in (None, "x86_64", "i686"):
        return None
    restart = f"then shut it down and start it again (virsh edit {dom.name}; it takes effect at a start)"
    if dom.root.find("features/acpi") is None:
        return (f"domain '{dom.name}' is an i440fx guest without ACPI, and i440fx hot-plugs PCI devices "
                "through ACPI", f"add <acpi/> to its <features>, {restart}")
    for ctrl in dom.root.findall("devices/controller[@type='pci']"):
        target = ctrl.find("target")
        if ctrl.get("model") == "pci-root" and target is not None and target.get("hotplug") == "off":
            return (f"domain '{dom.name}' has hot-plug off on its pci-root controller",
                    f"remove <target hotplug='off'/> from that controller, {restart}")
    return None


def detach(rt: Runtime, state: StateDir, dom: Domain, target: str, guest, timeout: float,
           persistent: bool = False, progress: Callable[[str], None] | None = None) -> Plan:
    """Take the vstor disk `target` from the running domain `dom`; the new
    plan.  The domain is read again under its record lock (see attach)."""
    with state.record_lock(dom.safe_name, dry_run=rt.dry_run):
        return _detach(rt, state, guest.current(), target, guest, timeout, persistent, progress)


def _detach(rt, state, dom, target, guest, timeout, persistent, progress) -> Plan:
    say = progress or print
    req, plan = plan_of(dom)
    new = plan_detach(req, plan, target)
    gone = plan.disk(target)
    if persistent:
        _check_persistent(guest, dom, plan)
    kept = {actions.identity(s) for s in actions.build(new, rt.cfg)}
    mine = [actions.identity(s) for s in actions.build(replace(plan, disks=(gone,)), rt.cfg)
            if actions.identity(s) not in kept]
    device = guest.device(gone)
    if rt.dry_run:
        say(f"would detach {target} from {dom.name} and wait up to {timeout:g}s for QEMU to let go")
        for kind, name in reversed(mine):
            say(f"would undo: {kind} {name}")
        return new
    _running_record(state, dom)     # refused before the guest loses the disk
    if device is not None:
        say(f"asking the guest to let go of {target}")
        guest.detach(device, timeout, persistent)
    elif persistent:
        guest.detach_config(gone)
    with state.lock():
        _release_disk(rt, state, dom, target, mine, progress)
        rec = _running_record(state, dom)
        rec.holding = holding_to_json(Holding.from_plan(new, active=True))
        state.save(rec)
    guest.set_metadata(_metadata(dom, new, remove=target), persistent)
    return new


def _release_disk(rt: Runtime, state: StateDir, dom: Domain, target: str, mine, progress) -> None:
    """Undo the recorded steps that only the disk stood on (`mine`, by identity)."""
    rec = _running_record(state, dom)
    rt = rt.of(rec)
    steps = [actions.from_json(entry) for entry in rec.steps]
    for step in steps:
        why = executor.in_use(step, rt) if actions.identity(step) in mine and not rt.force else None
        if why:
            raise InUse(f"domain '{dom.name}': {target} is gone from the guest but {why}",
                             hint=f"retry vstor detach {dom.name} {target} in a moment")
    journal = Journal(state, rec, rt, progress)
    errors = _undo_steps(rt, state, rec, lambda i, _entry: actions.identity(steps[i]) not in mine,
                         progress, journal=journal)
    if errors:
        raise undo_failed(journal, f"domain '{dom.name}': {target} left the guest, but undoing its "
                                   f"backend failed: {'; '.join(errors)}",
                          f"fix the cause, then: vstor detach {dom.name} {target}")


def _unplugged(guest, dom: Domain, say) -> Domain:
    """The domain without the hot-plugged disks its live plan has and the
    guest does not: an attach killed between its metadata and its device
    (or a detach killed after the guest let go, or a virsh detach-device).
    They leave the live metadata (and the persistent one, when it carries
    the same plan), so that _undo_interrupted undoes their backend and this
    attach can make the disk again."""
    while True:
        req, plan = plan_of(dom)
        gone = next((d for d in plan.disks if HOTPLUGGED in d.reasons and guest.device(d) is None), None)
        if gone is None or len(plan.disks) == 1:
            return dom
        say(f"{gone.target} is in {dom.name}'s plan but not in the guest (an attach or detach was "
            "interrupted): taking it out, and its backend with it")
        new = plan_detach(req, plan, gone.target)
        guest.set_metadata(_metadata(dom, new, remove=gone.target), guest.persistent_plan() == plan)
        dom = guest.current()


def _undo_interrupted(rt: Runtime, state: StateDir, dom: Domain, rec, plan: Plan, progress) -> bool:
    """An attach killed before the guest had its disk (the live plan never
    got it) left its share in the record's holding and its backend steps
    in the record: undone first, as prepare
    undoes an interrupted prepare, so that this attach makes them again.  A
    step made for the whole domain (its prepared mark, its outgoing NVMe-oF
    export) is no disk's and stays."""
    planned = {actions.identity(s) for s in actions.build(plan, rt.cfg)}

    def kept(_i, entry) -> bool:
        try:
            step = actions.from_json(entry)
        except ActionFailed:
            return True         # not this vstor's to judge: release reports it
        return step.whole_domain or actions.identity(step) in planned
    holding = holding_to_json(Holding.from_plan(plan, active=True))
    if all(kept(i, e) for i, e in enumerate(rec.steps)):
        if rec.holding != holding:      # killed after it recorded the disk's share, before a step
            rec.holding = holding
            state.save(rec)
        return False
    errors = _undo_steps(rt, state, rec, kept, progress, holding=holding)
    if errors:
        raise ActionFailed(f"domain '{dom.name}': an interrupted attach left a backend that "
                           f"could not be undone: {'; '.join(errors)}",
                           hint=f"fix the cause, then retry (or vstor release {dom.name} after it stops)")
    return True


def _undo_steps(rt: Runtime, state: StateDir, rec, keep, progress, holding: dict | None = None,
                journal: Journal | None = None) -> list[str]:
    """Undo the record's steps but those keep(index, entry) names; the
    record stays the running domain's (prepared, holding `holding` when
    given).  What could not be undone, as the journal's rollback says it."""
    errors = (journal or Journal(state, rec, rt, progress)).rollback(keep=keep)
    rec.status = PREPARED
    if holding is not None:
        rec.holding = holding
    state.save(rec)
    return errors


def _running_record(state: StateDir, dom: Domain):
    rec = own_record(state.load(dom.safe_name), dom.name, dom.uuid)
    if rec is None or rec.status != PREPARED:
        now = "nothing" if rec is None else f"a record that is {rec.status}"
        raise DoesNotFit(f"domain '{dom.name}' is not running on what vstor prepared "
                         f"(vstor holds {now} for it)",
                         hint="hot-plug is for running domains: start it, or edit its metadata "
                              "and vstor apply while it is stopped")
    return rec


def _check_persistent(guest, dom: Domain, plan: Plan) -> None:
    saved = guest.persistent_plan()
    if saved != plan:
        raise BadInput(f"domain '{dom.name}': --persistent needs the persistent definition to "
                       "carry the plan it runs with, and it does not (re-planned since it started)",
                       hint="leave out --persistent, or restart the domain first")


def _metadata(dom: Domain, plan: Plan, add: DiskIntent | None = None,
              remove: str | None = None) -> str:
    root = Domain.parse(dom.to_string(), dom.origin).root
    if add is not None:
        metadata.add_disk(root, add)
    if remove is not None:
        metadata.remove_disk(root, remove)
    metadata.store(root, plan)
    return metadata.element_text(root)
