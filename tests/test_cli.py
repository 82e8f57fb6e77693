"""The vstor CLI as an operator uses it: exit codes, messages, and the domains
libvirt ends up with (libvirt's own test:///default driver)."""

import json
import os
import subprocess
import sys
import time

import libvirt
import pytest

from vstor.cli.main import main

ROOT = os.path.join(os.path.dirname(__file__), "..")
TEMPLATES = os.path.join(ROOT, "xml-templates")
URI = "test:///default"


def vstor(*args, check_code=None):
    """Run the real command in a subprocess: what an operator sees."""
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", *args], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    if check_code is not None:
        assert out.returncode == check_code, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out


def test_plan_explains_the_decisions(host_layout, cfg):
    out = vstor("--config", cfg, "--host-root", host_layout("two-socket"),
                "plan", os.path.join(TEMPLATES, "vhost-local-nvme.xml"), check_code=0)
    assert "Domain web1 on compute-7: NUMA node 1" in out.stdout
    assert "vdb   vhost  spdk" in out.stdout and "/run/vstor/vhost/web1-vdb" in out.stdout
    assert "SPDK reactor core 18" in out.stdout
    assert "planning against a host capture" in out.stderr


def test_plan_json_is_machine_readable(host_layout, cfg):
    out = vstor("--config", cfg, "--host-root", host_layout("two-socket"), "plan", "--json",
                os.path.join(TEMPLATES, "vhost-nvmf-rdma-multipath.xml"), check_code=0)
    data = json.loads(out.stdout)
    assert data["node"] == 0 and data["disks"][0]["source"]["kind"] == "nvmf"
    assert data["disks"][0]["source"]["paths"] == [{"traddr": "192.168.101.8", "trsvcid": 4420}]


@pytest.mark.parametrize("args, code, words", [
    (["plan", "/nonexistent/vm.xml"], 2, "cannot read /nonexistent/vm.xml: the file does not exist"),
    (["render", "newvm.xml"], 2, "cannot read newvm.xml: the file does not exist"),
    (["frobnicate"], 2, "invalid choice"),
    (["plan"], 2, "required"),
    (["--host-root", "/nonexistent", "host", "show"], 2, "/nonexistent holds no sysfs tree"),
])
def test_bad_invocations_are_one_line_with_exit_2(host_layout, cfg, args, code, words):
    out = vstor("--config", cfg, "--host-root", host_layout("two-socket"), *args, check_code=code)
    assert words in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_malformed_xml_unknown_device_and_no_fit_have_distinct_codes(host_layout, cfg, tmp_path):
    root = host_layout("two-socket")
    bad = tmp_path / "bad.xml"
    bad.write_text("<domain><name>x</name>")
    out = vstor("--config", cfg, "--host-root", root, "plan", str(bad), check_code=2)
    assert "malformed XML" in out.stderr
    unknown = tmp_path / "unknown.xml"
    unknown.write_text(open(os.path.join(TEMPLATES, "vhost-local-nvme.xml")).read()
                       .replace("0000:5f:00.0", "0000:99:00.0"))
    out = vstor("--config", cfg, "--host-root", root, "plan", str(unknown), check_code=2)
    assert "0000:99:00.0 is not on this host" in out.stderr
    big = tmp_path / "big.xml"
    big.write_text(open(os.path.join(TEMPLATES, "vhost-local-nvme.xml")).read()
                   .replace("<vcpu>4</vcpu>", "<vcpu>40</vcpu>"))
    out = vstor("--config", cfg, "--host-root", root, "plan", str(big), check_code=3)
    assert "does not fit" in out.stderr and len(out.stderr.strip().splitlines()) == 2  # warning + error


def test_render_prints_valid_concrete_xml(host_layout, cfg, tmp_path):
    out_file = tmp_path / "out.xml"
    vstor("--config", cfg, "--host-root", host_layout("two-socket"), "render",
          os.path.join(TEMPLATES, "qsd-file.xml"), "-o", str(out_file), check_code=0)
    text = out_file.read_text()
    assert "type=\"vhostuser\"" in text and "<vstor:plan" in text


def test_unreachable_libvirt_is_exit_4(host_layout, cfg):
    out = vstor("-c", "qemu+unix:///system?socket=/nonexistent/sock", "--config", cfg,
                "--host-root", host_layout("two-socket"), "define",
                os.path.join(TEMPLATES, "qsd-file.xml"), check_code=4)
    assert "cannot connect to libvirt" in out.stderr


# -- define / apply in libvirt's test driver (in-process: test:///default is per process) ----

@pytest.fixture
def testconn():
    """The test driver's state lives as long as one connection to it is open."""
    conn = libvirt.open(URI)
    yield conn
    conn.close()


def _domain_xml(name):
    conn = libvirt.open(URI)
    return conn.lookupByName(name).XMLDesc(0)


def test_define_renders_and_defines_and_the_ledger_keeps_cores_apart(host_layout, cfg, tmp_path, capsys, testconn):
    root = host_layout("two-socket")
    assert main(["-c", URI, "--config", cfg, "--host-root", root, "define",
                 os.path.join(TEMPLATES, "vhost-local-nvme.xml")]) == 0
    assert "Domain 'web1' defined: vdb vhost/spdk, node 1" in capsys.readouterr().out
    xml = _domain_xml("web1")
    assert "vhostuser" in xml and "vstor:plan" in xml
    second = tmp_path / "web2.xml"
    second.write_text(open(os.path.join(TEMPLATES, "vhost-local-nvme.xml")).read()
                      .replace("<name>web1</name>", "<name>web2</name>").replace("0000:5f:00.0", "0000:60:00.0"))
    assert main(["-c", URI, "--config", cfg, "--host-root", root, "define", str(second)]) == 0
    from vstor.meta.document import Domain
    p1 = Domain.parse(_domain_xml("web1")).recorded_plan()
    p2 = Domain.parse(_domain_xml("web2")).recorded_plan()
    assert p1.dedicated_cpus and p2.dedicated_cpus and not p1.dedicated_cpus & p2.dedicated_cpus
    for name in ("web1", "web2"):
        libvirt.open(URI).lookupByName(name).undefine()


def test_the_ledger_is_the_same_from_the_plans_cache_as_from_each_domains_plan(host_layout, cfg, tmp_path,
                                                                               capsys, testconn):
    """plans.json keeps each domain's holding by its XML's SHA-256: what a
    plan reads warm is what it reads cold (whether a domain runs asked of
    libvirt each time), a damaged entry is read again from the domain, a
    domain gone leaves, a damaged plan record is skipped with a warning;
    only save_pending (after a define or apply) writes the file."""
    import re
    from vstor.meta.document import Domain
    from vstor.meta.holding import Holding, holding_to_json
    from vstor.runtime import inventory
    root = host_layout("two-socket")
    for name in ("vhost-local-nvme.xml", "qsd-file.xml", "vhost-two-nodes.xml"):
        assert main(["-c", URI, "--config", cfg, "--host-root", root, "define",
                     os.path.join(TEMPLATES, name)]) == 0
    broken = re.sub(r"<uuid>.*</uuid>", "", _domain_xml("demo1")).replace("demo1", "broken1")
    testconn.defineXML(broken.replace('mode="vhost"', 'mode="sideways"', 1))
    testconn.lookupByName("web1").create()          # running: its hugepages already taken
    cache = str(tmp_path / "state" / "plans.json")
    os.remove(cache)                                # as the defines left it: cold
    capsys.readouterr()

    def expected() -> dict:
        """Each planned domain's holding as its recorded plan gives it."""
        return {n: Holding.from_plan(Domain.parse(_domain_xml(n)).recorded_plan(),
                                     bool(testconn.lookupByName(n).isActive()))
                for n in ("web1", "demo1", "db1") if n in [d.name() for d in testconn.listAllDomains(0)]}

    def read() -> dict:
        return {h.domain: h for h in inventory.load_ledger(testconn, (), cache).holdings}
    try:
        want = expected()
        assert want["web1"].active and not want["db1"].active and want["db1"].cells
        assert read() == want and "ledger skips domain 'broken1'" in capsys.readouterr().err
        assert not os.path.exists(cache)                # read, not written
        inventory.save_pending()
        with open(cache) as f:
            kept = json.load(f)
        # The driver's own domain 'test' holds nothing; broken1 has no entry.
        assert sorted(kept.values(), key=json.dumps) == sorted(
            [None, *(holding_to_json(h) for h in want.values())], key=json.dumps)
        inode = os.stat(cache).st_ino
        assert read() == want
        inventory.save_pending()
        assert os.stat(cache).st_ino == inode               # warm: nothing to write again
        testconn.lookupByName("web1").destroy()
        assert read() == expected() != want                  # whether it runs: libvirt's, now
        key = next(k for k, v in kept.items() if v and v["domain"] == "demo1")
        with open(cache, "w") as f:
            json.dump({**kept, key: {"domain": "demo1", "cpus": "all"}}, f)
        assert read() == expected()                          # the damaged entry read again
        inventory.save_pending()
        with open(cache) as f:
            assert json.load(f) == kept
        testconn.lookupByName("db1").undefine()
        assert read() == expected() and len(expected()) == 2
        inventory.save_pending()
        with open(cache) as f:
            assert json.load(f) == {k: v for k, v in kept.items() if not v or v["domain"] != "db1"}
    finally:
        inventory.save_pending()
        for dom in testconn.listAllDomains(0):
            if dom.name() in ("web1", "demo1", "db1", "broken1"):
                if dom.isActive():
                    dom.destroy()
                dom.undefine()


def test_apply_replans_a_domain_defined_with_virsh(host_layout, cfg, capsys, testconn):
    conn = libvirt.open(URI)
    annotated = open(os.path.join(TEMPLATES, "qsd-file.xml")).read()
    conn.defineXML(annotated)           # what `virsh define annotated.xml` does
    assert "vhostuser" not in _domain_xml("demo1")
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "apply", "demo1"]) == 0
    xml = _domain_xml("demo1")
    assert "vhostuser" in xml and "/run/vstor/vhost/demo1-vdb" in xml and "vstor:plan" in xml
    # applying again keeps the same plan
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "apply", "demo1"]) == 0
    assert _domain_xml("demo1") == xml
    conn.lookupByName("demo1").undefine()


def _second_define_refused(monkeypatch):
    """libvirt refuses the second step of a define with cells (the spares)."""
    from vstor.errors import BadInput
    from vstor.runtime import virt
    real, calls = virt.define, []

    def define(conn, xml):
        calls.append(xml)
        if len(calls) == 2:
            raise BadInput("libvirt refused the rendered domain: (the test's refusal)")
        return real(conn, xml)
    monkeypatch.setattr(virt, "define", define)
    return calls


def test_a_define_with_cells_whose_second_step_is_refused_leaves_nothing(host_layout, cfg, capsys,
                                                                          testconn, monkeypatch):
    calls = _second_define_refused(monkeypatch)
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "define",
                 os.path.join(TEMPLATES, "vhost-two-nodes.xml")]) == 2
    assert "the test's refusal" in capsys.readouterr().err and len(calls) == 2
    assert "db1" not in testconn.listDefinedDomains()


def test_a_define_whose_spares_are_refused_after_the_first_step_leaves_nothing(host_layout, cfg, capsys,
                                                                                testconn, monkeypatch):
    """with_spares refusing (no controller index left) comes after libvirt
    defined the first step: that definition goes too."""
    from vstor.cli import domains
    from vstor.errors import BadInput

    def refused(dom):
        raise BadInput("domain 'db1': no PCI controller index is left for the spare root port")
    monkeypatch.setattr(domains, "with_spares", refused)
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "define",
                 os.path.join(TEMPLATES, "vhost-two-nodes.xml")]) == 2
    assert "no PCI controller index is left" in capsys.readouterr().err
    assert "db1" not in testconn.listDefinedDomains()


def test_an_apply_with_cells_whose_second_step_is_refused_keeps_the_definition(host_layout, cfg, capsys,
                                                                                testconn, monkeypatch):
    from lxml import etree
    name = etree.fromstring(open(os.path.join(TEMPLATES, "vhost-two-nodes.xml"), "rb").read()).findtext("name")
    testconn.defineXML(open(os.path.join(TEMPLATES, "vhost-two-nodes.xml")).read())
    before = testconn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    calls = _second_define_refused(monkeypatch)
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "apply", name]) == 2
    assert len(calls) == 3          # the first step, the refused second, the definition put back
    assert testconn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) == before
    testconn.lookupByName(name).undefine()


def test_apply_of_an_unknown_domain_is_bad_input(host_layout, cfg, capsys):
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "apply", "nope"]) == 2
    assert "domain 'nope' is not defined" in capsys.readouterr().err


def test_define_dry_run_defines_nothing(host_layout, cfg, capsys, testconn):
    assert main(["-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"), "define", "--dry-run",
                 os.path.join(TEMPLATES, "qsd-file.xml")]) == 0
    assert "vhostuser" in capsys.readouterr().out
    with pytest.raises(libvirt.libvirtError):
        libvirt.open(URI).lookupByName("demo1")


# -- host commands -------------------------------------------------------------------------

def test_doctor_reports_each_check_with_a_fix(host_layout, cfg):
    out = vstor("-c", URI, "--config", cfg, "--host-root", host_layout("no-iommu"), "doctor")
    assert out.returncode in (0, 1)
    assert "WARN  iommu" in out.stdout and "intel_iommu=on iommu=pt" in out.stdout
    assert "WARN  vfio-pci" in out.stdout and "modprobe vfio-pci" in out.stdout
    data = json.loads(vstor("-c", URI, "--config", cfg, "--host-root", host_layout("two-socket"),
                            "doctor", "--json").stdout)
    by_name = {c["name"]: c for c in data}
    assert by_name["iommu"]["status"] == "ok" and by_name["rdma mlx5_0"]["status"] == "ok"
    assert by_name["spdk"]["status"] == "warn" and "SPDK" in by_name["spdk"]["detail"]


def test_doctor_says_whether_the_libvirt_hook_is_installed_current_and_read(host_layout, cfg, tmp_path):
    from vstor.host import doctor
    root = host_layout("two-socket")
    data = json.loads(vstor("-c", URI, "--config", cfg, "--host-root", root, "doctor", "--json").stdout)
    hook = {c["name"]: c for c in data}["libvirt hook"]
    assert hook["detail"].startswith(f"no vstor hook at {root}/etc/libvirt/hooks/qemu.d/vstor")
    assert hook["fix"].startswith("vstor hooks install, then restart libvirtd")

    from vstor.cli.hooks import render_hook
    path, now = tmp_path / "vstor", render_hook(None)
    daemon = [(4242, "libvirtd", os.stat(tmp_path).st_mtime - 100)]   # started before the install
    check = doctor.check_hook(str(path), now, daemon)
    assert (check.status, check.fix.split(" (")[0]) == ("fail", "vstor hooks install, then restart libvirtd")
    assert "without systemd: stop the running libvirtd, then libvirtd -d" in check.fix
    path.write_text(now)
    path.chmod(0o755)
    check = doctor.check_hook(str(path), now, daemon)
    assert check.status == "warn" and "installed after libvirtd pid 4242 started" in check.detail
    later = [(4242, "libvirtd", os.stat(path).st_mtime + 0.5)]
    assert doctor.check_hook(str(path), now, later).status == "ok"
    assert "no libvirtd runs" in doctor.check_hook(str(path), now, []).detail
    path.write_text(now.replace(sys.executable, "/opt/gone/bin/python3"))
    check = doctor.check_hook(str(path), now, later)
    assert check.status == "fail" and "runs /opt/gone/bin/python3, which does not exist" in check.detail
    path.write_text(render_hook("/etc/vstor/other.conf"))
    check = doctor.check_hook(str(path), now, later)
    assert check.status == "warn" and "reads config /etc/vstor/other.conf" in check.detail
    path.write_text(now + "# an older hook\n")
    check = doctor.check_hook(str(path), now, later)
    assert check.status == "warn" and "another version" in check.detail
    path.write_text("#!/bin/sh\nexec logger started\n")
    assert doctor.check_hook(str(path), now, later).detail == f"{path} is not vstor's hook"


def test_libvirt_daemons_are_read_from_proc_with_their_start_time():
    from vstor.host import doctor
    for pid, name, started in doctor.libvirt_daemons():
        assert name in ("libvirtd", "virtqemud") and 0 < started <= time.time()
    assert doctor.libvirt_daemons("/nonexistent") == []


@pytest.mark.parametrize("euid, words", [(0, "does not exist and cannot be made: create it"),
                                         (1000, "(run as root)")])
def test_hooks_install_into_a_directory_it_cannot_make(tmp_path, capsys, monkeypatch, euid, words):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    assert main(["hooks", "install", "--dir", str(afile / "qemu.d")]) == 2
    err = capsys.readouterr().err
    assert f"cannot install the hook into {afile}/qemu.d" in err and words in err
    assert euid != 0 or "run as root" not in err


def test_hooks_install_into_a_mistyped_directory_makes_nothing(tmp_path, capsys, monkeypatch):
    """--dir two levels below what exists (a typo) is refused; one level is made."""
    typo = tmp_path / "etc" / "libvrt" / "hooks" / "qemu.d"
    assert main(["hooks", "install", "--dir", str(typo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither it nor" in err and "leave out --dir" in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    assert main(["hooks", "install", "--dir", ""]) == 2       # not ./vstor
    assert "--dir is empty" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    assert main(["hooks", "install", "--dir", str(tmp_path / "a\nb")]) == 2   # one level down, but a slip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a control character" in err and list(tmp_path.iterdir()) == []
    assert main(["hooks", "install", "--dir", str(tmp_path / "qemu.d")]) == 0
    assert (tmp_path / "qemu.d" / "vstor").stat().st_mode & 0o111


def test_host_show_and_capture_round_trip(host_layout, cfg, tmp_path):
    root = host_layout("two-socket")
    shown = vstor("--host-root", root, "host", "show", check_code=0).stdout
    assert "Host compute-7: 64 CPUs, 2 NUMA nodes, IOMMU on" in shown and "nvme 0000:5e:00.0" in shown
    tarball = tmp_path / "cap.tar.gz"
    vstor("--host-root", root, "host", "capture", "-o", str(tarball), check_code=0)
    extracted = tmp_path / "x"
    extracted.mkdir()
    subprocess.run(["tar", "-xzf", str(tarball), "-C", str(extracted)], check=True)
    again = vstor("--host-root", str(extracted), "host", "show", check_code=0).stdout
    assert again == shown


def test_a_control_character_in_a_message_is_shown_escaped_never_a_second_line():
    from vstor.errors import BadInput
    assert str(BadInput("domain 'a\nb'", hint="x\x1b[2J\u2028")) == "domain 'a\\nb' (x\\x1b[2J\\u2028)"
    assert str(BadInput("naïve é")) == "naïve é"


# -- issue 28: plan says where a disk can be attached live ------------------------------------

def test_plan_says_how_many_spare_root_ports_the_domain_will_have(host_layout, cfg, tmp_path):
    """What libvirt leaves after the define: a q35 guest's empty root ports
    less those its devices take (vstor's disks, and the USB controller and
    balloon libvirt adds); one spare per guest cell for a guest with cells."""
    def plan(name, ports=0):
        text = open(os.path.join(TEMPLATES, f"{name}.xml")).read()
        path = tmp_path / f"{name}.xml"
        path.write_text(text.replace("<devices>", "<devices>" + "<controller type='pci' model='pcie-root-port'/>"
                                     * ports, 1))
        return vstor("--config", cfg, "--host-root", host_layout("two-socket"), "plan", str(path),
                     check_code=0).stdout
    assert "\nHot-plug: 0 spare PCIe root ports\n" in plan("vhost-local-nvme")
    # five ports: its root disk, vstor's vdb, the USB controller and the balloon take four
    assert "\nHot-plug: 1 spare PCIe root port\n" in plan("vhost-local-nvme", ports=5)
    assert "\nHot-plug: spare PCIe root ports per guest cell: 0: 1, 1: 1\n" in plan("vhost-two-nodes")
    assert "Hot-plug" not in plan("qsd-file")          # i440fx: pci.0's slots, no ports


# -- define over a defined domain ------------------------------------------------------------


def test_define_over_a_defined_domain_points_at_replace_which_plans_the_new_file(host_layout, tmp_path, capsys):
    """`vstor apply NAME` re-plans the definition libvirt has, not the new
    file: the advice is `define --replace FILE`, which keeps the UUID."""
    import os
    import libvirt
    from vstor.meta.document import Domain
    conn = libvirt.open(URI)        # the test driver's domains live while a connection is open
    cfg = tmp_path / "vstor.conf"
    cfg.write_text(f"[cpu]\nreactors = 2,18\n[paths]\nstate_dir = {tmp_path}/state\nvhost_dir = /run/vstor/vhost\n")
    base = ["-c", URI, "--config", str(cfg), "--host-root", host_layout("two-socket")]
    first = open(os.path.join(TEMPLATES, "vhost-local-nvme.xml")).read()
    (tmp_path / "a.xml").write_text(first)
    try:
        assert main([*base, "define", str(tmp_path / "a.xml")]) == 0
        uuid = conn.lookupByName("web1").UUIDString()
        new = tmp_path / "b.xml"
        new.write_text(first.replace("0000:5f:00.0", "0000:60:00.0"))
        if "<uuid>" in first:
            new.write_text(new.read_text().split("<uuid>")[0] + new.read_text().split("</uuid>")[1])
        capsys.readouterr()
        assert main([*base, "define", str(new)]) == 2
        err = capsys.readouterr().err
        assert f"vstor define --replace {new}" in err and "vstor apply" not in err and err.count("\n") == 1
        assert main([*base, "define", "--replace", str(new)]) == 0
        now = Domain.parse(conn.lookupByName("web1").XMLDesc(0))
        assert now.uuid == uuid.lower()
        assert [d.controller for d in now.recorded_plan().disks] == ["0000:60:00.0"]
        other = tmp_path / "c.xml"
        other.write_text(new.read_text().replace("<name>web1</name>",
                                                 "<name>web1</name><uuid>0d2f7a4e-0000-4000-8000-000000000001</uuid>"))
        assert main([*base, "define", "--replace", str(other)]) == 2
        assert "another domain of the same name" in capsys.readouterr().err
    finally:
        for name in conn.listDefinedDomains():
            if name == "web1":
                conn.lookupByName(name).undefine()
        conn.close()


# -- doctor: a venv's python and python3 are one Python ------------------------------------------


def test_doctor_takes_a_venvs_python_and_python3_as_one(tmp_path):
    import os
    import sys
    from vstor.cli.hooks import render_hook
    from vstor.host import doctor
    venv, other = tmp_path / "venv", tmp_path / "other"
    for v in (venv, other):
        (v / "bin").mkdir(parents=True)
        (v / "pyvenv.cfg").write_text(f"home = {os.path.dirname(sys.executable)}\n")
        os.symlink(sys.executable, v / "bin" / "python3")
        os.symlink("python3", v / "bin" / "python")
    py3, py = str(venv / "bin" / "python3"), str(venv / "bin" / "python")
    assert doctor.same_python(py, py3) and doctor.same_python(py3, py3)
    assert not doctor.same_python(py, str(other / "bin" / "python3"))     # another venv, one base
    assert not doctor.same_python(py, py3 + " -I") and not doctor.same_python(py, "/nonexistent/python")

    now = render_hook(None)
    expected = now.replace(f"PYTHON={sys.executable}", f"PYTHON={py3}")
    hook = tmp_path / "vstor"
    hook.write_text(now.replace(f"PYTHON={sys.executable}", f"PYTHON={py}"))
    hook.chmod(0o755)
    check = doctor.check_hook(str(hook), expected, [])
    assert check.status == "ok", check
    hook.write_text(now.replace(f"PYTHON={sys.executable}", f"PYTHON={other}/bin/python3"))
    check = doctor.check_hook(str(hook), expected, [])
    assert check.status == "warn" and f"runs {other}/bin/python3; this vstor runs under {py3}" in check.detail


def test_doctor_judges_the_packages_hook_against_what_the_package_installs(tmp_path):
    """The Debian package's hook (debian/rules writes vstor.cli.hooks.packaged_hook)
    is not "another version" of what `vstor hooks install` would write
    (issue 30): it is checked against the package's own form."""
    from vstor.cli.hooks import packaged_hook, render_hook
    from vstor.host import doctor
    path, ours = tmp_path / "vstor", packaged_hook()
    assert "\nPYTHON=/usr/bin/python3\n" in ours and "\nSYSPATH=/usr/lib/python3/dist-packages\n" in ours
    assert "apt-get install vstor" in ours and ours != render_hook(None)
    check = doctor.check_hook(str(path), ours, [], packaged=True)
    assert (check.status, check.fix) == ("fail", "apt-get install --reinstall vstor, then " + doctor.RESTART)
    path.write_text(ours)
    path.chmod(0o755)
    later = [(4242, "libvirtd", os.stat(path).st_mtime + 0.5)]
    check = doctor.check_hook(str(path), ours, later, packaged=True)
    assert check.status == "ok" and check.detail == f"{path} the vstor package's hook, read by libvirtd pid 4242"
    before = [(4242, "libvirtd", os.stat(path).st_mtime - 100)]
    check = doctor.check_hook(str(path), ours, before, packaged=True)
    assert check.status == "warn" and "after an upgrade nothing needs restarting" in check.detail
    path.write_text(ours + "# edited\n")
    check = doctor.check_hook(str(path), ours, later, packaged=True)
    assert (check.status, check.fix) == ("warn", "apt-get install --reinstall vstor")
