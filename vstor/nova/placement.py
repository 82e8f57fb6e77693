"""What Nova's scheduler (Placement) learns of a vstor host: a provider
config file that gives the compute node custom inventories and traits for
the vhost-user-blk disks vstor's compute driver serves, and the flavor
properties that ask for them.  Pure.

Nova's facts, checked against nova 34.0.0: nova-compute loads every *.yaml
in `[compute] provider_config_location` (nova/compute/provider_config.py,
PyYAML's safe_load, schema 1.0); a provider file may add custom resource
classes and custom traits only (CUSTOM_ and [A-Z0-9_], at most 255
characters), never one the virt driver reports; the identification uuid
`$COMPUTE_NODE` names every compute node root provider the service manages
(nova/compute/resource_tracker.py _merge_provider_configs).  A flavor asks
with `resources:<class>=<count>` (the unsuffixed group: the compute node's
inventory) and `trait:<trait>=required`.

What is counted: one unit per vhost-user-blk disk, per backend.  Neither
backend has a count the planner enforces: a qemu-storage-daemon is one
small process per disk (about 5 MiB resident, idle, measured), an SPDK
vhost controller one more poller on a reactor.  What bounds them is the
host: with aio=native each qemu-storage-daemon holds 1024 of the host's
AIO events (vstor.backends.qsd.aio), and fs.aio-max-nr's default of 65536
keeps 64 of them on native AIO (past that they fall back to the thread
pool).  So the bound is a number, 64 by default, that the operator can
lower or raise; it is a promise Placement keeps, not a fact vstor reads.
"""

from __future__ import annotations

import json
import shlex

from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.model import Host, format_cpulist
from vstor.nova import disks
from vstor.nova.config import PASSTHROUGH_TRAIT as PASSTHROUGH
from vstor.records import record

VHOST_DISKS = 64
NVMF_TRAITS = {"rdma": "CUSTOM_VSTOR_NVMF_RDMA", "tcp": "CUSTOM_VSTOR_NVMF_TCP"}


@record
class Backend:
    name: str
    resource_class: str     # one unit per disk it serves to an instance
    trait: str              # the host serves Nova instances' disks with it


BACKENDS = {
    "qsd": Backend("qsd", "CUSTOM_VSTOR_VHOST_QSD", "CUSTOM_VSTOR_QSD"),
    "spdk": Backend("spdk", "CUSTOM_VSTOR_VHOST_SPDK", "CUSTOM_VSTOR_SPDK"),
}
# What vstor's compute driver serves a Nova instance: qemu-storage-daemon
# disks, and SPDK disks (local NVMe or NVMe-oF) of a flavor whose
# hw:mem_page_size gives the guest hugepages (Nova's: vstor places none,
# vstor.nova.disks).
NOVA_BACKENDS = ("qsd", "spdk")
NOT_FOR_NOVA = "vstor's Nova driver does not serve it"
SPDK_PAGES = ("an SPDK disk needs the guest's memory in hugepages: the flavor's "
              "hw:mem_page_size must be large (or 2MB, 1GB)")


@record
class Inventory:
    resource_class: str
    total: int
    why: str


@record
class ProviderView:
    """The compute node's additions, and what it does not offer with why."""
    inventories: tuple[Inventory, ...]
    traits: tuple[tuple[str, str], ...]         # (trait, why)
    not_offered: tuple[tuple[str, str], ...]    # (class or trait, why not)


def view(host: Host, cfg: Config, passthrough: int, *, qsd_installed: bool,
         vhost_disks: int = VHOST_DISKS, served: tuple[str, ...] = NOVA_BACKENDS) -> ProviderView:
    """`passthrough`: how many controllers the nova.conf fragment offers;
    `qsd_installed`: /usr/bin/qemu-storage-daemon is there (the shell looks)."""
    if vhost_disks < 1:
        raise BadInput(f"--vhost-disks {vhost_disks}: Placement takes an inventory of 1 or more",
                       hint="--vhost-disks 1 or more")
    inv, traits, refused = [], [], []
    why_not = {"qsd": None if qsd_installed else
               "qemu-storage-daemon is not installed (apt-get install qemu-system-common)",
               "spdk": None if cfg.reactors else "no SPDK reactor cores ([cpu] reactors)"}
    for name, b in BACKENDS.items():
        why = why_not[name] or (None if name in served else NOT_FOR_NOVA)
        if why:
            refused += [(b.resource_class, why), (b.trait, why)]
            continue
        inv.append(Inventory(b.resource_class, vhost_disks,
                             f"vhost-user-blk disks from {_NAMES[name]}: at most {vhost_disks} "
                             "(--vhost-disks)"))
        traits.append((b.trait, f"Nova instances' vhost-user-blk disks from {_NAMES[name]}"))
    spdk = "spdk" in served and not why_not["spdk"]
    for transport, trait in NVMF_TRAITS.items():
        why = _nvmf_why_not(host, transport) if spdk else "NVMe-oF disks are SPDK's: " + (
            why_not["spdk"] or NOT_FOR_NOVA)
        if why:
            refused.append((trait, why))
        else:
            traits.append((trait, f"SPDK reaches NVMe-oF targets over {transport.upper()} "
                                  f"(reactors {format_cpulist(cfg.reactors)})"))
    if passthrough:
        traits.append((PASSTHROUGH, f"{passthrough} NVMe controller(s) offered to Nova's PCI "
                                    "passthrough, each checked by vstor"))
    else:
        refused.append((PASSTHROUGH, "no NVMe controller here is offered to Nova's passthrough"))
    return ProviderView(tuple(inv), tuple(traits), tuple(refused))


_NAMES = {"qsd": "qemu-storage-daemon", "spdk": "SPDK"}


def _nvmf_why_not(host: Host, transport: str) -> str | None:
    """In the planner's words (vstor.planner.disks._nic_node): without an
    RDMA NIC, SPDK cannot reach an RDMA target; TCP needs only SPDK."""
    if transport == "rdma" and not host.rdma_nics:
        return "this host has no RDMA NIC: SPDK cannot reach an RDMA target from it"
    return None


def provider_yaml(v: ProviderView, source: str) -> str:
    """The provider config file, in the block style Nova's documentation
    shows; every string quoted as JSON (which YAML reads the same)."""
    q = json.dumps
    source = " ".join(source.split())       # one comment line, whatever the host is called
    lines = [f"# Written by `vstor nova config --provider-config` from {source}: what vstor",
             "# serves Nova instances on this compute host.  nova-compute reads every *.yaml",
             "# in [compute] provider_config_location when it starts: restart it after a change.",
             "# The vhost-user-blk disks are served where nova-compute runs vstor's driver",
             "# (compute_driver = vstor.VstorLibvirtDriver).  The hook still checks every",
             "# start: what this file cannot say, it refuses then, and Nova reschedules."]
    lines += [f"# not offered: {what}: {why}" for what, why in v.not_offered]
    lines += ["meta:", f"  schema_version: {q('1.0')}"]
    if not (v.inventories or v.traits):
        return "\n".join(lines + ["providers: []"]) + "\n"
    lines += ["providers:", "  - identification:", f"      uuid: {q('$COMPUTE_NODE')}"]
    if v.inventories:
        lines += ["    inventories:", "      additional:"]
        for i in v.inventories:
            lines += [f"        # {i.why}", f"        - {i.resource_class}:",
                      f"            total: {i.total}", "            reserved: 0",
                      "            min_unit: 1", f"            max_unit: {i.total}",
                      "            step_size: 1", "            allocation_ratio: 1.0"]
    if v.traits:
        lines += ["    traits:", "      additional:"]
        for trait, why in v.traits:
            lines += [f"        # {why}", f"        - {q(trait)}"]
    return "\n".join(lines) + "\n"


def disk_backend(d, flavor: str) -> str:
    """The backend every host's planner gives a flavor's disk, or BadInput
    when hosts could differ (an NVMe namespace with backend='auto' gets each
    host's [vhost] default_backend)."""
    kind = d.source.kind
    if d.mode == "passthrough":
        raise BadInput(f"{flavor}: disk {d.target} asks for passthrough; a flavor's vstor disks "
                       "are vhost-user disks", hint="pci_passthrough:alias (vstor nova config --flavors)")
    if kind == "nvmf":
        return "spdk"
    if kind in ("file", "block"):
        return "qsd"
    if d.backend == "auto":
        raise BadInput(f"{flavor}: disk {d.target} has backend='auto': each host's [vhost] "
                       "default_backend would choose, and the scheduler could not know which",
                       hint=f"set {disks.PREFIX_KEY}{d.target}.backend=qsd")
    return d.backend


def disk_flavor_specs(specs: dict[str, str], flavor: str,
                      served: tuple[str, ...] = NOVA_BACKENDS, page: str | None = None) -> dict[str, str]:
    """The flavor properties that make Placement pick a host with room for
    the flavor's vstor disks (the specs are checked as vstor's driver
    checks them), and the large pages its SPDK disks need (`page`, or
    'large', where the specs do not say hw:mem_page_size)."""
    where = f"flavor '{flavor}'"
    intent = disks.intent_of(specs, where)
    disks.projects_of(specs, intent, where)
    disks.numa_policy(specs, where)
    if not intent.disks:
        raise BadInput(f"{where}: no vstor:disk.<target>.<source>.<attribute> spec",
                       hint="like vstor:disk.vdb.file.path=/var/lib/vstor/images/db.raw")
    count: dict[str, int] = {}
    transports = set()
    for d in intent.disks:
        backend = disk_backend(d, where)
        if backend not in served:
            raise BadInput(f"{where}: disk {d.target} would be served by {_NAMES[backend]}: "
                           + NOT_FOR_NOVA, hint="use a file, block or nvme source with backend qsd")
        if backend == "spdk" and "hw:mem_page_size" in specs and not disks.large_pages(specs):
            raise BadInput(f"{where}: disk {d.target} is an SPDK disk; {SPDK_PAGES}",
                           hint="hw:mem_page_size=large")
        if d.source.kind == "nvmf":
            transports.add(d.source.transport)
        count[backend] = count.get(backend, 0) + 1
    out = {}
    if "spdk" in count and "hw:mem_page_size" not in specs:
        out["hw:mem_page_size"] = page or "large"
    for backend, n in sorted(count.items()):
        out[f"resources:{BACKENDS[backend].resource_class}"] = str(n)
        out[f"trait:{BACKENDS[backend].trait}"] = "required"
    for transport in sorted(transports):
        out[f"trait:{NVMF_TRAITS[transport]}"] = "required"
    return out


def disk_flavor_command(specs: dict[str, str], flavor: str, page: str | None = None) -> list[str]:
    """`openstack flavor set` with the flavor's vstor disk specs and what
    they ask of Placement (and of Nova: an SPDK disk's large pages)."""
    asks = disk_flavor_specs(specs, flavor, page=page)
    props = " ".join("--property " + shlex.quote(f"{k}={v}") for k, v in {**specs, **asks}.items())
    wants = ", ".join(f"{v} {k.split(':', 1)[1]}" for k, v in asks.items() if k.startswith("resources:"))
    return [f"# {flavor}: Placement gives it a host with {wants} left", f"openstack flavor set {flavor} {props}"]
