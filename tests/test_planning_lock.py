"""The planning lock: two runs that plan at once, as real processes, never
plan the same cores.  `vstor apply` against one libvirt that every process
shares (a private libvirtd, serving libvirt's own test driver, as nobody);
`vstor pve apply` on the Proxmox tree of tests/test_pve.py.  Without the
lock, such pairs got the same dedicated cores in most trials."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.helpers import Pve

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAIRS = int(os.environ.get("VSTOR_PAIRS", "50"))
NS = "https://vstor.dev/xmlns/domain/1"


def run(*args, timeout=60) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vstor.cli.main", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})


def both(*commands, timeout=60) -> None:
    """Start every command at once; each must end within `timeout`, exit 0."""
    procs = [run(*c) for c in commands]
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0 and "Traceback" not in err, out + err


def cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pins(plan_file: str) -> set[int]:
    """The dedicated cores of the plan `vstor pve apply` recorded."""
    from lxml import etree
    return {int(c) for c in etree.parse(plan_file).getroot().get("pins").split(",")}


def affinity(config: str) -> set[int]:
    return cpulist(next(line.split(":", 1)[1].strip() for line in config.splitlines()
                        if line.startswith("affinity:")))


# -- libvirt: vstor apply --------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_libvirt():
    """test:///default in a libvirtd of its own (started here as nobody, in
    a session of its own, stopped by pid): one state for every process."""
    libvirt = pytest.importorskip("libvirt")
    daemon = shutil.which("libvirtd", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if daemon is None or os.geteuid() != 0:
        pytest.skip("needs libvirtd and root (to start it as nobody)")
    # Outside pytest's root-only temporary tree: nobody must reach it.
    d = pathlib.Path(tempfile.mkdtemp(prefix="vstor-libvirtd-"))
    os.chmod(d, 0o777)
    (d / "libvirtd.conf").write_text(f'unix_sock_dir = "{d}"\nunix_sock_rw_perms = "0777"\n'
                                     'unix_sock_ro_perms = "0777"\nauth_unix_rw = "none"\n'
                                     'auth_unix_ro = "none"\n')
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(d), "XDG_RUNTIME_DIR": str(d),
           "XDG_CONFIG_HOME": f"{d}/config", "XDG_CACHE_HOME": f"{d}/cache"}
    proc = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                             daemon, "-f", f"{d}/libvirtd.conf"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(d / "log", "w"))
    sock = d / "libvirt-sock"
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (d / "log").read_text()
        time.sleep(0.05)
    uri = f"test+unix:///default?socket={sock}"
    conn = libvirt.open(uri)        # the test driver's state lives while a connection is open
    try:
        yield uri, conn
    finally:
        conn.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def annotated(name: str) -> str:
    return f"""<domain type='kvm'>
  <name>{name}</name>
  <memory unit='MiB'>512</memory>
  <vcpu>4</vcpu>
  <metadata>
    <vstor:vstor xmlns:vstor='{NS}'>
      <vstor:vm cpus='dedicated'/>
      <vstor:disk target='vdb' backend='qsd'><vstor:file path='/var/lib/vstor/images/{name}.raw'/></vstor:disk>
    </vstor:vstor>
  </metadata>
  <os><type arch='x86_64'>hvm</type></os>
</domain>"""


def test_concurrent_applies_never_share_a_core(shared_libvirt, host_layout, tmp_path):
    from vstor.meta.document import Domain
    uri, conn = shared_libvirt
    cfg = tmp_path / "vstor.conf"
    cfg.write_text(f"[cpu]\nreactors = 2,18\n[paths]\nstate_dir = {tmp_path}/state\n")
    common = ["-c", uri, "--config", str(cfg), "--host-root", host_layout("two-socket")]
    start, shared = time.monotonic(), []
    for i in range(PAIRS):
        names = (f"a{i}", f"b{i}")
        doms = [conn.defineXML(annotated(n)) for n in names]       # as `virsh define` does
        try:
            both(*[[*common, "apply", n] for n in names])
            a, b = (Domain.parse(d.XMLDesc(0)).recorded_plan() for d in doms)
            assert len(a.dedicated_cpus) == 4 == len(b.dedicated_cpus)
            if a.dedicated_cpus & b.dedicated_cpus:
                shared.append(i)
        finally:
            for d in doms:
                d.undefine()
    assert shared == [], f"{len(shared)} of {PAIRS} pairs shared a core"
    assert time.monotonic() - start < 600


# -- Proxmox: vstor pve apply ----------------------------------------------------------------

def test_concurrent_pve_applies_never_share_a_core(host_layout, tmp_path):
    pve = Pve(tmp_path, host_layout("two-socket"))
    common = ["--config", pve.conf, "--host-root", pve.host_root, "pve"]
    start, shared = time.monotonic(), []
    for i in range(PAIRS):
        for vmid in (100, 101):
            pve.vm(f"cores: 4\nmemory: 1024\nname: vm{vmid}\nostype: l26\n", vmid)
            pve.intent(pve.file_disk(f"d{vmid}.raw"), vmid, vm="<vstor:vm cpus='dedicated'/>")
            if os.path.exists(f"{pve.snippets}/vstor-{vmid}.plan.xml"):
                os.unlink(f"{pve.snippets}/vstor-{vmid}.plan.xml")
        both(*[[*common, "apply", str(vmid), "--qemu-version", "9.2"] for vmid in (100, 101)])
        a, b = (pins(f"{pve.snippets}/vstor-{vmid}.plan.xml") for vmid in (100, 101))
        assert len(a) == 4 == len(b)
        assert a <= affinity(pve.config(100)) and b <= affinity(pve.config(101))     # as written
        if a & b:
            shared.append(i)
    assert shared == [], f"{len(shared)} of {PAIRS} pairs shared a core"
    assert time.monotonic() - start < 600
