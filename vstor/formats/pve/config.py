"""A Proxmox VE VM config (/etc/pve/qemu-server/VMID.conf) as qemu-server
reads it: `key: value` lines; `#` lines, which are the VM's description
(URL-escaped by Proxmox); blank lines; and sections after the main one
(`[snapshot-name]`, `[PENDING]`, `[special:cloudinit]`), each with keys of
its own.  Pure.

The file is kept as its lines: reading and writing it back unchanged gives
the same bytes, and a change touches only the lines of the keys changed, in
the main section (a snapshot is history, never rewritten).  A new key goes at
the end of the main section; Proxmox sorts keys when it next writes the file.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from vstor.errors import BadInput
from vstor.records import field, record

# qemu-server's own rules (PVE::QemuServer::parse_vm_config), on the line as
# it is: a key is letters and underscores then digits, a colon, the value;
# a section header is [PENDING], [special:cloudinit] or [snapshot-name]; a
# line starting with # is description; anything else qemu-server warns about
# and ignores, and so does vstor (kept as it is).
# Any other [...] line starts a section qemu-server skips whole (with a
# warning): its lines are kept here, and never read as the main section's.
# Perl's \s and \d are ASCII: so are these (re.ASCII), or a line ending in
# U+00A0 would be a section header here and not to qemu-server.
_KEY_LINE = re.compile(r"^([a-z][a-z_]*\d*):\s*(.+?)\s*$", re.ASCII)
_SECTION = re.compile(r"^\[([^\]]*)\]\s*$", re.ASCII)
_BLANK = " \t\n\r\f\v"
MAX_BYTES = 1 << 20         # qemu-server refuses configs over 1 MiB


@record(frozen=False)
class Line:
    raw: str                    # the line as it was, without its newline
    key: str | None = None
    value: str | None = None


@record(frozen=False)
class Section:
    name: str | None            # None: the main section
    lines: list[Line] = field(default_factory=list)

    def get(self, key: str) -> str | None:
        """The key's value; of a key written twice, the last, as qemu-server reads it."""
        for line in reversed(self.lines):
            if line.key == key:
                return line.value
        return None

    def keys(self) -> list[str]:
        return [line.key for line in self.lines if line.key]


class PveConfig:
    def __init__(self, sections: list[Section], trailing_newline: bool = True):
        self.sections = sections
        self.trailing_newline = trailing_newline

    @classmethod
    def parse(cls, text: str, origin: str = "VM config") -> "PveConfig":
        if len(text.encode()) > MAX_BYTES:
            raise BadInput(f"{origin} is larger than Proxmox allows (1 MiB)")
        if "\0" in text:
            raise BadInput(f"{origin} holds a NUL byte")
        lines = text.split("\n")
        trailing = text.endswith("\n")
        if trailing:
            lines.pop()
        sections = [Section(None)]
        for raw in lines:
            header = _SECTION.match(raw)
            if header:
                sections.append(Section(header.group(1)))
                continue
            m = None if raw.startswith("#") or not raw.strip(_BLANK) else _KEY_LINE.match(raw)
            sections[-1].lines.append(Line(raw, m.group(1), m.group(2)) if m else Line(raw))
        return cls(sections, trailing)

    def to_text(self) -> str:
        out = []
        for section in self.sections:
            if section.name is not None:
                out.append(f"[{section.name}]")
            out.extend(line.raw for line in section.lines)
        text = "\n".join(out)
        return text + "\n" if self.trailing_newline and out else text

    # -- the main section -----------------------------------------------------------------

    @property
    def main(self) -> Section:
        return self.sections[0]

    def get(self, key: str) -> str | None:
        return self.main.get(key)

    def keys(self) -> list[str]:
        return self.main.keys()

    def snapshots(self) -> list[str]:
        return [s.name for s in self.sections[1:]
                if re.fullmatch(r"(?i:[a-z][a-z0-9_\-]+)", s.name) and s.name.lower() != "pending"]

    def set(self, key: str, value: str) -> None:
        """Replace the key's line where it is, or add it at the end of the
        main section (before its trailing blank lines)."""
        _check_value(key, value)
        mine = [line for line in self.main.lines if line.key == key]
        if mine:        # a key written twice: the last one counts; the others go
            self.main.lines = [line for line in self.main.lines if line.key != key or line is mine[-1]]
            mine[-1].raw, mine[-1].value = f"{key}: {value}", value
            return
        at = len(self.main.lines)
        while at > 0 and not self.main.lines[at - 1].raw.strip():
            at -= 1
        self.main.lines.insert(at, Line(f"{key}: {value}", key, value))

    def delete(self, key: str) -> bool:
        before = len(self.main.lines)
        self.main.lines = [line for line in self.main.lines if line.key != key]
        return len(self.main.lines) != before

    def description(self) -> str:
        """The `#` lines of the main section, as Proxmox shows the description
        (its URL escapes undone)."""
        return "\n".join(unquote(line.raw[1:]) for line in self.main.lines if line.raw.startswith("#"))


def _check_value(key: str, value: str) -> None:
    if not re.fullmatch(r"[a-z][a-z_]*\d*", key):
        raise BadInput(f"'{key}' is not a Proxmox config key")
    if any(c in value for c in "\n\r\0") or value != value.strip() or not value:
        raise BadInput(f"the value for {key} would not read back as written (empty, a line break, "
                       "a NUL or surrounding spaces)")
