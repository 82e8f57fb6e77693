"""Papercuts of issue 22: each refusal says what is wrong and the fix that
applies to the case at hand."""

import pytest

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
