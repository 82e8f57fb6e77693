"""`vstor pve doctor`: what a Proxmox node needs for vstor VMs to start as
planned.  Each check is (ok, one line saying what was found and the fix)."""

from __future__ import annotations

import glob
import os
import re

from vstor.config import Config
from vstor.errors import VstorError
from vstor.pve import manage
from vstor.pve.leave import chains_vstor, hook_value
from vstor.pve.node import Node
from vstor.runtime.state import StateDir

HUGEPAGES = "/run/hugepages/kvm"        # qemu-server's mount points: <dir>/<kB>kB
_PAGE_KB = (2048, 1048576)


def checks(node: Node, cfg: Config, hugepages: str = HUGEPAGES,
           mounts: str = "/proc/self/mounts", source: str | None = None) -> list[tuple[bool, str]]:
    """`source`: this vstor's hookscript (hooks/proxmox/vstor), which the
    installed one must be, but for what install writes into it."""
    out: list[tuple[bool, str]] = []
    if not node.is_proxmox():
        return [(False, f"{node.etc}/qemu-server does not exist: not a Proxmox VE node "
                        "(or set [pve] etc in vstor.conf)")]
    out += _hugepage_mounts(hugepages, mounts)
    try:
        store = node.snippets()
    except VstorError as e:
        return out + [(False, f"snippets storage: {e}")]
    out.append((True, f"snippets storage '{store.id}' at {store.snippets}"
                + (" (shared)" if store.shared else " (this node only: copy the hookscript and "
                   "intents to every node a vstor VM may run on)")))
    script = os.path.join(store.snippets, "vstor")
    installed = os.path.isfile(script) and os.access(script, os.X_OK)
    if installed and source is not None and not _same_script(script, source):
        out.append((False, f"hookscript {script} is not this vstor's (an older one does not pin "
                           "QEMU's threads at post-start): run vstor pve hooks install"))
    else:
        out.append((installed, f"hookscript {script} " + ("installed" if installed else
                                                          "missing: run vstor pve hooks install")))
    out += _vms(node, hook_value(store.id))
    return out


def _same_script(path: str, source: str) -> bool:
    """The installed hookscript is `source` but for its interpreter line and
    the CONFIG and SYSPATH lines install writes."""
    def body(text: str) -> list[str]:
        return [line for line in text.splitlines()[1:]
                if not line.startswith(("CONFIG = ", "SYSPATH = "))]
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return body(f.read(1 << 20)) == body(source)
    except OSError:
        return False


def _hugepage_mounts(base: str, mounts: str) -> list[tuple[bool, str]]:
    """qemu-server mounts hugetlbfs at <base>/<kB>kB when it is missing; a
    directory there that is not that mount makes QEMU map ordinary memory
    from it, and the VM starts without hugepages."""
    try:
        with open(mounts) as f:
            table = {line.split()[1]: line.split() for line in f if len(line.split()) > 3}
    except OSError as e:
        return [(False, f"cannot read {mounts}: {e.strerror}")]
    out = []
    for kb in _PAGE_KB:
        path = f"{base}/{kb}kB"
        entry = table.get(path)
        if entry is None and not os.path.exists(path):
            out.append((True, f"{path}: not mounted yet (qemu-server mounts it at the first start)"))
        elif entry is None or entry[2] != "hugetlbfs":
            out.append((False, f"{path} exists but is not a hugetlbfs mount: guests would get "
                               f"ordinary memory (umount it or remove the directory)"))
        elif f"pagesize={kb // 1024}M" not in entry[3] and f"pagesize={kb // 1048576}G" not in entry[3]:
            out.append((False, f"{path} is hugetlbfs of another page size ({entry[3]})"))
        else:
            out.append((True, f"{path}: hugetlbfs"))
    return out


def _vms(node: Node, hook: str) -> list[tuple[bool, str]]:
    out = []
    qemu = None
    for vm in manage.vstor_vms(node):
        try:
            vmo = manage.load(node, vm)
            conf = vmo.conf
        except VstorError as e:
            out.append((False, f"VM {vm}: {e}"))
            continue
        own = conf.get("hookscript")
        if own != hook and not (own and chains_vstor(node.etc, own, _script(node))):
            fix = (f"make yours call {_script(node)} with its two arguments first" if own
                   else f"qm set {vm} --hookscript {hook}")
            out.append((False, f"VM {vm}: hookscript is {own or 'not set'}; "
                               f"vstor makes no backends at its start: {fix}"))
            continue
        try:
            qemu = qemu or node.qemu_version()
            manage.check_config(vmo, manage.recorded_plan(vmo), qemu)
        except VstorError as e:
            out.append((False, f"VM {vm}: {e}"))
            continue
        said = "set" if own == hook else "of its own calls vstor's"
        out.append((True, f"VM {vm}: hookscript {said}, config carries its plan"))
    return out + _others(node, set(manage.vstor_vms(node)))


def _script(node: Node) -> str:
    return os.path.join(node.snippets().snippets, "vstor")


def _others(node: Node, ours: set[int]) -> list[tuple[bool, str]]:
    """The VMs without a vstor intent: none may hand over what vstor holds
    (its pre-start refuses that only where the hookscript is set)."""
    out = []
    claimed = manage.claimed_controllers(node, StateDir(node.cfg.state_dir).records())
    mappings = node.pci_mappings()
    for path in sorted(glob.glob(os.path.join(glob.escape(node.etc), "qemu-server", "*.conf"))):
        m = re.fullmatch(r"([1-9][0-9]{2,8})\.conf", os.path.basename(path))
        if not m or int(m.group(1)) in ours:
            continue
        vm = int(m.group(1))
        try:
            conf, _ = node.read_config(vm, path)
            theirs = manage.carries_vstor(conf, claimed, mappings, vm)
        except VstorError as e:
            out.append((False, str(e)))
            continue
        if theirs:
            out.append((False, f"VM {vm} has no vstor intent but its {theirs}: remove it from its config"))
    return out
