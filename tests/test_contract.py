"""The plan is the contract the start path stands on (issue #7), tried as an
operator would: through the `vstor` CLI and through the libvirt hook script.

1. A local NVMe namespace served by qemu-storage-daemon plans, renders and
   now also starts: the plan carries the namespace's block device, and a real
   qemu-storage-daemon exports it (the block device is a real loop device,
   given the namespace's name on this machine for the test).
2. The intent edited after the plan was made (another controller; a file
   source turned into an NVMe-oF one) is refused with exit 2 and one line,
   before anything on the host is touched.
"""

import os
import re
import stat
import subprocess

import pytest

from tests import qsd_fds
from tests.helpers import contract_work  # noqa: F401 (the fixture work)
from tests.helpers import contract_domain_xml as domain_xml, contract_hook as hook
from tests.helpers import contract_rendered as rendered, contract_vstor as vstor
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons handed to root:kvm (needs root)")

ROOT = os.path.join(os.path.dirname(__file__), "..")
HOOK = os.path.join(ROOT, "hooks", "vstor")
NS = "https://vstor.dev/xmlns/domain/1"
CTRL = "0000:61:00.0"


@pytest.fixture
def namespace_device(work):
    """The namespace of CTRL as a real block device: a loop device over a
    16 MiB file, with a device node at the path the host model names."""
    ns = read_host(SysFS(work.host)).controller(CTRL).namespaces[0]
    if os.path.exists(ns.dev_path):
        pytest.skip(f"{ns.dev_path} exists on this machine")
    backing = os.path.join(work.dir, "ns.raw")
    with open(backing, "wb") as f:
        f.truncate(16 << 20)
    loop = subprocess.run(["losetup", "-f", "--show", backing], capture_output=True, text=True)
    if loop.returncode != 0:
        pytest.fail(f"losetup cannot attach a loop device here: {loop.stderr.strip()}")
    dev = loop.stdout.strip()
    st = os.stat(dev)
    os.mknod(ns.dev_path, 0o600 | stat.S_IFBLK, st.st_rdev)
    # The tree's sysfs names the loop's device number as the namespace, as a
    # real host's names its own: vstor opens the node only if sysfs says so.
    by_num = os.path.join(work.host, "sys/dev/block")
    mine = next(n for n in os.listdir(by_num)
                if os.path.basename(os.path.realpath(os.path.join(by_num, n))) == ns.name)
    alias = os.path.join(by_num, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    os.symlink(os.readlink(os.path.join(by_num, mine)), alias)
    try:
        yield ns.dev_path, backing
    finally:
        os.unlink(alias)
        os.unlink(ns.dev_path)
        subprocess.run(["losetup", "-d", dev], check=False)


def qsd_serving(dev_path: str) -> list[int]:
    return qsd_fds.serving(dev_path)


def test_a_kernel_nvme_namespace_served_by_qsd_starts_through_the_cli(work, namespace_device, capsys):
    dev_path, _ = namespace_device
    disk = f"<vstor:disk target='vdb' backend='qsd'><vstor:nvme controller='{CTRL}'/></vstor:disk>"
    xml = rendered(work, disk)
    assert f'device="{dev_path}"' in open(xml).read()           # the plan carries it
    assert vstor(work, "prepare", xml) == 0
    assert f"start qemu-storage-daemon for {dev_path}" in capsys.readouterr().out
    assert len(qsd_serving(dev_path)) == 1
    assert stat.S_ISSOCK(os.stat(f"{work.dir}/vhost/ct1-vdb").st_mode)
    assert vstor(work, "release", "ct1") == 0
    assert qsd_serving(dev_path) == [] and not os.path.exists(f"{work.dir}/vhost/ct1-vdb")


def test_a_kernel_nvme_namespace_served_by_qsd_starts_through_the_hook(work, namespace_device):
    dev_path, _ = namespace_device
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:nvme controller='{CTRL}'/></vstor:disk>")
    out = hook(work, "prepare", xml)
    assert out.returncode == 0, out.stderr.decode()
    assert len(qsd_serving(dev_path)) == 1
    out = hook(work, "release", xml)
    assert out.returncode == 0, out.stderr.decode()
    assert qsd_serving(dev_path) == [] and os.listdir(f"{work.dir}/state/domains") == []


def _edit(xml_path: str, old: str, new: str) -> str:
    """What an operator's `virsh edit` of the intent does: the plan stays."""
    text = open(xml_path).read()
    old, new = old.replace("'", '"'), new.replace("'", '"')     # as lxml writes them
    head, sep, plan = text.partition("<vstor:plan")
    assert old in head
    edited = xml_path.replace(".xml", "-edited.xml")
    with open(edited, "w") as f:
        f.write(head.replace(old, new, 1) + sep + plan)
    return edited


def _sysfs_files(root: str) -> dict:
    out = {}
    for dirpath, _dirs, files in os.walk(os.path.join(root, "sys", "bus", "pci")):
        for name in files:
            if name == "driver_override":
                out[os.path.join(dirpath, name)] = open(os.path.join(dirpath, name)).read()
    return out


EDITS = [
    pytest.param("<vstor:disk target='vdb' backend='spdk'><vstor:nvme controller='0000:5f:00.0'/></vstor:disk>",
                 "controller='0000:5f:00.0'", "controller='0000:60:00.0'", id="controller-changed"),
    pytest.param("<vstor:disk target='vdb'><vstor:file path='/var/lib/vstor/images/a.raw'/></vstor:disk>",
                 "<vstor:file path='/var/lib/vstor/images/a.raw'/>",
                 "<vstor:nvmf transport='tcp' traddr='127.0.0.1' subnqn='nqn.2016-06.io.spdk:cnode1'/>",
                 id="file-became-nvmf"),
]


@pytest.mark.parametrize("disk, old, new", EDITS)
def test_an_intent_edited_after_planning_is_refused_by_the_cli(work, capsys, disk, old, new):
    xml = _edit(rendered(work, disk), old, new)
    before = _sysfs_files(work.host)
    capsys.readouterr()
    assert vstor(work, "prepare", xml) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the vstor metadata changed since the plan was made" in err[0]
    assert "run vstor apply ct1" in err[0]
    assert _sysfs_files(work.host) == before
    assert not os.path.isdir(f"{work.dir}/state/domains") or os.listdir(f"{work.dir}/state/domains") == []


@pytest.mark.parametrize("disk, old, new", EDITS)
def test_an_intent_edited_after_planning_is_refused_by_the_hook(work, disk, old, new):
    xml = _edit(rendered(work, disk), old, new)
    before = _sysfs_files(work.host)
    out = hook(work, "prepare", xml)
    err = out.stderr.decode().strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr.decode()
    assert re.match(r"vstor: domain 'ct1': the vstor metadata changed since the plan was made "
                    r"\(run vstor apply ct1\)$", err[0])
    assert _sysfs_files(work.host) == before
    assert not os.path.isdir(f"{work.dir}/state/domains") or os.listdir(f"{work.dir}/state/domains") == []


def test_one_domains_hook_never_undoes_anothers_record(work):
    """A name that is not safe in a file name falls back to the UUID; a domain
    whose UUID is another domain's name must not reach that domain's record."""
    victim = "11111111-2222-3333-4444-555555555555"
    image = os.path.join(work.dir, "v.raw")
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    xml = rendered(work, f"<vstor:disk target='vdb'><vstor:file path='{image}'/></vstor:disk>", name=victim)
    assert hook(work, "prepare", xml, name=victim).returncode == 0
    evil = os.path.join(work.dir, "evil.xml")
    with open(evil, "w") as f:
        f.write(f"<domain><name>evil one</name><uuid>{victim}</uuid><memory>1024</memory><metadata>"
                f"<vstor:vstor xmlns:vstor='{NS}'><vstor:disk target='vdb'><vstor:file path='{image}'/>"
                "</vstor:disk></vstor:vstor></metadata></domain>")
    out = hook(work, "release", evil, name="evil one")
    assert out.returncode == 3 and b"belongs to domain '11111111" in out.stderr
    assert len(qsd_serving(image)) == 1                        # the victim's disk is untouched
    assert hook(work, "release", xml, name=victim).returncode == 0
    assert qsd_serving(image) == []


@pytest.mark.parametrize("where", ["outside", "symlink"])
def test_a_file_source_outside_the_image_roots_is_never_exported(work, capsys, where):
    """Planning refuses a path outside [paths] images, and a symlink inside
    that points out; one re-pointed out after planning is refused at start,
    before anything changes (CLI and hook), with the same message."""
    if where == "outside":
        assert vstor(work, "render", domain_xml(work, "<vstor:disk target='vdb'>"
                     "<vstor:file path='/etc/shadow'/></vstor:disk>"), "-o", f"{work.dir}/x.xml") == 2
        assert "outside the image roots" in capsys.readouterr().err
        return
    link = os.path.join(work.dir, "innocent.raw")
    open(os.path.join(work.dir, "real.raw"), "wb").close()
    os.symlink("real.raw", link)
    disk = f"<vstor:disk target='vdb' readonly='yes'><vstor:file path='{link}'/></vstor:disk>"
    xml = rendered(work, disk)
    os.unlink(link)
    os.symlink("/etc/hostname", link)
    capsys.readouterr()
    assert vstor(work, "render", domain_xml(work, disk), "-o", f"{work.dir}/x.xml") == 2
    refused = capsys.readouterr().err
    assert "resolves to /etc/hostname, outside the image roots" in refused
    assert vstor(work, "prepare", xml) == 2
    assert capsys.readouterr().err == refused
    out = hook(work, "prepare", xml)
    assert out.returncode == 2 and b"outside the image roots" in out.stderr
    assert qsd_serving("/etc/hostname") == []
    assert not os.path.isdir(f"{work.dir}/state/domains") or os.listdir(f"{work.dir}/state/domains") == []
