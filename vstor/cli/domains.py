"""plan, render, define, apply: from annotated XML to a defined domain."""

from __future__ import annotations

import json
import os
import sys

from vstor import records
from vstor.atomic import write_file
from vstor.cli.hotplug import hotplug_text
from vstor.errors import BadInput
from vstor.host import sources
from vstor.host.model import format_cpulist
from vstor.meta.document import Domain
from vstor.meta.names import gate_path
from vstor.meta.plan import Plan
from vstor.planner import Request, plan_domain
from vstor.render.libvirt import render, with_spares
from vstor.runtime import virt
from vstor.runtime.hotplug import spare_ports
from vstor.runtime.inventory import load_ledger, plans_cache, save_pending


def register(sub) -> None:
    p = sub.add_parser("plan", help="show what vstor would do for a domain, and why")
    p.add_argument("source", metavar="FILE|DOMAIN")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("render", help="print the concrete libvirt XML for an annotated domain")
    p.add_argument("source", metavar="FILE|DOMAIN")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("define", help="render an annotated domain and define it in libvirt")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--dry-run", action="store_true", help="print the XML, define nothing")
    p.add_argument("--replace", action="store_true", help="replace the definition of the domain of "
                   "that name with FILE, planned anew (its UUID kept)")
    p.set_defaults(func=cmd_define)

    p = sub.add_parser("apply", help="re-plan a defined domain (e.g. after `virsh define` "
                                     "of annotated XML) and redefine it")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--dry-run", action="store_true", help="print the XML, define nothing")
    p.set_defaults(func=cmd_apply)


# -- the work ----------------------------------------------------------------------

def is_file(source: str) -> bool:
    """A FILE|DOMAIN argument that names a file: a path, a name ending in
    .xml (a mistyped file, never looked up as a domain), or a file there."""
    return os.path.sep in source or source.endswith(".xml") or os.path.exists(source)


def load_source(ctx, source: str) -> Domain:
    """A file path, or else the name of a defined domain."""
    if is_file(source):
        if not os.path.lexists(source):
            raise BadInput(f"cannot read {source}: the file does not exist",
                           hint="give the annotated domain XML file, or the name of a defined domain")
        return Domain.load(source)
    return Domain.parse(virt.inactive_xml(virt.lookup(ctx.conn, source)), f"domain '{source}'")


def make_plan(ctx, dom: Domain, ledger=None) -> Plan:
    request = Request.from_domain(dom)
    plan = plan_domain(ctx.host, ctx.config, request, ledger if ledger is not None else ctx.ledger())
    sources.foresee(plan, ctx.config.images)
    return plan


def rendered(ctx, dom: Domain, ledger=None, spares: bool = True) -> tuple[Plan, Domain]:
    previous = _previous_plan(dom)
    plan = make_plan(ctx, dom, ledger)
    return plan, render(dom, plan, previous, spares, gate=gate_path(ctx.config.vhost_dir, dom.safe_name))


def _previous_plan(dom: Domain) -> Plan | None:
    """What vstor rendered last time (its devices are replaced); a record this
    vstor cannot read is re-planned from scratch."""
    try:
        return dom.recorded_plan()
    except BadInput:
        return None


def cmd_plan(ctx, args) -> int:
    if args.json:
        json.dump(plan_to_json(make_plan(ctx, load_source(ctx, args.source))), sys.stdout, indent=2)
        print()
        return 0
    plan, out = rendered(ctx, load_source(ctx, args.source))
    print(format_plan(plan, spare_ports(out, len(plan.guest_cells()))))
    return 0


def cmd_render(ctx, args) -> int:
    _, out = rendered(ctx, load_source(ctx, args.source))
    text = out.to_string()
    if args.output:
        write_file(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_define(ctx, args) -> int:
    dom = Domain.load(args.file)
    running = _replacing(ctx, dom, args.file) if args.replace else False
    try:
        code = _define(ctx, dom, args.dry_run)
    except BadInput as e:
        if "already exists" not in e.message:
            raise
        # `vstor apply NAME` would re-plan the definition libvirt has, not FILE.
        raise BadInput(e.message, hint=f"to replace domain '{dom.name}' with {args.file}: vstor define "
                                       f"--replace {args.file} (or virsh undefine {dom.name} first)") from None
    if running and not args.dry_run:
        print(f"Domain '{dom.name}' is running: the new definition and plan take effect at its next start")
    return code


def _replacing(ctx, dom: Domain, path: str) -> bool:
    """The FILE as the new definition of the defined domain of its name:
    that domain's UUID (libvirt replaces a definition of the same name and
    UUID); whether it runs.  A FILE with another UUID is another domain."""
    import libvirt
    try:
        old = ctx.conn.lookupByName(dom.name)
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return False            # nothing to replace: a plain define
        return virt.lookup(ctx.conn, dom.name).isActive()      # its refusal, in vstor's words
    uuid = old.UUIDString()
    if dom.uuid and dom.uuid.lower() != uuid.lower():
        raise BadInput(f"{path} has UUID {dom.uuid[:36]}, and the defined domain '{dom.name}' has {uuid}: "
                       "another domain of the same name", hint=f"remove <uuid> from {path} to replace "
                                                               f"'{dom.name}', or give it another name")
    if not dom.uuid:
        from lxml import etree
        elem = etree.Element("uuid")
        elem.text = uuid
        name = dom.root.find("name")
        name.addnext(elem) if name is not None else dom.root.insert(0, elem)
    return bool(old.isActive())


def cmd_apply(ctx, args) -> int:
    vdom = virt.lookup(ctx.conn, args.domain)
    dom = Domain.parse(virt.inactive_xml(vdom), f"domain '{args.domain}'")
    code = _define(ctx, dom, args.dry_run)
    if not args.dry_run and vdom.isActive():
        print(f"Domain '{args.domain}' is running: the new plan takes effect at its next start")
    return code


def _define(ctx, dom: Domain, dry_run: bool) -> int:
    conn = ctx.conn
    with ctx.planning(dry_run):     # the ledger read, the plan made and defined: one at a time
        plan, out = rendered(ctx, dom, load_ledger(conn, ctx.records(), plans_cache(ctx.config)), dry_run)
        if dry_run:
            sys.stdout.write(out.to_string())
            return 0
        _define_addressed(conn, plan.domain, out)
    save_pending()      # the other domains' holdings by their XML: the next plan reads them
    print(f"Domain '{plan.domain}' defined: " + ", ".join(
        f"{d.target} {d.mode}/{d.backend}" for d in plan.disks) + f", {where(plan)}")
    return 0


def _define_addressed(conn, name: str, out: Domain) -> None:
    """Define the rendered domain; then, once libvirt has placed every
    device, the spare root ports of its cells (a guest with cells: vstor's
    expander buses), above the ports libvirt made. A failure after the
    first define puts back what was defined before: the earlier
    definition, or none (a running domain that had none is transient
    again)."""
    before = None if virt.state(conn, name) == "not defined" else virt.lookup(conn, name)
    before_xml = virt.inactive_xml(before) if before is not None and before.isPersistent() else None
    defined = virt.define(conn, out.to_string())
    try:
        addressed = Domain.parse(virt.inactive_xml(defined, persistent=True), f"domain '{name}'")
        final = with_spares(addressed)
        if final.to_string() != addressed.to_string():
            virt.define(conn, final.to_string())
    except BaseException:
        if before_xml is not None:
            virt.define(conn, before_xml)
        else:
            defined.undefine()
        raise


# -- output ---------------------------------------------------------------------------

def plan_to_json(plan: Plan) -> dict:
    data = records.asdict(plan)
    for disk, raw in zip(plan.disks, data["disks"]):
        raw["source"] = {"kind": disk.source.kind, **raw["source"]}
    return data


def _source_text(src) -> str:
    if src.kind == "nvme":
        return f"nvme {src.controller} ns {src.namespace}"
    if src.kind == "nvmf":
        extra = f" +{len(src.paths)} paths" if src.paths else ""
        return f"nvmf/{src.transport} {src.traddr}:{src.trsvcid} ns {src.namespace}{extra}"
    return f"{src.kind} {src.path}"


def where(plan: Plan) -> str:
    """Where the plan puts the guest: its node, or its cells' nodes."""
    if not plan.cells:
        return f"node {plan.node}"
    return "guest cells " + ", ".join(f"{c.id} on node {c.node}" for c in plan.cells)


def format_plan(plan: Plan, spare: tuple[int, ...] | None = None) -> str:
    rows = [("DISK", "MODE", "BACKEND", "SOURCE", "ATTACHES AS", "REACTOR") + (("CELL",) if plan.cells else ())]
    for d in plan.disks:
        attach = d.socket if d.mode == "vhost" else f"hostdev {d.controller}"
        rows.append((d.target, d.mode, d.backend, _source_text(d.source), attach,
                     "-" if d.reactor is None else str(d.reactor))
                    + ((str(plan.disk_cell(d).id),) if plan.cells else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = f"NUMA node {plan.node}" if not plan.cells else where(plan).replace("guest cells", "NUMA cells")
    lines = [f"Domain {plan.domain} on {plan.host}: {head}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if plan.vcpu_pins:
        cpus = f"{plan.vcpus} dedicated -> {','.join(map(str, plan.vcpu_pins))}"
    else:
        cpus = f"{plan.vcpus} shared on {format_cpulist(plan.shared_cpus)}"
    lines.append(f"vCPUs:    {cpus}; emulator on {format_cpulist(plan.emulator)}")
    mem = f"{plan.memory_kib // 1024} MiB, {plan.numa}"
    if plan.hugepage_kib:
        mem += f", {plan.hugepages} x {plan.hugepage_kib} KiB hugepages"
    lines.append(f"Memory:   {mem}")
    if hotplug_text(spare):
        lines.append(f"Hot-plug: {hotplug_text(spare)}")
    lines.append("Why:")
    lines += [f"  - {r}" for r in plan.reasons]
    for d in plan.disks:
        lines += [f"  - {d.target}: {r}" for r in d.reasons]
    return "\n".join(lines)
