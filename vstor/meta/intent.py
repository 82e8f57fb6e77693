"""The operator's intent: vstor's element in a domain's <metadata>, parsed into
immutable values.  The contract is vstor/schema/vstor.rng; this module gives
each violation a message that names the element, the attribute and what is
allowed, then checks the whole element against the schema as well.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from lxml import etree

from vstor import NS
from vstor.errors import BadInput

Q = "{%s}" % NS


@dataclass(frozen=True)
class NvmeSource:
    controller: str             # normalised PCI address '0000:5e:00.0'
    namespace: int = 1
    kind = "nvme"


@dataclass(frozen=True)
class NvmfPath:
    traddr: str
    trsvcid: int


@dataclass(frozen=True)
class NvmfSource:
    transport: str              # rdma | tcp
    traddr: str
    subnqn: str
    trsvcid: int = 4420
    adrfam: str = "ipv4"
    namespace: int = 1
    hostnqn: str | None = None
    nic: str | None = None      # RDMA NIC whose node the VM goes to
    paths: tuple[NvmfPath, ...] = ()   # extra paths, for multipath
    ctrlr_loss_timeout: int | None = None
    reconnect_delay: int | None = None
    fast_io_fail_timeout: int | None = None
    kind = "nvmf"


@dataclass(frozen=True)
class FileSource:
    path: str
    kind = "file"


@dataclass(frozen=True)
class BlockSource:
    path: str
    kind = "block"


Source = NvmeSource | NvmfSource | FileSource | BlockSource


@dataclass(frozen=True)
class DiskIntent:
    target: str
    source: Source
    mode: str = "auto"          # auto | passthrough | vhost
    backend: str = "auto"       # auto | spdk | qsd
    queues: int | None = None   # None: one per vCPU, at most 4
    readonly: bool = False
    guest: str = "kernel"       # what drives a passed-through controller: kernel | spdk


@dataclass(frozen=True)
class VmIntent:
    numa: str = "strict"        # strict | preferred | none
    cpus: str = "dedicated"     # dedicated | shared
    hugepages: str = "auto"     # auto | none | 2M | 1G
    migratable: bool = False
    latency: str = "normal"     # normal | critical


@dataclass(frozen=True)
class Intent:
    vm: VmIntent
    disks: tuple[DiskIntent, ...]


_VM_ATTRS = {
    "numa": ("strict", "preferred", "none"),
    "cpus": ("dedicated", "shared"),
    "hugepages": ("auto", "none", "2M", "1G"),
    "migratable": ("yes", "no"),
    "latency": ("normal", "critical"),
}
_DISK_ATTRS = {
    "mode": ("auto", "passthrough", "vhost"),
    "backend": ("auto", "spdk", "qsd"),
    "readonly": ("yes", "no"),
    "guest": ("kernel", "spdk"),
}
_TARGET = re.compile(r"^vd[a-z]{1,3}$")
_BDF = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_ADDR = re.compile(r"^[0-9A-Za-z.:_-]{1,255}$")
_NQN = re.compile(r"^nqn\.\S{1,218}$")
_NIC = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_PATH = re.compile(r"^/[A-Za-z0-9_.+:@/-]{1,4095}$")


def parse_intent(elem: etree._Element) -> Intent:
    """<vstor:vstor> -> Intent, or BadInput naming what is wrong."""
    _known_children(elem, ("vm", "disk", "plan"), "vstor")
    vm_elems = elem.findall(Q + "vm")
    if len(vm_elems) > 1:
        raise BadInput("vstor metadata has more than one <vstor:vm> element", hint="keep one")
    vm = _parse_vm(vm_elems[0]) if vm_elems else VmIntent()
    disks = tuple(_parse_disk(d) for d in elem.findall(Q + "disk"))
    if not disks:
        raise BadInput("vstor metadata has no <vstor:disk>",
                       hint="add <vstor:disk target='vdb'> with an nvme, nvmf, file or block source")
    seen: set[str] = set()
    for disk in disks:
        if disk.target in seen:
            raise BadInput(f"two <vstor:disk> elements use target '{disk.target}'",
                           hint="give each disk its own target dev")
        seen.add(disk.target)
    _check_schema(elem)
    return Intent(vm=vm, disks=disks)


def _parse_vm(e) -> VmIntent:
    _known_attrs(e, _VM_ATTRS, "vm")
    return VmIntent(
        numa=e.get("numa", "strict"),
        cpus=e.get("cpus", "dedicated"),
        hugepages=e.get("hugepages", "auto"),
        migratable=e.get("migratable", "no") == "yes",
        latency=e.get("latency", "normal"),
    )


def _parse_disk(e) -> DiskIntent:
    _known_attrs(e, {**_DISK_ATTRS, "target": None, "queues": None}, "disk")
    target = e.get("target")
    if target is None:
        raise BadInput("<vstor:disk> has no target attribute", hint="add target='vdb'")
    if not _TARGET.match(target):
        raise BadInput(f"<vstor:disk target='{target}'>: target must be a virtio disk name",
                       hint="like vdb, vdc, ... (vd + 1-3 letters)")
    where = f"<vstor:disk target='{target}'>"
    sources = [c for c in e if isinstance(c.tag, str)]
    _known_children(e, ("nvme", "nvmf", "file", "block"), f"disk target='{target}'")
    if len(sources) != 1:
        raise BadInput(f"{where} needs exactly one source element",
                       hint="one of <vstor:nvme>, <vstor:nvmf>, <vstor:file>, <vstor:block>")
    return DiskIntent(
        target=target,
        source=_parse_source(sources[0], where),
        mode=e.get("mode", "auto"),
        backend=e.get("backend", "auto"),
        queues=_int_attr(e, "queues", where, 1, 64),
        readonly=e.get("readonly", "no") == "yes",
        guest=e.get("guest", "kernel"),
    )


def _parse_source(e, where: str) -> Source:
    kind = etree.QName(e).localname
    if kind == "nvme":
        _known_attrs(e, {"controller": None, "namespace": None}, "nvme")
        return NvmeSource(controller=normalise_bdf(_required(e, "controller", where), where),
                          namespace=_int_attr(e, "namespace", where, 1, 2**32 - 1) or 1)
    if kind == "nvmf":
        return _parse_nvmf(e, where)
    _known_attrs(e, {"path": None}, kind)
    path = _required(e, "path", where)
    if not _PATH.match(path) or ".." in path.split("/") or os.path.normpath(path) != path:
        raise BadInput(f"{where}: <vstor:{kind} path='{path}'> is not a clean absolute path",
                       hint="use an absolute path of letters, digits and _.+:@/- without '..'")
    if kind == "block" and not path.startswith("/dev/"):
        raise BadInput(f"{where}: <vstor:block path='{path}'> is not under /dev",
                       hint="use <vstor:file> for a regular file")
    return FileSource(path) if kind == "file" else BlockSource(path)


def _parse_nvmf(e, where: str) -> NvmfSource:
    _known_attrs(e, {"transport": ("rdma", "tcp"), "traddr": None, "trsvcid": None,
                     "adrfam": ("ipv4", "ipv6"), "subnqn": None, "namespace": None,
                     "hostnqn": None, "nic": None}, "nvmf")
    _known_children(e, ("path", "reconnect"), "nvmf")
    transport = _required(e, "transport", where)
    subnqn = _required(e, "subnqn", where)
    hostnqn = e.get("hostnqn")
    for name, value in (("subnqn", subnqn), ("hostnqn", hostnqn)):
        if value is not None and not _NQN.match(value):
            raise BadInput(f"{where}: <vstor:nvmf {name}='{value}'> is not an NVMe qualified name",
                           hint="like nqn.2016-06.io.spdk:cnode1")
    nic = e.get("nic")
    if nic is not None and not _NIC.match(nic):
        raise BadInput(f"{where}: <vstor:nvmf nic='{nic}'> is not an RDMA device name",
                       hint="like mlx5_0")
    paths = tuple(NvmfPath(_addr(p, where), _int_attr(p, "trsvcid", where, 1, 65535) or 4420)
                  for p in e.findall(Q + "path"))
    timeouts = e.find(Q + "reconnect")
    t = {}
    if timeouts is not None:
        _known_attrs(timeouts, {"ctrlr_loss_timeout": None, "reconnect_delay": None,
                                "fast_io_fail_timeout": None}, "reconnect")
        for name in ("ctrlr_loss_timeout", "reconnect_delay", "fast_io_fail_timeout"):
            t[name] = _int_attr(timeouts, name, where, 0, 2**31 - 1)
    return NvmfSource(transport=transport, traddr=_addr(e, where), subnqn=subnqn,
                      trsvcid=_int_attr(e, "trsvcid", where, 1, 65535) or 4420,
                      adrfam=e.get("adrfam", "ipv4"),
                      namespace=_int_attr(e, "namespace", where, 1, 2**32 - 1) or 1,
                      hostnqn=hostnqn, nic=nic, paths=paths, **t)


def normalise_bdf(text: str, where: str = "") -> str:
    m = _BDF.match(text.lower())
    if not m:
        raise BadInput(f"{where}: '{text}' is not a PCI address".lstrip(": "),
                       hint="write it like 0000:5e:00.0")
    domain, bus, slot, fn = m.groups()
    return f"{domain or '0000'}:{bus}:{slot}.{fn}"


def _addr(e, where: str) -> str:
    value = _required(e, "traddr", where)
    if not _ADDR.match(value):
        raise BadInput(f"{where}: traddr '{value}' is not an address",
                       hint="an IPv4/IPv6 address or host name")
    return value


def _required(e, name: str, where: str) -> str:
    value = e.get(name)
    if value is None:
        tag = etree.QName(e).localname
        raise BadInput(f"{where}: <vstor:{tag}> has no {name} attribute", hint=f"add {name}='...'")
    return value


def _int_attr(e, name: str, where: str, lo: int, hi: int) -> int | None:
    value = e.get(name)
    if value is None:
        return None
    if not value.isdigit() or not lo <= int(value) <= hi:
        tag = etree.QName(e).localname
        raise BadInput(f"{where}: <vstor:{tag} {name}='{value}'> is out of range",
                       hint=f"a whole number from {lo} to {hi}")
    return int(value)


def _known_attrs(e, allowed: dict, tag: str) -> None:
    for name, value in e.attrib.items():
        if name not in allowed:
            raise BadInput(f"<vstor:{tag}> has unknown attribute '{name}'",
                           hint="allowed: " + ", ".join(sorted(allowed)))
        choices = allowed[name]
        if choices is not None and value not in choices:
            raise BadInput(f"<vstor:{tag} {name}='{value}'> is not allowed",
                           hint=f"{name} is one of: " + ", ".join(choices))


def _known_children(e, allowed: tuple[str, ...], tag: str) -> None:
    for child in e:
        if not isinstance(child.tag, str):
            continue            # comments, processing instructions
        qn = etree.QName(child)
        if qn.namespace != NS or qn.localname not in allowed:
            raise BadInput(f"<vstor:{tag}> has unexpected element <{qn.localname}>",
                           hint="allowed: " + ", ".join(f"<vstor:{a}>" for a in allowed))


@functools.lru_cache(maxsize=1)
def schema() -> etree.RelaxNG:
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "schema", "vstor.rng")
    return etree.RelaxNG(etree.parse(here))


def _check_schema(elem) -> None:
    rng = schema()
    if not rng.validate(etree.ElementTree(_copy(elem))):
        err = rng.error_log.last_error
        raise BadInput(f"vstor metadata does not match the schema: {err.message}",
                       hint="see vstor/schema/vstor.rng")


def _copy(elem):
    # Validate a detached copy: the element sits inside a whole domain.
    return etree.fromstring(etree.tostring(elem))
