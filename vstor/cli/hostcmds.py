"""doctor, host show, host capture: what this host is and whether it is ready."""

from __future__ import annotations

import json
import os
import socket
import sys

from vstor import records
from vstor.backends import spdk_app
from vstor.backends.spdk import SpdkClient
from vstor.cli.hooks import HOOK_DIR, installed_hook_text, packaged, packaged_hook
from vstor.errors import EXIT_ERROR, VstorError
from vstor.host import doctor
from vstor.host.capture import capture
from vstor.host.model import format_cpulist
from vstor.host.read import block_source_lines
from vstor.runtime.actions import SpdkAttach, SpdkVhost


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check host readiness, one line per check with the fix")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    host = sub.add_parser("host", help="the host model vstor plans against")
    hsub = host.add_subparsers(dest="host_command", metavar="SUBCOMMAND")
    hsub.required = True
    p = hsub.add_parser("show", help="CPUs, NUMA nodes, hugepages, NVMe, RDMA as vstor sees them")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_host_show)
    p = hsub.add_parser("capture", help="save exactly the files vstor reads, for offline planning")
    p.add_argument("-o", "--output", metavar="FILE", help="tarball (default: vstor-host-HOSTNAME.tar.gz)")
    p.set_defaults(func=cmd_host_capture)


def cmd_doctor(ctx, args) -> int:
    host, cfg = ctx.host, ctx.config
    checks = doctor.run(host, cfg, [doctor.check_qsd(), *doctor.check_sources(cfg),
                                    _spdk_check(cfg), _libvirt_check(ctx), _hook_check(ctx),
                                    *doctor.check_nova_offers(host, os.path.join(ctx.host_root,
                                                                                  "etc/nova"))])
    if args.json:
        json.dump([records.asdict(c) for c in checks], sys.stdout, indent=2)
        print()
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            fix = f"  -> {c.fix}" if c.fix and c.status != doctor.OK else ""
            print(f"{c.status.upper():4}  {c.name.ljust(width)}  {c.detail}{fix}")
    return EXIT_ERROR if any(c.status == doctor.FAIL for c in checks) else 0


def _spdk_check(cfg):

    def probe() -> dict:
        with SpdkClient(cfg.spdk_socket, timeout=min(cfg.spdk_timeout, 5.0),
                        vhost_dir=cfg.vhost_dir, config=cfg.file) as client:
            return spdk_app.app_facts(client, SpdkAttach.rpc_methods + SpdkVhost.rpc_methods)
    return doctor.check_spdk(cfg, probe, spdk_app.SUPPORTED)


def _libvirt_check(ctx):
    try:
        major, rest = divmod(ctx.conn.getLibVersion(), 1000000)
        minor = rest // 1000
    except VstorError as e:
        return doctor.Check("libvirt", doctor.WARN, e.message, e.hint or "")
    if (major, minor) < (7, 1):
        return doctor.Check("libvirt", doctor.FAIL, f"libvirt {major}.{minor} has no vhostuser disks",
                            "upgrade to libvirt >= 7.1")
    return doctor.Check("libvirt", doctor.OK, f"libvirt {major}.{minor} at {ctx.conn.getURI()}")


def _hook_check(ctx):
    """The hook `vstor hooks install` puts in libvirt's qemu.d (under
    --host-root, as the host's other files), against what it would write now."""
    path = os.path.join(ctx.host_root, HOOK_DIR.lstrip("/"), "vstor")
    ours = packaged(os.path.join(HOOK_DIR, "vstor")) and ctx.host_root == "/"
    return doctor.check_hook(path, packaged_hook() if ours else installed_hook_text(ctx),
                             doctor.libvirt_daemons(os.path.join(ctx.host_root, "proc")),
                             packaged=ours)


def cmd_host_show(ctx, args) -> int:
    host = ctx.host
    if args.json:
        data = records.asdict(host)
        data.pop("extra", None)
        json.dump(data, sys.stdout, indent=2)
        print()
        return 0
    print(f"Host {host.hostname}: {len(host.cpus)} CPUs, {len(host.nodes)} NUMA node{'s' if len(host.nodes) != 1 else ''}, "
          f"IOMMU {'on' if host.iommu_enabled else 'off'}, "
          f"vfio-pci {'yes' if host.vfio_available else 'no'}")
    for node in host.nodes:
        pages = ", ".join(f"{p.free}/{p.total} x {p.size_kib} KiB" for p in node.hugepages if p.total)
        print(f"  node {node.id}: CPUs {format_cpulist(node.cpus)}; "
              f"{node.memory_kib // 1048576} GiB; hugepages {pages or 'none'}")
    for c in host.controllers:
        use = "; ".join(c.in_use) or "free"
        peers = f"; group shared with {', '.join(p.address for p in c.group_peers)}" if c.group_peers else ""
        print(f"  nvme {c.address} ({c.model or c.device}) node {c.numa_node} driver "
              f"{c.driver or 'none'} iommu group {c.iommu_group}{peers}: {use}")
        for ns in c.namespaces:
            print(f"    {ns.name} nsid {ns.nsid} {ns.size_bytes // 10**9} GB"
                  + (f": {'; '.join(ns.in_use)}" if ns.in_use else ""))
    for nic in host.rdma_nics:
        nets = ", ".join(f"{n.name} mtu {n.mtu}" for n in nic.netdevs)
        print(f"  rdma {nic.name} {nic.address} node {nic.numa_node} {nets}")
    print("\n".join(block_source_lines(host)))
    return 0


def cmd_host_capture(ctx, args) -> int:
    out = args.output or f"vstor-host-{socket.gethostname()}.tar.gz"
    paths = capture(ctx.host_root, out)
    print(f"Captured {len(paths)} paths to {out}; plan against it with: "
          f"mkdir h && tar -xzf {out} -C h && vstor --host-root h plan FILE")
    return 0
