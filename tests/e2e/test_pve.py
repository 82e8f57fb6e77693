"""A Proxmox VE VM configured by vstor, end to end, without Proxmox: a node's
tree in a temporary directory (/etc/pve, the snippets storage, qemu-server's
run and lock directories), `vstor pve apply` and `vstor pve hooks install`
run on it, then what qemu-server would do at the VM's start and stop done
here: the installed hookscript called as `<script> 100 pre-start`, the
hugepage pool grown and mounted, QEMU started with the arguments Proxmox's
real qemu-server turns the config into (../shared/pve/oracle's showcmd, as
`qm showcmd` prints them: its taskset prefix, -smp, -m, memory objects, -numa
nodes and the `args` it appends last; what needs Proxmox's own files or KVM
is left out), `<script> 100 post-stop` when it exits.

The guest boots under TCG on real qemu-storage-daemons, writes a pattern to
every vstor disk and reads it back; the pattern must be in the backing files,
and after post-stop nothing of vstor's may be left on the host."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pve import oracle
from vstor.formats.pve.config import PveConfig

from .conftest import unavailable
from .guest import expected_pattern, job, parse_console
from .libvirtd import read_console

ROOT = Path(__file__).resolve().parents[2]
VMID = 100
NAME = f"pve-{VMID}"
MEMORY_MIB = 256
SIZE = 1 << 20                  # what the guest writes to each disk
DISK_BYTES = 64 << 20
USER_ARGS = "-msg timestamp=on"     # the user's own args: vstor must keep them
HUGEPAGES = Path("/run/hugepages/kvm/2048kB")       # where qemu-server mounts 2 MiB pages
POOL = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
BOOT_TIMEOUT = 240


@dataclass(frozen=True)
class Shape:
    id: str
    machine: str
    cores: int
    disks: tuple[str, ...]
    vm: str                     # the intent's <vstor:vm/>
    policy: str                 # what numa0 must say
    affinity: str               # the cores every QEMU thread may run on
    written: str                # the affinity line vstor writes for them
    # After post-start: each vCPU's cores, and every other thread's.
    vcpu_cores: tuple[str, ...] = ()
    emulator: str = ""
    housekeeping: str | None = None     # [cpu] housekeeping (None: unset)
    cells: int = 1


SHAPES = [
    # Core 0 is this 2-core host's housekeeping core: shared vCPUs float on
    # it with the emulator; core 1 is the one a dedicated vCPU can have.
    Shape("q35-shared-1disk", "q35", 2, ("vdb",), '<vstor:vm cpus="shared" numa="preferred"/>',
          "preferred", "0", "0-0", ("0", "0"), "0"),     # qemu-server's Perl takes "0" as false
    Shape("pc-dedicated-strict-2disks", "pc", 1, ("vdb", "vdc"),
          '<vstor:vm cpus="dedicated" numa="strict"/>', "bind", "0-1", "0-1", ("1",), "0"),
    # Two guest cells, one dedicated core each: with no housekeeping cores
    # the emulator shares the VM's; qemu-server starts every thread on 0-1,
    # post-start pins vCPU 0 to core 0 and vCPU 1 to core 1.
    Shape("q35-two-cells-dedicated", "q35", 2, ("vdb", "vdc"),
          '<vstor:vm cpus="dedicated" numa="strict" cells="2"/>', "bind", "0-1", "0-1",
          ("0", "1"), "0-1", housekeeping="", cells=2),
]


def vm_config(shape: Shape) -> str:
    """As Proxmox writes one: the description first (URL-escaped # lines),
    keys sorted, a snapshot section after the main one."""
    return f"""#vstor e2e%3A a VM whose disks vstor serves
#%20not touched by vstor
args: {USER_ARGS}
boot: order=scsi0
cores: {shape.cores}
cpu: x86-64-v2-AES
machine: {shape.machine}
memory: {MEMORY_MIB}
meta: creation-qemu=7.2.0,ctime=1700000000
name: vstor-e2e-{shape.id}
net0: virtio=BC:24:11:5E:00:01,bridge=vmbr0,firewall=1
ostype: l26
parent: before-vstor
scsihw: virtio-scsi-single
smbios1: uuid={uuid.uuid4()}
sockets: 1
vmgenid: {uuid.uuid4()}

[before-vstor]
boot: order=scsi0
cores: {shape.cores}
machine: {shape.machine}
memory: {MEMORY_MIB}
name: vstor-e2e-{shape.id}
ostype: l26
snaptime: 1700000000
sockets: 1
"""


class Hugepages:
    """What qemu-server does for `hugepages: 2` at a start (after pre-start):
    hugetlbfs mounted at /run/hugepages/kvm/2048kB and the pool grown.
    `undo()` unmounts only what it mounted and restores nr_hugepages."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.mounted = False
        self.made: Path | None = None

    def provide(self, mib: int) -> None:
        if not _mounted(HUGEPAGES):
            if not HUGEPAGES.exists():
                top = HUGEPAGES
                while not top.parent.exists():
                    top = top.parent
                HUGEPAGES.mkdir(parents=True)
                self.made = top         # removed again at undo()
            subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2048k", "hugetlbfs",
                            str(HUGEPAGES)], check=True, capture_output=True)
            self.mounted = True
        pages = mib // 2
        self.total = int((POOL / "nr_hugepages").read_text())
        need = pages - int((POOL / "free_hugepages").read_text())
        if need > 0:
            (POOL / "nr_hugepages").write_text(str(self.total + need))
            if int((POOL / "free_hugepages").read_text()) < pages:
                unavailable(f"the kernel could not allocate {pages} free 2 MiB hugepages")

    def undo(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(HUGEPAGES)], check=False)
        if self.made is not None:       # the directories made, emptied: rmdir, never rm -r
            path = HUGEPAGES
            while True:
                try:
                    path.rmdir()
                except OSError:
                    break
                if path == self.made:
                    break
                path = path.parent
        if self.total is not None:
            (POOL / "nr_hugepages").write_text(str(self.total))


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) and line.split()[2] == "hugetlbfs"
               for line in Path("/proc/mounts").read_text().splitlines())


class Node:
    """A Proxmox node's tree and a vstor.conf for it, under one directory."""

    def __init__(self, root: Path, qemu: str):
        self.root, self.qemu = root, qemu
        self.etc = root / "etc" / "pve"
        self.storage = root / "var" / "lib" / "vz"
        self.snippets = self.storage / "snippets"
        self.run_dir = root / "run" / "qemu-server"
        self.lock_dir = root / "lock" / "qemu-server"
        self.vhost_dir, self.qsd_dir = root / "vhost", root / "qsd"
        self.state_dir = root / "state"
        self.conf = root / "vstor.conf"
        self.vm_conf = self.etc / "qemu-server" / f"{VMID}.conf"
        self.intent = self.snippets / f"vstor-{VMID}.xml"
        self.hookscript = self.snippets / "vstor"
        self.qemus: list[subprocess.Popen] = []
        self.hugepages = Hugepages()
        for d in (self.etc / "qemu-server", self.snippets, self.run_dir, self.lock_dir):
            d.mkdir(parents=True)
        (self.etc / "storage.cfg").write_text(
            f"dir: local\n\tpath {self.storage}\n\tcontent iso,vztmpl,backup,snippets\n\n"
            f"lvmthin: local-lvm\n\tthinpool data\n\tvgname pve\n\tcontent rootdir,images\n")
        # QEMU runs as root under Proxmox; [pve] qemu is the QEMU started here.
        self.conf.write_text(
            f"[paths]\nstate_dir = {self.state_dir}\nvhost_dir = {self.vhost_dir}\n"
            f"qsd_dir = {self.qsd_dir}\nimages = {root}\n"
            "[qemu]\nuser = root\ngroup = root\n"
            f"[pve]\netc = {self.etc}\nrun_dir = {self.run_dir}\nlock_dir = {self.lock_dir}\n"
            f"qemu = {qemu}\n")

    def vstor(self, *args: str, code: int = 0) -> str:
        out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(self.conf),
                              *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == code, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        return out.stdout

    def hook(self, phase: str) -> subprocess.CompletedProcess:
        """The hookscript as qemu-server runs it on a normal start or stop."""
        env = dict(os.environ, PVE_MIGRATED_FROM="")
        env.pop("VSTOR_CONFIG", None)
        return subprocess.run([str(self.hookscript), str(VMID), phase], capture_output=True,
                              text=True, env=env, cwd="/", timeout=120)

    def read_vm(self) -> PveConfig:
        return PveConfig.parse(self.vm_conf.read_text())

    def write_vm(self, conf: PveConfig) -> None:
        self.vm_conf.write_text(conf.to_text())

    def disk(self, target: str) -> Path:
        return self.root / f"{target}.raw"

    def record(self) -> Path:
        return self.state_dir / "domains" / f"{NAME}.json"

    def daemons(self) -> list[int]:
        """The qemu-storage-daemons serving this tree's disks."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (os.path.basename(argv[0]) == b"qemu-storage-daemon"
                    and any(str(self.root).encode() in a for a in argv)):
                out.append(int(entry.name))
        return out

    def leftovers(self) -> list[str]:
        """What vstor holds for the VM: sockets, daemon files, the state
        record, daemons (qsd_dir's own lock file is not the VM's)."""
        out = [str(p) for d in (self.vhost_dir, self.qsd_dir) if d.exists()
               for p in d.iterdir() if p.name != ".lock"]
        out += [str(self.record())] if self.record().exists() else []
        return out + [f"qemu-storage-daemon pid {pid}" for pid in self.daemons()]

    def teardown(self) -> None:
        """QEMU first (it holds the sockets and the hugepages), then vstor's
        release, then any daemon still serving this tree."""
        for proc in self.qemus:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if self.hookscript.exists() and self.record().exists():
            self.hook("post-stop")
        if self.record().exists():
            subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(self.conf),
                            "release", "--force", NAME], capture_output=True, cwd=ROOT, timeout=120)
        for pid in self.daemons():
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self.daemons() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.daemons():
            os.kill(pid, signal.SIGKILL)


def _qemu_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    assert m, out
    return f"{m.group(1)}.{m.group(2)}"


@pytest.fixture
def node():
    qemu = shutil.which("qemu-system-x86_64")
    if not shutil.which("taskset"):
        unavailable("taskset (util-linux) is not installed")
    root = Path(tempfile.mkdtemp(prefix="vstor-pve-", dir="/tmp"))
    root.chmod(0o755)           # mkdtemp gives 0700
    n = Node(root, qemu)
    try:
        yield n
    finally:
        try:
            n.teardown()
        finally:
            n.hugepages.undo()          # after QEMU is gone: it held the pages
            shutil.rmtree(root, ignore_errors=True)


def configured(node: Node, shape: Shape) -> PveConfig:
    """The VM and its intent written, vstor pve apply and hooks install run,
    the hookscript set as `qm set 100 --hookscript local:snippets/vstor` does."""
    for target in shape.disks:
        with open(node.disk(target), "wb") as f:
            f.truncate(DISK_BYTES)
    disks = "".join(f'\n  <vstor:disk target="{t}"><vstor:file path="{node.disk(t)}"/></vstor:disk>'
                    for t in shape.disks)
    if shape.housekeeping is not None:
        with node.conf.open("a") as f:
            f.write(f"[cpu]\nhousekeeping = {shape.housekeeping}\n")
    node.intent.write_text(f'<vstor:vstor xmlns:vstor="https://vstor.dev/xmlns/domain/1">\n'
                           f'  {shape.vm}{disks}\n</vstor:vstor>\n')
    before = vm_config(shape)
    node.vm_conf.write_text(before)
    out = node.vstor("pve", "apply", str(VMID), "--qemu-version", _qemu_version(node.qemu))
    assert f"qm set {VMID} --hookscript local:snippets/vstor" in out, out
    out = node.vstor("pve", "hooks", "install")
    assert f"Installed {node.hookscript}" in out, out
    assert os.access(node.hookscript, os.X_OK)
    conf = node.read_vm()
    conf.set("hookscript", "local:snippets/vstor")
    node.write_vm(conf)
    old = PveConfig.parse(before)
    # vstor's keys written, the user's kept: description, keys, snapshot, own args.
    assert conf.description() == old.description()
    assert {k: old.get(k) for k in old.keys() if k != "args"} == \
        {k: conf.get(k) for k in old.keys() if k != "args"}
    assert conf.sections[1:] == old.sections[1:]
    assert conf.get("args").startswith(USER_ARGS + " -chardev socket,id=vstor-")
    # The plan recorded in the snippets storage, next to the intent.
    assert any("<vstor:plan " in p.read_text() for p in node.snippets.glob(f"vstor-{VMID}*.xml"))
    return conf


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
def test_a_proxmox_vm_configured_by_vstor_boots_and_writes_through_its_disks(node, shape, guest_image,
                                                                              request):
    """apply writes numa0, hugepages, affinity and the vhost-user pairs;
    pre-start makes one socket per disk; QEMU started from the config as
    qemu-server would reaches the guest's writes into the backing files;
    post-stop leaves nothing."""
    conf = configured(node, shape)
    assert conf.get("numa") == "1" and conf.get("hugepages") == "2"
    if shape.cells == 1:
        vcpus = "0" if shape.cores == 1 else f"0-{shape.cores - 1}"
        assert conf.get("numa0") == f"cpus={vcpus},hostnodes=0,memory={MEMORY_MIB},policy={shape.policy}"
    else:
        mib = MEMORY_MIB // shape.cells
        assert [conf.get(f"numa{k}") for k in range(shape.cells)] == \
            [f"cpus={k},hostnodes=0,memory={mib},policy={shape.policy}" for k in range(shape.cells)]
    assert conf.get("affinity") == shape.written
    sockets = [node.vhost_dir / f"{NAME}-{t}" for t in shape.disks]
    start = qemu_server_argv(node)
    args = start["args"]
    assert args[:2] == USER_ARGS.split()
    assert [a.split(",")[2] for a in args if a.startswith("socket,id=vstor-")] == \
        [f"path={s}" for s in sockets]

    pre = node.hook("pre-start")
    assert pre.returncode == 0, pre.stderr
    assert all(s.is_socket() for s in sockets), os.listdir(node.vhost_dir)
    status = json.loads(node.vstor("status", "--json", NAME))
    assert status[0]["status"] == "prepared"
    node.hugepages.provide(MEMORY_MIB)

    seed = int.from_bytes(os.urandom(3), "big")
    console = node.root / "console.log"
    devs = ",".join(f"vd{chr(ord('a') + i)}" for i in range(len(shape.disks)))     # PCI order
    cmdline = ("console=ttyS0 panic=-1 quiet printk.devkmsg=on "
               + job("write-verify", dev=devs, seed=seed, size=SIZE))
    argv = start["prefix"] + [
        node.qemu, "-machine", f"{shape.machine},accel=tcg",
        "-nodefaults", "-display", "none", "-no-reboot",
        "-kernel", str(guest_image.kernel), "-initrd", str(guest_image.initrd), "-append", cmdline,
        "-serial", f"file:{console}", "-pidfile", str(node.run_dir / f"{VMID}.pid"),
        # The test's own: QEMU names each thread ("CPU 1/TCG"), apart from
        # the monitor vstor asks which is which.
        "-name", f"vm{VMID},debug-threads=on",
    ] + start["monitor"] + start["options"] + args
    assert start["prefix"] == ["/usr/bin/taskset", "--cpu-list", "--all-tasks", shape.written]
    assert "mem-path=/run/hugepages/kvm/2048kB,share=on,prealloc=yes" in " ".join(argv)
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node.qemus.append(proc)
    running_as_qemu_server_sees_it(node, proc, shape)
    pinned_at_post_start(node, proc, shape)
    try:
        output, _ = proc.communicate(timeout=BOOT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the guest did not power off in {BOOT_TIMEOUT}s; console:\n"
                    f"{read_console(console)[-3000:]}\nQEMU: {output[-2000:]}")
    elapsed = time.monotonic() - started
    request.node.user_properties.append(("boot_and_io_seconds", round(elapsed, 1)))
    print(f"{shape.id}: QEMU start to exit {elapsed:.1f}s")

    log = read_console(console)
    assert proc.returncode == 0, f"QEMU exited {proc.returncode}: {output[-2000:]}\n{log[-2000:]}"
    result = parse_console(log)
    assert result["done"] and not result["fail"], log[-3000:]
    want = expected_pattern(seed, SIZE)
    digest = hashlib.sha256(want).hexdigest()
    assert result["devices"] == {d: {"wrote": digest, "read": digest} for d in devs.split(",")}
    for target in shape.disks:
        with open(node.disk(target), "rb") as f:
            assert f.read(SIZE) == want, f"{target}'s backing file lacks the guest's writes"

    post = node.hook("post-stop")
    assert post.returncode == 0, post.stderr
    assert node.leftovers() == []
    assert "vstor holds nothing on this host" in node.vstor("status")


def qemu_server_argv(node: Node) -> dict[str, list[str]]:
    """What Proxmox's real qemu-server makes of the VM's config (the oracle,
    as `qm showcmd` prints it), in the parts a QEMU under TCG without
    Proxmox's files can run: `prefix` (taskset for `affinity`), `options`
    (-smp, -m, the memory-backend objects, -numa nodes) and `args` (the
    config's `args`, which qemu-server appends after -machine, last)."""
    start = oracle.showcmd(node.vm_conf.read_text(), qemu=_qemu_version(node.qemu), vmid=VMID)
    assert start.code == 0, f"qemu-server refused the config vstor wrote: {start.err}"
    argv = start.argv
    kvm, machine = argv.index("/usr/bin/kvm"), argv.index("-machine")
    options, monitor = [], []
    for option, value in zip(argv[kvm + 1:machine], argv[kvm + 2:machine]):
        if option in ("-smp", "-m", "-numa") or (option == "-object" and value.startswith("memory-backend-")):
            options += [option, value]
        elif value.startswith("socket,id=qmp,") or value == "chardev=qmp,mode=control":
            # qemu-server's own monitor, in this tree's run directory.
            monitor += [option, value.replace("/var/run/qemu-server", str(node.run_dir))]
    assert len(monitor) == 4, argv
    return {"prefix": argv[:kvm], "options": options, "monitor": monitor, "args": argv[machine + 2:]}


def allowed_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of the process."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:       # a thread that just ended
            continue
        out.add(status.split("Cpus_allowed_list:")[1].split()[0])
    return out


def threads_by_name(pid: int) -> dict[str, set[str]]:
    """QEMU's thread names ("CPU 0/TCG", "IO mon_iothread", ...) -> the
    Cpus_allowed_list of the threads of that name."""
    out: dict[str, set[str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except FileNotFoundError:       # a thread that just ended
            continue
        out.setdefault(name, set()).add(status.split("Cpus_allowed_list:")[1].split()[0])
    return out


def pinned_at_post_start(node: Node, proc: subprocess.Popen, shape: Shape) -> None:
    """qemu-server runs post-start once QEMU runs: each vCPU thread ends on
    its planned cores, every other thread on the emulator's; the pinning is
    vstor status's to check."""
    post = node.hook("post-start")
    assert post.returncode == 0, post.stderr
    threads = threads_by_name(proc.pid)
    assert {n: threads[n] for n in threads if n.startswith("CPU ")} == \
        {f"CPU {i}/TCG": {c} for i, c in enumerate(shape.vcpu_cores)}, threads
    assert set().union(*(v for n, v in threads.items() if not n.startswith("CPU "))) == \
        {shape.emulator}, threads
    status = node.vstor("status", NAME)
    assert "pinned by vstor at post-start: " in status and "PROBLEM" not in status, status


def running_as_qemu_server_sees_it(node: Node, proc: subprocess.Popen, shape: Shape) -> None:
    """Once QEMU wrote its pid file: every thread runs on `affinity`'s cores
    (taskset --all-tasks), and vstor sees the VM running (qemu-server's own
    test), so apply refuses to change the config under it."""
    pidfile = node.run_dir / f"{VMID}.pid"
    deadline = time.monotonic() + 60
    while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pidfile.exists() and proc.poll() is None, "QEMU did not start"
    assert int(pidfile.read_text()) == proc.pid
    assert allowed_cpus(proc.pid) == {shape.affinity}
    out = node.vstor("pve", "apply", str(VMID), "--qemu-version", _qemu_version(node.qemu), code=3)
    assert out == ""


EDITS = {
    # What a Proxmox user with VM.Config.CPU / VM.Config.Memory (not root)
    # may change in the GUI or with qm set.
    "numa0-memory": lambda c: c.set("numa0", c.get("numa0").replace(f"memory={MEMORY_MIB}",
                                                                    f"memory={MEMORY_MIB // 2}")),
    "cores": lambda c: c.set("cores", "1"),
    "memory": lambda c: c.set("memory", str(MEMORY_MIB * 2)),
    "hugepages-off": lambda c: c.delete("hugepages"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_pre_start_refuses_a_config_edited_since_apply(node, edit):
    """A config changed after `vstor pve apply` no longer carries the plan:
    pre-start aborts the start with one line naming the fix, and makes
    nothing on the host."""
    conf = configured(node, SHAPES[0])
    EDITS[edit](conf)
    node.write_vm(conf)
    pre = node.hook("pre-start")
    assert pre.returncode == 2, pre.stdout + pre.stderr
    lines = pre.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vstor:"), pre.stderr
    assert f"vstor pve apply {VMID}" in lines[0], lines[0]
    assert node.leftovers() == []
