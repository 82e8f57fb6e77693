"""vstor migrate check | prepare | abort | finish, and the destination's agent."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from vstor.cli.domains import is_file, load_source
from vstor.cli.runtime import is_running, key_of
from vstor.errors import BadInput, DoesNotFit, VstorError
from vstor.host.sysfs import SysFS
from vstor.meta.document import Domain
from vstor.migration import agent, run, source
from vstor.migration.peer import Peer, destination
from vstor.migration.verdict import report
from vstor.runtime import virt
from vstor.runtime.lifecycle import release


def register(sub) -> None:
    m = sub.add_parser("migrate", help="live migration: check, prepare the destination, abort, finish")
    msub = m.add_subparsers(dest="migrate_command", metavar="STEP")
    msub.required = True
    p = msub.add_parser("check", help="can DOMAIN live-migrate to DEST: a verdict per disk, and "
                                      "whether DEST can take it")
    p.add_argument("domain", metavar="FILE|DOMAIN")
    p.add_argument("--to", required=True, metavar="DEST", help="host name or libvirt URI")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)
    p = msub.add_parser("prepare", help="make and hold DOMAIN's backends on DEST; write the XML it "
                                        "arrives with; print the virsh migrate command")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--to", required=True, metavar="DEST", help="host name or libvirt URI")
    p.add_argument("-o", "--output", metavar="FILE", help="destination XML (default: DOMAIN.DEST.xml)")
    p.add_argument("--cold", action="store_true", help="reserve DEST for a cold migration")
    p.add_argument("--run", action="store_true", help="then migrate it through libvirt, with progress; "
                   "finish on success, abort both sides on failure")
    p.add_argument("--dest-uri", metavar="URI", help="the destination's libvirt URI when it is not "
                   "qemu+ssh://DEST/system (qemu+tls://..., a local socket)")
    p.add_argument("--migrate-uri", metavar="URI", help="with --run: QEMU's migration stream address "
                   "(virsh --migrateuri), e.g. tcp://10.0.0.2")
    _dry_run(p)
    p.set_defaults(func=cmd_prepare)
    p = msub.add_parser("abort", help="give up what migrate prepare holds on the destination")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--to", metavar="DEST", help="(default: the destination prepare recorded)")
    _dry_run(p)
    p.set_defaults(func=cmd_abort)
    p = msub.add_parser("finish", help="after a migration: check the domain arrived, clean this host")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--to", metavar="DEST", help="(default: the destination prepare recorded, while "
                                                "this host still holds the domain)")
    _dry_run(p)
    p.set_defaults(func=cmd_finish)
    p = msub.add_parser("agent", help="(run by migrate on the destination) one JSON request "
                                      "on stdin, one JSON answer on stdout")
    p.set_defaults(func=cmd_agent)


def _dry_run(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="say what would be done, on both hosts; "
                   "change nothing (the destination is only asked read-only questions)")


def _peer(ctx, dest: str):
    host, uri = destination(dest)
    return Peer(ctx.config, host), uri


def _domain(ctx, source: str):
    return load_source(ctx, source) if is_file(source) else migrating(ctx, source)


def migrating(ctx, name: str):
    """A defined domain as libvirt migrates it: a running one as
    `virsh dumpxml --migratable` (virsh migrate --xml is checked against
    exactly that)."""
    import libvirt
    vdom = virt.lookup(ctx.conn, name)
    flags = libvirt.VIR_DOMAIN_XML_MIGRATABLE if vdom.isActive() else 0
    return Domain.parse(vdom.XMLDesc(flags), f"domain '{name}'")


def cmd_check(ctx, args) -> int:
    """This host's side first (what each disk needs on the destination),
    then the destination's answer; --json: one object (verdict.report),
    also when the destination does not answer."""
    dom = _domain(ctx, args.domain)
    peer, _ = _peer(ctx, args.to)
    sysfs = SysFS(ctx.host_root)
    looked = source.look(ctx.config, dom, sysfs)
    side = looked[-1]
    if not args.json:
        print(f"{dom.name} -> {peer.host}: on this host")
        for n in side:
            print(f"  {n.target}: needs {n.needs}: {n.reason}")
        print(f"asking {peer.host} ...", flush=True)
    try:
        verdict = source.check(ctx.config, dom, peer, sysfs, looked)
    except VstorError as e:
        if args.json:
            print(json.dumps(report(dom.name, peer.host, side, None, str(e)), indent=1))
        raise
    if args.json:
        print(json.dumps(report(dom.name, peer.host, side, verdict), indent=1))
        return 0 if verdict.live else 3
    print(f"{dom.name} -> {peer.host}: {verdict.verdict}"
          f"{'' if not verdict.problems else ', and it does not fit there'}")
    for d in verdict.disks:
        print(f"  {d.target}: {d.verdict}: {d.reason}")
        if d.fix:
            print(f"      fix: {d.fix}")
    for why in verdict.problems:
        print(f"  {peer.host} cannot take it: {why}")
    for line in verdict.placement:
        print(f"  on {peer.host}: {line}")
    return 0 if verdict.live else 3


def cmd_prepare(ctx, args) -> int:
    if args.cold and args.run:
        raise BadInput("--run migrates live; a cold migration waits for the domain to be shut down",
                       hint="drop --run, or --cold")
    if args.migrate_uri and not args.run:
        raise BadInput("--migrate-uri is for --run", hint="add --run, or give virsh --migrateuri yourself")
    dom = _domain(ctx, args.domain)
    peer, uri = _peer(ctx, args.to)
    uri = args.dest_uri or uri
    if args.dry_run:
        return _prepare_dry(ctx, args, dom, peer, uri)
    print(f"Preparing {peer.host} for {dom.name}:")
    verdict, xml = source.prepare(ctx.config, ctx.state(), dom, peer, uri, ctx.runtime(), cold=args.cold)
    for d in verdict.disks:
        print(f"  {d.target}: {d.reason}")
    out = args.output or f"{dom.name}.{peer.host}.xml"
    try:
        with open(out, "w") as f:
            f.write(xml)
    except OSError as e:
        raise BadInput(f"cannot write {out}: {e.strerror}", hint="pick another -o FILE") from None
    q = shlex.quote
    src = f" -c {q(ctx.args.connect)}" if ctx.args.connect else ""
    if args.cold:
        print(f"{peer.host} holds a place for {dom.name}; it arrives with {out}. Shut it down, then:")
        print(f"  virsh{src} migrate --offline --persistent --undefinesource --persistent-xml {q(out)} "
              f"{q(dom.name)} {q(uri)}")
        print(f"and start it on {peer.host}; that start makes its backends there")
    elif args.run:
        return _run(ctx, args, dom, peer, uri, xml)
    else:
        print(f"{peer.host} holds {dom.name}'s backends; it arrives with {out}. Migrate it with:")
        print(f"  virsh{src} migrate --live --persistent --undefinesource --persistent-xml {q(out)} "
              f"--xml {q(out)} {q(dom.name)} {q(uri)}")
    print(f"(then: vstor migrate finish {q(dom.name)} --to {q(peer.host)}; to give up: "
          f"vstor migrate abort {q(dom.name)} --to {q(peer.host)})")
    return 0


def _prepare_dry(ctx, args, dom, peer, uri: str) -> int:
    """What prepare would do, after every check it makes (the destination's
    read-only `check`): nothing is exported, held, written or recorded."""
    print(f"Preparing {peer.host} for {dom.name} (dry run):")
    verdict, exports = source.preflight(ctx.config, ctx.state(), dom, peer, SysFS(ctx.host_root), args.cold)
    for d in verdict.disks:
        print(f"  {d.target}: {d.reason}")
    for target, (step, _) in exports.items():
        print(f"  would export {target} ({step.bdev}) over NVMe-oF as {step.nqn} at {step.traddr} port "
              f"{step.trsvcid}, to host NQN {step.host} alone")
        for line in step.dry_run():
            print(f"      {line}")
    print(f"  would ask {peer.host} to {'reserve a place for' if args.cold else 'make and hold the backends of'} "
          f"{dom.name}" + "".join(f"; {line}" for line in verdict.placement[:1]))
    print(f"  would write the XML it arrives with to {args.output or f'{dom.name}.{peer.host}.xml'}")
    print(f"  would record the migration to {peer.host} in {dom.name}'s state record")
    if args.run:
        print(f"  would then migrate it live to {uri}, and finish (or abort both sides on failure)")
    return 0


def _run(ctx, args, dom, peer, uri: str, xml: str) -> int:
    """Migrate now; finish on success, give both sides back on failure."""
    print(f"Migrating {dom.name} to {peer.host}:", flush=True)
    try:
        stats = run.migrate(ctx.conn, dom.name, uri, xml, ctx.config.migrate_timeout,
                            lambda line: print(line, flush=True), args.migrate_uri)
    except BaseException:
        print(f"Giving up: releasing what {peer.host} holds for {dom.name}", flush=True)
        try:
            cmd_abort(ctx, argparse.Namespace(domain=dom.name, to=peer.host, dry_run=False))
        except Exception as e:      # the migration's own failure is the one to report
            print(f"vstor: warning: the abort failed too: {e}", file=sys.stderr)
        raise
    print(f"{dom.name} runs on {peer.host}: {run.completed(stats)}")
    return cmd_finish(ctx, argparse.Namespace(domain=dom.name, to=peer.host, dry_run=False))


def _recorded_peer(ctx, args):
    dest = args.to or source.recorded_destination(ctx.state(), args.domain)
    if not dest:
        raise BadInput(f"no migration of domain '{args.domain}' is recorded here",
                       hint="name the destination with --to")
    return _peer(ctx, dest)[0]


def cmd_abort(ctx, args) -> int:
    peer = _recorded_peer(ctx, args)
    uuid = _uuid_of(ctx, args.domain)
    if args.dry_run:
        return _abort_dry(ctx, args, peer, uuid)
    answer = peer.call("abort", name=args.domain, uuid=uuid)
    if source.unexport_all(ctx.state(), args.domain, ctx.runtime()):
        print(f"removed the NVMe-oF exports made for {peer.host}")
    source.forget(ctx.state(), args.domain)
    print(f"{peer.host}: {'released what was held for' if answer.get('aborted') else 'held nothing for'} "
          f"{args.domain}")
    return 0


def _abort_dry(ctx, args, peer, uuid) -> int:
    there = peer.call("status", name=args.domain, uuid=uuid)     # a read
    held = there.get("status")
    print(f"Aborting the migration of {args.domain} to {peer.host} (dry run):")
    print(f"  {peer.host}: " + (f"would release what it holds for {args.domain} ({held})" if held
                                else f"holds nothing for {args.domain}"))
    for rec in ctx.state().records():
        if rec.domain == args.domain:
            nqns = [e["data"].get("nqn") for e in rec.steps if e.get("kind") == "nvmf-export"]
            for nqn in nqns:
                print(f"  would remove the NVMe-oF export {nqn} made for {peer.host}")
            if rec.migration:
                print(f"  would forget the migration in {args.domain}'s state record")
    return 0


def cmd_finish(ctx, args) -> int:
    peer = _recorded_peer(ctx, args)
    there = peer.call("status", name=args.domain, uuid=_uuid_of(ctx, args.domain))
    arrived = there.get("status") == "prepared" or (there.get("cold") is True and there.get("status") == "incoming")
    if not arrived:
        if not there.get("status") and is_running(ctx, args.domain) is False:
            raise DoesNotFit(f"domain '{args.domain}' runs on neither host: {peer.host} holds nothing for "
                             "it and it does not run here (it stopped after the move, or was never started)",
                             hint=f"see virsh domstate {args.domain} on both hosts; "
                                  f"vstor migrate abort {args.domain} forgets the move")
        raise DoesNotFit(f"domain '{args.domain}' has not arrived on {peer.host} "
                         f"({there.get('status') or 'nothing held there'})",
                         hint=f"migrate it first, or: vstor migrate abort {args.domain}")
    if there.get("cold") is True:
        print(f"{args.domain} is defined on {peer.host}, and its first start there makes its backends")
    if is_running(ctx, args.domain) is not False:
        raise DoesNotFit(f"domain '{args.domain}' still runs here (or libvirt cannot say)",
                         hint="wait for the migration to complete")
    state = ctx.state()
    if args.dry_run:
        return _finish_dry(ctx, args, peer, state)
    if not any(r.domain == args.domain for r in state.records()):
        source.forget(state, args.domain)
        print(f"{args.domain} runs on {peer.host}; nothing of it is left here")
        return 0
    if any(r.domain == args.domain and r.status == "exporting" for r in state.records()):
        print(f"{args.domain} runs on {peer.host} and reads its local NVMe through this host's "
              f"NVMe-oF export, which stays until it leaves {peer.host} (vstor gc removes it then)")
        return 0
    rec = release(ctx.runtime(), state, key_of(ctx, args.domain), progress=lambda m: print(f"  {m}"))
    source.forget(state, args.domain)
    print(f"{args.domain} runs on {peer.host}; {'released its backends here' if rec else 'nothing left here'}")
    return 0


def _finish_dry(ctx, args, peer, state) -> int:
    """finish's checks passed (the destination asked read-only): what it would release here."""
    recs = [r for r in state.records() if r.domain == args.domain]
    print(f"{args.domain} runs on {peer.host} (dry run):")
    if not recs:
        print("  nothing of it is left here")
    elif any(r.status == "exporting" for r in recs):
        print(f"  its NVMe-oF export here stays while it runs on {peer.host} (vstor gc removes it then)")
    else:
        release(ctx.runtime(dry_run=True), state, key_of(ctx, args.domain),
                progress=lambda m: print(f"  {m}"))
    if any(r.migration for r in recs):
        print(f"  would forget the migration in {args.domain}'s state record")
    return 0


def _uuid_of(ctx, name: str) -> str | None:
    return next((r.uuid for r in ctx.state().records() if r.domain == name), None) or _libvirt_uuid(ctx, name)


def _libvirt_uuid(ctx, name: str) -> str | None:
    try:
        from vstor.runtime import virt
        return virt.lookup(ctx.conn, name).UUIDString()
    except Exception:
        return None


def cmd_agent(ctx, args) -> int:
    return agent.serve(ctx, sys.stdin.buffer)
