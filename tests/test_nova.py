"""vstor nova config, judged by Nova's own code (nova 34.0.0 from PyPI, run
by tests/nova/oracle.py): nova.conf read by oslo.config as nova-compute
reads it, the device specs by Nova's PCI whitelist, the aliases by its
alias parser, the CPU sets by nova.virt.hardware, the flavor extra specs
by Nova's extra-spec validators."""

import json
import re

import pytest

from tests.helpers import conf_file, run_cli
from tests.nova import ask


@pytest.mark.parametrize("layout, offered, refused", [
    ("two-socket", {"0000:3b:00.0", "0000:5e:00.0", "0000:5f:00.0", "0000:60:00.0", "0000:61:00.0"}, {}),
    ("nvme-root", {"0000:02:00.0"}, {"0000:01:00.0": "holds the host's root filesystem"}),
    ("no-iommu", set(), None),
])
def test_nova_reads_the_config_as_vstor_meant_it(tmp_path, capsys, host_layout, layout, offered, refused):
    cfg = conf_file(tmp_path, "[cpu]\nreactors = 2\n[pci]\nblocked = 0000:5f:00.0\n"
                if layout == "two-socket" else "")
    code, text, err = run_cli(capsys, "--config", cfg, "--host-root", host_layout(layout), "nova", "config")
    assert code == 0, err
    if layout == "two-socket":
        offered = offered - {"0000:5f:00.0"}
        refused = {"0000:5f:00.0": "PCI_BLOCKED"}
    got = ask({"conf": text})
    addresses = {"{domain}:{bus}:{slot}.{func}".format(**eval(s["address"])) for s in got["whitelist"]}
    assert addresses == offered
    assert all(s["live_migratable"] == "false" for s in got["whitelist"])
    for address, why in (refused or {}).items():
        assert re.search(rf"# not offered: {re.escape(address)}: .*{why}", text)
    for name, (policy, specs) in got["aliases"].items():
        assert policy == "required" and len(specs) == 1
        assert specs[0]["dev_type"] == ("type-PF" if name.endswith("-pf") else "type-PCI")
    if layout == "two-socket":
        assert set(got["aliases"]) == {"vstor-nvme-8086-0a54", "vstor-nvme-144d-a824",
                                       "vstor-nvme-144d-a824-pf"}      # 61:00.0 is SR-IOV capable
        assert 2 not in got["dedicated"] and 2 not in got["shared"]        # the SPDK reactor
        assert set(got["dedicated"]) | set(got["shared"]) | {2} == set(range(64))
        assert got["shared"] == [0, 16, 32, 48]                            # housekeeping: core 0 of each node
    if layout == "no-iommu":
        assert "IOMMU is off" in text and got["aliases"] == {}


def test_the_flavor_extra_specs_pass_novas_validators(tmp_path, capsys, host_layout):
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("two-socket"),
                          "nova", "config", "--flavors", "--flavor", "nvme.large", "--page-size", "1G")
    assert code == 0, err
    commands = [line for line in out.splitlines() if line.startswith("openstack flavor set nvme.large ")]
    assert len(commands) == 3
    specs = dict(p.split("=", 1) for p in re.findall(r"--property (\S+)", commands[0]))
    assert specs["hw:mem_page_size"] == "1GB" and specs["hw:cpu_policy"] == "dedicated"
    got = ask({"extra_specs": specs})
    assert got["extra_specs"] == {k: None for k in specs}
    # The oracle is no rubber stamp: Nova refuses what is wrong.
    bad = ask({"extra_specs": {"hw:cpu_policy": "pinned", "hw:pci_numa_affinity_policy": "near"}})
    assert all(bad["extra_specs"].values())


def test_the_generated_specs_and_aliases_parse_one_by_one(tmp_path, host_layout):
    from vstor.config import Config
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    from vstor.nova import config as nova
    from vstor.planner.ledger import Ledger
    s = nova.setup(read_host(SysFS(host_layout("two-socket"))), Config(), Ledger())
    got = ask({"device_specs": nova.device_specs(s), "aliases": [json.dumps(a) for a in nova.aliases(s)]})
    assert got["device_specs"] == [None] * 5 and got["alias_error"] is None
    bad = ask({"device_specs": [{"address": "0000:zz:00.0"}],
               "aliases": [json.dumps({"name": "x", "numa_policy": "near"})]})
    assert bad["device_specs"][0] and bad["alias_error"]


def test_a_controller_vstor_passes_through_is_not_offered(tmp_path, capsys, host_layout):
    from vstor.config import Config
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    from vstor.nova import config as nova
    from vstor.planner.ledger import Holding, Ledger
    held = Holding("db1", None, False, 1, frozenset(), (), (), (),
                   frozenset({"0000:5e:00.0"}), frozenset(), frozenset(), frozenset())
    s = nova.setup(read_host(SysFS(host_layout("two-socket"))), Config(), Ledger([held]))
    assert "0000:5e:00.0" not in {o.address for o in s.offers}
    assert dict(s.excluded)["0000:5e:00.0"].endswith("vstor passes it through to domain 'db1'")


def test_bad_flavor_names_and_no_offers_are_refused(tmp_path, capsys, host_layout):
    code, _, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("two-socket"),
                        "nova", "config", "--flavors", "--flavor", "x; rm -rf /")
    assert code == 2 and "is not a flavor name" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("no-iommu"),
                        "nova", "config", "--flavors")
    assert code == 2 and "no NVMe controller here can be offered" in err
    out = tmp_path / "nova-pci.conf"
    code, _, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", host_layout("two-socket"),
                        "nova", "config", "-o", str(out))
    assert code == 0 and out.read_text().startswith("# Written by `vstor nova config`")


def test_a_controller_on_no_node_gets_a_legacy_alias(tmp_path, capsys):
    """Nova's `required` policy never matches a device whose NUMA node is
    unknown (numa_node -1, common on one-socket hosts): such a controller is
    offered under an alias of its own, with the legacy policy."""
    from tests.hostlayout import build_tree
    layout = tmp_path / "flat.toml"
    layout.write_text('hostname = "flat"\nnuma = false\n[[node]]\ncores = 4\nmemory = "16GiB"\n'
                      '[[nvme]]\naddress = "0000:03:00.0"\n')
    root = build_tree(str(layout), str(tmp_path / "root"))
    code, text, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", root, "nova", "config")
    assert code == 0, err
    got = ask({"conf": text})
    (name, (policy, _)), = got["aliases"].items()
    assert name.endswith("-anynode") and policy == "legacy"
    code, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "--host-root", root,
                          "nova", "config", "--flavors")
    specs = dict(p.split("=", 1) for p in re.findall(r"--property (\S+)", out))
    assert specs["hw:pci_numa_affinity_policy"] == "legacy" and "vstor:numa" not in specs
    assert ask({"extra_specs": specs})["extra_specs"] == dict.fromkeys(specs)


@pytest.mark.parametrize("args, code, message", [
    (["prepare", "instance-1;reboot", "--to", "compute-8"], 2, "is not a Nova instance's domain name"),
    (["prepare", "instance-1", "--to", "a b"], 2, "'a b' is not a host name"),
    (["prepare", "instance-1"], 2, "prepare needs the destination"),
    (["abort", "instance-1", "--config", "/tmp/x.conf"], 2, "unrecognized arguments: --config"),
    # libvirt's test driver: a domain that is not a Nova instance with vstor disks
    (["prepare", "test", "--to", "compute-8"], 2, "is not a Nova instance with vstor disks"),
    (["abort", "instance-1"], 0, "no vstor migration of instance-1 is recorded here"),
])
def test_vstor_nova_migrate_takes_only_nova_instances_and_host_names(tmp_path, capsys, args, code, message):
    """What sudo lets nova-compute run as root: checked before anything is read."""
    try:
        got, out, err = run_cli(capsys, "--config", conf_file(tmp_path), "-c", "test:///default", "nova", "migrate", *args)
    except SystemExit as e:     # argparse's own refusal
        got, out, err = e.code, *capsys.readouterr()
    assert got == code and message in (err if code else out), (out, err)
    assert err.count("\n") == (1 if code else 0)


def test_nothing_read_from_the_host_becomes_a_line_of_nova_conf_or_a_shell_word():
    """A host name, a refusal (a domain's name) or a PCI id with a newline
    or shell syntax in it: oslo.config, as nova-compute reads the file,
    sees only vstor's lines, and the shell (shlex) only vstor's words."""
    import shlex
    from vstor.errors import BadInput
    from vstor.nova import config as nova
    evil = '\n[pci]\ndevice_spec = {"address": "0000:99:00.0"}\n'
    offer = nova.Offer("0000:5e:00.0", "8086", "0a54", 0, "type-PCI", "m")
    s = nova.NovaSetup((offer,), (("0000:5f:00.0", f"vstor passes it through to domain 'x{evil}'"),),
                       (1, 2), (0,), ())
    text = nova.nova_conf(s, f"host{evil}")
    got = ask({"conf": text})
    addresses = {"{domain}:{bus}:{slot}.{func}".format(**eval(sp["address"])) for sp in got["whitelist"]}
    assert addresses == {"0000:5e:00.0"}
    assert [line for line in text.splitlines() if line.startswith("[")] == ["[pci]", "[compute]"]
    with pytest.raises(BadInput, match="control character"):
        nova.nova_conf(s, "host", "/etc/nova/provider\n[DEFAULT]")
    # The shell's words, whatever a capture's ids say (Nova refuses such ids
    # in device_spec, so they never reach a real nova.conf).
    offer = nova.Offer("0000:5e:00.0", "8086;rm -rf /", "0a54 $(id)", 0, "type-PCI", "m")
    s = nova.NovaSetup((offer,), (), (1, 2), (0,), ())
    for line in nova.flavor_commands(s, None):
        if line.startswith("openstack"):
            words = shlex.split(line)
            assert words[:3] == ["openstack", "flavor", "set"] and words[3] == offer.alias
            assert f"pci_passthrough:alias={offer.alias}:1" in words
            assert all(w == "--property" or "=" in w for w in words[4:])
        else:
            assert line.startswith("# ") and "\n" not in line
