"""libvirt, through libvirt-python only.  Never used from the hook (a hook that
calls back into libvirt deadlocks it)."""

from __future__ import annotations

import os

from vstor.errors import ActionFailed, BadInput, Unavailable

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


def inactive_xml(dom, persistent: bool | None = None) -> str:
    """The persistent definition (what `apply` re-plans).  `persistent`:
    whether it has one, when the caller knows (one call to libvirt less)."""
    libvirt = _libvirt()
    if persistent is None:
        persistent = dom.isPersistent()
    return dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE if persistent else 0)


def uuids_of(conn, flag: str) -> set[str]:
    """The UUIDs of the domains listAllDomains gives with one
    VIR_CONNECT_LIST_DOMAINS_* flag ("ACTIVE", "PERSISTENT"): one call to
    libvirt for every domain's state, not one per domain."""
    libvirt = _libvirt()
    try:
        return {d.UUIDString() for d in conn.listAllDomains(getattr(libvirt, f"VIR_CONNECT_LIST_DOMAINS_{flag}"))}
    except libvirt.libvirtError as e:
        raise Unavailable(f"cannot list domains at {conn.getURI()}: {_msg(e)}") from None


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


# -- a running domain's devices (hot-plug) -------------------------------------------------

_events_ready = False


class LiveDomain:
    """A running domain as vstor's hot-plug changes it: its vstor metadata
    and one device at a time, live (and in the persistent definition when
    asked)."""

    def __init__(self, conn, dom):
        self.conn, self.dom = conn, dom
        self.name = dom.name()

    def _flags(self, persistent: bool) -> int:
        libvirt = _libvirt()
        return libvirt.VIR_DOMAIN_AFFECT_LIVE | (libvirt.VIR_DOMAIN_AFFECT_CONFIG if persistent else 0)

    def live_xml(self) -> str:
        return self.dom.XMLDesc(0)

    def current(self):
        """The running domain as libvirt has it now (vstor's Domain)."""
        from vstor.meta.document import Domain
        return Domain.parse(self.live_xml(), f"domain '{self.name}'")

    def persistent_plan(self):
        from vstor.meta.document import Domain
        if not self.dom.isPersistent():
            return None
        return Domain.parse(inactive_xml(self.dom), f"domain '{self.name}' (persistent)").recorded_plan()

    def set_metadata(self, element: str, persistent: bool = False) -> None:
        from vstor import NS, PREFIX
        libvirt = _libvirt()
        try:
            self.dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, element, PREFIX, NS,
                                 self._flags(persistent))
        except libvirt.libvirtError as e:
            raise ActionFailed(f"libvirt refused domain '{self.name}''s new vstor metadata: "
                               f"{_msg(e)}") from None

    def attach(self, device: str, element: str, persistent: bool = False) -> None:
        """The metadata first (a refused device puts the old back), then the device."""
        from vstor.meta import metadata
        libvirt = _libvirt()
        old = metadata.element_text(self.current().root)
        self.set_metadata(element, persistent)
        try:
            self.dom.attachDeviceFlags(device, self._flags(persistent))
        except libvirt.libvirtError as e:
            self.set_metadata(old, persistent)
            raise ActionFailed(f"libvirt refused to attach the device to domain '{self.name}': "
                               f"{_msg(e)}", hint="a q35 guest needs a free pcie-root-port for "
                                                  "each hot-plugged device") from None

    def device(self, disk) -> str | None:
        """The live device of a planned disk (its <disk> or <hostdev>), None
        when the domain no longer has it."""
        found = _device(self.live_xml(), disk)
        return None if found is None else etree_text(found)

    def detach(self, device: str, timeout: float, persistent: bool = False) -> None:
        """Ask QEMU to unplug it and wait for DEVICE_DELETED (libvirt's
        device-removed event), `timeout` seconds at most."""
        import threading
        from lxml import etree
        libvirt = _libvirt()
        alias = etree.fromstring(device).find("alias")
        alias = alias.get("name") if alias is not None else None
        conn = _event_connection(self.conn.getURI())
        done, failed = threading.Event(), threading.Event()

        def removed(_c, _d, dev_alias, _o):
            if dev_alias == alias:
                done.set()

        def refused(_c, _d, dev_alias, _o):
            if dev_alias == alias:
                failed.set()
                done.set()

        dom = conn.lookupByUUIDString(self.dom.UUIDString())
        ids = [conn.domainEventRegisterAny(dom, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED, removed, None),
               conn.domainEventRegisterAny(dom, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVAL_FAILED,
                                           refused, None)]
        try:
            try:
                self.dom.detachDeviceFlags(device, self._flags(persistent))
            except libvirt.libvirtError as e:
                raise ActionFailed(f"libvirt refused to detach the device from domain "
                                   f"'{self.name}': {_msg(e)}") from None
            waited = 0.0
            while not done.wait(0.25) and waited < timeout:
                waited += 0.25
                if alias is None or _device_by_alias(self.live_xml(), alias) is None:
                    done.set()      # gone (libvirt removed it before we listened)
        finally:
            for i in ids:
                try:
                    conn.domainEventDeregisterAny(i)
                except libvirt.libvirtError:
                    pass
            conn.close()
        if failed.is_set():
            raise ActionFailed(f"the guest of domain '{self.name}' refused to release device "
                               f"{alias}; nothing was released", hint="retry when it is unused")
        if not done.is_set():
            raise ActionFailed(f"the guest of domain '{self.name}' did not let go of device {alias} "
                               f"within {timeout:g}s (a guest without PCI hot-plug, or one still "
                               "using the disk, ignores the request); nothing was released",
                               hint="unmount it in the guest and run vstor detach again (the device "
                                    "goes whenever the guest lets go), or stop the domain")

    def detach_config(self, disk) -> None:
        """The device from the persistent definition only (gone live already)."""
        libvirt = _libvirt()
        found = _device(inactive_xml(self.dom), disk)
        if found is None:
            return
        try:
            self.dom.detachDeviceFlags(etree_text(found), libvirt.VIR_DOMAIN_AFFECT_CONFIG)
        except libvirt.libvirtError as e:
            raise ActionFailed(f"libvirt refused to remove the device from domain "
                               f"'{self.name}''s definition: {_msg(e)}") from None


def _event_connection(target: str):
    """A connection of its own whose events the default event loop delivers
    (registered once per process, before the connection is opened)."""
    global _events_ready
    import threading
    libvirt = _libvirt()
    if not _events_ready:
        libvirt.virEventRegisterDefaultImpl()

        def loop():
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=loop, name="libvirt-events", daemon=True).start()
        _events_ready = True
    return connect(target)


def _device(xml: str, disk):
    from vstor.meta.document import Domain
    from vstor.render.libvirt import hostdev_address
    devices = Domain.parse(xml).root.find("devices")
    if devices is None:
        return None
    if disk.mode == "vhost":
        return next((d for d in devices.findall("disk")
                     if d.find("target") is not None and d.find("target").get("dev") == disk.target), None)
    return next((h for h in devices.findall("hostdev") if hostdev_address(h) == disk.controller), None)


def _device_by_alias(xml: str, alias: str):
    from vstor.meta.document import Domain
    root = Domain.parse(xml).root
    return next((e for e in root.iterfind("devices/*") if e.find("alias") is not None
                 and e.find("alias").get("name") == alias), None)


def etree_text(e) -> str:
    from lxml import etree
    return etree.tostring(e, encoding="unicode")
