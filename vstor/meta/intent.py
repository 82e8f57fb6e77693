"""The operator's intent: vstor's elements in a domain's <metadata>, declared
once (vstor.meta.xmlmodel derives parsing, serialising and the schema).

The same source elements (<vstor:nvme>, <vstor:nvmf>, <vstor:file>,
<vstor:block>) also appear in the plan record, as the source as planned.
"""

from __future__ import annotations

from vstor.meta.names import normalise_bdf
from vstor.meta.types import Enum, Int, Text, YesNo
from vstor.meta.xmlmodel import attr, child, children, choice, element
from vstor.records import record

# A path component other than '.' and '..', of letters, digits and _.+:@-.
_SEG = r"([A-Za-z0-9_+:@\-][A-Za-z0-9_.+:@\-]*|\.[A-Za-z0-9_+:@\-][A-Za-z0-9_.+:@\-]*|\.\.[A-Za-z0-9_.+:@\-]+)"
_PATH_HINT = "use an absolute path of letters, digits and _.+:@/- without '.' or '..' components"

TARGET = Text(r"vd[a-z]{1,3}", "is not a virtio disk name", "like vdb, vdc, ... (vd + 1-3 letters)")
BDF = Text(r"([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]", "is not a PCI address",
           "write it like 0000:5e:00.0", normalise=normalise_bdf)
ABSPATH = Text(f"(/{_SEG})+", "is not a clean absolute path", _PATH_HINT, max_length=4095)
DEVPATH = Text(f"/dev(/{_SEG})+", "is not under /dev (or not a clean path)",
               "use <vstor:file> for a regular file; " + _PATH_HINT, max_length=4095)
ADDR = Text(r"[0-9A-Za-z.:_\-]{1,255}", "is not an address", "an IPv4/IPv6 address or host name")
NQN = Text(r"nqn\.[!-~]{1,219}", "is not an NVMe qualified name (ASCII, at most 223 bytes)",
           "like nqn.2016-06.io.spdk:cnode1")
NIC = Text(r"[A-Za-z0-9_.\-]{1,64}", "is not an RDMA device name", "like mlx5_0")
NSID = Int(1, 2**32 - 1)
PORT = Int(1, 65535)
SECONDS = Int(0, 2**31 - 1)
MAX_CELLS = 8
CELL = Int(0, MAX_CELLS - 1)
CELLS = Text(r"one|spread|[1-8]", "is not a number of guest NUMA cells",
             "one, spread, or a number from 1 to 8")


@element("nvme")
@record
class NvmeSource:
    controller: str = attr(BDF, required=True)      # normalised: '0000:5e:00.0'
    namespace: int = attr(NSID, default=1)
    kind = "nvme"


@element("path")
@record
class NvmfPath:
    traddr: str = attr(ADDR, required=True)
    trsvcid: int = attr(PORT, default=4420)


@element("reconnect")
@record
class Reconnect:
    ctrlr_loss_timeout: int | None = attr(SECONDS)
    reconnect_delay: int | None = attr(SECONDS)
    fast_io_fail_timeout: int | None = attr(SECONDS)


@element("nvmf")
@record
class NvmfSource:
    transport: str = attr(Enum(("rdma", "tcp")), required=True)
    traddr: str = attr(ADDR, required=True)
    trsvcid: int = attr(PORT, default=4420)
    adrfam: str = attr(Enum(("ipv4", "ipv6")), default="ipv4")
    subnqn: str = attr(NQN, required=True)
    namespace: int = attr(NSID, default=1)
    hostnqn: str | None = attr(NQN)
    nic: str | None = attr(NIC)                     # RDMA NIC whose node the VM goes to
    paths: tuple[NvmfPath, ...] = children(NvmfPath)   # extra paths, for multipath
    reconnect: Reconnect | None = child(Reconnect)
    kind = "nvmf"


@element("file")
@record
class FileSource:
    path: str = attr(ABSPATH, required=True)
    kind = "file"


@element("block")
@record
class BlockSource:
    path: str = attr(DEVPATH, required=True)
    kind = "block"


Source = NvmeSource | NvmfSource | FileSource | BlockSource
SOURCES = (NvmeSource, NvmfSource, FileSource, BlockSource)


@element("disk", where="target")
@record
class DiskIntent:
    target: str = attr(TARGET, required=True)
    mode: str = attr(Enum(("auto", "passthrough", "vhost")), default="auto")
    backend: str = attr(Enum(("auto", "spdk", "qsd")), default="auto")
    queues: int | None = attr(Int(1, 64))           # None: one per vCPU, at most 4
    readonly: bool = attr(YesNo(), default=False)
    guest: str = attr(Enum(("kernel", "spdk")), default="kernel")   # drives a passed-through controller
    # The guest NUMA cell the disk sits in (None: its device's node's cell,
    # or cell 0); absent from the canonical form when unset, so plans made
    # before it existed keep their digest.
    cell: int | None = attr(CELL)
    source: Source = choice(*SOURCES, label="source")


@element("vm")
@record
class VmIntent:
    numa: str = attr(Enum(("strict", "preferred", "none")), default="strict")
    cpus: str = attr(Enum(("dedicated", "shared", "external")), default="dedicated")
    # 'external': the platform backs the guest's memory with hugepages of
    # its own choosing (a Nova flavor's hw:mem_page_size): vstor places none.
    hugepages: str = attr(Enum(("auto", "none", "2M", "1G", "external")), default="auto")
    migratable: bool = attr(YesNo(), default=False)
    latency: str = attr(Enum(("normal", "critical")), default="normal")
    # Guest NUMA cells: 'one'; 'spread' (one per host node the disks' devices
    # are on); a number; None (unset): 'spread' when the devices are on more
    # than one node, else 'one' (vstor.planner.cells).
    cells: str | None = attr(CELLS)


@record
class Intent:
    vm: VmIntent
    disks: tuple[DiskIntent, ...]
