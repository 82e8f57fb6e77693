"""NVMe controllers and namespaces, other disks, partitions, dm/md volumes,
and the mounts and swaps on them."""

from __future__ import annotations

import itertools
import re

from vstor.errors import BadInput

from .model import KEYS, USE_KEYS, Block, Build, Pci, check_keys, parse_size, pci_address
from .pci import AHCI

SCHEDULERS = ["none", "mq-deadline", "kyber", "bfq"]
# Disks no controller serves, under /sys/devices/virtual/block, by kernel
# name prefix: their major (zram's, ublk's and rbd's are dynamic; these are
# typical).  rbd really sits under /sys/devices/rbd/N/block; nothing vstor
# reads depends on that.
VIRTUAL = {"loop": 7, "nbd": 43, "ram": 1, "zram": 251, "ublkb": 250, "rbd": 249, "drbd": 147}


def write_controllers(b: Build) -> None:
    specs = [s for s in b.layout.get("nvme", [])
             if b.pci[pci_address(s["address"])].driver == "nvme"]
    taken = {int(s["name"][4:]) for s in specs if "name" in s}
    free = (i for i in itertools.count() if i not in taken)
    for spec in specs:
        instance = int(spec["name"][4:]) if "name" in spec else next(free)
        _controller(b, spec, b.pci[pci_address(spec["address"])], instance)


def _controller(b: Build, spec: dict, dev: Pci, instance: int) -> None:
    name, t = f"nvme{instance}", b.t
    ctrl = f"{dev.path}/nvme/{name}"
    model = spec.get("model", "INTEL SSDPE2KX040T8")
    serial = spec.get("serial", f"PHLJ{9100 + instance:04d}00A4P0DGN")
    nqn = f"nqn.2014.08.org.nvmexpress:{dev.vendor[2:]}{dev.vendor[2:]}{serial}{model}"
    for attr, value in (("model", model), ("serial", serial), ("firmware_rev", "VDV10170"),
                        ("transport", "pcie"), ("address", dev.address), ("state", "live"),
                        ("cntlid", 0), ("numa_node", dev.node), ("subsysnqn", nqn),
                        ("dev", f"240:{instance}")):
        t.write(f"{ctrl}/{attr}", value)
    t.link(f"{ctrl}/device", dev.path)
    t.link(f"/sys/class/nvme/{name}", ctrl)
    head_dir = None
    if spec.get("multipath"):
        head_dir = f"/sys/devices/virtual/nvme-subsystem/nvme-subsys{instance}"
        for attr, value in (("model", model), ("serial", serial), ("subsysnqn", nqn)):
            t.write(f"{head_dir}/{attr}", value)
        t.link(f"{head_dir}/{name}", ctrl)
        t.link(f"/sys/class/nvme-subsystem/nvme-subsys{instance}", head_dir)
    for i, ns in enumerate(spec.get("namespace", [{}])):
        check_keys(ns, KEYS["namespace"], f"namespace {i + 1} of {dev.address}")
        _namespace(b, ns, ctrl, instance, ns.get("nsid", i + 1), head_dir)


def _namespace(b: Build, spec: dict, ctrl: str, instance: int, nsid: int,
               head_dir: str | None) -> None:
    head = f"nvme{instance}n{nsid}"
    if head_dir:
        # Native multipath: the controller holds a hidden per-path device
        # (no dev_t); the block device is the subsystem's head.
        path_dev = f"{ctrl}/nvme{instance}c{instance}n{nsid}"
        b.t.write(f"{path_dev}/nsid", nsid)
        b.t.write(f"{path_dev}/ana_state", "optimized")
        b.t.link(f"/sys/block/nvme{instance}c{instance}n{nsid}", path_dev)
        b.t.link(f"/sys/class/block/nvme{instance}c{instance}n{nsid}", path_dev)
    disk_dir = f"{head_dir or ctrl}/{head}"
    _disk(b, head, disk_dir, spec, 259, b.blkext, {"nsid": nsid, "wwid": f"eui.{instance:04x}{nsid:012x}"},
          default_size="1TB")


def _disk(b: Build, name: str, path: str, spec: dict, major: int, minors, extra: dict,
          default_size: str = "1TB", source: str | None = None) -> None:
    t, size = b.t, parse_size(spec.get("size", default_size))
    scheduler = spec.get("scheduler", "none")
    choices = SCHEDULERS if scheduler in SCHEDULERS else SCHEDULERS + [scheduler]
    t.write(f"{path}/queue/scheduler", " ".join(f"[{s}]" if s == scheduler else s for s in choices))
    t.write(f"{path}/queue/logical_block_size", 512)
    t.write(f"{path}/queue/rotational", 0)
    t.write(f"{path}/removable", 0)
    for attr, value in extra.items():
        t.write(f"{path}/{attr}", value)
    _block(b, name, path, spec, f"{major}:{next(minors)}", size, "disk", source)
    t.link(f"/sys/block/{name}", path)
    start = 2048
    for k, part in enumerate(spec.get("partitions", []), start=1):
        check_keys(part, KEYS["partition"], f"partition {k} of {name}")
        pname = f"{name}p{k}" if name[-1].isdigit() else f"{name}{k}"
        psize = parse_size(part.get("size", "1GiB"))
        t.write(f"{path}/{pname}/partition", k)
        t.write(f"{path}/{pname}/start", start)
        _block(b, pname, f"{path}/{pname}", part, f"{major}:{next(minors)}", psize, "partition", None)
        start += psize // 512


def _block(b: Build, name: str, path: str, spec: dict, devnum: str, size: int, kind: str,
           source: str | None) -> None:
    t = b.t
    t.write(f"{path}/dev", devnum)
    t.write(f"{path}/size", size // 512)
    t.write(f"{path}/ro", 0)
    t.write(f"{path}/uevent", f"MAJOR={devnum.split(':')[0]}\nMINOR={devnum.split(':')[1]}\n"
            f"DEVNAME={name}\nDEVTYPE={kind}")
    t.mkdir(f"{path}/holders")
    if kind == "disk":
        t.mkdir(f"{path}/slaves")
    t.link(f"/sys/class/block/{name}", path)
    t.link(f"/sys/dev/block/{devnum}", path)
    block = Block(path, devnum, size, spec.get("source", source or f"/dev/{name}"))
    b.blocks[name] = block
    if "mount" in spec:
        b.mounts.append((spec["mount"], devnum, spec.get("fs", "ext4"), block.source))
    if spec.get("swap"):
        b.swaps.append((block.source, size // 1024))


def write_disks(b: Build) -> None:
    for k, spec in enumerate(b.layout.get("disk", [])):
        check_keys(spec, KEYS["disk"], f"disk {spec.get('name', k)}")
        name = spec.get("name", f"sd{chr(ord('a') + k)}")
        virtual = re.fullmatch(r"([a-z]+?)(\d+)", name)
        if virtual and virtual.group(1) in VIRTUAL:
            number = int(virtual.group(2))
            path, major, minors = f"/sys/devices/virtual/block/{name}", VIRTUAL[virtual.group(1)], \
                iter(range(16 * number, 16 * number + 16))
            extra = {"loop/backing_file": spec["backing"]} if "backing" in spec else {}
            _disk(b, name, path, {"scheduler": "none", **spec}, major, minors, extra, "16GiB")
            continue
        if "backing" in spec:
            raise BadInput(f"disk {name}: only a loop device has a backing file")
        controller = b.pci[pci_address(spec.get("pci", AHCI))]
        if name.startswith("sd"):
            path = f"{controller.path}/ata{k + 1}/host{k}/target{k}:0:0/{k}:0:0:0/block/{name}"
            major, minors = 8, iter(range(16 * k, 16 * k + 16))
        else:
            path, major, minors = f"{controller.path}/virtio{k}/block/{name}", 252, iter(range(16 * k, 16 * k + 16))
        _disk(b, name, path, {"scheduler": "mq-deadline", **spec}, major, minors, {}, "480GB")


def write_volumes(b: Build) -> None:
    for spec in b.layout.get("volume", []):
        check_keys(spec, KEYS["volume"], f"volume {spec.get('name', '?')}")
        name, members = spec["name"], spec.get("on", [])
        members = [members] if isinstance(members, str) else members
        for member in members:
            if member not in b.blocks:
                raise BadInput(f"volume {name} is on {member}, which the layout does not describe")
        size = spec.get("size", b.blocks[members[0]].size if members else "10GiB")
        if re.fullmatch(r"md\d+", name):
            kname, path = name, f"/sys/devices/virtual/block/{name}"
            extra, major, minor, source = {"md/level": spec.get("level", "raid1")}, 9, int(name[2:]), None
        else:
            minor = next(b.dm)
            kname, path = f"dm-{minor}", f"/sys/devices/virtual/block/dm-{minor}"
            extra = {"dm/name": name, "dm/uuid": f"LVM-vstor{minor:04d}", "dm/suspended": 0}
            major, source = 254, f"/dev/mapper/{name}"
        volume = {k: v for k, v in spec.items() if k in USE_KEYS | {"partitions"}} | {"size": size}
        # An md device's partitions (md0p1) take minors of its major past any
        # device's own (the kernel gives them blkext's 259:N; nothing reads that).
        minors = itertools.chain([minor], itertools.count(1024 + 16 * minor))
        _disk(b, kname, path, volume, major, minors, extra, source=source)
        for member in members:
            b.t.link(f"{b.blocks[member].path}/holders/{kname}", path)
            b.t.link(f"{path}/slaves/{member}", b.blocks[member].path)
