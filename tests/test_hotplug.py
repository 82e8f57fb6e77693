"""vstor attach/detach below libvirt: the disk planned against the running
placement, its backend made through the SPDK target double, the kernel
sysfs double and real qemu-storage-daemons, and a failure at any step
(libvirt's included) leaving the domain's record and the host as they were.
libvirt's side is a named double here (GuestDouble); tests/e2e/test_hotplug.py
runs the real one with a running guest."""

import os
import time

import pytest

from tests.helpers import (LOCAL, GuestDouble, disk, file_disk, file_disks, flock_free, live, local_spdk,
                           rendered_domain, running)
from tests.helpers import spdk_nvmf as nvmf
from vstor.errors import ActionFailed, BadInput, DoesNotFit
from vstor.meta.document import Domain, load_disk
from vstor.runtime.hotplug import attach, detach
from vstor.meta.names import gate_path
from vstor.runtime.lifecycle import prepare, release

NS = "https://vstor.dev/xmlns/domain/1"
OTHER = "0000:60:00.0"


def test_an_spdk_disk_is_added_on_the_domains_node_and_reactor_and_removed_again(env, tmp_path):
    dom = running(env, local_spdk())
    before = env.state.load("vm1").steps
    guest = GuestDouble(dom)
    plan = attach(env.rt(), env.state, env.host(), dom,
                  disk(local_spdk(OTHER, "vdc"), tmp_path), guest, progress=lambda _m: None)
    added = plan.disk("vdc")
    assert (added.backend, added.reactor, plan.node) == ("spdk", 18, 1)    # node 1's reactor
    assert env.sysfs.driver_of(OTHER) == "vfio-pci"
    assert {v.bdev for v in env.spdk.vhost.values()} == {"vs_0000_5f_00_0n1", "vs_0000_60_00_0n1"}
    (call,) = guest.calls
    assert call[0] == "attach" and f"{env.cfg.vhost_dir}/vm1-vdc" in call[1] and call[3] is False
    now = live(dom, guest)
    assert now.recorded_plan() == plan and [d.target for d in now.intent().disks] == ["vdb", "vdc"]
    rec = env.state.load("vm1")
    assert rec.steps[:3] == before and len(rec.steps) == 6 and rec.status == "prepared"
    assert sorted(rec.holding["sockets"]) == [f"{env.cfg.vhost_dir}/vm1-vdb", f"{env.cfg.vhost_dir}/vm1-vdc"]

    after = detach(env.rt(), env.state, now, "vdc", guest, 5.0, progress=lambda _m: None)
    assert [d.target for d in after.disks] == ["vdb"]
    assert env.sysfs.driver_of(OTHER) == "nvme" and env.sysfs.driver_of(LOCAL) == "vfio-pci"
    assert {v.bdev for v in env.spdk.vhost.values()} == {"vs_0000_5f_00_0n1"}
    rec = env.state.load("vm1")
    assert rec.steps == before and rec.holding["sockets"] == [f"{env.cfg.vhost_dir}/vm1-vdb"]
    assert guest.calls[-1][0] == "set_metadata"
    assert live(dom, guest).recorded_plan() == after
    release(env.rt(), env.state, "vm1")
    assert env.spdk.vhost == {} and env.state.records() == []


def test_a_disk_on_a_shared_remote_controller_leaves_the_controller_to_the_other(env, tmp_path):
    dom = running(env, nvmf(1), vm="<vstor:vm numa='preferred'/>")
    guest = GuestDouble(dom)
    attach(env.rt(), env.state, env.host(), dom, disk(nvmf(2, "vdc"), tmp_path), guest)
    assert len(env.spdk.nvme) == 1 and len(env.spdk.vhost) == 2      # one controller, both namespaces
    detach(env.rt(), env.state, live(dom, guest), "vdc", guest, 5.0)
    assert len(env.spdk.nvme) == 1 and {v.bdev for v in env.spdk.vhost.values()} == \
        {next(iter(env.spdk.nvme)) + "n1"}


@pytest.mark.parametrize("fault", ["libvirt", "vhost_create_blk_controller"])
def test_a_failed_attach_leaves_the_domain_and_host_as_they_were(env, tmp_path, fault):
    dom = running(env, local_spdk())
    rec = env.state.load("vm1")
    spdk = (dict(env.spdk.nvme), dict(env.spdk.vhost))
    guest = GuestDouble(dom, refuse="No more available PCI slots" if fault == "libvirt" else None)
    if fault != "libvirt":
        env.spdk.fail(fault, -5, "Input/output error")
    with pytest.raises(ActionFailed):
        attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path), guest)
    after = env.state.load("vm1")
    assert (after.steps, after.holding, after.status) == (rec.steps, rec.holding, "prepared")
    assert (env.spdk.nvme.keys(), env.spdk.vhost.keys()) == (spdk[0].keys(), spdk[1].keys())
    assert env.sysfs.driver_of(OTHER) == "nvme"
    assert [c[0] for c in guest.calls] == (["attach"] if fault == "libvirt" else [])


def test_qsd_disks_are_added_and_removed_with_real_daemons(env, tmp_path):
    _, paths = file_disks(env, "bc", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    guest = GuestDouble(dom)
    plan = attach(env.rt(), env.state, env.host(), dom, disk(file_disk(paths[1], "vdc"), tmp_path), guest)
    assert plan.disk("vdc").backend == "qsd"
    assert sorted(os.listdir(env.cfg.vhost_dir)) == ["vm1-vdb", "vm1-vdc"]
    detach(env.rt(), env.state, live(dom, guest), "vdc", guest, 5.0)
    assert sorted(f for f in os.listdir(env.cfg.vhost_dir) if f.startswith("vm1")) == ["vm1-vdb"]
    assert sorted(f for f in os.listdir(env.cfg.qsd_dir) if f.startswith("vm1-vdc")) == []


def test_the_prepared_mark_outlives_an_attach_and_a_detach(env, tmp_path):
    """The mark is the whole domain's, no disk's: an attach (which undoes
    the steps of a disk the guest never got) and a detach leave it."""
    _, paths = file_disks(env, "bc", size=8 << 20)
    mark = gate_path(env.cfg.vhost_dir, "vm1")
    dom = rendered_domain(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>", gate=mark)
    prepare(env.rt(), env.state, env.host(), dom)
    guest = GuestDouble(dom)
    attach(env.rt(), env.state, env.host(), dom, disk(file_disk(paths[1], "vdc"), tmp_path), guest)
    assert os.path.exists(mark) and "gate" in [s["kind"] for s in env.state.load("vm1").steps]
    detach(env.rt(), env.state, live(dom, guest), "vdc", guest, 5.0)
    assert os.path.exists(mark) and "gate" in [s["kind"] for s in env.state.load("vm1").steps]
    release(env.rt(), env.state, "vm1")
    assert not os.path.exists(mark)


def _killed_attach(env, dom, guest, new) -> int:
    """attach in a child killed right before libvirt would attach the
    device (after the daemon started); the orphaned daemon's pid."""
    child = os.fork()
    if child == 0:      # pragma: no cover (the killed attach)
        guest.attach = lambda *_a: os._exit(9)
        attach(env.rt(), env.state, env.host(), dom, new, guest, progress=lambda _m: None)
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 9
    return int(open(os.path.join(env.cfg.qsd_dir, f"vm1-{new.target}.pid")).read())


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("again", ["the same disk", "another disk"])
def test_an_attach_killed_before_the_guest_had_its_disk_is_undone_by_the_next(env, tmp_path, again):
    """Killed (SIGKILL, power lost) after the daemon started but before
    libvirt attached the device: the record holds the new disk's step and
    the live plan has no such disk.  The next attach undoes it first, as a
    prepare undoes an interrupted prepare, then does its own."""
    _, paths = file_disks(env, "bcd", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    before = env.state.load("vm1")
    guest = GuestDouble(dom)
    killed = disk(file_disk(paths[1], "vdc"), tmp_path)
    orphan = _killed_attach(env, dom, guest, killed)
    left = env.state.load("vm1")
    assert len(left.steps) == len(before.steps) + 1 and left.holding != before.holding
    new = killed if again == "the same disk" else disk(file_disk(paths[2], "vdd"), tmp_path)
    plan = attach(env.rt(), env.state, env.host(), dom, new, guest, progress=lambda _m: None)
    assert [c[0] for c in guest.calls] == ["attach"] and [d.target for d in plan.disks] == ["vdb", new.target]
    now = env.state.load("vm1")
    assert now.steps[:len(before.steps)] == before.steps and len(now.steps) == len(before.steps) + 1
    assert _gone(orphan) and now.holding["sockets"] == sorted(
        f"{env.cfg.vhost_dir}/vm1-{t}" for t in ("vdb", new.target))
    assert sorted(f for f in os.listdir(env.cfg.vhost_dir) if f.startswith("vm1")) == ["vm1-vdb", f"vm1-{new.target}"]
    release(env.rt(), env.state, "vm1")


def test_a_qsd_disk_starts_without_the_host_lock_and_spdk_steps_under_it(env, tmp_path, monkeypatch):
    """As prepare: the host lock covers the decision; the new disk's own
    daemon starts after it is let go, SPDK's shared controller under it."""
    from vstor.runtime import executor
    seen, real = [], executor.do
    lock = os.path.join(env.cfg.state_dir, "lock")
    monkeypatch.setattr(executor, "do", lambda a, rt: seen.append((a.kind, flock_free(lock))) or real(a, rt))
    _, paths = file_disks(env, "bc", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    seen.clear()
    attach(env.rt(), env.state, env.host(), dom, disk(file_disk(paths[1], "vdc"), tmp_path),
           GuestDouble(dom), progress=lambda _m: None)
    assert seen == [("qsd-export", True)]
    release(env.rt(), env.state, "vm1")
    dom = running(env, local_spdk())
    seen.clear()
    attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path),
           GuestDouble(dom), progress=lambda _m: None)
    assert seen == [("vfio-bind", False), ("spdk-attach", False), ("spdk-vhost", False)]
    release(env.rt(), env.state, "vm1")


def test_refusals_name_the_reason_and_change_nothing(env, tmp_path):
    pt = "<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:61:00.0'/></vstor:disk>"
    dom = running(env, pt)
    img = os.path.join(env.work, "x.raw")
    open(img, "wb").close()
    cases = [
        (f"<vstor:disk target='vdc'><vstor:file path='{img}'/></vstor:disk>", DoesNotFit,
         "its memory is not shared"),
        (pt, BadInput, "already has a vstor disk vdb"),
        (nvmf(1, "vdc"), DoesNotFit, "is on node 0 and the domain runs on node 1 (numa='strict')"),
        ("<vstor:disk target='vdc' mode='passthrough' guest='spdk'><vstor:nvme controller='0000:60:00.0'/>"
         "</vstor:disk>", DoesNotFit, "guest='spdk' needs a vIOMMU"),
    ]
    rec = env.state.load("vm1")
    for text, err, words in cases:
        guest = GuestDouble(dom)
        with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
            attach(env.rt(), env.state, env.host(), dom, disk(text, tmp_path), guest)
        assert guest.calls == [] and env.state.load("vm1").steps == rec.steps
    with pytest.raises(BadInput, match="last vstor disk"):
        detach(env.rt(), env.state, dom, "vdb", GuestDouble(dom), 5.0)
    with pytest.raises(BadInput, match=r"has no vstor disk vdq \(its vstor disks: vdb\)"):
        detach(env.rt(), env.state, dom, "vdq", GuestDouble(dom), 5.0)
    release(env.rt(), env.state, "vm1")
    with pytest.raises(DoesNotFit, match="is not running on what vstor prepared"):
        attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path),
               GuestDouble(dom))
    with pytest.raises(BadInput, match="persistent definition"):
        attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path),
               GuestDouble(dom, plan=None), persistent=True)


def test_a_guest_that_does_not_let_go_keeps_everything(env, tmp_path):
    dom = running(env, local_spdk())
    guest = GuestDouble(dom)
    attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path), guest)
    now, rec = live(dom, guest), env.state.load("vm1")
    guest.refuse = "stuck"
    with pytest.raises(ActionFailed, match="did not let go"):
        detach(env.rt(), env.state, now, "vdc", guest, 0.5)
    assert env.state.load("vm1").steps == rec.steps and len(env.spdk.vhost) == 2
    guest.refuse = None
    guest.present.discard("vdc")        # the guest let go later: detach again finishes the job
    detach(env.rt(), env.state, now, "vdc", guest, 0.5)
    assert len(env.spdk.vhost) == 1
    assert [c[0] for c in guest.calls] == ["attach", "detach", "set_metadata"]  # not asked twice


def test_a_dry_run_attach_changes_nothing(env, tmp_path):
    dom = running(env, local_spdk())
    rec, said = env.state.load("vm1"), []
    rt = env.rt()
    rt.dry_run = True
    attach(rt, env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path), GuestDouble(dom),
           progress=said.append)
    assert env.state.load("vm1").steps == rec.steps and len(env.spdk.vhost) == 1
    assert any("bdev_nvme_attach_controller" in s for s in said)
    assert any("<disk type=\"vhostuser\"" in s for s in said)


def test_a_disk_file_that_is_not_one_vstor_disk_is_one_line(tmp_path):
    cases = [("<disk type='file'/>", "the root element is <disk>, not <vstor:disk>"),
             (f"<vstor:disk xmlns:vstor='{NS}' target='vdc'/>", "source"),
             (f"<vstor:disk xmlns:vstor='{NS}' target='sda'><vstor:file path='/x'/></vstor:disk>", "sda"),
             ("<vstor:disk", "malformed XML at line 1")]
    for text, words in cases:
        path = tmp_path / "d.xml"
        path.write_text(text)
        with pytest.raises(BadInput, match=words) as e:
            load_disk(str(path))
        assert "\n" not in str(e.value) and str(e.value).startswith(str(path))
    with pytest.raises(BadInput, match="cannot read"):
        load_disk(str(tmp_path / "absent.xml"))


def test_a_second_attach_reads_the_domain_again_and_keeps_the_first(env, tmp_path):
    _, paths = file_disks(env, "bcd", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    guest = GuestDouble(dom)
    for target, path in (("vdc", paths[1]), ("vdd", paths[2])):     # `dom` as read before both
        attach(env.rt(), env.state, env.host(), dom, disk(file_disk(path, target), tmp_path), guest)
    now = live(dom, guest)
    assert [d.target for d in now.intent().disks] == ["vdb", "vdc", "vdd"]
    assert [d.target for d in now.recorded_plan().disks] == ["vdb", "vdc", "vdd"]
    assert len(env.state.load("vm1").holding["sockets"]) == 3


def _crashed_attach(env, dom, guest, new, crash_at: int | None, metadata: str) -> bool:
    """attach in a child that SIGKILLs itself at its crash_at-th crash point
    (tests/crash_child.py's: every record save, before its rename too, and
    before and after every step, then libvirt's: the new metadata taken,
    the device not yet, LiveDomain.attach's order), or at libvirt's alone
    (crash_at None); the metadata libvirt would then keep is written to
    `metadata`.  True when it was killed."""
    import signal
    from tests.crash_child import CrashPoints, install
    child = os.fork()
    if child == 0:      # pragma: no cover (the killed attach)
        points = CrashPoints(crash_at or 0)
        install(points)

        def attach_device(_device, element, _persistent=False):
            with open(metadata, "w") as f:
                f.write(element)
            points.point("libvirt: metadata set, device not yet attached")
            if crash_at is None:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(0)
        guest.attach = attach_device
        attach(env.rt(), env.state, env.host(), dom, new, guest, progress=lambda _m: None)
        os._exit(3)
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.waitstatus_to_exitcode(status) == 0
    return False


def test_an_attach_killed_anywhere_is_finished_by_the_next_of_the_same_disk(env, tmp_path):
    """SIGKILL at every crash point of an attach of an SPDK disk (three
    steps that other disks may share: a bind, an SPDK controller, a vhost
    controller), the metadata's too: the next attach of the same disk undoes
    what the killed one left and makes it again, to the same record and the
    same SPDK state as an attach that was never interrupted."""
    dom = running(env, local_spdk())
    before = env.state.load("vm1")
    new = disk(local_spdk(OTHER, "vdc"), tmp_path)
    meta = str(tmp_path / "metadata.xml")
    clean_guest = GuestDouble(dom)
    attach(env.rt(), env.state, env.host(), dom, new, clean_guest, progress=lambda _m: None)
    clean = env.state.load("vm1")
    clean_spdk = (sorted(env.spdk.nvme), sorted(env.spdk.vhost))
    detach(env.rt(), env.state, live(dom, clean_guest), "vdc", clean_guest, 5.0, progress=lambda _m: None)
    assert env.state.load("vm1").steps == before.steps
    killed = 0
    for crash_at in range(1, 40):
        guest = GuestDouble(dom)
        if os.path.exists(meta):
            os.unlink(meta)
        if not _crashed_attach(env, dom, guest, new, crash_at, meta):
            break
        killed += 1
        if os.path.exists(meta):        # libvirt kept the new metadata, not the device
            guest.set_metadata(open(meta).read())
        started = time.monotonic()
        plan = attach(env.rt(), env.state, env.host(), live(dom, guest), new, guest, progress=lambda _m: None)
        assert time.monotonic() - started < 30
        assert [d.target for d in plan.disks] == ["vdb", "vdc"] and guest.calls[-1][0] == "attach"
        rec = env.state.load("vm1")
        assert [(e["kind"], e["state"], e["data"]) for e in rec.steps] == \
            [(e["kind"], e["state"], e["data"]) for e in clean.steps], crash_at
        assert rec.holding == clean.holding and rec.status == "prepared"
        assert (sorted(env.spdk.nvme), sorted(env.spdk.vhost)) == clean_spdk, crash_at
        detach(env.rt(), env.state, live(dom, guest), "vdc", guest, 5.0, progress=lambda _m: None)
        assert env.state.load("vm1").steps == before.steps and env.sysfs.driver_of(OTHER) == "nvme"
    assert killed >= 10         # every save and step of the attach, and libvirt's metadata
    release(env.rt(), env.state, "vm1")


@pytest.mark.parametrize("again", ["the same disk", "another disk"])
def test_an_attach_killed_between_metadata_and_device_is_taken_out_by_the_next(env, tmp_path, again):
    """libvirt took the new metadata (the live plan has the disk) and the
    guest never got the device: the next attach takes the disk out of the
    live metadata, undoes its backend (its real daemon stops), then does
    its own."""
    _, paths = file_disks(env, "bcd", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    before = env.state.load("vm1")
    guest = GuestDouble(dom)
    killed = disk(file_disk(paths[1], "vdc"), tmp_path)
    meta = str(tmp_path / "metadata.xml")
    assert _crashed_attach(env, dom, guest, killed, None, meta)
    guest.set_metadata(open(meta).read())
    orphan = int(open(os.path.join(env.cfg.qsd_dir, "vm1-vdc.pid")).read())
    assert [d.target for d in live(dom, guest).recorded_plan().disks] == ["vdb", "vdc"]
    new = killed if again == "the same disk" else disk(file_disk(paths[2], "vdd"), tmp_path)
    said = []
    plan = attach(env.rt(), env.state, env.host(), live(dom, guest), new, guest, progress=said.append)
    assert any("vdc is in vm1's plan but not in the guest" in m for m in said)
    assert [c[0] for c in guest.calls] == ["set_metadata", "set_metadata", "attach"]
    assert [d.target for d in plan.disks] == ["vdb", new.target]
    assert [d.target for d in live(dom, guest).intent().disks] == ["vdb", new.target]
    now = env.state.load("vm1")
    assert now.steps[:len(before.steps)] == before.steps and len(now.steps) == len(before.steps) + 1
    assert _gone(orphan) and now.holding["sockets"] == sorted(
        f"{env.cfg.vhost_dir}/vm1-{t}" for t in ("vdb", new.target))
    release(env.rt(), env.state, "vm1")


def test_attach_plans_under_the_planning_lock_and_lets_it_go_once_recorded(env, tmp_path, monkeypatch):
    from vstor.runtime import executor
    import fcntl
    from vstor.errors import Unavailable
    lock = os.path.join(env.cfg.state_dir, "plan.lock")
    _, paths = file_disks(env, "bc", size=8 << 20)
    dom = running(env, file_disk(paths[0]), vm="<vstor:vm cpus='shared'/>")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    seen, real = [], executor.do
    monkeypatch.setattr(executor, "do", lambda a, rt: seen.append((a.kind, flock_free(lock))) or real(a, rt))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)      # another run is planning
        with pytest.raises(Unavailable, match="the planning lock .* stayed locked"):
            monkeypatch.setattr(env.state, "planning", _short(env.state.planning))
            attach(env.rt(), env.state, env.host(), dom, disk(file_disk(paths[1], "vdc"), tmp_path),
                   GuestDouble(dom), progress=lambda _m: None)
    finally:
        os.close(fd)
    assert seen == [] and len(env.state.load("vm1").steps) == 1
    attach(env.rt(), env.state, env.host(), dom, disk(file_disk(paths[1], "vdc"), tmp_path),
           GuestDouble(dom), progress=lambda _m: None)
    assert seen == [("qsd-export", True)]
    release(env.rt(), env.state, "vm1")


def _short(planning):
    return lambda timeout=0.3, dry_run=False: planning(timeout=0.3, dry_run=dry_run)


# -- issue 28: a q35 guest's free root ports, foreseen -----------------------------------------

# A q35 domain as libvirt 9.0 defines it (every device addressed): root ports
# 1-5, the NIC on 1, the USB controller on 2, the balloon on 3; 4 is free,
# 5 has hot-plug off.
DEFINED_Q35 = """<domain type='kvm'><name>web1</name><memory unit='KiB'>1048576</memory><vcpu>2</vcpu>
  <os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>
  <devices>
    <controller type='pci' index='0' model='pcie-root'><alias name='pcie.0'/></controller>
    <controller type='pci' index='1' model='pcie-root-port'><model name='pcie-root-port'/>
      <target chassis='1' port='0x10'/><alias name='pci.1'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0' multifunction='on'/></controller>
    <controller type='pci' index='2' model='pcie-root-port'><model name='pcie-root-port'/>
      <target chassis='2' port='0x11'/><alias name='pci.2'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x1'/></controller>
    <controller type='pci' index='3' model='pcie-root-port'><model name='pcie-root-port'/>
      <target chassis='3' port='0x12'/><alias name='pci.3'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x2'/></controller>
    <controller type='pci' index='4' model='pcie-root-port'><model name='pcie-root-port'/>
      <target chassis='4' port='0x13'/><alias name='pci.4'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x3'/></controller>
    <controller type='pci' index='5' model='pcie-root-port'><model name='pcie-root-port'/>
      <target chassis='5' port='0x14' hotplug='off'/><alias name='pci.5'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x4'/></controller>
    <controller type='usb' index='0' model='qemu-xhci'><alias name='usb'/>
      <address type='pci' domain='0x0000' bus='0x02' slot='0x00' function='0x0'/></controller>
    <controller type='sata' index='0'><alias name='ide'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x1f' function='0x2'/></controller>
    <interface type='network'><mac address='52:54:00:12:34:56'/><source network='default'/>
      <model type='virtio'/><alias name='net0'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></interface>
    <memballoon model='virtio'><alias name='balloon0'/>
      <address type='pci' domain='0x0000' bus='0x03' slot='0x00' function='0x0'/></memballoon>
  </devices></domain>"""


def test_the_spare_root_ports_of_a_defined_q35_domain_are_its_empty_hot_pluggable_ones():
    from vstor.runtime.hotplug import spare_ports
    dom = Domain.parse(DEFINED_Q35)
    assert spare_ports(dom, 1) == (1,)                      # root port 4
    taken = DEFINED_Q35.replace("</devices>", "<rng model='virtio'><backend model='random'>/dev/urandom</backend>"
                                "<address type='pci' domain='0x0000' bus='0x04' slot='0x00' function='0x0'/>"
                                "</rng></devices>")
    assert spare_ports(Domain.parse(taken), 1) == (0,)
    waiting = DEFINED_Q35.replace("</devices>", "<rng model='virtio'><backend model='random'>/dev/urandom"
                                  "</backend></rng></devices>")
    assert spare_ports(Domain.parse(waiting), 1) == (0,)    # libvirt gives the RNG the free one at define
    i440fx = DEFINED_Q35.replace("pc-q35-7.2", "pc-i440fx-7.2")
    assert spare_ports(Domain.parse(i440fx), 1) is None     # i440fx: slots of pci.0, no ports
    assert spare_ports(Domain.parse(i440fx), 2) == (0, 0)   # with cells: none (its cells' pxb take none)


def test_an_attach_into_a_q35_guest_without_a_free_root_port_is_refused_by_its_dry_run_too(env, tmp_path):
    """libvirt would refuse the device after vstor made its backend (exit 5,
    rolled back): the dry run and the attach refuse first, in one line
    with the fix, and change nothing."""
    dom = running(env, local_spdk())
    rec, vhosts = env.state.load("vm1"), dict(env.spdk.vhost)
    for dry_run in (True, False):
        rt = env.rt()
        rt.dry_run = dry_run
        guest = GuestDouble(dom, ports=0)
        with pytest.raises(DoesNotFit) as e:
            attach(rt, env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path), guest)
        assert e.value.message == "domain 'vm1' has no free PCIe root port, where a q35 guest takes a hot-plugged disk"
        assert "<controller type='pci' model='pcie-root-port'/>" in e.value.hint and "virsh edit vm1" in e.value.hint
        assert "\n" not in str(e.value)
        assert guest.calls == [] and env.state.load("vm1").steps == rec.steps and env.spdk.vhost == vhosts
    new = attach(env.rt(), env.state, env.host(), dom, disk(local_spdk(OTHER, "vdc"), tmp_path),
                 GuestDouble(dom, ports=1))
    assert new.disk("vdc") is not None                      # one empty port is enough


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
