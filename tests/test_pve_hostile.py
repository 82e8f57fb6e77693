"""The Proxmox part of the hostile suite: whoever has VM.Config rights on a
VM may write any `hostpciN` line, in any form qemu-server reads.  None of
them may hand a controller vstor holds (passed through to a vstor VM, or
served by a qsd or SPDK) to a second VM: refused by `vstor pve apply` and at
the hookscript's pre-start, for VMs with and without a vstor intent, with
one line and nothing changed.  Proxmox's own qemu-server (tests/pve/oracle.py)
shows each form really passes the controller, so none is a straw man.

Also here: plans Proxmox could not start (hugepages on a host node >= 10),
and a `vstor pve apply` killed between its plan record and the config."""

import os

import pytest
from lxml import etree

from tests.hostlayout import build_tree
from tests.pve.oracle import agrees_with_plan, showcmd, vfio_hosts
from tests.helpers import PCI, Pve, judge
from vstor.config import Config
from vstor.formats.pve.config import PveConfig
from vstor.pve.node import Node

try:                # the hookscript's QEMU, as at a start
    QEMU = ".".join(map(str, Node(Config()).qemu_version()))
except Exception:   # no QEMU here: the hook's own checks say so
    QEMU = "9.2"

PASSED, SERVED = "0000:5e:00.0", "0000:5f:00.0"
BASE = "machine: q35\ncores: 2\nmemory: 2048\nname: t\nhookscript: local:snippets/vstor\n"
FORMS = ["pcie=1,host={full}", "rombar=0,host={short}", "pcie=1,host={slot}", "x-vga=1,host={full}",
         "host=3b:00.0;{short},pcie=1", "{slot},pcie=yes", "mapping=stolen,pcie=1"]


def _line(form: str, ctrl: str) -> str:
    return form.format(full=ctrl, short=ctrl[5:], slot=ctrl[5:-2])


@pytest.fixture
def node(tmp_path, host_layout):
    """VM 100 holds 5e:00.0 (passed through) and 5f:00.0 (served by a qsd);
    the cluster's mapping 'stolen' names, for this node, the controller a
    test puts in STOLEN."""
    p = Pve(tmp_path, host_layout("two-socket"))
    p.vm(BASE)
    p.intent(f"<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='{PASSED}'/></vstor:disk>"
             f"<vstor:disk target='vdc'><vstor:nvme controller='{SERVED}'/></vstor:disk>", vm="<vstor:vm/>")
    assert p.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    judge(p, p.config(), 2048, qemu=QEMU)
    assert p.vstor("pve", "hooks", "install") == 0
    os.makedirs(f"{p.etc}/mapping")
    return p


def _map(p, ctrl: str) -> None:
    with open(f"{p.etc}/mapping/pci.cfg", "w") as f:
        f.write(f"stolen\n\tmap node={os.uname().nodename.split('.')[0]},path={ctrl},id=144d:a80a\n")


def _refused(done_code: int, err: str, ctrl: str, key: str) -> None:
    assert done_code == 2, err
    assert f"{key} passes {ctrl} through" in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("ctrl", [PASSED, SERVED])
@pytest.mark.parametrize("form", FORMS)
def test_no_hostpci_form_hands_a_held_controller_to_a_vm_without_an_intent(node, form, ctrl, capsys):
    line = _line(form, ctrl)
    _map(node, ctrl)
    text = BASE + f"hostpci0: {line}\n"
    if "mapping=" not in line:        # the oracle has no cluster filesystem to hold a mapping
        assert ctrl in vfio_hosts(showcmd(text, PCI, vmid=101))
    node.vm(text, 101)
    done = node.hook(101, "pre-start")
    _refused(done.returncode, done.stderr, ctrl, "hostpci0")
    assert "which vstor holds for a VM" in done.stderr
    assert not os.path.exists(f"{node.root}/state/pve-101.json")
    if form == FORMS[0]:          # the CLI's check of the node says it too
        assert node.vstor("pve", "doctor") == 3
        assert f"PROBLEM: VM 101 has no vstor intent but its hostpci0 passes {ctrl}" in capsys.readouterr().out


@pytest.mark.parametrize("ctrl", [PASSED, SERVED])
@pytest.mark.parametrize("form", FORMS)
def test_no_hostpci_form_added_to_a_vstor_vm_passes_its_start_or_apply(node, form, ctrl, capsys):
    _map(node, ctrl)
    text = node.config() + f"hostpci5: {_line(form, ctrl)}\n"
    node.vm(text)
    done = node.hook(100, "pre-start")
    assert done.returncode == 2 and "does not carry its vstor plan" in done.stderr, done.stderr
    assert f"hostpci5 passes {ctrl} through" in done.stderr
    capsys.readouterr()
    assert node.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 2
    _refused(2, capsys.readouterr().err, ctrl, "hostpci5")
    assert node.config() == text


@pytest.mark.parametrize("ctrl", [PASSED, SERVED])
@pytest.mark.parametrize("form", FORMS)
def test_no_hostpci_form_hands_another_vstor_vms_controller_over(node, form, ctrl, capsys):
    _map(node, ctrl)
    node.vm(BASE + f"hostpci0: {_line(form, ctrl)}\n", 102)
    node.intent(node.file_disk("d102.raw").replace("d0.raw", "d102.raw"), 102)
    before = node.config(102)
    assert node.vstor("pve", "apply", "102", "--qemu-version", "9.2") == 2
    err = capsys.readouterr().err
    _refused(2, err, ctrl, "hostpci0")
    assert "which vstor holds for another VM" in err and node.config(102) == before


@pytest.mark.parametrize("mapping, why", [
    ("", "is not in /etc/pve/mapping/pci.cfg"),
    ("stolen\n\tmap node=elsewhere,path=0000:5e:00.0,id=144d:a80a\n", "names no device on node"),
    ("stolen\n\tmap node=x,path=5e:00.0\n", "has an entry vstor cannot read"),
])
def test_a_mapping_that_cannot_be_resolved_is_refused_at_pre_start(node, mapping, why):
    with open(f"{node.etc}/mapping/pci.cfg", "w") as f:
        f.write(mapping)
    node.vm(BASE + "hostpci0: mapping=stolen\n", 101)
    done = node.hook(101, "pre-start")
    assert done.returncode == 2 and why in done.stderr and "mapping=stolen" in done.stderr, done.stderr


def test_a_clone_that_keeps_only_its_own_devices_starts(node):
    node.vm(BASE + "hostpci0: 0000:3b:00.0,pcie=1\nhostpci1: 60:00\n", 101)
    done = node.hook(101, "pre-start")
    assert done.returncode == 0 and done.stderr == ""


# -- plans Proxmox can start, or refused with the reason ----------------------------------

MANY_NODES = "hostname = \"big\"\nsmt = 2\n" + "".join(
    "[[node]]\ncores = 2\nmemory = \"16GiB\"\nhugepages = { \"2M\" = 2048 }\n" for _ in range(12)) + (
    "[[nvme]]\naddress = \"0000:5e:00.0\"\nnode = 11\nmodel = \"M\"\nserial = \"S1\"\n"
    "namespace = [{ size = \"1TB\" }]\n")


@pytest.fixture
def big(tmp_path):
    (tmp_path / "big.toml").write_text(MANY_NODES)
    root = build_tree(str(tmp_path / "big.toml"), str(tmp_path / "host"))
    p = Pve(tmp_path / "pve", root)
    p.write_config("")
    with open(p.conf) as f:
        text = f.read().replace("reactors = 2,18", "reactors = 45")
    with open(p.conf, "w") as f:
        f.write(text)
    return p


def test_hugepages_on_a_host_node_proxmox_cannot_bind_are_refused_at_plan_time(big, capsys):
    """qemu-server's hugepages_topology takes host nodes 0-9 only."""
    big.vm("cores: 2\nmemory: 1024\n")
    big.intent("<vstor:disk target='vdb'><vstor:nvme controller='0000:5e:00.0'/></vstor:disk>", vm="<vstor:vm/>")
    before = big.config()
    assert big.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 3
    err = capsys.readouterr().err
    assert "hugepages only on host nodes 0-9" in err and err.count("\n") == 1, err
    assert big.config() == before
    # What vstor wrote before would have been refused by Proxmox's start:
    stale = "cores: 2\nmemory: 1024\nnuma: 1\nhugepages: 2\nnuma0: cpus=0-1,hostnodes=11,memory=1024,policy=bind\n"
    assert showcmd(stale).code == 4


def test_a_preferred_vm_lands_where_proxmox_can_bind_its_hugepages(big):
    big.vm("cores: 2\nmemory: 1024\n")
    big.intent("<vstor:disk target='vdb'><vstor:nvme controller='0000:5e:00.0'/></vstor:disk>",
               vm="<vstor:vm numa='preferred'/>")
    assert big.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    plan = etree.parse(f"{big.snippets}/vstor-100.plan.xml").getroot()
    assert int(plan.get("node")) < 10
    agrees_with_plan(showcmd(big.config()), plan, 1024)


# -- a `pve apply` killed between the plan record and the config ------------------------------

def test_an_apply_killed_before_its_config_leaves_no_line_unknown(node, monkeypatch, capsys):
    from vstor.pve.node import Node
    old = node.config()
    node.intent(node.file_disk(), vm="<vstor:vm/>")        # 5e:00.0 and 5f:00.0 no longer vstor's

    def killed(self, path, text):
        raise SystemExit(9)
    with monkeypatch.context() as m:
        m.setattr(Node, "write_config", killed)
        with pytest.raises(SystemExit):
            node.vstor("pve", "apply", "100", "--qemu-version", QEMU)
    assert node.config() == old and os.path.exists(f"{node.snippets}/vstor-100.plan.prev.xml")
    # Until the config is written, the old plan's controller is still vstor's:
    node.vm(BASE + "hostpci0: 5e:00,pcie=1\n", 101)
    done = node.hook(101, "pre-start")
    assert done.returncode == 2 and f"passes {PASSED} through" in done.stderr, done.stderr
    done = node.hook(100, "pre-start")
    assert done.returncode == 2 and "vstor pve apply 100" in done.stderr, done.stderr
    # The next apply knows the old lines as vstor's and replaces them.
    capsys.readouterr()
    assert node.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0, capsys.readouterr().err
    conf = PveConfig.parse(node.config())
    assert not [k for k in conf.keys() if k.startswith("hostpci")]
    assert not os.path.exists(f"{node.snippets}/vstor-100.plan.prev.xml")
    judge(node, node.config(), 2048, qemu=QEMU)


def test_a_plan_recorded_on_node_11_before_is_refused_at_pre_start(big, monkeypatch, capsys):
    """A plan an earlier vstor recorded there (hugepages on node 11): Proxmox's
    start would die in hugepages_topology; pre-start says why first."""
    import vstor.pve.request
    import vstor.render.pve
    big.vm("cores: 2\nmemory: 1024\nhookscript: local:snippets/vstor\n")
    big.intent("<vstor:disk target='vdb'><vstor:nvme controller='0000:5e:00.0'/></vstor:disk>", vm="<vstor:vm/>")
    with monkeypatch.context() as m:            # the planner and renderer before the fix
        m.setattr(vstor.pve.request, "HUGEPAGE_NODES", None)
        m.setattr(vstor.render.pve, "HUGEPAGE_NODES", 1 << 20)
        assert big.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0, capsys.readouterr().err
    assert "hostnodes=11" in big.config() and showcmd(big.config(), qemu=QEMU).code == 4
    done = big.hook(100, "pre-start")
    assert done.returncode == 2 and "hugepages on host node 11, which Proxmox cannot bind" in done.stderr
    assert "vstor pve apply 100" in done.stderr and done.stderr.count("\n") == 1


def test_while_a_config_write_is_pending_no_other_plan_takes_the_old_controller(node, monkeypatch, capsys):
    from vstor.pve.node import Node
    node.intent(node.file_disk(), vm="<vstor:vm/>")

    def killed(self, path, text):
        raise SystemExit(9)
    with monkeypatch.context() as m:
        m.setattr(Node, "write_config", killed)
        with pytest.raises(SystemExit):
            node.vstor("pve", "apply", "100", "--qemu-version", QEMU)
    node.vm(BASE, 102)
    node.intent(f"<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='{PASSED}'/></vstor:disk>",
                102, vm="<vstor:vm/>")
    capsys.readouterr()
    assert node.vstor("pve", "apply", "102", "--qemu-version", QEMU) == 3
    err = capsys.readouterr().err
    assert PASSED in err and "pve-100" in err, err


# -- issue 28: a memory vstor cannot read -------------------------------------------------
#
# A user with VM.Config.Memory writes `memory:`.  qemu-server's grammar has no
# maximum, and 4,400 digits passed it into an integer parse that Python
# refuses past 4,300 digits (an internal error at plan, apply and pre-start);
# Proxmox reads the config's bytes, so fullwidth digits are not a number to
# it, and were 4096 MiB to vstor.

@pytest.mark.parametrize("memory, words", [
    ("9" * 4400, "is more than the 1099511627776 MiB (1 EiB) vstor plans"),
    ("1099511627777", "is more than the 1099511627776 MiB (1 EiB) vstor plans"),
    ("４０９６", "is not as Proxmox reads it (current: type check ('integer') failed"),
], ids=["4400-digits", "over-1-EiB", "fullwidth"])
def test_a_memory_vstor_cannot_read_is_one_refusal_at_plan_apply_and_pre_start(tmp_path, host_layout, capsys,
                                                                               memory, words):
    p = Pve(tmp_path, host_layout("two-socket"))
    p.vm(BASE)
    p.intent(p.file_disk())
    assert p.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    p.vm(p.config().replace("memory: 2048", f"memory: {memory}"))
    assert p.vstor("pve", "hooks", "install") == 0
    before, intents = p.config(), sorted(os.listdir(p.snippets))
    capsys.readouterr()
    for args in (("plan", "100"), ("apply", "100")):
        assert p.vstor("pve", *args, "--qemu-version", QEMU) == 2, args
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "internal error" not in err, err
    done = p.hook(100, "pre-start")
    assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert p.config() == before and sorted(os.listdir(p.snippets)) == intents
