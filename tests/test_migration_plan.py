"""The pure parts of a migration: the verdict per disk, the XML a domain
arrives with (every device as it was, only the host side moved), and how the
source tells shared storage from local."""


from lxml import etree
import pytest

from tests.helpers import SPDK_CFG, nvme, nvmf, qsd_file, request
from vstor import records
from vstor.errors import BadInput
from vstor.meta.document import Domain
from vstor.migration.storage import mount_of
from vstor.migration.verdict import COLD, IMPOSSIBLE, MAKE_READY, READY, judge
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.render.libvirt import render
from vstor.render.migration import render_incoming

NS = "https://vstor.dev/xmlns/domain/1"


def test_the_verdict_of_each_kind_of_disk(host_model):
    host = host_model("two-socket")
    disks = (nvme("0000:5e:00.0", target="vdb", mode="passthrough") + nvmf(target="vdc") +
             nvme("0000:5f:00.0", target="vdd", mode="vhost", backend="spdk") +
             qsd_file(target="vde") + qsd_file("/var/lib/vstor/images/b.raw", target="vdf"))
    plan = plan_domain(host, SPDK_CFG, request(disks), Ledger())
    v = judge(plan, {"vde": (True, "on a nfs4 filesystem"), "vdf": (False, "on a local ext4 filesystem")},
              {"vde": None, "vdf": None}, "b")
    got = {d.target: d.verdict for d in v.disks}
    assert got == {"vdb": COLD, "vdc": READY, "vdd": MAKE_READY, "vde": READY, "vdf": IMPOSSIBLE}
    assert v.verdict == IMPOSSIBLE and not v.live and not v.cold
    assert "vstor migrate prepare vm1 --to b --cold" in v.disks[0].fix
    seen_not = judge(plan_domain(host, SPDK_CFG, request(qsd_file()), Ledger()),
                     {"vdb": (True, "on a nfs4 filesystem")}, {"vdb": "has no such file"}, "b")
    assert seen_not.verdict == IMPOSSIBLE and "b has no such file" in seen_not.disks[0].reason
    ready = judge(plan_domain(host, SPDK_CFG, request(nvmf()), Ledger()), {}, {}, "b", problems=["no cores"])
    assert ready.verdict == READY and not ready.live and ready.to_json()["destination_problems"] == ["no cores"]


def _rendered(host_model, layout, xml):
    dom = Domain.parse(xml)
    return dom, plan_domain(host_model(layout), SPDK_CFG, Request.from_domain(dom), Ledger())


def test_an_arriving_domain_keeps_every_device_and_moves_only_the_host_side(host_model):
    xml = f"""<domain type='kvm'><name>vm1</name><uuid>6a0c6c5e-7f55-4b4a-9d8e-000000000001</uuid>
      <memory unit='MiB'>1024</memory><vcpu>2</vcpu><os><type arch='x86_64' machine='q35'>hvm</type></os>
      <metadata><vstor:vstor xmlns:vstor='{NS}'>{qsd_file()}</vstor:vstor></metadata><devices/></domain>"""
    dom, plan_a = _rendered(host_model, "two-socket", xml)
    live = render(dom, plan_a).root
    disk = live.find("devices/disk")
    etree.SubElement(disk, "alias", name="virtio-disk1")        # as libvirt's live XML has them
    etree.SubElement(disk, "address", type="pci", domain="0x0000", bus="0x04", slot="0x00", function="0x0")
    live_dom = Domain(live)
    _, plan_b = _rendered(host_model, "laptop", xml)
    plan_b = records.replace(plan_b, disks=tuple(
        records.replace(d, socket="/run/b/vhost/vm1-vdb") for d in plan_b.disks))
    arriving = render_incoming(live_dom, plan_b).root
    d = arriving.find("devices/disk")
    assert d.find("source").get("path") == "/run/b/vhost/vm1-vdb"
    assert d.find("address").get("bus") == "0x04" and d.find("alias").get("name") == "virtio-disk1"
    assert Domain(arriving).recorded_plan().host == plan_b.host != plan_a.host
    # only the host side differs: the same devices, in the same order
    assert [e.tag for e in arriving.find("devices")] == [e.tag for e in live.find("devices")]
    assert arriving.find("cputune") is not None and arriving.find("numatune") is not None


def test_an_arriving_domain_without_its_vhost_disk_or_with_passthrough_is_refused(host_model):
    xml = f"""<domain type='kvm'><name>vm1</name><memory unit='MiB'>1024</memory><vcpu>2</vcpu>
      <os><type arch='x86_64' machine='q35'>hvm</type></os>
      <metadata><vstor:vstor xmlns:vstor='{NS}'>{qsd_file()}</vstor:vstor></metadata><devices/></domain>"""
    dom, plan = _rendered(host_model, "two-socket", xml)
    with pytest.raises(BadInput, match="arrives without the vhost-user disk vdb"):
        render_incoming(dom, plan)
    pt = xml.replace(qsd_file(), nvme("0000:5e:00.0", mode="passthrough"))
    dom, plan = _rendered(host_model, "two-socket", pt)
    with pytest.raises(BadInput, match="passed through"):
        render_incoming(render(dom, plan), plan)


def test_the_mount_that_holds_a_path(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        b"40 22 0:50 / /srv/vm\\040store rw shared:2 - nfs4 fs:/export rw\n"
        b"41 22 0:51 / /srv rw shared:3 - xfs /dev/sdb1 rw\n"
        b"42 22 0:52 / /d\xc3\xa9p\xc3\xb4t rw shared:4 - nfs4 fs:/d\xc3\xa9p\xc3\xb4t rw\n")
    assert mount_of("/srv/vm store/a.raw", str(info)) == ("nfs4", "fs:/export")
    assert mount_of("/srv/other.raw", str(info)) == ("xfs", "/dev/sdb1")
    assert mount_of("/var/lib/x.raw", str(info)) == ("ext4", "/dev/sda1")
    assert mount_of("/dépôt/a.raw", str(info)) == ("nfs4", "fs:/dépôt")


def test_two_hosts_copies_of_a_source_are_compared_by_size_and_filesystem():
    from vstor.migration.storage import differs, shared
    nfs = {"path": "/v/a.raw", "kind": "file", "size": 10, "fstype": "nfs4", "mount": "fs:/export", "shared_root": ""}
    assert shared(nfs) == (True, "on a nfs4 filesystem (fs:/export)") and differs(nfs, dict(nfs)) is None
    assert "another size" in differs(nfs, {**nfs, "size": 11})
    local_copy = {**nfs, "fstype": "ext4", "mount": "/dev/sda1"}
    assert differs(nfs, local_copy) == "has it on ext4 /dev/sda1, not on nfs4 fs:/export"
    declared = {**local_copy, "shared_root": "/v"}
    assert differs({**nfs, "shared_root": "/v"}, declared) is None       # both operators say so
    assert shared({**local_copy})[0] is False


def test_a_refusal_names_what_the_destination_lacks():
    """The source declared the root shared, the destination did not: the
    same local names on both hosts (ext4 /dev/vda) are not the answer."""
    from vstor.migration.storage import differs
    src = {"path": "/srv/shared/a.raw", "kind": "file", "size": 10, "fstype": "ext4", "mount": "/dev/vda",
           "shared_root": "/srv/shared"}
    dest = {**src, "shared_root": ""}
    why = differs(src, dest)
    assert why == ("has /srv/shared on ext4 /dev/vda, not in its [migrate] shared (add /srv/shared to "
                   "[migrate] shared in its vstor.conf, if it is the same storage there)")
    assert "not on ext4 /dev/vda" not in why
    # Neither declared it, the same local names: another disk, said so.
    assert differs(dest, dict(dest)).startswith("has its own ext4 /dev/vda at that path")
