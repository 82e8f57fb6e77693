"""plan + a Proxmox VM config -> the config keys that carry the plan.  Pure;
decides nothing the plan does not say.

vstor owns, in the main section only:
- `numa`, `numa0`..`numa7`: one guest node on the plan's host node, every
  vCPU, all memory, policy bind (strict) or preferred; for a plan with
  cells, `numaK` for each cell K: its vCPUs, its host node, its memory;
- `hugepages`: the plan's page size (2 or 1024 MiB);
- `affinity`: the plan's vCPU and emulator cores (Proxmox runs every QEMU
  thread on the set: it pins no single vCPU);
- the `hostpciN` lines that pass a planned controller through (recognised by
  the controller, so a user's own GPU or NIC line is never touched; read
  with Proxmox's grammar, vstor/formats/pve/grammar.py, and refused when a user's
  line hands the VM a controller vstor holds);
- in `args`, a suffix of `-chardev socket,id=vstor-<disk>,...` and
  `-device vhost-user-blk-pci,id=vstor-<disk>,...` pairs (for a plan with
  cells: every -chardev, then the expander buses of vstor.render.pve_cells,
  then every -device, each on its cell's bus); the user's own arguments
  before it are kept byte for byte.
Every other key is the user's.
"""

from __future__ import annotations

import json
import re
import shlex

from vstor.errors import BadInput
from vstor.formats.pve import grammar
from vstor.formats.pve.config import PveConfig
from vstor.formats.pve.vm import HUGEPAGE_NODES, machine_of, viommu_of, vmid_of
from vstor.formats.pve.words import shellwords
from vstor.host.model import format_cpulist
from vstor.meta.names import RECONNECT_SECONDS
from vstor.meta.plan import Plan
from vstor.meta.topology import is_q35
from vstor.records import field, record
from vstor.render import pve_cells

ID = "vstor-"
PAGES = {2048: "2", 1048576: "1024"}
NUMA_KEYS = ("numa",) + tuple(f"numa{i}" for i in range(8))
HOSTPCI_KEYS = tuple(f"hostpci{i}" for i in range(16))
PLACEMENT_KEYS = NUMA_KEYS + ("hugepages", "affinity")
# QEMU options that decide guest memory, NUMA or vCPUs: vstor's numa0 and
# hugepages say those, and a second say in args would override or break them.
_CONFLICTS = ("-m", "-numa", "-smp", "-mem-path", "-mem-prealloc")
_START = re.compile(r"(?:^|\s)-chardev\s+['\"]?socket,id=" + ID, re.ASCII)   # Perl's \s




@record
class Guard:
    """What else a hostpci line must not hand over: the controllers vstor
    holds for other VMs, and this node's PCI mappings to resolve mapping=."""
    others: frozenset = frozenset()
    mappings: grammar.Mappings = field(default_factory=lambda: grammar.Mappings(None, ""))


def render(conf: PveConfig, plan: Plan, previous: tuple[Plan, ...], qemu: tuple[int, int],
           vm: int, guard: Guard | None = None) -> dict[str, str | None]:
    """Every key vstor owns -> its value under `plan` (None: no such line).
    `previous`: the plans whose lines the config may carry (the one vstor
    last wrote, and the one before while a config write is pending): their
    hostpci lines are vstor's."""
    out = placement(plan)
    out.update(_hostpci(conf, plan, previous, vm, guard or Guard()))
    machine = machine_of(conf)
    pve_cells.check_machine(conf, plan, machine, vm)
    out["args"] = merge_args(conf.get("args"), vhost_args(plan, qemu, machine), vm)
    return out


def drift(conf: PveConfig, plan: Plan, qemu: tuple[int, int], vm: int,
          guard: Guard | None = None) -> list[str]:
    """The keys whose line is not what `plan` writes: the config was edited
    (or written for another QEMU) since `vstor pve apply`."""
    try:
        want = render(conf, plan, (plan,), qemu, vm, guard)
    except BadInput as e:
        return [e.message]
    return [k for k, v in want.items() if conf.get(k) != v]


def placement(plan: Plan, check: bool = True) -> dict[str, str | None]:
    """The placement keys of the plan.  check=False: as an older vstor may
    have written them (to recognise them, never to write): nothing refused."""
    out: dict[str, str | None] = dict.fromkeys(NUMA_KEYS)
    if plan.cells or (plan.node is not None and (plan.hugepage_kib or plan.numa != "none")):
        policy = "bind" if plan.numa == "strict" else "preferred"
        out["numa"] = "1"
        for cell in plan.guest_cells():
            out[f"numa{cell.id}"] = _numa_line(plan, cell, policy, check)
    out["hugepages"] = PAGES.get(plan.hugepage_kib) if plan.hugepage_kib else None
    cores = set(plan.vcpu_pins) | set(plan.emulator) if plan.cpus == "dedicated" else \
        set(plan.shared_cpus) | set(plan.emulator)
    # qemu-server tests `if ($conf->{affinity})`: Perl takes "0" as false and
    # would run the VM unpinned; "0-0" is the same set, and true.
    affinity = format_cpulist(sorted(cores)) if cores else None
    out["affinity"] = "0-0" if affinity == "0" and check else affinity
    return out


def _numa_line(plan: Plan, cell, policy: str, check: bool = True) -> str:
    """numaK of one guest cell; refused (naming the cell) where qemu-server
    would refuse it or start the VM otherwise than planned."""
    which = f"{plan.domain}: guest cell {cell.id}: " if plan.cells else f"{plan.domain}: "
    if check and plan.hugepage_kib and cell.node >= HUGEPAGE_NODES:
        raise BadInput(f"{which}hugepages on host node {cell.node}, which Proxmox cannot "
                       "bind (qemu-server's hugepages_topology takes nodes 0-9 only)",
                       hint=f"plan it again ({plan.domain} then lands on nodes 0-9)")
    unit = plan.hugepage_kib or 1024
    if check and plan.cells and cell.memory_kib % max(unit, 1024):
        size = f"{unit // 1024} MiB pages" if plan.hugepage_kib else "MiB"
        raise BadInput(f"{which}{cell.memory_kib} KiB of memory is not a whole number of {size}, "
                       "which a numaN line of Proxmox needs",
                       hint=f"give the VM memory its cells can share evenly: qm set {vmid_of(plan.domain)} "
                            "--memory ..., then apply again")
    cpus = format_cpulist(cell.vcpus).replace(",", ";")     # Proxmox's list: 0-1;4-5
    return f"cpus={cpus},hostnodes={cell.node},memory={cell.memory_kib // 1024},policy={policy}"


def vhost_args(plan: Plan, qemu: tuple[int, int], machine: str = "pc") -> list[str]:
    """The -chardev/-device pairs of the plan's vhost disks, in plan order;
    for a plan with cells every -chardev, then the expander buses, then
    every -device on its cell's bus.  QEMU 9.2 replaced `reconnect`
    (seconds) with `reconnect-ms` and later removed the old one."""
    reconnect = (f"reconnect-ms={RECONNECT_SECONDS * 1000}" if qemu >= (9, 2)
                 else f"reconnect={RECONNECT_SECONDS}")
    buses, where = pve_cells.buses(plan, machine)
    chardevs: list[str] = []
    devices: list[str] = []
    for d in plan.disks:
        if d.mode != "vhost":
            continue
        if not re.fullmatch(r"/[A-Za-z0-9_./+-]+", d.socket or ""):
            raise BadInput(f"vhost socket {d.socket!r} cannot go into a QEMU option",
                           hint="use letters, digits and _./+- in [paths] vhost_dir")
        name = f"{ID}{d.target}"
        chardevs += ["-chardev", f"socket,id={name},path={d.socket},{reconnect}"]
        devices += ["-device", f"vhost-user-blk-pci,id={name},chardev={name},num-queues={d.queues}"
                    + where.get(d.target, "")]
    if not buses:
        return [w for i in range(0, len(chardevs), 2) for w in chardevs[i:i + 2] + devices[i:i + 2]]
    return chardevs + [w for b in buses for w in ("-device", b)] + devices


def has_vstor_args(args: str | None) -> bool:
    """Does an args line hold vstor's -chardev/-device pairs?"""
    return bool(_START.search(args or ""))


def merge_args(current: str | None, ours: list[str], vm: int) -> str | None:
    """The user's part of `args` (before vstor's suffix) kept as written,
    `ours` appended; refused when the user's part says what vstor says, or
    when the line would not split (as qemu-server splits it) into the
    user's words followed by exactly `ours`."""
    text = current or ""
    m = _START.search(text)
    user, theirs = (text[:m.start()].rstrip(), text[m.start():]) if m else (text.rstrip(), "")
    _check_vstor_part(_split(theirs, "vstor's part of args", vm), vm)
    mine = _split(user, "args", vm)
    _check_user_part(mine, vm)
    if any(w.startswith("pxb") for w in ours):
        _check_expanders(mine, vm)
    merged = " ".join(p for p in (user, shlex.join(ours)) if p)
    words = shellwords(merged) or []
    if words[len(words) - len(ours):] != ours:
        raise BadInput(f"VM {vm}: args would not end in vstor's arguments as Proxmox splits it "
                       "(a trailing backslash or an open quote in your part?)",
                       hint=f"fix its quoting: qm set {vm} --args '...'")
    return merged or None


def _split(text: str, what: str, vm: int) -> list[str]:
    words = shellwords(text)
    if words is None:
        raise BadInput(f"VM {vm}: {what} cannot be split into arguments (an unbalanced quote: "
                       "Proxmox would pass no args to QEMU at all)",
                       hint=f"fix its quoting: qm set {vm} --args '...'")
    return words


_OUR_ID = re.compile(r"(^|,)(id|chardev|bus)=" + ID + r"|\"(id|chardev|bus)\"\s*:\s*\"" + ID)
_check_vstor_part = pve_cells.check_vstor_part


def _check_user_part(tokens: list[str], vm: int) -> None:
    for i, word in enumerate(tokens):
        value = tokens[i + 1] if i + 1 < len(tokens) else ""
        opt = word[1:] if word.startswith("--") else word       # QEMU takes --opt as -opt
        why = None
        if _OUR_ID.search(word):
            why = f"uses the id prefix '{ID}', which is vstor's"
        elif opt in _CONFLICTS or (opt in ("-machine", "-M") and "memory-backend" in value) \
                or (opt == "-object" and _memory_backend(value)):
            why = "decides guest memory, NUMA or vCPUs, as vstor's numa0 and hugepages do"
        elif opt in ("-set", "-global") and (ID in value or "vhost-user-blk" in value):
            why = "changes vstor's vhost-user devices"
        elif opt in ("-readconfig", "-add-fd"):
            why = "can define anything vstor writes; vstor cannot check it"
        if why:
            said = f"{word} {value}".strip()[:60]
            raise BadInput(f"VM {vm}: args has '{said}', which {why}",
                           hint=f"remove it from args (qm set {vm} --args '...'), then apply again")


def _check_expanders(tokens: list[str], vm: int) -> None:
    """A guest with several cells: vstor's expander buses take a root-bus
    slot and the bus numbers from 255 down; a user's own would collide."""
    for i, word in enumerate(tokens[:-1]):
        value = tokens[i + 1]
        if word.lstrip("-") == "device" and _driver_of(value) in ("pxb", "pxb-pcie"):
            raise BadInput(f"VM {vm}: args has '{word} {value[:40]}', a PCI expander bus; vstor's "
                           "guest cells bring their own, in the slot and bus numbers it would take",
                           hint=f"remove it from args (qm set {vm} --args '...'), or plan the VM "
                                "with cells='one'")


def _driver_of(value: str) -> str | None:
    """A -device's driver in each form QEMU takes: JSON (`{"driver": ...}`),
    the implied first word, or `driver=` anywhere in the list."""
    if value.lstrip().startswith("{"):
        try:
            found = json.loads(value).get("driver")
        except (ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None
    parts = value.replace(",,", "\0").split(",")
    if "=" not in parts[0]:
        return parts[0]
    for part in parts:
        key, _, driver = part.partition("=")
        if key.strip() == "driver":
            return driver
    return None


def _memory_backend(value: str) -> bool:
    if value.lstrip().startswith("{"):
        try:
            return str(json.loads(value).get("qom-type", "")).startswith("memory-backend")
        except (ValueError, AttributeError):
            return False
    return value.startswith("memory-backend")


def _hostpci(conf: PveConfig, plan: Plan, previous: tuple[Plan, ...], vm: int,
             guard: Guard) -> dict[str, str | None]:
    wanted = [d.controller for d in plan.disks if d.mode == "passthrough"]
    served = {d.controller: f"vstor serves as {d.target}" for d in plan.disks if d.controller}
    held = {c: "vstor holds for another VM" for c in guard.others if c not in served}
    ours_before = {d.controller for p in previous for d in p.disks if d.mode == "passthrough"}
    machine = machine_of(conf)
    if any(d.guest == "spdk" for d in plan.disks if d.mode == "passthrough") and not viommu_of(conf):
        raise BadInput(f"VM {vm}: a disk with guest='spdk' needs a vIOMMU in the guest",
                       hint=f"qm set {vm} --machine q35,viommu=intel")
    pcie = ",pcie=1" if is_q35(machine) else ""
    out: dict[str, str | None] = {}
    placed: dict[str, str] = {}
    seen: set[str] = set()
    for key in HOSTPCI_KEYS:
        value = conf.get(key)
        if value is None:
            continue
        host = vstors_line(value, ours_before)
        if host is not None and host not in seen:     # a second line of it is not vstor's
            seen.add(host)
            out[key] = None             # vstor's line: kept below if still planned
            if host in wanted:
                placed[host] = key
            continue
        if not is_q35(machine) and _flag(value, "pcie"):
            # qemu-server dies on it at every start (PVE::QemuServer::PCI).
            raise BadInput(f"VM {vm}: {key} asks for pcie=1, which qemu-server refuses on "
                           f"machine '{machine or 'pc'}' (q35 machine model is not enabled)",
                           hint=f"qm set {vm} --machine q35, or drop pcie=1 from {key}")
        ids = grammar.handed(key, value, guard.mappings, f"VM {vm}: {key}")
        for ctrl, why in {**served, **held}.items():
            if grammar.names(ids, ctrl):
                raise BadInput(f"VM {vm}: {key} passes {ctrl} through, which {why}",
                               hint=f"qm set {vm} --delete {key} (vstor writes its own line for a "
                                    "passthrough disk)")
    free = [k for k in HOSTPCI_KEYS if conf.get(k) is None or out.get(k, "") is None]
    for bdf in wanted:
        key = placed.get(bdf)
        if key is None:
            spare = [k for k in free if k not in placed.values()]
            if not spare:
                raise BadInput(f"VM {vm}: all 16 hostpci slots are taken", hint="free one")
            key = spare[0]
            placed[bdf] = key
        out[key] = f"{bdf}{pcie}"
    return out


def _flag(value: str, name: str) -> bool:
    """A boolean option of a property string set (qemu-server's booleans:
    1, on, yes, true)."""
    for part in value.split(",")[1:]:
        key, _, flag = part.partition("=")
        if key.strip() == name:
            return flag.strip().lower() in ("1", "on", "yes", "true")
    return False


def vstors_line(value: str, controllers: set[str]) -> str | None:
    """The controller of a line vstor wrote: one full function it planned to
    pass through, by `host` (whatever options were added since)."""
    try:
        line = grammar.hostpci("hostpci", value)
    except grammar.Invalid:
        return None
    if line.mapping or len(line.hosts) != 1 or not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]",
                                                                  line.hosts[0]):
        return None
    return line.hosts[0] if line.hosts[0] in controllers else None
