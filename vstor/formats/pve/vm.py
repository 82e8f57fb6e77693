"""What a Proxmox VM's config says about the VM, read with qemu-server's
rules: its VMID, the name vstor knows it by, its memory, machine and UUID.
Pure.

The config is written by anyone with VM.Config rights (threats.md): every
value read here is checked, and what does not fit vstor's model is refused
with the `qm set` that fixes it.
"""

from __future__ import annotations

import re

from vstor.errors import BadInput
from vstor.formats.pve import grammar
from vstor.formats.pve.config import PveConfig

_VMID = re.compile(r"[1-9][0-9]{2,8}", re.ASCII)        # Proxmox: 100 .. 999999999
# qemu-server's hugepages_topology reads a numaN's hostnodes with m/^(\d)$/
# (QS:PVE/QemuServer/Memory.pm): hugepages bind only to host nodes 0-9.
HUGEPAGE_NODES = 10
_COUNT = re.compile(r"[1-9][0-9]{0,3}", re.ASCII)


def vmid(text: str) -> int:
    text = str(text).strip()
    if not _VMID.fullmatch(text):
        raise BadInput(f"'{text[:40]}' is not a Proxmox VMID", hint="a number from 100 to 999999999")
    return int(text)


def name_of(vm: int) -> str:
    """The name vstor knows the VM by (state records, sockets, daemons)."""
    return f"pve-{vm}"


def vmid_of(name: str) -> int | None:
    """The VMID of a name made by name_of, else None."""
    m = re.fullmatch(r"pve-([1-9][0-9]{2,8})", name or "", re.ASCII)
    return int(m.group(1)) if m else None


# qemu-server's memory grammar has a minimum (16) and no maximum; vstor
# reads at most 2^40 MiB, 1 EiB, as for a libvirt domain (vstor.meta.document).
MAX_MEMORY_MIB = 2**40


def memory_mib(conf: PveConfig, where: str) -> int:
    raw = conf.get("memory") or "512"
    fix = "qm set VMID --memory 4096"
    current = _props(grammar.MEMORY, raw, "memory", where, fix)["current"]
    digits = current.lstrip("+0")       # the grammar's integer: [+-]?\d+, at least 16
    if len(digits) > len(str(MAX_MEMORY_MIB)) or int(digits) > MAX_MEMORY_MIB:
        raise BadInput(f"{where}: memory '{raw[:40]}' is more than the {MAX_MEMORY_MIB} MiB (1 EiB) "
                       "vstor plans", hint=fix)
    return int(digits)


def machine_of(conf: PveConfig, where: str = "the VM") -> str:
    """'q35' or 'pc' (with the version Proxmox pins, if any): the type only."""
    raw = conf.get("machine") or "pc"
    return _props(grammar.MACHINE, raw, "machine", where, "qm set VMID --machine q35").get("type", "pc")


def viommu_of(conf: PveConfig) -> str | None:
    raw = conf.get("machine")
    return _props(grammar.MACHINE, raw, "machine", "the VM", "").get("viommu") if raw else None


def uuid_of(conf: PveConfig, where: str) -> str | None:
    raw = conf.get("smbios1")
    if raw is None:
        return None
    value = _props(grammar.SMBIOS1, raw, "smbios1", where, "qm set VMID --smbios1 uuid=$(uuidgen)").get("uuid")
    return value.lower() if value else None


def count_of(conf: PveConfig, key: str, where: str) -> int:
    """`sockets` or `cores`: 1 when absent."""
    raw = conf.get(key) or "1"
    if not _COUNT.fullmatch(raw):
        raise BadInput(f"{where}: {key} '{raw[:20]}' is not a count", hint=f"qm set VMID --{key} 2")
    return int(raw)


def _props(fmt: dict, raw: str, key: str, where: str, fix: str) -> dict[str, str]:
    """A property string as qemu-server reads it, or refused with its reason."""
    try:
        return grammar.parse(fmt, raw)
    except grammar.Invalid as e:
        raise BadInput(f"{where}: {key} '{raw[:40]}' is not as Proxmox reads it ({e})",
                       hint=fix or None) from None
