"""Proxmox's own grammar for the VM config values vstor reads or writes, and
what a `hostpciN` line hands to the VM.  Pure.  The one place that knows it:
vm.py, render/pve.py and pve/manage.py ask here.

Ported from Proxmox VE 9 (../shared/pve/oracle; QS = qemu-server/src,
PC = pve-common/src, GC = pve-guest-common/src):
- property strings: PC:PVE/JSONSchema.pm parse_property_string and
  check_object/check_prop: comma-separated parts (empty ones skipped, Perl's
  split drops trailing ones), `key=value` split at the first `=`, keys in
  any order, each at most once, a bare part is the format's default key,
  unknown keys and missing required ones refused, booleans 1/on/yes/true and
  0/off/no/false, patterns anchored at both ends;
- `hostpciN`: QS:PVE/QemuServer/PCI.pm ($hostpci_fmt, parse_hostpci):
  `host` (the default key) is `;`-separated ids, each `[domain:]bus:dev` with
  an optional `.function`, lowercase hex; `mapping` names a cluster mapping;
  never both.  Each id selects every host function PC:PVE/SysFSTools.pm
  lspci matches with `^(0000:)?<id>`: a prefix, so `5e:00` is every function
  of the slot;
- `mapping=`: GC:PVE/Mapping/PCI.pm (find_on_current_node, get_node_mapping)
  over /etc/pve/mapping/pci.cfg in PC:PVE/SectionConfig.pm parse_config's
  layout: a header line `<id>`, then indented `key value` lines up to a
  blank one; each `map` a property string ($map_fmt) whose `node` is a
  node's name and `path` its `;`-separated full addresses;
- `numaN`: QS:PVE/QemuServer/Memory.pm ($numa_fmt); `memory`
  ($memory_fmt); `machine`: QS:PVE/QemuServer/Machine.pm ($machine_fmt);
  `hugepages`: QS:PVE/QemuServer.pm (enum any, 2, 1024).  Perl matches
  the config's bytes, where a digit or a blank is an ASCII one: so do
  these (re.ASCII).
qemu-server drops a value it cannot parse (a warning, the VM starts
without it); vstor refuses it instead wherever it decides something.
tests/test_pve_grammar.py holds this port to the real Perl."""

from __future__ import annotations

import re

from vstor.errors import BadInput
from vstor.records import record

STR, BOOL, INT, NUM = "string", "boolean", "integer", "number"


@record
class Prop:
    type: str = STR
    pattern: str | None = None
    enum: tuple[str, ...] = ()
    default_key: bool = False
    optional: bool = True
    minimum: int | None = None
    maximum: int | None = None
    max_length: int | None = None


class Invalid(ValueError):
    """Proxmox would not read the value (its reason, as it says it)."""


PCI_ID = r"(?:[a-f0-9]{4,}:)?[a-f0-9]{2}:[a-f0-9]{2}(?:\.[a-f0-9])?"
_FULL_PCI = r"[a-f0-9]{4,}:[a-f0-9]{2}:[a-f0-9]{2}(?:\.[a-f0-9])?"
_HEX_ID = r"^0x[0-9a-fA-F]{4}$"
CONFIGID = r"(?i:[a-z][a-z0-9_-]+)"
_SETS = r"\d+(?:-\d+)?(?:;\d+(?:-\d+)?)*"

HOSTPCI = {
    "host": Prop(pattern=f"{PCI_ID}(;{PCI_ID})*", default_key=True),
    "mapping": Prop(pattern=CONFIGID),
    "rombar": Prop(BOOL), "pcie": Prop(BOOL), "x-vga": Prop(BOOL), "legacy-igd": Prop(BOOL),
    "romfile": Prop(pattern=r"[^,;]+"), "mdev": Prop(pattern=r"[^/\.:]+"),
    "vendor-id": Prop(pattern=_HEX_ID), "device-id": Prop(pattern=_HEX_ID),
    "sub-vendor-id": Prop(pattern=_HEX_ID), "sub-device-id": Prop(pattern=_HEX_ID),
    "driver": Prop(enum=("vfio", "keep")),
}
NUMA = {
    "cpus": Prop(pattern=_SETS, optional=False),
    "memory": Prop(NUM),
    "hostnodes": Prop(pattern=_SETS),
    "policy": Prop(enum=("preferred", "bind", "interleave")),
}
MEMORY = {"current": Prop(INT, default_key=True, optional=False, minimum=16)}
MACHINE = {
    "type": Prop(pattern=r"(pc|pc(-i440fx)?-\d+(\.\d+)+(\+pve\d+)?(\.pxe)?|q35|pc-q35-\d+(\.\d+)+"
                         r"(\+pve\d+)?(\.pxe)?|virt(?:-\d+(\.\d+)+)?(\+pve\d+)?)",
                 default_key=True, max_length=40),
    "viommu": Prop(enum=("intel", "virtio")),
    "aw-bits": Prop(NUM, minimum=32, maximum=64), "enable-s3": Prop(BOOL), "enable-s4": Prop(BOOL),
}
_B64 = r"[A-Za-z0-9+\/]+={0,2}"
SMBIOS1 = {     # QS:PVE/QemuServer.pm $smbios1_fmt
    "uuid": Prop(pattern=r"[a-fA-F0-9]{8}(?:-[a-fA-F0-9]{4}){3}-[a-fA-F0-9]{12}"),
    **{k: Prop(pattern=_B64) for k in ("version", "serial", "manufacturer", "product", "sku", "family")},
    "base64": Prop(BOOL),
}
MAP = {         # GC:PVE/Mapping/PCI.pm $map_fmt
    "node": Prop(pattern=r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9\-]*[a-zA-Z0-9])\.)*"
                         r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9\-]*[A-Za-z0-9])", optional=False),
    "id": Prop(pattern=r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$", optional=False),
    "subsystem-id": Prop(pattern=r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$"),
    "path": Prop(pattern=f"(?:{_FULL_PCI};)*{_FULL_PCI}", optional=False),
    "iommugroup": Prop(INT), "description": Prop(max_length=4096),
}
HUGEPAGES = ("any", "2", "1024")


def _boolean(text: str) -> str | None:
    if re.fullmatch(r"(?i:1|on|yes|true)", text, re.ASCII):
        return "1"
    if re.fullmatch(r"(?i:0|off|no|false)", text, re.ASCII):
        return "0"
    return None


def parse(fmt: dict[str, Prop], text: str) -> dict[str, str]:
    """A property string as PC:PVE/JSONSchema.pm parse_property_string reads
    it (booleans as '1'/'0'), or Invalid with its reason."""
    out: dict[str, str] = {}
    parts = text.split(",")
    while parts and parts[-1] == "":           # Perl's split drops trailing empty fields
        parts.pop()
    default = next((k for k, p in fmt.items() if p.default_key), None)
    bare = False
    for part in parts:
        if not part.strip():
            continue
        m = re.fullmatch(r"([^=]+)=(.+)", part)
        if m:
            key, value = m.groups()
            if key in out:
                raise Invalid(f"duplicate key in comma-separated list property: {key}")
            if key not in fmt:
                raise Invalid(f"invalid key in comma-separated list property: {key}")
        elif "=" not in part:
            if default is None:
                raise Invalid("value without key, but schema does not define a default key")
            if bare or out.get(default):
                raise Invalid(f"duplicate key in comma-separated list property: {default}")
            key, value, bare = default, part, True
        else:
            raise Invalid("missing key in comma-separated list property")
        if fmt[key].type == BOOL:
            value = _boolean(value) or value
        out[key] = value
    for key, prop in fmt.items():
        if key not in out:
            if not prop.optional:
                raise Invalid(f"{key}: property is missing and it is not optional")
            continue
        _check(key, prop, out[key])
    return out


def _check(key: str, prop: Prop, value: str) -> None:
    kinds = {BOOL: r"[01]", INT: r"[+-]?\d+", NUM: r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"}
    if prop.type in kinds and not re.fullmatch(kinds[prop.type], value, re.ASCII):
        raise Invalid(f"{key}: type check ('{prop.type}') failed - got '{value[:40]}'")
    if prop.enum and value not in prop.enum:
        raise Invalid(f"{key}: value '{value[:40]}' does not have a value in the enumeration "
                      f"'{', '.join(prop.enum)}'")
    if prop.pattern and not re.fullmatch(f"(?:{prop.pattern.strip('^$')})", value, re.ASCII):
        raise Invalid(f"{key}: value does not match the regex pattern")
    if prop.max_length is not None and len(value) > prop.max_length:
        raise Invalid(f"{key}: value may only be {prop.max_length} characters long")
    if prop.minimum is not None and float(value) < prop.minimum:
        raise Invalid(f"{key}: value must have a minimum value of {prop.minimum}")
    if prop.maximum is not None and float(value) > prop.maximum:
        raise Invalid(f"{key}: value must have a maximum value of {prop.maximum}")


# -- hostpciN -----------------------------------------------------------------------------

@record
class Hostpci:
    key: str
    hosts: tuple[str, ...]          # the host ids as written (`;` list), or ()
    mapping: str | None
    options: tuple[tuple[str, str], ...]

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)


def hostpci(key: str, value: str) -> Hostpci:
    """QS:PVE/QemuServer/PCI.pm parse_hostpci, up to resolving a mapping."""
    props = parse(HOSTPCI, value)
    host, mapping = props.pop("host", None), props.pop("mapping", None)
    if host is not None and mapping is not None:
        raise Invalid("Cannot set both 'host' and 'mapping'.")
    if not host and not mapping:
        raise Invalid("Either 'host' or 'mapping' must be set.")
    return Hostpci(key, tuple(host.split(";")) if host else (), mapping, tuple(sorted(props.items())))


def selects(host_id: str, function: str) -> bool:
    """Does a host id select the function `DDDD:BB:DD.F`?  PC:PVE/SysFSTools.pm
    lspci's filter `$id !~ m/^(0000:)?\\Q$filter\\E/`: a prefix match."""
    return function.startswith(host_id) or function.startswith("0000:" + host_id)


def parse_mappings(text: str) -> dict[str, list[str]]:
    """pci.cfg -> each mapping id's raw `map` values (a later section of the
    same id replaces an earlier one, as SectionConfig's hash does)."""
    out: dict[str, list[str]] = {}
    lines = [line for line in text.split("\n") if not re.match(r"\s*#", line, re.ASCII)]
    i = 0
    while i < len(lines):
        header = re.fullmatch(r"(\S+)\s*", lines[i], re.ASCII)
        i += 1
        if not header:
            continue
        maps: list[str] = []
        while i < len(lines) and lines[i] not in ("", "0"):
            m = re.fullmatch(r"\s+(\S+)(?:\s+(.*\S))?\s*", lines[i], re.ASCII)
            if m and m.group(1) == "map":
                maps.append(m.group(2) or "")
            i += 1
        i += 1
        out[header.group(1)] = maps
    return out


class Mappings:
    """This node's view of /etc/pve/mapping/pci.cfg.  `text` None: the file
    could not be read (`why`)."""

    def __init__(self, text: str | None, nodename: str, why: str = "it does not exist"):
        self.nodename, self.why = nodename, why
        self.ids = parse_mappings(text) if text is not None else None

    def paths(self, mapping: str, where: str) -> tuple[str, ...]:
        """The host ids the mapping gives this node, or BadInput: vstor
        cannot tell what it hands to the VM (qemu-server refuses it too)."""
        hint = "fix the mapping in Datacenter > Resource Mappings, or use host= instead"
        if self.ids is None:
            raise BadInput(f"{where}: mapping={mapping} cannot be resolved: /etc/pve/mapping/pci.cfg "
                           f"cannot be read ({self.why})", hint=hint)
        if mapping not in self.ids:
            raise BadInput(f"{where}: mapping={mapping} is not in /etc/pve/mapping/pci.cfg", hint=hint)
        out: list[str] = []
        for raw in self.ids[mapping]:
            try:
                entry = parse(MAP, raw)
            except Invalid as e:
                raise BadInput(f"{where}: mapping={mapping} has an entry vstor cannot read ({e})",
                               hint=hint) from None
            if entry["node"] == self.nodename:
                out += entry["path"].split(";")
        if not out:
            raise BadInput(f"{where}: mapping={mapping} names no device on node {self.nodename}",
                           hint=hint)
        return tuple(out)


def hostpci_ids(line: Hostpci, mappings: Mappings, where: str) -> tuple[str, ...]:
    """The host ids a line hands to the VM (through its mapping, if any)."""
    return mappings.paths(line.mapping, where) if line.mapping else line.hosts


def names(ids: tuple[str, ...], controller: str) -> bool:
    return any(selects(i, controller) for i in ids)


def handed(key: str, value: str, mappings: Mappings, where: str) -> tuple[str, ...]:
    """The host ids a hostpciN line hands to the VM.  A line Proxmox would
    not read passes nothing there; here it counts as passing every PCI
    address written in it, so a near miss of this port never lets one by."""
    try:
        line = hostpci(key, value)
    except Invalid:
        return tuple(re.findall(PCI_ID, value.lower()))
    return hostpci_ids(line, mappings, where)
