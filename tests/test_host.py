"""read_host on synthetic trees of the named layouts, on one-off layouts, and
on the machine the tests run on."""

import os
import pathlib
import socket

import pytest

from tests.helpers import as_nobody
from tests.helpers import refused, request
from vstor.cli.main import main
from vstor.config import Config
from vstor.errors import BadInput
from vstor.host.read import read_host
from vstor.host.model import NVME_CLASS
from vstor.host.sysfs import SysFS
from vstor.planner import plan_domain
from vstor.planner.ledger import Ledger
from tests.hostlayout import build_tree


def tree_host(tmp_path, layout: dict):
    return read_host(SysFS(build_tree(layout, tmp_path / "root")))


# --- the two-socket server ----------------------------------------------------

def test_two_socket_nodes_cpus_and_smt_siblings(host_model):
    host = host_model("two-socket")
    assert host.hostname == "compute-7"
    assert [n.id for n in host.nodes] == [0, 1]
    assert host.node(0).cpus == tuple(range(0, 16)) + tuple(range(32, 48))
    assert host.node(1).cpus == tuple(range(16, 32)) + tuple(range(48, 64))
    assert len(host.cpus) == 64
    assert host.cpu(5).siblings == (5, 37) and host.cpu(37).siblings == (5, 37)
    assert host.cpu(5).core_id == host.cpu(37).core_id
    assert (host.cpu(20).node, host.cpu(20).package) == (1, 1)
    assert not any(cpu.isolated for cpu in host.cpus)


def test_two_socket_memory_and_hugepage_pools(host_model):
    for node in host_model("two-socket").nodes:
        assert node.memory_kib == 192 * 1024 * 1024
        assert (node.pool(2048).total, node.pool(2048).free) == (8192, 8192)
        assert (node.pool(1048576).total, node.pool(1048576).free) == (32, 32)


def test_two_socket_controllers_are_free_and_on_their_nodes(host_model):
    host = host_model("two-socket")
    assert sorted(c.address for c in host.controllers) == [
        "0000:3b:00.0", "0000:5e:00.0", "0000:5f:00.0", "0000:60:00.0", "0000:61:00.0"]
    for address in ("0000:5e:00.0", "0000:5f:00.0", "0000:60:00.0", "0000:61:00.0"):
        ctrl = host.controller(address)
        assert ctrl.numa_node == 1 and ctrl.driver == "nvme"
        assert ctrl.name and ctrl.name.startswith("nvme")
        assert ctrl.local_cpus == host.node(1).cpus
        assert ctrl.group_peers == () and ctrl.iommu_group is not None
        assert [ns.nsid for ns in ctrl.namespaces] == [1]
        assert ctrl.in_use == () and not ctrl.backs_root
    assert host.controller("0000:3b:00.0").numa_node == 0


def test_controller_identity_namespace_size_and_scheduler(host_model):
    host = host_model("two-socket")
    samsung = host.controller("0000:61:00.0")
    assert (samsung.vendor, samsung.device) == ("0x144d", "0xa824")
    assert samsung.model == "SAMSUNG MZQL23T8HCLS-00A07" and samsung.serial == "S64HNE0T610001"
    ns = samsung.namespace(1)
    assert ns.name == f"{samsung.name}n1"
    assert ns.size_bytes == 3_840_000_000_000
    assert ns.scheduler == "mq-deadline"
    assert host.controller("0000:60:00.0").namespace(1).scheduler == "none"
    assert host.block_device(ns.name).size_bytes == ns.size_bytes


def test_controller_irqs_cover_every_cpu_with_their_affinity(host_model):
    host = host_model("two-socket")
    ctrl = host.controller("0000:5e:00.0")
    assert len(ctrl.irqs) == 33     # admin queue + one per I/O queue
    every = {cpu.id for cpu in host.cpus}
    covered = set()
    for irq, cpus in ctrl.irqs:
        assert irq > 0 and cpus and set(cpus) <= every
        covered |= set(cpus)
    assert covered == every
    numbers = [irq for irq, _ in ctrl.irqs]
    assert numbers == sorted(set(numbers))


def test_two_socket_rdma_nic_kernel_switches(host_model):
    host = host_model("two-socket")
    nic = host.rdma_nic("mlx5_0")
    assert (nic.address, nic.numa_node) == ("0000:17:00.0", 0)
    assert [(n.name, n.mtu) for n in nic.netdevs] == [("ens1f0np0", 4096)]
    assert host.cmdline.endswith("intel_iommu=on iommu=pt")
    assert host.iommu_enabled and host.vfio_available
    assert host.thp == "never" and not host.irqbalance_running
    # RDMA NICs and root ports are PCI devices too, but not NVMe controllers.
    assert all(c.address != "0000:17:00.0" for c in host.controllers)


# --- what the host uses -------------------------------------------------------

def test_laptop_nvme_holds_root_and_swap(host_model):
    host = host_model("laptop")
    assert len(host.nodes) == 1 and len(host.cpus) == 8
    assert host.cpu(0).siblings == (0, 4)
    ctrl = host.controller("0000:02:00.0")
    assert ctrl.backs_root and ctrl.vendor == "0x144d"
    ns = ctrl.namespace(1)
    assert ns.partitions == ("nvme0n1p1", "nvme0n1p2", "nvme0n1p3")
    assert ns.in_use == ("mounted at /boot/efi (nvme0n1p1)", "mounted at / (nvme0n1p2)",
                         "swap (nvme0n1p3)")
    assert ctrl.in_use[1] == "nvme0n1: mounted at / (nvme0n1p2)"
    assert host.block_device("nvme0n1").in_use == ns.in_use
    assert host.irqbalance_running and host.thp == "madvise"


def test_root_on_lvm_over_an_nvme_partition(host_model):
    host = host_model("nvme-root")
    ctrl = host.controller("0000:01:00.0")
    assert ctrl.backs_root
    uses = ctrl.namespace(1).in_use
    assert "held by dm-0 (vg0-root), mounted at / (nvme0n1p3)" in uses
    # /proc/swaps names it /dev/mapper/vg0-swap: found through dm/name.
    assert "held by dm-1 (vg0-swap), swap (nvme0n1p3)" in uses
    assert "mounted at /boot (nvme0n1p1)" in uses
    free = host.controller("0000:02:00.0")
    assert free.in_use == () and not free.backs_root
    assert host.block_device("dm-0").in_use == ("mounted at /",)
    assert host.block_device("dm-1").in_use == ("swap",)


def test_a_whole_namespace_held_by_md_and_dm_is_in_use(tmp_path):
    host = tree_host(tmp_path, {
        "nvme": [{"address": "0000:01:00.0"}, {"address": "0000:02:00.0"}],
        "volume": [{"name": "md0", "on": ["nvme0n1", "nvme1n1"]},
                   {"name": "data-vol", "on": ["md0"], "mount": "/var/lib/data"}]})
    for ctrl in host.controllers:
        assert ctrl.namespace(1).in_use == ("held by md0, held by dm-0 (data-vol), mounted at /var/lib/data",)
        assert not ctrl.backs_root


def test_dev_root_in_mountinfo_is_found_by_device_number(tmp_path):
    host = tree_host(tmp_path, {"nvme": [{"address": "0000:01:00.0", "namespace": [
        {"partitions": [{"size": "100GiB", "mount": "/", "source": "/dev/root"}]}]}]})
    assert host.controllers[0].backs_root
    assert host.controllers[0].namespace(1).in_use == ("mounted at / (nvme0n1p1)",)


# --- IOMMU groups and drivers ---------------------------------------------------

def test_dirty_group_peers_are_the_other_members(host_model):
    host = host_model("dirty-group")
    dirty = host.controller("0000:04:00.0")
    assert dirty.iommu_group == 12
    assert len(dirty.group_peers) == 1
    nic = dirty.group_peers[0]
    assert (nic.address, nic.pci_class, nic.driver, nic.vendor) == ("0000:04:00.1", "0x020000", "ixgbe", "0x8086")
    assert not nic.is_bridge
    clean = host.controller("0000:05:00.0")
    assert clean.iommu_group == 13 and clean.group_peers == ()


def test_no_iommu_host(host_model):
    host = host_model("no-iommu")
    assert not host.iommu_enabled and not host.vfio_available
    ctrl = host.controllers[0]
    assert ctrl.iommu_group is None and ctrl.group_peers == ()
    assert ctrl.namespace(1) is not None


def test_controllers_on_vfio_or_no_driver_are_still_found(tmp_path):
    host = tree_host(tmp_path, {"nvme": [
        {"address": "0000:01:00.0", "driver": "vfio-pci"},
        {"address": "0000:02:00.0", "driver": ""},
        {"address": "0000:03:00.0"}]})
    by_driver = {c.address: (c.driver, c.name, c.namespaces) for c in host.controllers}
    assert by_driver["0000:01:00.0"] == ("vfio-pci", None, ())
    assert by_driver["0000:02:00.0"] == (None, None, ())
    driver, name, namespaces = by_driver["0000:03:00.0"]
    assert (driver, name, len(namespaces)) == ("nvme", "nvme0", 1)
    assert all(c.vendor == "0x8086" for c in host.controllers)


def test_group_peer_bridges_are_marked(tmp_path):
    host = tree_host(tmp_path, {
        "pci": [{"address": "0000:00:1c.0", "class": "0x060400", "driver": "pcieport", "iommu_group": 7}],
        "nvme": [{"address": "0000:01:00.0", "port": "0000:00:1c.0", "iommu_group": 7}]})
    (peer,) = host.controllers[0].group_peers
    assert peer.address == "0000:00:1c.0" and peer.is_bridge and peer.driver == "pcieport"


# --- namespaces ---------------------------------------------------------------------

def test_several_namespaces_sorted_by_nsid(tmp_path):
    host = tree_host(tmp_path, {"nvme": [{"address": "0000:01:00.0", "namespace": [
        {"size": "2TB"}, {"nsid": 3, "size": "512GiB", "scheduler": "kyber"}]}]})
    ctrl = host.controllers[0]
    assert [(ns.name, ns.nsid, ns.size_bytes) for ns in ctrl.namespaces] == [
        ("nvme0n1", 1, 2 * 10**12), ("nvme0n3", 3, 512 * 2**30)]
    assert ctrl.namespace(3).scheduler == "kyber"


def test_nsid_comes_from_the_name_when_the_attribute_is_missing(tmp_path):
    root = build_tree({"nvme": [{"address": "0000:01:00.0", "namespace": [{"nsid": 2}]}]}, tmp_path / "r")
    os.unlink(os.path.realpath(f"{root}/sys/block/nvme0n2") + "/nsid")
    assert read_host(SysFS(root)).controllers[0].namespaces[0].nsid == 2


def test_native_multipath_uses_the_head_block_device(tmp_path):
    host = tree_host(tmp_path, {"nvme": [{"address": "0000:01:00.0", "multipath": True,
                                          "namespace": [{"size": "1TB", "mount": "/srv"}]}]})
    ctrl = host.controllers[0]
    assert [(ns.name, ns.nsid) for ns in ctrl.namespaces] == [("nvme0n1", 1)]
    assert ctrl.namespace(1).in_use == ("mounted at /srv",)
    # the hidden per-path device nvme0c0n1 is not a disk anyone can use
    assert [d.name for d in host.block_devices] == ["nvme0n1"]


# --- CPUs without NUMA, isolated CPUs ------------------------------------------------

def test_isolated_cpus(tmp_path):
    host = tree_host(tmp_path, {"smt": 2, "node": [{"cores": 4}], "isolated": "2-3,6-7"})
    assert [c.id for c in host.cpus if c.isolated] == [2, 3, 6, 7]


def test_a_kernel_without_numa_is_one_node_with_every_cpu(tmp_path):
    root = build_tree({"numa": False, "node": [{"cores": 6, "memory": "8GiB",
                                                "hugepages": {"2M": [512, 100]}}]}, tmp_path / "r")
    assert not os.path.exists(f"{root}/sys/devices/system/node")
    host = read_host(SysFS(root))
    (node,) = host.nodes
    assert node.id == 0 and node.cpus == tuple(range(6))
    assert node.memory_kib == 8 * 1024 * 1024
    assert (node.pool(2048).total, node.pool(2048).free) == (512, 100)
    assert {cpu.node for cpu in host.cpus} == {0}


def test_non_nvme_disks_and_partitions_are_block_devices_loops_are_not(tmp_path):
    root = build_tree({"disk": [{"name": "sda", "size": "480GB", "partitions": [{"mount": "/"}]},
                                {"name": "sdb", "size": "2TB"}]}, tmp_path / "r")
    os.makedirs(f"{root}/sys/devices/virtual/block/loop0")
    os.symlink("../devices/virtual/block/loop0", f"{root}/sys/block/loop0")
    host = read_host(SysFS(root))
    got = [(d.name, d.in_use) for d in host.block_devices]
    assert got == [("sda", ("mounted at / (sda1)",)), ("sda1", ("mounted at /",)), ("sdb", ())]
    assert host.block_device("sdb").size_bytes == 2 * 10**12
    assert host.controllers == ()


# --- the machine the tests run on ----------------------------------------------------

def test_read_host_on_this_machine():
    host = read_host(SysFS("/"))
    assert len(host.cpus) == os.cpu_count()
    assert host.nodes and {c.node for c in host.cpus} <= {n.id for n in host.nodes}
    assert sorted(c for n in host.nodes for c in n.cpus) == [c.id for c in host.cpus]
    assert host.hostname == socket.gethostname()
    assert host.thp in ("always", "madvise", "never", "")
    for ctrl in host.controllers:
        with open(f"/sys/bus/pci/devices/{ctrl.address}/class") as f:
            assert f.read().strip() == NVME_CLASS


@pytest.mark.parametrize("name", ["laptop", "two-socket", "nvme-root", "dirty-group", "no-iommu", "stacked"])
def test_every_named_layout_reads_consistently(host_model, name):
    host = host_model(name)
    assert {c.id for c in host.cpus} == {c for n in host.nodes for c in n.cpus}
    for ctrl in host.controllers:
        assert ctrl.numa_node in {n.id for n in host.nodes}
        assert ctrl.namespaces and ctrl.name


def test_btrfs_mount_with_an_anonymous_device_number_is_found_by_source(tmp_path):
    root = build_tree({"nvme": [{"address": "0000:01:00.0", "namespace": [
        {"partitions": [{"size": "100GiB", "mount": "/", "fs": "btrfs"}]}]}]}, tmp_path / "r")
    mountinfo = pathlib.Path(os.path.realpath(f"{root}/proc/self/mountinfo"))
    text = mountinfo.read_text()
    assert " 259:1 / / " in text
    # btrfs reports an anonymous device (0:N) in mountinfo, not the partition's.
    mountinfo.write_text(text.replace(" 259:1 / / ", " 0:31 / / "))
    ctrl = read_host(SysFS(root)).controllers[0]
    assert ctrl.backs_root and ctrl.namespace(1).in_use == ("mounted at / (nvme0n1p1)",)


@pytest.mark.parametrize("gone", ["proc/self/mountinfo", "proc/swaps"])
def test_an_unreadable_mount_or_swap_table_is_a_refusal_not_nothing_mounted(tmp_path, gone):
    from vstor.errors import Unavailable
    root = build_tree(os.path.join(os.path.dirname(__file__), "hosts", "nvme-root.toml"), tmp_path / "r")
    os.unlink(os.path.realpath(os.path.join(root, gone)))
    with pytest.raises(Unavailable, match="cannot tell which disks the host uses"):
        read_host(SysFS(root))


# --- a read the kernel refuses is a refusal, never "nothing there" ------------------

def test_an_attribute_the_kernel_refuses_is_unreadable_not_the_default():
    """/proc/self/mem at offset 0 is a real EIO from this kernel."""
    from vstor.host.sysfs import Unreadable
    with pytest.raises(Unreadable, match=r"cannot read /proc/self/mem: Input/output error \(check the device"):
        SysFS("/").read("/proc/self/mem", "")
    assert SysFS("/").read("/proc/self/mem", "x", optional=True) == "x"    # one that decides nothing
    assert SysFS("/").read("/proc/no-such-file", "absent") == "absent"      # absence is an answer


@pytest.fixture
def open_tree():
    """name -> the tree of tests/hosts/<name>.toml where nobody may read it
    (pytest's tmp_path is root-only), read once as root first (what
    read_host imports lazily may lie where nobody can read); removed after."""
    import shutil
    import tempfile
    work = tempfile.mkdtemp(prefix="vs-perm-", dir="/tmp")
    os.chmod(work, 0o755)

    def build(name: str) -> str:
        root = build_tree(os.path.join(os.path.dirname(__file__), "hosts", f"{name}.toml"), os.path.join(work, name))
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        read_host(SysFS(root))
        return root
    yield build
    shutil.rmtree(work)


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_permission_denied_read_refuses_the_host_instead_of_reading_it_as_absent(open_tree):
    root = open_tree("two-socket")
    assert as_nobody(lambda: len(read_host(SysFS(root)).controllers)) == ("ok", "5")
    # The driver link of a controller, behind a directory nobody else may enter.
    dev = os.path.realpath(os.path.join(root, "sys/bus/pci/devices/0000:5e:00.0"))
    os.chmod(dev, 0o700)
    kind, message = as_nobody(lambda: read_host(SysFS(root)))
    assert kind == "Unreadable" and "Permission denied (run vstor as root)" in message
    assert "/sys/bus/pci/devices/0000:5e:00.0/" in message


def test_the_host_nqn_made_from_the_machine_id_is_stable_and_a_v4_uuid(tmp_path):
    """Without /etc/nvme/hostnqn, the NQN is made from the machine ID: the
    same on every read, a version 4 UUID as the NVMe base specification's
    uuid form wants it, and not the machine ID itself."""
    import uuid
    from vstor.host.read import read_hostnqn
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    nqns = {read_hostnqn(SysFS(str(tmp_path))) for _ in range(2)}
    assert len(nqns) == 1
    nqn = nqns.pop()
    prefix = "nqn.2014-08.org.nvmexpress:uuid:"
    assert nqn.startswith(prefix)
    made = uuid.UUID(nqn[len(prefix):])
    assert made.version == 4 and made.variant == uuid.RFC_4122 and str(made) == nqn[len(prefix):]
    assert made.hex != "0123456789abcdef0123456789abcdef"


# --- what a block device stacks on (issue 28) ----------------------------------------

def test_each_block_device_knows_the_loop_nbd_ublk_or_ram_device_it_stacks_on(host_model):
    """tests/hosts/stacked.toml: down slaves/ (dm, md) and from a partition
    to its disk, to the first device the model does not list as a disk."""
    stacks = {d.name: d.stacks_on for d in host_model("stacked").block_devices}
    assert stacks == {
        "dm-0": ("dm-0", "loop0"), "dm-1": ("dm-1", "md6p1", "md6", "loop2"), "dm-2": ("dm-2", "nbd0p1"),
        "dm-3": ("dm-3", "ublkb0"), "dm-4": ("dm-4", "zram0"), "md5": ("md5", "loop1"),
        "md6": ("md6", "loop2"), "md6p1": ("md6p1", "md6", "loop2"), "md7": ("md7", "loop3"),
        # on disks: an NVMe partition (dm-5), an rbd device (dm-6); drbd and rbd themselves
        "dm-5": (), "dm-6": (), "drbd0": (), "rbd0": (), "nvme0n1": (), "nvme0n1p1": (), "nvme0n1p2": (),
        "sda": (), "sda1": (), "sda2": ()}


def test_a_stack_deeper_than_the_kernel_makes_is_a_refusal_not_nothing_below(tmp_path):
    """Two dm devices each the other's slave: no kernel makes that; a
    hand-edited tree does, and vstor cannot tell what either stacks on."""
    from vstor.host.sysfs import Unreadable
    root = build_tree({"volume": [{"name": "a"}, {"name": "b"}]}, tmp_path / "r")
    os.symlink("../../dm-1", f"{root}/sys/devices/virtual/block/dm-0/slaves/dm-1")
    os.symlink("../../dm-0", f"{root}/sys/devices/virtual/block/dm-1/slaves/dm-0")
    with pytest.raises(Unreadable, match=r"/dev/dm-0 stacks more than 16 devices deep"):
        read_host(SysFS(root))


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_slaves_directory_the_kernel_refuses_is_a_refusal_not_nothing_below(open_tree):
    root = open_tree("stacked")
    assert as_nobody(lambda: read_host(SysFS(root)).block_device("dm-0").stacks_on) == ("ok", "('dm-0', 'loop0')")
    os.chmod(f"{root}/sys/devices/virtual/block/dm-5/slaves", 0o700)
    kind, message = as_nobody(lambda: read_host(SysFS(root)))
    assert (kind, message) == ("Unreadable", "cannot read /sys/class/block/dm-5/slaves: Permission denied "
                                             "(run vstor as root)")


# -- a loop device as a block source, and what host show says vstor would take ------------------


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
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    host = read_host(SysFS(host_layout("nvme-root")))
    for path, _, use in block_sources(host):
        req = request(f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>")
        if use:
            assert use[0] in refused(host, Config(), req)
        else:
            assert plan_domain(host, Config(), req, Ledger()).disks[0].source.path == path
