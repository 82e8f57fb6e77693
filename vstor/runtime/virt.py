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


# virsh domstate's words for libvirt's virDomainState values.
STATES = ("no state", "running", "idle", "paused", "in shutdown", "shut off", "crashed",
          "pmsuspended")


def state(conn, name: str) -> str:
    """What libvirt says of a domain, as virsh says it; 'not defined' when
    libvirt does not know it; Unavailable when it cannot be asked."""
    libvirt = _libvirt()
    try:
        code = conn.lookupByName(name).state()[0]
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return "not defined"
        raise Unavailable(f"cannot ask libvirt about domain '{name}': {_msg(e)}") from None
    return STATES[code] if 0 <= code < len(STATES) else f"state {code}"


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
