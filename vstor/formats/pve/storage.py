"""Proxmox's storage.cfg, as far as vstor needs it: where a storage keeps its
snippets, and whether every node sees the same files there.  Pure.

    dir: local
            path /var/lib/vz
            content iso,vztmpl,backup,snippets

A section is `<type>: <id>`, then indented `<key> <value>` lines.  Network
storages (nfs, cifs, cephfs, glusterfs) are mounted at /mnt/pve/<id> unless
they say otherwise, and are shared; a directory storage is shared when it
says `shared 1` (the operator's promise that it is the same on every node).
"""

from __future__ import annotations

import re

from vstor.errors import BadInput
from vstor.records import record

_HEADER = re.compile(r"^([a-z][a-z0-9]*):\s*([A-Za-z][A-Za-z0-9_.-]*)\s*$")
_NETWORK = ("nfs", "cifs", "cephfs", "glusterfs")
_WITH_PATH = ("dir", "btrfs") + _NETWORK


@record
class Storage:
    id: str
    type: str
    path: str | None
    content: frozenset[str]
    shared: bool
    disabled: bool

    @property
    def snippets(self) -> str:
        return f"{self.path}/snippets"


def parse(text: str) -> dict[str, Storage]:
    out: dict[str, Storage] = {}
    current: tuple[str, str] | None = None
    props: dict[str, str] = {}

    def close():
        if current:
            kind, sid = current
            path = props.get("path") or (f"/mnt/pve/{sid}" if kind in _NETWORK else None)
            out[sid] = Storage(sid, kind, path if kind in _WITH_PATH else None,
                               frozenset(c.strip() for c in props.get("content", "").split(",") if c.strip()),
                               kind in _NETWORK or props.get("shared") == "1",
                               props.get("disable") == "1")

    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):     # no comments after a value
            continue
        header = _HEADER.match(line)
        if header:
            close()
            current, props = (header.group(1), header.group(2)), {}
        elif line[0] in " \t" and current:
            key, _, value = line.strip().partition(" ")
            props[key] = value.strip()
    close()
    return out


def snippets_storage(storages: dict[str, Storage], sid: str, origin: str) -> Storage:
    """The storage, if it can hold the hookscript and the vstor intents."""
    st = storages.get(sid)
    if st is None:
        known = ", ".join(sorted(s.id for s in storages.values() if "snippets" in s.content))
        raise BadInput(f"snippets storage '{sid}' does not exist in {origin}",
                       hint=f"set [pve] storage to one with snippets content ({known or 'none has'})")
    if st.path is None:
        raise BadInput(f"storage '{sid}' ({st.type}) has no directory for snippets",
                       hint="use a dir, nfs, cifs or cephfs storage")
    if "snippets" not in st.content:
        raise BadInput(f"storage '{sid}' does not hold snippets",
                       hint=f"pvesm set {sid} --content {','.join(sorted(st.content | {'snippets'}))}")
    if st.disabled:
        raise BadInput(f"storage '{sid}' is disabled", hint=f"pvesm set {sid} --disable 0")
    return st
