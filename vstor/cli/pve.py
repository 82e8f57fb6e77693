"""vstor pve: Proxmox VE VMs, planned like libvirt domains, their plan
written into the VM config; the hookscript; doctor for a Proxmox node."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from contextlib import nullcontext

from vstor.errors import BadInput, DoesNotFit, InUse


def register(sub) -> None:
    p = sub.add_parser("pve", help="Proxmox VE: plan and apply VMs, the hookscript, doctor")
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
    from vstor.pve.node import Node
    return Node(ctx.config)


def _version(text: str) -> tuple[int, int]:
    """--qemu-version, checked as the arguments are read (before anything else)."""
    m = re.fullmatch(r"(\d{1,3})\.(\d{1,3})", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text[:20]}' is not X.Y, like 9.2")
    return int(m.group(1)), int(m.group(2))


def _qemu(node, args) -> tuple[int, int]:
    return args.qemu_version or node.qemu_version()


def _planned(ctx, args):
    from vstor.pve import manage
    from vstor.pve.vm import vmid
    node = _node(ctx)
    vm = vmid(args.vmid)
    vmo = manage.load(node, vm, args.conf, args.intent, tolerant=True)
    plan = manage.make_plan(ctx.host, ctx.config, vmo, manage.ledger(node, ctx.records(), skip=vm))
    return node, vmo, plan


def cmd_plan(ctx, args) -> int:
    from vstor.cli.domains import format_plan, plan_to_json
    from vstor.pve import manage
    node, vmo, plan = _planned(ctx, args)
    old = vmo.conf.to_text()
    new, _ = manage.new_config(vmo, plan, _qemu(node, args))
    if args.json:
        json.dump({"plan": plan_to_json(plan), "config": new}, sys.stdout, indent=2)
        print()
        return 0
    print(format_plan(plan).replace(f"Domain {plan.domain}", f"VM {vmo.vmid} ({plan.domain})", 1))
    _diff(old, new, vmo.conf_path)
    return 0


def cmd_apply(ctx, args) -> int:
    from vstor.pve.vm import vmid
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
    from vstor.pve import manage, snippet
    _, vmo, plan = _planned(ctx, args)
    if vmo.conf.get("lock"):
        raise DoesNotFit(f"VM {vmo.vmid} is locked ({vmo.conf.get('lock')[:20]})",
                         hint=f"wait for it, or: qm unlock {vmo.vmid}")
    old = vmo.conf.to_text()
    new, changed = manage.new_config(vmo, plan, _qemu(node, args))
    if args.dry_run:
        _diff(old, new, vmo.conf_path)
        print(f"would record the plan in {snippet.plan_path(vmo.intent_path)}")
        return 0
    manage.write(node, vmo, plan, old, new, _qemu(node, args))
    print(f"VM {vmo.vmid}: " + ", ".join(f"{d.target} {d.mode}/{d.backend}" for d in plan.disks)
          + f", node {plan.node}; " + (f"wrote {', '.join(changed)}" if changed else "config unchanged"))
    hook = f"{ctx.config.pve_storage}:snippets/vstor"
    if vmo.conf.get("hookscript") != hook:
        print(f"Set the hookscript, or vstor makes no backends at its start: "
              f"qm set {vmo.vmid} --hookscript {hook}")
    return 0


def _diff(old: str, new: str, path: str) -> None:
    lines = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                      fromfile=path, tofile=f"{path} (vstor)"))
    sys.stdout.write("".join(lines) if lines else f"{path}: no change\n")


def cmd_hooks_install(ctx, args) -> int:
    from vstor.atomic import write_file
    from vstor.cli.hooks import render_hook
    from vstor.pve import manage
    node = _node(ctx)
    store = node.snippets()
    target = os.path.join(store.snippets, "vstor")
    config_path = ctx.args.config or os.environ.get("VSTOR_CONFIG")
    write_file(target, render_hook(config_path, "proxmox/vstor"), mode=0o755, makedirs=True,
               failure=f"cannot install the hookscript into {store.snippets}", hint="run as root")
    print(f"Installed {target}" + ("" if store.shared else
                                   f" (storage '{store.id}' is not shared: install it on every node "
                                   "a vstor VM may start or migrate to)"))
    for vm in manage.vstor_vms(node):
        conf, _ = node.read_config(vm)
        if conf.get("hookscript") != f"{store.id}:snippets/vstor":
            print(f"qm set {vm} --hookscript {store.id}:snippets/vstor")
    return 0


def cmd_hooks_uninstall(ctx, args) -> int:
    store = _node(ctx).snippets()
    from vstor.cli.hooks import remove_hook
    return remove_hook(os.path.join(store.snippets, "vstor"), "hookscript",
                       "VMs that name it no longer start (qm set VMID --delete hookscript)")


def cmd_doctor(ctx, args) -> int:
    from vstor.pve.doctor import checks
    problems = 0
    for ok, line in checks(_node(ctx), ctx.config):
        print(f"{'ok' if ok else 'PROBLEM'}: {line}")
        problems += not ok
    return 3 if problems else 0
