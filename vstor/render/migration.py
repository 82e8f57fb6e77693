"""The XML a domain arrives with on a migration's destination: the domain as
libvirt sends it, placed by the destination's plan.  Every device stays as it
is (its PCI address, alias and features are the guest's ABI, which libvirt
checks); only what is the host's changes: each vhost-user disk's source (its
socket), the pinning, numatune, hugepages and the recorded plan, each as
vstor/render/elements.py builds it."""

from __future__ import annotations

import copy

from lxml import etree

from vstor.errors import BadInput
from vstor.meta.document import Domain
from vstor.meta.plan import Plan
from vstor.render import elements
from vstor.render.libvirt import place, share_domain_memory


def render_incoming(dom: Domain, plan: Plan, gate: str | None = None) -> Domain:
    """`gate`: this host's path of vstor's prepared mark, for a domain that
    arrives with one (a domain without it keeps its fw_cfg as it is: the
    guest's)."""
    root = copy.deepcopy(dom.root)
    if gate and dom.gate() is not None:
        elements.gate(root, gate)
    disks = {}
    for el in root.iterfind("devices/disk"):
        target = el.find("target")
        if target is not None:
            disks[target.get("dev")] = el
    for d in plan.disks:
        if d.mode != "vhost":
            raise BadInput(f"domain '{plan.domain}': disk {d.target} is passed through, and a PCI "
                           "device cannot be live-migrated", hint="migrate it cold")
        el = disks.get(d.target)
        source = el.find("source") if el is not None else None
        if el is None or el.get("type") != "vhostuser" or source is None:
            raise BadInput(f"domain '{plan.domain}' arrives without the vhost-user disk {d.target} "
                           "its vstor metadata plans", hint="migrate the domain as vstor rendered it")
        el.replace(source, elements.vhost_source(d))
    place(root, plan)
    return Domain(root, dom.origin)


def reshare_memory(xml: str) -> str:
    """The XML Nova's source sends a live migration with, its memory shared
    again: Nova's get_updated_guest_xml strips <source> and <access> from
    <memoryBacking>, and the source's libvirt refuses a target whose memory
    source is not the running domain's (memfd); vhost-user needs it shared."""
    dom = Domain.parse(xml, "the domain XML Nova sends")     # vstor's hardened parser
    share_domain_memory(dom.root)
    return etree.tostring(dom.root, encoding="unicode")
