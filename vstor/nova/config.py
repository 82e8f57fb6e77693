"""Nova's own PCI passthrough, configured from vstor's host model: which
NVMe controllers Nova may hand out (`[pci] device_spec`), how flavors ask
for them (`[pci] alias`), which cores instances get (`[compute]
cpu_dedicated_set` / `cpu_shared_set`, never an SPDK reactor), and the
flavor extra specs that keep an instance's vCPUs and memory on its
device's node.  Pure: the same decisions as vstor's planner (the same
passthrough check, the same housekeeping and reactor cores).

Nova's facts, checked against nova 34.0.0: device_spec and alias are
multi-valued JSON options (nova/conf/pci.py); an alias needs vendor_id and
product_id unless it names a resource class, and takes device_type
(type-PCI, type-PF, type-VF), numa_policy (required, legacy, preferred,
socket) and live_migratable (nova/pci/request.py _ALIAS_SCHEMA); a device
spec's live_migratable tag is normalised like managed (nova/pci/devspec.py);
libvirt reports an SR-IOV capable function as a PF, and Nova types it
type-PF (nova/virt/libvirt/driver.py).

Placement (`[pci] report_in_placement`): Nova makes a resource provider per
controller with the device spec's `resource_class` and `traits`, normalised
to CUSTOM_ upper case unless standard (nova/compute/pci_placement_translator.py),
and cannot turn reporting off again.  With `[filter_scheduler]
pci_in_placement` (nova-api, scheduler, conductors) an alias asks Placement
for its own `resource_class` (else CUSTOM_PCI_<vendor>_<product>) and
`traits`; an alias with a resource_class may leave out vendor_id and
product_id there, but not without pci_in_placement, so vstor's aliases keep
them and work either way (the PCI filter ignores both tags).
"""

from __future__ import annotations

import json
import shlex

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, NvmeController, format_cpulist
from vstor.planner.ledger import Ledger
from vstor.planner.passthrough import USERSPACE_DRIVERS, check_passthrough
from vstor.planner.placement import all_housekeeping
from vstor.records import record

ALIAS_PREFIX = "vstor-nvme"
PASSTHROUGH_TRAIT = "CUSTOM_VSTOR_PASSTHROUGH"
PAGE_SIZES = {None: "large", 2048: "2MB", 1048576: "1GB"}


@record
class Offer:
    """A controller Nova may pass through."""
    address: str
    vendor_id: str          # '8086', as Nova writes PCI ids
    product_id: str
    node: int | None
    device_type: str        # type-PCI, or type-PF for an SR-IOV capable function
    model: str

    @property
    def alias(self) -> str:
        """One alias per model, Nova device type (an alias has one type) and
        NUMA policy: a controller the firmware puts on no node (numa_node -1)
        can never satisfy `required`, so it gets an alias of its own."""
        pf = "-pf" if self.device_type == "type-PF" else ""
        anywhere = "-anynode" if self.node is None else ""
        return f"{ALIAS_PREFIX}-{self.vendor_id}-{self.product_id}{pf}{anywhere}"

    @property
    def numa_policy(self) -> str:
        return "required" if self.node is not None else "legacy"

    @property
    def resource_class(self) -> str:
        """One per alias, named after it, already in Nova's normal form:
        a controller of another alias is never handed out for this one."""
        return "CUSTOM_" + self.alias.upper().replace("-", "_")


@record
class NovaSetup:
    offers: tuple[Offer, ...]
    excluded: tuple[tuple[str, str], ...]       # (address, why, with the fix)
    dedicated: tuple[int, ...]
    shared: tuple[int, ...]
    reactors: tuple[int, ...]


def setup(host: Host, cfg: Config, ledger: Ledger) -> NovaSetup:
    offers, excluded = [], []
    for ctrl in sorted(host.controllers, key=lambda c: c.address):
        why = _refusals(host, cfg, ledger, ctrl)
        if why:
            excluded.append((ctrl.address, why[0]))
        else:
            offers.append(Offer(ctrl.address, _id(ctrl.vendor), _id(ctrl.device),
                                ctrl.numa_node if ctrl.numa_node >= 0 else None,
                                "type-PF" if ctrl.sriov_vfs else "type-PCI", ctrl.model))
    offers, apart = _apart(offers)
    excluded += apart
    excluded.sort()
    reactors = tuple(sorted(cfg.reactors))
    shared = tuple(sorted(all_housekeeping(host, cfg) - set(reactors)))
    dedicated = tuple(sorted(c.id for c in host.cpus if c.id not in shared and c.id not in reactors))
    return NovaSetup(tuple(offers), tuple(excluded), dedicated, shared, reactors)


def _apart(offers: list[Offer]) -> tuple[list[Offer], list[tuple[str, str]]]:
    """Controllers on no NUMA node beside controllers of the same model on
    one: not offered.  Without pci_in_placement, Nova's PCI pools match an
    alias by vendor, product and type alone (nova/pci/stats.py ignores the
    resource class), so the no-node alias would take the node's controller,
    and with it the node alias cannot be served where its flavor says."""
    bound = {(o.vendor_id, o.product_id, o.device_type) for o in offers if o.node is not None}
    keep, apart = [], []
    for o in offers:
        if o.node is None and (o.vendor_id, o.product_id, o.device_type) in bound:
            apart.append((o.address, "the firmware puts it on no NUMA node, beside controllers of "
                                     "its model on nodes: Nova's PCI pools would give its alias "
                                     "theirs; fix the firmware's NUMA node, or [pci] blocked it"))
        else:
            keep.append(o)
    return keep, apart


def _refusals(host: Host, cfg: Config, ledger: Ledger, ctrl: NvmeController) -> tuple[str, ...]:
    why = check_passthrough(ctrl, iommu_enabled=host.iommu_enabled,
                            vfio_available=host.vfio_available, pci_allowed=cfg.pci_allowed,
                            pci_blocked=cfg.pci_blocked,
                            spdk_owned=bool(ledger.spdk_users.get(ctrl.address)))
    if ctrl.driver in USERSPACE_DRIVERS:
        # SPDK's setup.sh (or another VM's passthrough) took it from the kernel:
        # whose it is cannot be told from here, so it is nobody's to offer.
        why += (f"it is on {ctrl.driver} already (SPDK's or another VM's): give it back to the "
                "nvme driver to offer it",)
    owner = ledger.passthrough.get(ctrl.address)
    if owner:
        why += (f"vstor passes it through to domain '{owner}'",)
    if ctrl.physfn:
        # Nova types it type-VF and never lets a PF and its VFs be offered
        # together (PlacementPciDependentDeviceException stops nova-compute);
        # vstor offers whole controllers (docs/nova.md).
        why = (f"an SR-IOV virtual function of {ctrl.physfn}: vstor offers whole controllers, "
               "not virtual functions",) + why
    return why


def _id(text: str) -> str:
    return text.lower().removeprefix("0x").rjust(4, "0")


def device_specs(s: NovaSetup) -> list[dict]:
    """One per controller, by address (so a controller of the same model
    that the host uses is never matched)."""
    return [{"address": o.address, "vendor_id": o.vendor_id, "product_id": o.product_id,
             "live_migratable": "no", "resource_class": o.resource_class,
             "traits": PASSTHROUGH_TRAIT} for o in s.offers]


def aliases(s: NovaSetup) -> list[dict]:
    """One per model; numa_policy required: Nova places the instance on the
    device's node or not at all."""
    out: dict[str, dict] = {}
    for o in s.offers:
        out.setdefault(o.alias, {"name": o.alias, "vendor_id": o.vendor_id,
                                 "product_id": o.product_id, "device_type": o.device_type,
                                 "numa_policy": o.numa_policy, "live_migratable": "no",
                                 "resource_class": o.resource_class, "traits": PASSTHROUGH_TRAIT})
    return list(out.values())


def flavor_specs(alias: str, count: int = 1, page_kib: int | None = None,
                 local: bool = True) -> dict[str, str]:
    """Passthrough with the instance's vCPUs (dedicated) and memory on the
    device's node; emulator threads on cpu_shared_set, off the vCPUs.
    local=False: the device is on no node, so nothing can be next to it."""
    out = {"pci_passthrough:alias": f"{alias}:{count}",
           "hw:pci_numa_affinity_policy": "required" if local else "legacy",
           "hw:cpu_policy": "dedicated",
           "hw:numa_nodes": "1",
           "hw:mem_page_size": PAGE_SIZES.get(page_kib, "large"),
           "hw:emulator_threads_policy": "share"}
    if local:
        # vstor's hook checks at every start that Nova kept it so
        # (vstor.nova.instance): a start that slipped off the node is refused.
        out["vstor:numa"] = "strict"
    return out


def _flat(text: str) -> str:
    """`text` on one line: a control character (a newline in a host name, a
    mount point or a domain's name) written as its escape, so that nothing
    read from the host becomes a line of nova.conf of its own."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def nova_conf(s: NovaSetup, source: str, provider_dir: str | None = None) -> str:
    """A nova.conf fragment (oslo.config: repeated keys make a list);
    provider_dir: where the provider config file is (vstor.nova.placement)."""
    if provider_dir is not None and _flat(provider_dir) != provider_dir:
        raise BadInput(f"the provider config's directory {_flat(provider_dir)!r} cannot be "
                       "written into nova.conf (a control character)",
                       hint="--provider-config in a directory with a plain name")
    source = _flat(source)
    lines = [f"# Written by `vstor nova config` from {source} (Nova 2025.1 or later: aliases",
             "# with live_migratable).  Merge into nova.conf on this compute host; restart",
             "# nova-compute.  The [pci] alias lines must also be in nova.conf on every",
             "# nova-api and scheduler host, the same everywhere (the union of all hosts').",
             "", "[pci]"]
    for address, why in s.excluded:
        lines.append(f"# not offered: {_flat(address)}: {_flat(why)}")
    lines += ["# Each controller below becomes a Placement resource provider with its",
              f"# resource_class and trait {PASSTHROUGH_TRAIT}; Nova cannot turn this off again.",
              "# Once every compute host reports, set [filter_scheduler] pci_in_placement = True",
              "# on nova-api, nova-scheduler and every nova-conductor: the aliases then ask",
              "# Placement for their resource_class and trait.",
              "report_in_placement = True"]
    lines += [f"device_spec = {json.dumps(spec, separators=(', ', ': '))}" for spec in device_specs(s)]
    lines += [f"alias = {json.dumps(a, separators=(', ', ': '))}" for a in aliases(s)]
    lines += ["", "[compute]"]
    if s.reactors:
        lines.append(f"# SPDK reactor cores {format_cpulist(s.reactors)} are in neither set: "
                     "no instance runs on them")
    lines.append(f"cpu_dedicated_set = {format_cpulist(s.dedicated)}")
    lines.append(f"cpu_shared_set = {format_cpulist(s.shared)}")
    if provider_dir:
        lines += ["# vstor's provider config file (vhost-user-blk disks, traits) is in this directory",
                  f"provider_config_location = {provider_dir}"]
    return "\n".join(lines) + "\n"


def flavor_commands(s: NovaSetup, flavor: str | None, page_kib: int | None = None) -> list[str]:
    """`openstack flavor set` per alias, for FLAVOR (or one named after the alias)."""
    out = []
    for a in aliases(s):
        name = flavor or a["name"]
        specs = flavor_specs(a["name"], 1, page_kib, local=a["numa_policy"] == "required")
        props = " ".join(f"--property {shlex.quote(f'{k}={v}')}" for k, v in specs.items())
        nodes = sorted({o.node for o in s.offers if o.alias == a["name"] and o.node is not None})
        out.append(f"# {_flat(a['name'])}: {sum(o.alias == a['name'] for o in s.offers)} controller(s)"
                   + (f" on node(s) {','.join(map(str, nodes))}" if nodes else "")
                   + f"; Placement: {a['resource_class']} through the alias")
        out.append(f"openstack flavor set {shlex.quote(name)} {props}")
    return out
