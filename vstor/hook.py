"""The libvirt hook, past its fast path (hooks/vstor): a domain with vstor
metadata.  Never calls back into libvirt (that deadlocks libvirtd); logs
each host change and refusal with the domain name (vstor.log: the journal,
else syslog); one line on stderr when it refuses, which libvirt shows as
the reason `virsh start` failed."""

from __future__ import annotations

import os
import sys
import time

from vstor import config as config_mod
from vstor import counters
from vstor import log as vlog
from vstor.errors import EXIT_ERROR, VstorError, one_line


# What the hook (and Proxmox's hookscript) may import beyond vstor and the
# standard library.  Their Python starts with -S and the paths vstor was
# installed with; one of these not on those paths (installed since, or
# moved) sends the bootstrap to site, as a Python without -S would go.
NEEDS = ("lxml", "qemu", "spdk")


def missing() -> list[str]:
    """NEEDS not found on sys.path now (looked up, never imported)."""
    from importlib.machinery import PathFinder
    return [name for name in NEEDS if PathFinder.find_spec(name) is None]


def log(domain: str, message: str, priority: int = vlog.INFO) -> None:
    vlog.note(domain, message, priority)


def progress(domain: str):
    """What the hook does with a run's progress lines: each host change is
    logged with its result by the journal (vstor.runtime.journal), so only
    the warnings are logged here."""
    def say(message: str) -> None:
        if message.startswith("warning: "):
            vlog.note(domain, message[len("warning: "):], vlog.WARNING)
    return say


def run(argv: list[str], xml: bytes) -> int:
    if len(argv) < 2:
        print("vstor hook: expected <domain> <operation> <sub-operation> <extra>", file=sys.stderr)
        return EXIT_ERROR
    name, op = argv[0], argv[1]
    if op not in ("prepare", "release", "reconnect", "migrate"):
        # restore (and anything newer): print nothing, libvirt keeps the XML.
        return 0
    vlog.setup(f"hook {op}")
    began = time.monotonic()
    code = EXIT_ERROR
    try:
        code = _dispatch(name, op, xml, argv[3] if len(argv) > 3 else "-")
    except VstorError as e:
        vlog.refusal(f"{name}: {op} failed: {e}", e.exit_code, name)
        print(f"vstor: {e}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:      # never a traceback into libvirt's error message
        vlog.refusal(f"{name}: {op} failed: internal error: {type(e).__name__}: {e}", EXIT_ERROR, name)
        print(one_line(f"vstor: internal error in {op}: {type(e).__name__}: {e}"), file=sys.stderr)
    # Counted only for a vstor domain (_dispatch says where its counts go).
    counters.add("hook", ("libvirt", op, str(code)), time.monotonic() - began)
    return code


def _dispatch(name: str, op: str, xml: bytes, extra: str) -> int:
    from vstor.host.sysfs import SysFS
    from vstor.runtime.executor import Runtime
    from vstor.runtime.state import StateDir
    root = os.environ.get("VSTOR_HOST_ROOT", "/")
    if op == "release":     # what the record names is undone, whatever vstor.conf says now
        cfg = config_mod.for_undo(None, lambda m: log(name, m, vlog.WARNING))
    else:
        cfg = config_mod.load()
    if op in ("release", "reconnect"):
        # What to undo or check is in the state record: the domain's name
        # and UUID are all these read of its XML (no lxml, no planner).
        from vstor.meta.identity import read
        dom = read(xml, f"domain '{name}'")
        if not dom.vstor:
            return 0
        counters.at(cfg.state_dir)
        return _recorded(name, op, dom, Runtime(cfg, SysFS(root)), StateDir(cfg.state_dir), extra)
    from vstor.meta.document import Domain
    dom = Domain.parse(xml, f"domain '{name}'")
    if op == "prepare" and dom.is_nova():
        counters.at(cfg.state_dir)
        _nova_prepare(cfg, dom, name)       # before vstor's own prepare, disks or not
    if not dom.has_vstor():
        return 0        # the marker was only mentioned, e.g. in a description
    counters.at(cfg.state_dir)
    rt = Runtime(cfg, SysFS(root))
    state = StateDir(cfg.state_dir)
    if op == "migrate":
        # On the destination, before prepare: the XML the domain arrives
        # with, placed by the plan `vstor migrate prepare` made here.
        from vstor.runtime.incoming import arriving_xml
        sys.stdout.write(arriving_xml(state, dom))
        log(name, "incoming migration: placed by the plan made for it here")
    else:
        from vstor.host.read import read_host
        from vstor.runtime.lifecycle import prepare
        rec = prepare(rt, state, read_host(SysFS(root), processes=False), dom,
                      progress=progress(name))
        log(name, f"prepared: {len(rec.steps)} host changes recorded")
    return 0


def _recorded(name: str, op: str, dom, rt, state, extra: str) -> int:
    from vstor.runtime.recorded import reconnect, release
    if op == "release":
        rec = release(rt, state, dom.safe_name, progress=progress(name),
                      domain=dom.name, uuid=dom.uuid, migrated=extra == "migrated")
        log(name, "released" if rec else "nothing to release")
    else:
        for finding in reconnect(rt, state, dom.safe_name, dom.name, dom.uuid):
            log(name, f"reconnect: {finding}", vlog.WARNING)
    return 0


def _nova_prepare(cfg, dom, name: str) -> None:
    """A Nova instance whose flavor has vstor: extra specs: vstor's checks
    of the passthrough and placement Nova chose (vstor.nova.instance)."""
    from vstor.errors import DoesNotFit
    from vstor.nova import instance as nova
    inst = nova.find(dom.root)
    if inst is None:
        return
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    plan = dom.recorded_plan() if dom.has_vstor() else None
    found = nova.problems(read_host(SysFS(os.environ.get("VSTOR_HOST_ROOT", "/"))), cfg, inst,
                          has_disks=dom.has_vstor(),
                          reactors={d.target: d.reactor for d in plan.disks if d.reactor is not None}
                          if plan else None)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise DoesNotFit(f"Nova instance '{inst.name}' (flavor {inst.flavor}) cannot start: "
                         f"{found[0]}{more}", reasons=tuple(found),
                         hint="check the flavor's hw: extra specs and [pci] device_spec "
                              "(vstor nova config)")
    log(name, f"Nova instance (flavor {inst.flavor}): passthrough and placement checked")
