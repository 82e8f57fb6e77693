"""attach, detach: a vstor disk into or out of a running domain."""

from __future__ import annotations

import re

from vstor.cli.context import say
from vstor.errors import BadInput, DoesNotFit, VstorError
from vstor.meta.document import Domain, load_disk
from vstor.planner.placement import counted
from vstor.runtime import hotplug, virt
from vstor.runtime.hotplug import spare_ports


def register(sub) -> None:
    p = sub.add_parser("attach", help="hot-plug a vstor disk into a running domain: plan it on "
                                      "the domain's node, make its backend, attach it")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("disk", metavar="DISK.xml", help="a file with one <vstor:disk> element")
    p.add_argument("--persistent", action="store_true",
                   help="also add it to the persistent definition (as attach-device --config)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, changes and device XML")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("detach", help="unplug a vstor disk from a running domain: the guest lets "
                                      "go first, then the backend goes")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("target", metavar="TARGET", help="the disk's target, e.g. vdc")
    p.add_argument("--persistent", action="store_true",
                   help="also remove it from the persistent definition")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long the guest has to let go (default 30)")
    p.add_argument("--dry-run", action="store_true", help="print what would happen")
    p.set_defaults(func=cmd_detach)


def _running(ctx, name: str):
    """The running domain's live XML (as vstor's Domain) and its LiveDomain."""
    found = virt.lookup(ctx.conn, name)
    if not found.isActive():
        raise DoesNotFit(f"domain '{name}' is not running",
                         hint="hot-plug is for running domains: edit its vstor metadata and "
                              f"run vstor apply {name}")
    guest = virt.LiveDomain(ctx.conn, found)
    dom = guest.current()
    if not dom.has_vstor():
        raise BadInput(f"domain '{name}' has no vstor metadata: vstor adds disks to the plan "
                       "it runs with", hint=f"give it a vstor disk and vstor apply {name} "
                                            "while it is stopped")
    return dom, guest


def cmd_attach(ctx, args) -> int:
    disk = load_disk(args.disk)
    dom, guest = _running(ctx, args.domain)
    plan = hotplug.attach(ctx.runtime(args.dry_run), ctx.state(), ctx.host, dom, disk, guest,
                          args.persistent, say)
    d = plan.disk(disk.target)
    how = f"{d.mode} on {d.backend}" + (f", socket {d.socket}" if d.socket else "")
    verb = "would attach" if args.dry_run else "attached"
    print(f"{verb} {d.target} to {args.domain} ({how}; {'; '.join(d.reasons)})")
    return 0


def cmd_detach(ctx, args) -> int:
    if not re.fullmatch(r"vd[a-z]{1,3}", args.target):
        raise BadInput(f"'{args.target[:40]}' is not a vstor disk target", hint="like vdb or vdc")
    if not 0 < args.timeout <= 3600:
        raise BadInput(f"--timeout {args.timeout:g} is not from 0 to 3600 seconds")
    dom, guest = _running(ctx, args.domain)
    hotplug.detach(ctx.runtime(args.dry_run), ctx.state(), dom, args.target, guest,
                   args.timeout, args.persistent, say)
    print(f"{'would detach' if args.dry_run else 'detached'} {args.target} from {args.domain}")
    return 0


# -- spare ports, for status and plan ------------------------------------------------------

def hotplug_text(ports: tuple[int, ...] | None) -> str | None:
    """A domain's spare PCIe root ports (vstor.runtime.hotplug.spare_ports),
    where `vstor attach` puts a disk live; None when it has no such ports
    to count (i440fx)."""
    if ports is None:
        return None
    if len(ports) == 1:
        return counted(ports[0], "spare PCIe root port")
    return "spare PCIe root ports per guest cell: " + ", ".join(f"{i}: {n}" for i, n in enumerate(ports))


def spare_ports_of(ctx, records, said: dict[str, str]) -> dict[str, list[int]]:
    """Per domain libvirt has, its spare PCIe root ports per guest cell
    (vstor.runtime.hotplug.spare_ports), from its live XML while it runs;
    a domain whose XML cannot be read is left out (null: not known)."""
    import libvirt
    out = {}
    for r in records:
        if said.get(r.domain) in (None, "not defined", "libvirt unreachable"):
            continue
        try:
            dom = Domain.parse(ctx.conn.lookupByName(r.domain).XMLDesc(0), f"domain '{r.domain}'")
        except (VstorError, libvirt.libvirtError):
            continue
        ports = spare_ports(dom, max(len(r.holding.get("cells") or ()), 1))
        if ports is not None:
            out[r.domain] = list(ports)
    return out
