"""vstor pve: Proxmox VE VMs, planned like libvirt domains, their plan
written into the VM config (and taken out again: unapply); the hookscript;
doctor for a Proxmox node."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from contextlib import nullcontext

from vstor import log
from vstor.atomic import write_file
from vstor.cli.context import say
from vstor.cli.domains import format_plan, plan_to_json, where
from vstor.cli.hooks import check_replaceable, hook_source, remove_hook, render_hook
from vstor.errors import BadInput, DoesNotFit, InUse
from vstor.formats.pve.config import PveConfig
from vstor.formats.pve.vm import name_of, uuid_of, vmid
from vstor.host import sources
from vstor.pve import leave, manage, pinning, snippet
from vstor.pve.doctor import checks
from vstor.pve.leave import chains_vstor, hook_value
from vstor.pve.node import Node
from vstor.render import pve as render
from vstor.runtime.recorded import release


def register(sub) -> None:
    p = sub.add_parser("pve", help="Proxmox VE: plan, apply and unapply VMs, the hookscript, doctor")
    psub = p.add_subparsers(dest="pve_command", metavar="COMMAND")
    psub.required = True
    for name, helptext in (("plan", "show what vstor would do for a VM, and why"),
                           ("apply", "plan a VM and write the plan into its config")):
        q = psub.add_parser(name, help=helptext)
        q.add_argument("vmid", metavar="VMID")
        q.add_argument("--conf", metavar="FILE",
                       help="the VM config (default: /etc/pve/qemu-server/VMID.conf)")
        q.add_argument("--intent", metavar="FILE",
                       help="the vstor intent (default: <snippets storage>/snippets/vstor-VMID.xml)")
        q.add_argument("--qemu-version", metavar="X.Y", type=_version,
                       help="the QEMU the VM will run under (default: ask [pve] qemu)")
        if name == "plan":
            q.add_argument("--json", action="store_true", help="machine-readable output")
            q.set_defaults(func=cmd_plan)
        else:
            q.add_argument("--dry-run", action="store_true", help="print the config diff, write nothing")
            q.set_defaults(func=cmd_apply)
    q = psub.add_parser("unapply", help="remove the lines vstor wrote into a VM's config, and its plan")
    q.add_argument("vmid", metavar="VMID")
    q.add_argument("--dry-run", action="store_true", help="print the config diff, change nothing")
    q.set_defaults(func=cmd_unapply)
    q = psub.add_parser("hooks", help="install the hookscript into the snippets storage")
    hsub = q.add_subparsers(dest="hooks_command", metavar="COMMAND")
    hsub.required = True
    h = hsub.add_parser("install", help="write <storage>/snippets/vstor and print the qm set lines")
    h.set_defaults(func=cmd_hooks_install)
    h = hsub.add_parser("uninstall", help="remove the hookscript")
    h.set_defaults(func=cmd_hooks_uninstall)
    q = psub.add_parser("doctor", help="check this Proxmox node for vstor")
    q.set_defaults(func=cmd_doctor)


def _node(ctx):
    return Node(ctx.config)


def _version(text: str) -> tuple[int, int]:
    """--qemu-version, checked as the arguments are read (before anything else)."""
    m = re.fullmatch(r"([0-9]{1,3})\.([0-9]{1,3})", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text[:20]}' is not X.Y, like 9.2")
    return int(m.group(1)), int(m.group(2))


def _qemu(node, args) -> tuple[int, int]:
    return args.qemu_version or node.qemu_version()


def _planned(ctx, args):
    node = _node(ctx)
    vm = vmid(args.vmid)
    vmo = manage.load(node, vm, args.conf, args.intent, tolerant=True,
                      missing="check the VMID (qm list), or pass --conf FILE")
    plan = manage.make_plan(ctx.host, ctx.config, vmo, manage.ledger(node, ctx.records(), skip=vm))
    sources.foresee(plan, ctx.config.images)
    return node, vmo, plan


def cmd_plan(ctx, args) -> int:
    node, vmo, plan = _planned(ctx, args)
    old = vmo.conf.to_text()
    new, _ = manage.new_config(vmo, plan, _qemu(node, args))
    if args.json:
        json.dump(plan_json(vmo, plan, old, new, plan_to_json(plan)), sys.stdout, indent=2)
        print()
        return 0
    print(format_plan(plan).replace(f"Domain {plan.domain}", f"VM {vmo.vmid} ({plan.domain})", 1))
    print("  post-start (vstor's hookscript, once QEMU runs; until then every QEMU thread runs on "
          "the affinity line's cores):")
    for line in pinning.describe(plan):
        print(f"    {line}")
    _diff(old, new, vmo.conf_path)
    return 0


def plan_json(vmo, plan, old: str, new: str, plan_data: dict) -> dict:
    """`vstor pve plan --json`, version 1:

        {"version": 1, "vmid": int, "domain": "pve-VMID",
         "config_path": str, "intent_path": str,
         "plan": {...},                 # as `vstor plan --json` prints a plan
         "post_start": [str],           # what the hookscript pins once QEMU runs
         "keys": {key: str | null},     # every config key vstor owns, as apply would
                                        # leave it (null: no such line)
         "changed": [key],              # the keys apply would write or remove
         "config": str}                 # the whole config apply would write
    """
    after, before = PveConfig.parse(new), PveConfig.parse(old)
    keys = sorted({k for k in after.keys() + before.keys() if _owned(k)} | set(_PLACEMENT))
    return {"version": 1, "vmid": vmo.vmid, "domain": plan.domain, "config_path": vmo.conf_path,
            "intent_path": vmo.intent_path, "plan": plan_data, "post_start": pinning.describe(plan),
            "keys": {k: after.get(k) for k in keys},
            "changed": [k for k in keys if after.get(k) != before.get(k)], "config": new}


def _owned(key: str) -> bool:
    return key in render.PLACEMENT_KEYS or key in render.HOSTPCI_KEYS or key == "args"


_PLACEMENT = ("numa", "numa0", "hugepages", "affinity", "args")


def cmd_apply(ctx, args) -> int:
    node = _node(ctx)
    vm = vmid(args.vmid)
    if bool(args.conf) != bool(args.intent) and not args.dry_run:
        raise BadInput("--conf and --intent go together: offline, apply writes the config and the "
                       "plan beside the intent it was given, never this node's VM",
                       hint="give both, or neither (this node's VM), or add --dry-run")
    if args.conf:       # offline: copies of a config and an intent, not this node's VM
        return _apply(ctx, args, node)
    with nullcontext() if args.dry_run else node.lock(vm):     # as `qm set` does
        if node.running(vm):
            raise InUse(f"VM {vm} is running; its backends are in use and its config was read "
                             "at its start", hint=f"stop it first (qm shutdown {vm}), then apply")
        return _apply(ctx, args, node)


def _apply(ctx, args, node) -> int:
    with ctx.planning(args.dry_run):    # the ledger read until the plan and config are written
        return _apply_planned(ctx, args, node)


def _apply_planned(ctx, args, node) -> int:
    _, vmo, plan = _planned(ctx, args)
    _check_unlocked(vmo.conf, vmo.vmid)
    hook = hook_value(ctx.config.pve_storage)
    if not args.conf:
        _check_hookscript(node, vmo.vmid, vmo.conf.get("hookscript"), hook)
    old = vmo.conf.to_text()
    new, changed = manage.new_config(vmo, plan, _qemu(node, args))
    if args.dry_run:
        _diff(old, new, vmo.conf_path)
        print(f"would record the plan in {snippet.plan_path(vmo.intent_path)}")
        return 0
    manage.write(node, vmo, plan, old, new, _qemu(node, args), changed)
    log.change(plan.domain, f"record the plan in {snippet.plan_path(vmo.intent_path)}", log.DONE)
    if changed:
        log.change(plan.domain, f"write {', '.join(changed)} into {vmo.conf_path}", log.DONE)
    print(f"VM {vmo.vmid}: " + ", ".join(f"{d.target} {d.mode}/{d.backend}" for d in plan.disks)
          + f", {where(plan)}; " + (f"wrote {', '.join(changed)}" if changed else "config unchanged"))
    if not vmo.conf.get("hookscript"):
        print(f"Set the hookscript, or vstor makes no backends at its start: "
              f"qm set {vmo.vmid} --hookscript {hook}")
    return 0


def _check_unlocked(conf, vm: int) -> None:
    """apply and unapply wait for whatever holds a VM's `lock:` (a backup,
    a migration, a snapshot), as qemu-server's own config changes do."""
    if conf.get("lock"):
        raise DoesNotFit(f"VM {vm} is locked ({conf.get('lock')[:20]})",
                         hint=f"wait for it, or: qm unlock {vm}")


def _check_hookscript(node, vm: int, have: str | None, hook: str) -> None:
    """Proxmox runs one hookscript per VM: a VM's own must call vstor's."""
    if have and have != hook:
        script = os.path.join(node.snippets().snippets, "vstor")
        if not leave.chains_vstor(node.etc, have, script):
            raise leave.own_hookscript(vm, have, script)


def cmd_unapply(ctx, args) -> int:
    node = _node(ctx)
    vm = vmid(args.vmid)
    with nullcontext() if args.dry_run else node.lock(vm):     # as `qm set` does
        if node.running(vm):
            raise InUse(f"VM {vm} is running; its backends are in use and its config was read "
                        "at its start", hint=f"stop it first (qm shutdown {vm}), then unapply")
        with ctx.planning(args.dry_run):
            return _unapply(ctx, args, node, vm)


def _unapply(ctx, args, node, vm: int) -> int:
    """Backends a start left (no post-stop) first, then the config, then the
    plan records: a run killed on the way leaves what the next one finishes."""
    conf, path = node.read_config(vm)
    _check_unlocked(conf, vm)
    ipath = snippet.path_of(manage.intent_dir(node), vm)
    records = [p for p in (snippet.plan_path(ipath), snippet.prev_path(ipath), snippet.written_path(ipath))
               if os.path.lexists(p)]
    plans = tuple(p for p in (snippet.read_plan(ipath, name_of(vm), None,
                                                "restore it, or remove it and vstor's lines by hand", where)
                              for where in records if where.endswith(".xml")) if p is not None)
    old = conf.to_text()
    written = snippet.read_written(ipath)
    removed = leave.strip(conf, plans, leave.hook_value(ctx.config.pve_storage), vm, written)
    new = conf.to_text()
    held = [r for r in ctx.state().records() if r.domain == name_of(vm)]
    _check_own(held, conf, vm)
    if not removed and not records and not held:
        print(f"nothing of vstor's in {path}")
        return 0
    if args.dry_run:
        _diff(old, new, path)
        for p in records:
            print(f"would remove {p}")
        for r in held:
            print(f"would release what vstor holds for {r.domain} (state record {r.key})")
        return 0
    for r in held:
        release(ctx.runtime(), ctx.state(), r.key, progress=say, domain=r.domain, uuid=r.uuid)
    if new != old:
        node.write_config(path, new)
        log.change(name_of(vm), f"remove {', '.join(removed)} from {path}", log.DONE)
    for p in records:
        snippet.remove(p)
    if records:
        log.change(name_of(vm), f"remove the plan records {', '.join(records)}", log.DONE)
    print(f"VM {vm}: " + (f"removed {', '.join(removed)}" if removed else "config unchanged")
          + (f"; removed its plan ({', '.join(os.path.basename(p) for p in records)})" if records else ""))
    if os.path.lexists(ipath):
        print(f"Kept your intent {ipath}: remove it to leave vstor, or run vstor pve apply {vm} again")
    own = conf.get("hookscript")
    if own:
        print(f"The VM's hookscript {own} is yours: if it calls vstor's, remove that call "
              "(with an intent and no plan, vstor's pre-start refuses the start)")
    return 0


def _check_own(held, conf, vm: int) -> None:
    """A record by the VM's name is the VM's only with its UUID (smbios1):
    any libvirt client may name a domain pve-VMID."""
    mine = uuid_of(conf, f"VM {vm}")
    for r in held:
        if (r.uuid or "").lower() != (mine or ""):
            raise InUse(f"state record {r.key} is of UUID {r.uuid}, not VM {vm}'s "
                        f"({mine or 'no uuid in smbios1'}): another domain by that name, or the "
                        "VM's smbios1 changed since its start",
                        hint=f"if it is VM {vm}'s: vstor release {r.domain}, then unapply again")


def _diff(old: str, new: str, path: str) -> None:
    lines = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                      fromfile=path, tofile=f"{path} (vstor)"))
    sys.stdout.write("".join(lines) if lines else f"{path}: no change\n")


def cmd_hooks_install(ctx, args) -> int:
    node = _node(ctx)
    store = node.snippets()
    target = os.path.join(store.snippets, "vstor")
    check_replaceable(target, "hookscript")
    config_path = ctx.args.config or os.environ.get("VSTOR_CONFIG")
    write_file(target, render_hook(config_path, "proxmox/vstor"), mode=0o755, makedirs=True,
               failure=f"cannot install the hookscript into {store.snippets}", hint="run as root")
    log.change(None, f"install the Proxmox hookscript {target}", log.DONE)
    print(f"Installed {target}" + ("" if store.shared else
                                   f" (storage '{store.id}' is not shared: install it on every node "
                                   "a vstor VM may start or migrate to)"))
    hook = hook_value(store.id)
    for vm in manage.vstor_vms(node):
        conf, _ = node.read_config(vm)
        own = conf.get("hookscript")
        if not own:
            print(f"qm set {vm} --hookscript {hook}")
        elif own != hook and not chains_vstor(node.etc, own, target):
            print(f"VM {vm}'s own hookscript {own} must call {target} \"$1\" \"$2\" first")
    return 0


def cmd_hooks_uninstall(ctx, args) -> int:
    store = _node(ctx).snippets()
    return remove_hook(os.path.join(store.snippets, "vstor"), "hookscript",
                       "VMs that name it no longer start (vstor pve unapply VMID takes vstor's lines, "
                       "its hookscript included, out of each)")


def cmd_doctor(ctx, args) -> int:
    problems = 0
    with open(hook_source("proxmox/vstor")) as f:
        source = f.read()
    for ok, line in checks(_node(ctx), ctx.config, source=source):
        print(f"{'ok' if ok else 'PROBLEM'}: {line}")
        problems += not ok
    return 3 if problems else 0
