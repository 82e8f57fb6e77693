"""The planner: a host, the config, the ledger and an annotated domain in;
a Plan with its reasons out, or DoesNotFit naming what is short.

Pure and deterministic: no I/O, and the same inputs give the same plan.
"""

from __future__ import annotations

from vstor.config import Config, conflicts
from vstor.errors import BadInput, DoesNotFit
from vstor.host.model import Host
from vstor.meta import topology
from vstor.meta.document import Domain
from vstor.meta.intent import Intent, NvmfSource
from vstor.meta.metadata import digest
from vstor.meta.names import MIGRATION_SUBNQN, bdev_name, socket_path, spdk_controller_name
from vstor.meta.plan import CellPlan, DiskPlan, Plan
from vstor.planner import cells
from vstor.planner.disks import DiskChoice, NoFit, choose_all
from vstor.planner.ledger import Ledger, Overlay
from vstor.planner.placement import CpuPlacement
from vstor.planner.spdk_paths import attach_paths
from vstor.records import record, replace

_PAGE_KIB = {"2M": 2048, "1G": 1048576}
_SHARED = {"memfd": "memfd-backed shared memory",
           "platform-hugepages": "the guest's memory in Nova's hugepages (the flavor's "
                                 "hw:mem_page_size; vstor places none), shared"}


@record
class Request:
    """What the planner needs from a domain document."""
    name: str
    safe_name: str
    uuid: str | None
    vcpus: int
    memory_kib: int
    machine: str
    intent: Intent
    # NVMe-oF namespaces that stand in for disks' sources on this host: on a
    # live migration's destination, the source's local NVMe exported to it.
    imports: tuple[tuple[str, NvmfSource], ...] = ()
    # How a vhost-user disk's guest memory is shared: libvirt can use memfd;
    # Proxmox only shares hugepage-backed memory (memory-backend-file,share=on);
    # a Nova flavor's hugepages are Nova's ("platform-hugepages").
    vhost_memory: str = "memfd"
    # The platform raises the hugepage pool itself at the start (Proxmox).
    grows_hugepages: bool = False
    # The command that plans the domain again (named in every "re-plan" hint).
    replan: str = ""
    # How messages name it ("VM 100" on Proxmox).
    title: str = ""
    # The platform pins the vCPUs (a Nova instance): cpus='external' allowed.
    external_cpus: bool = False
    # The size of the hugepages the platform backs the guest with (Nova's,
    # from the flavor's hw:mem_page_size), KiB; None: ordinary memory.
    platform_page_kib: int | None = None
    # The platform binds hugepages only on host nodes below this (Proxmox's
    # qemu-server: 0-9); None: any node.
    hugepage_nodes: int | None = None
    # Who pins each vCPU thread, and when, if not the platform as QEMU starts
    # (Proxmox: vstor's hookscript at post-start); said in the plan's reasons.
    pins_at: str = ""
    # The guest's cells as they are (a migration's arriving domain keeps
    # them: the guest's ABI) and the cell of each disk: (target, cell).
    fixed_cells: tuple = ()
    fixed_disk_cells: tuple[tuple[str, int], ...] = ()
    # The file the domain's XML has QEMU read before any device (vstor's
    # fw_cfg entry, vstor.meta.names.gate_path): its prepare writes it.
    gate: str | None = None

    @property
    def fix(self) -> str:
        return self.replan or f"vstor apply {self.name}"

    @property
    def who(self) -> str:
        return self.title or f"domain '{self.name}'"

    @classmethod
    def from_domain(cls, dom: Domain, imports=()) -> "Request":
        nova = dom.is_nova()
        page = dom.hugepage_kib() if nova else None
        return cls(dom.name, dom.safe_name, dom.uuid, dom.vcpus, dom.memory_kib,
                   dom.machine, dom.intent(), tuple(imports), external_cpus=nova,
                   vhost_memory="platform-hugepages" if page else "memfd",
                   platform_page_kib=page, gate=dom.gate())

    @classmethod
    def keeping_cells(cls, dom: Domain, imports=()) -> "Request":
        """The domain with the guest cells its XML gives the guest
        (vstor.meta.topology): what a start checks its plan against, and what
        a live migration's arriving domain keeps (the guest's ABI); the
        host nodes under them are this host's to choose."""
        req = cls.from_domain(dom, imports)
        if req.external_cpus or req.intent.vm.cpus == "external":
            return req          # Nova's flavor makes a Nova instance's cells, whatever they are
        fixed = topology.cells(dom.root, dom.vcpus, dom.memory_kib, req.who)
        if len(fixed) < 2:
            return replace(req, fixed_cells=fixed)
        return replace(req, fixed_cells=fixed, fixed_disk_cells=topology.disk_cells(dom.root, len(fixed)))

    def disks(self) -> tuple:
        """The intent's disks, imported ones served by SPDK from their namespace."""
        imported = dict(self.imports)
        return tuple(replace(d, source=imported[d.target], mode="vhost", backend="spdk")
                     if d.target in imported else d for d in self.intent.disks)


def plan_domain(host: Host, cfg: Config, req: Request, ledger: Ledger) -> Plan:
    _check_config(cfg)
    check_request(req)
    taken = Overlay(ledger.without(req.name, req.uuid))
    choices = choose_all(host, cfg, req.intent.vm, req.disks(), taken)
    if isinstance(choices, NoFit):
        raise DoesNotFit(f"{req.who} does not fit: {choices.reason}")
    page_kib = page_size(req, choices)
    guest_cells, disk_cell = cells.layout(req, choices, cells.count(req, choices, page_kib), page_kib)
    placed, cpus, reactors, reasons = cells.place(host, cfg, req, choices, taken, guest_cells, disk_cell,
                                                  page_kib, grow_pool(cfg, req))
    return _assemble(host, cfg, req, choices, page_kib, placed, disk_cell, cpus, reactors, reasons)


def grow_pool(cfg: Config, req: Request) -> Config | None:
    """Proxmox raises the hugepage pool itself at a VM's start (after the
    hookscript's pre-start): a plan may count on free memory becoming pages."""
    return cfg if req.grows_hugepages else None


def check_request(req: Request) -> None:
    if req.intent.vm.cpus == "external" and not req.external_cpus:
        raise BadInput(f"{req.who}: cpus='external' is for Nova instances (Nova pins their vCPUs); "
                       "vstor places every other domain's", hint="use cpus='dedicated' or 'shared'")
    for d in req.intent.disks:
        if d.source.kind == "nvmf" and d.source.subnqn.startswith(MIGRATION_SUBNQN):
            raise BadInput(f"{req.who}: disk {d.target} names {d.source.subnqn}, a subsystem vstor "
                           "exports for a migration: only that migration's destination reads it",
                           hint="name the domain's own NVMe-oF subsystem")


def _check_config(cfg: Config) -> None:
    problem = conflicts(cfg)
    if problem:
        raise problem


def page_size(req: Request, choices: tuple[DiskChoice, ...]) -> int | None:
    """The size of the hugepages vstor places for the guest, KiB; None when
    it places none (ordinary memory, or the platform's hugepages)."""
    wanted = req.intent.vm.hugepages
    spdk = any(c.backend == "spdk" for c in choices)
    shared = req.vhost_memory == "hugepages" and any(c.mode == "vhost" for c in choices)
    if wanted == "external" or (spdk and req.external_cpus):
        if spdk or req.platform_page_kib or not req.external_cpus:
            _platform_pages(req, spdk)
        return None         # qemu-storage-daemon disks alone: memfd will do (an image's small pages)
    if wanted == "none" and spdk:
        raise BadInput(f"{req.who}: hugepages='none' with an SPDK disk; SPDK maps guest "
                       "memory in 2 MiB units and needs it hugepage-backed",
                       hint="use hugepages='2M', '1G' or 'auto'")
    if wanted == "none" and shared:
        raise BadInput(f"{req.who}: hugepages='none' with a vhost-user disk; here only "
                       "hugepages give the shared guest memory vhost-user needs",
                       hint="use hugepages='2M', '1G' or 'auto'")
    size = _PAGE_KIB.get(wanted) or (2048 if wanted == "auto" and (spdk or shared) else None)
    if size and req.memory_kib % size:
        raise BadInput(f"{req.who}: memory {req.memory_kib} KiB is not a whole number "
                       f"of {size} KiB hugepages", hint="round <memory> to the page size")
    return size


def _platform_pages(req: Request, spdk: bool) -> None:
    """A Nova instance's hugepages are Nova's: vstor checks that the flavor
    asked for them where an SPDK disk needs them, and that Nova gave them."""
    flavor = "set hw:mem_page_size=large (or 2MB, 1GB) on the flavor"
    if not req.external_cpus:
        raise BadInput(f"{req.who}: hugepages='external' is for Nova instances (the flavor's "
                       "hw:mem_page_size)", hint="use hugepages='2M', '1G', 'auto' or 'none'")
    if spdk and req.intent.vm.hugepages != "external":
        raise BadInput(f"{req.who}: an SPDK disk needs the guest's memory in hugepages, and its "
                       "flavor asks for none", hint=flavor)
    if not req.platform_page_kib:
        raise BadInput(f"{req.who}: the flavor asks for large pages (hw:mem_page_size) but the "
                       "guest's memory is not hugepage-backed (an image's hw_mem_page_size=small?)",
                       hint=flavor + ", and no small pages on the image")
    if spdk and req.platform_page_kib < 2048:
        raise BadInput(f"{req.who}: its guest memory is in {req.platform_page_kib} KiB pages; SPDK "
                       "maps guest memory in 2 MiB units", hint=flavor)


def _assemble(host, cfg, req, choices, page_kib, guest_cells: tuple[CellPlan, ...], disk_cell: dict,
              cpus: CpuPlacement, reactors, reasons) -> Plan:
    """The plan of the placed cells: one cell is recorded as the plan's node
    (no <cell> elements, as vstor has always written a one-node guest)."""
    vm = req.intent.vm
    reasons = list(reasons)
    node_id, pages = guest_cells[0].node, sum(c.hugepages for c in guest_cells)
    if len(guest_cells) == 1:
        guest_cells = ()
    nodes = {c.node for c in choices if c.node is not None}
    at = {c.id: c.node for c in guest_cells}
    for c in choices:
        if guest_cells and c.node is not None and at[disk_cell[c.disk.target]] != c.node:
            reasons.append(f"{c.disk.target}: {c.node_from} is on node {c.node}, its guest cell "
                           f"{disk_cell[c.disk.target]} on node {at[disk_cell[c.disk.target]]}: "
                           "its I/O crosses the interconnect")
    if len(nodes) > 1 and not guest_cells:
        reasons.append(f"disks sit on nodes {sorted(nodes)}: I/O to the others crosses the interconnect")
    if vm.numa != "none":
        reasons.append(f"guest memory {vm.numa} on node {node_id}" if not guest_cells else
                       f"guest memory {vm.numa}, each cell's on its host node")
    if page_kib:
        where = (f" from node {node_id}'s pool" if not guest_cells else
                 ": " + ", ".join(f"{c.hugepages} from node {c.node}'s pool" for c in guest_cells))
        reasons.append(f"{pages} x {page_kib} KiB hugepages{where}"
                       + (" (qemu-server raises it at the start)" if req.grows_hugepages else ""))
        if req.vhost_memory == "hugepages" and any(c.mode == "vhost" for c in choices):
            reasons.append("hugepages also share the guest memory with the vhost-user backend "
                           "(memory-backend-file,share=on: the only shared memory Proxmox gives)")
    elif any(c.mode == "vhost" for c in choices):
        reasons.append(_SHARED.get(req.vhost_memory, f"{req.vhost_memory}-backed shared memory")
                       + ", which vhost-user needs")
    disks = tuple(disk_plan(cfg, req, c, reactors.get(c.disk.target),
                            disk_cell[c.disk.target] if guest_cells else None) for c in choices)
    viommu = any(d.mode == "passthrough" and d.guest == "spdk" for d in disks)
    if viommu and not topology.is_q35(req.machine):
        raise BadInput(f"{req.who}: guest='spdk' needs a vIOMMU, which needs the q35 "
                       f"machine (this domain has '{req.machine or 'the default'}')",
                       hint="set <os><type machine='q35'>hvm</type>")
    return Plan(
        digest=digest(req.intent),
        domain=req.name, uuid=req.uuid, host=host.hostname, node=node_id, numa=vm.numa,
        cpus=vm.cpus, vcpus=req.vcpus, memory_kib=req.memory_kib,
        vcpu_pins=cpus.vcpu_pins, reserved=cpus.reserved, shared_cpus=cpus.shared,
        emulator=cpus.emulator, hugepage_kib=page_kib, hugepages=pages,
        viommu=viommu, migratable=vm.migratable, cells=tuple(guest_cells), disks=disks,
        reasons=tuple(reasons))


def disk_plan(cfg: Config, req: Request, c: DiskChoice, reactor: tuple[int, str] | None,
              cell: int | None = None) -> DiskPlan:
    """A choice made concrete: every name, path and parameter the host side needs."""
    d = c.disk
    reasons = list(c.reasons)
    socket = spdk_ctrl = bdev = None
    attach = ()
    if c.mode == "vhost":
        socket = socket_path(cfg.vhost_dir, req.safe_name, d.target)
    if c.backend == "spdk":
        attach = c.attach or attach_paths(cfg, d.source)
        spdk_ctrl = spdk_controller_name(d.source, attach)
        bdev = bdev_name(spdk_ctrl, d.source.namespace)
        if reactor:
            reasons.append(reactor[1])
    return DiskPlan(
        target=d.target, mode=c.mode, backend=c.backend, source=d.source, socket=socket,
        controller=c.controller, bind=c.bind, device=c.device, spdk_controller=spdk_ctrl,
        bdev=bdev, reactor=reactor[0] if reactor else None,
        queues=d.queues or min(req.vcpus, 4), readonly=d.readonly,
        guest=d.guest, cell=cell, attach=attach, reasons=tuple(reasons))
