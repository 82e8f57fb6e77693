"""vstor's element in a domain's <metadata>: the root declaration, and the
only code that finds, reads or replaces it in a domain document."""

from __future__ import annotations

import copy
import functools
import os
import re
from hashlib import sha256

from lxml import etree

from vstor import NS, PREFIX
from vstor.errors import BadInput
from vstor.meta.intent import DiskIntent, Intent, VmIntent
from vstor.meta.plan import PLAN_VERSION, Plan
from vstor.meta.xmlmodel import Q, build, canonical, child, children, element, parse
from vstor.records import record

SCHEMA_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "schema", "vstor.rng")


@element("vstor")
@record
class Metadata:
    vm: VmIntent | None = child(VmIntent)
    disks: tuple[DiskIntent, ...] = children(
        DiskIntent, min=1, unique="target",
        missing=("vstor metadata has no <vstor:disk>",
                 "add <vstor:disk target='vdb'> with an nvme, nvmf, file or block source"))
    plan: Plan | None = child(Plan)

    @property
    def intent(self) -> Intent:
        return Intent(self.vm or VmIntent(), self.disks)


def find(root: etree._Element) -> etree._Element | None:
    """The one <vstor:vstor> element; two are refused (one would be ignored)."""
    found = root.findall(f"metadata/{Q}vstor")
    if len(found) > 1:
        raise BadInput(f"<metadata> holds {len(found)} <vstor:vstor> elements",
                       hint="keep one: vstor reads its disks from a single element")
    return found[0] if found else None


def load_intent(elem: etree._Element) -> Intent:
    """<vstor:vstor> -> the intent (the plan record, if any, is not read)."""
    bare = copy.copy(elem)
    for old in bare.findall(Q + "plan"):
        bare.remove(old)
    return parse(Metadata, bare).intent


def load_plan(elem: etree._Element, domain: str, uuid: str | None) -> Plan | None:
    """The <vstor:plan> record, or None if the domain was never planned."""
    found = elem.findall(Q + "plan")
    if not found:
        return None
    if len(found) > 1:
        raise BadInput(f"domain '{domain}' has more than one vstor plan record",
                       hint=f"re-plan it with: vstor apply {domain}")
    version = found[0].get("version")
    if version != PLAN_VERSION:
        # Every release reads the plan version the previous ones wrote (2 since
        # the first package; tests/test_packaging.py keeps them loading); a
        # newer one is a newer vstor's, which this one must not re-plan over.
        if re.fullmatch(r"[0-9]{1,9}", version or "", re.ASCII) and int(version) > int(PLAN_VERSION):
            raise BadInput(f"domain '{domain}': its vstor plan record has version {version}, "
                           f"newer than this vstor's {PLAN_VERSION}",
                           hint="install the vstor release that planned it (or a newer one) here")
        raise BadInput(f"domain '{domain}': vstor plan record version {version!r} "
                       f"is not {PLAN_VERSION}", hint=f"re-plan it with: vstor apply {domain}")
    try:
        return parse(Plan, found[0], domain=domain, uuid=uuid)
    except BadInput as e:
        raise BadInput(f"domain '{domain}': vstor plan record is damaged ({e.message})",
                       hint=f"re-plan it with: vstor apply {domain}") from None


def store(root: etree._Element, plan: Plan) -> None:
    """Replace the plan record; the operator's own elements (and comments)
    stay as they were, under the fixed prefix."""
    meta = root.find("metadata")
    old = meta.find(Q + "vstor")
    vs = etree.Element(Q + "vstor", nsmap={PREFIX: NS})
    for kid in old:
        if kid.tag != Q + "plan":
            vs.append(copy.deepcopy(kid))
    vs.append(build(plan))
    meta.replace(old, vs)
    etree.cleanup_namespaces(vs)


def add_disk(root: etree._Element, disk: DiskIntent) -> None:
    """Add a <vstor:disk> (as vstor writes it) after the last one."""
    vs = find(root)
    last = vs.findall(Q + "disk")[-1]
    last.addnext(build(disk))


def remove_disk(root: etree._Element, target: str) -> None:
    vs = find(root)
    for e in vs.findall(Q + "disk"):
        if e.get("target") == target:
            vs.remove(e)


def element_text(root: etree._Element) -> str:
    """The <vstor:vstor> element alone, as libvirt's setMetadata takes it:
    without a namespace (libvirt puts it in the one it is given, with its
    prefix, and refuses an element that declares its own: "failed to create
    a new XML namespace")."""
    e = copy.deepcopy(find(root))
    for el in e.iter(etree.Element):
        el.tag = etree.QName(el).localname
    etree.cleanup_namespaces(e)
    return etree.tostring(e, encoding="unicode")


def digest(intent: Intent) -> str:
    """Of the intent in canonical form (defaults spelled out, normalised
    values): what a plan was made for."""
    return "sha256:" + sha256(canonical(Metadata(intent.vm, intent.disks))).hexdigest()


@functools.lru_cache(maxsize=1)
def schema() -> etree.RelaxNG:
    return etree.RelaxNG(etree.parse(SCHEMA_FILE))
