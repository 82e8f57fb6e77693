"""Every name vstor derives, in one place: safe names, PCI addresses, volume
keys, socket paths, SPDK controller names.  Pure."""

from __future__ import annotations

import json
import os
import re

from vstor.errors import BadInput

#: A name that may appear in a file name (domain safe names, state records).
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
#: <safe name>-<target>: a disk's socket, vhost controller and daemon name.
DISK_NAME = re.compile(SAFE_NAME.pattern[:-1] + r"-vd[a-z]{1,3}$")
_BDF = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
SOCKET_MAX = 107            # sizeof(sun_path) - 1


def is_safe_name(name: str) -> bool:
    return bool(SAFE_NAME.match(name))


def safe_key(name: str, uuid: str | None, origin: str) -> str:
    """A domain's name as it may appear in a file name; its UUID when the
    name holds anything but letters, digits and _.+- (never trusted into a
    path)."""
    if is_safe_name(name):
        return name
    if uuid and re.match(r"^[0-9a-f-]{36}$", uuid):
        return uuid
    raise BadInput(f"{origin}: domain name '{name}' cannot be used in socket names",
                   hint="use letters, digits and _.+- or give the domain a <uuid>")


def is_disk_name(name: str) -> bool:
    """Named the way socket_path names a disk."""
    return bool(DISK_NAME.match(name))


def normalise_bdf(text: str) -> str:
    """'5E:00.0' -> '0000:5e:00.0' (SPDK's lists and the kernel accept both)."""
    m = _BDF.match(text.strip().lower())
    if not m:
        raise BadInput(f"'{text}' is not a PCI address", hint="write it like 0000:5e:00.0")
    domain, bus, slot, fn = m.groups()
    return f"{domain or '0000'}:{bus}:{slot}.{fn}"


def volume_keys(source) -> tuple[str, ...]:
    """What two writers must never share: two disks are the same volume when
    they share one key.  A remote namespace has one key per path (a subsystem
    reached at an address and port): NQNs are reused across targets in
    practice (SPDK's example cnode1), and two multipath disks are one volume
    when any of their paths is the same."""
    if source.kind == "nvme":
        return (f"nvme:{source.controller}/{source.namespace}",)
    if source.kind == "nvmf":
        paths = [(source.traddr, source.trsvcid), *((p.traddr, p.trsvcid) for p in source.paths)]
        return tuple(f"nvmf:{source.transport}:{addr.lower()}:{port}:{source.subnqn}/{source.namespace}"
                     for addr, port in paths)
    return (f"{source.kind}:{source.path}",)


#: The fw_cfg entry whose file vstor's prepare writes (docs/libvirt.md): QEMU
#: reads it before it creates any device, so a start the hook did not
#: prepare fails at once, naming vstor, instead of waiting for a socket.
GATE_FWCFG = "opt/dev.vstor/prepared"
GATE_TEXT = "prepared by vstor\n"


def gate_path(vhost_dir: str, safe_name: str) -> str:
    """The file a domain's start needs vstor's prepare to have written:
    <vhost_dir>/<safe name>.vstor-prepared (QEMU reaches it as it reaches
    the sockets there)."""
    if not is_safe_name(safe_name):
        raise BadInput(f"'{safe_name}' cannot name a file")
    return os.path.join(vhost_dir, f"{safe_name}.vstor-prepared")


def socket_path(vhost_dir: str, safe_name: str, target: str) -> str:
    """The vhost-user socket of one disk: <vhost_dir>/<safe name>-<target>."""
    if not is_safe_name(safe_name):
        raise BadInput(f"'{safe_name}' cannot name a socket")
    path = os.path.join(vhost_dir, f"{safe_name}-{target}")
    if len(path.encode()) > SOCKET_MAX:
        raise BadInput(f"vhost socket path {path} is longer than a Unix socket allows "
                       f"({SOCKET_MAX} bytes)", hint="shorten the domain name or [paths] vhost_dir")
    return path


def spdk_controller_name(source, paths=()) -> str:
    """SPDK bdev_nvme controller name, shared by every vstor disk that uses
    the same controller.  A local one is named by its PCI address.  A remote
    one by everything that makes it a different connection: every path's
    attach parameters (transport, address, port, subsystem and host NQN,
    multipath mode, reconnect timeouts), so two domains share a controller
    only when all of it matches, and two targets that reuse an NQN get two
    controllers."""
    if source.kind == "nvme":
        return "vs_" + source.controller.replace(":", "_").replace(".", "_")
    import hashlib      # here, not at the top: the hook's release never needs it
    identity = json.dumps([{k: v for k, v in p.params("").items() if k != "name"} for p in paths],
                          sort_keys=True)
    return f"vs_nvmf_{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def nvme_path(trtype, traddr, trsvcid, subnqn, hostnqn=None) -> str:
    """One path of an NVMe controller as SPDK tells them apart: the transport
    ID and the host NQN (bdev_nvme_create refuses a second controller with
    both the same).  Also how vstor names a path to an operator."""
    where = f"{traddr}:{trsvcid}" if trsvcid else traddr
    return f"{str(trtype).upper()} {str(where).lower()} {subnqn or ''} {hostnqn or ''}".strip()


#: The subsystem NQNs of vstor's migration exports: only a migration's
#: import names one, never a domain's metadata (planner.check_request).
MIGRATION_SUBNQN = "nqn.2016-06.io.vstor:migrate:"


def migration_subnqn(safe_name: str, target: str) -> str:
    """The subsystem a migration exports a domain's local NVMe disk as."""
    return f"{MIGRATION_SUBNQN}{safe_name}-{target}"


def bdev_name(controller: str, namespace: int) -> str:
    """SPDK names a controller's namespaces <controller>n<nsid>."""
    return f"{controller}n{namespace}"


def inside(path: str, roots) -> bool:
    """Is `path` (clean and absolute) strictly below one of `roots`?"""
    return any(path.startswith(root.rstrip("/") + "/") for root in roots)


# How often QEMU tries a vhost-user socket again once its backend has gone
# (libvirt's <reconnect timeout>, QEMU's reconnect=): a daemon the
# supervisor starts again (in about 0.1 s) serves the guest again within a
# second or so (tests/e2e/test_supervise.py).
RECONNECT_SECONDS = 1
