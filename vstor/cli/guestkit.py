"""guest-kit: the guest side of a passed-through controller (hugepages,
vfio-pci, its address in the guest, SPDK's environment), from the plan."""

from __future__ import annotations

import json
import sys

from vstor.cli.context import warn
from vstor.cli.domains import is_file, load_source
from vstor.errors import BadInput
from vstor.meta.document import Domain
from vstor.pve.node import Node
from vstor.render import guestkit, guestscript
from vstor.runtime import virt


def register(sub) -> None:
    p = sub.add_parser("guest-kit", help="the set-up a guest needs to run SPDK on a controller "
                                         "vstor passes through: a script for root in the guest")
    p.add_argument("source", metavar="DOMAIN|FILE",
                   help="a defined domain, or its XML as libvirt addressed it (virsh dumpxml)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--cloud-init", action="store_true",
                     help="as cloud-init user-data (#cloud-config) that installs and runs it")
    how.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_guest_kit)


def cmd_guest_kit(ctx, args) -> int:
    kit = guestkit.build(_domain(ctx, args.source), _host(ctx))
    if args.json:
        json.dump({**guestkit.to_json(kit), "script": guestscript.script(kit)}, sys.stdout, indent=2)
        print()
    elif args.cloud_init:
        sys.stdout.write(guestscript.cloud_config(kit))
    else:
        sys.stdout.write(guestscript.script(kit))
    return 0


def _domain(ctx, source: str):
    """A file, or a defined domain as libvirt has it now: live while it
    runs (the addresses it runs with), else its persistent definition."""
    if is_file(source):
        return load_source(ctx, source)
    if source.isdigit():
        if Node(ctx.config).is_proxmox():
            raise BadInput(f"'{source}' looks like a Proxmox VM: guest-kit covers libvirt domains "
                           "vstor renders, not Proxmox's or Nova's guests")
    found = virt.lookup(ctx.conn, source)
    xml = (virt.LiveDomain(ctx.conn, found).live_xml() if found.isActive()
           else virt.inactive_xml(found))
    return Domain.parse(xml, f"domain '{source}'")


def _host(ctx):
    """The host model, for the controllers' vendor:device and node; without
    it the guest's script checks the class only."""
    try:
        return ctx.host
    except BadInput as e:
        warn(f"{e}: the kit checks only that the guest's device is an NVMe controller")
        return None
