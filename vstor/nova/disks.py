"""A Nova flavor's vstor disks: extra specs that spell the same elements a
domain's <vstor:disk> holds, one attribute per key.  Pure.

    vstor:disk.vdb.file.path = /var/lib/vstor/images/db.raw
    vstor:disk.vdb.nvme.controller = 0000:5e:00.0
    vstor:disk.vdb.nvme.namespace = 2
    vstor:disk.vdb.queues = 4
    vstor:disk.vdb.readonly = yes

`vstor:disk.<target>.<attribute>` is an attribute of the disk,
`vstor:disk.<target>.<source>.<attribute>` one of its source.  The element
is built and parsed with the declaration every intent goes through
(vstor.meta.intent), so a flavor is checked exactly as domain metadata is.
Nova owns the instance's cores and memory: the VM part of the intent is
fixed (cpus='external': Nova pins them; no NUMA binding, no hugepages of
vstor's).  A flavor whose hw:mem_page_size asks for large pages gets
hugepages='external': the guest's memory is in Nova's hugepages, which
vstor checks (an SPDK disk needs them) and never places.
"""

from __future__ import annotations

import re

from lxml import etree

from vstor import NS, PREFIX
from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.intent import Intent
from vstor.meta.xmlmodel import Q

PREFIX_KEY = "vstor:disk."
SOURCES = ("nvme", "nvmf", "file", "block")
_KEY = re.compile(r"vstor:disk\.([a-z0-9]{1,8})\.(?:(nvme|nvmf|file|block)\.)?([a-z_]{1,32})")
_PAGE = re.compile(r"(\d{1,12})([KMGT])i?B")     # oslo's IEC units, as Nova parses them
_UNIT_KIB = {"K": 1, "M": 1024, "G": 1024 ** 2, "T": 1024 ** 3}
_PROJECT = re.compile(r"[0-9a-f]{32}|[0-9a-f-]{36}|[A-Za-z0-9_-]{1,64}")


NUMA_KEY = "vstor:numa"
NUMA_POLICIES = ("strict", "preferred")


def numa_policy(specs: dict[str, str], where: str) -> str:
    """What vstor does when Nova puts the instance on another host node than
    its SPDK disks' (vstor:numa): 'preferred' (the default) starts it and
    says so in the plan; 'strict' refuses it (Nova reschedules)."""
    value = str(specs.get(NUMA_KEY, "preferred"))
    if value not in NUMA_POLICIES:
        raise BadInput(f"{where}: {NUMA_KEY}='{value[:20]}' is not preferred or strict",
                       hint=f"{NUMA_KEY}=preferred (the default) or strict")
    return value


def has_disks(specs: dict[str, str]) -> bool:
    return any(k.startswith(PREFIX_KEY) for k in specs)


def large_pages(specs: dict[str, str]) -> bool:
    """The flavor's hw:mem_page_size asks for hugepages of 2 MiB or more:
    'large', or a size (KiB when bare, as nova.virt.hardware reads it).
    'any' may end in small pages; an image may still ask for small ones
    under 'large' (Nova lets it): the guest config says what Nova gave."""
    value = str(specs.get("hw:mem_page_size", "")).strip()
    if value == "large":
        return True
    if value.isdigit() and len(value) <= 12:
        return int(value) >= 2048
    m = _PAGE.fullmatch(value)
    return bool(m) and int(m.group(1)) * _UNIT_KIB[m.group(2)] >= 2048


def element(specs: dict[str, str], flavor: str = "the flavor") -> etree._Element:
    """<vstor:vstor> with a <vstor:vm> and a <vstor:disk> per target."""
    root = etree.Element(Q + "vstor", nsmap={PREFIX: NS})
    etree.SubElement(root, Q + "vm", cpus="external", numa="none",
                     hugepages="external" if large_pages(specs) else "none")
    disks: dict[str, etree._Element] = {}
    for key in sorted(k for k in specs if k.startswith(PREFIX_KEY)):
        m = _KEY.fullmatch(key)
        if not m:
            raise BadInput(f"{flavor}: extra spec '{key[:60]}' is not vstor:disk.<target>.<attribute> "
                           "or vstor:disk.<target>.<source>.<attribute>",
                           hint="like vstor:disk.vdb.file.path=/var/lib/vstor/images/db.raw")
        target, kind, attr = m.groups()
        if kind is None and attr == "project":
            continue        # who may use the disk (projects_of), not part of the element
        disk = disks.get(target)
        if disk is None:
            disk = disks[target] = etree.SubElement(root, Q + "disk", target=target)
        value = str(specs[key])
        if kind is None:
            if attr == "target":
                raise BadInput(f"{flavor}: {key} names the target twice")
            disk.set(attr, value)
            continue
        src = disk.find(Q + kind)
        others = [c for c in disk if c.tag != Q + kind]
        if others:
            raise BadInput(f"{flavor}: disk {target} has two sources "
                           f"({etree.QName(others[0]).localname} and {kind})")
        if src is None:
            src = etree.SubElement(disk, Q + kind)
        src.set(attr, value)
    return root


def parse(specs: dict[str, str], flavor: str = "the flavor") -> tuple[etree._Element, Intent]:
    """The <vstor:vstor> element and the intent it declares."""
    root = element(specs, flavor)
    try:
        return root, metadata.load_intent(root)
    except BadInput as e:
        raise BadInput(f"{flavor}: {e.message}", hint=e.hint) from None


def intent_of(specs: dict[str, str], flavor: str = "the flavor") -> Intent:
    return parse(specs, flavor)[1]


def projects_of(specs: dict[str, str], intent: Intent, flavor: str = "the flavor") -> dict[str, str]:
    """target -> the one project whose instances may use the disk.

    A flavor's disk source is fixed: every instance of the flavor would get
    the same file or namespace, and what one tenant wrote another would
    read.  So a writable disk names its project (vstor:disk.<t>.project),
    and only that project's instances get it; a readonly one may be shared."""
    out = {}
    for d in intent.disks:
        project = specs.get(f"{PREFIX_KEY}{d.target}.project")
        if project is not None and not _PROJECT.fullmatch(project):
            raise BadInput(f"{flavor}: {PREFIX_KEY}{d.target}.project '{project[:40]}' is not a "
                           "project id")
        if project is None and not d.readonly:
            raise BadInput(f"{flavor}: disk {d.target} is writable and names no project: every "
                           "instance of the flavor would get the same disk, and read what another "
                           "tenant wrote", hint=f"set {PREFIX_KEY}{d.target}.project=<project id>, "
                                                "or readonly=yes")
        if project is not None:
            out[d.target] = project
    return out
