"""--json of status, host show, plan and doctor: every key the commands
print is in docs/operations.md's tables and every documented key is printed
(for hosts and plans that have them); the exit codes are the text form's;
status gives each daemon's pid, read back from the real daemon."""

import json
import os
import re
import subprocess
import sys

import pytest

from vstor.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "xml-templates")
DOC = os.path.join(ROOT, "docs", "operations.md")
# Objects documented in one table cell, not key by key.
INLINE = ("controllers[].group_peers[].", "disks[].source.", "disks[].attach[].", "migration.")


def documented(heading: str) -> set[str]:
    """The keys of the table under `### heading` in docs/operations.md."""
    text = open(DOC).read()
    start = text.index(f"### {heading}\n")
    end = min(i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1), len(text)) if i > 0)
    return set(re.findall(r"^\| `([^`]+)` \|", text[start:end], re.M))


def keys(data, prefix="", out=None) -> set[str]:
    out = set() if out is None else out
    if isinstance(data, dict):
        for k, v in data.items():
            if not (prefix + k + ".").startswith(INLINE) or prefix + k + "." in INLINE:
                out.add(prefix + k)
                if prefix + k + "." not in INLINE:
                    keys(v, prefix + k + ".", out)
    elif isinstance(data, list):
        for item in data:
            keys(item, (prefix[:-1] if prefix else "") + "[].", out)
    return out


def strip(found: set[str]) -> set[str]:
    """A top-level list's keys without the leading '[].'."""
    return {k[3:] if k.startswith("[].") else k for k in found}


def vstor(*args):
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", *args], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert "Traceback" not in out.stderr
    return out


from tests.helpers import cli_work  # noqa: E402,F401  (the fixture work: the same domain and files)


def test_host_show_json_is_the_documented_object(host_layout, cfg):
    out = vstor("--config", cfg, "--host-root", host_layout("two-socket"), "host", "show", "--json")
    assert out.returncode == 0
    assert keys(json.loads(out.stdout)) == documented("`vstor host show --json`")


def test_plan_json_is_the_documented_object_and_refuses_as_the_text_form(host_layout, cfg):
    found = set()
    for name in ("vhost-nvmf-rdma-multipath", "vhost-local-nvme", "passthrough-guest-spdk", "qsd-file",
                 "vhost-two-nodes"):
        out = vstor("--config", cfg, "--host-root", host_layout("two-socket"), "plan", "--json",
                    os.path.join(TEMPLATES, f"{name}.xml"))
        assert out.returncode == 0, out.stderr
        keys(json.loads(out.stdout), out=found)
    assert found == documented("`vstor plan FILE|DOMAIN --json`")
    # a controller this host does not have: refused, with the same code and line either way
    text, js = (vstor("--config", cfg, "--host-root", host_layout("no-iommu"), "plan", *extra,
                      os.path.join(TEMPLATES, "passthrough-guest-spdk.xml")) for extra in ((), ("--json",)))
    assert text.returncode == js.returncode == 2
    errors = [line for line in js.stderr.splitlines() if not line.startswith("vstor: warning: ")]
    assert js.stdout == "" and len(errors) == 1 and errors[0].startswith("vstor: error: ")
    assert text.stderr == js.stderr


def test_doctor_json_is_the_documented_list_with_the_text_forms_exit_code(host_layout, cfg):
    for layout in ("two-socket", "no-iommu", "dirty-group"):
        args = ("-c", "test:///default", "--config", cfg, "--host-root", host_layout(layout), "doctor")
        text, js = vstor(*args), vstor(*args, "--json")
        assert text.returncode == js.returncode
        data = json.loads(js.stdout)
        assert strip(keys(data)) == documented("`vstor doctor --json`")
        assert [c["name"] for c in data] == [line[6:].split("  ")[0] for line in text.stdout.splitlines()
                                             if line[:4].strip() in ("OK", "WARN", "FAIL")]


def test_every_kind_of_step_has_documented_labelled_fields():
    from vstor.backends.qsd.export import QsdExport as Spec
    from vstor.cli.runtime import labelled
    from vstor.meta.plan import AttachPath
    from vstor.runtime import actions
    made = [actions.VfioBind("0000:5e:00.0"),
            actions.SpdkAttach("nvme5e", (AttachPath(trtype="PCIe", traddr="0000:5e:00.0"),)),
            actions.SpdkVhost("web1-vdb", "nvme5en1", 18, False, "/run/vstor/vhost/web1-vdb", "kvm"),
            actions.QsdExport(Spec(run_dir="/run/vstor/qsd", name="web1-vdc", source="/srv/web1.raw",
                                   kind="file", socket_path="/run/vstor/vhost/web1-vdc")),
            actions.NvmfExport("nqn.2024-01.dev.vstor:web1", "nvme5en1", "TCP", "IPv4", "10.0.0.1", 4420,
                               "nqn.2014-08.org.nvmexpress:uuid:1"),
            actions.Gate("/run/vstor/vhost/web1.vstor-prepared", "web1")]
    assert {a.kind for a in made} == set(actions.KINDS)
    doc = {k[len("steps[]."):] for k in documented("`vstor status [DOMAIN] --json`") if k.startswith("steps[].")}
    found = set()
    for a in made:
        fields = labelled(actions.to_json(a, "done"), 4242)
        assert {"kind", "name"} <= set(fields) and fields["kind"] == a.kind
        if fields.get("daemon") == "spdk":
            assert fields["pid"] == 4242
        found |= set(fields)
    assert found | {"step", "state", "problem"} == doc
    assert labelled({"kind": "from-the-future", "state": "done", "data": {}}, None) == {"kind": "from-the-future"}


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                    reason="starts qemu-storage-daemons handed to root:kvm (needs root)")
def test_status_json_gives_each_daemons_pid_and_the_documented_keys(work, capsys):
    d, conf = work.dir, work.conf     # test_runtime_cli's domain cli1: two file disks

    def run(*args):
        return main(["-c", "test:///default", "--config", conf, *args])
    assert run("render", f"{d}/vm.xml", "-o", f"{d}/r.xml") == 0
    assert run("prepare", f"{d}/r.xml") == 0
    capsys.readouterr()
    assert run("status", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert strip(keys(rows)) <= documented("`vstor status [DOMAIN] --json`")
    (row,) = rows
    pids = {}
    *daemons, gate = row["steps"]
    assert (gate["kind"], gate["name"], gate["problem"]) == ("gate", f"{d}/vhost/cli1.vstor-prepared", None)
    for step in daemons:
        assert step["kind"] == "qsd-export" and step["daemon"] == "qemu-storage-daemon"
        with open(f"{d}/qsd/{step['name']}.pid") as f:
            assert step["pid"] == int(f.read())
        with open(f"/proc/{step['pid']}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert os.path.basename(argv[0]) == b"qemu-storage-daemon"
        assert f"{d}/qsd/{step['name']}.pid".encode() in argv
        pids[step["name"]] = step["pid"]
    assert sorted(s["source"] for s in daemons) == [f"{d}/d0.raw", f"{d}/d1.raw"]
    assert run("status") == 0
    out = capsys.readouterr().out
    for pid in pids.values():
        assert f": ok (qemu-storage-daemon pid {pid})" in out
    os.kill(pids["cli1-vdb"], 9)
    assert run("status", "cli1") == run("status", "cli1", "--json") == 1      # as the text form
    capsys.readouterr()
    assert run("status", "--json") == 1
    dead = {s["name"]: s for s in json.loads(capsys.readouterr().out)[0]["steps"]}
    assert dead["cli1-vdb"]["pid"] is None and dead["cli1-vdb"]["problem"]
    assert dead["cli1-vdc"]["pid"] == pids["cli1-vdc"]
    assert run("status", "nosuch", "--json") == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
