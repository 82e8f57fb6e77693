"""Leaving a Proxmox VM: which lines of its config `vstor pve apply` wrote
(so `vstor pve unapply` removes exactly those), and whose hookscript it has.

A line is vstor's when it is what a plan vstor recorded for the VM renders
(numaN, hugepages, affinity; a hostpciN line passing a planned controller,
recognised as `render.vstors_line` recognises it), the `-chardev`/`-device`
suffix of `args` in the exact shape vstor writes, or `hookscript:` naming
vstor's hookscript.  Every other line is the user's and stays byte for
byte.  A placement line the user wrote that equals vstor's own (`numa: 1`
before the first apply, say) stays: apply records the placement keys it
wrote (snippet.written_path).

Proxmox runs one hookscript per VM.  A VM with a hookscript of its own gets
vstor's backends only if that script calls vstor's with the same two
arguments; `chains_vstor` looks for that call in the script.
"""

from __future__ import annotations

import os
import re

from vstor.errors import BadInput
from vstor.formats.pve import storage as storage_mod
from vstor.formats.pve.config import MAX_BYTES, PveConfig, Section
from vstor.meta.plan import Plan
from vstor.render import pve as render


def strip(conf: PveConfig, plans: tuple[Plan, ...], hook: str, vm: int,
          written: set[str] | None = None) -> list[str]:
    """Remove vstor's lines from the config's main section and from its
    [PENDING] section (a change Proxmox holds until the next start, which
    would bring them back); the keys removed or changed, in config order
    (a pending one as `pending KEY`).  `written`: the placement keys apply
    recorded writing (None: not recorded, every one equal to a plan's).
    Refused (nothing changed) when an args line holds vstor's id prefix in
    a shape vstor does not write."""
    changed: list[str] = []
    for section in conf.sections:
        if section.name is None or section.name.lower() == "pending":
            prefix = "" if section.name is None else "pending "
            changed += [prefix + key for key in _strip(section, plans, hook, vm, written)]
    return changed


def _strip(section: Section, plans: tuple[Plan, ...], hook: str, vm: int,
           written: set[str] | None) -> list[str]:
    # As each plan renders now, and as an older vstor wrote it (no refusal
    # of a plan today's renderer would not write; `affinity: 0`).
    ours = [render.placement(p, check) for p in plans for check in (True, False)
            if check is False or _renders(p)]
    changed: list[str] = []
    args = _user_args(section.get("args"), vm)
    controllers = {d.controller for p in plans for d in p.disks if d.mode == "passthrough"}
    seen: set[str] = set()
    for key in section.keys():
        value = section.get(key)
        if key in render.PLACEMENT_KEYS:
            mine = (written is None or key in written) and any(o.get(key) == value for o in ours)
        elif key in render.HOSTPCI_KEYS:
            host = render.vstors_line(value, controllers)
            mine = host is not None and host not in seen    # a second line of it is the user's
            seen |= {host} if mine else set()
        elif key == "args":
            mine = args != value
        else:
            mine = key == "hookscript" and value == hook
        if mine and key not in changed:
            changed.append(key)
    for key in changed:
        if key == "args" and args:
            line = next(ln for ln in reversed(section.lines) if ln.key == key)
            line.raw, line.value = f"{key}: {args}", args
        section.lines = [ln for ln in section.lines
                         if ln.key != key or (key == "args" and args and ln.value == args)]
    return changed


def _renders(plan: Plan) -> bool:
    try:
        render.placement(plan)
    except BadInput:
        return False
    return True


def _user_args(text: str | None, vm: int) -> str | None:
    """The args line without vstor's suffix (None: nothing left)."""
    m = render._START.search(text or "")
    if not m:
        return text
    try:
        render._check_vstor_part(render._split(text[m.start():], "vstor's part of args", vm), vm)
    except BadInput as e:       # not vstor's shape: which words are vstor's is not known
        raise BadInput(e.message, hint=f"put args right by hand (qm set {vm} --args '...'), "
                                       "then unapply again") from None
    return text[:m.start()].rstrip() or None


def hook_value(storage_id: str) -> str:
    """The `hookscript:` value that names vstor's hookscript."""
    return f"{storage_id}:snippets/vstor"


def chains_vstor(etc: str, value: str, vstor_script: str) -> bool:
    """Does the hookscript `value` (`<storage>:snippets/<file>`) name vstor's
    hookscript (its path, or `snippets/vstor` relative to its storage), as a
    script that calls it must?  A script that cannot be read does not."""
    sid, sep, rel = value.partition(":")
    if not sep or not rel.startswith("snippets/") or "/" in rel[9:] or rel[9:] in ("", ".", ".."):
        return False
    try:
        with open(os.path.join(etc, "storage.cfg")) as f:
            store = storage_mod.parse(f.read(MAX_BYTES)).get(sid)
        if store is None or store.path is None:
            return False
        with open(os.path.join(store.path, rel), "rb") as f:
            text = f.read(MAX_BYTES).decode(errors="replace")
    except OSError:
        return False
    return _calls(text, vstor_script)


def _calls(text: str, path: str) -> bool:
    """`path` in the script's code, not only in a comment: shell, Perl and
    Python comments begin with '#' at the start of a line or after a
    blank (a path that itself holds ' #' is not one vstor writes)."""
    for line in text.splitlines():
        code = re.sub(r"(^|\s)#.*", "", line)
        if path in code:
            return True
    return False


def own_hookscript(vm: int, value: str, vstor_script: str) -> BadInput:
    """The refusal for a VM whose own hookscript does not call vstor's."""
    return BadInput(
        f"VM {vm} has a hookscript of its own ({value[:60]}) that does not call vstor's; "
        "Proxmox runs one hookscript per VM, so vstor's would never run and the VM would start "
        "without its vstor disks",
        hint=f"make yours call vstor's first with its two arguments and stop when it fails, "
             f"as in sh: {vstor_script} \"$1\" \"$2\" || exit $? -- then apply again")
