"""vstor pve plan/apply and the hookscript, as an operator and Proxmox use
them, on a Proxmox tree in a temporary directory (/etc/pve, the snippets
storage, qemu-server's pid and lock directories).

The judge of what the written keys mean is Proxmox's own qemu-server
(tests/pve/oracle.py: ../shared/pve/oracle's showcmd and hugepages_topology);
the real QEMU runs such a VM in tests/e2e/test_pve.py."""

import glob
import os
import re
import subprocess
import sys

import pytest
from lxml import etree

from tests.helpers import CONF, PCI, Pve, judge, needs_root, pve_applied, pve_left, running_qemu
from tests.pve.oracle import agrees_with_plan, showcmd, vfio_hosts
from tests.snapshot import COUNTED
from vstor.formats.pve.config import PveConfig

NS = "https://vstor.dev/xmlns/domain/1"
TEMPLATES = os.path.join(os.path.dirname(__file__), "..", "xml-templates")


@pytest.fixture
def pve(tmp_path):
    p = Pve(tmp_path)
    yield p
    p.vstor("release", "--force", "pve-100")


@pytest.fixture
def pve_nvme(tmp_path, host_layout):
    return Pve(tmp_path, host_layout("two-socket"))


# Every host PCI function the tests' configs name (the oracle's fake lspci).


def _owned(key: str) -> bool:
    return bool(re.fullmatch(r"numa\d?|hugepages|affinity|args|hostpci\d+", key))


# -- apply: only vstor's lines, byte for byte, and twice is once --------------------------

def test_apply_writes_only_vstors_lines_and_twice_is_once(pve, capsys):
    pve.vm()
    pve.intent(pve.file_disk())
    before = pve.config()
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    after = pve.config()
    old, new = before.splitlines(), after.splitlines()
    gone = [line for line in old if line not in new]
    added = [line for line in new if line not in old]
    assert all(_owned(line.split(":")[0]) for line in gone + added), (gone, added)
    # Every line the user wrote is still there, in order; the sections after
    # the main one (pending changes, a snapshot) are the same bytes.
    assert after[after.index("[PENDING]"):] == before[before.index("[PENDING]"):]
    assert [line for line in new if line in old] == [line for line in old if line not in gone]
    conf = PveConfig.parse(after)
    assert conf.get("args").startswith("-msg timestamp=on -set 'device.x.y=a b' -chardev socket,id=vstor-vdb,")
    assert "reconnect-ms=1000" in conf.get("args")
    assert conf.get("hostpci0") == "0000:17:00.0"               # the user's device, untouched
    judge(pve, after, user_vfio=["0000:17:00.0"])

    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    assert pve.config() == after
    assert "config unchanged" in capsys.readouterr().out
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2", "--dry-run") == 0
    assert "no change" in capsys.readouterr().out
    assert "<!-- kept -->" in open(f"{pve.snippets}/vstor-100.xml").read()    # the operator's file
    assert open(f"{pve.snippets}/vstor-100.plan.xml").read().startswith("<vstor:plan ")


def test_dry_run_prints_the_diff_and_writes_nothing(pve, capsys):
    pve.vm()
    intent = pve.intent(pve.file_disk())
    before, before_intent = pve.config(), open(intent).read()
    assert pve.vstor("pve", "apply", "100", "--dry-run", "--qemu-version", "7.2") == 0
    out = capsys.readouterr().out
    assert "+numa: 1" in out and "+hugepages: 2" in out and "reconnect=1 " in out
    assert "-args: -msg" in out and "would record the plan" in out
    assert pve.config() == before and open(intent).read() == before_intent


def test_plan_says_why_hugepages(pve, capsys):
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "plan", "100", "--qemu-version", "9.2") == 0
    out = capsys.readouterr().out
    assert "VM 100 (pve-100)" in out and "vhost-user backend" in out and "qemu-server raises" in out


# -- every template shape, read back by Proxmox's qemu-server -------------------------------

def _template(name: str):
    dom = etree.parse(os.path.join(TEMPLATES, name)).getroot()
    vs = dom.find(f"metadata/{{{NS}}}vstor")
    mem = int(dom.findtext("memory"))
    unit = dom.find("memory").get("unit", "KiB")
    mib = mem * {"GiB": 1024, "MiB": 1, "KiB": 1 / 1024}[unit]
    machine = dom.find("os/type").get("machine", "pc")
    return etree.tostring(vs).decode(), int(mib), int(dom.findtext("vcpu")), machine


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(TEMPLATES) if n.endswith(".xml")))
def test_every_template_shape_gives_a_config_qemu_server_starts_as_planned(pve_nvme, name, capsys):
    intent, mib, vcpus, machine = _template(name)
    machine = "q35,viommu=intel" if 'guest="spdk"' in intent else machine
    pve_nvme.vm(f"cores: {vcpus}\nmemory: {mib}\nmachine: {machine}\nname: t\n")
    if "<vstor:file " in intent:       # the file where this test's image root is
        pve_nvme.file_disk("data.raw")
        intent = re.sub(r'(<vstor:file path=)"[^"]+"', rf'\1"{pve_nvme.root}/data.raw"', intent)
    with open(f"{pve_nvme.snippets}/vstor-100.xml", "w") as f:
        f.write(intent)
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0, capsys.readouterr().err
    conf = PveConfig.parse(pve_nvme.config())
    plan = etree.parse(f"{pve_nvme.snippets}/vstor-100.plan.xml").getroot()
    judge(pve_nvme, pve_nvme.config(), mib)
    argv = showcmd(pve_nvme.config(), PCI).argv
    node, kb = plan.get("node"), plan.get("hugepage_kib")
    if plan.find(f"{{{NS}}}cell") is None:     # several cells: each checked by judge above
        # The guest's memory: hugepages from the plan's node, shared (vhost-user).
        assert (f"memory-backend-file,id=ram-node0,size={mib}M,mem-path=/run/hugepages/kvm/{kb}kB,"
                f"share=on,prealloc=yes,host-nodes={node},policy=bind") in argv
        cpus = "0" if vcpus == 1 else f"0-{vcpus - 1}"
        assert f"node,nodeid=0,cpus={cpus},memdev=ram-node0" in argv
    # Every QEMU thread on the plan's cores, none of them a reactor.
    cores = set(map(int, plan.get("pins", "").split(","))) | _cpus(plan.get("emulator"))
    assert _cpus(argv[3]) == cores and not cores & {2, 18}
    for disk in plan.findall(f"{{{NS}}}disk"):
        t = disk.get("target")
        if disk.get("mode") == "vhost":
            assert f"socket,id=vstor-{t},path={disk.get('socket')},reconnect-ms=1000" in argv
            want = f"vhost-user-blk-pci,id=vstor-{t},chardev=vstor-{t},num-queues={disk.get('queues', '1')}"
            # several cells: on its cell's expander bus (tests/test_pve_cells.py follows the chain)
            assert any(a == want or a.startswith(want + ",bus=vstor-cell") for a in argv)
        else:
            assert any(a.startswith(f"vfio-pci,host={disk.get('controller')},id=hostpci0,"
                                    "bus=ich9-pcie-port-1,") for a in argv)


def _cpus(text) -> set:
    out = set()
    for part in (text or "").split(","):
        if part:
            a, _, b = part.partition("-")
            out |= set(range(int(a), int(b or a) + 1))
    return out


# -- args: the user's kept, or a clear refusal -----------------------------------------

@pytest.mark.parametrize("args, why", [
    ("-numa node,nodeid=0", "decides guest memory, NUMA or vCPUs"),
    ("-object memory-backend-ram,id=m,size=1G", "decides guest memory"),
    ("-m 4096", "decides guest memory"),
    ("-machine memory-backend=m", "decides guest memory"),
    ("-chardev socket,id=vstor-mine,path=/x", "id prefix 'vstor-'"),
    ("-msg 'timestamp=on", "cannot be split into arguments"),
    ("-msg 'timestamp=on\\'", "cannot be split into arguments"),     # Perl: no words at all
    ("--numa node", "decides guest memory"),                          # QEMU takes --x as -x
    ("-object '{\"qom-type\":\"memory-backend-ram\",\"id\":\"m\",\"size\":1}'", "decides guest memory"),
    ("-device '{\"driver\":\"virtio-blk-pci\",\"id\":\"vstor-vdb\"}'", "id prefix 'vstor-'"),
    ("-set chardev.vstor-vdb.path=/tmp/x", "changes vstor's vhost-user devices"),
    ("-global vhost-user-blk-pci.num-queues=1", "changes vstor's vhost-user devices"),
    ("-readconfig /tmp/q.cfg", "vstor cannot check it"),
    ("-msg timestamp=on -chardev socket,id=vstor-vdb,path=/x,reconnect=1 -usb",
     "which vstor did not write"),
])
def test_conflicting_args_are_refused_and_nothing_changes(pve, capsys, args, why):
    pve.vm(CONF.replace("args: -msg timestamp=on -set 'device.x.y=a b'", f"args: {args}"))
    intent = pve.intent(pve.file_disk())
    before, before_intent = pve.config(), open(intent).read()
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1 and "Traceback" not in err
    assert pve.config() == before and open(intent).read() == before_intent


def test_vstors_args_are_replaced_and_removed_with_its_disks(pve, capsys):
    pve.vm()
    disk = pve.file_disk()
    second = pve.file_disk("d1.raw").replace("vdb", "vdc").replace("d0.raw", "d1.raw")
    pve.intent(disk + second)
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "7.2") == 0
    args = PveConfig.parse(pve.config()).get("args")
    assert args.count("-chardev") == 2 and args.count("reconnect=1 ") == 2
    judge(pve, pve.config(), user_vfio=["0000:17:00.0"], qemu="7.2")
    pve.intent(disk)
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    args = PveConfig.parse(pve.config()).get("args")
    assert args == ("-msg timestamp=on -set 'device.x.y=a b' -chardev socket,id=vstor-vdb,"
                    f"path={pve.root}/vhost/pve-100-vdb,reconnect-ms=1000 -device vhost-user-blk-pci,"
                    "id=vstor-vdb,chardev=vstor-vdb,num-queues=2")
    judge(pve, pve.config(), user_vfio=["0000:17:00.0"])


def test_an_args_line_that_was_all_vstors_goes_with_its_disks(pve_nvme, capsys):
    conf = CONF.replace("args: -msg timestamp=on -set 'device.x.y=a b'\n", "").replace("hostpci0: 0000:17:00.0\n", "")
    pve_nvme.vm(conf.replace("memory: 1024", "memory: 2048"))
    pve_nvme.intent("<vstor:disk target='vdb'><vstor:nvme controller='0000:5e:00.0'/></vstor:disk>",
                    vm="<vstor:vm/>")
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    assert "vhost-user-blk-pci" in PveConfig.parse(pve_nvme.config()).get("args")
    judge(pve_nvme, pve_nvme.config(), 2048)
    pve_nvme.intent("<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:5e:00.0'/>"
                    "</vstor:disk>", vm="<vstor:vm/>")
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    conf = PveConfig.parse(pve_nvme.config())
    assert conf.get("args") is None and conf.get("hostpci0") == "0000:5e:00.0"    # i440fx: no pcie=1
    judge(pve_nvme, pve_nvme.config(), 2048)


# -- hostpci: vstor's lines recognised by their controller --------------------------------

def test_passthrough_lines_are_vstors_only_for_its_controllers(pve_nvme, capsys):
    pve_nvme.vm(CONF.replace("memory: 1024", "memory: 2048") + "machine: q35\n".join(("", "")))
    text = pve_nvme.config().replace("ostype: l26\n", "ostype: l26\nmachine: q35\n")
    pve_nvme.vm(text)
    passthrough = ("<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:5e:00.0'/>"
                   "</vstor:disk>")
    pve_nvme.intent(passthrough, vm="<vstor:vm/>")
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    conf = PveConfig.parse(pve_nvme.config())
    assert conf.get("hostpci0") == "0000:17:00.0"                   # the user's NIC
    assert conf.get("hostpci1") == "0000:5e:00.0,pcie=1"            # vstor's, next free slot
    assert any(v.startswith("vfio-pci,host=0000:5e:00.0,id=hostpci1,bus=ich9-pcie-port-2")
               for v in showcmd(pve_nvme.config(), PCI).after("-device"))
    judge(pve_nvme, pve_nvme.config(), 2048, user_vfio=["0000:17:00.0"])
    pve_nvme.intent(pve_nvme.file_disk(), vm="<vstor:vm/>")
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    conf = PveConfig.parse(pve_nvme.config())
    assert conf.get("hostpci0") == "0000:17:00.0" and conf.get("hostpci1") is None

    # A line of the user's that passes vstor's controller: refused, not taken over.
    pve_nvme.vm(text.replace("hostpci0: 0000:17:00.0", "hostpci0: 5e:00.0,pcie=1"))
    pve_nvme.intent(passthrough, vm="<vstor:vm/>")
    before = pve_nvme.config()
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 2
    assert "hostpci0 passes 0000:5e:00.0 through, which vstor serves as vdb" in capsys.readouterr().err
    assert pve_nvme.config() == before


# -- bad input: one line, a distinct exit code, nothing changed -------------------------


@pytest.mark.parametrize("case, code, message", [
    ("unknown", 2, "VM 101 does not exist on this node"),
    ("not-a-vmid", 2, "is not a Proxmox VMID"),
    ("running", 3, "VM 100 is running"),
    ("locked", 3, "VM 100 is locked (backup)"),
    ("no-storage", 2, "snippets storage 'nope' does not exist"),
    ("no-intent", 2, "VM 100 has no vstor intent"),
    ("memory-hotplug", 2, "memory hotplug is on"),
    ("bad-intent", 2, "unknown attribute"),
])
def test_bad_input_is_one_line_and_changes_nothing(pve, capsys, case, code, message):
    pve.vm(CONF + ("lock: backup\n" if case == "locked" else "")
           if case != "locked" else CONF.replace("boot:", "lock: backup\nboot:"))
    intent = pve.intent(pve.file_disk())
    vmid = {"unknown": "101", "not-a-vmid": "10x"}.get(case, "100")
    proc = running_qemu(pve) if case == "running" else None
    if case == "no-storage":
        pve.write_config("storage = nope\n")
    if case == "no-intent":
        os.unlink(intent)
    if case == "memory-hotplug":
        pve.vm(CONF.replace("boot:", "hotplug: disk,memory\nboot:"))
    if case == "bad-intent":
        pve.intent(pve.file_disk(), vm="<vstor:vm cpus='shared' colour='red'/>")
    snapshot = {p: open(p, "rb").read() for p in glob.glob(f"{pve.root}/**/*", recursive=True)
                if os.path.isfile(p)}
    try:
        assert pve.vstor("pve", "apply", vmid, "--qemu-version", "9.2") == code
    finally:
        if proc:
            proc.kill()
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    after = {p: open(p, "rb").read() for p in glob.glob(f"{pve.root}/**/*", recursive=True)
             if os.path.isfile(p) and not p.endswith((".pid", "/state/plan.lock")) and "/lock/" not in p
             and f"/{COUNTED}/" not in p}      # a refusal is counted, as it is logged
    assert {p: v for p, v in snapshot.items() if p in after} == after


# -- the hookscript, called as qemu-server calls it ---------------------------------------


@needs_root
def test_pre_start_makes_the_backends_and_post_stop_removes_them(pve, capsys):
    pve_applied(pve)
    done = pve.hook(100, "pre-start")
    assert done.returncode == 0, done.stderr
    assert os.path.exists(f"{pve.root}/vhost/pve-100-vdb")
    # The daemon runs on the VM's emulator cores (here the housekeeping core
    # 0, as `affinity` says), never on a dedicated vCPU's or a reactor.
    pid = open(f"{pve.root}/qsd/pve-100-vdb.pid").read().strip()
    for task in os.listdir(f"/proc/{pid}/task"):
        status = open(f"/proc/{pid}/task/{task}/status").read()
        assert re.search(r"Cpus_allowed_list:\s+0\n", status), status
    assert pve.hook(100, "pre-stop").returncode == 0
    # post-start pins a running QEMU's threads (tests/test_pve_pinning.py);
    # with none it says so in one line (a warning in Proxmox's task log).
    post = pve.hook(100, "post-start")
    assert post.returncode == 4 and post.stderr.startswith("vstor: VM 100's QEMU does not run"), post
    assert pve.vstor("status") == 0
    assert "pve-100: prepared" in capsys.readouterr().out
    done = pve.hook(100, "post-stop")
    assert done.returncode == 0, done.stderr
    assert pve_left(pve) == []
    assert pve.hook(100, "post-stop").returncode == 0        # twice: nothing to do


@needs_root
def test_a_start_that_failed_without_post_stop_is_undone_by_the_next_pre_start(pve):
    pve_applied(pve)
    assert pve.hook(100, "pre-start").returncode == 0
    pid = open(f"{pve.root}/qsd/pve-100-vdb.pid").read()
    # QEMU failed to start: Proxmox calls no post-stop.  The next start:
    assert pve.hook(100, "pre-start").returncode == 0
    assert open(f"{pve.root}/qsd/pve-100-vdb.pid").read() != pid
    assert not os.path.exists(f"/proc/{pid}")
    assert pve.hook(100, "post-stop").returncode == 0 and pve_left(pve) == []


@needs_root
def test_a_migration_source_gets_no_stop_phase_and_gc_releases_what_it_held(pve, capsys):
    """The target node runs pre-start with PVE_MIGRATED_FROM and the config
    still in the source node's directory; the source gets no stop phase."""
    text = pve_applied(pve)
    assert pve.hook(100, "pre-start").returncode == 0
    assert pve.vstor("status") == 0
    assert "VM 100 does not run on this node (vstor gc releases it)" in capsys.readouterr().out
    qemu = running_qemu(pve)
    try:
        assert pve.vstor("gc") == 0
        assert "Nothing to collect" in capsys.readouterr().out      # it runs: kept
        assert pve.vstor("release", "pve-100") == 3                 # in use: 3, as on libvirt
        assert "VM 100: it runs on this node; its backends are in use" in capsys.readouterr().err
    finally:
        qemu.kill()
        qemu.wait()
    assert pve.vstor("gc") == 0                                     # migrated away: released
    assert "Releasing pve-100 (not running)" in capsys.readouterr().out and pve_left(pve) == []

    # This node as the target: the config is still the source's, locked
    # for the migration (qemu-server starts it all the same).
    os.unlink(f"{pve.etc}/qemu-server/100.conf")
    pve.vm(text.replace("boot:", "lock: migrate\nboot:"), vmid="../nodes/other/qemu-server/100")
    done = pve.hook(100, "pre-start", env={"PVE_MIGRATED_FROM": "other"})
    assert done.returncode == 3 and "not on storage declared shared between nodes" in done.stderr
    pve.write_config(f"\n[migrate]\nshared = {pve.root}\n")
    done = pve.hook(100, "pre-start", env={"PVE_MIGRATED_FROM": "other"})
    assert done.returncode == 0, done.stderr
    assert os.path.exists(f"{pve.root}/vhost/pve-100-vdb")
    assert pve.hook(100, "post-stop").returncode == 0 and pve_left(pve) == []
    bad = pve.hook(100, "pre-start", env={"PVE_MIGRATED_FROM": "../../x"})
    assert bad.returncode == 2 and "is not a node name" in bad.stderr
    assert text


@pytest.mark.parametrize("edit, message", [
    (lambda t: re.sub(r"policy=\w+", "policy=interleave", t), "numa0"),
    (lambda t: t.replace("cores: 2", "cores: 4"), "4 vCPUs"),
    (lambda t: t.replace("affinity: ", "affinity: 1,"), "affinity"),
    (lambda t: t.replace(" -device vhost-user-blk-pci", " -usb -device vhost-user-blk-pci"), "args"),
])
def test_pre_start_refuses_a_config_that_no_longer_carries_the_plan(pve, edit, message):
    text = pve_applied(pve)
    pve.vm(edit(text))
    done = pve.hook(100, "pre-start")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("vstor: ") and done.stderr.count("\n") == 1
    assert message in done.stderr and ("vstor pve apply 100" in done.stderr or "qm unlock" in done.stderr)
    assert pve_left(pve) == []


def test_a_clone_with_vstors_args_but_no_intent_is_refused(pve):
    text = pve_applied(pve)
    pve.vm(text.replace("smbios1: uuid=6ad6b5f0", "smbios1: uuid=7ad6b5f0"), 101)
    done = pve.hook(101, "pre-start")
    assert done.returncode == 2 and "a clone or a restore of another VM" in done.stderr
    assert "args hold vstor's vhost-user disks" in done.stderr and pve_left(pve) == []


def test_a_clone_of_a_passthrough_vm_is_refused(pve_nvme):
    pve_nvme.vm(CONF.replace("memory: 1024", "memory: 2048"))
    pve_nvme.intent("<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:5e:00.0'/>"
                    "</vstor:disk>", vm="<vstor:vm/>")
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    clone = PveConfig.parse(pve_nvme.config())
    assert clone.get("hostpci1") == "0000:5e:00.0" and clone.get("args") == (
        "-msg timestamp=on -set 'device.x.y=a b'")
    clone.set("hostpci1", "5e:00")                  # the whole slot: the same controller
    pve_nvme.vm(clone.to_text(), 101)
    done = pve_nvme.hook(101, "pre-start")
    assert done.returncode == 2, done.stderr
    assert "hostpci1 passes 0000:5e:00.0 through, which vstor holds for a VM" in done.stderr


def test_the_hookscript_leaves_vms_without_vstor_alone(pve):
    pve.vm("cores: 1\nmemory: 512\nhookscript: local:snippets/vstor\n", 102)
    assert pve.vstor("pve", "hooks", "install") == 0
    for phase in ("pre-start", "post-start", "pre-stop", "post-stop"):
        done = pve.hook(102, phase)
        assert done.returncode == 0 and done.stderr == ""
    done = subprocess.run([f"{pve.snippets}/vstor", "102"], capture_output=True, text=True)
    assert done.returncode == 0         # not a phase it acts on
    done = subprocess.run([f"{pve.snippets}/vstor", "1x", "pre-start"], capture_output=True, text=True,
                          env={**os.environ, "VSTOR_CONFIG": pve.conf})
    assert done.returncode == 2 and "is not a Proxmox VMID" in done.stderr


def test_doctor_names_what_a_node_lacks(pve, tmp_path, capsys):
    from vstor.config import load
    from vstor.pve.doctor import checks
    from vstor.pve.node import Node
    text = pve_applied(pve)
    pve.vm(text.replace("hookscript: local:snippets/vstor\n", ""))
    mounts = tmp_path / "mounts"
    os.makedirs(tmp_path / "hp" / "2048kB")
    mounts.write_text(f"hugetlbfs {tmp_path}/hp/1048576kB hugetlbfs rw,pagesize=1024M 0 0\n")
    os.makedirs(tmp_path / "hp" / "1048576kB")
    found = checks(Node(load(pve.conf)), load(pve.conf), str(tmp_path / "hp"), str(mounts))
    bad = [line for ok, line in found if not ok]
    assert any("2048kB exists but is not a hugetlbfs mount" in b for b in bad)
    assert any("hookscript" in b and "missing: run vstor pve hooks install" in b for b in bad)
    assert any(b.startswith("VM 100: hookscript is not set") for b in bad)
    assert any(ok and "1048576kB: hugetlbfs" in line for ok, line in found)

    assert pve.vstor("pve", "hooks", "install") == 0
    assert "qm set 100 --hookscript local:snippets/vstor" in capsys.readouterr().out
    pve.vm(text)
    assert pve.vstor("pve", "doctor") == 0
    out = capsys.readouterr().out
    assert "ok: VM 100: hookscript set, config carries its plan" in out
    # A hookscript an older vstor installed (it ignored post-start): named, with the fix.
    script = f"{pve.snippets}/vstor"
    with open(script) as f:
        current = f.read()
    with open(script, "w") as f:
        f.write(current.replace('["pre-start"], ["post-start"], ["post-stop"]', '["pre-start"], ["post-stop"]'))
    assert pve.vstor("pve", "doctor") == 3
    assert (f"PROBLEM: hookscript {script} is not this vstor's (an older one does not pin QEMU's "
            "threads at post-start): run vstor pve hooks install") in capsys.readouterr().out
    assert pve.vstor("pve", "hooks", "install") == 0 and pve.vstor("pve", "doctor") == 0
    capsys.readouterr()
    pve.vm(text.replace("cores: 2", "cores: 3"))
    assert pve.vstor("pve", "doctor") == 3
    assert "PROBLEM: VM 100:" in capsys.readouterr().out
    pve.write_config("storage = nope\n")
    assert pve.vstor("pve", "doctor") == 3
    assert "snippets storage 'nope' does not exist" in capsys.readouterr().out


def test_the_proxmox_template_applies(pve_nvme, capsys):
    pve_nvme.vm("cores: 4\nmemory: 8192\nmachine: q35\nname: db1\n")
    with open(os.path.join(TEMPLATES, "proxmox", "vstor-100.xml")) as src:
        with open(f"{pve_nvme.snippets}/vstor-100.xml", "w") as f:
            f.write(src.read())
    assert pve_nvme.vstor("pve", "apply", "100", "--qemu-version", "10.1") == 0
    conf = PveConfig.parse(pve_nvme.config())
    assert conf.get("hostpci0") == "0000:5f:00.0,pcie=1"
    judge(pve_nvme, pve_nvme.config(), 8192)
    assert "policy=bind" in conf.get("numa0") and "vstor-vdb" in conf.get("args")


@needs_root
def test_gc_leaves_a_vm_whose_config_lock_is_held(pve, capsys):
    import fcntl
    pve_applied(pve)
    assert pve.hook(100, "pre-start").returncode == 0
    with open(f"{pve.root}/lock/lock-100.conf", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)            # a start (or migration) under way
        assert pve.vstor("gc") == 0
        assert "Leaving pve-100: its config is locked" in capsys.readouterr().out
        assert pve.vstor("release", "pve-100") == 3
        assert "its config is locked" in capsys.readouterr().err
        assert os.path.exists(f"{pve.root}/vhost/pve-100-vdb")
    assert pve.vstor("gc") == 0 and pve_left(pve) == []


def test_offline_apply_writes_only_the_files_it_was_given(pve, tmp_path, capsys):
    pve.vm()
    live_intent = pve.intent(pve.file_disk())
    conf, intent = tmp_path / "copy.conf", tmp_path / "copy.xml"
    conf.write_text(CONF)
    intent.write_text(open(live_intent).read())
    assert pve.vstor("pve", "apply", "100", "--conf", str(conf), "--qemu-version", "9.2") == 2
    assert "--conf and --intent go together" in capsys.readouterr().err
    assert pve.vstor("pve", "apply", "100", "--conf", str(conf), "--intent", str(intent),
                     "--qemu-version", "9.2") == 0
    assert "numa0:" in conf.read_text() and (tmp_path / "copy.plan.xml").exists()
    plan = etree.parse(str(tmp_path / "copy.plan.xml")).getroot()
    agrees_with_plan(showcmd(conf.read_text(), PCI), plan, 1024, ["0000:17:00.0"])
    assert pve.config() == CONF and not os.path.exists(f"{pve.snippets}/vstor-100.plan.xml")


@pytest.mark.parametrize("line", ["numa0: cpus=0,memory=1", "affinity: 0-3", "hugepages: any",
                                  "numa: 0", "numa1: cpus=1,memory=512"])
def test_a_users_numa_affinity_or_hugepages_line_is_refused_never_replaced(pve, capsys, line):
    pve.vm(CONF.replace("cores: 2", f"cores: 2\n{line}"))
    pve.intent(pve.file_disk())
    before = pve.config()
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 2
    err = capsys.readouterr().err
    assert f"'{line}' is a line of yours" in err and err.count("\n") == 1, err
    assert pve.config() == before and not os.path.exists(f"{pve.snippets}/vstor-100.plan.xml")


def test_a_key_written_twice_counts_as_qemu_server_reads_it(pve, capsys):
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "apply", "100", "--qemu-version", "9.2") == 0
    text = pve.config()
    judge(pve, text, user_vfio=["0000:17:00.0"])
    assert text.count("numa0:") == 1 and "numa0: cpus=0-1,hostnodes=0,memory=1024" in text
    doubled = text.replace("boot:", "numa0: cpus=0,hostnodes=0,memory=1024,policy=bind\nboot:", 1)
    pve.vm(doubled.replace("numa0: cpus=0-1", "numa0: cpus=0-1", 1))
    # The last numa0 is vstor's, so qemu-server reads vstor's: pre-start must
    # judge the same line (the first, a user's, is dead text to Proxmox).
    assert PveConfig.parse(pve.config()).get("numa0").startswith("cpus=0-1")


def test_the_hookscript_imports_nothing_from_the_snippets_directory(pve, tmp_path):
    """Whoever can write to the snippets storage (often a shared export) can
    put a module next to the hookscript, which Python would import first,
    as root.  The script starts with -SP and the paths vstor was installed
    with, and drops its own directory itself too."""
    marker = tmp_path / "imported"
    for name in ("json.py", "lxml/__init__.py", "configparser.py", "os.py"):
        path = f"{pve.snippets}/{name}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"open({str(marker)!r}, 'a').write({name!r})\n")
    out = pve.hook(100, "pre-start")
    assert not marker.exists(), marker.read_text()
    assert "Traceback" not in out.stderr
    first = open(f"{pve.snippets}/vstor").readline()
    assert first in (f"#!{sys.executable} -SP\n", f"#!{sys.executable} -P\n")
    # Without -P (an older Python, a script run by hand), the script drops
    # its own directory itself: before it imports anything.
    bare = subprocess.run([sys.executable, "-S", f"{pve.snippets}/vstor", "100", "pre-start"],
                          capture_output=True, text=True, env={**os.environ, "PVE_MIGRATED_FROM": ""})
    assert not marker.exists(), marker.read_text()
    assert "Traceback" not in bare.stderr
