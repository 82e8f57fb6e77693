"""Where a Proxmox VM's vstor intent and plan live: files in the snippets
storage, next to the hookscript:

    <storage>/snippets/vstor-<VMID>.xml       the operator's intent: the same
                                               <vstor:vstor> element a libvirt
                                               domain's <metadata> holds
    <storage>/snippets/vstor-<VMID>.plan.xml  the <vstor:plan> record that
                                               `vstor pve apply` wrote (vstor's
                                               alone: an operator who rewrites
                                               the intent loses nothing of it)

Why there and not in the VM's description:
- only root writes a snippets directory (Proxmox has no upload for
  snippets), while any user with VM.Config.Options rewrites a description;
  the intent decides which host device a VM gets, so it is root's;
- Proxmox never rewrites the files, whatever it does to the config;
- the hookscript must be on every node the VM starts on, so the storage
  that holds it (shared, or copied to every node) holds these too;
- a clone or a restore under a new VMID has no intent: its pre-start
  refuses vstor's leftovers in the config instead of stealing the sockets.
"""

from __future__ import annotations

import os
import stat

from lxml import etree

from vstor import NS, PREFIX
from vstor.atomic import write_file
from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.document import xml_parser, syntax_error
from vstor.meta.intent import Intent
from vstor.meta.plan import Plan
from vstor.meta.xmlmodel import Q, build
from vstor.render.pve import PLACEMENT_KEYS

MAX_BYTES = 1 << 20


def path_of(snippets_dir: str, vmid: int) -> str:
    return os.path.join(snippets_dir, f"vstor-{vmid}.xml")


def plan_path(intent_path: str) -> str:
    return intent_path.removesuffix(".xml") + ".plan.xml"


def prev_path(intent_path: str) -> str:
    """The plan whose lines the config carries, kept while `vstor pve apply`
    writes a new plan and then the config (a run killed between the two
    leaves both sets of lines recognised as vstor's)."""
    return intent_path.removesuffix(".xml") + ".plan.prev.xml"


def written_path(intent_path: str) -> str:
    """The placement keys (numaN, hugepages, affinity) vstor wrote into the
    config, one a line: a line the user had before the first apply, equal
    to vstor's, is the user's, and `vstor pve unapply` keeps it."""
    return intent_path.removesuffix(".xml") + ".plan.keys"


def write_written(intent_path: str, keys) -> None:
    """Record the placement keys vstor wrote (read_written reads them)."""
    write(written_path(intent_path), "".join(f"{k}\n" for k in sorted(keys)).encode())


def read_written(intent_path: str) -> set[str] | None:
    """The keys of written_path, or None where apply recorded none (an
    older vstor): then every placement line equal to a plan's is vstor's."""
    data = _read(written_path(intent_path))
    if data is None:
        return None
    keys = set(data.decode(errors="replace").split())
    if not keys <= set(PLACEMENT_KEYS):
        raise BadInput(f"{written_path(intent_path)} names keys vstor does not write",
                       hint="restore it, or remove it (vstor then takes every placement line "
                            "equal to its plan's as its own)")
    return keys


def read(path: str, vmid: int) -> etree._Element:
    """The intent file's <vstor:vstor>; a missing file is a refusal naming
    what to write."""
    data = _read(path)
    if data is None:
        raise BadInput(f"VM {vmid} has no vstor intent ({path})",
                       hint="write one (see xml-templates/proxmox/vstor-100.xml), or pass --intent FILE")
    return parse(data, path)


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise BadInput(f"{path} is not a regular file of at most 1 MiB")
        return f.read(MAX_BYTES + 1)


def parse(data: bytes, origin: str, root_tag: str = "vstor") -> etree._Element:
    try:
        root = etree.fromstring(data, xml_parser())
    except etree.XMLSyntaxError as e:
        raise BadInput(f"{origin}: {syntax_error(e)}") from None
    if root.tag != Q + root_tag:
        raise BadInput(f"{origin}: the root element is <{etree.QName(root).localname}>, "
                       f"not <{PREFIX}:{root_tag} xmlns:{PREFIX}='{NS}'>")
    return root


def intent_of(root: etree._Element) -> Intent:
    return metadata.load_intent(root)


def read_plan(intent_path: str, name: str, uuid: str | None, fix: str,
              path: str | None = None) -> Plan | None:
    """The plan `vstor pve apply` recorded, or None if it never did."""
    path = path or plan_path(intent_path)
    data = _read(path)
    if data is None:
        return None
    holder = etree.Element(Q + "vstor", nsmap={PREFIX: NS})
    holder.append(parse(data, path, "plan"))
    try:
        return metadata.load_plan(holder, name, uuid)
    except BadInput as e:
        raise BadInput(f"{path}: {e.message}", hint=fix) from None


def plan_bytes(plan: Plan) -> bytes:
    return etree.tostring(build(plan), pretty_print=True, encoding="utf-8")


def write(path: str, data: bytes) -> None:
    """Atomically, root's: a reader sees the old file or the new one."""
    write_file(path, data, hint="run as root")


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise BadInput(f"cannot remove {path}: {e.strerror}", hint="run as root") from None
