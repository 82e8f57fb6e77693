"""vstor nova: OpenStack compute hosts."""

from __future__ import annotations

import argparse
import os
import re
import sys

from vstor.atomic import write_file
from vstor.backends.qsd.export import QsdExport
from vstor.cli import migrate
from vstor.cli.migrate import migrating
from vstor.errors import BadInput
from vstor.meta.names import is_safe_name
from vstor.migration import source
from vstor.nova import config as nova, install, placement

MAX_VHOST_DISKS = 100000


def register(sub) -> None:
    p = sub.add_parser("nova", help="OpenStack Nova: PCI passthrough and Placement config, flavors")
    nsub = p.add_subparsers(dest="nova_command", metavar="COMMAND")
    nsub.required = True
    q = nsub.add_parser("config", help="the [pci] and [compute] part of nova.conf for this host "
                                       "(and Placement's provider config file), or (--flavors) "
                                       "the flavor extra specs")
    q.add_argument("-o", "--output", metavar="FILE", help="write the nova.conf fragment here")
    q.add_argument("--flavors", action="store_true",
                   help="print `openstack flavor set` commands instead")
    q.add_argument("--flavor", metavar="NAME", help="the flavor to set (default: one per alias, "
                                                    "named after it)")
    q.add_argument("--page-size", choices=("2M", "1G"), help="hw:mem_page_size (default: large)")
    q.add_argument("--provider-config", metavar="FILE",
                   help="also write Placement's provider config file here (a .yaml in [compute] "
                        "provider_config_location, e.g. /etc/nova/provider_config/vstor.yaml)")
    q.add_argument("--vhost-disks", metavar="N", type=int,
                   help=f"the most vhost-user-blk disks each backend serves to Nova instances "
                        "here, in the provider config file (default: [nova] vhost_disks)")
    q.add_argument("--disk-spec", metavar="KEY=VALUE", action="append",
                   help="with --flavors: a flavor's vstor:disk.* extra spec, or vstor:numa or "
                        "hw:mem_page_size (repeat it); prints that flavor with the Placement "
                        "resources and traits its disks need (and hw:mem_page_size for SPDK disks: "
                        "--page-size, default large)")
    q.set_defaults(func=cmd_config)
    q = nsub.add_parser("install-driver", help="make vstor's compute driver loadable by Nova "
                                               "(compute_driver = vstor.VstorLibvirtDriver); a wheel "
                                               "or the Debian package already did")
    q.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    q.set_defaults(func=cmd_install_driver)
    q = nsub.add_parser("migrate", help="(run as root by vstor's Nova driver) a Nova instance's "
                                        "live migration: prepare the destination, finish, abort")
    q.add_argument("step", choices=("prepare", "finish", "abort"))
    q.add_argument("instance", metavar="INSTANCE", help="the libvirt domain name (instance-0000002a)")
    q.add_argument("--to", metavar="DEST", help="the destination compute host (prepare; finish "
                                                "and abort default to the one prepare recorded)")
    q.set_defaults(func=cmd_migrate)


def cmd_config(ctx, args) -> int:
    if args.flavor and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}", args.flavor):
        raise BadInput(f"--flavor '{args.flavor[:40]}' is not a flavor name vstor will print into a "
                       "command", hint="letters, digits and _.:-")
    if args.disk_spec:
        if not (args.flavors and args.flavor):
            raise BadInput("--disk-spec describes a flavor's disks", hint="--flavors --flavor NAME")
        page = {"2M": "2MB", "1G": "1GB"}.get(args.page_size)
        print("\n".join(placement.disk_flavor_command(_specs(args.disk_spec), args.flavor, page)))
        return 0
    if args.provider_config or args.output:
        _check_targets(args.provider_config, args.output)
    if args.vhost_disks is not None and not args.provider_config:
        raise BadInput("--vhost-disks is a count in the provider config file",
                       hint="--provider-config FILE --vhost-disks N")
    if args.vhost_disks is not None and not 1 <= args.vhost_disks <= MAX_VHOST_DISKS:
        raise BadInput(f"--vhost-disks {args.vhost_disks} is not a count Placement takes here",
                       hint=f"1 to {MAX_VHOST_DISKS}")
    s = nova.setup(ctx.host, ctx.config, ctx.ledger())
    if args.flavors:
        if not s.offers:
            raise BadInput("no NVMe controller here can be offered to Nova",
                           hint="see: vstor nova config (each excluded one with why)")
        page = {"2M": 2048, "1G": 1048576}.get(args.page_size)
        print("\n".join(nova.flavor_commands(s, args.flavor, page)))
        return 0
    provider = None
    if args.provider_config:
        view = placement.view(ctx.host, ctx.config, len(s.offers), vhost_disks=args.vhost_disks or ctx.config.nova_vhost_disks,
                              qsd_installed=os.access(QsdExport.binary, os.X_OK))
        provider = placement.provider_yaml(view, ctx.host.hostname or "this host")
    text = nova.nova_conf(s, ctx.host.hostname or "this host",
                          os.path.dirname(args.provider_config) if provider else None)
    if provider:
        write_file(args.provider_config, provider)
        print(f"Wrote {args.provider_config}: {len(view.inventories)} inventories, "
              f"{len(view.traits)} traits", file=sys.stderr)
    if args.output:
        write_file(args.output, text)
        print(f"Wrote {args.output}: {len(s.offers)} controllers offered, {len(s.excluded)} not",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _specs(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not (key.startswith("vstor:disk.") or key in ("vstor:numa", "hw:mem_page_size")):
            raise BadInput(f"--disk-spec '{item[:60]}' is not vstor:disk.<...>=VALUE (or "
                           "vstor:numa, hw:mem_page_size)",
                           hint="like --disk-spec vstor:disk.vdb.file.path=/var/lib/vstor/images/db.raw")
        if key in out:
            raise BadInput(f"--disk-spec {key[:60]} is given twice")
        out[key] = value
    return out


def _check_targets(provider: str | None, output: str | None) -> None:
    """Before anything is written: a refusal leaves both files as they were."""
    if provider is not None:
        if not provider.endswith(".yaml"):
            raise BadInput(f"--provider-config {provider[:80]}: nova-compute loads only *.yaml files",
                           hint="like /etc/nova/provider_config/vstor.yaml")
        if not os.path.isabs(provider):
            raise BadInput(f"--provider-config {provider[:80]} is not an absolute path, and nova.conf "
                           "names its directory", hint="like /etc/nova/provider_config/vstor.yaml")
        if output and os.path.abspath(output) == provider:
            raise BadInput("-o and --provider-config name the same file", hint="two files")
    for path in (provider, output):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise BadInput(f"cannot write {path}: {folder} is not a directory this user can write",
                           hint=f"mkdir -p {folder}, or run as root")
        if os.path.isdir(path):
            raise BadInput(f"cannot write {path}: it is a directory", hint="name a file in it")


def cmd_install_driver(ctx, args) -> int:
    """Nothing in Nova's own package: see vstor.nova.install."""
    try:
        import nova.virt

        from vstor.nova import driver  # noqa: F401  (Nova's libvirt driver imports here)
    except ImportError as e:
        raise BadInput(f"Nova is not importable by this vstor ({e})",
                       hint="install vstor into nova-compute's environment: pip install 'vstor[nova]'") from None
    setup = install.plan(os.path.dirname(nova.virt.__file__))
    then = ("set [DEFAULT] compute_driver = vstor.VstorLibvirtDriver in nova.conf and restart "
            "nova-compute")
    if not setup.changes:
        print(f"Nova loads vstor's driver already (through {install.PTH} in {setup.site}, "
              f"installed with vstor); {then}")
        return 0
    for line in install.describe(setup):
        print(f"Would {line}" if args.dry_run else line[0].upper() + line[1:])
    if args.dry_run:
        return 0
    install.apply(setup)
    print(f"Nova loads vstor's driver now; {then}")
    return 0


def cmd_migrate(ctx, args) -> int:
    """`vstor migrate` for a Nova instance with vstor disks, and nothing
    else: the one command a sudoers line gives nova-compute."""
    name = args.instance
    if not is_safe_name(name):
        raise BadInput(f"'{name[:40]}' is not a Nova instance's domain name",
                       hint="like instance-0000002a")
    if args.step == "prepare":
        if not args.to:
            raise BadInput("prepare needs the destination", hint="--to DEST")
        peer, uri = migrate._peer(ctx, args.to)
        dom = _instance(ctx, name)
        verdict, _ = source.prepare(ctx.config, ctx.state(), dom, peer, uri, ctx.runtime())
        print(f"{peer.host} holds {name}'s vstor backends; Nova's migration may go ahead:")
        for d in verdict.disks:
            print(f"  {d.target}: {d.reason}")
        return 0
    if args.step == "abort" and not args.to and source.recorded_destination(ctx.state(), name) is None:
        print(f"no vstor migration of {name} is recorded here; nothing to abort")
        return 0
    step = migrate.cmd_finish if args.step == "finish" else migrate.cmd_abort
    return step(ctx, argparse.Namespace(domain=name, to=args.to, dry_run=False))


def _instance(ctx, name: str):
    """The instance as libvirt migrates it, if it is a Nova instance with
    vstor disks."""
    dom = migrating(ctx, name)
    if not (dom.is_nova() and dom.has_vstor()):
        raise BadInput(f"domain '{name}' is not a Nova instance with vstor disks",
                       hint="vstor migrate prepare is the command for other domains")
    return dom
