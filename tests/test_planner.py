"""The planner's decisions and refusals on realistic host layouts."""

import os
import re

import pytest

from tests.helpers import nvme, nvmf, qsd_file, refused, request, SPDK_CFG
from vstor.config import Config
from vstor.errors import BadInput
from vstor.planner.ledger import Holding, Ledger, holding_from_json, holding_to_json
from vstor.planner import Request, plan_domain

NS = "https://vstor.dev/xmlns/domain/1"


# -- two-socket server: NVMe on node 1, RDMA NIC on node 0 ------------------------------

def test_spdk_vhost_on_local_nvme_lives_on_the_controllers_node(host_model):
    host = host_model("two-socket")
    plan = plan_domain(host, SPDK_CFG, request(nvme("0000:5f:00.0", backend="spdk")), Ledger())
    node1 = set(host.node(1).cpus)
    disk = plan.disks[0]
    assert (plan.node, disk.mode, disk.backend) == (1, "vhost", "spdk")
    assert set(plan.vcpu_pins) <= node1
    assert not set(plan.vcpu_pins) & {16, 48, 18, 50}   # housekeeping core 16 and the reactor's core
    assert plan.emulator == (16, 48)
    assert disk.reactor == 18 and disk.spdk_controller == "vs_0000_5f_00_0" and disk.bdev == "vs_0000_5f_00_0n1"
    assert (plan.hugepage_kib, plan.hugepages) == (2048, 4096)
    assert disk.socket == "/run/vstor/vhost/vm1-vdb"
    # whole cores: each vCPU pair is one physical core
    siblings = {frozenset(host.cpu(c).siblings) for c in plan.vcpu_pins}
    assert len(siblings) == 2 and plan.reserved == ()


def test_nvmf_goes_to_the_rdma_nics_node_and_stays_migratable(host_model):
    host = host_model("two-socket")
    plan = plan_domain(host, SPDK_CFG, request(nvmf(), vm="<vstor:vm migratable='yes'/>"), Ledger())
    disk = plan.disks[0]
    assert (plan.node, disk.mode, disk.backend, disk.reactor) == (0, "vhost", "spdk", 2)
    assert any("RDMA NIC mlx5_0" in r for r in plan.reasons)
    assert any("2 paths" in r for r in disk.reasons)
    assert disk.spdk_controller.startswith("vs_nvmf_") and plan.migratable


def test_nvmf_cannot_be_passed_through_or_served_by_qsd(host_model):
    host = host_model("two-socket")
    assert "cannot be passed through" in refused(host, SPDK_CFG, request(nvmf(mode="passthrough")))
    assert "no NVMe-oF initiator" in refused(host, SPDK_CFG, request(nvmf(backend="qsd")))


def test_latency_critical_auto_gets_passthrough_of_a_free_controller(host_model):
    plan = plan_domain(host_model("two-socket"), SPDK_CFG,
                       request(nvme("0000:5e:00.0"), vm="<vstor:vm latency='critical'/>"), Ledger())
    assert (plan.disks[0].mode, plan.disks[0].backend, plan.node) == ("passthrough", "vfio", 1)
    assert plan.hugepage_kib is None and not plan.viommu


def test_migratable_auto_never_gets_passthrough(host_model):
    plan = plan_domain(host_model("two-socket"), SPDK_CFG,
                       request(nvme("0000:5e:00.0"), vm="<vstor:vm latency='critical' migratable='yes'/>"), Ledger())
    assert plan.disks[0].mode == "vhost"
    assert "migratable" in plan.disks[0].reasons[0]


def test_two_domains_never_share_a_core_and_never_sit_on_a_reactor(host_model):
    host = host_model("two-socket")
    first = plan_domain(host, SPDK_CFG, request(nvme("0000:5e:00.0", backend="spdk"), name="a"), Ledger())
    ledger = Ledger([Holding.from_plan(first)])
    second = plan_domain(host, SPDK_CFG, request(nvme("0000:5f:00.0", backend="spdk"), name="b"), ledger)
    assert not first.dedicated_cpus & second.dedicated_cpus
    for plan in (first, second):
        assert not plan.dedicated_cpus & {2, 34, 18, 50}
    assert second.disks[0].reactor == 18    # the only reactor on node 1, shared by both


def test_not_enough_cores_on_the_device_node_is_refused_naming_what_is_short(host_model):
    message = refused(host_model("two-socket"), SPDK_CFG, request(nvme("0000:5e:00.0", backend="spdk"), vcpus=40))
    assert "node 1" in message and "the VM needs 40" in message


def test_one_free_core_is_one_core_not_cores(host_model):
    message = refused(host_model("laptop"), Config(housekeeping=(0, 1, 2, 4, 5, 6)),
                      request(qsd_file(), vcpus=4))
    assert "1 whole free core (2 threads) for dedicated vCPUs" in message


def test_preferred_numa_falls_back_to_another_node_and_says_so(host_model):
    host = host_model("two-socket")
    req = request(qsd_file(), vm="<vstor:vm numa='preferred'/>", vcpus=28)
    plan = plan_domain(host, Config(), req, Ledger())
    assert len(plan.vcpu_pins) == 28
    ledger = Ledger([Holding.from_plan(plan)])
    second = plan_domain(host, Config(), request(qsd_file("/var/lib/libvirt/images/b.raw"), vm="<vstor:vm numa='preferred'/>",
                                                 vcpus=28, name="vm2"), ledger)
    assert second.node != plan.node


def test_short_hugepages_are_refused_with_the_sysfs_knob(host_model):
    message = refused(host_model("two-socket"), SPDK_CFG,
                      request(nvme("0000:5e:00.0", backend="spdk"), memory_mib=20480))
    assert "8192 free 2048 KiB hugepages" in message and "needs 10240" in message
    assert "/sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages" in message


def test_hugepages_promised_to_stopped_domains_count_but_running_ones_do_not(host_model):
    host = host_model("two-socket")
    req = request(nvme("0000:5e:00.0", backend="spdk"), memory_mib=12288)   # 6144 pages
    other = plan_domain(host, SPDK_CFG, request(nvme("0000:5f:00.0", backend="spdk"), name="o",
                                                memory_mib=8192), Ledger())
    assert "4096 of them promised" in refused(host, SPDK_CFG, req, Ledger([Holding.from_plan(other, active=False)]))
    # a running domain's pages are already gone from the free pool read from sysfs
    plan_domain(host, SPDK_CFG, req, Ledger([Holding.from_plan(other, active=True)]))



def test_the_overlay_adds_what_the_domain_claimed_to_the_ledger_it_overlays(host_model):
    """One overlay for what the domain being planned took so far (its cells'
    cores, pages, bound memory and reactors, its disks' controllers): asked
    as the ledger, it answers the base's rules plus those claims, and the
    base is left as it was."""
    from vstor.planner.ledger import Overlay
    host = host_model("two-socket")
    other = plan_domain(host, SPDK_CFG, request(nvme("0000:5f:00.0", backend="spdk"), name="o",
                                                memory_mib=8192), Ledger())
    base = Ledger([Holding.from_plan(other, active=False)])
    taken = Overlay(base)
    taken.take_node("me", (40, 41), 1, 2048, 100, 0)
    taken.take_node("me", (), 0, None, 0, 4096)
    taken.take_disk("qsd", "0000:5e:00.0", (("10.0.0.1:4420", "c"),))
    assert taken.promised_hugepages(1, 2048) == base.promised_hugepages(1, 2048) + 100 == 4196
    assert taken.bound_memory_kib(0) == 4096 and base.bound_memory_kib(0) == 0
    assert taken.cpu_owner[40] == "me" and 40 not in base.cpu_owner
    assert all(taken.cpu_owner[c] == "o" for c in other.vcpu_pins)
    assert taken.own_kernel == {"0000:5e:00.0"} and taken.own_connections == {"10.0.0.1:4420": "c"}
    assert taken.running("o") is False and taken.holdings == base.holdings     # the rest is the base's

# -- ordinary memory bound to a node (VMs without hugepages) ----------------------------------
# two-socket: each node has 192 GiB, 48 GiB of it in hugepage pools (8192 x 2 MiB, 32 x 1 GiB),
# and [memory] reserved keeps 1 GiB for the host: 143 GiB for VMs bound to the node.

def test_a_strict_vm_larger_than_its_node_is_refused(host_model):
    message = refused(host_model("two-socket"), Config(),
                      request(qsd_file(), vm="<vstor:vm cpus='shared'/>", memory_mib=256 * 1024))
    assert ("has 146432 MiB of memory left for VMs outside its hugepage pools (196608 MiB, 49152 MiB "
            "in hugepage pools, 1024 MiB kept for the host, 0 MiB bound to other domains); the VM "
            "needs 262144 MiB") in message


def test_vms_bound_to_a_node_are_counted_running_or_not(host_model):
    host = host_model("two-socket")
    big = dict(vm="<vstor:vm cpus='shared'/>", memory_mib=60 * 1024)
    held = []
    for i, active in enumerate((True, False)):
        plan = plan_domain(host, Config(), request(nvme(("0000:5e:00.0", "0000:60:00.0")[i]),
                                                   name=f"m{i}", **big), Ledger(held))
        assert plan.node == 1 and plan.hugepage_kib is None
        held.append(Holding.from_plan(plan, active=active))
    message = refused(host, Config(), request(nvme("0000:5f:00.0"), name="m2", **big), Ledger(held))
    assert "node 1 has 23552 MiB of memory left" in message and "122880 MiB bound to other domains" in message
    # preferred falls back to the other node; none binds nothing and is not counted
    spill = plan_domain(host, Config(), request(nvme("0000:5f:00.0"), name="m2", vm="<vstor:vm cpus='shared' "
                                                "numa='preferred'/>", memory_mib=60 * 1024), Ledger(held))
    assert spill.node == 0
    free = plan_domain(host, Config(), request(nvme("0000:5f:00.0"), name="m2", vm="<vstor:vm cpus='shared' "
                                               "numa='none'/>", memory_mib=60 * 1024), Ledger(held))
    assert Holding.from_plan(free).memory == ()
    # hugepage-backed memory comes from the pools, not from here
    paged = plan_domain(host, Config(), request(nvme("0000:5f:00.0"), name="m2", vm="<vstor:vm cpus='shared' "
                                                "hugepages='1G'/>", memory_mib=30 * 1024), Ledger(held))
    assert paged.node == 1 and Holding.from_plan(paged).memory == ()


def test_the_host_reserve_is_configurable(host_model, tmp_path):
    from vstor.config import load
    conf = tmp_path / "c.conf"
    conf.write_text("[memory]\nreserved = 16384\n")
    cfg = load(str(conf))
    assert cfg.memory_reserved_mib == 16384
    assert "16384 MiB kept for the host" in refused(host_model("two-socket"), cfg, request(
        qsd_file(), vm="<vstor:vm cpus='shared'/>", memory_mib=140 * 1024))
    conf.write_text("[memory]\nreserved = 1G\n")
    with pytest.raises(BadInput, match=r"\[memory\] reserved must be a whole number of MiB, not '1G'"):
        load(str(conf))


def test_a_controller_passed_through_elsewhere_is_refused_with_its_owner(host_model):
    host = host_model("two-socket")
    owner = plan_domain(host, SPDK_CFG, request(nvme("0000:60:00.0", mode="passthrough"), name="db"), Ledger())
    message = refused(host, SPDK_CFG, request(nvme("0000:60:00.0", mode="passthrough")),
                      Ledger([Holding.from_plan(owner)]))
    assert "passed through to domain db (not running)" in message


def test_a_file_written_by_another_domain_is_refused_unless_both_readonly(host_model):
    host = host_model("two-socket")
    a = plan_domain(host, Config(), request(qsd_file(readonly="yes"), name="a"), Ledger())
    ledger = Ledger([Holding.from_plan(a)])
    plan_domain(host, Config(), request(qsd_file(readonly="yes")), ledger)
    assert "already used by domain a (not running)" in refused(host, Config(), request(qsd_file()), ledger)


def test_the_same_request_gives_the_same_plan(host_model):
    host = host_model("two-socket")
    req = request(nvme("0000:5f:00.0", backend="spdk") + qsd_file(target="vdc"))
    assert plan_domain(host, SPDK_CFG, req, Ledger()) == plan_domain(host, SPDK_CFG, req, Ledger())


def test_shared_vcpus_float_on_housekeeping_cores(host_model):
    plan = plan_domain(host_model("two-socket"), Config(),
                       request(nvme("0000:5e:00.0", backend="qsd"), vm="<vstor:vm cpus='shared'/>"), Ledger())
    assert plan.vcpu_pins == () and plan.shared_cpus == (16, 48) and plan.dedicated_cpus == frozenset()


def test_spdk_without_configured_reactors_is_refused(host_model):
    assert "no SPDK reactor cores configured" in refused(
        host_model("two-socket"), Config(), request(nvme("0000:5e:00.0", backend="spdk")))


# -- hosts whose NVMe the host itself uses ------------------------------------------------

def test_laptop_root_disk_is_never_passed_through_nor_given_to_spdk_or_qsd(host_model):
    host = host_model("laptop")
    msg = refused(host, SPDK_CFG, request(nvme("0000:02:00.0", mode="passthrough"), vcpus=2))
    assert "0000:02:00.0" in msg and "/" in msg
    msg = refused(host, Config(reactors=(1,)), request(nvme("0000:02:00.0", backend="spdk"), vcpus=2))
    assert "SPDK's PCIe driver takes the whole controller" in msg
    msg = refused(host, Config(), request(nvme("0000:02:00.0", backend="qsd"), vcpus=2))
    assert "in use by the host" in msg and "swap" in msg


def test_lvm_root_controller_is_refused_and_the_free_one_is_not(host_model):
    host = host_model("nvme-root")
    ctrl = host.controller("0000:01:00.0")
    assert ctrl.backs_root
    msg = refused(host, SPDK_CFG, request(nvme("0000:01:00.0", mode="passthrough"), vcpus=2))
    assert "vg0-root" in msg or "root" in msg
    plan = plan_domain(host, SPDK_CFG, request(nvme("0000:02:00.0", mode="passthrough"), vcpus=2), Ledger())
    assert plan.disks[0].mode == "passthrough"


def test_dirty_iommu_group_is_refused_naming_the_other_device(host_model):
    host = host_model("dirty-group")
    msg = refused(host, SPDK_CFG, request(nvme("0000:04:00.0", mode="passthrough"), vcpus=2))
    assert "0000:04:00.1" in msg and "ixgbe" in msg
    plan = plan_domain(host, SPDK_CFG, request(nvme("0000:04:00.0"), vm="<vstor:vm latency='critical'/>",
                                               vcpus=2), Ledger())
    assert plan.disks[0].mode == "vhost" and "passthrough is not possible" in plan.disks[0].reasons[0]
    assert plan_domain(host, SPDK_CFG, request(nvme("0000:05:00.0", mode="passthrough"), vcpus=2),
                       Ledger()).disks[0].mode == "passthrough"


def test_without_iommu_auto_falls_back_to_the_kernel_path(host_model):
    host = host_model("no-iommu")
    msg = refused(host, SPDK_CFG, request(nvme("0000:03:00.0", mode="passthrough"), vcpus=2))
    assert "intel_iommu=on" in msg
    plan = plan_domain(host, Config(default_backend="spdk", reactors=(1,)),
                       request(nvme("0000:03:00.0"), vcpus=2), Ledger())
    assert plan.disks[0].backend == "qsd"


# -- bad input ---------------------------------------------------------------------------

def test_unknown_controller_lists_the_known_ones(host_model):
    with pytest.raises(BadInput) as e:
        plan_domain(host_model("two-socket"), SPDK_CFG, request(nvme("0000:99:00.0")), Ledger())
    assert "0000:99:00.0 is not on this host" in str(e.value) and "0000:5e:00.0" in str(e.value)


@pytest.mark.parametrize("req, words", [
    (lambda: request(nvme("0000:5e:00.0", backend="spdk"), vm="<vstor:vm hugepages='none'/>"), "hugepages='none'"),
    (lambda: request(nvme("0000:5e:00.0", mode="passthrough", guest="spdk"), machine="pc"), "q35"),
    (lambda: request(nvme("0000:5e:00.0", mode="passthrough", backend="qsd")), "applies to vhost disks"),
    (lambda: request(nvme("0000:5e:00.0", mode="vhost", guest="spdk")), "needs the controller passed through"),
    (lambda: request(nvme("0000:5e:00.0", backend="spdk"), memory_mib=1025), "not a whole number"),
])
def test_contradictory_requests_are_bad_input(host_model, req, words):
    with pytest.raises(BadInput) as e:
        plan_domain(host_model("two-socket"), SPDK_CFG, req(), Ledger())
    assert words in str(e.value)


def test_a_core_that_is_both_reactor_and_housekeeping_is_refused(host_model):
    with pytest.raises(BadInput, match="both SPDK reactors and housekeeping"):
        plan_domain(host_model("two-socket"), Config(reactors=(0,), housekeeping=(0, 32)),
                    request(qsd_file()), Ledger())


def test_start_refuses_a_block_source_whose_nvme_namespace_got_mounted(host_model):
    from vstor.records import replace
    from vstor.planner import fit
    host = host_model("two-socket")
    req = request("<vstor:disk target='vdb'><vstor:block path='/dev/nvme1n1'/></vstor:disk>")
    plan = plan_domain(host, Config(), req, Ledger())
    validate = lambda h, cfg, p, ledger: fit.problems(h, cfg, req, p, ledger)  # noqa: E731
    assert validate(host, Config(), plan, Ledger()) == []
    ctrl = host.controller("0000:5e:00.0")
    mounted = replace(ctrl, namespaces=(replace(ctrl.namespaces[0], in_use=("mounted at /srv",)),))
    busy = replace(host, controllers=tuple(mounted if c is ctrl else c for c in host.controllers))
    assert validate(busy, Config(), plan, Ledger()) == ["vdb: /dev/nvme1n1 is in use by the host (mounted at /srv)"]


def test_a_controller_spdk_takes_for_one_vm_is_never_a_kernel_disk_for_another(host_model):
    """Both orders refuse: SPDK would unbind the kernel driver under the qsd disk."""
    host = host_model("two-socket")
    spdk = request(nvme("0000:60:00.0", backend="spdk", readonly="yes"), name="a")
    a = plan_domain(host, SPDK_CFG, spdk, Ledger())
    kernel = request(nvme("0000:60:00.0", backend="qsd", readonly="yes"), name="b")
    assert "SPDK takes the whole controller for a" in refused(
        host, SPDK_CFG, kernel, Ledger([Holding.from_plan(a)]))
    b = plan_domain(host, SPDK_CFG, kernel, Ledger())
    assert "served through the kernel to b" in refused(host, SPDK_CFG, spdk, Ledger([Holding.from_plan(b)]))


@pytest.mark.parametrize("path, words", [
    ("/dev/nvme0n1p3", "held by dm-0 (vg0-root), mounted at /"),
    ("/dev/nvme0n1p1", "mounted at /boot"),
    ("/dev/dm-0", "mounted at /"),
    ("/dev/dm-1", "swap"),
])
def test_a_block_source_the_host_uses_is_refused_naming_the_use(host_model, path, words):
    req = request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>")
    assert words in refused(host_model("nvme-root"), Config(), req)


def test_a_block_source_vstor_cannot_see_is_refused_not_assumed_free(host_model):
    for path in ("/dev/sdz", "/dev/mapper/vg0-root", "/dev/disk/by-id/nvme-x"):
        with pytest.raises(BadInput, match="cannot tell whether the host uses it"):
            plan_domain(host_model("nvme-root"), Config(),
                        request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>"), Ledger())


def test_start_refuses_memory_the_running_domains_hold_on_the_node(host_model):
    from vstor.planner import fit
    host = host_model("two-socket")
    big = dict(vm="<vstor:vm cpus='shared'/>", memory_mib=60 * 1024)
    req = request(nvme("0000:5f:00.0"), **big)
    plan = plan_domain(host, Config(), req, Ledger())      # planned while node 1 was empty
    running = [Holding.from_plan(plan_domain(host, Config(), request(nvme(a), name=n, **big), Ledger()),
                                 active=True) for a, n in (("0000:5e:00.0", "r0"), ("0000:60:00.0", "r1"))]
    assert fit.problems(host, Config(), req, plan, Ledger(running[:1])) == []
    (problem,) = fit.problems(host, Config(), req, plan, Ledger(running))
    assert problem.startswith("node 1 has 23552 MiB of memory left for VMs")


def test_the_reason_no_host_change_can_fix_comes_first(host_model):
    """Passthrough of the root disk's controller for a VM larger than the free
    hugepages: the root filesystem is the reason, not the hugepage pool."""
    message = refused(host_model("nvme-root"), Config(pci_blocked=("0000:01:00.0",)), request(
        nvme("0000:01:00.0", mode="passthrough"), vm="<vstor:vm hugepages='2M'/>", memory_mib=64 * 1024))
    first = message.split("cannot be passed through: ", 1)[1]
    assert first.startswith("0000:01:00.0 holds the host's root filesystem")
    assert first.index("PCI_BLOCKED") < first.index("mounted at /boot")
    assert "hugepages" not in message


def nvmf_at(addr, nsid=1, target="vdb", paths=(), reconnect="", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    more = "".join(f"<vstor:path traddr='{p}'/>" for p in paths)
    return (f"<vstor:disk target='{target}' {a}><vstor:nvmf transport='rdma' traddr='{addr}' "
            f"subnqn='nqn.2016-06.io.spdk:cnode1' namespace='{nsid}'>{more}{reconnect}</vstor:nvmf></vstor:disk>")


def test_a_remote_controller_is_named_by_everything_that_makes_it_a_connection(host_model):
    host = host_model("two-socket")

    def ctrl(disk):
        return plan_domain(host, SPDK_CFG, request(disk), Ledger()).disks[0].spdk_controller
    base = ctrl(nvmf_at("192.168.100.8"))
    assert ctrl(nvmf_at("192.168.100.8", nsid=2)) == base          # namespaces share a controller
    others = [nvmf_at("192.168.102.8"),                              # another target, same NQN
              nvmf_at("192.168.100.8", paths=("192.168.101.8",)),    # multipath
              nvmf_at("192.168.100.8", reconnect="<vstor:reconnect ctrlr_loss_timeout='5'/>")]
    names = [ctrl(d) for d in others]
    assert base not in names and len(set(names)) == len(names)
    assert ctrl(nvmf_at("192.168.100.8").replace("subnqn=", "hostnqn='nqn.2016-06.io.spdk:h2' subnqn=")) != base


def test_two_writers_of_one_remote_namespace_are_refused_on_any_shared_path(host_model):
    host = host_model("two-socket")
    a = plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8", paths=("192.168.101.8",)), name="a"),
                    Ledger())
    held = Ledger([Holding.from_plan(a)])
    assert "already used by domain a (" in refused(host, SPDK_CFG, request(nvmf_at("192.168.101.8")), held)
    # the same NQN on another target is another namespace; readers share
    plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.102.8")), held)
    plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8", nsid=2, paths=("192.168.101.8",))), held)
    ro = plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8", readonly="yes"), name="r"), Ledger())
    plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8", readonly="yes")), Ledger([Holding.from_plan(ro)]))


def test_a_path_another_controller_has_is_refused_unless_every_setting_matches(host_model):
    """SPDK keeps one controller per path and host NQN (bdev_nvme_create
    refuses a second with -EEXIST): a disk whose controller would differ
    from the one already on its path cannot start; one that matches shares it."""
    host = host_model("two-socket")
    a = plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8"), name="a"), Ledger())
    held = Ledger([Holding.from_plan(a)])
    why = "SPDK keeps one NVMe-oF controller per path and host NQN, and domain 'a' reaches RDMA 192.168.100.8:4420"
    for clash in (nvmf_at("192.168.100.8", nsid=2, paths=("192.168.101.8",)),
                  nvmf_at("192.168.100.8", nsid=2, reconnect="<vstor:reconnect ctrlr_loss_timeout='5'/>")):
        assert why in refused(host, SPDK_CFG, request(clash), held)
    plan_domain(host, SPDK_CFG, request(nvmf_at("192.168.100.8", nsid=2)), held)          # shares it
    other_host = nvmf_at("192.168.100.8", nsid=2).replace("subnqn=", "hostnqn='nqn.2016-06.io.spdk:h2' subnqn=")
    plan_domain(host, SPDK_CFG, request(other_host), held)                                 # its own
    two = nvmf_at("192.168.100.8") + nvmf_at("192.168.100.8", nsid=2, target="vdc", paths=("192.168.101.8",))
    assert "another disk of this domain reaches" in refused(host, SPDK_CFG, request(two), Ledger())
    again = holding_from_json(holding_to_json(Holding.from_plan(a)))
    assert again.connections == Holding.from_plan(a).connections != frozenset()


def test_a_pool_qemu_server_grows_counts_free_node_memory_once():
    """Proxmox raises the hugepage pool at the VM's start: the plan may count
    on the node's memory outside the pools, less what the host keeps and
    less pages promised to stopped VMs (each counted once)."""
    from vstor.config import Config
    from vstor.host.model import HugepagePool, NumaNode
    from vstor.planner.ledger import Holding, Ledger
    from vstor.planner.placement import place_hugepages
    from vstor.planner.disks import NoFit
    cfg = Config(memory_reserved_mib=1024)
    node = NumaNode(0, (0, 1), memory_kib=8 << 20, hugepages=(HugepagePool(2048, 0, 0),))
    stopped = Holding("pve-101", None, False, 0, frozenset(), (), ((0, 2048, 1024),), (),
                      frozenset(), frozenset(), frozenset(), frozenset())
    ledger = Ledger([stopped])              # 2 GiB promised; 7 GiB of room: 5 GiB left
    assert place_hugepages(node, 2048, 5 << 20, ledger, cfg) == 2560
    assert isinstance(place_hugepages(node, 2048, (5 << 20) + 2048, ledger, cfg), NoFit)
    assert isinstance(place_hugepages(node, 2048, 2048, Ledger(), None), NoFit)   # libvirt: no growing


def test_two_disks_of_one_domain_on_one_volume_are_both_readonly_or_refused(host_model):
    """Between domains the ledger refuses a second writer; within one domain
    it is the intent's own contradiction (exit 2), found before anything is
    made: two qemu-storage-daemons writing one file corrupt it."""
    host = host_model("two-socket")
    cases = [(qsd_file() + qsd_file(target="vdc"), "vdc", "vdb"),
             (qsd_file(readonly="yes") + qsd_file(target="vdc"), "vdc", "vdb"),
             (nvmf() + nvmf(target="vdc"), "vdc", "vdb"),
             (nvme("0000:5e:00.0", mode="vhost", backend="spdk") + qsd_file(target="vdc")
              + nvme("0000:5e:00.0", target="vdd", mode="vhost", backend="spdk"), "vdd", "vdb")]
    for disks, second, first in cases:
        with pytest.raises(BadInput) as e:
            plan_domain(host, SPDK_CFG, request(disks), Ledger())
        assert e.value.exit_code == 2 and str(e.value).startswith(
            f"disk {second}: its source is also disk {first}'s; two writers would corrupt it")
    both = plan_domain(host, SPDK_CFG, request(qsd_file(readonly="yes") + qsd_file(target="vdc", readonly="yes")),
                       Ledger())
    assert [d.target for d in both.disks] == ["vdb", "vdc"]


def test_a_remote_disk_always_names_its_host_nqn(host_layout, tmp_path):
    """Never SPDK's default (random at every start of SPDK's app): the
    disk's hostnqn, else [nvmf] hostnqn, else the host's /etc/nvme/hostnqn,
    else one made from /etc/machine-id (the same at every read); a host with
    none of them is refused with the fix."""
    import shutil
    from vstor import records
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    root = str(tmp_path / "h")
    shutil.copytree(host_layout("two-socket"), root, symlinks=True)

    def nqns(cfg=SPDK_CFG, hostnqn=None):
        disk = nvmf() if hostnqn is None else nvmf().replace("subnqn=", f"hostnqn='{hostnqn}' subnqn=")
        plan = plan_domain(read_host(SysFS(root)), cfg, request(disk), Ledger())
        return {p.hostnqn for p in plan.disks[0].attach}

    made = nqns()
    assert len(made) == 1 and made.pop().startswith("nqn.2014-08.org.nvmexpress:uuid:")
    assert nqns() == nqns() != {None}                                   # made once, the same after
    machine_id = open(f"{root}/etc/machine-id").read().strip()
    assert machine_id[:8] not in str(nqns()).replace("-", "")           # the machine ID stays here
    os.makedirs(f"{root}/etc/nvme")
    with open(f"{root}/etc/nvme/hostnqn", "w") as f:
        f.write("nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555\n")
    assert nqns() == {"nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"}
    cfg = records.replace(SPDK_CFG, hostnqn="nqn.2026-01.example:cfg")
    assert nqns(cfg) == {"nqn.2026-01.example:cfg"}
    assert nqns(cfg, hostnqn="nqn.2026-01.example:disk") == {"nqn.2026-01.example:disk"}
    os.unlink(f"{root}/etc/nvme/hostnqn")
    os.unlink(f"{root}/etc/machine-id")
    why = refused(read_host(SysFS(root)), SPDK_CFG, request(nvmf()))
    assert "vdb: this host has no NVMe host NQN to attach with" in why and "[nvmf] hostnqn" in why
    assert nqns(cfg) == {"nqn.2026-01.example:cfg"}


# -- block devices judged by what they stack on (issue 28) ------------------------------
#
# tests/hosts/stacked.toml: dm, md and partitions over loop, nbd, ublk and zram
# devices, beside an LVM volume on an NVMe partition and devices of rbd and
# drbd, which vstor takes.

def block(path: str) -> Request:
    return request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>")


LOOP_WHY = "vstor does not serve a loop device or what stacks on one, as the file behind it may lie outside"


@pytest.mark.parametrize("path, words, fix", [
    ("/dev/dm-0", f"/dev/dm-0 stacks on /dev/loop0, a loop device: {LOOP_WHY}", "losetup --list /dev/loop0"),
    ("/dev/md5", f"/dev/md5 stacks on /dev/loop1, a loop device: {LOOP_WHY}", "losetup --list /dev/loop1"),
    ("/dev/md7", "/dev/md7 stacks on /dev/loop3, a loop device", "losetup --list /dev/loop3"),
    ("/dev/dm-1", "/dev/dm-1 stacks on /dev/loop2 through /dev/md6p1, /dev/md6, a loop device",
     "losetup --list /dev/loop2"),
    ("/dev/md6p1", "/dev/md6p1 stacks on /dev/loop2 through /dev/md6, a loop device",
     "losetup --list /dev/loop2"),
    ("/dev/dm-2", "/dev/dm-2 stacks on /dev/nbd0p1, a network block device (nbd): vstor does not serve "
                  "a network block device (nbd) or what stacks on one", "the nbd server's command line"),
    ("/dev/nbd0", "/dev/nbd0 is a network block device (nbd): vstor does not serve", "nbd server"),
    ("/dev/nbd0p1", "/dev/nbd0p1 is a network block device (nbd)", "nbd server"),
    ("/dev/dm-3", "/dev/dm-3 stacks on /dev/ublkb0, a ublk device", "the ublk server's command line"),
    ("/dev/ublkb0", "/dev/ublkb0 is a ublk device", "ublk server"),
    ("/dev/dm-4", "/dev/dm-4 stacks on /dev/zram0, a RAM disk", "use a disk, a partition or a file"),
])
def test_a_device_stacked_on_a_loop_nbd_ublk_or_ram_device_is_refused_like_one(host_model, path, words, fix):
    with pytest.raises(BadInput) as e:
        plan_domain(host_model("stacked"), Config(), block(path), Ledger())
    assert e.value.exit_code == 2 and words in e.value.message and fix in e.value.hint
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", ["/dev/dm-5", "/dev/dm-6", "/dev/drbd0"])
def test_a_device_stacked_on_disks_is_taken(host_model, path):
    """An LVM volume on an NVMe partition, one on an rbd device, a drbd
    device: storage root configured, served by the kernel."""
    assert plan_domain(host_model("stacked"), Config(), block(path), Ledger()).disks[0].source.path == path


def test_start_refuses_a_block_source_that_came_to_stack_on_a_loop_device_with_the_plans_words(host_model):
    """Planned while /dev/dm-5 was on an NVMe partition; at start it is on
    a loop device (the same name, another stack): the start refuses it with
    the words the planner uses."""
    from vstor.planner import fit
    from vstor.records import replace
    host = host_model("stacked")
    plan = plan_domain(host, Config(), block("/dev/dm-5"), Ledger())
    assert fit.problems(host, Config(), block("/dev/dm-5"), plan, Ledger()) == []
    moved = replace(host, block_devices=tuple(replace(d, stacks_on=("dm-5", "loop0")) if d.name == "dm-5" else d
                                              for d in host.block_devices))
    with pytest.raises(BadInput) as e:
        plan_domain(moved, Config(), block("/dev/dm-5"), Ledger())
    assert fit.problems(moved, Config(), block("/dev/dm-5"), plan, Ledger()) == [e.value.message]
    assert e.value.message.startswith("/dev/dm-5 stacks on /dev/loop0, a loop device")


def test_host_show_never_offers_a_stacked_device_and_each_row_plans_as_it_says(host_layout, capsys):
    from vstor.cli.main import main
    from vstor.host.read import block_sources, read_host
    from vstor.host.sysfs import SysFS
    assert main(["--host-root", host_layout("stacked"), "host", "show"]) == 0
    out = capsys.readouterr().out
    assert "  block sources vstor would take: /dev/dm-5 (107 GB), /dev/dm-6 (17 GB), /dev/drbd0 (17 GB)\n" in out
    assert "    not /dev/dm-1: stacks on /dev/loop2 through /dev/md6p1, /dev/md6, a loop device\n" in out
    assert "    not /dev/md6: stacks on /dev/loop2, a loop device; held by dm-1 (vg-part) (md6p1)\n" in out
    assert "never a loop, nbd, ublk or RAM device or what stacks on one" in out
    host = read_host(SysFS(host_layout("stacked")))
    for path, _, use in block_sources(host):
        if not use:
            assert plan_domain(host, Config(), block(path), Ledger()).disks[0].source.path == path
        elif use[0].startswith("stacks on"):
            with pytest.raises(BadInput, match=f"^{re.escape(f'{path} {use[0]}: ')}"):
                plan_domain(host, Config(), block(path), Ledger())
        else:
            assert use[0] in refused(host, Config(), block(path))


# -- issue 28: a refusal names who holds what is short ----------------------------------------

def test_no_free_cores_names_the_domains_that_hold_them_and_whether_they_run(host_model):
    """Here a shut-off domain held the node's cores: the refusal says so
    (its plan holds them while it is defined)."""
    host = host_model("laptop")
    web1 = plan_domain(host, Config(), request(qsd_file("/var/lib/vstor/images/w.raw"), name="web1"), Ledger())
    db2 = plan_domain(host, Config(), request(qsd_file("/var/lib/vstor/images/d.raw"), name="db2", vcpus=2),
                      Ledger([Holding.from_plan(web1)]))
    ledger = Ledger([Holding.from_plan(web1, active=False), Holding.from_plan(db2, active=True)])
    why = refused(host, Config(), request(qsd_file(), vcpus=2), ledger)
    assert ("node 0: 0 whole free cores (0 threads) for dedicated vCPUs, the VM needs 2 (free cores or use "
            "cpus='shared'); cores held by web1 (not running), db2 (running)") in why


def test_the_holders_named_are_a_few_then_how_many_more(host_model):
    from vstor.planner.placement import holders
    host, ledger = host_model("two-socket"), Ledger()
    for i in range(6):
        plan = plan_domain(host, Config(), request(qsd_file(f"/var/lib/vstor/images/{i}.raw"), name=f"vm{i}",
                                                  vcpus=2), ledger)
        ledger = Ledger([*ledger.holdings, Holding.from_plan(plan, active=i != 2)])
    # In the order of their CPUs: the planner put the even ones on node 0.
    assert holders(ledger, range(128)) == "vm0 (running), vm2 (not running), vm4 (running) and 3 more"
    assert holders(ledger, ()) == ""


# -- issue 28: a volume's holder, whether it runs, and how to free it -------------------------

BLOCK_NS = "<vstor:disk target='vdb'><vstor:block path='/dev/nvme1n1'/></vstor:disk>"


@pytest.mark.parametrize("held, asked", [(nvme("0000:5e:00.0"), BLOCK_NS), (BLOCK_NS, nvme("0000:5e:00.0"))],
                         ids=["nvme-then-block", "block-then-nvme"])
def test_a_namespace_named_as_nvme_and_as_its_block_device_is_one_volume(host_model, held, asked):
    """<vstor:nvme controller ns> and <vstor:block path='/dev/nvmeXnY'> are
    one namespace: a domain that is not running holds it by its plan, and
    the refusal names it, its state and how to free it."""
    host = host_model("two-socket")
    web1 = plan_domain(host, Config(), request(held, name="web1"), Ledger())
    why = refused(host, Config(), request(asked, name="db2"), Ledger([Holding.from_plan(web1, active=False)]))
    assert "web1 (not running)" in why, why
    if asked == BLOCK_NS:
        assert "/dev/nvme1n1 is already used by domain web1 (not running); two writers would corrupt it" in why
        assert "give web1 another disk and vstor apply web1, or virsh undefine web1" in why


def test_a_file_held_by_a_domain_that_is_not_running_says_how_to_free_it(host_model):
    host = host_model("two-socket")
    web1 = plan_domain(host, Config(), request(qsd_file(), name="web1"), Ledger())
    for active, fix in ((False, "web1 is not running, but its plan holds it: give web1 another disk and vstor "
                                "apply web1, or virsh undefine web1; or make both readonly='yes'"),
                        (True, "make both readonly='yes' or pick another; if web1 has stopped, vstor release web1")):
        why = refused(host, Config(), request(qsd_file(), name="db2"), Ledger([Holding.from_plan(web1, active=active)]))
        assert f"already used by domain web1 ({'running' if active else 'not running'}); two writers would corrupt it ({fix})" \
            in why, why


def test_a_controller_a_stopped_domain_passes_through_is_not_planned_for_another(host_model):
    """Its plan takes the whole controller from the kernel at its start: no
    namespace of it is another domain's meanwhile."""
    host = host_model("three-node")
    web1 = plan_domain(host, Config(), request(nvme("0000:81:00.0", mode="passthrough"), name="web1"), Ledger())
    ns2 = "<vstor:disk target='vdb'><vstor:nvme controller='0000:81:00.0' namespace='2'/></vstor:disk>"
    why = refused(host, Config(), request(ns2, name="db2"), Ledger([Holding.from_plan(web1, active=False)]))
    assert "qsd: the controller is passed through to web1 (not running)" in why, why
