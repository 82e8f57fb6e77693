"""libvirt, through libvirt-python only.  Never used from the hook (a hook that
calls back into libvirt deadlocks it)."""

from __future__ import annotations

import os

from vstor.errors import BadInput, Unavailable

DEFAULT_URI = "qemu:///system"


def _libvirt():
    import libvirt   # imported late: the hook's fast path must not pay for it
    return libvirt


def uri(explicit: str | None) -> str:
    return explicit or os.environ.get("LIBVIRT_DEFAULT_URI") or DEFAULT_URI


def connect(explicit_uri: str | None = None):
    libvirt = _libvirt()
    target = uri(explicit_uri)
    try:
        # libvirt prints its own errors to stderr unless a handler is set.
        libvirt.registerErrorHandler(lambda *_: None, None)
        return libvirt.open(target)
    except libvirt.libvirtError as e:
        raise Unavailable(f"cannot connect to libvirt at {target}: {_msg(e)}",
                          hint="is libvirtd running? pick another URI with -c") from None


def lookup(conn, name: str):
    libvirt = _libvirt()
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError:
        raise BadInput(f"domain '{name}' is not defined at {conn.getURI()}",
                       hint="see: virsh list --all") from None


def inactive_xml(dom) -> str:
    """The persistent definition (what `apply` re-plans)."""
    libvirt = _libvirt()
    flags = libvirt.VIR_DOMAIN_XML_INACTIVE if dom.isPersistent() else 0
    return dom.XMLDesc(flags)


def define(conn, xml: str):
    libvirt = _libvirt()
    try:
        return conn.defineXML(xml)
    except libvirt.libvirtError as e:
        hint = ("to re-plan a defined domain use: vstor apply NAME"
                if "already exists" in _msg(e) else None)
        raise BadInput(f"libvirt refused the rendered domain: {_msg(e)}", hint=hint) from None


def all_domains(conn) -> list:
    libvirt = _libvirt()
    try:
        return conn.listAllDomains(0)
    except libvirt.libvirtError as e:
        raise Unavailable(f"cannot list domains at {conn.getURI()}: {_msg(e)}") from None


def _msg(e) -> str:
    return (e.get_error_message() or str(e)).splitlines()[0]
