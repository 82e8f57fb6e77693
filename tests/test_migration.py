"""vstor migrate between two "hosts" on this machine: A (the source, this
process) and B (its own config, state, socket and daemon directories, its own
host layout, and its own mount namespace: `unshare -m` runs B's agent, as
another host's vstor would run behind ssh).  The disk is a file under a
directory both list in [migrate] shared.  Real qemu-storage-daemons on both;
libvirt's test driver (the live migration itself is in tests/e2e)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import hosts, on_a, running_on_a  # noqa: F401 (hosts: a fixture)
from tests.helpers import migration_hook as hook, migration_records as records
from vstor.cli.main import main

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons in another mount namespace (needs root)")

HERE = os.path.dirname(__file__)
ROOT = os.path.abspath(os.path.join(HERE, ".."))
HOOK = os.path.join(ROOT, "hooks", "vstor")
NS = "https://vstor.dev/xmlns/domain/1"


def test_check_prepare_arrive_and_finish(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb", "--json") == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["verdict"] == "ready" and verdict["live"] and verdict["destination_problems"] == []
    assert "[migrate] shared" in verdict["disks"][0]["reason"] and "hostb sees it" in verdict["disks"][0]["reason"]

    out_xml = f"{h.work}/vm.b.xml"
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", out_xml) == 0
    printed = capsys.readouterr().out
    assert (f"migrate --live --persistent --undefinesource --persistent-xml {out_xml} --xml {out_xml} "
            "vm qemu+ssh://hostb/system") in printed
    assert records(h, "b") == {"vm": "incoming"} and records(h, "a") == {"vm": "prepared"}
    assert on_a(h, "status", "vm") == 0
    assert "migrating to hostb" in capsys.readouterr().out
    b_status = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", h.b_conf, "status"],
                              capture_output=True, text=True)
    assert "vm: incoming" in b_status.stdout and "held for an incoming migration from" in b_status.stdout
    assert sorted(os.listdir(f"{h.work}/b/vhost")) == ["vm-vdb", "vm.vstor-prepared"]   # B's daemon serves B's socket
    arriving = open(out_xml).read()
    assert f"{h.work}/b/vhost/vm-vdb" in arriving and f"{h.work}/a/vhost" not in arriving

    # a start of that name on B that is not the migration does not take the reservation
    out = hook(h, "b", "vm", "prepare", "begin", "-", arriving)
    assert out.returncode == 3 and b"reserved here for an incoming migration" in out.stderr
    # libvirt on B: the migrate hook places the XML the source sends ...
    source_xml = open(xml_path).read()
    out = hook(h, "b", "vm", "migrate", "begin", "-", source_xml)
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert out.stdout.decode() == arriving
    # ... prepare takes over what migrate prepare made; the source releases.
    out = hook(h, "b", "vm", "prepare", "begin", "-", out.stdout.decode())
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert records(h, "b") == {"vm": "prepared"}
    out = hook(h, "a", "vm", "release", "end", "migrated", source_xml)
    assert out.returncode == 0 and records(h, "a") == {} and os.listdir(f"{h.work}/a/vhost") == []
    assert on_a(h, "migrate", "finish", "vm", "--to", "hostb") == 0
    assert "vm runs on hostb" in capsys.readouterr().out


def test_abort_releases_the_destination_and_a_second_prepare_is_clean(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{h.work}/o.xml") == 0
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{h.work}/o.xml") == 0
    assert records(h, "b") == {"vm": "incoming"}
    assert on_a(h, "migrate", "abort", "vm") == 0
    assert records(h, "b") == {} and os.listdir(f"{h.work}/b/vhost") == []
    assert records(h, "a") == {"vm": "prepared"}             # the source runs on, untouched
    assert "released what was held for vm" in capsys.readouterr().out


def test_finish_says_which_side_holds_what(hosts, capsys):
    """finish before the move: not arrived (B holds it incoming). A domain
    that stopped after it arrived (B released it; libvirt here knows no such
    domain running): it runs on neither host. Both refused, nothing changed."""
    h = hosts
    xml_path = running_on_a(h)
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{h.work}/o.xml") == 0
    capsys.readouterr()
    assert on_a(h, "migrate", "finish", "vm") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has not arrived on hostb (incoming)" in err
    assert main(["--config", h.b_conf, "--host-root", h.b_root, "release", "--force", "vm"]) == 0
    capsys.readouterr()
    assert on_a(h, "migrate", "finish", "vm") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs on neither host: hostb holds nothing for it" in err, err
    assert records(h, "a") == {"vm": "prepared"}


def test_a_destination_that_cannot_take_it_changes_nothing_on_either_host(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h, memory_mib=64 * 1024)      # fits a node of A (192 GiB), not B (32 GiB)
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb") == 3
    assert "hostb cannot take it" in capsys.readouterr().out
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{h.work}/o.xml") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot live-migrate to hostb" in err
    assert records(h, "b") == {} and not os.path.exists(f"{h.work}/o.xml")
    assert records(h, "a") == {"vm": "prepared"}


def test_a_file_only_the_source_sees_is_impossible(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h, disk="a/local/mine.raw")
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb", "--json") == 3
    v = json.loads(capsys.readouterr().out)
    assert v["verdict"] == "impossible" and "on a local" in v["disks"][0]["reason"]
    assert "[migrate] shared" in v["disks"][0]["fix"]


def test_a_cold_migration_reserves_the_destination_and_its_start_makes_the_backends(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    out_xml = f"{h.work}/cold.xml"
    capsys.readouterr()
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "--cold", "-o", out_xml) == 0
    assert "virsh -c test:///default migrate --offline --persistent" in capsys.readouterr().out
    assert records(h, "b") == {"vm": "incoming"} and os.listdir(f"{h.work}/b") .count("vhost") == 0
    # shut down on A (its hook releases), the offline migration runs B's migrate hook, then a start on B
    source_xml = open(xml_path).read()
    assert hook(h, "a", "vm", "release", "end", "-", source_xml).returncode == 0
    out = hook(h, "b", "vm", "migrate", "begin", "-", source_xml)
    assert out.returncode == 0 and out.stdout.decode() == open(out_xml).read()
    out = hook(h, "b", "vm", "prepare", "begin", "-", out.stdout.decode())
    assert (out.returncode, out.stderr) == (0, b""), out.stderr
    assert records(h, "b") == {"vm": "prepared"} and sorted(os.listdir(f"{h.work}/b/vhost")) == [
        "vm-vdb", "vm.vstor-prepared"]
    assert on_a(h, "migrate", "finish", "vm", "--to", "hostb") == 0


def test_two_incoming_migrations_get_their_own_cores_and_a_failed_one_gives_them_back(hosts, capsys):
    """The destination's ledger holds what it reserved for incoming
    migrations; libvirt's `release end failed` there gives it back."""
    h = hosts
    first, second = running_on_a(h), running_on_a(h, name="vm2", disk="shared/big.raw")
    for path, out in ((first, "o1.xml"), (second, "o2.xml")):
        assert on_a(h, "migrate", "prepare", path, "--to", "hostb", "-o", f"{h.work}/{out}") == 0
    cpus = []
    for name in ("vm", "vm2"):
        with open(f"{h.work}/b/state/domains/{name}.json") as f:
            cpus.append(set(json.load(f)["holding"]["cpus"]))
    assert cpus[0] and cpus[1] and not cpus[0] & cpus[1]
    xml = open(f"{h.work}/o2.xml").read()
    assert hook(h, "b", "vm2", "migrate", "begin", "-", open(second).read()).returncode == 0
    out = hook(h, "b", "vm2", "release", "end", "failed", xml)
    assert out.returncode == 0 and records(h, "b") == {"vm": "incoming"}
    assert sorted(os.listdir(f"{h.work}/b/vhost")) == ["vm-vdb", "vm.vstor-prepared"]


def test_two_migrations_prepared_at_once_get_their_own_cores(hosts):
    """Two `vstor migrate prepare` at once (real processes): the destination
    plans and records each under its planning lock, the state records read
    under it, so neither is refused for the other's cores nor shares them."""
    h = hosts
    first, second = running_on_a(h), running_on_a(h, name="vm2", disk="shared/big.raw")
    for _ in range(5):
        procs = [subprocess.Popen([sys.executable, "-m", "vstor.cli.main", "-c", "test:///default",
                                   "--config", h.a_conf, "--host-root", h.a_root, "migrate", "prepare",
                                   path, "--to", "hostb", "-o", f"{h.work}/{out}"],
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for path, out in ((first, "o1.xml"), (second, "o2.xml"))]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err
        cpus = []
        for name in ("vm", "vm2"):
            with open(f"{h.work}/b/state/domains/{name}.json") as f:
                cpus.append(set(json.load(f)["holding"]["cpus"]))
        assert cpus[0] and cpus[1] and not cpus[0] & cpus[1]
        for name in ("vm", "vm2"):
            assert on_a(h, "migrate", "abort", name) == 0
        assert records(h, "b") == {}
