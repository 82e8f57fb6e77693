"""status, prepare, release, gc: the host side of running domains (the hook: vstor.cli.hooks)."""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

from vstor.backends.qsd import daemon
from vstor.cli.context import say
from vstor.cli.domains import is_file, load_source
from vstor.cli.hooks import register as hooks_register
from vstor.cli.hotplug import hotplug_text, spare_ports_of
from vstor.errors import ActionFailed, BadInput, InUse, Unavailable
from vstor.formats.pve.vm import vmid_of
from vstor.meta.names import is_safe_name
from vstor.migration import peer
from vstor.pve.node import Node, RunGuard
from vstor.runtime import actions, gc, supervise, virt
from vstor.runtime.lifecycle import health, prepare, release
from vstor.runtime.state import PREPARED, REPAIRED, DamagedRecord


def register(sub) -> None:
    p = sub.add_parser("status", help="what vstor holds on this host, per domain")
    p.add_argument("domain", metavar="DOMAIN", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("prepare", help="create a domain's backends now (what the hook does "
                                       "before QEMU starts), e.g. for Proxmox or Nova hosts")
    p.add_argument("source", metavar="FILE|DOMAIN")
    p.add_argument("--dry-run", action="store_true", help="print the changes and SPDK RPCs, make none")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("release", help="undo everything vstor holds for a domain that is not running")
    p.add_argument("domain", metavar="DOMAIN")
    p.add_argument("--dry-run", action="store_true", help="print what would be undone")
    p.add_argument("--force", action="store_true",
                   help="even if libvirt says it runs, or QEMU is still connected to its SPDK disks")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("gc", help="release what vstor holds for domains that no longer run")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("supervise", help="start a qemu-storage-daemon again when it dies while its "
                                         "domain runs (one per host; each start starts one if need be)")
    p.add_argument("--idle", type=float, default=supervise.IDLE, metavar="SECONDS",
                   help=f"exit after SECONDS with nothing to watch (default {supervise.IDLE:g}; 0: never)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--start", action="store_true",
                     help="start one in the background unless one runs (what each start does), and return")
    how.add_argument("--stop", action="store_true", help="stop the one that runs (a package's removal)")
    p.set_defaults(func=cmd_supervise)

    hooks_register(sub)


def headed(title: str):
    """say, with `title` printed before the first line: a run refused
    before it changes anything prints its refusal alone.  Called with no
    message: the title alone, unless it was printed."""
    untold = [title]

    def first_titled(message: str | None = None) -> None:
        if untold:
            print(untold.pop(), flush=True)
        if message is not None:
            say(message)
    return first_titled


# -- status ---------------------------------------------------------------------------

def cmd_status(ctx, args) -> int:
    damaged: list[str] = []
    records = ctx.state().records(damaged)
    for problem in damaged:
        print(f"vstor: warning: {problem}", file=sys.stderr)
    if args.domain:
        records = [r for r in records if r.domain == args.domain]
        if not records:
            raise BadInput(f"vstor holds nothing for domain '{args.domain}'",
                           hint="see: vstor status")
    rt = ctx.runtime()
    elsewhere = _pve_elsewhere(ctx, records)
    pinned = _pve_pinning(ctx, records, elsewhere)
    said = _libvirt_says(ctx, [r.domain for r in records if r.domain not in elsewhere])
    drifted = _drift(ctx, rt, records, said)
    spare = spare_ports_of(ctx, records, said)
    spdk_pid = _spdk_pid(rt) if any(e.get("kind", "").startswith("spdk")
                                    for r in records for e in r.steps) else None
    state = ctx.state()
    rows = [{"domain": r.domain, "status": r.status, "libvirt": said.get(r.domain),
             "holding": r.holding, "elsewhere": elsewhere.get(r.domain),
             "problem": (_left_behind(r, said.get(r.domain)) or "; ".join(supervise.failures(state, r))
                         or _unfinished_repair(r) or pinned.get(r.domain, (None, None))[1]
                         or drifted.get(r.domain, (None, None))[1] or None),
             "pinning": pinned.get(r.domain, (None, None))[0],
             "drift": drifted.get(r.domain, (None, None))[0],
             "migration": {k: v for k, v in r.migration.items() if k != "xml"} or None,
             "repair": r.repair or None,
             "spare_ports": spare.get(r.domain),
             "steps": [{"step": s, "state": st, "problem": p, **labelled(entry, spdk_pid)}
                       for entry, (s, st, p) in zip(r.steps, health(rt, r))]}
            for r in records]
    # Like doctor's failed check: a step with a problem, or a record that
    # cannot be read, is exit 1 once everything has been printed.
    code = 1 if damaged or any(row["problem"] or row["drift"] or any(s["problem"] for s in row["steps"])
                               for row in rows) else 0
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return code
    if not rows:
        print("vstor holds nothing on this host")
    elif (ctx.config.supervise and not supervise.running(ctx.config.state_dir)
          and any(e.get("kind") == "qsd-export" for r in records for e in r.steps)):
        print("no supervisor runs: a qemu-storage-daemon that dies stays dead until one does "
              "(the next start, vstor gc, or: vstor supervise --start)")
    for row in rows:
        h = row["holding"]
        cpus = ",".join(map(str, h.get("cpus", []))) or "none dedicated"
        libvirt = f"; libvirt: {row['libvirt']}" if row["libvirt"] else ""
        where = (f"guest cells {', '.join(f'{c} on node {n}' for c, n in h['cells'])}"
                 if h.get("cells") else f"node {h.get('node')}")
        print(f"{row['domain']}: {row['status']}{libvirt}; {where}; CPUs {cpus}; "
              f"sockets {', '.join(h.get('sockets', [])) or 'none'}")
        if row["problem"]:
            print(f"  PROBLEM: {row['problem']}")
        for d in row["drift"] or ():
            fix = f" (fix: vstor repair {row['domain']})" if d["repairable"] else ""
            print(f"  PROBLEM: {d['message']}{fix}")
        if row["pinning"]:
            print(f"  pinned by vstor at post-start: {'; '.join(row['pinning'])}")
        if (row["repair"] or {}).get("status") == REPAIRED:
            n = len(row["repair"]["changes"])
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["repair"]["at"]))
            print(f"  last repair: {n} change{'s' if n != 1 else ''} at {when} "
                  f"(vstor repair {row['domain']} --undo puts them back)")
        if hotplug_text(row["spare_ports"]):
            print(f"  hot-plug: {hotplug_text(row['spare_ports'])}")
        m = row["migration"] or {}
        if row["status"] == "exporting":
            print(f"  runs on {m.get('to') or 'another host'}, reading its disk through this host's "
                  "NVMe-oF export (vstor gc removes it once the domain has left there)")
        elif m.get("role") == "incoming":
            print(f"  held for an incoming migration from {m.get('from') or 'another host'}")
        elif m.get("role") == "outgoing":
            print(f"  migrating to {m.get('to')} (vstor migrate finish or abort {row['domain']})")
        elif row.get("elsewhere"):
            print(f"  {row['elsewhere']}")
        for s in row["steps"]:
            mark = "ok" if s["problem"] is None else f"PROBLEM: {s['problem']}"
            pid = f" ({s['daemon']} pid {s['pid']})" if s.get("pid") and s["problem"] is None else ""
            print(f"  {s['step']}: {mark}{pid}")
    return code


# How long after its prepare a domain may still be shut off: libvirt starts
# QEMU once the prepare hook has returned.
STARTING = 60.0


def _left_behind(rec, libvirt: str | None) -> str | None:
    """A domain libvirt has stopped whose backends vstor still holds: its
    stop's release did not run or failed (the hook then logs why).  Not
    'crashed': a guest that panicked with on_crash='preserve', whose QEMU
    libvirt keeps running on those backends (a QEMU that died is 'shut off')."""
    if (rec.status != PREPARED or libvirt != "shut off" or not rec.steps
            or time.time() - rec.updated < STARTING):
        return None
    return (f"libvirt says {libvirt} but vstor still holds its backends (its stop's release "
            f"did not run or failed: see journalctl -t vstor); fix: vstor release {rec.domain}, "
            "or vstor gc")


def _unfinished_repair(rec) -> str | None:
    """A repair of a running domain (or its undo) that was killed half-way."""
    if rec.status != PREPARED or not rec.repair:
        return None
    from vstor.runtime import drift
    return drift.unfinished(rec)


def labelled(entry: dict, spdk_pid: int | None) -> dict:
    """A recorded step as labelled fields (docs/operations.md, `status
    --json`): its kind, what it made, and the daemon serving it with its
    pid (None when it does not run)."""
    try:
        a = actions.from_json(entry)
    except ActionFailed:
        return {"kind": entry.get("kind")}
    if a.kind == "qsd-export":
        e = a.export
        return {"kind": a.kind, "name": e.name, "source": e.source, "socket": e.socket_path,
                "daemon": "qemu-storage-daemon", "pid": daemon.pid(e)}
    if a.kind == "spdk-vhost":
        return {"kind": a.kind, "name": a.ctrlr, "bdev": a.bdev, "socket": a.socket,
                "reactor": a.reactor, "daemon": "spdk", "pid": spdk_pid}
    if a.kind == "spdk-attach":
        return {"kind": a.kind, "name": a.name, "addresses": [p.traddr for p in a.paths],
                "daemon": "spdk", "pid": spdk_pid}
    if a.kind == "nvmf-export":
        return {"kind": a.kind, "name": a.nqn, "bdev": a.bdev,
                "address": f"{a.trtype} {a.traddr}:{a.trsvcid}", "host": a.host,
                "daemon": "spdk", "pid": spdk_pid}
    return {"kind": a.kind, "name": actions.identity(a)[1]}


def _spdk_pid(rt) -> int | None:
    """The SPDK application's pid as it reports it; None when it cannot be
    asked (its steps then say what is wrong)."""
    try:
        return rt.spdk.app_pid()
    except Exception:       # noqa: BLE001 (health() reports SPDK's absence per step)
        return None


def _libvirt_says(ctx, names: list[str]) -> dict[str, str]:
    """Per domain, what libvirt says (running, paused, shut off, not
    defined), next to what vstor holds; 'libvirt unreachable' when it
    cannot be asked.  Proxmox VMs are qemu-server's (_pve_elsewhere)."""
    if any(vmid_of(n) for n in names) and Node(ctx.config).is_proxmox():
        names = [n for n in names if not vmid_of(n)]
    out = dict.fromkeys(names, "libvirt unreachable")
    try:
        for name in names:
            out[name] = virt.state(ctx.conn, name)
    except Unavailable:
        pass
    return out


def _pve_elsewhere(ctx, records) -> dict[str, str]:
    """Proxmox VMs vstor holds for that do not run on this node (stopped
    without post-stop, or migrated away: the source gets no stop phases)."""
    node = Node(ctx.config)
    if not node.is_proxmox():
        return {}
    return {r.domain: f"VM {vmid_of(r.domain)} does not run on this node (vstor gc releases it)"
            for r in records if vmid_of(r.domain) and not node.running(vmid_of(r.domain))}


STATUS_QMP_SECONDS = 3.0      # each step with a hung QEMU's monitor waits this long


def _pve_pinning(ctx, records, elsewhere) -> dict[str, tuple[list[str] | None, str | None]]:
    """Per Proxmox VM running here: (what its post-start pinned, as the
    plan says it; a problem: a thread not where the plan pins it, or a
    monitor or plan that cannot be read)."""
    vms = [(r.domain, vmid_of(r.domain)) for r in records
           if vmid_of(r.domain) and r.domain not in elsewhere and r.status == PREPARED]
    if not vms:
        return {}
    from vstor.pve import manage, pinning
    node, out = Node(ctx.config), {}
    for name, vm in vms:
        try:
            plan = manage.recorded_plan(manage.load(node, vm))
            lines = pinning.describe(plan)
            wrong = pinning.check(plan, pinning.running(node, vm, timeout=STATUS_QMP_SECONDS))
        except (ActionFailed, Unavailable, BadInput) as e:
            out[name] = (None, f"cannot check its threads' pinning: {e}")
            continue
        hook = os.path.join(node.snippets().snippets, "vstor")
        out[name] = (lines, f"{'; '.join(wrong)} (post-start did not pin it, or somebody moved it "
                            f"since: see journalctl -t vstor; fix: {hook} {vm} post-start)"
                     if wrong else None)
    return out


def _drift(ctx, rt, records, said) -> dict[str, tuple[list[dict] | None, str | None]]:
    """Per libvirt domain running here: (how it differs from its plan,
    vstor.runtime.drift; a problem: what could not be read to tell).  A
    Proxmox VM's drift is its pinning (_pve_pinning)."""
    from vstor.runtime import drift
    out = {}
    for r in records:
        if said.get(r.domain) not in ("running", "paused") or r.status != PREPARED:
            continue
        try:
            out[r.domain] = ([d.to_json() for d in drift.find(ctx.conn, rt, r)], None)
        except (ActionFailed, Unavailable, BadInput) as e:
            out[r.domain] = (None, f"cannot check whether it runs as planned: {e}")
    return out


# -- prepare / release / gc -------------------------------------------------------------

def cmd_prepare(ctx, args) -> int:
    dom = load_source(ctx, args.source)
    if is_file(args.source):
        _refuse_unrendered(dom, args.source)
    say = headed(f"Preparing {dom.name}{' (dry run)' if args.dry_run else ''}:")
    rec = prepare(ctx.runtime(args.dry_run), ctx.state(), ctx.host, dom, progress=say)
    if args.dry_run:
        say()       # a dry run that would change nothing says so by its title alone
    else:
        print(f"Domain '{dom.name}' prepared: {len(rec.steps)} host changes recorded")
    return 0


def _refuse_unrendered(dom, path: str) -> None:
    """An annotated file that was never rendered: its domain may not even be
    defined, so `vstor apply NAME` (the fix for a defined domain) is the
    wrong advice; rendering (or defining) the file is the right one."""
    dom.intent()                # a bad intent is the first reason
    if dom.recorded_plan() is None:
        out = f"{os.path.splitext(path)[0]}-rendered.xml"
        raise BadInput(f"{path}: domain '{dom.name}' has vstor metadata but no plan",
                       hint=f"render it: vstor render {path} -o {out}, then vstor prepare {out}; "
                            f"or define it: vstor define {path}")


def is_running(ctx, name: str) -> bool | None:
    """True or False as libvirt (or, for a Proxmox VM, qemu-server's pid
    file) says; None when vstor cannot tell."""
    import libvirt
    node = Node(ctx.config)
    if vmid_of(name) and node.is_proxmox():
        return node.running(vmid_of(name))
    try:
        conn = ctx.conn
    except Unavailable:
        return None
    try:
        return bool(conn.lookupByName(name).isActive())
    except libvirt.libvirtError as e:
        return False if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN else None


def cmd_release(ctx, args) -> int:
    node = Node(ctx.undoing().config)
    if vmid_of(args.domain) and node.is_proxmox() and not args.force:
        # Under the VM's config lock: no start between the check and the release.
        with RunGuard(node, args.domain) as why:
            if why:
                raise InUse(f"VM {vmid_of(args.domain)}: {why}; its backends are in use",
                                 hint="stop it first (post-stop then releases), or --force")
            return _release(ctx, args)
    return _release(ctx, args)


def _release(ctx, args) -> int:
    if not args.force:
        running = is_running(ctx, args.domain)
        if running is None:
            raise Unavailable(f"cannot tell from libvirt whether domain '{args.domain}' runs",
                              hint="start libvirtd, or --force if you know it is stopped")
        if running:
            raise InUse(f"domain '{args.domain}' is running; its backends are in use",
                           hint="stop it first (the hook then releases), or --force")
    key = key_of(ctx, args.domain)
    say = headed(f"Releasing {args.domain}{' (dry run)' if args.dry_run else ''}:")
    rec = release(ctx.runtime(args.dry_run, args.force), ctx.state(), key, progress=say)
    if rec is None:
        print(f"vstor holds nothing for domain '{args.domain}'")
    elif not args.dry_run:
        print(f"Domain '{args.domain}' released")
    return 0


def key_of(ctx, name: str) -> str:
    """The key of domain `name`'s record.  A safe name is its own key
    (vstor.meta.names.safe_key): that one record is read, unless it is
    another domain's.  Any other name's record is under its UUID, found
    among every record."""
    state = ctx.state()
    if is_safe_name(name):
        rec = state.load(name)
        if rec is None or rec.domain == name:
            return name
    damaged: list[str] = []
    for rec in state.records(damaged):
        if rec.domain == name:
            return rec.key
    if damaged:     # one of them may be this domain's
        raise DamagedRecord(f"{damaged[0]}; it may be domain '{name}''s")
    if not is_safe_name(name):
        raise BadInput(f"vstor holds nothing for domain '{name}'")
    return name


def cmd_gc(ctx, args) -> int:
    state = ctx.undoing().state()
    node = Node(ctx.config)
    records, damaged = gc.read_records(state, args.dry_run)     # before what runs is asked: see gc.collect
    running = _running(ctx, records, node)
    if not gc.collect(ctx.runtime(args.dry_run), state, records, running, say=print, step=say,
                      guard=lambda rec: RunGuard(node, rec.domain), damaged=damaged,
                      ask=partial(peer.status, ctx.config)):
        print("Nothing to collect")
    if not args.dry_run:
        supervise.ensure(ctx.config, ctx.host_root)     # the timer's run starts one that died
    return 0


def cmd_supervise(ctx, args) -> int:
    from vstor.backends.qsd import monitor, proc  # noqa: F401 (loaded now: an upgrade may replace them)
    state = ctx.state()
    if args.stop:
        if supervise.stop(state.path):
            print(f"stopped the supervisor of {state.path}")
        return 0
    if not os.path.isdir(state.domains):
        return 0        # nothing prepared here
    if args.start:
        supervise.ensure(ctx.config, ctx.host_root)
        return 0
    if not supervise.run(ctx.runtime(), state, args.idle or None):
        print(f"a supervisor already runs for {state.path}")
    return 0


def _running(ctx, records, node) -> set[str]:
    """The names of the domains and Proxmox VMs that run here.  gc must know
    what runs: without libvirt it would remove live backends.  Proxmox VMs
    (records named pve-VMID) are judged by qemu-server's pid files, the rest
    by libvirt; each release is checked again under the VM's config lock
    (RunGuard), so no start begins on what gc releases."""
    pve = {vmid_of(r.domain) for r in records if vmid_of(r.domain)}
    if pve and not node.is_proxmox():
        raise Unavailable(f"vstor holds Proxmox VMs here but {node.etc}/qemu-server is missing "
                          "(is pmxcfs running?): cannot tell which run",
                          hint="start pve-cluster, then run vstor gc again")
    running = {f"pve-{vm}" for vm in pve if node.running(vm)}
    if any(not vmid_of(r.domain) for r in records):
        running |= {d.name() for d in virt.all_domains(ctx.conn) if d.isActive()}
    return running
