"""One class per kind of host change (a step), os-brick's one connector per
transport: each holds its record, what it says and what a dry run shows,
and how it is done, undone, checked and repaired.

A step is a frozen record of what the plan decided (vstor.runtime.actions
builds them).  Each kind's class implements base.StepKind, inheriting
the defaults of base.Kind where they are right for it:

- describe(), dry_run(): its line, and what `vstor prepare --dry-run` shows under it;
- to_data(), from_data(d): its journal form, in the shapes earlier vstor
  versions wrote; makes(): what it makes (a PCI address, a controller's
  name), whatever it observed: two steps making one thing are one;
- preflight(rt): the read-only checks a dry run makes too; what it will
  write (base.Writes) or None;
- observe(rt, others): the step with the host facts its undo needs, read
  before the journal records it (no writes);
- do(rt), undo(rt, others), in_use(rt) (why undoing now would take
  something from a running QEMU), check(rt) (None, or why what it made is
  not there), repair(rt);

and the class attributes kind, parallel (the journal does consecutive
steps of the kind side by side), private (it changes only the domain's own
things: done without the host lock) and rpc_methods (what it asks SPDK).

`rt` is the host operations (vstor.runtime.executor.Runtime): sysfs, SPDK, the
config and the backends' operations.  A kind reaches the host through it
alone and imports nothing that touches it, so these modules are as pure as
the planner (tests/test_layers.py).  `others` is what the other domains'
records hold (vstor.runtime.holders).
"""

from __future__ import annotations

from vstor.errors import ActionFailed, VstorError
from vstor.runtime.kinds.gate import Gate
from vstor.runtime.kinds.nvmf_export import NvmfExport
from vstor.runtime.kinds.qsd_export import QsdExport
from vstor.runtime.kinds.spdk_attach import SpdkAttach
from vstor.runtime.kinds.spdk_vhost import SpdkVhost
from vstor.runtime.kinds.vfio_bind import VfioBind

Step = VfioBind | SpdkAttach | SpdkVhost | QsdExport | NvmfExport | Gate
KINDS = {cls.kind: cls for cls in (VfioBind, SpdkAttach, SpdkVhost, QsdExport, NvmfExport, Gate)}


def to_json(step: Step, state: str) -> dict:
    return {"kind": step.kind, "state": state, "data": step.to_data()}


def from_json(entry: dict) -> Step:
    try:
        return KINDS[entry["kind"]].from_data(entry["data"])
    except (KeyError, TypeError, ValueError, AttributeError, VstorError) as e:
        raise ActionFailed(f"state record holds a step vstor cannot read "
                           f"({entry.get('kind')!r}: {type(e).__name__} {e})",
                           hint="it was written by another vstor version") from None


def identity(step: Step) -> tuple[str, str]:
    """What a step makes, whatever it observed: (kind, name); two steps with
    one identity make the same thing (a controller two disks share)."""
    return step.kind, step.makes()
