"""The layout builder writes the files and the symlinks the kernel makes."""

import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from vstor.errors import BadInput
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
import tests.hostlayout as hostlayout
from tests.hostlayout import build_tree, parse_size
from tests.hostlayout.__main__ import USAGE, main


def link(root, host_path) -> str:
    target = os.readlink(f"{root}{host_path}")
    assert not target.startswith("/"), f"{host_path} -> {target} is absolute"
    return target


def real(root, host_path) -> str:
    return "/" + os.path.relpath(os.path.realpath(f"{root}{host_path}"), root)


def read(root, host_path) -> str:
    with open(f"{root}{host_path}") as f:
        return f.read().strip()


def test_pci_device_links(host_layout):
    root = host_layout("two-socket")
    dev = "/sys/bus/pci/devices/0000:5e:00.0"
    assert link(root, dev).startswith("../../../devices/pci0000:")
    path = real(root, dev)
    assert path.startswith("/sys/devices/pci0000:") and path.endswith("/0000:5e:00.0")
    assert link(root, f"{dev}/driver").endswith("/bus/pci/drivers/nvme")
    assert real(root, f"{dev}/driver") == "/sys/bus/pci/drivers/nvme"
    assert real(root, "/sys/bus/pci/drivers/nvme/0000:5e:00.0") == path
    group = real(root, f"{dev}/iommu_group")
    assert group.startswith("/sys/kernel/iommu_groups/")
    assert real(root, f"{group}/devices/0000:5e:00.0") == path
    assert read(root, f"{dev}/class") == "0x010802"
    assert read(root, f"{dev}/numa_node") == "1"
    assert read(root, f"{dev}/driver_override") == "(null)"


def test_driver_directories_and_probe(host_layout):
    root = host_layout("two-socket")
    for driver in ("nvme", "vfio-pci", "mlx5_core", "pcieport"):
        for attr in ("bind", "unbind"):
            assert os.path.isfile(f"{root}/sys/bus/pci/drivers/{driver}/{attr}")
    assert os.path.isfile(f"{root}/sys/bus/pci/drivers_probe")
    assert os.path.exists(f"{root}/sys/module/vfio_pci")


def test_nvme_class_and_block_links(host_layout):
    root = host_layout("laptop")
    assert link(root, "/sys/class/nvme/nvme0").startswith("../../devices/pci0000:")
    ctrl = real(root, "/sys/class/nvme/nvme0")
    pci = real(root, "/sys/bus/pci/devices/0000:02:00.0")
    assert ctrl == f"{pci}/nvme/nvme0"
    assert real(root, "/sys/class/nvme/nvme0/device") == pci
    assert real(root, "/sys/block/nvme0n1") == f"{ctrl}/nvme0n1"
    assert real(root, "/sys/class/block/nvme0n1p2") == f"{ctrl}/nvme0n1/nvme0n1p2"
    devnum = read(root, "/sys/block/nvme0n1/nvme0n1p2/dev")
    assert real(root, f"/sys/dev/block/{devnum}") == f"{ctrl}/nvme0n1/nvme0n1p2"
    assert read(root, "/sys/block/nvme0n1/queue/scheduler") == "[none] mq-deadline kyber bfq"
    assert int(read(root, "/sys/block/nvme0n1/size")) * 512 == 10**12


def test_holders_and_slaves_link_both_ways(host_layout):
    root = host_layout("nvme-root")
    part = "/sys/block/nvme0n1/nvme0n1p3"
    assert real(root, f"{part}/holders/dm-0") == "/sys/devices/virtual/block/dm-0"
    assert real(root, "/sys/block/dm-0/slaves/nvme0n1p3") == real(root, part)
    assert read(root, "/sys/block/dm-0/dm/name") == "vg0-root"
    mountinfo = read(root, "/proc/self/mountinfo")
    devnum = read(root, "/sys/block/dm-0/dev")
    assert f" {devnum} / / rw" in mountinfo and "/dev/mapper/vg0-root" in mountinfo
    assert "/dev/mapper/vg0-swap" in read(root, "/proc/swaps")


def test_procfs(host_layout):
    root = host_layout("laptop")
    assert os.path.islink(f"{root}/proc/self")
    assert link(root, "/proc/self").isdigit()
    assert read(root, "/proc/sys/kernel/hostname") == "laptop"
    assert "intel_iommu=on" in read(root, "/proc/cmdline")
    comms = {read(root, f"/proc/{p}/comm") for p in os.listdir(f"{root}/proc") if p.isdigit()}
    assert "irqbalance" in comms
    irqs = os.listdir(os.path.realpath(f"{root}/sys/bus/pci/devices/0000:02:00.0/msi_irqs"))
    assert irqs and all(os.path.isfile(f"{root}/proc/irq/{n}/smp_affinity_list") for n in irqs)


def test_cpu_topology_and_nodes(host_layout):
    root = host_layout("two-socket")
    assert read(root, "/sys/devices/system/cpu/online") == "0-63"
    assert read(root, "/sys/devices/system/node/node1/cpulist") == "16-31,48-63"
    assert read(root, "/sys/devices/system/cpu/cpu17/topology/thread_siblings_list") == "17,49"
    assert read(root, "/sys/devices/system/node/node0/hugepages/hugepages-1048576kB/nr_hugepages") == "32"
    assert "MemTotal:       201326592 kB" in read(root, "/sys/devices/system/node/node1/meminfo")


def test_rdma_nic(host_layout):
    root = host_layout("two-socket")
    pci = real(root, "/sys/bus/pci/devices/0000:17:00.0")
    assert real(root, "/sys/class/infiniband/mlx5_0") == f"{pci}/infiniband/mlx5_0"
    assert real(root, "/sys/class/infiniband/mlx5_0/device") == pci
    assert read(root, "/sys/class/infiniband/mlx5_0/device/net/ens1f0np0/mtu") == "4096"
    assert read(root, "/sys/class/infiniband/mlx5_0/device/vendor") == "0x15b3"


def test_no_iommu_layout_has_no_groups_and_no_vfio(host_layout):
    root = host_layout("no-iommu")
    assert os.listdir(f"{root}/sys/kernel/iommu_groups") == []
    assert not os.path.exists(f"{root}/sys/bus/pci/devices/0000:03:00.0/iommu_group")
    assert not os.path.exists(f"{root}/sys/bus/pci/drivers/vfio-pci")


def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("16G") == 16 * 2**30
    assert parse_size("960GB") == 960 * 10**9
    assert parse_size("3.84TB") == 3_840_000_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(BadInput):
        parse_size("lots")


@pytest.mark.parametrize("layout, message", [
    ({"nvme": [{"adress": "0000:01:00.0"}]}, "unknown key"),
    ({"nvme": [{"address": "5e:00"}]}, "not a PCI address"),
    ({"nvme": [{"address": "0000:01:00.0"}, {"address": "0000:01:00.0"}]}, "described twice"),
    ({"volume": [{"name": "vg-x", "on": ["sdz1"]}]}, "does not describe"),
    ({"node": [{"memory": "1GiB"}]}, "needs 'cores'"),
])
def test_mistakes_in_a_layout_are_named(tmp_path, layout, message):
    with pytest.raises(BadInput, match=message):
        build_tree(layout, tmp_path / "r")


def test_command_line(tmp_path, capsys):
    toml = tmp_path / "mine.toml"
    toml.write_text('hostname = "mine"\n[[node]]\ncores = 2\n[[nvme]]\naddress = "0000:01:00.0"\n')
    assert main([str(toml), str(tmp_path / "tree")]) == 0
    assert read(tmp_path / "tree", "/proc/sys/kernel/hostname") == "mine"
    toml.write_text("[[nvme]]\nbogus = 1\n")
    assert main([str(toml), str(tmp_path / "tree2")]) == 2
    assert "unknown key(s) bogus" in capsys.readouterr().err
    assert main([]) == 2
    assert capsys.readouterr().err == USAGE + "\n"
    assert main(["-x", "y"]) == 2


@pytest.mark.process
def test_runs_as_a_module(tmp_path):
    hosts = os.path.join(os.path.dirname(__file__), "hosts")
    done = subprocess.run([sys.executable, "-m", "tests.hostlayout", f"{hosts}/laptop.toml",
                           str(tmp_path / "t")], capture_output=True, text=True,
                          cwd=os.path.dirname(hosts) + "/..")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert os.path.islink(tmp_path / "t/sys/bus/pci/devices/0000:02:00.0")


@pytest.mark.process
def test_help_prints_usage_and_exits_0():
    repo = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, "-m", "tests.hostlayout", "--help"],
                          capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("usage: python3 -m tests.hostlayout LAYOUT.toml DIR\n")
    assert 'hostname = "lab1"' in done.stdout


@pytest.mark.process
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[[nvme]]\nbogus = 1\n")
    repo = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, "-m", "tests.hostlayout", str(toml), str(tmp_path / "t")],
                          capture_output=True, text=True, cwd=repo)
    assert done.returncode == 2
    assert done.stderr.startswith("tests.hostlayout: error: unknown key(s) bogus")
    assert done.stderr.count("\n") == 1 and done.stdout == ""


def test_the_documented_example_builds(tmp_path):
    doc = hostlayout.__doc__
    example = tomllib.loads(textwrap.dedent(doc[doc.index('    hostname = "lab1"'):]))
    host = read_host(SysFS(build_tree(example, tmp_path / "r")))
    assert host.hostname == "lab1" and len(host.cpus) == 32
    ctrl = host.controller("0000:5e:00.0")
    assert ctrl.backs_root and [p.address for p in ctrl.group_peers] == ["0000:5e:00.1"]
    assert len(ctrl.irqs) == 9 and ctrl.namespace(1).size_bytes == 4 * 10**12
    assert host.rdma_nic("mlx5_0").netdevs[0].mtu == 4096
    assert host.block_device("sda").in_use == ("mounted at /srv",)
    assert [c.id for c in host.cpus if c.isolated] == [2, 3]
    assert host.node(0).pool(1048576).free == 6
