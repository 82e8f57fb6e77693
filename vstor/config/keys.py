"""Every key of /etc/vstor/vstor.conf, declared once.

The parser, the Config record, `vstor config check`, the sample file
(etc/vstor.conf), the reference table (docs/configuration.md) and
vstor.conf(5) are all made from KEYS; `python3 scripts/gen-docs.py`
regenerates the files after a change here.
"""

from __future__ import annotations

from vstor.config.kinds import (Address, Bool, Choice, CpuList, IdRange, Int, Kind, Path, Paths,
                                PciList, Seconds, StorageId, Text)


class Key:
    __slots__ = ("section", "name", "kind", "default", "help", "attr", "example", "unset")

    def __init__(self, section: str, name: str, kind: Kind, default, help: str, *,
                 attr: str | None = None, example: str | None = None, unset: str | None = None):
        self.section, self.name, self.kind, self.default = section, name, kind, default
        self.help = help
        self.attr = attr or name            # the Config field
        self.example = example              # a value as written in the file, when not the default
        self.unset = unset                  # what a default of None means

    @property
    def default_text(self) -> str:
        """The default as the reference shows it."""
        if self.default is None:
            return self.unset or "not set"
        return self.kind.format(self.default) or "(empty)"

    def sample_value(self) -> str:
        """A value that shows how to write the key: its example, else its default."""
        return self.example if self.example is not None else self.kind.format(self.default)

    def __repr__(self) -> str:
        return f"Key([{self.section}] {self.name})"


# Sections in the order the sample and the reference show them.
SECTIONS = {
    "paths": "Where vstor keeps its state and sockets, and where disk images may live.",
    "cpu": "Cores vstor keeps for the host and for SPDK; vCPUs are planned onto the rest.",
    "qemu": "The user and group QEMU runs as (libvirt's qemu.conf).",
    "spdk": "How vstor reaches SPDK's vhost application.",
    "pci": "Which NVMe controllers vstor may take (SPDK's PCI_ALLOWED and PCI_BLOCKED).",
    "vhost": "vhost-user-blk disks.",
    "memory": "Memory vstor never plans a VM into.",
    "nvmf": "NVMe over Fabrics disks: this host as an NVMe-oF host.",
    "migrate": "Live migration between vstor hosts.",
    "pve": "Proxmox VE: where qemu-server keeps its files.",
    "nova": "OpenStack Nova's compute driver.",
}

KEYS: tuple[Key, ...] = (
    Key("paths", "state_dir", Path(), "/run/vstor/state",
        "Per-domain records of every host change vstor made, read to undo them."),
    Key("paths", "vhost_dir", Path(), "/run/vstor/vhost",
        "The vhost-user sockets. SPDK's vhost application must be started with -S set to "
        "this directory."),
    Key("paths", "qsd_dir", Path(), "/run/vstor/qsd",
        "qemu-storage-daemon's pid and QMP files."),
    Key("paths", "images", Paths(), ("/var/lib/libvirt/images", "/var/lib/vstor/images"),
        "Image roots, like a storage pool's: a <vstor:file> source must resolve inside one."),

    Key("cpu", "housekeeping", CpuList(), None,
        "Cores for emulator threads and shared vCPUs, on each NUMA node.",
        example="0-1,16-17,32-33,48-49", unset="the first core of each NUMA node"),
    Key("cpu", "reactors", CpuList(), (),
        "SPDK's reactor cores (SPDK's -m mask), one on each node the NVMe is on; "
        "never given to vCPUs, never housekeeping cores.", example="2,18"),

    Key("qemu", "user", Text(), "libvirt-qemu", "The user QEMU runs as.", attr="qemu_user"),
    Key("qemu", "group", Text(), "kvm",
        "The group QEMU runs as: vhost-user sockets are root:GROUP, mode 0660.",
        attr="qemu_group"),

    Key("spdk", "rpc_socket", Text(), "/var/tmp/spdk.sock", "SPDK's JSON-RPC socket.",
        attr="spdk_socket"),
    Key("spdk", "timeout", Seconds(), 30.0, "How long vstor waits for an SPDK RPC to answer.",
        attr="spdk_timeout"),

    Key("pci", "allowed", PciList(), (),
        "Controllers vstor may take; empty: any controller not blocked.",
        attr="pci_allowed", example="0000:5e:00.0 0000:5f:00.0"),
    Key("pci", "blocked", PciList(), (),
        "Controllers vstor never takes (the host's boot disk); blocked wins over allowed.",
        attr="pci_blocked", example="0000:01:00.0"),

    Key("vhost", "default_backend", Choice("qsd", "spdk"), "qsd",
        "The backend tried first for a vhost-user disk whose intent says backend='auto' "
        "(qemu-storage-daemon or SPDK); the other is tried when it does not fit."),

    Key("vhost", "supervise", Bool(), True,
        "Start a qemu-storage-daemon again when it dies while its domain runs (a supervisor "
        "per host; docs/operations.md).", attr="supervise"),
    Key("vhost", "restart_limit", Int("", 1, 1000, noun="restart count"), 5,
        "How many times the supervisor starts one daemon again within restart_window; at the "
        "next death it stays dead and vstor status names it (systemd's StartLimitBurst).",
        attr="restart_limit"),
    Key("vhost", "restart_window", Seconds(), 10.0,
        "The window of restart_limit, in seconds (systemd's StartLimitIntervalSec).",
        attr="restart_window"),

    Key("vhost", "confine", Bool(), True,
        "Run each qemu-storage-daemon as a uid of its own from daemon_users: no capabilities, "
        "no_new_privs, a seccomp filter, no network, a read-only view of the filesystem "
        "(docs/security.md).", attr="confine"),
    Key("vhost", "daemon_users", IdRange(), (1879048192, 1879052287),
        "The uids (and gids of the same numbers) confined qemu-storage-daemons run as, one "
        "per daemon; no account or other program may use them.", attr="daemon_users"),

    Key("memory", "reserved", Int("MiB"), 1024,
        "MiB of each NUMA node's memory outside its hugepage pools that no VM is planned "
        "into: the host's own (kernel, libvirtd, QEMU's overhead, SPDK).",
        attr="memory_reserved_mib"),

    Key("nvmf", "hostnqn", Text(), None,
        "The host NQN SPDK attaches NVMe-oF disks with, unless a disk names its own.",
        example="nqn.2014-08.com.example:compute-17",
        unset="/etc/nvme/hostnqn, else one made from /etc/machine-id"),
    Key("nvmf", "ctrlr_loss_timeout_sec", Int("seconds"), 60,
        "SPDK's ctrlr_loss_timeout_sec for an NVMe-oF disk whose <vstor:reconnect> sets "
        "none: how long SPDK tries to reconnect a lost controller before the disk fails."),
    Key("nvmf", "reconnect_delay_sec", Int("seconds"), 5,
        "SPDK's reconnect_delay_sec (likewise): the wait between two reconnect attempts."),
    Key("nvmf", "fast_io_fail_timeout_sec", Int("seconds"), 30,
        "SPDK's fast_io_fail_timeout_sec (likewise): how long I/O to a lost controller "
        "waits before it fails."),

    Key("migrate", "shared", Paths(), (),
        "Storage every migration peer sees at the same path (a cluster or network "
        "filesystem's mount point, a multipath device): files and block devices under one "
        "are live-migratable. Network filesystems are recognised without it.",
        attr="migrate_shared", example="/srv/vmstore /dev/mapper/mpatha"),
    Key("migrate", "peer_command", Text(), "ssh -o BatchMode=yes -- {host} vstor migrate agent",
        "How `vstor migrate` reaches vstor on the destination; {host} is the destination's "
        "host name. Run as argv, never through a shell."),
    Key("migrate", "timeout", Int("seconds"), 600,
        "How long `vstor migrate prepare --run` lets libvirt's migration run.",
        attr="migrate_timeout"),
    Key("migrate", "export_address", Address(), None,
        "Where this host's SPDK exports local NVMe over NVMe-oF to a migration's "
        "destination: an address of this host the destination reaches.",
        example="192.168.100.7", unset="none (then local NVMe behind SPDK does not live-migrate)"),
    Key("migrate", "export_transport", Choice("rdma", "tcp"), "rdma",
        "The NVMe-oF transport of that export."),
    Key("migrate", "export_port", Int("", 1, 65535, noun="port"), 4420,
        "The NVMe-oF port of that export."),
    Key("migrate", "local_peers", Bool(), False,
        "The migration peers are \"hosts\" on this one machine (a lab, a test): only then "
        "may a destination's qemu-storage-daemon share a file with the source's."),

    Key("pve", "etc", Path(), "/etc/pve", "Proxmox's cluster filesystem.", attr="pve_etc"),
    Key("pve", "storage", StorageId(), "local",
        "The storage whose snippets hold the hookscript and the VMs' vstor-VMID.xml "
        "intents and plans.", attr="pve_storage"),
    Key("pve", "run_dir", Path(), "/var/run/qemu-server",
        "qemu-server's pid files (what runs on this node).", attr="pve_run_dir"),
    Key("pve", "lock_dir", Path(), "/var/lock/qemu-server",
        "qemu-server's per-VM config locks.", attr="pve_lock_dir"),
    Key("pve", "qemu", Path(), "/usr/bin/kvm",
        "The QEMU qemu-server starts; its version decides the arguments vstor writes.",
        attr="pve_qemu"),

    Key("nova", "migrate_command", Text(), "sudo -n vstor",
        "How vstor's Nova driver (nova-compute, as the nova user) runs `vstor nova migrate` "
        "as root: a command prefix, run as argv, never through a shell.",
        attr="nova_migrate_command"),
    Key("nova", "vhost_disks", Int("", 1, 100000, noun="disk count"), 64,
        "How many vhost-user-blk disks from qemu-storage-daemon this host offers Nova's "
        "scheduler (the CUSTOM_VSTOR_VHOST_QSD inventory of `vstor nova config "
        "--provider-config`); 64 daemons stay on native AIO at the kernel's default "
        "fs.aio-max-nr.", attr="nova_vhost_disks"),
)

BY_SECTION: dict[str, dict[str, Key]] = {s: {} for s in SECTIONS}
for _key in KEYS:
    BY_SECTION[_key.section][_key.name] = _key
