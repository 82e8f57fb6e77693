"""vstor host capture: the archive holds what read_host reads, and reading the
extracted archive gives the same host."""

import os
import tarfile

import pytest

from vstor.host.capture import capture
from vstor.errors import BadInput
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
from tests.hostlayout import build_tree


def extract(archive, into) -> str:
    os.makedirs(into)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            # 'data' refuses absolute links and links leaving the directory.
            tar.extractall(into, filter="data")
        else:       # Python before 3.11.4 (Debian 12's 3.11.2): the same refusal by hand
            for m in tar.getmembers():
                where = os.path.normpath(os.path.join(into, m.name))
                target = os.path.normpath(os.path.join(os.path.dirname(where), m.linkname))
                assert where.startswith(str(into) + os.sep) and not os.path.isabs(m.name), m.name
                assert not m.issym() or (not os.path.isabs(m.linkname)
                                         and target.startswith(str(into) + os.sep)), m.linkname
            tar.extractall(into)
    return str(into)


def members(archive) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(archive) as tar:
        return {m.name: m for m in tar.getmembers()}


@pytest.mark.parametrize("name", ["laptop", "two-socket", "nvme-root", "dirty-group", "no-iommu", "stacked"])
def test_round_trip_gives_the_same_host(host_layout, tmp_path, name):
    archive = tmp_path / "capture.tar.gz"
    paths = capture(host_layout(name), str(archive))
    assert "/proc/cmdline" in paths and "/sys/bus/pci/devices" in paths
    copy = extract(archive, tmp_path / "x")
    assert read_host(SysFS(copy)) == read_host(SysFS(host_layout(name)))


def test_round_trip_on_this_machine(tmp_path):
    archive = tmp_path / "here.tar.gz"
    capture("/", str(archive))
    copy = extract(archive, tmp_path / "x")
    assert read_host(SysFS(copy)) == read_host(SysFS("/"))


def test_symlinks_stay_symlinks_with_their_targets(host_layout, tmp_path):
    archive = tmp_path / "c.tar.gz"
    capture(host_layout("two-socket"), str(archive))
    m = members(archive)
    dev = m["sys/bus/pci/devices/0000:5e:00.0"]
    assert dev.issym() and dev.linkname.startswith("../../../devices/pci0000:")
    target = os.path.normpath(os.path.join("sys/bus/pci/devices", dev.linkname))
    assert m[target].isdir()
    assert m[f"{target}/driver"].issym() and m[f"{target}/iommu_group"].issym()
    assert m[f"{target}/class"].isfile()
    assert m["sys/class/infiniband/mlx5_0"].issym()


def test_proc_self_is_stored_as_a_plain_directory(host_layout, tmp_path):
    archive = tmp_path / "c.tar.gz"
    capture(host_layout("laptop"), str(archive))
    m = members(archive)
    assert m["proc/self"].isdir()
    assert m["proc/self/mountinfo"].isfile()
    assert not any(name.startswith("proc/4242/mountinfo") for name in m)


def test_only_what_was_read_listed_dirs_keep_links_and_dirs(tmp_path):
    root = build_tree({"nvme": [{"address": "0000:01:00.0"}]}, tmp_path / "root")
    dev = os.path.realpath(f"{root}/sys/bus/pci/devices/0000:01:00.0")
    # Attributes vstor never reads, some unreadable or huge on a real host.
    for attr in ("config", "resource0", "rom", "remove"):
        with open(f"{dev}/{attr}", "wb") as f:
            f.write(b"\0" * 4096)
    archive = tmp_path / "c.tar.gz"
    paths = capture(root, str(archive))
    rel = os.path.relpath(dev, root)
    m = members(archive)
    for attr in ("config", "resource0", "rom", "remove", "subsystem_device", "enable"):
        assert f"{rel}/{attr}" not in m
    for attr in ("class", "vendor", "numa_node", "local_cpulist"):
        assert m[f"{rel}/{attr}"].isfile()
    assert m[f"{rel}/msi_irqs"].isdir()
    assert sorted(paths) == paths and all(p.startswith("/") for p in paths)
    assert {p.lstrip("/") for p in paths} <= set(m)


def test_round_trip_of_vfio_multipath_and_stacked_volumes(tmp_path):
    root = build_tree({
        "isolated": "1", "node": [{"cores": 2}, {"cores": 2}],
        "nvme": [{"address": "0000:01:00.0", "driver": "vfio-pci"},
                 {"address": "0000:02:00.0", "multipath": True},
                 {"address": "0000:03:00.0", "node": 1, "namespace": [{"partitions": [{}, {}]}]}],
        "volume": [{"name": "md0", "on": ["nvme1n1p1", "nvme1n1p2"]},
                   {"name": "vg1-data", "on": ["md0"], "mount": "/data"}]}, tmp_path / "root")
    archive = tmp_path / "c.tar.gz"
    capture(root, str(archive))
    original = read_host(SysFS(root))
    assert original.controller("0000:03:00.0").namespace(1).in_use
    assert read_host(SysFS(extract(archive, tmp_path / "x"))) == original


def test_unwritable_output_is_a_user_error(host_layout, tmp_path):
    with pytest.raises(BadInput, match="cannot write the capture"):
        capture(host_layout("laptop"), str(tmp_path / "no-such-dir" / "c.tar.gz"))
