"""vstor guest-kit: the guest side of a passed-through controller, from the
plan and the domain as libvirt addressed it.

The addresses tests/helpers.py adds (addressed) are the ones the real
libvirtd (9.0) gives the rendered xml-templates/passthrough-guest-spdk.xml; tests/e2e/test_guestkit.py defines
that domain in libvirtd and checks it still does.  The kit's script runs here
under dash, busybox and bash on a guest-like sysfs tree (VSTOR_KIT_ROOT) with
a PATH that has no modprobe and no mount; in a real guest it runs in
tests/e2e/test_guestkit.py."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from lxml import etree

from vstor.errors import BadInput
from vstor.meta import metadata
from vstor.meta.document import Domain
from vstor.records import replace
from vstor.render import guestkit, guestscript
from tests.helpers import TEMPLATES, addressed, planned

ROOT = os.path.join(os.path.dirname(__file__), "..")


def kernel_only(dom: Domain) -> Domain:
    """The same domain with guest='kernel' and no vIOMMU."""
    root = etree.fromstring(dom.to_string())
    for e in root.findall("devices/iommu"):
        e.getparent().remove(e)
    out = Domain(root, dom.origin)
    plan = out.recorded_plan()
    metadata.store(root, replace(plan, viommu=False, disks=tuple(replace(d, guest="kernel")
                                                                 for d in plan.disks)))
    return out


@pytest.fixture
def db1(host_model):
    return addressed(planned(host_model("two-socket")))


def test_the_kit_follows_libvirts_address_through_the_root_port(db1, host_model):
    kit = guestkit.build(db1, host_model("two-socket"))
    (c,) = kit.controllers
    assert (c.targets, c.host_address) == (("vdb",), "0000:5e:00.0")
    assert c.pci_path == "0000:00:01.2/00.0" and c.guest_address is None   # the guest numbers bus 3
    assert c.behind == ("pcie-root-port pci.3",)
    assert (c.vendor, c.device) == ("0x8086", "0x0a54")
    # 8 vCPUs pinned on node 1 with the controller; vCPU 0 stays the guest OS's.
    assert c.vcpus == (1, 2, 3, 4, 5, 6, 7) and c.core_mask == "0xfe"
    assert "vCPU 0 is left to the guest OS" in c.notes
    # 16 GiB guest: min(1024 MB, 4096 MB) in 2 MiB pages on the guest's node 0.
    assert (kit.hugemem_mb, kit.hugepages, kit.page_kib, kit.node) == (1024, 512, 2048, 0)
    assert not kit.noiommu and kit.warnings == ()
    assert kit.setup_env() == {"PCI_ALLOWED": None, "HUGEMEM": 1024, "HUGENODE": 0,
                               "DRIVER_OVERRIDE": "vfio-pci"}


def test_a_controller_on_the_root_bus_has_its_address_known_here(db1):
    db1.root.find("devices/hostdev/address").set("bus", "0x00")
    db1.root.find("devices/hostdev/address").set("slot", "0x05")
    kit = guestkit.build(db1)
    (c,) = kit.controllers
    assert c.pci_path == c.guest_address == "0000:00:05.0" and c.behind == ()
    assert kit.pci_allowed == "0000:00:05.0"
    assert (c.vendor, c.device) == ("", "")       # no host model: the script checks the class


def test_another_hosts_model_says_nothing_of_the_controller(db1, host_model):
    (c,) = guestkit.build(db1, host_model("laptop")).controllers
    assert (c.vendor, c.device) == ("", "") and c.core_mask == "0xfe"


@pytest.mark.parametrize("memory, hugemem", [("510", 126), ("512", 128), ("2048", 512), ("4096", 1024), ("8192", 1024)])
def test_hugemem_is_a_quarter_of_the_guest_at_most_1024_mb(host_model, memory, hugemem):
    def edit(root):
        root.find("memory").text, root.find("memory").attrib["unit"] = memory, "MiB"
        root.find(".//{*}vm").set("hugepages", "2M")
    kit = guestkit.build(addressed(planned(host_model("two-socket"), edit=edit)))
    assert (kit.hugemem_mb, kit.hugepages) == (hugemem, hugemem // 2)


def test_one_vcpu_is_the_spdk_apps(host_model):
    kit = guestkit.build(addressed(planned(host_model("two-socket"),
                                           edit=lambda r: setattr(r.find("vcpu"), "text", "1"))),
                         host_model("two-socket"))
    assert kit.controllers[0].core_mask == "0x1" and kit.controllers[0].notes == ()


def test_a_guest_away_from_the_controllers_node_is_told(db1, host_model):
    host = host_model("two-socket")
    plan = db1.recorded_plan()
    metadata.store(db1.root, replace(plan, numa="preferred", node=0, vcpu_pins=(1, 33, 2, 34, 3, 35, 4, 36)))
    (c,) = guestkit.build(db1, host).controllers
    assert c.core_mask == "0xfe"
    assert any("no vCPU runs on node 1 with the controller" in n for n in c.notes)


def test_no_viommu_means_no_iommu_mode_with_the_warning(db1):
    kit = guestkit.build(kernel_only(db1))
    assert kit.noiommu
    (w,) = kit.warnings
    assert "UNSAFE" in w and "no DMA isolation" in w and "guest='spdk'" in w and "vstor apply db1" in w
    assert "driver: vfio-pci in no-IOMMU mode" in guestkit.describe(kit)


def test_an_iommu_of_the_operators_own_is_a_viommu(db1):
    dom = kernel_only(db1)
    etree.SubElement(dom.root.find("devices"), "iommu", model="intel")
    assert not guestkit.build(dom).noiommu


def test_kernel_controllers_stay_with_the_guests_driver_next_to_spdk_ones(host_model):
    def edit(root):
        vstor = root.find("metadata/{*}vstor")
        disk = etree.fromstring(f"<vstor:disk xmlns:vstor='{vstor.nsmap['vstor']}' target='vdc' "
                                "mode='passthrough'><vstor:nvme controller='0000:5f:00.0'/></vstor:disk>")
        vstor.append(disk)
    kit = guestkit.build(addressed(planned(host_model("two-socket"), edit=edit)))
    assert [c.host_address for c in kit.controllers] == ["0000:5e:00.0"]
    assert kit.kernel == ("vdc: 0000:5f:00.0 stays with the guest's nvme driver (guest='kernel')",)


@pytest.mark.parametrize("change, words", [
    (lambda r: r.find("devices/hostdev").remove(r.find("devices/hostdev/address")),
     "has no guest PCI address for 0000:5e:00.0 yet: libvirt assigns it when the domain is defined"),
    (lambda r: r.find("devices").remove(r.find("devices/hostdev")),
     "has no <hostdev> for 0000:5e:00.0, which its plan passes through"),
    (lambda r: r.find("devices").remove(r.find("devices/controller[@index='3']")),
     "sits on PCI bus 3, and the domain has no <controller type='pci' index='3'>"),
    (lambda r: r.find("devices/controller[@index='3']").set("model", "pcie-expander-bus"),
     "sits behind a pcie-expander-bus controller (index 3)"),
    (lambda r: r.find("devices/hostdev/address").set("slot", "0x20"), "<address slot='0x20'> is not a PCI slot"),
    (lambda r: r.find("devices/controller[@index='3']").remove(r.find("devices/controller[@index='3']/address")),
     "its pcie-root-port (index 3) has no PCI address yet"),
    (lambda r: r.find("metadata").remove(r.find("metadata/{*}vstor")), "has no vstor plan"),
])
def test_what_the_kit_cannot_follow_is_refused_in_one_line(db1, change, words):
    change(db1.root)
    with pytest.raises(BadInput) as e:
        guestkit.build(db1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_domain_without_passthrough_is_refused(host_model):
    dom = planned(host_model("two-socket"), os.path.join(TEMPLATES, "vhost-local-nvme.xml"))
    with pytest.raises(BadInput, match="passes no NVMe controller through"):
        guestkit.build(dom)


def test_a_nova_instance_is_refused(db1):
    meta = db1.root.find("metadata")
    etree.SubElement(meta, "{http://openstack.org/xmlns/libvirt/nova/1.1}instance")
    with pytest.raises(BadInput, match="is a Nova instance"):
        guestkit.build(db1)


# -- the script and the cloud-config -------------------------------------------------

def test_the_cloud_config_is_yaml_that_installs_and_runs_the_script(db1, host_model):
    kit = guestkit.build(db1, host_model("two-socket"))
    text = guestscript.cloud_config(kit)
    assert text.startswith("#cloud-config\n")
    data = yaml.safe_load(text)
    (f,) = data["write_files"]
    assert f["path"] == guestscript.INSTALLED and f["permissions"] == "0755"
    assert f["content"] == guestscript.script(kit)
    assert data["runcmd"] == [[guestscript.INSTALLED]]
    assert data["bootcmd"] == [["sh", "-c", f"if [ -x {guestscript.INSTALLED} ]; then "
                                            f"{guestscript.INSTALLED}; fi"]]


@pytest.mark.process
def test_a_hostile_domain_name_stays_a_comment_and_a_quoted_word(db1, tmp_path):
    db1.root.find("name").text = "x'\n$(reboot)\u2028y"
    kit = guestkit.build(db1)
    text = guestscript.script(kit)
    assert all(line.startswith(("#", "DOMAIN=")) for line in text.splitlines()[:12] if "reboot" in line)
    assert yaml.safe_load(guestscript.cloud_config(kit))["write_files"][0]["content"] == text
    (tmp_path / "kit.sh").write_text(text)
    assert subprocess.run(["sh", "-n", str(tmp_path / "kit.sh")]).returncode == 0


SHELLS = [s for s in (["dash"], ["busybox", "sh"], ["bash", "--posix"]) if shutil.which(s[0])]


def guest(tmp_path, *, bus=5, ids=("0x8086", "0x0a54"), pci_class="0x010802", driver="nvme",
          group=True, mounts="", holders=(), modules=("vfio", "vfio_iommu_type1", "vfio_pci"),
          noiommu_param=False, hugetlbfs=True, builtin=(), iommu=False):
    """A guest's sysfs and procfs as the kit reads them: the root port
    0000:00:01.2 whose secondary bus is `bus`, the controller on it."""
    root = tmp_path / "guest"
    sysfs, proc = root / "sys", root / "proc"
    devices, drivers = sysfs / "bus/pci/devices", sysfs / "bus/pci/drivers"
    port = devices / "0000:00:01.2"
    port.mkdir(parents=True)
    (port / "secondary_bus_number").write_text(f"{bus}\n")
    d = devices / f"0000:{bus:02x}:00.0"
    (d / "nvme/nvme0/nvme0n1").mkdir(parents=True)
    for name, value in (("class", pci_class), ("vendor", ids[0]), ("device", ids[1]), ("driver_override", "(null)")):
        (d / name).write_text(value + "\n")
    for name in ("nvme", "vfio-pci"):
        (drivers / name).mkdir(parents=True)
        (drivers / name / "unbind").write_text("")
    (sysfs / "bus/pci/drivers_probe").write_text("")
    if driver:
        (d / "driver").symlink_to(drivers / driver)
    if iommu:
        (sysfs / "class/iommu/dmar0").mkdir(parents=True)
    if group:
        (sysfs / "kernel/iommu_groups/6").mkdir(parents=True)
        (d / "iommu_group").symlink_to(sysfs / "kernel/iommu_groups/6")
    (sysfs / "class/block/nvme0n1/holders").mkdir(parents=True)
    for h in holders:
        (sysfs / "class/block/nvme0n1/holders" / h).mkdir()
    for m in modules:
        (sysfs / "module" / m / "parameters").mkdir(parents=True)
    kernel = root / "lib/modules" / os.uname().release
    kernel.mkdir(parents=True)
    (kernel / "modules.builtin").write_text("".join(f"kernel/drivers/vfio/{m}.ko\n" for m in builtin))
    if noiommu_param:
        (sysfs / "module/vfio/parameters/enable_unsafe_noiommu_mode").write_text("N\n")
    pool = sysfs / "devices/system/node/node0/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "nr_hugepages").write_text("0\n")
    proc.mkdir()
    (proc / "mounts").write_text(("nodev /dev/hugepages hugetlbfs rw,relatime 0 0\n" if hugetlbfs else "")
                                 + mounts)
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    return root, d


@pytest.fixture
def bin_dir(tmp_path):
    """The tools the script uses, and neither modprobe nor mount: nothing
    here may load a module or mount on the host running the tests."""
    out = tmp_path / "bin"
    out.mkdir()
    for tool in ("cat", "readlink", "sed", "grep", "tr", "mkdir", "id", "ls", "uname"):
        os.symlink(shutil.which(tool), out / tool)
    return str(out)


def run(kit, root, shell, bin_dir):
    path = root.parent / "kit.sh"
    path.write_text(guestscript.script(kit))
    return subprocess.run([shutil.which(shell[0]), *shell[1:], str(path)], capture_output=True, text=True,
                          env={"PATH": bin_dir, "VSTOR_KIT_ROOT": str(root)})


@pytest.fixture(params=SHELLS, ids=lambda s: s[0])
def shell(request):
    return request.param


@pytest.mark.process
def test_the_script_moves_the_controller_and_raises_the_pool(db1, host_model, tmp_path, shell, bin_dir):
    root, d = guest(tmp_path)
    out = run(guestkit.build(db1, host_model("two-socket")), root, shell, bin_dir)
    # The tree is not a kernel: nothing binds, so the script says so, after
    # doing what the kernel's documentation asks, in that order.
    assert out.returncode == 1, out.stdout + out.stderr
    assert "vdb: 0000:05:00.0 did not bind to vfio-pci (it has nvme; see dmesg)" in out.stderr
    assert (d / "driver_override").read_text() == "vfio-pci\n"
    assert (root / "sys/bus/pci/drivers/nvme/unbind").read_text() == "0000:05:00.0\n"
    assert (root / "sys/bus/pci/drivers_probe").read_text() == "0000:05:00.0\n"
    assert (root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages").read_text() == "512\n"
    assert "vstor-guest-kit: hugepages: 512 x 2048 kB on node 0" in out.stdout


@pytest.mark.process
def test_the_script_run_again_changes_nothing_and_says_what_spdk_needs(db1, host_model, tmp_path, shell, bin_dir):
    root, d = guest(tmp_path, driver="vfio-pci")
    (root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages").write_text("600\n")
    out = run(guestkit.build(db1, host_model("two-socket")), root, shell, bin_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "vstor-guest-kit: hugepages: 600 x 2048 kB on node 0",
        "vstor-guest-kit: vdb: 0000:05:00.0 is on vfio-pci already",
        "vstor-guest-kit: vdb: SPDK app core mask -m 0xfe",
        "vstor-guest-kit: SPDK setup.sh: PCI_ALLOWED='0000:05:00.0' HUGEMEM=1024 HUGENODE=0 "
        "DRIVER_OVERRIDE=vfio-pci"]
    assert (d / "driver_override").read_text() == "(null)\n"


@pytest.mark.process
@pytest.mark.parametrize("tree, words", [
    (dict(ids=("0x1b36", "0x0010")), "vdb: 0000:05:00.0 is NVMe 0x1b36:0x0010, not 0x8086:0x0a54 as on the host"),
    (dict(pci_class="0x020000"), "vdb: 0000:05:00.0 is not an NVMe controller (class 0x020000)"),
    (dict(mounts="/dev/nvme0n1p1 /data ext4 rw 0 0\n"), "/dev/nvme0n1 on 0000:05:00.0 is mounted or swap"),
    (dict(holders=("dm-0",)), "/dev/nvme0n1 on 0000:05:00.0 is held by dm-0"),
    (dict(group=False), "0000:05:00.0 has no IOMMU group: the guest kernel's IOMMU is off (nothing in "
                        "/sys/class/iommu); add intel_iommu=on"),
    (dict(group=False, iommu=True), "0000:05:00.0 has no IOMMU group although the guest has an IOMMU: "
                                    "is this the guest of domain 'db1'?"),
    (dict(modules=()), "module vfio is not loaded and there is no modprobe here: load vfio vfio_iommu_type1 vfio-pci"),
    (dict(hugetlbfs=False), "cannot mount hugetlbfs on /dev/hugepages"),
])
def test_the_script_refuses_before_it_touches_the_controller(db1, host_model, tmp_path, bin_dir, tree, words):
    root, d = guest(tmp_path, **tree)
    out = run(guestkit.build(db1, host_model("two-socket")), root, ["sh"], bin_dir)
    assert out.returncode == 1 and words in out.stderr.splitlines()[-1], out.stdout + out.stderr
    assert (d / "driver_override").read_text() == "(null)\n"
    assert (root / "sys/bus/pci/drivers_probe").read_text() == ""


@pytest.mark.process
def test_modules_built_into_the_kernel_are_there(db1, host_model, tmp_path, bin_dir):
    root, d = guest(tmp_path, modules=("vfio_pci",), builtin=("vfio", "vfio_iommu_type1"))
    out = run(guestkit.build(db1, host_model("two-socket")), root, ["sh"], bin_dir)
    assert "no modprobe" not in out.stderr and "did not bind to vfio-pci" in out.stderr


@pytest.mark.process
def test_the_script_finds_no_bridge_in_another_guest(db1, tmp_path, bin_dir):
    root, d = guest(tmp_path)
    shutil.rmtree(root / "sys/bus/pci/devices/0000:00:01.2")
    out = run(guestkit.build(db1), root, ["sh"], bin_dir)
    assert out.returncode == 1
    assert ("no PCI bridge at 0000:00:01.2 in this guest (PCI path 0000:00:01.2/00.0): "
            "is this the guest of domain 'db1'?") in out.stderr


@pytest.mark.process
def test_no_iommu_mode_is_switched_on_loudly_or_refused_where_the_kernel_lacks_it(db1, tmp_path, bin_dir):
    kit = guestkit.build(kernel_only(db1))
    root, d = guest(tmp_path, group=False, driver="vfio-pci", noiommu_param=True, modules=("vfio", "vfio_pci"))
    out = run(kit, root, ["sh"], bin_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (root / "sys/module/vfio/parameters/enable_unsafe_noiommu_mode").read_text() == "Y\n"
    assert "WARNING: vfio-pci in no-IOMMU mode is UNSAFE" in out.stderr
    (root / "sys/module/vfio/parameters/enable_unsafe_noiommu_mode").unlink()
    out = run(kit, root, ["sh"], bin_dir)
    assert out.returncode == 1 and "has no no-IOMMU mode (CONFIG_VFIO_NOIOMMU" in out.stderr


# -- the command ----------------------------------------------------------------------------

def vstor(*args):
    return subprocess.run([sys.executable, "-m", "vstor.cli.main", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.process
def test_the_command_prints_the_script_the_cloud_config_and_json(db1, host_layout, tmp_path):
    path = tmp_path / "db1.xml"
    path.write_text(db1.to_string())
    host = ["--host-root", host_layout("two-socket")]
    out = vstor(*host, "guest-kit", str(path))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("#!/bin/sh\n# vstor guest-kit for domain 'db1'")
    assert "# vdb: NVMe 0000:5e:00.0 (8086:0a54) on the host; in the guest at PCI path 0000:00:01.2/00.0" in out.stdout
    assert yaml.safe_load(vstor(*host, "guest-kit", str(path), "--cloud-init").stdout)["runcmd"]
    data = json.loads(vstor(*host, "guest-kit", str(path), "--json").stdout)
    assert data["controllers"][0]["pci_path"] == "0000:00:01.2/00.0" and data["script"] == out.stdout
    assert data["setup_sh"]["HUGEMEM"] == 1024


@pytest.mark.process
def test_the_command_refuses_in_one_line(db1, host_layout, tmp_path):
    path = tmp_path / "db1.xml"
    db1.root.find("devices/hostdev").remove(db1.root.find("devices/hostdev/address"))
    path.write_text(db1.to_string())
    out = vstor("--host-root", host_layout("two-socket"), "guest-kit", str(path))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert "define it first: vstor define FILE, then vstor guest-kit NAME" in out.stderr
    out = vstor("guest-kit", str(path), "--json", "--cloud-init")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
