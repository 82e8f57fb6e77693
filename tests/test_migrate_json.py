"""vstor migrate check: this host's side first, then the destination's
answer, and one --json object (migration.verdict.report) even when the
destination does not answer; --dry-run on prepare, abort and finish: what
would be done, with both hosts' state trees, the source's SPDK (the test
double) and the destination's agent (every request logged) left as they
were but for read-only questions.  The two hosts are tests/test_migration.py's
and tests/test_migration_spdk.py's."""

import json
import os
import shlex

from tests.helpers import changes, hosts, kinds, on, on_a, running_nvme_on_a, running_on_a, two  # noqa: F401 (fixtures)
from tests.helpers import migration_hook as hook, migration_records as records
from tests.snapshot import COUNTED

REPORT_KEYS = {"version", "domain", "destination", "answered", "error", "verdict", "live", "cold",
               "disks", "destination_problems", "placement"}
DISK_KEYS = {"target", "needs", "source", "verdict", "reason", "fix"}


def logged(work: str, conf: str) -> str:
    """The peer command of `conf` through a wrapper that logs each request;
    the log's path."""
    log, wrapper = f"{work}/peer.log", f"{work}/peer.sh"
    with open(conf) as f:
        text = f.read()
    agent = next(line.split("=", 1)[1].strip() for line in text.splitlines() if line.startswith("peer_command"))
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nreq=$(cat)\nprintf '%s\\n' \"$req\" >> {shlex.quote(log)}\n"
                f"printf '%s' \"$req\" | exec {agent}\n")
    with open(conf, "w") as f:
        f.write(text.replace(f"peer_command = {agent}", f"peer_command = /bin/sh {wrapper} {{host}}"))
    return log


def ops(log: str) -> list[str]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line)["op"] for line in f if line.strip()]


def tree(work: str) -> dict:
    """Every file of both hosts' state, socket and daemon directories, and
    the outputs; not the locks taken, nor the peer log."""
    out = {}
    for top, dirs, files in os.walk(work):
        dirs[:] = [d for d in dirs if d not in ("host", COUNTED)]   # the host layouts (sysfs trees); counts
        for name in files:
            p = os.path.join(top, name)
            if "lock" not in name and name != "peer.log" and os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    out[p] = f.read()
    return out


# -- check ------------------------------------------------------------------------------------

def test_check_says_this_hosts_side_first_then_the_destinations(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "vm -> hostb: on this host"
    assert out[1].startswith(f"  vdb: needs shared: {h.shared}/d0.raw is under the shared storage")
    assert out[2] == "asking hostb ..." and out[3] == "vm -> hostb: ready"
    assert "hostb sees it" in out[4]


def test_check_json_is_one_object_with_per_disk_verdicts(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h, disk="a/local/mine.raw")
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb", "--json") == 3
    v = json.loads(capsys.readouterr().out)
    assert set(v) == REPORT_KEYS and v["version"] == 1 and v["answered"] and v["error"] is None
    assert (v["domain"], v["destination"], v["verdict"], v["live"], v["cold"]) == \
        ("vm", "hostb", "impossible", False, False)
    [disk] = v["disks"]
    assert set(disk) == DISK_KEYS and disk["needs"] == "copy" and "would have to be copied" in disk["source"]
    assert disk["verdict"] == "impossible" and "[migrate] shared" in disk["fix"]


def test_a_destination_that_does_not_answer_still_gets_this_hosts_side(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    with open(h.a_conf) as f:
        text = f.read()
    with open(h.a_conf, "w") as f:
        f.write(text.split("peer_command")[0] + "peer_command = /bin/false {host}\n")
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb") == 4
    out, err = capsys.readouterr()
    assert "  vdb: needs shared:" in out and "vstor on hostb did not answer 'check'" in err
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb", "--json") == 4
    out, err = capsys.readouterr()
    v = json.loads(out)
    assert not v["answered"] and "did not answer" in v["error"] and v["verdict"] is None
    assert [(d["target"], d["needs"], d["verdict"]) for d in v["disks"]] == [("vdb", "shared", None)]
    assert err.count("\n") == 1


# -- dry runs ---------------------------------------------------------------------------------

def test_prepare_abort_and_finish_dry_runs_change_nothing_on_either_host(hosts, capsys):
    h = hosts
    xml_path = running_on_a(h)
    log = logged(h.work, h.a_conf)
    before = tree(h.work)
    capsys.readouterr()
    out_xml = f"{h.work}/o.xml"
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", out_xml, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "would ask hostb to make and hold the backends of vm" in out
    assert f"would write the XML it arrives with to {out_xml}" in out
    assert ops(log) == ["check"] and tree(h.work) == before
    assert records(h, "a") == {"vm": "prepared"} and records(h, "b") == {}

    # Prepared for real; then abort's and finish's dry runs ask only "status".
    assert on_a(h, "migrate", "prepare", xml_path, "--to", "hostb", "-o", out_xml) == 0
    before, asked = tree(h.work), len(ops(log))
    capsys.readouterr()
    assert on_a(h, "migrate", "abort", "vm", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "hostb: would release what it holds for vm (incoming)" in out
    assert "would forget the migration in vm's state record" in out
    assert on_a(h, "migrate", "finish", "vm", "--dry-run") == 3       # refused as finish is
    assert "has not arrived on hostb (incoming)" in capsys.readouterr().err
    assert ops(log)[asked:] == ["status", "status"] and tree(h.work) == before

    # Arrived on B (its hooks, as libvirt runs them): finish's dry run says
    # what it would release here, and releases nothing.
    source_xml = open(xml_path).read()
    arriving = hook(h, "b", "vm", "migrate", "begin", "-", source_xml).stdout.decode()
    assert hook(h, "b", "vm", "prepare", "begin", "-", arriving).returncode == 0
    before, asked = tree(h.work), len(ops(log))
    assert on_a(h, "migrate", "finish", "vm", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "vm runs on hostb (dry run):" in out and "would undo:" in out
    assert ops(log)[asked:] == ["status"] and tree(h.work) == before
    assert records(h, "a") == {"vm": "prepared"} and records(h, "b") == {"vm": "prepared"}


def test_a_dry_run_prepare_exports_nothing_from_spdk(two, capsys):
    t = two
    xml_path = running_nvme_on_a(t)
    log = logged(t.work, t.a_conf)
    before, sent_a, sent_b = tree(t.work), len(t.a_spdk.requests), len(t.b_spdk.requests)
    capsys.readouterr()
    assert on(t, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{t.work}/o.xml", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "would export vdb (vs_0000_5f_00_0n1) over NVMe-oF as nqn.2016-06.io.vstor:migrate:vm-vdb " \
           "at 127.0.0.1 port 4420, to host NQN nqn.2014-08.org.nvmexpress:uuid:" in out
    assert changes(t.a_spdk, sent_a) == [] and changes(t.b_spdk, sent_b) == []
    assert ops(log) == ["check"] and tree(t.work) == before
    assert kinds(t, "a") == ("prepared", ["vfio-bind", "spdk-attach", "spdk-vhost", "gate"])
    assert kinds(t, "b") == (None, [])


def test_a_destination_without_the_shared_root_is_told_to_add_it(hosts, capsys):
    """Both hosts have the file on the same local filesystem names; only A
    lists the root in [migrate] shared: the refusal names that, and the fix."""
    h = hosts
    xml_path = running_on_a(h)
    with open(h.b_conf) as f:
        text = f.read()
    with open(h.b_conf, "w") as f:
        f.write(text.replace(f"shared = {h.shared}\n", "shared =\n"))
    capsys.readouterr()
    assert on_a(h, "migrate", "check", xml_path, "--to", "hostb", "--json") == 3
    [disk] = json.loads(capsys.readouterr().out)["disks"]
    assert disk["needs"] == "shared" and disk["verdict"] == "impossible"
    assert f"but hostb has {h.shared} on " in disk["reason"] and "not in its [migrate] shared" in disk["reason"]
    assert disk["fix"] == "add that root to [migrate] shared in vstor.conf on hostb"
    assert ", not on " not in disk["reason"]
