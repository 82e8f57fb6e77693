"""prepare / release / reconnect with every host-changing part real or a named
double: VFIO binding on the kernel sysfs double built from a named layout,
SPDK through its official client against the SPDK target double, and real
qemu-storage-daemons.  Faults at every step must leave nothing behind."""

import os
import stat

import pytest

from tests.helpers import LOCAL, file_disk, file_disks, flock_free, local_spdk
from tests.helpers import rendered_domain as domain, spdk_nvmf as nvmf
from tests.doubles.spdk_target import SpdkTargetDouble
from vstor.runtime.holders import FromRecords
from vstor.meta.document import Domain
from vstor.errors import ActionFailed, BadInput, DoesNotFit, EXIT_UNAVAILABLE, InUse
from vstor.planner.ledger import Ledger
from vstor.runtime.lifecycle import Runtime, health, prepare, reconnect, release
from vstor.render.libvirt import render

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="sockets are handed to root:kvm (needs root)")


def nothing_left(e, addr=LOCAL):
    assert e.sysfs.driver_of(addr) == "nvme"
    assert e.spdk.vhost == {} and e.spdk.nvme == {}
    assert [f for f in os.listdir(e.spdk.vhost_dir) if not f.startswith(".")] == []
    assert e.state.records() == []


# -- the SPDK path on a local controller ------------------------------------------------------

def test_local_nvme_spdk_prepare_and_release(env):
    dom = domain(env, local_spdk())
    rec = prepare(env.rt(), env.state, env.host(), dom)
    assert env.sysfs.driver_of(LOCAL) == "vfio-pci"
    assert env.spdk.params_of("bdev_nvme_attach_controller") == [
        {"name": "vs_0000_5f_00_0", "trtype": "PCIe", "traddr": LOCAL}]
    assert env.spdk.params_of("vhost_create_blk_controller") == [
        {"ctrlr": "vm1-vdb", "dev_name": "vs_0000_5f_00_0n1", "cpumask": hex(1 << 18)}]
    sock = os.stat(os.path.join(env.spdk.vhost_dir, "vm1-vdb"))
    assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_uid == 0
    assert sock.st_gid == __import__("grp").getgrnam("kvm").gr_gid
    assert [s["kind"] for s in rec.steps] == ["vfio-bind", "spdk-attach", "spdk-vhost"]
    assert all(problem is None for _, _, problem in health(env.rt(), env.state.load("vm1")))
    release(env.rt(), env.state, "vm1")
    changes = [m for m in env.spdk.methods_called()
               if not m.endswith(("_get_controllers", "get_version", "get_methods"))]
    assert changes == ["bdev_nvme_attach_controller", "vhost_create_blk_controller",
                       "vhost_delete_controller", "bdev_nvme_detach_controller"]
    nothing_left(env)


def test_release_while_qemu_is_connected_is_refused_before_anything_is_sent(env):
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    env.spdk.mark_connected("vm1-vdb")
    sent = len(env.spdk.requests)
    with pytest.raises(DoesNotFit) as e:
        release(env.rt(), env.state, "vm1")
    assert e.value.exit_code == 3
    assert "still using its storage: QEMU is connected to SPDK vhost controller vm1-vdb" in str(e.value)
    assert [r["method"] for r in env.spdk.requests[sent:]
            if not r["method"].endswith(("get_controllers", "get_version"))] == []
    kept = env.state.load("vm1")
    assert kept.status == "prepared" and [s["kind"] for s in kept.steps] == ["vfio-bind", "spdk-attach", "spdk-vhost"]
    assert "vs_0000_5f_00_0" in env.spdk.nvme and env.sysfs.driver_of(LOCAL) == "vfio-pci"
    env.spdk.mark_connected("vm1-vdb", False)
    release(env.rt(), env.state, "vm1")
    nothing_left(env)


def test_a_forced_release_while_connected_is_followed_until_spdk_deletes(env):
    """--force sends the deletion: SPDK before v24.09 refuses it (EBUSY); since
    then it defers it until QEMU lets go, and vstor follows it for a while.
    Either way nothing under the vhost controller is touched and the record
    keeps it; once QEMU is gone the next release finishes."""
    from vstor import records
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    env.spdk.mark_connected("vm1-vdb")
    forced = Runtime(records.replace(env.cfg, spdk_timeout=1.0), env.sysfs, force=True)
    with pytest.raises(InUse) as e:       # in use, as the unforced refusal: exit 3
        release(forced, env.state, "vm1")
    why = ("SPDK refused deleting vhost controller vm1-vdb" if env.spdk.version == "v24.01"
           else "SPDK deferred deleting vhost controller vm1-vdb")
    assert why in str(e.value) and "vstor release vm1" in str(e.value) and e.value.exit_code == 3
    kept = env.state.load("vm1")
    assert [s["kind"] for s in kept.steps] == ["vfio-bind", "spdk-attach", "spdk-vhost"]
    assert "vs_0000_5f_00_0" in env.spdk.nvme and env.sysfs.driver_of(LOCAL) == "vfio-pci"
    env.spdk.mark_connected("vm1-vdb", False)       # QEMU goes; a deferred deletion completes
    release(env.rt(), env.state, "vm1")
    nothing_left(env)


def test_an_spdk_app_without_vhost_is_found_before_anything_changes(env):
    from vstor import records
    nvmf = SpdkTargetDouble(os.path.join(env.work, "nvmf.sock"), os.path.join(env.work, "vhost"),
                            app="nvmf_tgt").start()
    try:
        rt = Runtime(records.replace(env.cfg, spdk_socket=nvmf.socket_path), env.sysfs)
        writes = len(env.sysfs.writes)
        with pytest.raises(Exception) as e:
            prepare(rt, env.state, env.host(), domain(env, local_spdk()))
        assert e.value.exit_code == EXIT_UNAVAILABLE
        assert "has no vhost_create_blk_controller" in str(e.value) and "-S" in str(e.value)
        assert len(env.sysfs.writes) == writes and env.state.records() == []
        assert [r["method"] for r in nvmf.requests] == ["rpc_get_methods"]
    finally:
        nvmf.stop()


def test_release_with_spdk_down_is_unavailable_and_keeps_everything(env):
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    env.spdk.stop()
    writes = len(env.sysfs.writes)
    with pytest.raises(Exception) as e:
        release(env.rt(), env.state, "vm1")
    assert e.value.exit_code == EXIT_UNAVAILABLE and "SPDK is not reachable" in str(e.value)
    kept = env.state.load("vm1")
    assert kept.status == "prepared" and len(kept.steps) == 3 and len(env.sysfs.writes) == writes


@pytest.mark.parametrize("fault", ["vfio-write", "bdev_nvme_attach_controller", "vhost_create_blk_controller"])
def test_a_failure_at_each_step_leaves_nothing(env, fault):
    dom = domain(env, local_spdk())
    if fault == "vfio-write":
        env.sysfs.fail_write(nth=2)
    else:
        env.spdk.fail(fault, -5, "Input/output error")
    with pytest.raises(ActionFailed) as e:
        prepare(env.rt(), env.state, env.host(), dom)
    assert "everything done before it was undone" in str(e.value)
    nothing_left(env)


def test_missing_spdk_is_unavailable_before_anything_changes(env):
    env.spdk.stop()
    writes = len(env.sysfs.writes)
    with pytest.raises(Exception) as e:
        prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    assert e.value.exit_code == EXIT_UNAVAILABLE and "SPDK is not reachable" in str(e.value)
    assert len(env.sysfs.writes) == writes and env.state.records() == []


def test_a_crash_between_steps_is_undone_by_the_next_run(env):
    """A run killed after attaching (record says attach 'doing'): the next
    prepare undoes the leftovers and starts clean; nothing is doubled."""
    from vstor.runtime import actions, executor
    from vstor.runtime.journal import DOING, DONE
    from vstor.runtime.state import Record
    dom = domain(env, local_spdk())
    rt = env.rt()
    steps = [executor.observe(a, rt, FromRecords([])) for a in actions.build(dom.recorded_plan(), env.cfg)]
    assert [a.kind for a in steps] == ["vfio-bind", "spdk-attach", "spdk-vhost"]
    rec = Record("vm1", "vm1", None)
    executor.do(steps[0], rt)
    rec.steps.append(actions.to_json(steps[0], DONE))
    rec.steps.append(actions.to_json(steps[1], DOING))
    executor.do(steps[1], rt)
    rec.repair = {"status": "done", "at": 1.0, "changes": [{"what": "vcpu", "item": 0, "have": [7],
                                                            "want": [4]}]}     # the last run's
    env.state.save(rec)                                  # ... and the process dies here
    prepare(env.rt(), env.state, env.host(), dom)        # the next start
    assert env.state.load("vm1").repair == {}            # a repair does not outlive its run
    assert len(env.spdk.params_of("bdev_nvme_attach_controller")) == 2   # undone, then redone once
    assert list(env.spdk.nvme) == ["vs_0000_5f_00_0"] and list(env.spdk.vhost) == ["vm1-vdb"]
    release(env.rt(), env.state, "vm1")
    nothing_left(env)


# -- NVMe-oF: one shared controller, multipath, counted users ----------------------------------

def test_nvmf_paths_are_attached_as_multipath_and_shared_until_the_last_user(env):
    a = domain(env, nvmf(1), name="a")
    from vstor.planner.ledger import Holding
    b = domain(env, nvmf(2), name="b", ledger=Ledger([Holding.from_plan(a.recorded_plan())]))
    prepare(env.rt(), env.state, env.host(), a)
    prepare(env.rt(), env.state, env.host(), b)
    calls = env.spdk.params_of("bdev_nvme_attach_controller")
    assert [c["traddr"] for c in calls] == ["192.168.100.8", "192.168.101.8"]     # b reused it
    for c in calls:
        assert c["trtype"] == "RDMA" and c["multipath"] == "multipath" and c["trsvcid"] == "4420"
        assert c["hostnqn"] == "nqn.2014-08.org.nvmexpress:uuid:1" and c["ctrlr_loss_timeout_sec"] == 90
        assert (c["reconnect_delay_sec"], c["fast_io_fail_timeout_sec"]) == (5, 30)
    name = calls[0]["name"]
    assert {v.bdev for v in env.spdk.vhost.values()} == {f"{name}n1", f"{name}n2"}
    release(env.rt(), env.state, "a")
    assert name in env.spdk.nvme                      # b still uses it
    release(env.rt(), env.state, "b")
    assert env.spdk.nvme == {} and env.state.records() == []


def test_two_targets_that_reuse_an_nqn_get_two_controllers_and_their_own_namespaces(env):
    """SPDK's example NQN on two targets: each domain gets a controller to the
    target it named, never the other target's namespace of the same number."""
    env.spdk.add_fabric("RDMA", "192.168.102.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
    one = ("<vstor:disk target='vdb' backend='spdk'><vstor:nvmf transport='rdma' traddr='{addr}' "
           "subnqn='nqn.2016-06.io.spdk:cnode1' namespace='2'/></vstor:disk>")
    a = domain(env, one.format(addr="192.168.100.8"), name="a")
    from vstor.planner.ledger import Holding
    b = domain(env, one.format(addr="192.168.102.8"), name="b",
               ledger=Ledger([Holding.from_plan(a.recorded_plan())]))
    pa, pb = a.recorded_plan().disks[0], b.recorded_plan().disks[0]
    assert pa.spdk_controller != pb.spdk_controller
    prepare(env.rt(), env.state, env.host(), a)
    prepare(env.rt(), env.state, env.host(), b)
    served = {v.name: v.bdev for v in env.spdk.vhost.values()}
    assert served == {"a-vdb": f"{pa.spdk_controller}n2", "b-vdb": f"{pb.spdk_controller}n2"}
    addrs = {c["name"]: c["traddr"] for c in env.spdk.params_of("bdev_nvme_attach_controller")}
    assert addrs == {pa.spdk_controller: "192.168.100.8", pb.spdk_controller: "192.168.102.8"}
    release(env.rt(), env.state, "a")
    release(env.rt(), env.state, "b")
    assert env.spdk.nvme == {}


def test_a_multipath_domain_gets_every_path_of_its_controller(env):
    """A controller of that name left with one path (an interrupted run, a
    path SPDK dropped) gets the missing one; one with a path the plan does not
    have is refused, never merged."""
    from vstor.runtime import actions, executor
    dom = domain(env, nvmf(1))
    attach = next(a for a in actions.build(dom.recorded_plan(), env.cfg) if a.kind == "spdk-attach")
    env.spdk.requests.clear()
    first = attach.paths[0].params(attach.name)
    client = env.rt().spdk
    client.attach_nvme_controller(**first)
    assert "lost its path RDMA 192.168.101.8:4420" in executor.check(attach, env.rt())
    prepare(env.rt(), env.state, env.host(), dom)
    assert [c["traddr"] for c in env.spdk.params_of("bdev_nvme_attach_controller")] == [
        "192.168.100.8", "192.168.101.8"]
    assert executor.check(attach, env.rt()) is None
    release(env.rt(), env.state, "vm1")
    assert attach.name in env.spdk.nvme         # vstor did not make it: it stays
    client.detach_nvme_controller(attach.name)
    env.spdk.add_fabric("RDMA", "192.168.109.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
    client.attach_nvme_controller(**first)
    client.attach_nvme_controller(**{**first, "traddr": "192.168.109.8"})
    with pytest.raises(ActionFailed, match="has a path the plan does not: RDMA 192.168.109.8:4420"):
        prepare(env.rt(), env.state, env.host(), dom)
    assert env.state.records() == [] and attach.name in env.spdk.nvme     # refused, and left alone
    client.detach_nvme_controller(attach.name)


# -- passthrough and the checks at start ---------------------------------------------------------

def test_passthrough_binds_and_gives_the_controller_back(env):
    dom = domain(env, "<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:61:00.0'/></vstor:disk>")
    prepare(env.rt(), env.state, env.host(), dom)
    assert env.sysfs.driver_of("0000:61:00.0") == "vfio-pci"
    release(env.rt(), env.state, "vm1")
    assert env.sysfs.driver_of("0000:61:00.0") == "nvme"


def test_two_domains_planned_apart_but_given_the_same_cores_cannot_both_start(env):
    pt = "<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='{}'/></vstor:disk>"
    a = domain(env, pt.format("0000:61:00.0"), name="a")
    b = domain(env, pt.format("0000:60:00.0"), name="b")     # planned without the ledger: same cores
    prepare(env.rt(), env.state, env.host(), a)
    with pytest.raises(DoesNotFit) as e:
        prepare(env.rt(), env.state, env.host(), b)
    assert "held by domain a (running)" in str(e.value)
    assert env.sysfs.driver_of("0000:60:00.0") == "nvme" and [r.domain for r in env.state.records()] == ["a"]
    release(env.rt(), env.state, "a")


def test_reconnect_repairs_a_vanished_vhost_controller(env):
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    env.spdk.stop()
    env.spdk.vhost.clear()           # SPDK restarted and lost its vhost controller...
    env.spdk.nvme.clear()
    env.spdk.start()
    findings = reconnect(env.rt(), env.state, "vm1")
    assert any("repaired" in f for f in findings), findings
    assert "vm1-vdb" in env.spdk.vhost and "vs_0000_5f_00_0" in env.spdk.nvme
    release(env.rt(), env.state, "vm1")
    nothing_left(env)


# -- qemu-storage-daemon: the embedded default ---------------------------------------------------

def test_four_qsd_disks_prepare_and_release_with_real_daemons(env):
    disks, _ = file_disks(env, "bcde")
    dom = domain(env, disks, vm="<vstor:vm cpus='shared'/>")
    prepare(env.rt(), env.state, env.host(), dom)
    socks = sorted(f for f in os.listdir(env.cfg.vhost_dir) if f.startswith("vm1-"))
    assert socks == ["vm1-vdb", "vm1-vdc", "vm1-vdd", "vm1-vde"]
    assert all(p is None for _, _, p in health(env.rt(), env.state.load("vm1")))
    release(env.rt(), env.state, "vm1")
    assert [f for f in os.listdir(env.cfg.vhost_dir) if f.startswith("vm1-")] == []
    assert [f for f in os.listdir(env.cfg.qsd_dir) if not f.startswith(".")] == []
    assert env.state.records() == []


def test_a_missing_backing_file_is_refused_before_any_daemon_starts(env):
    good = os.path.join(env.work, "good.raw")
    with open(good, "wb") as f:
        f.truncate(16 << 20)
    disks = (f"<vstor:disk target='vdb'><vstor:file path='{good}'/></vstor:disk>"
             f"<vstor:disk target='vdc'><vstor:file path='{env.work}/missing.raw'/></vstor:disk>")
    with pytest.raises(BadInput) as e:
        prepare(env.rt(), env.state, env.host(), domain(env, disks, vm="<vstor:vm cpus='shared'/>"))
    assert "missing.raw" in str(e.value) and e.value.exit_code == 2
    assert [f for f in os.listdir(env.cfg.vhost_dir) if f.startswith("vm1-")] == []
    assert not os.path.exists(env.cfg.qsd_dir) or os.listdir(env.cfg.qsd_dir) in ([], [".lock"])
    assert env.state.records() == []


def test_a_controller_two_spdk_domains_share_goes_back_to_its_driver_after_both(env):
    """The second domain's bind finds the controller on vfio-pci already: it
    keeps the first one's record of where it was, so whichever releases last
    gives it back to nvme."""
    from vstor.planner.ledger import Holding
    disk = (f"<vstor:disk target='vdb' backend='spdk' readonly='yes'>"
            f"<vstor:nvme controller='{LOCAL}'/></vstor:disk>")
    a = domain(env, disk, name="a")
    b = domain(env, disk, name="b", ledger=Ledger([Holding.from_plan(a.recorded_plan())]))
    prepare(env.rt(), env.state, env.host(), a)
    prepare(env.rt(), env.state, env.host(), b)
    assert env.sysfs.driver_of(LOCAL) == "vfio-pci"
    release(env.rt(), env.state, "a")
    assert env.sysfs.driver_of(LOCAL) == "vfio-pci"          # b's SPDK still uses it
    release(env.rt(), env.state, "b")
    assert env.sysfs.driver_of(LOCAL) == "nvme"
    nothing_left(env)


def test_an_interrupted_prepare_leaves_no_record(env, monkeypatch):
    """Ctrl-C in the middle of the steps: what was done is undone, no record holds anything."""
    from vstor.runtime import executor
    real = executor.do
    calls = []

    def interrupted(a, rt):
        calls.append(a.kind)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(a, rt)
    monkeypatch.setattr(executor, "do", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    assert env.state.records() == [] and env.sysfs.driver_of(LOCAL) == "nvme"
    assert env.spdk.nvme == {}


def test_daemons_start_without_the_host_lock_and_spdk_steps_under_it(env, monkeypatch):
    """The host lock covers the decision; a domain's own qsd daemons start
    (side by side) after it is let go, SPDK's shared controller under it."""
    from vstor.runtime import executor
    seen, real = [], executor.do
    lock = os.path.join(env.cfg.state_dir, "lock")

    import threading
    probing = threading.Lock()      # the daemons start side by side: one probe at a time

    def do(a, rt):
        from vstor.locking import try_range
        with probing:
            fd = os.open(lock, os.O_RDWR)
            try:        # the record lock: a byte of the same file, held by this run
                seen.append((a.kind, flock_free(lock), not try_range(fd, "vm1")))
            finally:
                os.close(fd)
        real(a, rt)
    monkeypatch.setattr(executor, "do", do)
    disks, _ = file_disks(env, "bc", prefix="p", size=8 << 20)
    prepare(env.rt(), env.state, env.host(), domain(env, disks, vm="<vstor:vm cpus='shared'/>"))
    assert seen == [("qsd-export", True, True), ("qsd-export", True, True)]
    release(env.rt(), env.state, "vm1")
    seen.clear()
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    assert [(k, free) for k, free, _ in seen] == [("vfio-bind", False), ("spdk-attach", False),
                                                   ("spdk-vhost", False)]


@pytest.mark.parametrize("alias", ["symlink", "hard link"])
def test_two_disks_writing_one_file_under_two_names_are_refused_with_nothing_made(env, alias):
    """The planner refuses one path written twice; a second name for the
    same file (their daemons would start side by side, each blind to the
    other) is refused before anything is made."""
    _, paths = file_disks(env, "b", size=8 << 20)
    other = os.path.join(env.work, "alias.raw")
    (os.symlink if alias == "symlink" else os.link)(paths[0], other)
    dom = domain(env, file_disk(paths[0]) + file_disk(other, "vdc"), vm="<vstor:vm cpus='shared'/>")
    with pytest.raises(DoesNotFit, match=r"^vm1-vdc and vm1-vdb are one file .*two writers would "
                                         r"corrupt it"):
        prepare(env.rt(), env.state, env.host(), dom)
    assert env.state.records() == [] and not os.listdir(env.cfg.vhost_dir)
    both = domain(env, file_disk(paths[0]).replace("target='vdb'", "target='vdb' readonly='yes'")
                  + file_disk(other, "vdc").replace("target='vdc'", "target='vdc' readonly='yes'"),
                  vm="<vstor:vm cpus='shared'/>")
    prepare(env.rt(), env.state, env.host(), both)
    release(env.rt(), env.state, "vm1")


def test_a_name_with_spaces_around_it_finds_the_record_an_earlier_vstor_made_under_it_stripped(env):
    """libvirt keeps ' web ' as the name; vstor now does too (its key is then
    the UUID), where it used to read 'web': a domain prepared by that vstor
    is still released by this one, and only with its own UUID."""
    uuid = "3f1c7c52-6d3e-4d5e-9d7a-0c1f2e3d4b5a"
    disks, _ = file_disks(env, "b", size=8 << 20)
    dom = domain(env, disks, name="web", vm="<vstor:vm cpus='shared'/>")
    dom.root.insert(1, Domain.parse(f"<domain><uuid>{uuid}</uuid></domain>").root[0])
    prepare(env.rt(), env.state, env.host(), dom)       # as the earlier vstor keyed it: 'web'
    spaced = Domain.parse(dom.to_string().replace("<name>web</name>", "<name> web </name>"))
    assert spaced.name == " web " and spaced.safe_name == uuid
    assert release(env.rt(), env.state, spaced.safe_name, domain=spaced.name,
                   uuid="00000000-0000-0000-0000-000000000000") is None
    assert env.state.load("web") is not None
    assert release(env.rt(), env.state, spaced.safe_name, domain=spaced.name, uuid=uuid) is not None
    assert env.state.records() == [] and os.listdir(env.cfg.qsd_dir) == [".lock"]


def test_a_plan_recorded_without_a_host_nqn_starts_as_it_was_and_says_to_replan(env):
    """A plan an earlier vstor recorded attaches with SPDK's default host NQN
    (no hostnqn sent): it still starts, as it was, and the start check says
    how to record this host's NQN; a plan made now always sends one."""
    from vstor import records
    from vstor.meta.names import bdev_name, spdk_controller_name
    dom = domain(env, nvmf().replace(" hostnqn='nqn.2014-08.org.nvmexpress:uuid:1'", ""))
    plan = dom.recorded_plan()
    d = plan.disks[0]
    assert {p.hostnqn for p in d.attach} == {env.host().hostnqn} != {None}
    attach = tuple(records.replace(p, hostnqn=None) for p in d.attach)
    ctrl = spdk_controller_name(d.source, attach)
    old = records.replace(plan, disks=(records.replace(d, attach=attach, spdk_controller=ctrl,
                                                       bdev=bdev_name(ctrl, d.source.namespace)),))
    said = []
    prepare(env.rt(), env.state, env.host(), render(dom, old), progress=said.append)
    assert [p.get("hostnqn") for p in env.spdk.params_of("bdev_nvme_attach_controller")] == [None, None]
    assert [m for m in said if m.startswith("warning:")] == [
        "warning: vdb: attaches with SPDK's default host NQN, which SPDK makes anew at every start of "
        "its app (no target can be told to allow it); run vstor apply vm1 to plan it with this host's NQN"]
    release(env.rt(), env.state, "vm1")
    prepare(env.rt(), env.state, env.host(), dom, progress=said.append)     # re-planned: named
    assert {p.get("hostnqn") for p in env.spdk.params_of("bdev_nvme_attach_controller")[2:]} == {
        env.host().hostnqn}


def test_a_damaged_record_leaves_what_is_shared_and_refuses_starts(env):
    """Another domain's record that cannot be read may hold the same
    controller: a release undoes only what is the domain's alone and keeps
    the rest recorded (exit 4); no other domain starts (its ledger is not
    known); once the record is dealt with, everything goes."""
    from vstor.errors import Unavailable
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    damaged = os.path.join(env.cfg.state_dir, "domains", "other.json")
    with open(damaged, "w") as f:
        f.write("{")
    with pytest.raises(Unavailable) as e:
        prepare(env.rt(), env.state, env.host(), domain(env, local_spdk("0000:60:00.0"), name="vm2"))
    assert e.value.exit_code == EXIT_UNAVAILABLE and "other.json is damaged" in str(e.value)
    with pytest.raises(Unavailable) as e:
        release(env.rt(), env.state, "vm1")
    assert e.value.exit_code == EXIT_UNAVAILABLE and "another domain may still use it" in str(e.value)
    assert [s["kind"] for s in env.state.load("vm1").steps] == ["vfio-bind", "spdk-attach"]
    assert env.spdk.vhost == {} and env.sysfs.driver_of(LOCAL) == "vfio-pci"
    os.unlink(damaged)
    release(env.rt(), env.state, "vm1")
    nothing_left(env)


def test_the_record_names_the_spdk_its_steps_were_made_through(env):
    """[spdk] rpc_socket changed (or misspelt) after the start: the release
    asks the SPDK application that holds the domain's controllers, which
    the record names (issue 30: release from the record alone)."""
    from vstor import records
    prepare(env.rt(), env.state, env.host(), domain(env, local_spdk()))
    assert env.state.load("vm1").spdk_socket == env.spdk.socket_path
    elsewhere = Runtime(records.replace(env.cfg, spdk_socket=f"{env.work}/moved.sock"), env.sysfs)
    assert all(problem is None for _, _, problem in health(elsewhere, env.state.load("vm1")))
    release(elsewhere, env.state, "vm1")
    changes = [m for m in env.spdk.methods_called()
               if not m.endswith(("_get_controllers", "get_version", "get_methods"))]
    assert changes[-2:] == ["vhost_delete_controller", "bdev_nvme_detach_controller"]
    nothing_left(env)


def test_a_record_of_qsd_disks_names_no_spdk(env):
    disks, _ = file_disks(env, "b")
    rec = prepare(env.rt(), env.state, env.host(), domain(env, disks, vm="<vstor:vm cpus='shared'/>"))
    assert rec.spdk_socket is None and "spdk_socket" not in rec.to_json()
    release(env.rt(), env.state, "vm1")
