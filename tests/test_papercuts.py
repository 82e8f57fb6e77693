"""Papercuts of issue 22: each refusal says what is wrong and the fix that
applies to the case at hand."""

import pytest

from tests.test_lifecycle import env  # noqa: F401 (a fixture)

from tests.test_planner import request
from vstor.config import Config
from vstor.errors import BadInput
from vstor.cli.main import main
from vstor.planner import plan_domain
from vstor.planner.ledger import Ledger


# -- a loop device as a block source ---------------------------------------------------------

@pytest.mark.parametrize("path, words, fix", [
    ("/dev/loop0", "/dev/loop0 is a loop device: vstor does not serve a loop device, as the file behind "
                   "it may lie outside the image roots", "losetup --list /dev/loop0"),
    ("/dev/zram0", "is a RAM disk", "use a disk, a partition or a file"),
    ("/dev/nvme1c1n1", "one path of a multipath NVMe namespace", "use its head device /dev/nvme1n1"),
])
def test_a_device_that_is_never_a_block_source_says_why_and_what_instead(host_model, path, words, fix):
    with pytest.raises(BadInput) as e:
        plan_domain(host_model("nvme-root"), Config(),
                    request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>"), Ledger())
    assert words in e.value.message and fix in e.value.hint
    assert "not a disk" not in e.value.message


def test_host_show_lists_the_block_sources_vstor_would_take(host_layout, capsys):
    assert main(["--host-root", host_layout("nvme-root"), "host", "show"]) == 0
    out = capsys.readouterr().out
    assert "  block sources vstor would take: /dev/nvme1n1 (1000 GB)\n" in out
    assert "    not /dev/nvme0n1p1: mounted at /boot\n" in out and "    not /dev/dm-1: swap\n" in out
    # What it lists it takes: each one listed plans; each refused one does not.
    from vstor.host.read import block_sources
    from tests.test_planner import refused
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    host = read_host(SysFS(host_layout("nvme-root")))
    for path, _, use in block_sources(host):
        req = request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>")
        if use:
            assert use[0] in refused(host, Config(), req)
        else:
            assert plan_domain(host, Config(), req, Ledger()).disks[0].source.path == path


# -- define over a defined domain ------------------------------------------------------------

def test_define_over_a_defined_domain_points_at_replace_which_plans_the_new_file(host_layout, tmp_path, capsys):
    """`vstor apply NAME` re-plans the definition libvirt has, not the new
    file: the advice is `define --replace FILE`, which keeps the UUID."""
    import os
    import libvirt
    from tests.test_cli import TEMPLATES, URI
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


# -- hot-plug into an i440fx guest -------------------------------------------------------------

def _i440fx(dom, acpi: bool, root_hotplug: str | None = None):
    from vstor.meta.document import Domain
    text = dom.to_string().replace("machine=\"q35\"", "machine=\"pc-i440fx-9.2\"")
    if acpi:
        text = text.replace("<devices>", "<features><acpi/></features><devices>", 1)
    if root_hotplug:
        text = text.replace("<devices>", f"<devices><controller type='pci' index='0' model='pci-root'>"
                                         f"<target hotplug='{root_hotplug}'/></controller>", 1)
    return Domain.parse(text)


def test_hot_plug_into_an_i440fx_guest_without_acpi_names_acpi_not_q35(env, tmp_path):
    from tests.test_hotplug import GuestDouble, disk, running
    from tests.test_lifecycle import LOCAL, local_spdk  # noqa: F401
    from vstor.errors import ActionFailed, DoesNotFit
    from vstor.runtime.hotplug import attach
    dom = running(env, local_spdk())
    rec = env.state.load("vm1")
    for guest_dom, words, fix in (
            (_i440fx(dom, acpi=False), "is an i440fx guest without ACPI, and i440fx hot-plugs PCI devices "
                                       "through ACPI", "add <acpi/> to its <features>"),
            (_i440fx(dom, acpi=True, root_hotplug="off"), "has hot-plug off on its pci-root controller",
             "remove <target hotplug='off'/>")):
        guest = GuestDouble(guest_dom)
        with pytest.raises(DoesNotFit) as e:
            attach(env.rt(), env.state, env.host(), guest_dom,
                   disk(local_spdk("0000:60:00.0", "vdc"), tmp_path), guest)
        assert words in e.value.message and fix in e.value.hint and "q35" not in str(e.value)
        assert guest.calls == [] and env.state.load("vm1").steps == rec.steps
    # With ACPI, libvirt's own refusal gets the i440fx fix, not the q35 one.
    guest_dom = _i440fx(dom, acpi=True)
    guest = GuestDouble(guest_dom, refuse="No more available PCI slots")
    with pytest.raises(ActionFailed) as e:
        attach(env.rt(), env.state, env.host(), guest_dom, disk(local_spdk("0000:60:00.0", "vdc"), tmp_path), guest)
    assert "pci-bridge" in e.value.hint and "q35" not in e.value.hint
    assert env.state.load("vm1").steps == rec.steps


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
