"""vstor nova: OpenStack compute hosts."""

from __future__ import annotations

import re
import sys

from vstor.errors import BadInput


def register(sub) -> None:
    p = sub.add_parser("nova", help="OpenStack Nova: PCI passthrough config and flavors")
    nsub = p.add_subparsers(dest="nova_command", metavar="COMMAND")
    nsub.required = True
    q = nsub.add_parser("config", help="the [pci] and [compute] part of nova.conf for this host, "
                                       "or (--flavors) the flavor extra specs")
    q.add_argument("-o", "--output", metavar="FILE", help="write the nova.conf fragment here")
    q.add_argument("--flavors", action="store_true",
                   help="print `openstack flavor set` commands instead")
    q.add_argument("--flavor", metavar="NAME", help="the flavor to set (default: one per alias, "
                                                    "named after it)")
    q.add_argument("--page-size", choices=("2M", "1G"), help="hw:mem_page_size (default: large)")
    q.set_defaults(func=cmd_config)
    q = nsub.add_parser("install-driver", help="make vstor's compute driver loadable by Nova "
                                               "(writes nova/virt/vstor.py into Nova's package)")
    q.set_defaults(func=cmd_install_driver)


def cmd_config(ctx, args) -> int:
    from vstor.nova import config as nova
    if args.flavor and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}", args.flavor):
        raise BadInput(f"--flavor '{args.flavor[:40]}' is not a flavor name vstor will print into a "
                       "command", hint="letters, digits and _.:-")
    s = nova.setup(ctx.host, ctx.config, ctx.ledger())
    if args.flavors:
        if not s.offers:
            raise BadInput("no NVMe controller here can be offered to Nova",
                           hint="see: vstor nova config (each excluded one with why)")
        page = {"2M": 2048, "1G": 1048576}.get(args.page_size)
        print("\n".join(nova.flavor_commands(s, args.flavor, page)))
        return 0
    text = nova.nova_conf(s, ctx.host.hostname or "this host")
    if args.output:
        from vstor.atomic import write_file
        write_file(args.output, text)
        print(f"Wrote {args.output}: {len(s.offers)} controllers offered, {len(s.excluded)} not",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


SHIM = ('"""Written by `vstor nova install-driver`: Nova loads compute drivers from\n'
        'nova.virt only.  compute_driver = vstor.VstorLibvirtDriver"""\n'
        "from vstor.nova.driver import VstorLibvirtDriver  # noqa: F401\n")


def cmd_install_driver(ctx, args) -> int:
    import os
    try:
        import nova.virt
        from vstor.nova import driver  # noqa: F401  (Nova's libvirt driver imports here)
    except ImportError as e:
        raise BadInput(f"Nova is not importable by this vstor ({e})",
                       hint="install vstor into nova-compute's environment: pip install vstor[nova]") from None
    from vstor.atomic import write_file
    target = os.path.join(os.path.dirname(nova.virt.__file__), "vstor.py")
    write_file(target, SHIM, hint="run as root")
    print(f"Wrote {target}; set [DEFAULT] compute_driver = vstor.VstorLibvirtDriver in nova.conf "
          "and restart nova-compute")
    return 0
