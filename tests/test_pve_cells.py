"""Proxmox VMs whose guest has several NUMA cells: the numaN lines and the
expander buses in args that `vstor pve apply` writes, judged by Proxmox's
own qemu-server (tests/pve/oracle.py: ../shared/pve/oracle's showcmd with
hugepages_topology) on configs made from plans on the two- and three-node
host layouts, and by the real QEMU of this machine, which must take the
expander buses, root ports and vhost-user-blk devices of such a command
line with real qemu-storage-daemons behind them."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest
from lxml import etree

from tests.pve.oracle import cpus, showcmd
from tests.helpers import PCI, Pve
from vstor.errors import BadInput
from vstor.formats.pve.config import PveConfig
from vstor.meta.plan import Plan
from vstor.meta.xmlmodel import parse as parse_record
from vstor.records import replace
from vstor.render import pve as render

QEMU = "9.2"
PCI3 = PCI + ("0000:41:00.0", "0000:81:00.0", "0000:c1:00.0")       # the three-node host's NVMe
# The buses and root ports pve-q35-4.0.cfg (-readconfig, not in the oracle)
# adds on q35: ich9-pcie-port-1..4 (chassis 1-4), pcidmi, pci.0..pci.3.
Q35_CFG_BRIDGES, Q35_CFG_CHASSIS = 9, {1, 2, 3, 4}


def disk(target: str, controller: str, backend: str = "qsd", mode: str = "", ns: str = "") -> str:
    m = f" mode='{mode}'" if mode else ""
    b = f" backend='{backend}'" if not mode else ""
    n = f" namespace='{ns}'" if ns else ""
    return f"<vstor:disk target='{target}'{m}{b}><vstor:nvme controller='{controller}'{n}/></vstor:disk>"


TWO = disk("vdb", "0000:3b:00.0") + disk("vdc", "0000:5e:00.0")
THREE = disk("vdb", "0000:41:00.0") + disk("vdc", "0000:81:00.0") + disk("vdd", "0000:c1:00.0")
# Two disks in cell 1 (two namespaces of node 1's controller): two root ports there.
FOUR = THREE + disk("vde", "0000:81:00.0", ns="2")
PASSED = disk("vdb", "0000:3b:00.0", mode="passthrough") + disk("vdc", "0000:5e:00.0", mode="passthrough")

# A config with many of qemu-server's own devices, whose slots, buses and
# chassis vstor's must not take.
BUSY = """agent: 1
audio0: device=ich9-intel-hda,driver=none
net0: virtio=BC:24:11:00:00:01,bridge=vmbr0
net1: e1000=BC:24:11:00:00:02,bridge=vmbr0
rng0: source=/dev/urandom
scsi0: local-lvm:vm-100-disk-0,size=8G
scsihw: virtio-scsi-single
virtio0: local-lvm:vm-100-disk-1,size=8G
watchdog: model=i6300esb
hostpci0: 0000:17:00.0{pcie}
hostpci1: 0000:5f:00.0{pcie}
hostpci2: 0000:60:00.0{pcie}
hostpci3: 0000:61:00.0{pcie}
hostpci4: 0000:3b:00.0{pcie}
"""


@pytest.fixture
def pve2(tmp_path, host_layout):
    return Pve(tmp_path, host_layout("two-socket"))


@pytest.fixture
def pve3(tmp_path, host_layout):
    return Pve(tmp_path, host_layout("three-node"))


def applied(pve, disks: str, vm: str, cores: int, mib: int, machine: str, extra: str = "") -> Plan:
    pve.vm(f"cores: {cores}\nmemory: {mib}\nmachine: {machine}\nname: db\n{extra}")
    pve.intent(disks, vm=vm)
    assert pve.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    return recorded(pve)


def recorded(pve) -> Plan:
    with open(f"{pve.snippets}/vstor-100.plan.xml", "rb") as f:
        return replace(parse_record(Plan, etree.fromstring(f.read())), domain="pve-100")


def options(value: str) -> tuple[str, dict]:
    driver, *rest = value.split(",")
    return driver, dict(p.split("=", 1) for p in rest if "=" in p)


def devices(start) -> dict[str, tuple[str, dict]]:
    out = {}
    for v in start.after("-device"):
        driver, props = options(v)
        out[props.get("id", f"#{len(out)}")] = (driver, props)
    return out


def cell_of(devs: dict, dev_id: str) -> int | None:
    """The numa_node of the expander bus the device's bus= chain leads to
    (None: it sits on the root bus, on no node)."""
    bus = devs[dev_id][1].get("bus")
    for _ in range(8):
        if bus not in devs:
            return None
        driver, props = devs[bus]
        if driver in ("pxb", "pxb-pcie"):
            return int(props["numa_node"])
        bus = props.get("bus")
    return None


def slot(addr: str) -> tuple[int, int]:
    s, _, f = addr.partition(".")
    return int(s, 16), int(f or "0", 16)


def check_command_line(start, plan: Plan, q35: bool, policy: str = "bind") -> None:
    """qemu-server's command line carries every cell as planned, and each
    vhost disk sits behind its cell's expander bus, colliding with none of
    qemu-server's own slots, buses or chassis."""
    assert start.code == 0, start.err
    backends = [options(v) for v in start.after("-object") if v.startswith("memory-backend")]
    assert len(backends) == len(plan.cells)
    for cell, (kind, props) in zip(plan.cells, backends):
        assert props["id"] == f"ram-node{cell.id}" and props["size"] == f"{cell.memory_kib // 1024}M"
        assert (props["host-nodes"], props["policy"]) == (str(cell.node), policy)
        if plan.hugepage_kib:
            assert kind == "memory-backend-file" and props["share"] == "on"
            assert props["mem-path"] == f"/run/hugepages/kvm/{plan.hugepage_kib}kB"
        else:
            assert kind == "memory-backend-ram"
    numa = [options("x," + v)[1] for v in start.after("-numa")]
    assert [(n["nodeid"], cpus(n["cpus"]), n["memdev"]) for n in numa] == \
        [(str(c.id), set(c.vcpus), f"ram-node{c.id}") for c in plan.cells]
    if plan.hugepage_kib:
        want: dict = {}
        for c in plan.cells:
            want[str(c.node)] = want.get(str(c.node), 0) + c.hugepages
        assert start.topology == {str(plan.hugepage_kib // 1024): want}, start.topology
    else:
        assert start.topology is None
    devs = devices(start)
    vhost = [d for d in plan.disks if d.mode == "vhost"]
    for d in vhost:
        driver, props = devs[f"vstor-{d.target}"]
        assert driver == "vhost-user-blk-pci" and props["chardev"] == f"vstor-{d.target}"
        assert cell_of(devs, f"vstor-{d.target}") == d.cell, (d.target, props)
    for d in plan.disks:
        if d.mode == "passthrough":        # no bus option in hostpciN: qemu-server's buses
            vfio = next(k for k, (drv, p) in devs.items() if drv == "vfio-pci" and p["host"] == d.controller)
            assert cell_of(devs, vfio) is None
    # No two devices in one slot; the expander buses on the root bus.
    slots = [(p["bus"], slot(p["addr"])) for _, p in devs.values() if "bus" in p and "addr" in p]
    assert len(slots) == len(set(slots)), sorted(slots)
    pxbs = [p for drv, p in devs.values() if drv in ("pxb", "pxb-pcie")]
    assert {p["bus"] for p in pxbs} <= {"pcie.0" if q35 else "pci.0"}
    assert len(pxbs) == len({d.cell for d in vhost})
    # Bus numbers: each expander bus's range (its root ports, or a pxb's
    # bridge) apart from the others' and above every bus qemu-server's
    # bridges and root ports can be given (numbered from 1 up).
    ranges = []
    for p in pxbs:
        behind = sum(1 for drv, q in devs.values() if drv == "pcie-root-port" and q.get("bus") == p["id"])
        ranges.append(range(int(p["bus_nr"]), int(p["bus_nr"]) + 1 + (behind if q35 else 1)))
    assert all(r.stop <= 256 for r in ranges)
    assert all(not set(a) & set(b) for i, a in enumerate(ranges) for b in ranges[i + 1:])
    theirs = sum(1 for drv, p in devs.values() if drv in ("pcie-root-port", "pci-bridge")
                 and not p.get("id", "").startswith("vstor-"))
    assert 1 + theirs + (Q35_CFG_BRIDGES if q35 else 0) < min((r.start for r in ranges), default=256)
    chassis = [int(p["chassis"]) for drv, p in devs.values() if drv == "pcie-root-port"]
    assert len(chassis) == len(set(chassis)) and not set(chassis) & (Q35_CFG_CHASSIS if q35 else set())
    # vstor's part of the command line is args' suffix: every -chardev,
    # then the buses, then the devices.
    tail = start.argv[start.argv.index(f"socket,id=vstor-{vhost[0].target},path={vhost[0].socket},"
                                       "reconnect-ms=1000") - 1:] if vhost else []
    group = {"socket": 0, "pxb": 1, "pxb-pcie": 1, "pcie-root-port": 1, "vhost-user-blk-pci": 2}
    kinds = [group[options(v)[0]] for v in tail[1::2]]
    assert kinds == sorted(kinds) and tail[::2] == ["-chardev"] * kinds.count(0) + ["-device"] * (
        len(kinds) - kinds.count(0))


CASES = [
    # layout, disks, <vstor:vm>, cores, MiB, machine, cells' host nodes
    ("two-socket", TWO, "<vstor:vm hugepages='2M'/>", 4, 4096, "q35", [0, 1]),
    ("two-socket", TWO, "<vstor:vm hugepages='1G'/>", 4, 4096, "pc", [0, 1]),
    ("three-node", THREE, "<vstor:vm hugepages='2M'/>", 6, 6144, "q35", [0, 1, 2]),
    ("three-node", FOUR, "<vstor:vm hugepages='2M'/>", 6, 6144, "pc-i440fx-9.2", [0, 1, 2]),
    ("three-node", FOUR, "<vstor:vm hugepages='2M' numa='preferred'/>", 6, 6144, "q35", [0, 1, 2]),
    ("two-socket", PASSED, "<vstor:vm/>", 4, 4096, "q35", [0, 1]),
    # 7001 MiB over three cells: 2334 + 2334 + 2333, as qemu-server must add them up
    ("three-node", "".join(disk(f"vd{t}", a, mode="passthrough") for t, a in
                           zip("bcd", ("0000:41:00.0", "0000:81:00.0", "0000:c1:00.0"))),
     "<vstor:vm/>", 6, 7001, "pc", [0, 1, 2]),
]


@pytest.mark.process
@pytest.mark.parametrize("layout, disks, vm, cores, mib, machine, nodes", CASES,
                         ids=["2-q35-2M", "2-pc-1G", "3-q35-2M", "3-i440fx-2M-4disks", "3-q35-preferred",
                              "2-q35-passthrough-no-hugepages", "3-pc-passthrough-7001MiB"])
@pytest.mark.parametrize("busy", ["", BUSY, BUSY + "ostype: win7\n"], ids=["bare", "busy", "busy-win7"])
def test_qemu_server_starts_each_cell_on_its_node_and_each_disk_behind_its_cells_bus(
        host_layout, tmp_path, layout, disks, vm, cores, mib, machine, nodes, busy, capsys):
    pve = Pve(tmp_path, host_layout(layout))
    q35 = machine.startswith(("q35", "pc-q35"))
    # (Windows 7 gets its pcie=1 devices on pcie.0 itself, hostpci4 in slot 0x9.)
    extra = busy.format(pcie=",pcie=1" if q35 else "")
    if busy and "0000:3b:00.0" in disks:
        extra = extra.replace("hostpci4: 0000:3b:00.0" + (",pcie=1" if q35 else "") + "\n", "")
    plan = applied(pve, disks, vm, cores, mib, machine, extra)
    assert [c.node for c in plan.cells] == nodes
    conf = PveConfig.parse(pve.config())
    policy = "bind" if "preferred" not in vm else "preferred"
    for c in plan.cells:
        assert conf.get(f"numa{c.id}") == (f"cpus={min(c.vcpus)}-{max(c.vcpus)},hostnodes={c.node},"
                                           f"memory={c.memory_kib // 1024},policy={policy}")
    assert conf.get(f"numa{len(plan.cells)}") is None
    check_command_line(showcmd(pve.config(), PCI3, QEMU), plan, q35, policy)
    assert plan.disks and all(d.cell is not None for d in plan.disks)
    for d in plan.disks:        # the plan says where a passed-through controller is not
        said = [r for r in d.reasons if "hostpciN line has no bus option" in r]
        assert len(said) == (d.mode == "passthrough"), d.reasons
        assert not said or said[0].startswith(f"in guest cell {d.cell} (host node {plan.cells[d.cell].node})")


def test_a_second_apply_changes_nothing_and_unapply_gives_the_config_back(pve3, capsys):
    original = ("cores: 6\nmemory: 6144\nmachine: q35\nname: db\n"
                "args: -msg timestamp=on -set 'device.x.y=a b'\n")
    pve3.vm(original)
    pve3.intent(FOUR, vm="<vstor:vm hugepages='2M'/>")
    assert pve3.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    after = pve3.config()
    args = PveConfig.parse(after).get("args")
    assert args.startswith("-msg timestamp=on -set 'device.x.y=a b' -chardev socket,id=vstor-vdb,")
    assert render.has_vstor_args(args) and args.count("pxb-pcie") == 3
    assert pve3.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    assert pve3.config() == after and "config unchanged" in capsys.readouterr().out
    assert pve3.vstor("pve", "unapply", "100") == 0
    assert pve3.config() == original


@pytest.mark.process
def test_from_cells_to_one_and_back_vstors_lines_follow_the_plan(pve2, capsys):
    """Re-applied with one cell, the cells' lines and buses go (they were
    vstor's: the plan before wrote them); with cells again they come back
    (numa1 now after the lines kept)."""
    pve2.vm("cores: 4\nmemory: 4096\nmachine: q35\nname: db\nargs: -msg timestamp=on\n")
    pve2.intent(TWO, vm="<vstor:vm hugepages='2M' numa='preferred'/>")
    assert pve2.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    spread = pve2.config()
    assert "numa1: " in spread and "pxb-pcie" in spread
    pve2.intent(TWO, vm="<vstor:vm hugepages='2M' numa='preferred' cells='one'/>")
    assert pve2.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    one = PveConfig.parse(pve2.config())
    assert one.get("numa1") is None and one.get("numa0").startswith("cpus=0-3,")
    assert "bus=" not in one.get("args") and one.get("args").startswith("-msg timestamp=on -chardev ")
    start = showcmd(pve2.config(), PCI, QEMU)
    assert start.code == 0 and len(start.after("-numa")) == 1
    assert not [v for v in start.after("-device") if v.startswith(("pxb", "pcie-root-port,id=vstor"))]
    pve2.intent(TWO, vm="<vstor:vm hugepages='2M' numa='preferred'/>")
    assert pve2.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0
    again, before = PveConfig.parse(pve2.config()), PveConfig.parse(spread)
    assert {k: again.get(k) for k in again.keys()} == {k: before.get(k) for k in before.keys()}


@pytest.mark.process
@pytest.mark.parametrize("edit, said", [
    (lambda t: t.replace("numa1: cpus=2-3,hostnodes=1", "numa1: cpus=2-3,hostnodes=0"), "(numa1 changed"),
    (lambda t: re.sub(r"(numa2: [^\n]*)policy=bind", r"\1policy=interleave", t), "(numa2 changed"),
    (lambda t: t.replace("numa2: ", "numa3: cpus=6,memory=1\nnuma2: "), "(numa3 changed"),
    (lambda t: t.replace(",bus=vstor-cell2-vdd,addr=0x0", ""), "(args changed"),
    (lambda t: re.sub(r"chassis=\d+", "chassis=5", t, count=1), "(args changed"),  # qemu-server's port 5
    # a bus on another cell's node than vstor's: not a line vstor writes
    (lambda t: re.sub(r"(id=vstor-cell1,bus_nr=\d+,)numa_node=1", r"\1numa_node=0", t),
     "args has '-device pxb-pcie,id=vstor-cell1,bus_nr=252,numa_node=0,"),
])
def test_a_hand_edit_of_a_cells_line_is_drift_refused_at_pre_start(pve3, edit, said):
    from tests.helpers import local_qemu
    pve3.vm("cores: 6\nmemory: 6144\nmachine: q35\nname: db\nhookscript: local:snippets/vstor\n")
    pve3.intent(THREE, vm="<vstor:vm hugepages='2M'/>")
    assert pve3.vstor("pve", "apply", "100", "--qemu-version", ".".join(map(str, local_qemu()))) == 0
    text = pve3.config()
    pve3.vm(edit(text))
    assert pve3.config() != text
    done = pve3.hook(100, "pre-start")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("vstor: VM 100's config does not carry its vstor plan")
    assert said in done.stderr and "(run: vstor pve apply 100)" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_one_cell_plan_keeps_its_pairs_and_a_multi_cell_suffix_is_vstors(pve2):
    plan = applied(pve2, disk("vdb", "0000:5e:00.0") + disk("vdc", "0000:5f:00.0"), "<vstor:vm/>",
                   2, 2048, "q35")
    assert not plan.cells
    words = render.vhost_args(plan, (9, 2), "q35")
    assert [w.split(",")[0] for w in words[1::2]] == ["socket", "vhost-user-blk-pci"] * 2
    assert "bus=" not in " ".join(words)


def _two_cells(pve) -> Plan:
    return applied(pve, TWO, "<vstor:vm hugepages='2M'/>", 4, 4096, "q35")


@pytest.mark.parametrize("user, words", [
    ("-device virtio-net-pci,bus=vstor-cell0,netdev=n", "which is vstor's"),
    ("-device '{\"driver\":\"e1000\",\"bus\":\"vstor-cell1-vdc\"}'", "which is vstor's"),
    # A user's own expander bus, in each form QEMU takes a -device in.
    ("-device pxb-pcie,id=mine,bus_nr=200,bus=pcie.0", "a PCI expander bus"),
    ("-device driver=pxb-pcie,id=mine,bus_nr=200,bus=pcie.0", "a PCI expander bus"),
    ("-device id=mine,driver=pxb,bus_nr=200", "a PCI expander bus"),
    ("-device '{\"driver\": \"pxb-pcie\", \"id\": \"mine\", \"bus_nr\": 200, \"bus\": \"pcie.0\"}'",
     "a PCI expander bus"),
])
def test_a_users_device_on_vstors_buses_is_refused(pve2, user, words):
    plan = _two_cells(pve2)
    with pytest.raises(BadInput) as e:
        render.merge_args(user, render.vhost_args(plan, (9, 2), "q35"), 100)
    assert words in e.value.message


@pytest.mark.parametrize("change", [
    lambda s: s.replace("pxb-pcie,id=vstor-cell1", "pxb-pcie,id=vstor-cell1,x=1"),
    lambda s: s + " -device pxb-pcie,id=vstor-cell7,bus_nr=9,numa_node=7,bus=pcie.0,addr=0x8.7,multifunction=on -usb",
    lambda s: re.sub(r" -device vhost-user-blk-pci,id=vstor-vdc\S*", "", s),
    lambda s: re.sub(r"(-device vhost-user-blk-pci,id=vstor-vdb\S*)", r"\1 \1", s),
])
def test_a_suffix_vstor_did_not_write_is_refused(pve2, change):
    plan = _two_cells(pve2)
    ours = render.merge_args(None, render.vhost_args(plan, (9, 2), "q35"), 100)
    assert render.merge_args(ours, render.vhost_args(plan, (9, 2), "q35"), 100) == ours
    with pytest.raises(BadInput) as e:
        render.merge_args(change(ours), render.vhost_args(plan, (9, 2), "q35"), 100)
    assert "which vstor did not write" in e.value.message


def test_cells_qemu_server_cannot_make_are_refused_naming_the_cell(pve2):
    plan = _two_cells(pve2)
    far = replace(plan, cells=(plan.cells[0], replace(plan.cells[1], node=11)))
    with pytest.raises(BadInput) as e:
        render.placement(far)
    assert e.value.message.startswith("pve-100: guest cell 1: hugepages on host node 11, which Proxmox")
    odd = replace(plan, cells=(replace(plan.cells[0], memory_kib=plan.cells[0].memory_kib + 1024),
                               replace(plan.cells[1], memory_kib=plan.cells[1].memory_kib - 1024)))
    with pytest.raises(BadInput) as e:
        render.placement(odd)
    assert "guest cell 0: 2098176 KiB of memory is not a whole number of 2 MiB pages" in e.value.message
    assert e.value.hint and "\n" not in e.value.message


@pytest.mark.process
def test_the_fourth_qxl_display_of_an_i440fx_guest_is_refused(pve2, capsys):
    """qemu-server puts a Windows guest's fourth qxl display in pci.0 slot
    0x1a, the slot of vstor's expander buses on i440fx."""
    conf = "ostype: win10\nvga: qxl4\n"
    start = showcmd(f"cores: 4\nmemory: 4096\n{conf}", PCI, QEMU)
    assert any(options(v)[1].get("addr") == "0x1a" and options(v)[1].get("bus") == "pci.0"
               for v in start.after("-device")), start.argv
    pve2.vm(f"cores: 4\nmemory: 4096\nname: db\n{conf}")
    pve2.intent(TWO, vm="<vstor:vm hugepages='2M'/>")
    before = pve2.config()
    assert pve2.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 2
    err = capsys.readouterr().err
    assert "vga qxl4 takes PCI slot 0x1a" in err and err.count("\n") == 1
    assert pve2.config() == before
    plan = applied(pve2, TWO, "<vstor:vm hugepages='2M'/>", 4, 4096, "q35", conf)
    check_command_line(showcmd(pve2.config(), PCI, QEMU), plan, True)


# -- the real QEMU takes the buses, with real qemu-storage-daemons behind the disks --------

QEMU_BIN, QSD_BIN = shutil.which("qemu-system-x86_64"), shutil.which("qemu-storage-daemon")


def _serve(disks, image: str) -> list[subprocess.Popen]:
    """A qemu-storage-daemon per disk, on the disk's socket, with its queues."""
    procs, sockets = [], [d.socket for d in disks]
    for i, d in enumerate(disks):
        sock = d.socket
        os.makedirs(os.path.dirname(sock), exist_ok=True)
        procs.append(subprocess.Popen(
            [QSD_BIN, "--blockdev", f"driver=file,node-name=f{i},filename={image},locking=off",
             "--export", f"type=vhost-user-blk,id=e{i},node-name=f{i},addr.type=unix,"
                         f"addr.path={sock},writable=on,num-queues={d.queues}"], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE))
    deadline = time.monotonic() + 20
    while not all(os.path.exists(s) for s in sockets):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _stop(procs)
            pytest.fail(f"qemu-storage-daemon did not serve: {[p.stderr.read() for p in procs]}")
        time.sleep(0.05)
    return procs


def _stop(procs) -> None:
    for p in procs:
        p.terminate()
        p.wait(10)


def local_qemu() -> str:
    out = subprocess.run([QEMU_BIN, "--version"], capture_output=True, text=True).stdout
    return re.search(r"version (\d+\.\d+)", out).group(1)


class _Qmp:
    """QEMU under QMP on its stdin and stdout, one command at a time."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.proc.stdout.readline()                     # the greeting
        self.ask("qmp_capabilities")

    def ask(self, command: str, **arguments):
        self.proc.stdin.write(json.dumps({"execute": command, "arguments": arguments}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                pytest.fail(f"QEMU exited: {self.proc.stderr.read()}")
            answer = json.loads(line)
            if "return" in answer:
                return answer["return"]
            assert "error" not in answer, answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


def _pci_devices(buses) -> dict[str, dict]:
    """query-pci's devices by qdev id, behind bridges too."""
    out = {}
    for bus in buses:
        stack = list(bus["devices"])
        while stack:
            dev = stack.pop()
            out[dev.get("qdev_id") or f"#{len(out)}"] = dev
            stack += dev.get("pci_bridge", {}).get("devices", [])
    return out


@pytest.mark.process
@pytest.mark.skipif(not (QEMU_BIN and QSD_BIN), reason="needs qemu-system-x86_64 and qemu-storage-daemon")
@pytest.mark.parametrize("layout, disks, machine", [("three-node", FOUR, "q35"), ("three-node", FOUR, "pc"),
                                                   ("two-socket", TWO, "q35")])
def test_qemu_and_its_firmware_put_each_disk_on_its_cells_bus(host_layout, tmp_path, layout, disks, machine):
    """qemu-server's -smp, -numa and args as it writes them (memory from
    memfd: this host has one node, and the machine is built without
    hugepages), on real qemu-storage-daemons.  QEMU says over QMP which bus
    each disk is on and which node each expander bus has; then the guest's
    firmware (SeaBIOS) numbers the buses: every disk must get a bus number
    of its cell's expander bus range and its memory BARs, or the guest
    would not see it."""
    pve = Pve(tmp_path, host_layout(layout))
    three = layout == "three-node"
    local = local_qemu()
    pve.vm(f"cores: {6 if three else 4}\nmemory: {6144 if three else 4096}\nmachine: {machine}\nname: db\n")
    pve.intent(disks, vm="<vstor:vm hugepages='2M'/>")
    assert pve.vstor("pve", "apply", "100", "--qemu-version", local) == 0
    plan = recorded(pve)
    argv = showcmd(pve.config(), PCI, local).argv
    cmd = [QEMU_BIN, "-machine", "q35" if machine == "q35" else "pc", "-accel", "tcg", "-nodefaults",
           "-display", "none", "-qmp", "stdio", "-smp", argv[argv.index("-smp") + 1].split(",")[0],
           "-m", argv[argv.index("-m") + 1]]
    for a, b in zip(argv, argv[1:]):
        if a == "-object" and b.startswith("memory-backend"):
            props = options(b)[1]
            cmd += ["-object", f"memory-backend-memfd,id={props['id']},size={props['size']},share=on"]
        elif a == "-numa":
            cmd += ["-numa", b]
    start = next(i for i, (a, b) in enumerate(zip(argv, argv[1:]))
                 if a == "-chardev" and b.startswith("socket,id=vstor-"))
    cmd += argv[start:]                 # args' suffix: vstor's chardevs, buses and devices
    vhost = [d for d in plan.disks if d.mode == "vhost"]
    image = str(tmp_path / "disk.raw")
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    procs = _serve(vhost, image)
    qemu = None
    try:
        qemu = _Qmp(cmd)
        for d in vhost:
            bus = qemu.ask("qom-get", path=f"/machine/peripheral/vstor-{d.target}", property="parent_bus")
            if machine == "q35":        # disk -> its root port -> its cell's pxb-pcie
                assert bus.endswith(f"/vstor-cell{d.cell}-{d.target}"), bus
                bus = qemu.ask("qom-get", path=f"/machine/peripheral/vstor-cell{d.cell}-{d.target}",
                               property="parent_bus")
            assert bus.endswith(f"/vstor-cell{d.cell}"), bus      # i440fx: the bus behind the pxb
            assert qemu.ask("qom-get", path=f"/machine/peripheral/vstor-cell{d.cell}",
                            property="numa_node") == d.cell
        deadline, found = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            found = _pci_devices(qemu.ask("query-pci"))
            if all(_numbered(found.get(f"vstor-{d.target}")) for d in vhost):
                break
            time.sleep(0.5)
    finally:
        if qemu:
            qemu.close()
        _stop(procs)
    for d in vhost:
        pxb = options(next(b for a, b in zip(argv, argv[1:]) if b.startswith(("pxb-pcie,", "pxb,"))
                           and f"id=vstor-cell{d.cell}," in b))[1]
        behind = sum(1 for x in vhost if x.cell == d.cell) if machine == "q35" else 1
        dev = found.get(f"vstor-{d.target}")
        assert _numbered(dev), (d.target, dev, sorted(found))
        assert int(pxb["bus_nr"]) < dev["bus"] <= int(pxb["bus_nr"]) + behind, (d.target, dev["bus"], pxb)


def _numbered(dev) -> bool:
    """Found by the firmware: on a bus it numbered, its memory BARs placed."""
    return bool(dev and dev["bus"] and all(r["address"] != 2**64 - 1 for r in dev["regions"]
                                           if r["type"] == "memory"))


def test_unapply_recognises_the_lines_an_older_vstor_wrote_for_a_plan_refused_today(pve2):
    """An older vstor wrote numaN with hugepages on host node 11 and
    `affinity: 0`; today's renderer refuses the first and writes `0-0` for
    the second.  unapply still takes every one of them out."""
    from vstor.formats.pve.config import PveConfig
    from vstor.pve import leave
    plan = _two_cells(pve2)
    far = replace(plan, cells=(plan.cells[0], replace(plan.cells[1], node=11)),
                  vcpu_pins=(0,) * len(plan.vcpu_pins), emulator=(0,), cpus="dedicated")
    old = render.placement(far, check=False)
    assert old["affinity"] == "0" and "hostnodes=11" in old["numa1"]
    text = "cores: 4\nmemory: 4096\n" + "".join(f"{k}: {v}\n" for k, v in old.items() if v)
    conf = PveConfig.parse(text)
    removed = leave.strip(conf, (far,), "local:snippets/vstor", 100)
    assert set(removed) == {k for k, v in old.items() if v}
    assert conf.to_text() == "cores: 4\nmemory: 4096\n"


@pytest.mark.process
def test_a_guest_cell_across_two_sockets_is_refused_and_aligned_cells_are_applied(pve3, capsys):
    """sockets: 2, cores: 3 and three cells: cell 1 would hold vCPU 2
    (socket 0) and vCPU 3 (socket 1).  Refused, nothing written; with
    sockets: 3, cores: 2 each cell is one socket, and qemu-server's own
    command line says so (-smp and the numa cpus ranges)."""
    from tests.pve.oracle import require, showcmd
    pve3.vm("sockets: 2\ncores: 3\nmemory: 3072\nmachine: q35\nname: db\n")
    pve3.intent(THREE, vm="<vstor:vm hugepages='2M'/>")
    before = pve3.config()
    assert pve3.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 2
    err = capsys.readouterr().err
    assert "guest cell 1 would hold vCPUs of sockets 0, 1 (sockets: 2, cores: 3)" in err, err
    assert err.count("\n") == 1 and pve3.config() == before
    pve3.vm("sockets: 3\ncores: 2\nmemory: 3072\nmachine: q35\nname: db\n")
    assert pve3.vstor("pve", "apply", "100", "--qemu-version", QEMU) == 0, capsys.readouterr().err
    require()
    start = showcmd(pve3.config(), qemu=QEMU)
    assert start.after("-smp")[0].startswith("6,sockets=3,cores=2")
    cpus = [p.split("cpus=")[1].split(",")[0] for p in start.after("-numa") if "cpus=" in p]
    assert cpus == ["0-1", "2-3", "4-5"]
