"""repair: a running domain's threads and memory put back where its plan
puts them (vstor.runtime.drift), and --undo; a Proxmox VM's by its
post-start pinning (vstor.pve.pinning)."""

from __future__ import annotations

from vstor.cli.context import say
from vstor.cli.runtime import headed, key_of
from vstor.errors import EXIT_DOES_NOT_FIT, BadInput, DoesNotFit
from vstor.formats.pve.vm import vmid_of
from vstor.pve.node import Node
from vstor.runtime import drift


def register(sub) -> None:
    p = sub.add_parser("repair", help="put a running domain's vCPUs, emulator and I/O threads, memory "
                                      "nodes and qemu-storage-daemon threads back where its plan "
                                      "puts them (what vstor status reports as drift)")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--dry-run", action="store_true", help="print each change, make none")
    p.add_argument("--undo", action="store_true",
                   help="put back what the last repair changed, while the domain runs as it left it")
    p.set_defaults(func=cmd_repair)


def cmd_repair(ctx, args) -> int:
    name = args.domain
    title = headed(f"{'Undoing the last repair of' if args.undo else 'Repairing'} {name}"
                   f"{' (dry run)' if args.dry_run else ''}:")
    node = Node(ctx.config)
    if vmid_of(name) and node.is_proxmox():
        if args.undo:
            raise BadInput(f"vstor repair --undo is for libvirt domains: VM {vmid_of(name)}'s threads "
                           "are pinned by its post-start", hint=f"pin them by hand, or: vstor repair {name}")
        return _repair_pve(ctx, node, name, args.dry_run, title)
    key = key_of(ctx, name)
    if args.undo:
        back = drift.undo(ctx.conn, ctx.runtime(args.dry_run), ctx.state(), key, title, args.dry_run)
        if not args.dry_run:
            print(f"Domain '{name}': its last repair undone ({len(back)} "
                  f"change{'s' if len(back) != 1 else ''} put back)")
        elif not back:
            title("would only forget the last repair (what it moved has ended)")
        return 0
    done, left = drift.repair(ctx.conn, ctx.runtime(args.dry_run), ctx.state(), ctx.host, key,
                              title, args.dry_run)
    for d in left:
        title(f"not repairable live: {d.message}")
    if not done and not left:
        print(f"nothing to repair: domain '{name}' runs as its plan places it")
    elif done and not args.dry_run:
        print(f"Domain '{name}': {len(done)} difference{'s' if len(done) > 1 else ''} from its plan "
              "repaired")
    # What only a restart fixes is still there: the plan does not fit live.
    return EXIT_DOES_NOT_FIT if left else 0


def _repair_pve(ctx, node: Node, name: str, dry_run: bool, title) -> int:
    """A Proxmox VM: its QEMU's threads pinned as its post-start pins them."""
    from vstor.pve import manage, pinning
    vm = vmid_of(name)
    state = ctx.state()
    with state.record_lock(name, dry_run=dry_run):
        if state.load(name) is None:
            raise DoesNotFit(f"vstor holds nothing for VM {vm}: there is nothing to repair",
                             hint="see: vstor status")
        plan = manage.recorded_plan(manage.load(node, vm))
        found = pinning.running(node, vm)
        wrong = pinning.check(plan, found)
        if not wrong:
            print(f"nothing to repair: VM {vm}'s threads run where its plan pins them")
            return 0
        if dry_run:
            for line in wrong:
                title(f"would pin again: {line}")
            for line in pinning.describe(plan):
                say(f"    {line}")
            return 0
        moved = pinning.apply(plan, found)
    print(f"VM {vm}: {moved} QEMU thread{'s' if moved != 1 else ''} pinned again as its plan says")
    return 0
