"""What the test modules share: a test module imports from here, never
from another test module.  The fixtures of one family of tests (work,
hosts, two, dest) are here too, imported by the modules that use them;
the fixtures any test may use are in tests/conftest.py."""

import glob
import json
import os
import shlex
import time
import pathlib
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

import pytest
from lxml import etree

from vstor.cli.main import main
from vstor.config import Config
from vstor.errors import ActionFailed, DoesNotFit
from vstor.meta import metadata
from vstor.meta.document import Domain, load_disk
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.render.libvirt import render
from vstor.runtime.journal import Journal
from vstor.runtime.lifecycle import prepare
from tests import installed_hook
from tests.doubles.kernel_sysfs import KernelSysfsDouble
from tests.doubles.spdk_target import Fabric, SpdkTargetDouble
from tests.hostlayout import build_tree

NS = "https://vstor.dev/xmlns/domain/1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Data of other projects, never copied into the checkout: ../shared next to it, where CI puts it.
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def unavailable(reason: str) -> None:
    """A test that cannot run here is skipped saying why, except in CI
    (CI=true), where a missing piece must not pass as green: it fails."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


# -- planner requests (tests/test_planner.py and the cells, host and migration tests) ----------

def request(disks: str, vm: str = "", name="vm1", vcpus=4, memory_mib=8192, machine="q35") -> Request:
    return Request.from_domain(Domain.parse(f"""
      <domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>
      <vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'>{vm}{disks}</vstor:vstor></metadata>
      <os><type arch='x86_64' machine='{machine}'>hvm</type></os><devices/></domain>"""))


def nvme(addr, target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return f"<vstor:disk target='{target}' {a}><vstor:nvme controller='{addr}'/></vstor:disk>"


def nvmf(target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return (f"<vstor:disk target='{target}' {a}><vstor:nvmf transport='rdma' traddr='192.168.100.8' "
            "subnqn='nqn.2016-06.io.spdk:cnode1'><vstor:path traddr='192.168.101.8'/></vstor:nvmf></vstor:disk>")


def qsd_file(path="/var/lib/vstor/images/a.raw", target="vdb", **attrs):
    a = " ".join(f"{k}='{v}'" for k, v in attrs.items())
    return f"<vstor:disk target='{target}' {a}><vstor:file path='{path}'/></vstor:disk>"


def request_xml(disks, vm="", name="vm1", vcpus=4, memory_mib=8192, machine="q35") -> str:
    return (f"<domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>"
            f"<vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>"
            f"{vm}{disks}</vstor:vstor></metadata><os><type arch='x86_64' machine='{machine}'>hvm</type>"
            "</os><devices/></domain>")


SPDK_CFG = Config(reactors=(2, 18))


def refused(host, cfg, req, ledger=Ledger()) -> str:
    with pytest.raises(DoesNotFit) as e:
        plan_domain(host, cfg, req, ledger)
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    return str(e.value)


# -- a Proxmox node in a temporary directory (tests/test_pve*.py, test_logging, test_planning_lock) --

CONF = """# web server
#  notes: %C3%A9t%C3%A9
boot: order=scsi0
cores: 2
memory: 1024
name: web1
args: -msg timestamp=on -set 'device.x.y=a b'
net0: virtio=BC:24:11:00:00:01,bridge=vmbr0
ostype: l26
scsi0: local-lvm:vm-100-disk-0,size=8G
smbios1: uuid=6ad6b5f0-3b36-4a8e-9e1c-1f0d2d5e8c11
hostpci0: 0000:17:00.0

[PENDING]
memory: 2048

[before-upgrade]
cores: 1
memory: 1024
numa: 0
snaptime: 1700000000
"""


class Pve:
    def __init__(self, root, host_root=None):
        self.root = str(root)
        self.etc = f"{root}/etc/pve"
        self.snippets = f"{root}/vz/snippets"
        for d in (f"{self.etc}/qemu-server", self.snippets, f"{root}/run", f"{root}/lock",
                  f"{self.etc}/nodes/other/qemu-server"):
            os.makedirs(d, exist_ok=True)
        with open(f"{self.etc}/storage.cfg", "w") as f:
            f.write(f"dir: local\n\tpath {root}/vz\n\tcontent iso,vztmpl,backup,snippets\n\n"
                    "lvmthin: local-lvm\n\tthinpool data\n\tvgname pve\n\tcontent rootdir,images\n")
        self.conf = f"{root}/vstor.conf"
        self.write_config()
        self.host_root = host_root
        os.chmod(self.root, 0o755)

    def write_config(self, extra: str = "") -> None:
        r = self.root
        with open(self.conf, "w") as f:
            f.write(f"[paths]\nstate_dir = {r}/state\nvhost_dir = {r}/vhost\nqsd_dir = {r}/qsd\n"
                    f"images = {r}\n[qemu]\nuser = root\ngroup = root\n[cpu]\nreactors = 2,18\n"
                    # No supervisor outliving a test (tests/test_supervise.py is its own).
                    f"[vhost]\nsupervise = no\n"
                    f"[pve]\netc = {self.etc}\nrun_dir = {r}/run\nlock_dir = {r}/lock\n{extra}")

    def vm(self, text: str = CONF, vmid: int = 100) -> str:
        path = f"{self.etc}/qemu-server/{vmid}.conf"
        with open(path, "w") as f:
            f.write(text)
        return path

    def intent(self, body: str, vmid: int = 100, vm: str = "<vstor:vm cpus='shared'/>") -> str:
        path = f"{self.snippets}/vstor-{vmid}.xml"
        with open(path, "w") as f:
            f.write(f"<vstor:vstor xmlns:vstor='{NS}'>\n  <!-- kept -->\n  {vm}\n  {body}\n</vstor:vstor>\n")
        return path

    def file_disk(self, name: str = "d0.raw") -> str:
        path = f"{self.root}/{name}"
        with open(path, "wb") as f:
            f.truncate(16 << 20)
        return f"<vstor:disk target='vdb'><vstor:file path='{path}'/></vstor:disk>"

    def vstor(self, *args) -> int:
        host = ["--host-root", self.host_root] if self.host_root else []
        return main(["--config", self.conf, *host, *args])

    def config(self, vmid: int = 100) -> str:
        return open(f"{self.etc}/qemu-server/{vmid}.conf").read()

    def hook(self, vmid: int, phase: str, env=None) -> subprocess.CompletedProcess:
        script = f"{self.snippets}/vstor"
        if not os.path.exists(script):
            assert self.vstor("pve", "hooks", "install") == 0
        run_env = {**os.environ, "PVE_MIGRATED_FROM": "", **(env or {})}
        if self.host_root:
            run_env["VSTOR_HOST_ROOT"] = self.host_root
        return subprocess.run([script, str(vmid), phase], capture_output=True, text=True,
                              env=run_env, timeout=120)


PCI = ("0000:17:00.0", "0000:3b:00.0", "0000:5e:00.0", "0000:5f:00.0", "0000:60:00.0", "0000:61:00.0")


def judge(pve, text: str, mib: int = 1024, user_vfio=(), vmid: int = 100, qemu: str = "9.2"):
    """Proxmox's own qemu-server, run on the config vstor wrote, agrees with
    the plan vstor recorded on every line."""
    from tests.pve.oracle import agrees_with_plan, showcmd    # the oracle imports this module
    plan = etree.parse(f"{pve.snippets}/vstor-{vmid}.plan.xml").getroot()
    agrees_with_plan(showcmd(text, PCI, qemu, vmid), plan, mib, user_vfio)


def running_qemu(pve, vmid=100):
    """A process qemu-server's check takes for the VM's QEMU."""
    pidfile = f"{pve.root}/run/{vmid}.pid"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-pidfile", pidfile])
    with open(pidfile, "w") as f:
        f.write(str(proc.pid))
    return proc


def pve_applied(pve, conf=CONF, vmid=100):
    pve.vm(conf, vmid)
    pve.intent(pve.file_disk(f"d{vmid}.raw").replace("d0.raw", f"d{vmid}.raw"), vmid)
    assert pve.vstor("pve", "apply", str(vmid), "--qemu-version",
                     ".".join(map(str, local_qemu()))) == 0
    text = pve.config(vmid).replace("boot:", "hookscript: local:snippets/vstor\nboot:", 1)
    pve.vm(text, vmid)
    return text


def local_qemu():
    from vstor.config import Config
    from vstor.pve.node import Node
    return Node(Config()).qemu_version()


def pve_left(pve) -> list[str]:
    return sorted(glob.glob(f"{pve.root}/vhost/*") + glob.glob(f"{pve.root}/qsd/*")
                  + glob.glob(f"{pve.root}/state/*.json"))


needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons (needs root)")


# -- the journal over test steps that touch files (tests/test_journal.py, test_logging) ------------

class TouchFile:
    """A test step that makes a real host change: a file; it can fail on do or undo."""
    kind = "test-touch"

    def __init__(self, data):
        self.data = data

    def describe(self):
        return f"touch {os.path.basename(self.data['path'])}"

    def do(self, rt):
        with open(self.data["path"], "w") as f:
            f.write("x")
        if self.data.get("fail_do"):
            raise OSError(5, "injected I/O error")

    def undo(self, rt):
        if self.data.get("fail_undo") and not os.path.exists(self.data["path"] + ".allow"):
            raise OSError(16, "injected busy")
        if os.path.exists(self.data["path"]):
            os.unlink(self.data["path"])

    def to_json(self, state):
        return {"kind": self.kind, "state": state, "data": self.data}


class Executor:
    """The journal's executor interface, for TouchFile steps."""
    encode = staticmethod(lambda step, state: step.to_json(state))
    decode = staticmethod(lambda entry: TouchFile(entry["data"]))
    do = staticmethod(lambda step, rt: step.do(rt))
    undo = staticmethod(lambda step, rt, others: step.undo(rt))


def J(state, rec, rt, progress=None):
    return Journal(state, rec, rt, progress, executor=Executor)


def steps(tmp_path, n, flags=None):
    flags = flags or {}
    return [TouchFile({"path": str(tmp_path / f"f{i}"), **flags.get(i, {})}) for i in range(n)]


# -- journald's native protocol on a socket of the test's own (test_logging, test_hooks_uninstall) --

def parse(datagram: bytes) -> dict[str, str]:
    """One entry of the native protocol, read as journald reads it."""
    out, i = {}, 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            i = nl + 1
        else:       # KEY\n<u64 le length><value>\n
            key = line
            (n,) = struct.unpack("<Q", datagram[nl + 1:nl + 9])
            value = datagram[nl + 9:nl + 9 + n]
            assert datagram[nl + 9 + n:nl + 10 + n] == b"\n"
            i = nl + 10 + n
        assert key.isupper() or key.replace(b"_", b"").isalnum(), key
        out[key.decode()] = value.decode()
    return out


class FakeJournal:
    """A datagram socket where journald's would be."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def entries(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(parse(self.sock.recv(1 << 16)))
            except BlockingIOError:
                return out


# -- a child process as nobody (test_host, test_qsd, test_nova_driver) ---------------------------------

def as_nobody(fn):
    """fn() in a child running as nobody: ('ok', value) or (exception type name, message)."""
    import json
    r, w = os.pipe()
    child = os.fork()
    if child == 0:      # pragma: no cover (the child)
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = ["ok", repr(fn())]
        except BaseException as e:      # noqa: BLE001
            out = [type(e).__name__, str(e)]
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(child, 0)
    return tuple(json.loads(data))


# -- the CLI on a config of the test's own (test_nova, test_nova_placement) -----------------------------

def conf_file(tmp_path, text=""):
    path = tmp_path / "vstor.conf"
    path.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n{text}")
    return str(path)


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- libvirt as the judge: its schema and its test driver (test_libvirt_accepts, test_cells) ----------

def accepted(conn, xml: str, tmp_path) -> etree._Element:
    """The domain as libvirt parsed it, after virt-xml-validate and the test
    driver's define accepted `xml`; defined for the caller, who undefines."""
    import libvirt
    path = tmp_path / "domain.xml"
    path.write_text(xml)
    if not shutil.which("virt-xml-validate"):
        unavailable("virt-xml-validate is not installed (libvirt-clients): libvirt's schema is the judge")
    valid = subprocess.run(["virt-xml-validate", str(path), "domain"], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    try:
        dom = conn.defineXML(xml)
    except libvirt.libvirtError as e:
        pytest.fail(f"libvirt refuses the domain: {e}")
    return etree.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))


# -- the guest-kit's template as libvirt defines it (test_guestkit, e2e/test_guestkit) ----------------

TEMPLATES = os.path.join(ROOT, "xml-templates")

# What libvirt adds to the rendered template when it defines it: root ports
# in slot 1, the disk on pci.2, the hostdev on pci.3 (00:01.2).
MULTIFUNCTION = " multifunction='on'"
LIBVIRT_CONTROLLERS = "".join(
    f"<controller type='pci' index='{i}' model='pcie-root-port'><model name='pcie-root-port'/>"
    f"<target chassis='{i}' port='0x{7 + i:x}'/><address type='pci' domain='0x0000' bus='0x00' "
    f"slot='0x01' function='0x{i - 1:x}'{MULTIFUNCTION if i == 1 else ''}/></controller>"
    for i in range(1, 6))
LIBVIRT_ADDRESS = {"vda": "0x02", "hostdev": "0x03"}


def planned(host, path=os.path.join(TEMPLATES, "passthrough-guest-spdk.xml"), edit=None) -> Domain:
    """The template (or `path`), edited, planned on `host` and rendered."""
    dom = Domain.load(path)
    if edit:
        edit(dom.root)
    return render(dom, plan_domain(host, SPDK_CFG, Request.from_domain(dom), Ledger()))


def addressed(dom: Domain) -> Domain:
    """The rendered domain as libvirt defines it (see LIBVIRT_CONTROLLERS)."""
    root = etree.fromstring(dom.to_string())
    devices = root.find("devices")
    devices.append(etree.fromstring("<controller type='pci' index='0' model='pcie-root'/>"))
    for c in etree.fromstring(f"<x>{LIBVIRT_CONTROLLERS}</x>"):
        devices.append(c)
    for e, bus in ((devices.find("disk"), LIBVIRT_ADDRESS["vda"]),
                   *((hd, LIBVIRT_ADDRESS["hostdev"]) for hd in devices.findall("hostdev"))):
        etree.SubElement(e, "address", type="pci", domain="0x0000", bus=bus, slot="0x00", function="0x0")
    return Domain(root, dom.origin)


# -- a two-socket host with the SPDK double (the env fixture's; test_lifecycle, test_hotplug, test_source_race) --

LOCAL = "0000:5f:00.0"


def rendered_domain(e, disks: str, name="vm1", vm="", vcpus=2, memory_mib=1024, ledger=None,
                    gate: str | None = None) -> Domain:
    dom = Domain.parse(f"""<domain type='kvm'><name>{name}</name><memory unit='MiB'>{memory_mib}</memory>
      <vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'>{vm}{disks}</vstor:vstor></metadata>
      <os><type arch='x86_64' machine='q35'>hvm</type></os><devices/></domain>""")
    plan = plan_domain(e.host(), e.cfg, Request.from_domain(dom), ledger or Ledger())
    return render(dom, plan, gate=gate)


def local_spdk(addr=LOCAL, target="vdb"):
    return f"<vstor:disk target='{target}' backend='spdk'><vstor:nvme controller='{addr}'/></vstor:disk>"


def spdk_nvmf(nsid=1, target="vdb"):
    return (f"<vstor:disk target='{target}' backend='spdk'><vstor:nvmf transport='rdma' traddr='192.168.100.8' "
            f"subnqn='nqn.2016-06.io.spdk:cnode1' namespace='{nsid}' hostnqn='nqn.2014-08.org.nvmexpress:uuid:1'>"
            "<vstor:path traddr='192.168.101.8'/><vstor:reconnect ctrlr_loss_timeout='90'/></vstor:nvmf></vstor:disk>")


def file_disk(path: str, target: str = "vdb") -> str:
    return f"<vstor:disk target='{target}'><vstor:file path='{path}'/></vstor:disk>"


def file_disks(e, targets: str, prefix: str = "d", size: int = 16 << 20) -> tuple[str, list[str]]:
    """Image files (prefix0.raw, ...) and a file disk on each, vd<t> for t in targets."""
    paths = []
    for i in range(len(targets)):
        paths.append(os.path.join(e.work, f"{prefix}{i}.raw"))
        with open(paths[-1], "wb") as f:
            f.truncate(size)
    return "".join(file_disk(p, f"vd{t}") for p, t in zip(paths, targets)), paths


def flock_free(path: str) -> bool:
    """Whether another open of `path` could take its flock now (this
    process's own hold conflicts too: flock is per open file description)."""
    import fcntl
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# -- a running guest as libvirt would show it, for hot-plug (test_hotplug, test_source_race) -------------

class GuestDouble:
    """A test double of vstor.runtime.virt.LiveDomain: it records what
    libvirt would be asked, and refuses the device when told to."""

    def __init__(self, dom: Domain, refuse: str | None = None, plan="same", ports: int = 4):
        self.dom, self.refuse = with_ports(dom, ports), refuse
        self.calls: list[tuple] = []
        self.present: set[str] = {d.target for d in dom.recorded_plan().disks}
        self.saved = dom.recorded_plan() if plan == "same" else plan

    def persistent_plan(self):
        return self.saved

    def current(self):
        return live(self.dom, self)

    def attach(self, device, element, persistent=False):
        self.calls.append(("attach", device, element, persistent))
        if self.refuse:
            raise ActionFailed(f"libvirt refused to attach the device: {self.refuse}")
        self.present.add(Domain.parse(f"<domain>{device}</domain>").root.find(".//target").get("dev"))

    def set_metadata(self, element, persistent=False):
        self.calls.append(("set_metadata", element, persistent))

    def device(self, disk):
        return f"<disk><target dev='{disk.target}'/></disk>" if disk.target in self.present else None

    def detach(self, device, timeout, persistent=False):
        self.calls.append(("detach", device, timeout, persistent))
        if self.refuse:
            raise ActionFailed(f"the guest did not let go within {timeout:g}s; nothing was released")
        self.present.discard(Domain.parse(f"<domain>{device}</domain>").root.find(".//target").get("dev"))

    def detach_config(self, disk):
        self.calls.append(("detach_config", disk.target))


def with_ports(dom: Domain, ports: int) -> Domain:
    """A q35 domain as libvirt shows it running: each vstor disk on a root
    port of its own, a USB controller and a balloon (model none here), and
    `ports` empty root ports, as an operator gives a guest that takes disks
    live (libvirt adds none spare)."""
    if "q35" not in dom.root.find("os/type").get("machine", ""):
        return dom
    from lxml import etree
    root = Domain.parse(dom.to_string()).root
    devices = root.find("devices")
    placed = [e for e in devices if e.tag in ("disk", "hostdev") and e.find("address") is None]
    for index in range(1, len(placed) + ports + 1):
        devices.append(etree.Element("controller", type="pci", index=str(index), model="pcie-root-port"))
        if index <= len(placed):
            etree.SubElement(placed[index - 1], "address", type="pci", domain="0x0000", bus=f"0x{index:02x}",
                             slot="0x00", function="0x0")
    etree.SubElement(devices, "controller", type="usb", model="none")
    etree.SubElement(devices, "memballoon", model="none")
    return Domain(root)


def disk(text: str, tmp_path):
    path = tmp_path / "disk.xml"
    path.write_text(text.replace("<vstor:disk ", f"<vstor:disk xmlns:vstor='{NS}' ", 1))
    return load_disk(str(path))


def live(dom: Domain, guest: GuestDouble) -> Domain:
    """The domain as libvirt would show it after the guest double's last
    metadata: libvirt puts the element (sent without a namespace, as its
    setMetadata wants it) into vstor's namespace."""
    elements = [c[2] if c[0] == "attach" else c[1] for c in guest.calls
                if c[0] in ("attach", "set_metadata")]
    if not elements:
        return dom
    from lxml import etree
    sent = etree.fromstring(elements[-1])
    assert all(etree.QName(e).namespace is None for e in sent.iter(etree.Element))
    for e in sent.iter(etree.Element):
        e.tag = f"{{{NS}}}{e.tag}"
    root = Domain.parse(dom.to_string()).root
    root.find("metadata").replace(metadata.find(root), sent)
    return Domain(root)


def running(env, disks: str, **kw) -> Domain:
    dom = rendered_domain(env, disks, **kw)
    prepare(env.rt(), env.state, env.host(), dom)
    return dom


# -- a two-socket host, a config and the hook, for the contract and source-race tests ---------------------

@pytest.fixture(name="work")
def contract_work():
    """A two-socket host tree and a config in a short-pathed directory."""
    d = tempfile.mkdtemp(prefix="vs-ct-", dir="/tmp")
    os.chmod(d, 0o755)
    host = build_tree(os.path.join(ROOT, "tests", "hosts", "two-socket.toml"), os.path.join(d, "host"))
    conf = os.path.join(d, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {d}/state\nvhost_dir = {d}/vhost\nqsd_dir = {d}/qsd\nimages = {d} /var/lib/vstor/images\n"
                "[cpu]\nreactors = 2,18\n")
    w = type("W", (), {"dir": d, "host": host, "conf": conf})
    yield w
    main(["--config", conf, "--host-root", host, "release", "--force", "ct1"])
    shutil.rmtree(d, ignore_errors=True)


def contract_vstor(w, *args) -> int:
    return main(["-c", "test:///default", "--config", w.conf, "--host-root", w.host, *args])


def contract_domain_xml(w, disk: str, name="ct1") -> str:
    path = os.path.join(w.dir, f"{name}.xml")
    with open(path, "w") as f:
        f.write(f"""<domain type='kvm'><name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>
          <metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm cpus='shared'/>{disk}</vstor:vstor>
          </metadata><os><type arch='x86_64' machine='q35'>hvm</type></os><devices/></domain>""")
    return path


def contract_rendered(w, disk: str, name="ct1") -> str:
    out = os.path.join(w.dir, f"{name}-rendered.xml")
    assert contract_vstor(w, "render", contract_domain_xml(w, disk, name), "-o", out) == 0
    return out


def contract_hook(w, op: str, xml_path: str, name="ct1", timeout=None):
    with open(xml_path, "rb") as f:
        xml = f.read()
    env = {**os.environ, "PYTHONPATH": ROOT, "VSTOR_CONFIG": w.conf, "VSTOR_HOST_ROOT": w.host}
    sub = "begin" if op == "prepare" else "end"
    return subprocess.run([installed_hook(), name, op, sub, "-"], input=xml,
                          capture_output=True, env=env, timeout=timeout)


# -- a domain on two file disks, for the CLI (test_runtime_cli, test_json) -----------------------------

@pytest.fixture(name="work")
def cli_work():
    """A config, two image files and a domain cli1 on them, in libvirt's test driver."""
    d = tempfile.mkdtemp(prefix="vs-cli-", dir="/tmp")
    os.chmod(d, 0o755)
    conf = os.path.join(d, "vstor.conf")
    with open(conf, "w") as f:
        # No supervisor: these tests kill a daemon to see how a dead one is
        # reported (tests/test_supervise.py: the supervisor's own tests).
        f.write(f"[paths]\nstate_dir = {d}/state\nvhost_dir = {d}/vhost\nqsd_dir = {d}/qsd\nimages = {d}\n"
                "[vhost]\nsupervise = no\n")
    for i in (0, 1):
        with open(os.path.join(d, f"d{i}.raw"), "wb") as f:
            f.truncate(16 << 20)
    xml = os.path.join(d, "vm.xml")
    with open(xml, "w") as f:
        f.write(f"""<domain type='kvm'><name>cli1</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>
          <metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm cpus='shared'/>
          <vstor:disk target='vdb'><vstor:file path='{d}/d0.raw'/></vstor:disk>
          <vstor:disk target='vdc' readonly='yes'><vstor:file path='{d}/d1.raw'/></vstor:disk>
          </vstor:vstor></metadata><devices/></domain>""")
    import libvirt
    conn = libvirt.open("test:///default")     # keeps the test driver's state for the test
    yield type("W", (), {"dir": d, "conf": conf, "xml": xml})
    main(["-c", "test:///default", "--config", conf, "release", "--force", "cli1"])
    conn.close()
    shutil.rmtree(d, ignore_errors=True)


# -- two hosts on shared storage, for migration (test_migration, test_migrate_json) -------------------------

def migration_conf(work, h, shared, peer=None):
    text = (f"[paths]\nstate_dir = {work}/{h}/state\nvhost_dir = {work}/{h}/vhost\n"
            f"qsd_dir = {work}/{h}/qsd\nimages = {shared} {work}/{h}/local\n"
            f"[migrate]\nshared = {shared}\nlocal_peers = yes\n")
    if peer:
        text += f"peer_command = {peer}\n"
    path = f"{work}/{h}.conf"
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture
def hosts():
    work = tempfile.mkdtemp(prefix="vs-mig-", dir="/tmp")
    os.chmod(work, 0o755)
    shared = f"{work}/shared"
    for d in (shared, f"{work}/a/local", f"{work}/b/local"):
        os.makedirs(d)
    for name in ("d0.raw", "big.raw"):
        with open(f"{shared}/{name}", "wb") as f:
            f.truncate(16 << 20)
    with open(f"{work}/a/local/mine.raw", "wb") as f:
        f.truncate(16 << 20)
    a_root = build_tree(os.path.join(ROOT, "tests", "hosts", "two-socket.toml"), f"{work}/a/host")
    b_root = build_tree(os.path.join(ROOT, "tests", "hosts", "laptop.toml"), f"{work}/b/host")
    b_conf = migration_conf(work, "b", shared)
    agent = (f"unshare -m --propagation private {shlex.quote(sys.executable)} -m vstor.cli.main "
             f"-c test:///default --config {b_conf} --host-root {b_root} migrate agent")
    h = type("Hosts", (), {})()
    h.work, h.shared, h.a_root, h.b_root, h.b_conf = work, shared, a_root, b_root, b_conf
    h.a_conf = migration_conf(work, "a", shared, peer=agent)
    yield h
    for who, cfg, root in (("a", h.a_conf, a_root), ("b", b_conf, b_root)):
        d = f"{work}/{who}/state/domains"
        for name in (os.listdir(d) if os.path.isdir(d) else ()):
            main(["-c", "test:///default", "--config", cfg, "--host-root", root,
                  "release", "--force", name.removesuffix(".json")])
    shutil.rmtree(work, ignore_errors=True)


def on_a(h, *args) -> int:
    return main(["-c", "test:///default", "--config", h.a_conf, "--host-root", h.a_root, *args])


def migration_hook(h, who, name, op, sub, extra, xml: str):
    cfg, root = (h.a_conf, h.a_root) if who == "a" else (h.b_conf, h.b_root)
    env = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", ""), "VSTOR_CONFIG": cfg,
           "VSTOR_HOST_ROOT": root}
    return subprocess.run([installed_hook(), name, op, sub, extra], input=xml.encode(),
                          capture_output=True, env=env)


def running_on_a(h, name="vm", disk="shared/d0.raw", memory_mib=512) -> str:
    """The domain rendered and prepared on A, as its start would."""
    src, out = f"{h.work}/{name}.in.xml", f"{h.work}/{name}.xml"
    with open(src, "w") as f:
        f.write(f"""<domain type='kvm'><name>{name}</name><uuid>6a0c6c5e-7f55-4b4a-9d8e-0000000000{len(name):02d}</uuid>
          <memory unit='MiB'>{memory_mib}</memory><vcpu>2</vcpu><os><type arch='x86_64' machine='q35'>hvm</type></os>
          <metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm migratable='yes'/>
          <vstor:disk target='vdb'><vstor:file path='{h.work}/{disk}'/></vstor:disk></vstor:vstor></metadata>
          <devices/></domain>""")
    assert on_a(h, "render", src, "-o", out) == 0
    assert on_a(h, "prepare", out) == 0
    return out


def migration_records(h, who) -> dict:
    d = f"{h.work}/{who}/state/domains"
    out = {}
    for name in (os.listdir(d) if os.path.isdir(d) else ()):
        with open(os.path.join(d, name)) as f:
            rec = json.load(f)
        out[rec["domain"]] = rec["status"]
    return out


# -- two hosts with the SPDK double, for an NVMe disk's migration (test_migration_spdk, test_kinds, test_migrate_json) --

B_NQN = "nqn.2014-08.org.nvmexpress:uuid:5a1e0000-0000-4000-8000-0000000000b2"


@pytest.fixture
def two(monkeypatch):
    work = tempfile.mkdtemp(prefix="vs-mx-", dir="/tmp")
    os.chmod(work, 0o755)
    fabric = Fabric()
    a_spdk = SpdkTargetDouble(f"{work}/a.sock", f"{work}/a/vhost", app="spdk_tgt", fabric=fabric,
                              cores=tuple(range(64)), version="v26.09")
    a_spdk.add_pcie(LOCAL, 1)
    b_spdk = SpdkTargetDouble(f"{work}/b.sock", f"{work}/b/vhost", fabric=fabric, cores=tuple(range(64)))
    a_spdk.start(), b_spdk.start()
    a_root = build_tree(os.path.join(ROOT, "tests", "hosts", "two-socket.toml"), f"{work}/a/host")
    b_root = build_tree(os.path.join(ROOT, "tests", "hosts", "two-socket.toml"), f"{work}/b/host")
    b_conf = f"{work}/b.conf"
    with open(b_conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {work}/b/state\nvhost_dir = {work}/b/vhost\nqsd_dir = {work}/b/qsd\n"
                f"[cpu]\nreactors = 3,19\n[spdk]\nrpc_socket = {b_spdk.socket_path}\ntimeout = 5\n"
                f"[nvmf]\nhostnqn = {B_NQN}\n")
    agent = (f"unshare -m --propagation private {shlex.quote(sys.executable)} -m vstor.cli.main "
             f"-c test:///default --config {b_conf} --host-root {b_root} migrate agent")
    a_conf = f"{work}/a.conf"
    with open(a_conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {work}/a/state\nvhost_dir = {work}/a/vhost\nqsd_dir = {work}/a/qsd\n"
                f"[cpu]\nreactors = 2,18\n[spdk]\nrpc_socket = {a_spdk.socket_path}\ntimeout = 5\n"
                f"[migrate]\nexport_address = 127.0.0.1\nexport_transport = tcp\npeer_command = {agent}\n")
    # A's VFIO binding goes through the kernel sysfs double (the CLI's own
    # runtime, with the double for sysfs).
    sysfs = KernelSysfsDouble(a_root)
    from vstor.runtime.context import HostContext
    from vstor.runtime.lifecycle import Runtime
    real = HostContext.runtime

    def runtime(here, dry_run=False, force=False):
        if here.config.spdk_socket == a_spdk.socket_path:
            return Runtime(here.config, sysfs, dry_run=dry_run, force=force)
        return real(here, dry_run, force)
    monkeypatch.setattr(HostContext, "runtime", runtime)
    t = type("Two", (), {})()
    t.work, t.a_spdk, t.b_spdk, t.a_root, t.b_root = work, a_spdk, b_spdk, a_root, b_root
    t.a_conf, t.b_conf, t.sysfs = a_conf, b_conf, sysfs
    yield t
    for cfg, root in ((a_conf, a_root), (b_conf, b_root)):
        for who in ("a", "b"):
            d = f"{work}/{who}/state/domains"
            for name in (os.listdir(d) if os.path.isdir(d) and cfg.endswith(f"{who}.conf") else ()):
                main(["-c", "test:///default", "--config", cfg, "--host-root", root,
                      "release", "--force", name.removesuffix(".json")])
    a_spdk.stop(), b_spdk.stop()
    shutil.rmtree(work, ignore_errors=True)


def on(t, who, *args) -> int:
    cfg, root = (t.a_conf, t.a_root) if who == "a" else (t.b_conf, t.b_root)
    return main(["-c", "test:///default", "--config", cfg, "--host-root", root, *args])


def spdk_migration_hook(t, who, op, sub, extra, xml: str):
    cfg, root = (t.a_conf, t.a_root) if who == "a" else (t.b_conf, t.b_root)
    env = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", ""), "VSTOR_CONFIG": cfg, "VSTOR_HOST_ROOT": root}
    return subprocess.run([installed_hook(), "vm", op, sub, extra], input=xml.encode(),
                          capture_output=True, env=env)


def running_nvme_on_a(t) -> str:
    src, out = f"{t.work}/vm.in.xml", f"{t.work}/vm.xml"
    with open(src, "w") as f:
        f.write(f"""<domain type='kvm'><name>vm</name><uuid>6a0c6c5e-7f55-4b4a-9d8e-00000000a001</uuid>
          <memory unit='MiB'>1024</memory><vcpu>2</vcpu><os><type arch='x86_64' machine='q35'>hvm</type></os>
          <metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm cpus='shared'/>
          <vstor:disk target='vdb' backend='spdk'><vstor:nvme controller='{LOCAL}'/></vstor:disk>
          </vstor:vstor></metadata><devices/></domain>""")
    assert on(t, "a", "render", src, "-o", out) == 0
    assert on(t, "a", "prepare", out) == 0
    return out


def kinds(t, who) -> tuple:
    path = f"{t.work}/{who}/state/domains/vm.json"
    if not os.path.exists(path):
        return None, []
    with open(path) as f:
        rec = json.load(f)
    return rec["status"], [s["kind"] for s in rec["steps"]]


def changes(spdk, since=0) -> list:
    return [(r["method"], r.get("params")) for r in spdk.requests[since:]
            if not r["method"].endswith(("get_controllers", "get_version", "get_methods", "get_subsystems",
                                         "get_bdevs"))]


# -- the destination of a migration and its real agent process (test_migration_agent, test_agent_hostile) --

@pytest.fixture
def dest(tmp_path, host_layout):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.raw").write_bytes(b"\0" * 4096)
    conf = tmp_path / "b.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\nvhost_dir = {tmp_path}/vhost\n"
                    f"qsd_dir = {tmp_path}/qsd\nimages = {images}\n[migrate]\nshared = {images}\n")
    return type("D", (), {"tmp": tmp_path, "images": images, "conf": str(conf),
                          "root": host_layout("two-socket")})()


HOOKED = """import sys
def opened(event, args):
    # A relative name is a component opened below a held directory
    # (vstor.host.sources walks a file source so).
    if event == "open" and isinstance(args[0], str) and (
            args[0].startswith(("/dev/", sys.argv[1])) or not args[0].startswith("/")):
        sys.stderr.write(f"opened {args[0]}\\n")
sys.addaudithook(opened)
from vstor.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def agent(d, request, opens=None, wrap=()) -> dict:
    """The answer of the real `vstor migrate agent` process to `request`:
    exactly one JSON object on stdout, the exit code its own (0 when ok),
    no traceback.  `opens`, when given, gets every /dev and image path the
    process opened (seen by an audit hook, not by patching anything);
    `wrap` runs it inside another command (a private /dev)."""
    raw = request if isinstance(request, (bytes, str)) else json.dumps(request)
    argv = ["-c", "test:///default", "--config", d.conf, "--host-root", d.root, "migrate", "agent"]
    out = subprocess.run([*wrap, sys.executable, "-c", HOOKED, str(d.images), *argv],
                         input=raw if isinstance(raw, bytes) else raw.encode(), capture_output=True,
                         cwd=ROOT, timeout=120)
    err = out.stderr.decode(errors="replace")
    assert "Traceback" not in err and "internal error" not in err, err
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 1, out.stdout
    answer = json.loads(lines[0])
    assert isinstance(answer, dict) and answer["ok"] in (True, False), answer
    assert out.returncode == (0 if answer["ok"] else answer["exit_code"]), (out.returncode, answer)
    if opens is not None:
        opens.extend(line.split(" ", 1)[1] for line in err.splitlines() if line.startswith("opened "))
    return answer


def agent_domain(path="/x/a.raw") -> str:
    return (f"<domain><name>vm</name><memory unit='MiB'>512</memory><vcpu>1</vcpu>"
            f"<os><type arch='x86_64' machine='q35'>hvm</type></os><metadata><vstor:vstor xmlns:vstor='{NS}'>"
            f"<vstor:vm cpus='shared'/><vstor:disk target='vdb'><vstor:file path='{path}'/></vstor:disk>"
            "</vstor:vstor></metadata><devices/></domain>")


# -- a site of a config file, two images and a domain (test_logging, test_supervise) -----------------------

def make_site(d):
    """A config (from a file, as the CLI reads it), two image files and a
    domain log1 on them, rendered to r.xml, in directory `d`."""
    conf = d / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {d}/state\nvhost_dir = {d}/vhost\nqsd_dir = {d}/qsd\n"
                    f"images = {d}\n")
    for i in (0, 1):
        with open(d / f"d{i}.raw", "wb") as f:
            f.truncate(16 << 20)
    (d / "vm.xml").write_text(f"""<domain type='kvm'><name>log1</name><memory unit='MiB'>256</memory>
      <vcpu>1</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'><vstor:vm cpus='shared'/>
      <vstor:disk target='vdb'><vstor:file path='{d}/d0.raw'/></vstor:disk>
      <vstor:disk target='vdc' readonly='yes'><vstor:file path='{d}/d1.raw'/></vstor:disk>
      </vstor:vstor></metadata><devices/></domain>""")
    assert site_vstor(d, "render", str(d / "vm.xml"), "-o", str(d / "r.xml")) == 0
    return d


@pytest.fixture(name="site")
def site_fixture():
    d = tempfile.mkdtemp(prefix="vs-site-", dir="/tmp")     # QEMU's group must reach the sockets
    os.chmod(d, 0o755)
    yield make_site(pathlib.Path(d))
    site_vstor(pathlib.Path(d), "release", "--force", "log1")
    shutil.rmtree(d, ignore_errors=True)


def site_vstor(d, *args):
    return main(["-c", "test:///default", "--config", str(d / "vstor.conf"), *args])


def until(what, timeout=10.0) -> bool:
    """Whether `what()` came true within `timeout` seconds (asked every 20 ms)."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

