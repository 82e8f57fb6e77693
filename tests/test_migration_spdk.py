"""Local NVMe made migratable: the source's SPDK (an spdk_tgt, which has
both vhost and NVMe-oF target methods) exports the namespace's bdev over
NVMe-oF to the destination's SPDK (a vhost app), which serves it to the
arriving domain.  Both SPDKs are the SPDK test double on one shared fabric;
the destination's vstor agent runs in its own mount namespace, as in
tests/test_migration.py.  Exact RPCs, their order, and the undo of each."""

import json
import os
import re
import sys

import pytest

from tests.helpers import B_NQN, changes, kinds, on, two  # noqa: F401 (two: a fixture)
from tests.helpers import running_nvme_on_a as running_on_a, spdk_migration_hook as hook

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="sockets handed to root:kvm, a mount namespace (needs root)")

HERE = os.path.dirname(__file__)
ROOT = os.path.abspath(os.path.join(HERE, ".."))
HOOK = os.path.join(ROOT, "hooks", "vstor")
NS = "https://vstor.dev/xmlns/domain/1"
LOCAL = "0000:5f:00.0"
EXPORT = "nqn.2016-06.io.vstor:migrate:vm-vdb"
SERIAL = "VS" + __import__("hashlib").sha256(EXPORT.encode()).hexdigest()[:18].upper()


def migration_nqn(t) -> str:
    """The host NQN A's export admits, as A's record holds it."""
    with open(f"{t.work}/a/state/domains/vm.json") as f:
        return next(e["data"]["host"] for e in json.load(f)["steps"] if e["kind"] == "nvmf-export")


@pytest.mark.parametrize("reason", ["migrated", "-"])     # libvirt >= 10.5 says why; older does not
def test_local_nvme_is_exported_to_the_destination_and_the_export_outlives_the_move(two, capsys, reason):
    t = two
    xml_path = running_on_a(t)
    capsys.readouterr()
    assert on(t, "a", "migrate", "check", xml_path, "--to", "hostb", "--json") == 0
    v = json.loads(capsys.readouterr().out)
    assert v["verdict"] == "can be made ready" and v["live"], v
    sent = len(t.a_spdk.requests)
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 0
    listen = {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "4420"}
    # The export admits this migration's own host NQN alone (a random UUID,
    # recorded on both sides), never B's shared [nvmf] hostnqn.
    mig = migration_nqn(t)
    assert re.fullmatch(r"nqn\.2014-08\.org\.nvmexpress:uuid:[0-9a-f-]{36}", mig) and mig != B_NQN
    assert changes(t.a_spdk, sent) == [
        ("nvmf_create_transport", {"trtype": "TCP"}),
        ("nvmf_create_subsystem", {"nqn": EXPORT, "serial_number": SERIAL,
                                   "model_number": "vstor migration export", "allow_any_host": False}),
        ("nvmf_subsystem_add_ns", {"nqn": EXPORT, "namespace": {"bdev_name": "vs_0000_5f_00_0n1", "nsid": 1}}),
        ("nvmf_subsystem_add_listener", {"nqn": EXPORT, "listen_address": listen}),
        ("nvmf_subsystem_add_host", {"nqn": EXPORT, "host": mig})]
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate", "nvmf-export"])
    assert kinds(t, "b") == ("incoming", ["spdk-attach", "spdk-vhost", "gate"])
    attach = t.b_spdk.params_of("bdev_nvme_attach_controller")
    assert [(a["trtype"], a["traddr"], a["trsvcid"], a["subnqn"], a["hostnqn"]) for a in attach] == [
        ("TCP", "127.0.0.1", "4420", EXPORT, mig)]
    assert mig in open(f"{t.work}/o.xml").read()                  # the arriving plan records it
    # Another domain on B that names the export (and B's own NQN, or even
    # this one) is refused at plan time: only the migration's import reads it.
    other = f"{t.work}/other.xml"
    with open(other, "w") as f:
        f.write(f"""<domain type='kvm'><name>thief</name><memory unit='MiB'>1024</memory><vcpu>1</vcpu>
          <os><type arch='x86_64' machine='q35'>hvm</type></os><metadata><vstor:vstor xmlns:vstor='{NS}'>
          <vstor:vm cpus='shared'/><vstor:disk target='vdb'><vstor:nvmf transport='tcp' traddr='127.0.0.1'
          subnqn='{EXPORT}' hostnqn='{mig}'/></vstor:disk></vstor:vstor></metadata><devices/></domain>""")
    capsys.readouterr()
    assert on(t, "b", "plan", other) == 2
    assert "names nqn.2016-06.io.vstor:migrate:vm-vdb, a subsystem vstor exports for a migration" in \
        capsys.readouterr().err

    # the move, as libvirt runs the hooks on both sides
    source_xml = open(xml_path).read()
    out = hook(t, "b", "migrate", "begin", "-", source_xml)
    assert out.returncode == 0, out.stderr
    assert hook(t, "b", "prepare", "begin", "-", out.stdout.decode()).returncode == 0
    out = hook(t, "a", "release", "end", reason, source_xml)
    assert out.returncode == 0, out.stderr
    assert kinds(t, "a") == ("exporting", ["vfio-bind", "spdk-attach", "nvmf-export"])
    capsys.readouterr()
    assert on(t, "a", "status", "vm") == 0
    shown = capsys.readouterr().out
    assert "vm: exporting" in shown and "runs on hostb, reading its disk through this host's NVMe-oF export" in shown
    assert "PROBLEM" not in shown
    assert t.a_spdk.vhost == {} and EXPORT in t.a_spdk.subsystems and t.sysfs.driver_of(LOCAL) == "vfio-pci"
    capsys.readouterr()
    assert on(t, "a", "migrate", "finish", "vm", "--to", "hostb") == 0
    assert "export, which stays until it leaves hostb" in capsys.readouterr().out
    assert on(t, "a", "gc") == 0
    assert "Leaving the NVMe-oF export of vm: hostb still holds the domain" in capsys.readouterr().out
    assert kinds(t, "a")[0] == "exporting"
    assert on(t, "a", "release", "vm") == 3                       # B reads through it
    assert "reads its disk through this host's NVMe-oF export" in capsys.readouterr().err
    with open(f"{t.work}/a/state/domains/vm.json") as f:         # it holds no cores or reactor now
        held = json.load(f)["holding"]
    assert held["cpus"] == [] and held["reactors"] == [] and held["sockets"] == []
    # a damaged record on B: B cannot say, so the export stays
    os.rename(f"{t.work}/b/state/domains/vm.json", f"{t.work}/b/vm.json.saved")
    with open(f"{t.work}/b/state/domains/vm.json", "w") as f:
        f.write("{")
    assert on(t, "a", "gc") == 0
    assert "cannot ask hostb whether it still needs it" in capsys.readouterr().out
    assert kinds(t, "a")[0] == "exporting"
    os.replace(f"{t.work}/b/vm.json.saved", f"{t.work}/b/state/domains/vm.json")
    # from B the disk cannot move on: only A's export serves it, to B alone
    with open(t.b_conf, "a") as f:
        f.write(f"[migrate]\npeer_command = {sys.executable} -m vstor.cli.main -c test:///default "
                f"--config {t.a_conf} --host-root {t.a_root} migrate agent\n")
    assert on(t, "b", "migrate", "check", f"{t.work}/o.xml", "--to", "hostc", "--json") == 3
    v = json.loads(capsys.readouterr().out)
    assert v["disks"][0]["verdict"] == "impossible" and "reads another host's local NVMe" in v["disks"][0]["reason"]

    # the domain stops on B; the next gc on A takes the export down
    assert hook(t, "b", "release", "end", "-", open(f"{t.work}/o.xml").read()).returncode == 0
    assert on(t, "a", "gc") == 0
    assert kinds(t, "a") == (None, []) and t.a_spdk.subsystems.keys() <= {"nqn.2014-08.org.nvmexpress.discovery"}
    assert t.a_spdk.nvme == {} and t.sysfs.driver_of(LOCAL) == "nvme"


def test_a_destination_that_refuses_leaves_no_export_behind(two, capsys):
    t = two
    xml_path = running_on_a(t)
    with open(t.b_conf) as f:       # B without a reactor on its node: it cannot serve the disk
        text = f.read().replace("reactors = 3,19", "reactors =")
    with open(t.b_conf, "w") as f:
        f.write(text)
    capsys.readouterr()
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 3
    assert capsys.readouterr().err.count("\n") == 1
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate"])
    assert kinds(t, "b") == (None, []) and EXPORT not in t.a_spdk.subsystems


def test_abort_takes_the_export_down_and_keeps_the_running_domain(two, capsys):
    t = two
    xml_path = running_on_a(t)
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 0
    first = migration_nqn(t)
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 0
    assert kinds(t, "a")[1].count("nvmf-export") == 1          # a second prepare adds nothing
    assert migration_nqn(t) == first and first in open(f"{t.work}/o.xml").read()   # and keeps its NQN
    assert t.a_spdk.subsystems[EXPORT].hosts == [first]
    assert on(t, "a", "migrate", "abort", "vm") == 0
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate"])
    assert kinds(t, "b") == (None, []) and EXPORT not in t.a_spdk.subsystems
    assert list(t.a_spdk.vhost) == ["vm-vdb"] and t.b_spdk.nvme == {}
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 0
    assert migration_nqn(t) != first                            # another migration, another NQN
    assert on(t, "a", "migrate", "abort", "vm") == 0


def test_an_export_subsystem_that_admits_another_host_is_refused_and_left(two, capsys):
    """A subsystem of the export's name found already there that admits any
    host (made by hand, say) is not reused, and not deleted either: its
    serial number is not the one vstor gives its exports."""
    from vstor.backends.spdk import SpdkClient
    t = two
    xml_path = running_on_a(t)
    with SpdkClient(t.a_spdk.socket_path) as client:
        client.nvmf_create_subsystem(EXPORT, serial_number="OPERATOR1", allow_any_host=True)
    capsys.readouterr()
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 5
    assert f"SPDK's NVMe-oF subsystem {EXPORT} admits any host" in capsys.readouterr().err
    assert t.a_spdk.subsystems[EXPORT].serial_number == "OPERATOR1"     # left as it was
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate"])
    assert kinds(t, "b") == (None, [])


def test_the_export_and_its_abort_go_through_the_spdk_the_record_names(two, capsys):
    """(review i30) [spdk] rpc_socket changed since the domain started: its
    export is made in, and its abort undone through, the SPDK application
    its record names (where its bdev is), as a hot-plug does, and the
    record keeps naming that one: its release asks it for the controllers."""
    t = two
    xml_path = running_on_a(t)
    with open(t.a_conf) as f:
        text = f.read().replace(t.a_spdk.socket_path, f"{t.work}/moved-spdk.sock")
    with open(t.a_conf, "w") as f:
        f.write(text)
    capsys.readouterr()
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml") == 0, \
        capsys.readouterr().err
    assert t.a_spdk.subsystems[EXPORT].hosts == [migration_nqn(t)]
    with open(f"{t.work}/a/state/domains/vm.json") as f:
        assert json.load(f)["spdk_socket"] == t.a_spdk.socket_path
    assert on(t, "a", "migrate", "abort", "vm") == 0, capsys.readouterr().err
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate"])
    assert EXPORT not in t.a_spdk.subsystems
