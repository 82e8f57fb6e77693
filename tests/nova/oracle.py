"""Run with an interpreter that has nova installed: one JSON request on
stdin, one JSON answer on stdout.  Everything here is Nova's own code.

request: {"conf": nova.conf text, "extra_specs": {key: value},
          "device_specs": [dict] (each parsed alone), "aliases": [str] (alias JSON),
          "placement": {...} (see placement()), "pci": {...} (see pci())}
answer:  {"whitelist": [spec tags], "aliases": {name: [numa_policy, specs]},
          "dedicated": [cpus], "shared": [cpus], "extra_specs": {key: error or null},
          "device_specs": [error or null], "alias_error": error or null,
          "placement": {...}, "pci": {...}}"""

import json
import os
import sys
import tempfile

import nova.conf
from nova import exception

CONF = nova.conf.CONF


def main() -> None:
    req = json.load(sys.stdin)
    out = {}
    if "conf" in req:
        with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
            f.write(req["conf"])
        CONF([], default_config_files=[f.name])
        os.unlink(f.name)
        from nova.pci import request as pci_request, whitelist
        from nova.virt import hardware
        wl = whitelist.Whitelist(CONF.pci.device_spec)
        out["whitelist"] = [spec.get_tags() | {"address": str(spec._address_obj().pci_address_spec.__dict__)}
                            for spec in wl.specs]
        out["aliases"] = {k: [v[0], v[1]] for k, v in pci_request.get_alias_from_config().items()}
        out["dedicated"] = sorted(hardware.get_cpu_dedicated_set() or [])
        out["shared"] = sorted(hardware.get_cpu_shared_set() or [])
    else:
        CONF([], default_config_files=[])
    from nova.api.validation.extra_specs import validators
    out["extra_specs"] = {}
    for key, value in req.get("extra_specs", {}).items():
        try:
            validators.validate(key, value)
            out["extra_specs"][key] = None
        except Exception as e:      # Nova raises webob HTTP errors here
            out["extra_specs"][key] = f"{type(e).__name__}: {e}"
    from nova.pci import devspec
    out["device_specs"] = []
    for spec in req.get("device_specs", []):
        try:
            devspec.PciDeviceSpec(dict(spec))
            out["device_specs"].append(None)
        except exception.NovaException as e:
            out["device_specs"].append(f"{type(e).__name__}: {e}")
    if "aliases" in req:
        from nova.pci import request as pci_request
        CONF.set_override("alias", req["aliases"], group="pci")
        pci_request.get_alias_from_config.cache_clear()
        try:
            pci_request.get_alias_from_config()
            out["alias_error"] = None
        except exception.NovaException as e:
            out["alias_error"] = f"{type(e).__name__}: {e}"
    if "placement" in req:
        out["placement"] = placement(req["placement"])
    if "pci" in req:
        out["pci"] = pci(req["pci"])
    if "guest" in req:
        out["xml"] = guest(req["guest"])
    if "driver" in req:
        out["driver"] = driver_step(req["driver"])
    if "augment" in req:
        out["augmented"] = augmented(req["augment"])
    if "guests" in req:
        out["xmls"] = {k: guest(v) for k, v in req["guests"].items()}
    if "migration_xml" in req:
        out["migration_xml"] = migration_xml(req["migration_xml"])
    if "driver_migration" in req:
        out["driver_migration"] = driver_migration(req["driver_migration"])
    json.dump(out, sys.stdout)


def placement(req: dict) -> dict:
    """What Placement would hold and be asked, as Nova makes both, with the
    nova.conf already read (req "conf"):
    - provider_dir: nova-compute's provider config loader on the directory,
      merged by its resource tracker into a compute node root provider
      (named req "node", with the COMPUTE_NODE trait and a VCPU inventory):
      {"provider_config_location", "compute_node": {inventory, traits}} or
      {"provider_error"};
    - devices ([{address, vendor_id, product_id, dev_type, numa_node,
      parent_addr}], as nova-compute's PCI tracker holds them): the
      providers Nova's PCI placement translator makes of the ones [pci]
      device_spec matches, or the exception that stops nova-compute
      ("pci_error");
    - aliases ([alias:count]): the request groups the scheduler asks
      Placement for with [filter_scheduler] pci_in_placement;
    - flavor_specs: the unsuffixed group the scheduler asks for a flavor
      with these extra specs (nova.scheduler.utils.ResourceRequest)."""
    import uuid
    import os_traits
    from nova import objects
    from nova.compute import pci_placement_translator, provider_config, provider_tree
    from nova.compute import resource_tracker
    from nova.pci import request as pci_request, whitelist
    objects.register_all()
    out = {}
    node = req.get("node", "compute-7")
    tree = provider_tree.ProviderTree()
    root = str(uuid.uuid4())
    tree.new_root(node, root)
    tree.update_traits(root, [os_traits.COMPUTE_NODE])
    tree.update_inventory(root, {"VCPU": {"total": 8}})
    if "provider_dir" in req:
        out["provider_config_location"] = CONF.compute.provider_config_location
        try:
            configs = provider_config.get_provider_configs(req["provider_dir"])
            rt = resource_tracker.ResourceTracker.__new__(resource_tracker.ResourceTracker)
            rt.absent_providers = set()
            rt._merge_provider_configs(configs, tree)
        except (exception.NovaException, ValueError) as e:
            out["provider_error"] = f"{type(e).__name__}: {e}"
        data = tree.data(root)
        out["compute_node"] = {"inventory": data.inventory, "traits": sorted(data.traits)}
    if "devices" in req:
        wl = whitelist.Whitelist(CONF.pci.device_spec)
        view = pci_placement_translator.PlacementView(node, [])
        try:
            for d in req["devices"]:
                # Nova's PCI tracker keeps only what device_spec matches.
                dev = objects.PciDevice(status="available", instance_uuid=None, extra_info={},
                                        compute_node_id=1, **{"parent_addr": None, **d})
                spec = wl.get_devspec(dev)
                if spec is not None:
                    view.process_dev(dev, spec)
            view.update_provider_tree(tree, {})
        except exception.NovaException as e:    # what stops nova-compute at its start
            out["pci_error"] = f"{type(e).__name__}: {e}"
        out["pci_providers"] = {tree.data(u).name: {"inventory": tree.data(u).inventory,
                                                    "traits": sorted(tree.data(u).traits)}
                                for u in tree.get_provider_uuids() if u != root}
    if "aliases" in req:
        CONF.set_override("pci_in_placement", True, group="filter_scheduler")
        pci_request.get_alias_from_config.cache_clear()
        groups = {}
        for alias in req["aliases"]:
            spec = objects.RequestSpec(requested_resources=None, pci_requests=objects.InstancePCIRequests(
                requests=pci_request._translate_alias_to_requests(alias)))
            spec.generate_request_groups_from_pci_requests()
            groups[alias] = [[g.resources, sorted(g.required_traits)] for g in spec.requested_resources]
        out["groups"] = groups
    if "flavor_specs" in req:
        from nova.scheduler import utils as scheduler_utils
        flavor = objects.Flavor(vcpus=2, memory_mb=2048, root_gb=10, ephemeral_gb=0, swap=0,
                                extra_specs=req["flavor_specs"])
        spec = objects.RequestSpec(flavor=flavor, image=objects.ImageMeta.from_dict({}),
                                   is_bfv=False, requested_resources=[],
                                   pci_requests=objects.InstancePCIRequests(requests=[]))
        group = scheduler_utils.ResourceRequest.from_request_spec(spec).get_request_group(None)
        out["unsuffixed"] = {"resources": group.resources, "required": sorted(group.required_traits)}
    return out



def pci(req: dict) -> dict:
    """A compute host's PCI devices through nova-compute and the scheduler,
    with the nova.conf already read (req "conf"):
    - nodedevs ([libvirt node device XML]): what libvirt's nodedev driver
      shows; Nova's libvirt driver makes its device dicts of them
      (Host._get_pcidev_info): "reported";
    - nova-compute's resource tracker: its PCI tracker (PciDevTracker, with
      an empty device table where it reads the database) takes what
      [pci] device_spec matches ("tracked"), and its Placement update
      (update_provider_tree_for_pci) makes the providers ("providers",
      name -> [device address, inventory, traits]) or raises ("pci_error");
    - flavors ({name: extra specs}): the PCI requests nova-api makes of each
      flavor, asked on every host NUMA cell (req "cells") the way the
      scheduler (PciDeviceStats from the compute node's pools) and the
      compute host's claim (the tracker's PciDeviceStats) ask them:
      "served" (support_requests, then apply_requests, until refused),
      "claimed" (consume_requests until refused: the devices handed out),
      "anywhere" (the PCI filter's ask, without cells), "host" (one pool
      for the host, cell after cell: the devices handed out, and whether
      one more is refused on every cell), "placed" (which providers
      Placement could hand the request group, and, for each, whether the
      scheduler's and the claim's PciDeviceStats serve the request from
      it on that cell)."""
    import copy
    import uuid
    from types import SimpleNamespace
    from unittest import mock
    from xml.etree import ElementTree
    import os_traits
    from nova import context, objects
    from nova.compute import pci_placement_translator, provider_tree
    from nova.pci import manager, request as pci_request, stats as pci_stats
    from nova.pci import utils as pci_utils
    from nova.virt import hardware
    from nova.virt.libvirt import host as libvirt_host
    objects.register_all()
    out = {}
    nodedevs = [SimpleNamespace(XMLDesc=lambda flags, x=x: x, listCaps=lambda: ["pci"],
                                name=lambda n=ElementTree.fromstring(x).findtext("name"): n)
                for x in req["nodedevs"]]      # virNodeDevice, as far as Nova's driver reads it

    def no_netdev(address, *a, **k):       # an NVMe function has no netdev
        raise exception.PciDeviceNotFoundById(id=address)
    with mock.patch.object(pci_utils, "get_mac_by_pci_address", no_netdev):
        reported = [libvirt_host.Host._get_pcidev_info(libvirt_host.Host.__new__(libvirt_host.Host),
                                                       dev.name(), dev, [], [], nodedevs) for dev in nodedevs]
    out["reported"] = {d["address"]: {k: d.get(k) for k in ("dev_type", "numa_node", "parent_addr",
                                                             "vendor_id", "product_id")}
                       for d in reported}
    ctx = context.get_admin_context()
    node = objects.ComputeNode(id=1, numa_topology=None)
    with mock.patch.object(objects.PciDeviceList, "get_by_compute_node",
                           lambda *a, **k: objects.PciDeviceList(objects=[])):
        tracker = manager.PciDevTracker(ctx, node)
    tracker.update_devices_from_hypervisor_resources(json.dumps(reported))
    out["tracked"] = sorted(d.address for d in tracker.pci_devs)
    tree = provider_tree.ProviderTree()
    root = str(uuid.uuid4())
    name = req.get("node", "compute-7")
    tree.new_root(name, root)
    tree.update_traits(root, [os_traits.COMPUTE_NODE])
    try:
        pci_placement_translator.update_provider_tree_for_pci(tree, name, tracker, {}, [])
    except (exception.NovaException, ValueError) as e:     # what stops nova-compute
        out["pci_error"] = f"{type(e).__name__}: {e}"
        return out
    by_rp = {d.extra_info.get("rp_uuid"): d.address for d in tracker.pci_devs}
    providers = {u: tree.data(u) for u in tree.get_provider_uuids() if u != root}
    out["providers"] = {p.name: [by_rp.get(u), p.inventory, sorted(p.traits)] for u, p in providers.items()}
    scheduler = pci_stats.PciDeviceStats(None, stats=tracker.stats.to_device_pools_obj())
    image = objects.ImageMeta.from_dict({})

    def cells_for(topology, cell):
        if cell is None or topology is None:
            return None
        cells = copy.deepcopy(topology.cells)
        for c in cells:
            c.id = cell            # numa_fit_instance_to_host: the host cell it fits
        return cells

    def served(cells, requests, limit=64):
        view = copy.deepcopy(scheduler)
        n = 0
        while n < limit and view.support_requests(requests, None, cells):
            view.apply_requests(requests, None, cells)
            n += 1
        return n

    def claimed(claim, cells, requests, limit=64):
        got = []
        for _ in range(limit):
            try:
                devs = claim.consume_requests(requests, cells)
            except exception.PciDeviceRequestFailed:
                break
            got.append(sorted(d.address for d in devs))
        return got

    out["flavors"] = {}
    for fname, specs in req["flavors"].items():
        flavor = objects.Flavor(name=fname, flavorid=fname, vcpus=2, memory_mb=2048, root_gb=10,
                                ephemeral_gb=0, swap=0, extra_specs=specs)
        topology = hardware.numa_get_constraints(flavor, image)
        requests = pci_request.get_pci_requests_from_flavor(     # as nova-api makes them
            flavor, affinity_policy=hardware.get_pci_numa_policy_constraint(flavor, image)).requests
        got = {"requests": [[r.count, r.spec, r.numa_policy] for r in requests],
               "numa_cells": len(topology.cells) if topology else 0,
               "served": {}, "claimed": {}, "placed": {},
               "anywhere": served(None, requests)}
        for cell in req["cells"]:
            cells = cells_for(topology, cell)
            got["served"][cell] = served(cells, requests)
            got["claimed"][cell] = claimed(copy.deepcopy(tracker.stats), cells, requests)
        claim = copy.deepcopy(tracker.stats)
        got["host"] = {"claimed": {cell: claimed(claim, cells_for(topology, cell), requests)
                                   for cell in req["cells"]}}
        got["host"]["one_more"] = [claim.support_requests(requests, None, cells_for(topology, cell))
                                   for cell in req["cells"]]
        # With [filter_scheduler] pci_in_placement: Placement hands each
        # request group a provider with its class and traits; the scheduler's
        # PCI filters, then the claim, must serve the request from exactly it.
        spec = objects.RequestSpec(requested_resources=None, pci_requests=objects.InstancePCIRequests(
            requests=requests))
        CONF.set_override("pci_in_placement", True, group="filter_scheduler")
        spec.generate_request_groups_from_pci_requests()
        CONF.clear_override("pci_in_placement", group="filter_scheduler")
        for group in spec.requested_resources:
            candidates = [u for u, p in providers.items()
                          if all(p.inventory.get(rc, {}).get("total", 0) >= n
                                 for rc, n in group.resources.items())
                          and set(group.required_traits) <= set(p.traits)]
            for cell in req["cells"]:
                for u in candidates:
                    mapping = {group.requester_id: [u]}
                    asked = copy.deepcopy(requests)
                    for r in asked:
                        if group.requester_id.startswith(r.request_id):
                            r.spec[0]["rp_uuids"] = u    # as the conductor records it
                    got["placed"].setdefault(cell, {})[by_rp[u]] = [
                        copy.deepcopy(scheduler).support_requests(requests, mapping,
                                                                  cells_for(topology, cell)),
                        bool(claimed(copy.deepcopy(tracker.stats), cells_for(topology, cell),
                                     asked, limit=1))]
        out["flavors"][fname] = got
    return out


def guest(spec: dict) -> str:
    return make_guest(spec).to_xml()


def augmented(req: dict) -> dict:
    """vstor's driver step (vstor.nova.guest.augment) on a guest Nova's
    classes built: the XML, or vstor's refusal."""
    from vstor import config as config_mod
    from vstor.errors import VstorError
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    from vstor.nova.guest import augment
    from vstor.planner.ledger import Ledger
    g = make_guest(req["spec"])
    try:
        plan = augment(g, req["spec"].get("extra_specs", {}), req["spec"].get("flavor", "nvme.large"),
                       req["spec"].get("project", "p1"), read_host(SysFS(req.get("host_root", "/"))),
                       config_mod.load(req["config"]), Ledger())
    except VstorError as e:
        return {"error": str(e), "code": e.exit_code}
    return {"xml": g.to_xml(), "disks": [d.target for d in plan.disks] if plan else None}


def driver_step(req: dict) -> dict:
    """VstorLibvirtDriver._get_guest_config as nova-compute calls it, loaded
    the way Nova loads a compute driver (nova.virt.<compute_driver>, after
    `vstor nova install-driver`), with Nova's own guest config standing in
    for what LibvirtDriver built (the parent's method is replaced: it needs
    a whole compute host) and vstor's ledger empty."""
    from types import SimpleNamespace
    from unittest import mock
    from oslo_utils import importutils
    from nova.virt.libvirt import driver as libvirt_driver
    cls = importutils.import_class("nova.virt." + req["compute_driver"])
    drv = cls.__new__(cls)
    drv._host = SimpleNamespace(get_connection=lambda: None)
    flavor = SimpleNamespace(name=req["spec"].get("flavor", "nvme.large"),
                             extra_specs=req["spec"].get("extra_specs", {}))
    project = req["spec"].get("project", "p1")
    os_env = {"VSTOR_CONFIG": req["config"]}
    with mock.patch.object(libvirt_driver.LibvirtDriver, "_get_guest_config",
                           lambda self, instance, *a, **k: make_guest(req["spec"])), \
            mock.patch("vstor.runtime.inventory.load_ledger", lambda *a, **k: __import__(
                "vstor.planner.ledger", fromlist=["Ledger"]).Ledger()), \
            mock.patch.dict(os.environ, os_env):
        g = drv._get_guest_config(SimpleNamespace(flavor=flavor, project_id=project), None, None, None)
    return {"subclass": issubclass(cls, libvirt_driver.LibvirtDriver), "xml": g.to_xml()}


def migration_xml(req: dict) -> str:
    """The XML Nova's source sends a live migration with
    (nova.virt.libvirt.migration.get_updated_guest_xml) from the domain's
    migratable XML, with the LibvirtLiveMigrateData a destination without
    file-backed memory, graphics, serial ports or volumes fills in, and
    `numa` (cpu_pins, cell_pins, emulator_pins) when Nova re-pins it."""
    from types import SimpleNamespace
    from nova import objects
    from nova.virt.libvirt import migration
    objects.register_all()
    data = objects.LibvirtLiveMigrateData(
        graphics_listen_addr_vnc="127.0.0.1", graphics_listen_addr_spice="127.0.0.1",
        serial_listen_addr=None, serial_listen_ports=[], target_connect_addr=None,
        supported_perf_events=[], bdms=[], dst_wants_file_backed_memory=False,
        block_migration=False, is_shared_instance_path=True)
    if req.get("numa"):
        n = req["numa"]
        data.dst_numa_info = objects.LibvirtLiveMigrateNUMAInfo(
            cpu_pins={k: set(v) for k, v in n["cpu_pins"].items()},
            cell_pins={k: set(v) for k, v in n["cell_pins"].items()},
            emulator_pins=set(n["emulator_pins"]))
    guest = SimpleNamespace(get_xml_desc=lambda dump_migratable=False: req["xml"],
                            migrate=lambda *a, destination_xml=None, **k: sent.append(destination_xml))
    if req.get("compute_driver"):
        # As _live_migration_operation of the driver hands it to Nova's code
        # (imported from vstor: the nova.virt shim may not be installed yet).
        from vstor.nova.driver import SharedMemoryGuest
        guest = SharedMemoryGuest(guest)
    sent = []
    instance = SimpleNamespace(flavor=SimpleNamespace(extra_specs=req.get("extra_specs", {})))
    xml = migration.get_updated_guest_xml(instance, guest, data, get_volume_config=None)
    guest.migrate("qemu+tcp://dest/system", destination_xml=xml)     # as Nova's migrate call does
    return sent[0]


def driver_migration(req: dict) -> dict:
    """vstor's driver in a live migration, loaded as Nova loads compute
    drivers, called as Nova's compute manager calls it
    (nova.compute.manager: driver.live_migration with its post and
    recover methods, then post_live_migration_at_source or
    rollback_live_migration_at_source), with Nova's own LibvirtDriver
    methods replaced by recorders (they need a whole compute host).
    What the driver ran is recorded by `[nova] migrate_command` (the test's
    double of sudo + vstor)."""
    import inspect
    from types import SimpleNamespace
    from unittest import mock
    from oslo_utils import importutils
    from nova.virt.libvirt import driver as libvirt_driver
    cls = importutils.import_class("nova.virt." + req["compute_driver"])
    drv = cls.__new__(cls)
    def note(line):
        with open(req["log"], "a") as f:
            f.write(line + "\n")
    signatures = {}
    for name in ("live_migration", "rollback_live_migration_at_source",
                 "post_live_migration_at_source", "_live_migration_operation"):
        ours, novas = getattr(cls, name), getattr(libvirt_driver.LibvirtDriver, name)
        signatures[name] = str(inspect.signature(ours)) == str(inspect.signature(novas))
    flavor = SimpleNamespace(name="f", extra_specs=req.get("extra_specs", {}))
    instance = SimpleNamespace(name=req["name"], flavor=flavor, uuid="u")

    def parent(name):
        def record(self, *args, **kwargs):
            note("nova " + name)
            if name == "live_migration" and req.get("migration_fails"):
                raise RuntimeError("libvirt said no")
        return record
    patches = [mock.patch.object(libvirt_driver.LibvirtDriver, n, parent(n))
               for n in ("live_migration", "rollback_live_migration_at_source",
                         "post_live_migration_at_source")]
    for p in patches:
        p.start()
    raised = None
    with mock.patch.dict(os.environ, {"VSTOR_CONFIG": req["config"]}):
        try:
            drv.live_migration("ctx", instance, req["dest"],
                               lambda *a, **k: note("post"), lambda *a, **k: note("recover"),
                               False, SimpleNamespace())
        except RuntimeError as e:
            raised = str(e)
        for then in req.get("then", ("post", "rollback")):   # what Nova's manager calls next
            if then == "post":
                drv.post_live_migration_at_source("ctx", instance, [])
            else:
                drv.rollback_live_migration_at_source("ctx", instance, SimpleNamespace())
    for p in patches:
        p.stop()
    with open(req["log"]) as f:
        calls = f.read().splitlines()
    return {"calls": calls, "raised": raised, "signatures": signatures}


def make_guest(spec: dict):
    """A domain as Nova's libvirt driver builds it, with Nova's own config
    classes: its metadata (instance, flavor, extra specs), vCPU pinning,
    memory binding, a guest NUMA cell, PCI passthrough, a kernel to boot,
    a serial console to a file, as given."""
    from nova.virt.libvirt import config as vconfig
    g = vconfig.LibvirtConfigGuest()
    g.virt_type, g.name, g.uuid = spec.get("virt_type", "qemu"), spec["name"], spec["uuid"]
    g.memory, g.vcpus = spec.get("memory_kib", 262144), spec["vcpus"]
    g.os_type = "hvm"
    g.os_kernel, g.os_initrd, g.os_cmdline = spec.get("kernel"), spec.get("initrd"), spec.get("cmdline")
    meta = vconfig.LibvirtConfigGuestMetaNovaInstance()
    meta.package, meta.name, meta.creationTime = "34.0.0", spec.get("display", "web1"), 1764000000
    flavor = vconfig.LibvirtConfigGuestMetaNovaFlavor()
    flavor.name, flavor.id = spec.get("flavor", "nvme.large"), "f1"
    flavor.memory, flavor.vcpus, flavor.disk, flavor.swap, flavor.ephemeral = (
        spec.get("memory_kib", 262144) // 1024, spec["vcpus"], 1, 0, 0)
    flavor.extra_specs = spec.get("extra_specs", {})
    meta.flavor = flavor
    owner = vconfig.LibvirtConfigGuestMetaNovaOwner()
    owner.userid, owner.username, owner.projectid, owner.projectname = "u1", "alice", "p1", "demo"
    meta.owner = owner
    g.metadata.append(meta)
    if spec.get("pins") is not None:
        tune = vconfig.LibvirtConfigGuestCPUTune()
        for vcpu, cpu in enumerate(spec["pins"]):
            pin = vconfig.LibvirtConfigGuestCPUTuneVCPUPin()
            pin.id, pin.cpuset = vcpu, {cpu}
            tune.vcpupin.append(pin)
        g.cputune = tune
    if spec.get("memory_nodes") is not None:
        nt = vconfig.LibvirtConfigGuestNUMATune()
        nt.memory = vconfig.LibvirtConfigGuestNUMATuneMemory()
        nt.memory.mode, nt.memory.nodeset = "strict", spec["memory_nodes"]
        g.numatune = nt
    for address in spec.get("hostdevs", []):
        hd = vconfig.LibvirtConfigGuestHostdevPCI()
        dom, bus, rest = address.split(":")
        slot, fn = rest.split(".")
        hd.domain, hd.bus, hd.slot, hd.function = dom, bus, slot, fn
        g.add_device(hd)
    if spec.get("console"):
        serial = vconfig.LibvirtConfigGuestSerial()
        serial.type, serial.source_path = "file", spec["console"]
        g.add_device(serial)
    if spec.get("memballoon") is False:
        balloon = vconfig.LibvirtConfigMemoryBalloon()
        balloon.model = "none"
        g.add_device(balloon)
    g.os_mach_type = spec.get("machine")
    if spec.get("page_kb"):
        mb = vconfig.LibvirtConfigGuestMemoryBacking()
        page = vconfig.LibvirtConfigGuestMemoryBackingPage()
        page.size_kb, page.nodeset = spec["page_kb"], [0]
        mb.hugepages.append(page)
        g.membacking = mb
    if spec.get("numa_cell"):
        # One guest NUMA cell, as Nova's driver makes it for a flavor with a
        # NUMA topology (hugepages imply one): shared with hugepages.
        cell = vconfig.LibvirtConfigGuestCPUNUMACell()
        cell.id, cell.cpus, cell.memory = 0, set(range(spec["vcpus"])), spec.get("memory_kib", 262144)
        if spec.get("page_kb"):
            cell.memAccess = "shared"
        g.cpu = vconfig.LibvirtConfigGuestCPU()
        g.cpu.numa = vconfig.LibvirtConfigGuestCPUNUMA()
        g.cpu.numa.cells.append(cell)
    if spec.get("acpi"):
        g.features.append(vconfig.LibvirtConfigGuestFeatureACPI())
    return g


if __name__ == "__main__":
    main()
