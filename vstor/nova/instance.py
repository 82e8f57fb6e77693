"""A Nova instance as the hook sees it: the domain Nova generated, with its
`<nova:instance>` metadata (flavor name; since Nova 2025.2 the flavor's
extra specs as `<nova:extraSpecs><nova:extraSpec name=...>`), the PCI
devices Nova passes through, and the pinning Nova chose.  Pure.

vstor acts on an instance only when its flavor carries `vstor:` extra
specs (Nova's validators pass keys in an unknown namespace):

    vstor:numa = strict    every vCPU pinned, and memory bound, to the node of
                           the NVMe controllers passed through (Nova's own
                           hw:pci_numa_affinity_policy=required decides the
                           node; this makes a start that slipped refuse);
                           and (vstor's driver) the instance on its SPDK
                           disks' reactors' node
    vstor:numa = preferred (the default) started wherever Nova puts it; a
                           plan on another node than its SPDK disks says so

Every NVMe controller an instance passes through is checked as vstor checks
its own passthrough: never one the host uses or `[pci] blocked` lists.
Nova and libvirt bind it (managed hostdevs); vstor creates and keeps
nothing for such an instance, so release has nothing to undo.
"""

from __future__ import annotations

import re

from lxml import etree

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, parse_cpulist
from vstor.planner.passthrough import USERSPACE_DRIVERS, check_passthrough
from vstor.records import record
from vstor.meta.topology import hostdev_address
from vstor.nova.disks import NUMA_KEY, NUMA_POLICIES

NOVA_NS = "http://openstack.org/xmlns/libvirt/nova/1.1"
N = "{%s}" % NOVA_NS
SPECS = {NUMA_KEY: NUMA_POLICIES}


@record
class NovaInstance:
    name: str                       # Nova's display name (a tenant's)
    flavor: str
    specs: dict[str, str]           # the vstor: extra specs
    hostdevs: tuple[str, ...]       # PCI addresses passed through
    pins: tuple[int, ...]           # host CPUs of the vCPU pins
    unpinned: bool                  # some vCPU has no pin
    memory_nodes: tuple[int, ...] | None
    project: str = ""               # nova:owner's project uuid


def find(root) -> NovaInstance | None:
    """The instance, if the domain is Nova's and its flavor has vstor: specs."""
    inst = root.find(f"metadata/{N}instance")
    if inst is None:
        other = [e for e in root.findall("metadata/*") if isinstance(e.tag, str)
                 and e.tag.startswith("{http://openstack.org/xmlns/libvirt/nova/")]
        if other and any(x.get("name", "").startswith("vstor:") for x in other[0].iter()):
            raise BadInput(f"Nova's metadata is in {etree.QName(other[0]).namespace}, which this vstor "
                           f"does not know ({NOVA_NS} only), and its flavor has vstor: specs",
                           hint="upgrade vstor")
        return None
    flavor = inst.find(f"{N}flavor")
    specs = {}
    for e in (flavor.findall(f"{N}extraSpecs/{N}extraSpec") if flavor is not None else ()):
        key = e.get("name") or ""
        if key.startswith("vstor:"):
            specs[key] = (e.text or "").strip()
    if not specs:
        return None
    for key, value in specs.items():
        if key.startswith("vstor:disk."):
            continue        # vstor's compute driver turns these into disks (vstor.nova.disks)
        if key not in SPECS:
            raise BadInput(f"flavor '{flavor.get('name')}': unknown extra spec '{key[:40]}'",
                           hint="known: " + ", ".join(sorted(SPECS)))
        if value not in SPECS[key]:
            raise BadInput(f"flavor '{flavor.get('name')}': {key}='{value[:40]}' is not one of "
                           + ", ".join(SPECS[key]), hint=f"openstack flavor set --property {key}=...")
    vcpus = _int(root.findtext("vcpu") or "1", "vcpu")
    pins = root.findall("cputune/vcpupin")
    cpus: set[int] = set()
    for p in pins:
        cpus.update(_cpulist(p.get("cpuset", ""), "<vcpupin cpuset>"))
    mem = root.find("numatune/memory")
    return NovaInstance(
        name=(inst.findtext(f"{N}name") or "").strip()[:80], flavor=flavor.get("name") or "",
        specs=specs, hostdevs=tuple(_hostdevs(root)), pins=tuple(sorted(cpus)),
        unpinned=len({p.get("vcpu") for p in pins}) < vcpus,
        memory_nodes=None if mem is None else _cpulist(mem.get("nodeset", ""), "<numatune><memory nodeset>"),
        project=(inst.find(f"{N}owner/{N}project").get("uuid", "")
                 if inst.find(f"{N}owner/{N}project") is not None else ""))


def reactors_apart(host: Host, reactors: dict[str, int], nodes: set[int]) -> dict[str, int]:
    """{disk target: its reactor's node} of each SPDK disk whose reactor is
    on none of `nodes`, the host nodes Nova placed the instance on (none
    known: none apart)."""
    out = {}
    for target, core in reactors.items():
        cpu = host.cpu(core)
        if cpu is not None and nodes and cpu.node not in nodes:
            out[target] = cpu.node
    return out


def problems(host: Host, cfg: Config, inst: NovaInstance, has_disks: bool = False,
             reactors: dict[str, int] | None = None) -> list[str]:
    """Why the instance must not start as Nova placed it; [] when it may.
    `reactors`: {disk target: its SPDK reactor's core}, as its plan says."""
    out = []
    if inst.specs.get(NUMA_KEY) == "strict" and inst.memory_nodes is not None:
        apart = sorted(set(reactors_apart(host, reactors or {}, set(inst.memory_nodes)).values()))
        if apart:
            out.append(f"its memory is bound to nodes {list(inst.memory_nodes)}, its SPDK disks' "
                       f"reactors run on node{'s' if len(apart) > 1 else ''} "
                       f"{','.join(map(str, apart))} (vstor:numa=strict)")
    for key, owner in sorted(inst.specs.items()):
        if key.startswith("vstor:disk.") and key.endswith(".project") and owner != inst.project:
            out.append(f"its flavor's disk {key.split('.')[1]} belongs to project {owner}, "
                       f"not this instance's ({inst.project or 'none'})")
    if any(k.startswith("vstor:disk.") for k in inst.specs) and not has_disks:
        out.append("its flavor asks for vstor disks, but its domain has none: nova-compute does "
                   "not run vstor's driver (compute_driver = vstor.VstorLibvirtDriver)")
    nodes = set()
    for address in inst.hostdevs:
        ctrl = host.controller(address)
        if ctrl is None:
            continue        # not an NVMe controller: Nova's business alone
        nodes.add(ctrl.numa_node)
        why = check_passthrough(ctrl, iommu_enabled=True, vfio_available=True,
                                pci_allowed=cfg.pci_allowed, pci_blocked=cfg.pci_blocked,
                                spdk_owned=ctrl.driver in USERSPACE_DRIVERS and ctrl.driver != "vfio-pci")
        out += [f"{address}: {w}" for w in why]
    if inst.specs.get("vstor:numa") == "strict" and nodes:
        if len(nodes) > 1:
            out.append(f"its NVMe controllers sit on nodes {sorted(nodes)}: no placement keeps "
                       "every vCPU next to all of them")
        node = min(nodes)
        cpu_node = {c.id: c.node for c in host.cpus}
        off = [c for c in inst.pins if cpu_node.get(c) != node]
        if inst.unpinned:
            out.append("some vCPUs are not pinned (the flavor needs hw:cpu_policy=dedicated)")
        elif off:
            out.append(f"vCPUs are pinned to CPUs {off[:8]} off node {node}, where its NVMe is")
        if inst.memory_nodes is not None and set(inst.memory_nodes) != {node}:
            out.append(f"its memory is bound to nodes {list(inst.memory_nodes)}, not node {node}")
    return out


def _hostdevs(root):
    for hd in root.findall("devices/hostdev"):
        if hd.get("type") != "pci" or hd.find("source/address") is None:
            continue
        address = hostdev_address(hd)
        if address is None:
            raise BadInput("a <hostdev> PCI address is not a number")
        yield address


def _int(text: str, what: str) -> int:
    if not re.fullmatch(r"[0-9]{1,4}", text.strip(), re.ASCII):
        raise BadInput(f"<{what}> is '{text[:20]}', not a number")
    return int(text)


def _cpulist(text: str, what: str) -> tuple[int, ...]:
    try:
        return parse_cpulist(text)
    except ValueError as e:
        raise BadInput(f"{what} is not a list of CPUs or nodes: {e}") from None
