"""Where a Proxmox VM's vstor intent and plan live: a file in the snippets
storage, `<storage>/snippets/vstor-<VMID>.xml`, next to the hookscript.

It holds exactly what a libvirt domain's <metadata> holds, the same
<vstor:vstor> element (one declaration per format): the operator's
<vstor:vm> and <vstor:disk> elements, and the <vstor:plan> record
`vstor pve apply` adds.  Why there and not in the VM's description:

- only root writes a snippets directory (Proxmox has no upload for
  snippets), while any user with VM.Config.Options rewrites a description;
  the intent decides which host device a VM gets, so it is root's;
- Proxmox never rewrites the file, whatever it does to the config;
- the hookscript must be on every node the VM starts on, so the storage
  that holds it (shared, or copied to every node) holds the intent too;
- a clone or a restore under a new VMID has no intent: its pre-start
  refuses vstor's leftovers in the config instead of stealing the sockets.
"""

from __future__ import annotations

import os

from lxml import etree

from vstor import NS, PREFIX
from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.document import _parser
from vstor.meta.intent import Intent
from vstor.meta.plan import Plan
from vstor.meta.xmlmodel import Q, build

MAX_BYTES = 1 << 20


def path_of(snippets_dir: str, vmid: int) -> str:
    return os.path.join(snippets_dir, f"vstor-{vmid}.xml")


def read(path: str, vmid: int) -> etree._Element:
    """The <vstor:vstor> element of the file; a missing file is a refusal
    naming what to write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BadInput(f"VM {vmid} has no vstor intent ({path})",
                       hint="write one (see xml-templates/pve-intent.xml), or pass --intent FILE") from None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not os.path.isfile(path) or os.fstat(f.fileno()).st_size > MAX_BYTES:
            raise BadInput(f"{path} is not a regular file of at most 1 MiB")
        return parse(f.read(), path)


def parse(data: bytes, origin: str) -> etree._Element:
    try:
        root = etree.fromstring(data, _parser())
    except etree.XMLSyntaxError as e:
        raise BadInput(f"{origin}: malformed XML: {e.msg}") from None
    if root.tag != Q + "vstor":
        raise BadInput(f"{origin}: the root element is <{etree.QName(root).localname}>, "
                       f"not <{PREFIX}:vstor xmlns:{PREFIX}='{NS}'>")
    return root


def intent_of(root: etree._Element) -> Intent:
    return metadata.load_intent(root)


def plan_of(root: etree._Element, name: str, uuid: str | None, fix: str) -> Plan | None:
    try:
        return metadata.load_plan(root, name, uuid)
    except BadInput as e:
        raise BadInput(e.message, hint=fix) from None


def with_plan(root: etree._Element, plan: Plan) -> bytes:
    """The file with `plan` as its record; the operator's elements (and
    comments) kept as they are."""
    out = etree.Element(Q + "vstor", nsmap={PREFIX: NS})
    for kid in root:
        if kid.tag != Q + "plan":
            out.append(_copy(kid))
    out.append(build(plan))
    etree.cleanup_namespaces(out)
    return etree.tostring(out, pretty_print=True, xml_declaration=False, encoding="utf-8")


def write(path: str, data: bytes) -> None:
    """Atomically, root's: a reader sees the old file or the new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise BadInput(f"cannot write {path}: {e.strerror}", hint="run as root") from None


def _copy(e):
    import copy
    return copy.deepcopy(e)
