"""The Proxmox hookscript, past its file (hooks/proxmox/vstor): called as
`<script> <VMID> <phase>` by qemu-server.

- pre-start (the only phase whose failure aborts the start; it runs under
  the VM's config lock, with the config already read): check the recorded
  plan against the intent, the config and the host now, then create the
  backends.  A refusal is one line on stderr, which Proxmox shows in the
  task log, and a distinct exit code.  On a migration's target
  PVE_MIGRATED_FROM names the source node, whose directory holds the config.
- post-start (a failure is a warning in the task log; the VM runs on):
  pin each QEMU thread to its planned cores (vstor.pve.pinning), which
  qemu-server's one `taskset --all-tasks` set cannot.  qemu-server runs it
  after every start it makes: a cold start, a live migration's target (the
  guest paused, its vCPU threads there), a resume from hibernation.
- post-stop: release what pre-start made.  Proxmox does not call it on a
  migration's source, nor when QEMU failed to start: `vstor gc` releases
  the first, the next pre-start undoes the second.
"""

from __future__ import annotations

import os
import sys
import time

from vstor import config as config_mod, counters, log as vlog
from vstor.errors import EXIT_BAD_INPUT, EXIT_ERROR, BadInput, DoesNotFit, VstorError, one_line
from vstor.formats.pve.vm import name_of
from vstor.hook import progress
from vstor.meta.names import inside
from vstor.pve import manage, pinning, snippet
from vstor.pve.node import Node
from vstor.runtime.context import HostContext, host_root
from vstor.runtime.lifecycle import carry_out, release

PHASES = ("pre-start", "post-start", "pre-stop", "post-stop")


def log(vmid: str, message: str, priority: int = vlog.INFO) -> None:
    """vstor's log (vstor.log), with the VM's record name as its domain."""
    vlog.note(f"pve-{vmid}" if vmid.isdigit() else None, f"VM {vmid}: {message}", priority)


def run(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in PHASES:
        print("vstor hookscript: expected <VMID> <pre-start|post-start|pre-stop|post-stop>",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    vmid, phase = argv
    if phase == "pre-stop":
        return 0
    vlog.setup(f"hookscript {phase}")
    began = time.monotonic()
    code = EXIT_ERROR
    try:
        from vstor.formats.pve.vm import vmid as parse_vmid
        vm = parse_vmid(vmid)
        if phase == "pre-start":
            pre_start(vm, os.environ.get("PVE_MIGRATED_FROM") or None)
        elif phase == "post-start":
            post_start(vm, os.environ.get("PVE_MIGRATED_FROM") or None)
        else:
            post_stop(vm)
        code = 0
    except VstorError as e:
        vlog.refusal(f"VM {vmid}: {phase} failed: {e}", e.exit_code, f"pve-{vmid}" if vmid.isdigit() else None)
        print(f"vstor: {e}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:      # never a traceback into the task log
        vlog.refusal(f"VM {vmid}: {phase} failed: internal error: {type(e).__name__}: {e}", EXIT_ERROR,
                     f"pve-{vmid}" if vmid.isdigit() else None)
        print(one_line(f"vstor: internal error in {phase}: {type(e).__name__}: {e}"), file=sys.stderr)
    # Counted only for a vstor VM (each phase says where its counts go).
    counters.add("hook", ("proxmox", phase, str(code)), time.monotonic() - began)
    return code


def _here():
    return HostContext(config_mod.load(), host_root())


def pre_start(vm: int, migrated_from: str | None) -> None:
    here = _here()
    cfg, state = here.config, here.state()
    node = Node(cfg)
    path = node.config_path(vm, migrated_from)
    conf, _ = node.read_config(vm, path)
    if not _exists(snippet.path_of(manage.intent_dir(node), vm)):
        theirs = manage.carries_vstor(conf, manage.claimed_controllers(node, state.records()),
                                      node.pci_mappings(), vm)
        if theirs:
            raise BadInput(f"VM {vm} has no vstor intent but its {theirs} (a clone or a restore "
                           "of another VM?)", hint=f"write its intent and run vstor pve apply {vm}, "
                                                   "or remove what is vstor's from its config")
        return          # the hookscript on a VM without vstor disks: nothing to do
    counters.at(cfg.state_dir)
    vmo = manage.load(node, vm, conf_path=path, conf=conf)
    plan = manage.recorded_plan(vmo)
    manage.check_config(vmo, plan, node.qemu_version(), starting=True)
    if migrated_from:
        _check_movable(cfg, vm, plan, migrated_from)
    rec = carry_out(here.runtime(), state, here.host, vmo.req, plan, progress=_progress(vm))
    log(str(vm), f"pre-start: {len(rec.steps)} host changes recorded"
        + (f" (incoming migration from {migrated_from})" if migrated_from else ""))


def _exists(path: str) -> bool:
    """A file that cannot be looked at is not 'no file' (an unmounted or
    unreadable storage would let a VM start without its backends)."""
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        from vstor.errors import Unavailable
        raise Unavailable(f"cannot look at {path}: {e.strerror}") from None


def _check_movable(cfg, vm: int, plan, source: str) -> None:
    """On a migration's target: Proxmox moved the config, not the disks."""
    for d in plan.disks:
        if d.source.kind == "nvme" or d.mode == "passthrough":
            raise DoesNotFit(f"VM {vm}'s disk {d.target} is local NVMe on {source}; Proxmox's "
                             "migration cannot move it", hint="migrate VMs whose vstor disks are "
                                                              "NVMe-oF namespaces or shared files")
        if d.source.kind in ("file", "block") and not inside(d.source.path, cfg.migrate_shared):
            raise DoesNotFit(f"VM {vm}'s disk {d.target} ({d.source.path}) is not on storage "
                             "declared shared between nodes: here it would be another disk",
                             hint="declare the shared mount in [migrate] shared on every node")


def post_start(vm: int, migrated_from: str | None) -> None:
    here = _here()
    rec = here.state().load(name_of(vm))
    if rec is None:
        return          # not a vstor VM, or pre-start refused it
    counters.at(here.config.state_dir)
    if rec.domain != name_of(vm):
        raise DoesNotFit(f"state record {name_of(vm)} belongs to '{rec.domain}', not VM {vm}")
    node = Node(here.config)
    path = node.config_path(vm, migrated_from)
    vmo = manage.load(node, vm, conf_path=path, conf=node.read_config(vm, path)[0])
    plan = manage.recorded_plan(vmo)
    moved = pinning.apply(plan, pinning.running(node, vm))
    log(str(vm), f"post-start: {moved} QEMU threads pinned: " + "; ".join(pinning.describe(plan)))


def post_stop(vm: int) -> None:
    here = _here()
    state = here.state()
    name = name_of(vm)
    rec = state.load(name)
    if rec is None:
        return
    counters.at(here.config.state_dir)
    if rec.domain != name:
        raise DoesNotFit(f"state record {name} belongs to '{rec.domain}', not VM {vm}")
    release(here.runtime(), state, name, progress=_progress(vm))
    log(str(vm), "post-stop: released")


def _progress(vm: int):
    """Each host change is logged with its result by the journal; only a
    run's warnings are logged here."""
    return progress(f"pve-{vm}")
