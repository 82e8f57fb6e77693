"""The host configuration file, /etc/vstor/vstor.conf (INI).

Every key is optional; unknown sections or keys are refused so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import configparser
import os
import re

from vstor.cpulist import parse_cpulist
from vstor.errors import BadInput
from vstor.meta.names import normalise_bdf
from vstor.records import field, record

DEFAULT_PATH = "/etc/vstor/vstor.conf"

_KEYS = {
    "paths": {"state_dir", "vhost_dir", "qsd_dir", "images"},
    "cpu": {"housekeeping", "reactors"},
    "qemu": {"user", "group"},
    "spdk": {"rpc_socket", "timeout"},
    "pci": {"allowed", "blocked"},
    "memory": {"reserved"},
    "vhost": {"default_backend"},
    "nvmf": {"hostnqn", "ctrlr_loss_timeout_sec", "reconnect_delay_sec",
             "fast_io_fail_timeout_sec"},
    "migrate": {"shared", "peer_command", "timeout", "export_address", "export_transport",
                "export_port", "local_peers"},
    "pve": {"etc", "storage", "run_dir", "lock_dir", "qemu"},
    "nova": {"migrate_command"},
}

@record
class Config:
    state_dir: str = "/run/vstor/state"
    # SPDK's vhost app must be started with -S set to this directory.
    vhost_dir: str = "/run/vstor/vhost"
    qsd_dir: str = "/run/vstor/qsd"
    # Image roots, like a storage pool's: a file source must resolve inside one.
    images: tuple[str, ...] = ("/var/lib/libvirt/images", "/var/lib/vstor/images")
    # None: not configured, the planner picks the first core of each node.
    housekeeping: tuple[int, ...] | None = None
    reactors: tuple[int, ...] = ()
    qemu_user: str = "libvirt-qemu"
    qemu_group: str = "kvm"
    spdk_socket: str = "/var/tmp/spdk.sock"
    spdk_timeout: float = 30.0
    pci_allowed: tuple[str, ...] = ()
    pci_blocked: tuple[str, ...] = ()
    default_backend: str = "qsd"
    hostnqn: str | None = None
    ctrlr_loss_timeout_sec: int = 60
    reconnect_delay_sec: int = 5
    fast_io_fail_timeout_sec: int = 30
    # MiB of each node's memory outside its hugepage pools that no VM is
    # planned into: the host's own (kernel, libvirtd, QEMU's overhead, SPDK).
    memory_reserved_mib: int = 1024
    # Storage every migration peer sees at the same path (a cluster or network
    # filesystem's mount point, a multipath device): files and block devices
    # under one are live-migratable.  Network filesystems are recognised alone.
    migrate_shared: tuple[str, ...] = ()
    # How `vstor migrate` reaches vstor on the destination; {host} is the
    # destination's host name.  Run as argv, never through a shell.
    peer_command: str = "ssh -o BatchMode=yes -- {host} vstor migrate agent"
    # Seconds `vstor migrate prepare --run` lets libvirt's migration run.
    migrate_timeout: int = 600
    # Where this host's SPDK exports local NVMe over NVMe-oF to a migration's
    # destination (an address of this host the destination reaches).
    export_address: str | None = None
    export_transport: str = "rdma"
    export_port: int = 4420
    # The migration peers are "hosts" on this one machine (a lab, a test):
    # only then may a destination's qemu-storage-daemon share a file with
    # the source's (another mount namespace, a socket of the same name).
    local_peers: bool = False
    # Proxmox VE: the cluster filesystem, the storage whose snippets hold the
    # hookscript and the VMs' vstor intents, qemu-server's pid and lock
    # directories, and the QEMU it starts (whose version the args follow).
    pve_etc: str = "/etc/pve"
    pve_storage: str = "local"
    pve_run_dir: str = "/var/run/qemu-server"
    pve_lock_dir: str = "/var/lock/qemu-server"
    pve_qemu: str = "/usr/bin/kvm"
    # How vstor's Nova driver (nova-compute, as the nova user) runs
    # `vstor nova migrate` as root: a command prefix, run as argv.
    nova_migrate_command: str = "sudo -n vstor"
    source: str = field(default="(defaults)", compare=False)

    @property
    def file(self) -> str:
        """The file an operator edits to change this configuration."""
        return DEFAULT_PATH if self.source == "(defaults)" else self.source


def load(path: str | None = None) -> Config:
    """Read the config file; a missing default file means all defaults."""
    explicit = path or os.environ.get("VSTOR_CONFIG")
    path = explicit or DEFAULT_PATH
    if not os.path.exists(path):
        if explicit:
            raise BadInput(f"config file {path} does not exist",
                           hint="create it or drop --config/VSTOR_CONFIG")
        return Config()
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
    try:
        with open(path) as f:
            parser.read_file(f)
    except (configparser.Error, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0]
        raise BadInput(f"{path}: {first}") from None
    except OSError as e:
        raise BadInput(f"cannot read config file {path}: {e.strerror}") from None
    return _from_parser(parser, path)


def _from_parser(parser: configparser.ConfigParser, path: str) -> Config:
    values: dict = {}
    for section in parser.sections():
        if section not in _KEYS:
            raise BadInput(f"{path}: unknown section [{section}]",
                           hint="known: " + ", ".join(sorted(_KEYS)))
        for key, raw in parser.items(section):
            if key not in _KEYS[section]:
                raise BadInput(f"{path}: unknown key '{key}' in [{section}]",
                               hint="known: " + ", ".join(sorted(_KEYS[section])))
            values[(section, key)] = raw.strip()
    return _build(values, path)


def _build(v: dict, path: str) -> Config:
    kw: dict = {"source": path}
    for key in ("state_dir", "vhost_dir", "qsd_dir"):
        if ("paths", key) in v:
            kw[key] = _abs_dir(v[("paths", key)], f"[paths] {key}", path)
    if ("paths", "images") in v:
        kw["images"] = tuple(_abs_dir(d, "[paths] images", path)
                             for d in v[("paths", "images")].replace(",", " ").split())
    if ("cpu", "housekeeping") in v:
        kw["housekeeping"] = _cpus(v[("cpu", "housekeeping")], "housekeeping", path)
    if ("cpu", "reactors") in v:
        kw["reactors"] = _cpus(v[("cpu", "reactors")], "reactors", path)
    for (section, key), name in {("qemu", "user"): "qemu_user",
                                 ("qemu", "group"): "qemu_group",
                                 ("spdk", "rpc_socket"): "spdk_socket",
                                 ("nvmf", "hostnqn"): "hostnqn"}.items():
        if (section, key) in v and v[(section, key)]:
            kw[name] = v[(section, key)]
    for key in ("allowed", "blocked"):
        if ("pci", key) in v:
            kw[f"pci_{key}"] = _pci_list(v[("pci", key)], key, path)
    if ("vhost", "default_backend") in v:
        backend = v[("vhost", "default_backend")]
        if backend not in ("qsd", "spdk"):
            raise BadInput(f"{path}: [vhost] default_backend is '{backend}'",
                           hint="use qsd or spdk")
        kw["default_backend"] = backend
    for (section, key) in (("nvmf", "ctrlr_loss_timeout_sec"),
                           ("nvmf", "reconnect_delay_sec"), ("nvmf", "fast_io_fail_timeout_sec")):
        if (section, key) in v:
            kw[key] = _int(v[(section, key)], f"[{section}] {key}", path)
    if ("spdk", "timeout") in v:
        kw["spdk_timeout"] = float(_int(v[("spdk", "timeout")], "[spdk] timeout", path))
    if ("migrate", "shared") in v:
        kw["migrate_shared"] = tuple(_abs_dir(d, "[migrate] shared", path)
                                     for d in v[("migrate", "shared")].replace(",", " ").split())
    if v.get(("migrate", "peer_command")):
        kw["peer_command"] = v[("migrate", "peer_command")]
    if v.get(("migrate", "export_address")):
        from vstor.meta.intent import ADDR
        from vstor.meta.types import Invalid
        addr = v[("migrate", "export_address")]
        try:
            ADDR.parse(addr, "export_address")
        except Invalid:
            raise BadInput(f"{path}: [migrate] export_address '{addr}' is not an address",
                           hint="an IPv4/IPv6 address or host name of this host") from None
        kw["export_address"] = addr
    if ("migrate", "export_transport") in v:
        transport = v[("migrate", "export_transport")].lower()
        if transport not in ("rdma", "tcp"):
            raise BadInput(f"{path}: [migrate] export_transport is '{transport}'", hint="use rdma or tcp")
        kw["export_transport"] = transport
    if ("migrate", "export_port") in v:
        kw["export_port"] = _int(v[("migrate", "export_port")], "[migrate] export_port", path, "port")
        if not 1 <= kw["export_port"] <= 65535:
            raise BadInput(f"{path}: [migrate] export_port {kw['export_port']} is not a port",
                           hint="a number from 1 to 65535")
    if ("migrate", "local_peers") in v:
        flag = v[("migrate", "local_peers")].lower()
        if flag not in ("yes", "no"):
            raise BadInput(f"{path}: [migrate] local_peers is '{flag}'", hint="use yes or no")
        kw["local_peers"] = flag == "yes"
    if ("migrate", "timeout") in v:
        kw["migrate_timeout"] = _int(v[("migrate", "timeout")], "[migrate] timeout", path)
    for key in ("etc", "run_dir", "lock_dir", "qemu"):
        if ("pve", key) in v:
            kw["pve_" + key] = _abs_dir(v[("pve", key)], f"[pve] {key}", path)
    if ("pve", "storage") in v:
        sid = v[("pve", "storage")]
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", sid):
            raise BadInput(f"{path}: [pve] storage '{sid[:40]}' is not a Proxmox storage ID",
                           hint="like local or cephfs")
        kw["pve_storage"] = sid
    if v.get(("nova", "migrate_command")):
        kw["nova_migrate_command"] = v[("nova", "migrate_command")]
    if ("memory", "reserved") in v:
        kw["memory_reserved_mib"] = _int(v[("memory", "reserved")], "[memory] reserved", path, "MiB")
    return Config(**kw)


def _abs_dir(value: str, what: str, path: str) -> str:
    if not value.startswith("/") or ".." in value.split("/"):
        raise BadInput(f"{path}: {what} must be an absolute path without '..', not '{value}'")
    return os.path.normpath(value)


def _cpus(value: str, what: str, path: str) -> tuple[int, ...]:
    try:
        return parse_cpulist(value)
    except ValueError:
        raise BadInput(f"{path}: [cpu] {what} is not a CPU list: '{value}'",
                       hint="write it like 0-1,32-33") from None


def _int(value: str, what: str, path: str, unit: str = "seconds") -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise BadInput(f"{path}: {what} must be a whole number of {unit}, not '{value}'")
    return int(value)


def _pci_list(value: str, what: str, path: str) -> tuple[str, ...]:
    out = []
    for item in value.replace(",", " ").split():
        try:
            out.append(normalise_bdf(item))
        except BadInput:
            raise BadInput(f"{path}: [pci] {what}: '{item.lower()}' is not a PCI address",
                           hint="write it like 0000:5e:00.0") from None
    return tuple(out)
