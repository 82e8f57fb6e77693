"""What Nova's scheduler learns of a vstor host, judged by Nova's own code
(nova 34.0.0, run by tests/nova/oracle.py): the provider config file
through nova-compute's loader and resource tracker, the device specs
through the PCI placement translator, the aliases through the request
groups the scheduler sends Placement, the flavor properties through
Nova's extra-spec validators and its scheduler's resource request, and the
host's PCI devices through nova-compute's PCI tracker and the PciDeviceStats
its scheduler filters and claims ask."""

import os
import re
import shlex

import pytest

from tests.nova import ask
from tests.helpers import conf_file, run_cli
from tests.hostlayout import build_tree
from vstor.config import Config
from vstor.errors import BadInput, VstorError

SPECS = {"vstor:disk.vdb.file.path": "/var/lib/vstor/images/db.raw",
         "vstor:disk.vdb.project": "0123456789abcdef0123456789abcdef",
         "vstor:disk.vdc.nvme.controller": "0000:5e:00.0",
         "vstor:disk.vdc.nvme.namespace": "1",
         "vstor:disk.vdc.backend": "qsd",
         "vstor:disk.vdc.readonly": "yes"}




def _write(tmp_path, capsys, root, *extra, cfg=""):
    out = tmp_path / "provider"
    out.mkdir(exist_ok=True)
    code, _, err = run_cli(capsys, "--config", conf_file(tmp_path, cfg), "--host-root", root, "nova", "config",
                        "-o", str(tmp_path / "nova-vstor.conf"),
                        "--provider-config", str(out / "vstor.yaml"), *extra)
    assert code == 0, err
    return (tmp_path / "nova-vstor.conf").read_text(), str(out)


def test_nova_compute_loads_the_provider_file_onto_its_compute_node(tmp_path, capsys, host_layout):
    conf, folder = _write(tmp_path, capsys, host_layout("two-socket"), "--vhost-disks", "12",
                          cfg="[cpu]\nreactors = 2,18\n")
    got = ask({"conf": conf, "placement": {"provider_dir": folder}})["placement"]
    assert "provider_error" not in got, got
    assert got["provider_config_location"] == folder
    node = got["compute_node"]
    assert node["inventory"]["CUSTOM_VSTOR_VHOST_QSD"] == {
        "total": 12, "reserved": 0, "min_unit": 1, "max_unit": 12, "step_size": 1,
        "allocation_ratio": 1.0}
    assert node["inventory"]["CUSTOM_VSTOR_VHOST_SPDK"]["total"] == 12
    assert set(node["inventory"]) == {"VCPU", "CUSTOM_VSTOR_VHOST_QSD", "CUSTOM_VSTOR_VHOST_SPDK"}
    assert set(node["traits"]) == {"COMPUTE_NODE", "OWNER_NOVA", "CUSTOM_VSTOR_QSD",
                                   "CUSTOM_VSTOR_PASSTHROUGH", "CUSTOM_VSTOR_SPDK",
                                   "CUSTOM_VSTOR_NVMF_RDMA", "CUSTOM_VSTOR_NVMF_TCP"}
    text = open(os.path.join(folder, "vstor.yaml")).read()
    # SPDK's reactors are configured: its disks are offered (Nova's large pages, issue 31).
    assert "# not offered: CUSTOM_VSTOR_VHOST_SPDK" not in text


@pytest.mark.parametrize("layout, traits", [
    ("two-socket", {"CUSTOM_VSTOR_SPDK", "CUSTOM_VSTOR_NVMF_RDMA", "CUSTOM_VSTOR_NVMF_TCP"}),
    ("laptop", {"CUSTOM_VSTOR_SPDK", "CUSTOM_VSTOR_NVMF_TCP"}),     # no RDMA NIC
])
def test_spdk_and_nvme_of_once_the_driver_serves_them(tmp_path, host_model, layout, traits):
    """vstor's driver serves SPDK disks (NOVA_BACKENDS): the file carries
    them, RDMA only with an RDMA NIC, and Nova takes it."""
    from vstor.nova import placement
    host = host_model(layout)
    v = placement.view(host, Config(reactors=(2,)), 0, qsd_installed=False, served=("qsd", "spdk"))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "vstor.yaml").write_text(placement.provider_yaml(v, host.hostname))
    got = ask({"placement": {"provider_dir": str(tmp_path / "p")}})["placement"]
    assert "provider_error" not in got, got
    assert set(got["compute_node"]["inventory"]) == {"VCPU", "CUSTOM_VSTOR_VHOST_SPDK"}
    assert set(got["compute_node"]["traits"]) == traits | {"COMPUTE_NODE", "OWNER_NOVA"}
    assert ("CUSTOM_VSTOR_QSD", "qemu-storage-daemon is not installed (apt-get install "
            "qemu-system-common)") in v.not_offered


def test_a_host_with_nothing_to_offer_writes_a_file_nova_takes(tmp_path, host_model):
    from vstor.nova import placement
    v = placement.view(host_model("no-iommu"), Config(), 0, qsd_installed=False)
    assert v.inventories == () and v.traits == ()
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "vstor.yaml").write_text(placement.provider_yaml(v, "h\nproviders: x"))
    got = ask({"placement": {"provider_dir": str(tmp_path / "p")}})["placement"]
    assert "provider_error" not in got and set(got["compute_node"]["inventory"]) == {"VCPU"}


def test_the_oracle_refuses_what_nova_refuses(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x.yaml").write_text('meta:\n  schema_version: "1.0"\nproviders:\n'
                                           '  - identification:\n      uuid: "$COMPUTE_NODE"\n'
                                           '    traits:\n      additional:\n        - "VSTOR_QSD"\n')
    got = ask({"placement": {"provider_dir": str(tmp_path / "p")}})["placement"]
    assert "only custom traits are allowed" in got["provider_error"]
    # Nova's translator makes the class and traits, it does not echo them.
    conf = ('[pci]\nreport_in_placement = True\ndevice_spec = {"address": "0000:5e:00.0", '
            '"resource_class": "vstor nvme", "traits": "fast,HW_CPU_X86_AVX"}\n')
    dev = {"address": "0000:5e:00.0", "vendor_id": "8086", "product_id": "0a54",
           "dev_type": "type-PCI", "numa_node": 1}
    rp, = ask({"conf": conf, "placement": {"devices": [dev]}})["placement"]["pci_providers"].values()
    assert set(rp["inventory"]) == {"CUSTOM_VSTOR_NVME"}
    assert {"CUSTOM_FAST", "HW_CPU_X86_AVX"} <= set(rp["traits"])


def test_nova_makes_a_provider_per_controller_that_its_alias_asks_for(tmp_path, capsys, host_layout,
                                                                     host_model):
    """report_in_placement: Nova's translator makes the providers from the
    device specs; pci_in_placement: each alias asks for a resource class and
    trait that exactly its own controllers' providers have."""
    from vstor.nova import config as nova
    from vstor.planner.ledger import Ledger
    conf, _ = _write(tmp_path, capsys, host_layout("two-socket"))
    assert re.search(r"^report_in_placement = True$", conf, re.M)
    s = nova.setup(host_model("two-socket"), Config(), Ledger())
    devices = [{"address": o.address, "vendor_id": o.vendor_id, "product_id": o.product_id,
                "dev_type": o.device_type, "numa_node": o.node} for o in s.offers]
    aliases = [f"{a['name']}:1" for a in nova.aliases(s)]
    got = ask({"conf": conf, "placement": {"devices": devices, "aliases": aliases}})["placement"]
    rps = got["pci_providers"]
    assert set(rps) == {f"compute-7_{o.address.upper()}" for o in s.offers}
    for alias in aliases:
        (resources, traits), = got["groups"][alias]
        (rc, count), = resources.items()
        served = {name for name, rp in rps.items() if rc in rp["inventory"] and set(traits) <= set(rp["traits"])}
        mine = {f"compute-7_{o.address.upper()}" for o in s.offers if f"{o.alias}:1" == alias}
        assert count == 1 and traits == ["CUSTOM_VSTOR_PASSTHROUGH"] and served == mine, alias
    assert rps["compute-7_0000:61:00.0"]["inventory"] == {
        "CUSTOM_VSTOR_NVME_144D_A824_PF": {"total": 1, "max_unit": 1}}


def test_the_flavor_asks_placement_for_what_the_file_offers(tmp_path, capsys, host_layout):
    root = host_layout("two-socket")
    args = [a for k, v in SPECS.items() for a in ("--disk-spec", f"{k}={v}")]
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", root, "nova", "config",
                          "--flavors", "--flavor", "db.fast", *args)
    assert code == 0, err
    command, = [line for line in out.splitlines() if line.startswith("openstack flavor set db.fast ")]
    props = dict(p.split("=", 1) for p in re.findall(r"--property (\S+)", command))
    assert {k: v for k, v in props.items() if k.startswith("vstor:")} == SPECS
    assert props["resources:CUSTOM_VSTOR_VHOST_QSD"] == "2"
    assert props["trait:CUSTOM_VSTOR_QSD"] == "required"
    conf, folder = _write(tmp_path, capsys, root)
    got = ask({"conf": conf, "extra_specs": props,
               "placement": {"provider_dir": folder, "flavor_specs": props}})
    assert got["extra_specs"] == dict.fromkeys(props)
    asked, node = got["placement"]["unsuffixed"], got["placement"]["compute_node"]
    assert asked["resources"]["CUSTOM_VSTOR_VHOST_QSD"] == 2 <= node["inventory"]["CUSTOM_VSTOR_VHOST_QSD"]["total"]
    assert set(asked["required"]) <= set(node["traits"])
    bad = ask({"extra_specs": {"resources:CUSTOM_VSTOR_VHOST_QSD": "two",
                               "trait:CUSTOM_VSTOR_QSD": "wanted"}})
    assert all(bad["extra_specs"].values())


def test_the_passthrough_flavors_ask_through_the_alias(tmp_path, capsys, host_layout):
    """No resources: property for a passed-through controller: the alias
    already asks Placement for it, and a second ask would take two."""
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("two-socket"),
                          "nova", "config", "--flavors")
    assert code == 0, err
    assert "resources:" not in out
    assert "# vstor-nvme-8086-0a54: 3 controller(s) on node(s) 0,1; Placement: " \
           "CUSTOM_VSTOR_NVME_8086_0A54 through the alias" in out


def test_an_spdk_disk_without_large_pages_could_never_start_in_a_nova_instance(host_model):
    """A flavor's SPDK disk needs the flavor's large pages: without them the
    planner refuses it (and `--flavors` writes hw:mem_page_size for it)."""
    from vstor.nova import disks
    from vstor.planner import Request, plan_domain
    from vstor.planner.ledger import Ledger
    specs = {"vstor:disk.vdb.nvme.controller": "0000:60:00.0", "vstor:disk.vdb.nvme.namespace": "1",
             "vstor:disk.vdb.backend": "spdk", "vstor:disk.vdb.readonly": "yes"}
    req = Request(name="instance-1", safe_name="instance-1", uuid=None, vcpus=2, memory_kib=2097152,
                  machine="q35", intent=disks.intent_of(specs), vhost_memory="platform-hugepages",
                  external_cpus=True)
    with pytest.raises(BadInput, match="an SPDK disk needs the guest's memory in hugepages, and "
                                       "its flavor asks for none"):
        plan_domain(host_model("two-socket"), Config(reactors=(2, 18)), req, Ledger())


@pytest.mark.parametrize("specs, message", [
    ({"vstor:disk.vdc.nvme.controller": "0000:5e:00.0", "vstor:disk.vdc.readonly": "yes"},
     "disk vdc has backend='auto': each host's [vhost] default_backend would choose"),
    ({"vstor:disk.vdc.nvmf.subnqn": "nqn.2014-08.org.example:a", "vstor:disk.vdc.nvmf.traddr": "10.0.0.1",
      "vstor:disk.vdc.nvmf.transport": "tcp", "vstor:disk.vdc.readonly": "yes",
      "hw:mem_page_size": "small"},
     "disk vdc is an SPDK disk; an SPDK disk needs the guest's memory in hugepages"),
    ({"vstor:disk.vdc.nvme.controller": "0000:5e:00.0", "vstor:disk.vdc.mode": "passthrough",
      "vstor:disk.vdc.readonly": "yes"},
     "asks for passthrough"),
    ({"vstor:disk.vdb.file.path": "/var/lib/vstor/images/db.raw"}, "is writable and names no project"),
])
def test_flavor_disks_the_scheduler_cannot_count_are_refused(specs, message):
    from vstor.nova import placement
    with pytest.raises(BadInput, match=re.escape(message)):
        placement.disk_flavor_specs(specs, "db.fast")


@pytest.mark.parametrize("args, message", [
    (["--provider-config", "{d}/vstor.yml"], "nova-compute loads only *.yaml files"),
    (["--provider-config", "vstor.yaml"], "is not an absolute path"),
    (["--provider-config", "{d}/missing/vstor.yaml"], "is not a directory this user can write"),
    (["--provider-config", "{d}/nova.conf.yaml", "-o", "{d}/nova.conf.yaml"], "name the same file"),
    (["--provider-config", "{d}/vstor.yaml", "-o", "{d}/missing/nova.conf"], "is not a directory"),
    (["--provider-config", "{d}/dir.yaml"], "it is a directory"),
    (["--provider-config", "{d}/vstor.yaml", "--vhost-disks", "0"], "--vhost-disks 0 is not a count"),
    (["-o", "{d}/nova.conf", "--vhost-disks", "8"], "--vhost-disks is a count in the provider config file"),
    (["--flavors", "--disk-spec", "vstor:disk.vdb.readonly=yes"], "--disk-spec describes a flavor's disks"),
    (["--flavors", "--flavor", "f", "--disk-spec", "hw:cpu_policy=dedicated"], "is not vstor:disk."),
    (["--flavors", "--flavor", "f", "--disk-spec", "vstor:disk.vdb.readonly=yes",
      "--disk-spec", "vstor:disk.vdb.readonly=no"], "is given twice"),
])
def test_refusals_write_nothing(tmp_path, capsys, host_layout, args, message):
    d = tmp_path / "out"
    d.mkdir()
    (d / "dir.yaml").mkdir()
    (d / "nova.conf").write_text("# the operator's\n")
    before = sorted(os.listdir(d))
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("two-socket"),
                          "nova", "config", *[a.format(d=d) for a in args])
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(os.listdir(d)) == before and (d / "nova.conf").read_text() == "# the operator's\n"


def test_the_pure_view_refuses_an_empty_inventory(host_model):
    from vstor.nova import placement
    with pytest.raises(VstorError, match="1 or more"):
        placement.view(host_model("two-socket"), Config(), 1, qsd_installed=True, vhost_disks=0)


def test_an_sriov_host_starts_nova_compute_and_each_alias_gets_whole_controllers(
        tmp_path, capsys, host_layout, host_model):
    """Node 1's PF has 2 VFs enabled.  Nova's PCI tracker holds every NVMe
    function as the kernel shows it (the PF type-PF, its VFs type-VF with
    the PF as parent); a device_spec matching a PF and one of its VFs makes
    Nova's placement translator raise, which stops nova-compute.  vstor
    offers neither: the PF with enabled VFs nor any VF; node 0's PF (no VFs)
    and the Intel controller are offered, and the flavor comments count
    exactly those."""
    from vstor.nova import config as nova
    from vstor.planner.ledger import Ledger
    host = host_model("sriov")
    pf = next(c for c in host.controllers if c.address == "0000:61:00.0")
    assert pf.virtfns == ("0000:61:00.1", "0000:61:00.2")
    assert {c.physfn for c in host.controllers if c.physfn} == {"0000:61:00.0"}
    conf, _ = _write(tmp_path, capsys, host_layout("sriov"))
    s = nova.setup(host, Config(), Ledger())
    assert {o.address for o in s.offers} == {"0000:3b:00.0", "0000:5e:00.0"}
    excluded = dict(s.excluded)
    assert "2 SR-IOV virtual functions enabled" in excluded["0000:61:00.0"]
    assert all(excluded[f"0000:61:00.{k}"].startswith("an SR-IOV virtual function of 0000:61:00.0")
               for k in (1, 2))
    devices = [{"address": c.address, "vendor_id": nova._id(c.vendor), "product_id": nova._id(c.device),
                "dev_type": "type-VF" if c.physfn else "type-PF" if c.sriov_vfs else "type-PCI",
                "numa_node": c.numa_node, "parent_addr": c.physfn} for c in host.controllers]
    aliases = [f"{a['name']}:1" for a in nova.aliases(s)]
    got = ask({"conf": conf, "placement": {"devices": devices, "aliases": aliases}})["placement"]
    assert "pci_error" not in got, got["pci_error"]
    assert set(got["pci_providers"]) == {"compute-7_0000:3B:00.0", "compute-7_0000:5E:00.0"}
    # What vstor offered before: every NVMe function, the VFs as type-PCI.
    before = conf.replace("\n[compute]", "".join(
        f'device_spec = {{"address": "{a}", "live_migratable": "no"}}\n'
        for a in ("0000:61:00.0", "0000:61:00.1")) + "\n[compute]", 1)
    bad = ask({"conf": before, "placement": {"devices": devices}})["placement"]
    assert "PlacementPciDependentDeviceException" in bad["pci_error"]
    comments = [line for line in nova.flavor_commands(s, None) if line.startswith("# ")]
    assert sorted(int(line.split(": ")[1].split()[0]) for line in comments) == [1, 1]


def test_doctor_catches_vfs_enabled_after_nova_config_ran(tmp_path, capsys):
    """The fragment was written while 0000:61:00.0 had no VFs; they are
    enabled now: doctor fails it, naming the file and the fix.  Written
    again by `vstor nova config`, it passes."""
    from tests.hostlayout.build import build_tree
    root = build_tree(os.path.join(os.path.dirname(__file__), "hosts", "sriov.toml"), tmp_path / "host")
    frag = tmp_path / "host" / "etc" / "nova" / "nova.conf.d" / "vstor-pci.conf"
    frag.parent.mkdir(parents=True)
    frag.write_text("# Written by `vstor nova config` from compute-sriov (earlier)\n[pci]\n"
                    'device_spec = {"address": "0000:5e:00.0", "live_migratable": "no"}\n'
                    'device_spec = {"address": "0000:61:00.0", "live_migratable": "no"}\n')
    cfg = conf_file(tmp_path)
    _, out, _ = run_cli(capsys, "--config", cfg, "--host-root", root, "doctor")
    line, = [ln for ln in out.splitlines() if "nova offers" in ln]
    assert line.startswith("FAIL") and "offers 0000:61:00.0, which now has 2 SR-IOV virtual functions" in line
    assert f"vstor nova config -o {frag}" in line
    code, _, err = run_cli(capsys, "--config", cfg, "--host-root", root, "nova", "config", "-o", str(frag))
    assert code == 0, err
    _, out, _ = run_cli(capsys, "--config", cfg, "--host-root", root, "doctor")
    line, = [ln for ln in out.splitlines() if "nova offers" in ln]
    assert line.startswith("OK"), line


# -- Nova's PCI tracker and its PciDeviceStats on every host layout ------------------------------------

LAYOUTS = sorted(name[:-5] for name in os.listdir(os.path.join(os.path.dirname(__file__), "hosts"))
                 if name.endswith(".toml"))
# Controllers the firmware puts on no node (numa_node -1): on a host without
# NUMA (libvirt's one cell), and on a two-node host beside one on node 1.
NO_NODE = {
    "flat": {"hostname": "flat", "numa": False, "node": [{"cores": 4, "memory": "16GiB"}],
             "nvme": [{"address": "0000:03:00.0"}]},
    "no-node": {"hostname": "no-node", "node": [{"cores": 4, "memory": "16GiB"}] + [{"cores": 4}],
                "nvme": [{"address": "0000:03:00.0", "node": -1}, {"address": "0000:04:00.0", "node": -1},
                         {"address": "0000:81:00.0", "node": 1}]},
}
COMMENT = re.compile(r"# (\S+): (\d+) controller\(s\)(?: on node\(s\) ([\d,]+))?; Placement: ")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _pci_address(address: str) -> str:
    dom, bus, rest = address.split(":")
    slot, fn = rest.split(".")
    return f"<address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' function='0x{fn}'/>"


def _nodedevs(root: str) -> list[str]:
    """Every PCI function of the layout's sysfs as libvirt's node device
    driver shows it (node_device_conf.c): virt_functions when sriov_totalvfs
    or the enabled VFs are above 0 (so an SR-IOV capable function without
    VFs is a PF too), phys_function for a VF, numa only for a node >= 0."""
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    out = []
    for address in sorted(os.listdir(devices)):
        dev = os.path.join(devices, address)
        dom, bus, rest = address.split(":")
        slot, fn = rest.split(".")
        caps = [f"<domain>{int(dom, 16)}</domain>", f"<bus>{int(bus, 16)}</bus>",
                f"<slot>{int(slot, 16)}</slot>", f"<function>{int(fn, 16)}</function>",
                f"<product id='{_read(dev + '/device')}'/>", f"<vendor id='{_read(dev + '/vendor')}'/>"]
        if os.path.islink(dev + "/physfn"):
            caps.append(f"<capability type='phys_function'>"
                        f"{_pci_address(os.path.basename(os.readlink(dev + '/physfn')))}</capability>")
        vfs = sorted(os.path.basename(os.readlink(os.path.join(dev, n))) for n in os.listdir(dev)
                     if n.startswith("virtfn"))
        total = int(_read(dev + "/sriov_totalvfs")) if os.path.exists(dev + "/sriov_totalvfs") else 0
        if total or vfs:
            caps.append(f"<capability type='virt_functions' maxCount='{total}'>"
                        + "".join(map(_pci_address, vfs)) + "</capability>")
        node = int(_read(dev + "/numa_node"))
        if node >= 0:
            caps.append(f"<numa node='{node}'/>")
        out.append(f"<device><name>pci_{address.replace(':', '_').replace('.', '_')}</name>"
                   f"<capability type='pci'>{''.join(caps)}</capability></device>")
    return out


def _host_cells(root: str) -> list[int]:
    """The host NUMA cells Nova's libvirt driver reports: one per node, and
    libvirt's one fake cell 0 on a host without NUMA."""
    nodes = os.path.join(root, "sys", "devices", "system", "node")
    found = sorted(int(n[4:]) for n in os.listdir(nodes) if re.fullmatch(r"node\d+", n)) \
        if os.path.isdir(nodes) else []
    return found or [0]


def _with_vfs(root: str) -> set[str]:
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    return {a for a in os.listdir(devices)
            if any(n.startswith("virtfn") for n in os.listdir(os.path.join(devices, a)))}


@pytest.mark.parametrize("layout", LAYOUTS + ["flat", "no-node"])
def test_nova_serves_each_alias_exactly_where_its_flavor_comment_says(tmp_path, capsys, host_layout, layout):
    """Nova's own compute and scheduler code on every host layout: its
    libvirt driver reports every PCI function (VFs as type-VF with their
    PF, SR-IOV capable functions as type-PF); its PCI tracker takes what
    the written [pci] device_spec matches, and the resource tracker's
    Placement update makes a provider of each; for each flavor
    `--flavors` prints, PciDeviceStats serves the alias's request exactly
    as many times as the flavor comment says, on exactly its nodes (every
    node for a controller on none), and refuses one more; Placement's
    candidates for the alias are exactly the controllers the PCI filters
    and the claim serve; no VF and no PF with VFs is ever handed out."""
    root = build_tree(NO_NODE[layout], tmp_path / "root") if layout in NO_NODE else host_layout(layout)
    conf, _ = _write(tmp_path, capsys, root)
    if layout == "no-node":
        # Nova's pools match an alias by model alone: the no-node alias would
        # take node 1's controller, so vstor offers only that one, and says why.
        assert re.findall(r'^device_spec = \{"address": "([^"]+)"', conf, re.M) == ["0000:81:00.0"]
        assert conf.count("on no NUMA node, beside controllers of its model on nodes") == 2
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", root, "nova", "config",
                             "--flavors")
    offered = re.findall(r'^device_spec = \{"address": "([^"]+)"', conf, re.M)
    lines = out.splitlines()
    comments = [COMMENT.match(line) for line in lines if line.startswith("# ")]
    flavors = {}
    for line in lines:
        if line.startswith("openstack flavor set "):
            words = shlex.split(line)
            flavors[words[3]] = dict(w.split("=", 1) for w in words[5::2])
    assert len(comments) == len(flavors) and all(comments), out
    if not offered:
        assert code == 2 and not flavors and "no NVMe controller here can be offered" in err
    else:
        assert code == 0, err
    cells = _host_cells(root)
    got = ask({"conf": conf, "pci": {"nodedevs": _nodedevs(root), "cells": cells,
                                     "flavors": flavors}})["pci"]
    assert "pci_error" not in got, got["pci_error"]
    reported = got["reported"]
    vfs = {a for a, d in reported.items() if d["dev_type"] == "type-VF"}
    never = vfs | _with_vfs(root)
    assert got["tracked"] == sorted(offered)
    assert not never & set(offered), f"offered a VF or a PF with VFs: {sorted(never & set(offered))}"
    assert sorted(a for a, _, _ in got["providers"].values()) == sorted(offered)
    handed_out = set()
    for m in comments:
        alias, count, nodes = m.group(1), int(m.group(2)), m.group(3)
        asked = got["flavors"][alias]        # the flavor is named after its alias
        (n, _, policy), = asked["requests"]
        assert n == 1 and asked["numa_cells"] == 1, asked
        claimed = {int(c): [a for devs in got_c for a in devs] for c, got_c in asked["claimed"].items()}
        served = {int(c): k for c, k in asked["served"].items()}
        assert all(len(claimed[c]) == served[c] for c in cells), (alias, served, claimed)
        if nodes is not None:
            assert policy == "required"
            assert {c for c in cells if served[c]} == set(map(int, nodes.split(","))), (alias, served)
            assert sum(served.values()) == count, (alias, served)
            assert all(reported[a]["numa_node"] == c for c in cells for a in claimed[c]), (alias, claimed)
        else:      # a controller on no node: any cell may have it
            assert policy == "legacy" and all(served[c] == count for c in cells), (alias, served)
        assert asked["anywhere"] == count, alias
        host = [a for c in cells for devs in asked["host"]["claimed"][str(c)] for a in devs]
        assert len(host) == len(set(host)) == count and asked["host"]["one_more"] == [False] * len(cells)
        assert not set(host) & never and not set(host) & handed_out, (alias, host)
        handed_out |= set(host)
        for c in cells:
            placed = asked["placed"].get(str(c), {})
            assert set(placed) == set(host), (alias, c, placed)
            assert {a for a, (scheduler, _) in placed.items() if scheduler} == set(claimed[c]) == \
                   {a for a, (_, claim) in placed.items() if claim}, (alias, c, placed)
    assert handed_out == set(offered)
