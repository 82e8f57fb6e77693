"""Hostile input: whoever writes a domain's XML may not be root, and vstor runs
as root inside libvirt's hook.  Malformed and hostile domains, and forged
plan records, go through every entry point:

    vstor plan FILE, vstor render FILE, vstor prepare --dry-run FILE,
    vstor prepare FILE (in-process, with the kernel sysfs double), and
    hooks/vstor DOMAIN prepare begin - (a subprocess, the XML on stdin)

and each must be refused with the documented exit code (docs/troubleshooting.md)
and one line on stderr, no traceback, within a time bound, and with NOTHING
changed on the host: the state, vhost and qsd directories, the image root and
the decoys a hostile input points at (a secret file, a listening socket),
/etc/shadow, /etc/passwd, /dev/null, the PCI part of the sysfs tree, the SPDK
target double, and the set of qemu-storage-daemon processes
(tests/snapshot.py).  A running 'victim' domain (a real qemu-storage-daemon)
is on the host throughout, so an input that reaches for another domain's
socket, image, record or daemon is noticed.

Forged plan records are generated from correctly rendered domains (the four
templates in xml-templates/ and three of this file's own) by walking every
attribute of <vstor:plan>, of each plan disk and of its children, the
attributes the declaration (vstor/meta/plan.py, intent.py) allows but the
record left out included, with hostile values per attribute kind, and by
forging the record's structure.  A fixed-seed sample runs: every attribute
of every base's record through the dry run, every attribute kind twice
through prepare and once through the hook (HOSTILE_ALL=1 runs all of them,
about 2400, through all three).

Hook runs expected to change nothing run a few at a time with the host
snapshotted around the batch; if the batch changed anything, each hook case
runs alone instead (see HookBatch).

A hostile input that shows a bug stays here as xfail(strict=True,
reason='BUG: ...'), so the suite is green and the bug cannot silently vanish.
"""

from __future__ import annotations

from tests import ended_process, installed_hook  # noqa: E402
import atexit
import contextlib
import copy
import dataclasses
import hashlib
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time

import pytest
from lxml import etree

from tests import snapshot
from tests.doubles.kernel_sysfs import KernelSysfsDouble
from tests.doubles.spdk_target import SpdkTargetDouble
from tests.hostlayout import build_tree, load_layout
from vstor import records
from vstor.cli.main import main
from vstor.meta import intent as intent_decl
from vstor.meta import plan as plan_decl

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons handed to root:kvm (needs root)")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
HOOK = os.path.join(ROOT, "hooks", "vstor")
TEMPLATES = os.path.join(ROOT, "xml-templates")
NS = "https://vstor.dev/xmlns/domain/1"
Q = "{%s}" % NS
SEED = 20240611
TIME_LIMIT = 20.0               # seconds, for any one entry point on any one input
SECRET = "vstor-hostile-decoy-secret-4711"      # content of the decoy file: never in any output
VICTIM_UUID = "a1b2c3d4-0000-4000-8000-00000000beef"
ENTRIES = ("plan", "render", "dry-run", "prepare", "hook")
START = ("dry-run", "prepare", "hook")
BAD, FIT = 2, 3


# -- the host: built once, at import, so the cases can be generated from it ------------------

def _host_layout() -> dict:
    """two-socket.toml, and devices that serve files vstor never opened
    (issue 28): dm-0 on loop0, md5 on loop1, an nbd device; and a free
    disk, sdb, whose plan a forgery re-points at them."""
    layout = load_layout(os.path.join(ROOT, "tests", "hosts", "two-socket.toml"))
    layout["disk"] = layout["disk"] + [{"name": "sdb", "size": "2TB"}, {"name": "loop0", "backing": "/tmp/x.img"},
                                       {"name": "loop1"}, {"name": "nbd0"}]
    layout["volume"] = [{"name": "vg-loop", "on": ["loop0"]}, {"name": "md5", "on": ["loop1"]}]
    return layout


class World:
    """A two-socket host tree, a config whose every directory lies under one
    temporary directory, image files, decoys, and (once the module fixture
    runs) the SPDK target double and a running victim domain."""

    def __init__(self, path: str | None = None, shm_file: str | None = None):
        if path:
            os.makedirs(path)
        self.dir = path or tempfile.mkdtemp(prefix="vs-hx-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        d = self.dir
        self.host = build_tree(_host_layout(), f"{d}/host")
        self.state, self.vhost, self.qsd = f"{d}/state", f"{d}/vhost", f"{d}/qsd"
        self.images, self.outside, self.cases = f"{d}/images", f"{d}/outside", f"{d}/cases"
        for sub in (self.images, self.outside, self.cases):
            os.makedirs(sub)
        self.spdk_sock = f"{d}/spdk.sock"
        self.conf = f"{d}/vstor.conf"
        # The start cases' plans are made as if before the victim started (a
        # state directory of their own), and on a host whose image roots take
        # in where the image root's links lead (plan and render refuse those
        # too), so the start itself must refuse them.
        self.plan_conf = f"{d}/plan.conf"
        for conf, state, images in ((self.conf, self.state, self.images),
                                    (self.plan_conf, f"{d}/plan-state", f"{self.images} {self.outside} /etc")):
            with open(conf, "w") as f:
                f.write(f"[paths]\nstate_dir = {state}\nvhost_dir = {self.vhost}\nqsd_dir = {self.qsd}\n"
                        f"images = {images}\n[cpu]\nreactors = 2,18\n"
                        f"[spdk]\nrpc_socket = {self.spdk_sock}\ntimeout = 5\n")
        for name in ("a.raw", "data.raw", "data2.raw", "victim.raw"):
            with open(f"{self.images}/{name}", "wb") as f:
                f.truncate(16 << 20)
        # Decoys a hostile input may point at: they must stay exactly as they are.
        self.secret = f"{self.outside}/secret"
        with open(self.secret, "w") as f:
            f.write(SECRET + "\n")
        os.chmod(self.secret, 0o600)
        self.decoy_sock = f"{self.outside}/decoy.sock"
        self.evil_dtd = f"{self.outside}/evil.dtd"
        with open(self.evil_dtd, "w") as f:
            f.write(f"<!ENTITY leak '{SECRET}'>\n")
        os.symlink(self.secret, f"{self.images}/escape.raw")         # a link out of the image root
        os.symlink(self.outside, f"{self.images}/outdir")             # a directory link out of it
        os.symlink("/etc/shadow", f"{self.images}/shadow.raw")
        if shm_file:
            open(shm_file, "wb").close()
            self.shm_file = shm_file
        else:
            fd, self.shm_file = tempfile.mkstemp(prefix="vs-hx-", suffix=".img", dir="/dev/shm")
            os.close(fd)                                              # a regular file under /dev
        self.victim_sock = f"{self.vhost}/victim-vdb"
        self.spdk = None
        self._listener = None
        self.baseline = None
        self.bases: dict[str, bytes] = {}
        self.base_dry_run: dict[str, str] = {}

    # -- what "the host" is ------------------------------------------------------------
    def snapshot(self) -> dict:
        paths = [self.secret, self.decoy_sock, self.evil_dtd, self.shm_file,
                 "/etc/shadow", "/etc/passwd", "/dev/null", "/dev/sda", "/dev/nvme0n1"]
        # Daemons are told apart by what they name: vstor's (this config's
        # pidfiles and sockets all lie under self.dir), or a file a hostile input
        # points at; other test runs on this machine may start their own.
        return snapshot.take(trees=(self.state, self.vhost, self.qsd, self.images, self.outside),
                             paths=paths, host_root=self.host, spdk=self.spdk,
                             processes_mentioning=(self.dir, self.shm_file, "/etc/", "/dev/null"))

    # -- the side-effectful part (the module fixture) -----------------------------------
    def start(self):
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.decoy_sock)
        os.chmod(self.decoy_sock, 0o600)
        self._listener.listen(1)
        self.spdk = SpdkTargetDouble(self.spdk_sock, self.vhost, cores=tuple(range(64)))
        self.spdk.add_pcie("0000:5f:00.0", 1).add_pcie("0000:5e:00.0", 1).add_pcie("0000:60:00.0", 1)
        self.spdk.add_fabric("RDMA", "192.168.100.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
        self.spdk.add_fabric("RDMA", "192.168.101.8", "4420", "nqn.2016-06.io.spdk:cnode1", (1, 2))
        self.spdk.start()
        victim = domain_xml(self, name="victim", uuid=VICTIM_UUID,
                            disks=file_disk(f"{self.images}/victim.raw"))
        code, _, err = cli(self, "render", self.write("victim-in.xml", victim), "-o",
                           f"{self.cases}/victim.xml")
        assert code == 0, err
        code, _, err = cli(self, "prepare", f"{self.cases}/victim.xml")
        assert code == 0, err
        assert os.path.exists(self.victim_sock)
        self.baseline = self.snapshot()

    def stop(self):
        cli(self, "release", "--force", "victim")
        if self.spdk is not None:
            self.spdk.stop()
        if self._listener is not None:
            self._listener.close()
        self.remove()

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.shm_file)

    def write(self, name: str, data) -> str:
        path = os.path.join(self.cases, name)
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return path


# -- running the entry points -----------------------------------------------------------------

@contextlib.contextmanager
def _sysfs_double():
    """In-process, the runtime reaches sysfs through the kernel's PCI
    behaviour (tests/doubles/kernel_sysfs.py), not plain file writes."""
    import vstor.host.sysfs as sysfs_mod
    real = sysfs_mod.SysFS
    sysfs_mod.SysFS = KernelSysfsDouble
    try:
        yield
    finally:
        sysfs_mod.SysFS = real


def cli(w: World, *args, conf: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _sysfs_double():
        try:
            code = main(["-c", "test:///default", "--config", conf or w.conf, "--host-root", w.host, *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def hook(w: World, name: str, xml: bytes, op: str = "prepare") -> tuple[int, str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": ROOT,
           "VSTOR_CONFIG": w.conf, "VSTOR_HOST_ROOT": w.host}
    sub = "begin" if op in ("prepare", "reconnect") else "end"
    r = subprocess.run([installed_hook(), name.replace("\0", ""), op, sub, "-"], input=xml,
                       capture_output=True, env=env, timeout=120)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


@dataclasses.dataclass
class Outcome:
    entry: str
    code: int
    out: str
    err: str
    seconds: float
    changes: list[str]


def run_entry(w: World, entry: str, xml: bytes, name: str) -> Outcome:
    path = w.write("case.xml", xml)
    before = w.snapshot()
    t0 = time.monotonic()
    if entry == "plan":
        code, out, err = cli(w, "plan", path)
    elif entry == "render":
        code, out, err = cli(w, "render", path)
    elif entry == "dry-run":
        code, out, err = cli(w, "prepare", "--dry-run", path)
    elif entry == "prepare":
        code, out, err = cli(w, "prepare", path)
    else:
        ran = _hook_batch(w).result(name, xml)
        if ran is not None:
            return Outcome(entry, *ran, changes=[])
        code, out, err = hook(w, name, xml)
    seconds = time.monotonic() - t0
    after = w.snapshot()
    changes = snapshot.diff(before, after)
    if changes:
        _clean_up(w, name, xml, before)
    return Outcome(entry, code, out, err, seconds, changes)


# -- the hook, several at a time ------------------------------------------------------------------
#
# A hook run is a new Python process (about 0.2 s): the hook cases that are
# expected to change nothing run HOOK_JOBS at a time, once, with the host
# snapshotted around the whole batch.  If the batch changed anything at all,
# its results are dropped and every hook case runs alone, snapshotted around
# itself, so the change is pinned on the case that made it.

HOOK_JOBS = min(4, (os.cpu_count() or 2) + 1)


class HookBatch:
    def __init__(self, w: World, jobs: list[tuple[str, bytes]]):
        self.results: dict[tuple[str, str], tuple] = {}
        before = w.snapshot()

        def one(job):
            name, xml = job
            t0 = time.monotonic()
            code, out, err = hook(w, name, xml)
            return job, (code, out, err, time.monotonic() - t0)

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(HOOK_JOBS) as pool:
            for (name, xml), ran in pool.map(one, jobs):
                self.results[_key(name, xml)] = ran
        self.changes = snapshot.diff(before, w.snapshot())
        if self.changes:
            for name, xml in jobs:
                _clean_up(w, name, xml, before)
            self.results = {}

    def result(self, name: str, xml: bytes):
        return self.results.get(_key(name, xml))


def _key(name: str, xml: bytes) -> tuple[str, str]:
    return name, hashlib.sha256(xml).hexdigest()


_BATCH: list[HookBatch] = []


def _hook_batch(w: World) -> HookBatch:
    if not _BATCH:
        _BATCH.append(HookBatch(w, _hook_jobs(w)))
    return _BATCH[0]


def _clean_up(w: World, name: str, xml: bytes, before: dict) -> None:
    """A case that changed the host (a bug, reported by its test): undo what
    it did, so the next case starts from the same host."""
    names = {name, *re.findall(r"<name>([A-Za-z0-9_.+\-]{1,64})</name>", xml[:4096].decode(errors="replace"))}
    for n in names:
        if n and n != "victim":
            cli(w, "release", "--force", n)
    for pid, cmd in snapshot.qsd_processes().items():
        if f"qsd-pid:{pid}" not in before and w.dir in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)        # a daemon this test's vstor started
    time.sleep(0.1)
    if snapshot.diff(w.baseline, w.snapshot()):
        _rebuild(w)


def _rebuild(w: World) -> None:
    """The host could not be put back by vstor itself: build it again, at the
    same paths (the generated cases name them)."""
    bases, dry = w.bases, w.base_dry_run
    w.stop()
    World.__init__(w, w.dir, w.shm_file)
    w.start()
    w.bases, w.base_dry_run = bases, dry


ONE_LINE_BREAKS = re.compile("[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")


def problems_with(o: Outcome, expect: set[int]) -> list[str]:
    """Everything wrong with an outcome; [] when it is what docs/troubleshooting.md documents."""
    out = []
    if o.code not in expect:
        out.append(f"exit {o.code}, expected {sorted(expect)}")
    for stream, text in (("stdout", o.out), ("stderr", o.err)):
        if "Traceback" in text:
            out.append(f"a traceback on {stream}: ...{text.strip()[-300:]!r}")
        if SECRET in text or "root:x:0:0" in text:
            out.append(f"{stream} shows the content of a file the input pointed at")
    if o.seconds > TIME_LIMIT:
        out.append(f"took {o.seconds:.1f}s (limit {TIME_LIMIT:g}s)")
    if o.code != 0:
        prefix = "vstor: " if o.entry == "hook" else "vstor: error: "
        if not o.err.endswith("\n") or not o.err.startswith(prefix):
            out.append(f"stderr is not one line starting {prefix!r}: {o.err[:300]!r}")
        else:
            m = ONE_LINE_BREAKS.search(o.err[:-1])
            if m:
                out.append(f"stderr is more than one line ({m.group()!r} inside): {o.err[:300]!r}")
            elif len(o.err) > 4096:
                out.append(f"stderr is one line of {len(o.err)} characters: {o.err[:200]!r}...")
    elif o.entry == "hook" and o.err:
        out.append(f"the hook passed but wrote to stderr: {o.err[:300]!r}")
    if o.changes:
        out.append(f"the host changed ({len(o.changes)} entries): " + "; ".join(o.changes[:6]))
    return out


def assert_refused(w: World, entry: str, xml: bytes, name: str, expect) -> Outcome:
    expect = {expect} if isinstance(expect, int) else set(expect)
    o = run_entry(w, entry, xml, name)
    found = problems_with(o, expect)
    assert not found, f"{entry}: " + " | ".join(found)
    return o


# -- building domains ---------------------------------------------------------------------------

def file_disk(path: str, target: str = "vdb", extra: str = "") -> str:
    return f"<vstor:disk target='{target}'{extra}><vstor:file path='{path}'/></vstor:disk>"


def domain_xml(w: World, *, name="hx1", uuid=None, vcpu="1", memory="<memory unit='MiB'>256</memory>",
               vm="<vstor:vm cpus='shared'/>", disks=None, meta="", devices="", prolog="",
               ns=NS, block=None) -> str:
    disks = file_disk(f"{w.images}/a.raw") if disks is None else disks
    uuid = f"<uuid>{uuid}</uuid>" if uuid else ""
    block = f"<vstor:vstor xmlns:vstor='{ns}'>{vm}{disks}</vstor:vstor>" if block is None else block
    return (f"{prolog}<domain type='kvm'><name>{name}</name>{uuid}{memory}<vcpu>{vcpu}</vcpu>"
            f"<metadata>{block}{meta}</metadata><os><type arch='x86_64' machine='q35'>hvm</type></os>"
            f"<devices>{devices}</devices></domain>")


def render_in(w: World, xml: bytes, label: str) -> bytes:
    """The domain as `vstor render` writes it (the plan recorded in it),
    planned without what the running victim holds."""
    code, out, err = cli(w, "render", w.write(f"{label}-in.xml", xml), conf=w.plan_conf)
    assert code == 0, f"rendering {label}: {err}"
    return out.encode()


# -- the bases of the forged plans: correctly rendered domains -----------------------------------

def _template(name: str, w: World) -> str:
    with open(os.path.join(TEMPLATES, name)) as f:
        text = f.read()
    return text.replace("/var/lib/vstor/images/demo1-data.raw", f"{w.images}/data.raw")


def _base_sources(w: World) -> dict[str, str]:
    return {
        "qsd-file": _template("qsd-file.xml", w),
        "spdk-local": _template("vhost-local-nvme.xml", w),
        "spdk-nvmf": _template("vhost-nvmf-rdma-multipath.xml", w),
        "passthrough": _template("passthrough-guest-spdk.xml", w),
        "qsd-namespace": domain_xml(w, name="nsq1", vcpu="2", memory="<memory unit='GiB'>1</memory>",
                                    vm="<vstor:vm/>", disks="<vstor:disk target='vdb' backend='qsd' "
                                    "queues='2' readonly='yes'><vstor:nvme controller='0000:61:00.0'/>"
                                    "</vstor:disk>"),
        "qsd-block": domain_xml(w, name="blk1", vm="<vstor:vm numa='preferred'/>",
                                disks="<vstor:disk target='vdd'><vstor:block path='/dev/nvme3n1'/></vstor:disk>"),
        "two-files": domain_xml(w, name="two1", disks=file_disk(f"{w.images}/data.raw")
                                + file_disk(f"{w.images}/data2.raw", "vdc", " readonly='yes'")),
    }


def _render_bases(w: World) -> None:
    for label, xml in _base_sources(w).items():
        w.bases[label] = render_in(w, xml.encode(), f"base-{label}")


def _name_of(xml: bytes) -> str:
    return etree.fromstring(xml).findtext("name")


WORLD = World()
atexit.register(lambda: WORLD.remove())
_render_bases(WORLD)        # pure: plan and render touch nothing


@pytest.fixture(scope="module")
def world():
    WORLD.start()
    try:
        for label, xml in WORLD.bases.items():      # the honest plans are good: refusals below are the forgery's
            code, out, err = cli(WORLD, "prepare", "--dry-run", WORLD.write(f"base-{label}.xml", xml))
            assert code == 0, f"the unforged {label} plan is refused: {err}"
            WORLD.base_dry_run[label] = out
        yield WORLD
    finally:
        WORLD.stop()


@pytest.fixture
def w(world):
    return world


# -- hostile domains ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile domain.  `expect`: entry -> allowed exit codes (default: 2,
    bad input).  `rendered`: the start entries (dry run, prepare, hook) get the
    domain as `vstor render` wrote it, so the start-time checks are reached,
    not the missing plan.  `bugs`: entry (or '*') -> the reason it is xfail."""
    id: str
    build: object                   # World -> str | bytes
    expect: dict = dataclasses.field(default_factory=dict)
    name: str = "hx1"
    rendered: bool = False
    bugs: dict = dataclasses.field(default_factory=dict)

    def expected(self, entry: str) -> set[int]:
        codes = self.expect.get(entry, self.expect.get("*", BAD))
        return {codes} if isinstance(codes, int) else set(codes)


PASS_HOOK = {"hook": 0}     # no vstor metadata as the hook sees it: libvirt starts the domain untouched

def _laughs(depth=9) -> str:
    ents = "<!ENTITY a 'lol'>" + "".join(
        f"<!ENTITY {chr(98 + i)} '{('&' + chr(97 + i) + ';') * 10}'>" for i in range(depth))
    return f"<!DOCTYPE domain [{ents}]>"


def _cases() -> list[Case]:
    d = lambda **kw: (lambda w: domain_xml(w, **kw))                                    # noqa: E731

    def with_disk(path_of, kind="file", extra=""):
        return lambda w: domain_xml(w, disks=f"<vstor:disk target='vdb'{extra}><vstor:{kind} "
                                             f"path='{path_of(w)}'/></vstor:disk>")

    def edit(fn):
        return lambda w: fn(domain_xml(w))

    cases = [
        # malformed XML (each names the vstor namespace, so the hook's fast path lets it through)
        Case("xml-truncated", edit(lambda x: x[: len(x) // 2])),
        Case("xml-truncated-in-vstor", edit(lambda x: x[: x.index("<vstor:file") + 8])),
        Case("xml-empty-after-marker", lambda w: f"<!-- {NS} -->"),
        Case("xml-encoding-bogus", d(prolog="<?xml version='1.0' encoding='x-bogus-9'?>")),
        Case("xml-encoding-utf16-declared-on-utf8", d(prolog="<?xml version='1.0' encoding='UTF-16'?>")),
        Case("xml-utf16-bom-on-utf8", lambda w: b"\xff\xfe" + domain_xml(w).encode()),
        Case("xml-invalid-utf8", lambda w: domain_xml(w).encode().replace(b"hx1", b"hx\xff\xfe1")),
        Case("xml-nul-in-name", lambda w: domain_xml(w).encode().replace(b"hx1", b"hx\x001")),
        Case("xml-nul-in-vstor-attribute", lambda w: domain_xml(w).encode().replace(b"'vdb'", b"'vd\x00b'")),
        Case("xml-control-char-ref", edit(lambda x: x.replace("hx1", "hx&#27;1"))),
        Case("xml-1.1-control-char-ref", d(prolog="<?xml version='1.1'?>", name="hx&#27;1")),
        Case("xml-billion-laughs-in-name", d(prolog=_laughs(), name="&j;")),
        Case("xml-billion-laughs-in-vstor-attribute",
             lambda w: domain_xml(w, prolog=_laughs(), disks=file_disk(f"{w.images}/a.raw", "&j;"))),
        Case("xml-billion-laughs-in-vstor-element", lambda w: domain_xml(
            w, prolog=_laughs(), disks=file_disk(f"{w.images}/a.raw").replace("</vstor:disk>", "&j;</vstor:disk>"))),
        Case("xml-external-entity-passwd-in-name",
             d(prolog="<!DOCTYPE domain [<!ENTITY x SYSTEM 'file:///etc/passwd'>]>", name="&x;")),
        Case("xml-external-entity-secret-in-vstor", lambda w: domain_xml(
            w, prolog=f"<!DOCTYPE domain [<!ENTITY x SYSTEM 'file://{w.secret}'>]>",
            disks=file_disk(f"{w.images}/a.raw").replace("</vstor:disk>", "&x;</vstor:disk>"))),
        Case("xml-external-dtd-subset", lambda w: domain_xml(
            w, prolog=f"<!DOCTYPE domain SYSTEM 'file://{w.evil_dtd}'>", name="&leak;")),
        Case("xml-external-parameter-entity", lambda w: domain_xml(
            w, prolog=f"<!DOCTYPE domain [<!ENTITY % p SYSTEM 'file://{w.evil_dtd}'> %p;]>", name="&leak;")),
        Case("xml-internal-entity-in-vstor-attribute", lambda w: domain_xml(
            w, prolog="<!DOCTYPE domain [<!ENTITY t 'vdb'>]>", disks=file_disk(f"{w.images}/a.raw", "&t;"))),
        Case("xml-internal-entity-for-path", lambda w: domain_xml(
            w, prolog="<!DOCTYPE domain [<!ENTITY p '/etc/shadow'>]>",
            disks="<vstor:disk target='vdb'><vstor:file path='&p;'/></vstor:disk>")),
        Case("xml-xinclude-in-vstor", d(disks="<vstor:disk target='vdb'><xi:include "
                                        "xmlns:xi='http://www.w3.org/2001/XInclude' href='file:///etc/passwd' "
                                        "parse='text'/></vstor:disk>")),
        Case("xml-root-is-vstor", lambda w: f"<vstor:vstor xmlns:vstor='{NS}'>{file_disk(w.images + '/a.raw')}</vstor:vstor>"),
        Case("xml-root-in-a-namespace", edit(lambda x: x.replace("<domain type='kvm'>", "<domain xmlns='urn:x' type='kvm'>"))),
        Case("ns-wrong-uri", d(ns="https://vstor.dev/xmlns/domain/2"), expect=PASS_HOOK),
        Case("ns-marker-as-prefix", d(ns=NS + "0"), expect=PASS_HOOK),
        Case("ns-trailing-slash", d(ns=NS + "/"), expect=PASS_HOOK),
        Case("ns-disk-in-another-namespace", lambda w: domain_xml(
            w, disks=f"<v2:disk xmlns:v2='{NS}0' target='vdb'><v2:file path='{w.images}/a.raw'/></v2:disk>")),
        Case("vstor-outside-metadata", lambda w: domain_xml(
            w, block="", devices=f"<vstor:vstor xmlns:vstor='{NS}'>{file_disk(w.images + '/a.raw')}</vstor:vstor>"),
            expect=PASS_HOOK),
        Case("vstor-nested-in-metadata", lambda w: domain_xml(
            w, block=f"<wrap xmlns='urn:w'><vstor:vstor xmlns:vstor='{NS}'>{file_disk(w.images + '/a.raw')}"
                     "</vstor:vstor></wrap>"), expect=PASS_HOOK),
        Case("vstor-two-blocks", lambda w: domain_xml(
            w, meta=f"<vstor:vstor xmlns:vstor='{NS}'>{file_disk('/etc/shadow', 'vdc')}</vstor:vstor>")),
        Case("vstor-no-disk", d(disks="")),
        Case("vstor-text-inside", d(vm="<vstor:vm cpus='shared'/>text")),
        Case("vstor-unknown-attribute", d(vm="<vstor:vm cpus='shared' evil='1'/>")),
        # disk targets
        Case("target-duplicate", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw") * 2)),
        Case("target-duplicate-other-source", lambda w: domain_xml(
            w, disks=file_disk(f"{w.images}/a.raw") + file_disk(f"{w.images}/data.raw"))),
        Case("target-slash", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vd/b"))),
        Case("target-dotdot", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "../vdb"))),
        Case("target-newline", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vd&#10;b"))),
        Case("target-trailing-newline", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vdb&#10;"))),
        Case("target-tab", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vd&#9;b"))),
        Case("target-carriage-return", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vdb&#13;"))),
        Case("target-very-long", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vd" + "b" * 100000))),
        Case("target-unicode", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "vdé"))),
        Case("target-fullwidth", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", "ｖｄｂ"))),
        # domain names (no <uuid>: vstor has nothing safe to name sockets and records by)
        Case("name-newline", d(name="hx&#10;1"), name="hx\n1"),
        Case("name-carriage-return", d(name="hx&#13;1"), name="hx\r1"),
        Case("name-slash", d(name="a/b")),
        Case("name-dotdot", d(name="..")),
        Case("name-traversal", d(name="../../etc/x")),
        Case("name-unicode", d(name="dömäin")),
        Case("name-dash-first", d(name="-rf")),
        Case("name-empty", d(name="")),
        Case("name-blank", d(name="  ")),
        Case("name-very-long", d(name="a" * (1 << 20)), name="a" * 1000),
        # numbers
        Case("vcpu-superscript-two", d(vcpu="²")),
        Case("vcpu-negative", d(vcpu="-1")),
        Case("vcpu-zero", d(vcpu="0")),
        Case("vcpu-huge", d(vcpu="99999999999999999999999")),
        Case("vcpu-fullwidth", d(vcpu="１")),
        Case("vcpu-arabic-indic", d(vcpu="٣")),
        Case("vcpu-hex", d(vcpu="0x2")),
        Case("vcpu-float", d(vcpu="1.5")),
        Case("vcpu-over-4096", d(vcpu="4097")),
        Case("vcpu-newline", d(vcpu="1&#10;2")),
        Case("memory-negative", d(memory="<memory>-1</memory>")),
        Case("memory-zero", d(memory="<memory>0</memory>")),
        Case("memory-absurd", d(memory="<memory>99999999999999999999999</memory>")),
        Case("memory-unit-EiB", d(memory="<memory unit='EiB'>1</memory>")),
        Case("memory-unit-bogus", d(memory="<memory unit='lots'>1</memory>")),
        Case("memory-unit-newline", d(memory="<memory unit='M&#10;iB'>256</memory>")),
        Case("memory-newline", d(memory="<memory>1&#10;024</memory>")),
        Case("memory-fullwidth", d(memory="<memory>１０２４</memory>")),
        Case("memory-bytes-rounding-to-zero", d(memory="<memory unit='b'>1</memory>")),
        Case("memory-missing", d(memory="")),
        Case("memory-1-EiB-does-not-fit", d(memory="<memory unit='TiB'>1048576</memory>"),
             expect={"plan": FIT, "render": FIT}),
        Case("queues-zero", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", extra=" queues='0'"))),
        Case("queues-leading-space", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", extra=" queues=' 1'"))),
        Case("queues-65", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", extra=" queues='65'"))),
        Case("queues-fullwidth", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", extra=" queues='１'"))),
        Case("queues-huge", lambda w: domain_xml(w, disks=file_disk(f"{w.images}/a.raw", extra=" queues='99999999999999999999999'"))),
        Case("nsid-huge", d(disks="<vstor:disk target='vdb'><vstor:nvme controller='0000:5f:00.0' namespace='4294967296'/></vstor:disk>")),
        Case("nsid-absent-on-host", d(disks="<vstor:disk target='vdb'><vstor:nvme controller='0000:5f:00.0' namespace='4294967295'/></vstor:disk>")),
        Case("nsid-zero", d(disks="<vstor:disk target='vdb'><vstor:nvme controller='0000:5f:00.0' namespace='0'/></vstor:disk>")),
        Case("trsvcid-65536", d(disks="<vstor:disk target='vdb'><vstor:nvmf transport='tcp' traddr='10.0.0.1' trsvcid='65536' subnqn='nqn.2016-06.io.spdk:c1'/></vstor:disk>")),
        Case("reconnect-over-int32", d(disks="<vstor:disk target='vdb'><vstor:nvmf transport='tcp' traddr='10.0.0.1' subnqn='nqn.2016-06.io.spdk:c1'><vstor:reconnect ctrlr_loss_timeout='2147483648'/></vstor:nvmf></vstor:disk>")),
        Case("nqn-with-newline", d(disks="<vstor:disk target='vdb'><vstor:nvmf transport='tcp' traddr='10.0.0.1' subnqn='nqn.x&#10;y'/></vstor:disk>")),
        # devices
        Case("controller-not-on-host", d(disks="<vstor:disk target='vdb'><vstor:nvme controller='0000:ff:00.0'/></vstor:disk>")),
        Case("controller-is-the-rdma-nic", d(disks="<vstor:disk target='vdb'><vstor:nvme controller='0000:17:00.0'/></vstor:disk>")),
        Case("controller-is-the-root-disks-ahci", d(disks="<vstor:disk target='vdb' mode='passthrough'><vstor:nvme controller='0000:00:17.0'/></vstor:disk>")),
        Case("nic-not-on-host", d(disks="<vstor:disk target='vdb'><vstor:nvmf transport='rdma' traddr='10.0.0.1' subnqn='nqn.2016-06.io.spdk:c1' nic='mlx5_9'/></vstor:disk>")),
        # paths
        Case("path-traversal-to-shadow", with_disk(lambda w: "/var/lib/libvirt/images/../../etc/shadow")),
        Case("path-traversal-out-of-image-root", with_disk(lambda w: f"{w.images}/../outside/secret")),
        Case("path-host-file-outside-roots", with_disk(lambda w: "/etc/shadow")),
        Case("path-decoy-outside-roots", with_disk(lambda w: w.secret)),
        Case("path-relative", with_disk(lambda w: "images/a.raw")),
        Case("path-double-slash", with_disk(lambda w: f"/{w.images}/a.raw")),
        Case("path-dot-component", with_disk(lambda w: f"{w.images}/./a.raw")),
        Case("path-newline", with_disk(lambda w: f"{w.images}/a&#10;.raw")),
        Case("path-tab", with_disk(lambda w: f"{w.images}/a&#9;.raw")),
        Case("path-nul", lambda w: domain_xml(w).encode().replace(b"a.raw", b"a\x00.raw")),
        Case("path-percent-encoded", with_disk(lambda w: f"{w.images}/%2e%2e/outside/secret")),
        Case("path-1MB", with_disk(lambda w: f"{w.images}/" + "a" * (1 << 20))),
        Case("path-image-root-itself", with_disk(lambda w: w.images)),
        Case("path-block-regular-file", with_disk(lambda w: w.shm_file, "block")),
        Case("path-block-dev-null", with_disk(lambda w: "/dev/null", "block")),
        Case("path-block-root-disk", with_disk(lambda w: "/dev/sda", "block"),
             expect={"plan": FIT, "render": FIT}),
        Case("path-block-root-partition", with_disk(lambda w: "/dev/sda2", "block"),
             expect={"plan": FIT, "render": FIT}),
        Case("path-block-traversal", with_disk(lambda w: "/dev/../etc/shadow", "block")),
        Case("path-block-outside-dev", with_disk(lambda w: w.secret, "block")),
        Case("path-file-is-dev-null", with_disk(lambda w: "/dev/null")),
        # a link out of the image root: refused by plan and render (they walk the
        # source as a start does), and by the start of a domain rendered elsewhere
        Case("start-symlink-out-of-image-root", with_disk(lambda w: f"{w.images}/escape.raw"), rendered=True),
        Case("start-symlink-to-shadow", with_disk(lambda w: f"{w.images}/shadow.raw"), rendered=True),
        Case("start-directory-symlink-out", with_disk(lambda w: f"{w.images}/outdir/secret"), rendered=True),
        # refused at start: an image may be made after its domain is planned
        Case("start-file-missing", with_disk(lambda w: f"{w.images}/missing.raw"),
             expect={"plan": 0, "render": 0}, rendered=True),
        Case("start-second-writer-on-victims-image", with_disk(lambda w: f"{w.images}/victim.raw"),
             expect={"*": FIT}, rendered=True),
        Case("start-victims-name-other-uuid", lambda w: domain_xml(
            w, name="victim", uuid="a1b2c3d4-0000-4000-8000-000000000bad"),
            expect={"plan": 0, "render": 0, "*": FIT}, name="victim", rendered=True),
        Case("start-victims-uuid-unsafe-name-second-writer", lambda w: domain_xml(
            w, name="not victim", uuid=VICTIM_UUID, disks=file_disk(f"{w.images}/victim.raw")),
            expect={"*": FIT}, name="not victim", rendered=True),
        # a correctly rendered domain, then its identity edited (what the digest does not cover)
        Case("renamed-slash", lambda w: _renamed(w, "a/b"), name="a/b"),
        Case("renamed-dotdot", lambda w: _renamed(w, ".."), name=".."),
        Case("renamed-newline", lambda w: _renamed(w, "demo&#10;1"), name="demo\n1"),
        Case("renamed-unicode", lambda w: _renamed(w, "dömäin"), name="dömäin"),
        Case("renamed-65-chars", lambda w: _renamed(w, "d" * 65), name="d" * 65),
        Case("renamed-unicode-with-uuid", lambda w: _renamed(w, "dömäin", "12345678-1234-4234-8234-123456789abc"),
             expect={"plan": 0, "render": 0, "*": FIT}, name="dömäin"),
        Case("renamed-uppercase-uuid", lambda w: _renamed(w, "dömäin", "12345678-1234-4234-8234-123456789ABC"),
             expect={"plan": 0, "render": 0, "*": FIT}, name="dömäin"),
        Case("renamed-malformed-uuid", lambda w: _renamed(w, "dömäin", "../../etc/passwd-000000000000000000000")),
        Case("renamed-as-the-victim-without-uuid", lambda w: _renamed(w, "victim"),
             expect={"plan": 0, "render": 0, "*": FIT}, name="victim"),
        Case("renamed-as-the-victim-other-uuid", lambda w: _renamed(w, "victim", "a1b2c3d4-0000-4000-8000-000000000bad"),
             expect={"plan": 0, "render": 0, "*": FIT}, name="victim"),
        Case("edited-vcpus", lambda w: _edited(w, ">1</vcpu>", ">2</vcpu>"), expect={"plan": 0, "render": 0}),
        Case("edited-memory", lambda w: _edited(w, ">512</memory>", ">1024</memory>"), expect={"plan": 0, "render": 0}),
    ]
    return cases + _huge_cases()


def _ten_thousand_disks(w: World, existing: bool = False) -> str:
    """10,000 disks: each on its own (missing) file, or all readonly on one
    file that exists (so a dry run gets past the start-time source checks)."""
    targets = ["vd" + "".join(p) for n in (1, 2, 3) for p in itertools.product(string.ascii_lowercase, repeat=n)]
    if existing:
        return domain_xml(w, disks="".join(file_disk(f"{w.images}/a.raw", t, " readonly='yes'")
                                           for t in targets[:10000]))
    return domain_xml(w, disks="".join(file_disk(f"{w.images}/{t}.raw", t) for t in targets[:10000]))


def _huge_cases() -> list[Case]:
    """Bounded time (TIME_LIMIT each) and one line, refused or handled."""
    element = f"<x a='{'v' * 90}'/>"
    return [
        Case("huge-50MB-of-elements", lambda w: domain_xml(w, devices=element * ((50 << 20) // len(element))),
             expect={"plan": 0, "render": 0}),
        Case("huge-50MB-comment", lambda w: domain_xml(w, devices="<!--" + "c" * (50 << 20) + "-->")),
        Case("huge-11MB-text-node", lambda w: domain_xml(w, devices="<description>" + "t" * (11 << 20)
                                                          + "</description>")),
        Case("huge-deep-nesting", lambda w: domain_xml(w, devices="<x>" * 100000 + "</x>" * 100000)),
        Case("huge-10k-disks", _ten_thousand_disks, expect={"plan": 0, "render": 0}),
        Case("huge-10k-vstor-elements-unknown", lambda w: domain_xml(
            w, disks=file_disk(f"{w.images}/a.raw") + "<vstor:evil/>" * 10000)),
        Case("huge-1MB-attribute-value", lambda w: domain_xml(
            w, disks=file_disk(f"{w.images}/a.raw", extra=f" mode='{'v' * (1 << 20)}'"))),
        Case("huge-1MB-attribute-name", lambda w: domain_xml(
            w, disks=file_disk(f"{w.images}/a.raw", extra=f" {'a' * (1 << 20)}='1'"))),
        Case("huge-1MB-plan-attribute", lambda w: w.bases["qsd-file"].replace(
            b' host="compute-7"', b' socket="/' + b"s" * (1 << 20) + b'"', 1),
             expect={"plan": 0, "render": 0}),      # plan and render re-plan over a damaged record
        Case("huge-1MB-unknown-element-name", lambda w: domain_xml(
            w, disks=file_disk(f"{w.images}/a.raw") + f"<vstor:{'e' * (1 << 20)}/>")),
    ]


def _renamed(w: World, name: str, uuid: str | None = None) -> bytes:
    """The rendered qsd-file base under another name (and UUID)."""
    xml = w.bases["qsd-file"].decode()
    assert "<name>demo1</name>" in xml
    return xml.replace("<name>demo1</name>", f"<name>{name}</name>" + (f"<uuid>{uuid}</uuid>" if uuid else ""), 1)


def _edited(w: World, old: str, new: str) -> bytes:
    xml = w.bases["qsd-file"].decode()
    assert old in xml
    return xml.replace(old, new, 1)


CASES = _cases()


def _entry_params(cases):
    for case in cases:
        for entry in ENTRIES:
            if case.rendered is None and entry not in START:
                continue
            reason = case.bugs.get(entry, case.bugs.get("*"))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(case, entry, id=f"{entry}-{case.id}", marks=marks)


@pytest.mark.parametrize("case, entry", list(_entry_params(CASES)))
def test_a_hostile_domain_is_refused_with_one_line_and_nothing_changed(w, case, entry):
    assert_refused(w, entry, case_xml(w, case, entry), case.name, case.expected(entry))


def case_xml(w: World, case: Case, entry: str) -> bytes:
    xml = case.build(w)
    xml = xml.encode() if isinstance(xml, str) else xml
    if case.rendered and entry in START:
        xml = render_in(w, xml, "case")
    return xml


# -- forged plan records -----------------------------------------------------------------------------
#
# Every attribute of <vstor:plan>, of each plan disk and of each element under
# it (the source as planned, attach, path, reconnect), including the ones the
# declaration allows but the record leaves out, set to hostile values and
# deleted; and the record's structure forged.  The element classes come from
# the declaration itself, so an attribute added to vstor/meta/plan.py or
# intent.py is forged here without editing this file.

DECLARED = {"plan": plan_decl.Plan, "disk": plan_decl.DiskPlan, "attach": plan_decl.AttachPath,
            "nvme": intent_decl.NvmeSource, "nvmf": intent_decl.NvmfSource,
            "file": intent_decl.FileSource, "block": intent_decl.BlockSource,
            "path": intent_decl.NvmfPath, "reconnect": intent_decl.Reconnect}
INERT = {("plan", "host")}      # not a decision: compared by nothing, tested on its own below
DELETE = object()


def declared_attributes(cls) -> dict[str, tuple[object, object]]:
    """attribute name -> (value type, default) as the element is declared."""
    out = {}
    for f in records.fields(cls):
        spec = f.metadata.get("xml")
        if spec is not None and hasattr(spec, "required") and hasattr(spec, "type"):
            out[spec.name or f.name] = (spec.type, f.default)
    return out


def _other_digest(w: World, current: str) -> str:
    for xml in w.bases.values():
        found = re.search(rb'digest="(sha256:[0-9a-f]{64})"', xml)
        if found and found.group(1).decode() != current:
            return found.group(1).decode()
    return "sha256:" + "1" * 64


def _specific(w: World, tag: str, name: str, current: str | None) -> list[str]:
    """Hostile values an attribute of this name invites."""
    files = ["/etc/shadow", w.secret, f"{w.images}/escape.raw", f"{w.images}/shadow.raw",
             f"{w.images}/outdir/secret", f"{w.images}/victim.raw", w.images,
             "/var/lib/libvirt/images/../../etc/shadow", "/dev/null", f"{w.images}/data2.raw"]
    blocks = ["/dev/sda", "/dev/sda2", "/dev/null", w.shm_file, "/dev/nvme0n1", "/dev/nvme1n1",
              "/dev/nvme2n1", "/dev/nvme4n1", "/dev/../etc/shadow"]
    controllers = ["0000:5e:00.0", "0000:5f:00.0", "0000:60:00.0", "0000:61:00.0", "0000:3b:00.0",
                   "0000:00:17.0", "0000:17:00.0", "ffff:ff:1f.7"]
    table = {
        "socket": ["/etc/shadow", w.decoy_sock, w.victim_sock, f"{w.vhost}/evil-vdb", "/dev/null",
                   f"{w.vhost}/../outside/decoy.sock", f"{w.images}/data.raw", f"{w.vhost}/victim-vdc",
                   f"{w.qsd}/victim-vdb.qmp"],
        "controller": controllers,
        "device": blocks,
        "spdk_controller": ["a/b", "..", "vs_0000_5e_00_0", "vs_0000_5f_00_0", "victim-vdb", "x" * 129,
                            "vs_nvmf_000000000000"],
        "bdev": ["a/b", "..", "vs_0000_5e_00_0n1", "vs_0000_5f_00_0n2", "victim-vdb", "x" * 129],
        "digest": ["sha256:" + "0" * 64, _other_digest(w, current or ""), (current or "").upper(),
                   (current or "sha256:")[:-1] + ("0" if (current or "")[-1:] != "0" else "1"), "md5:00"],
        "version": ["1", "3", "", "02", " 2", "2.0"],
        "target": ["vdc", "vdz", "vda", "vd/b", "../vdb", ""],
        "traddr": ["10.0.0.1", "127.0.0.1", "192.168.101.8", "192.168.100.8", "0000:5e:00.0", "a/b"],
        "subnqn": ["nqn.2016-06.io.spdk:cnode2", "nqn.x y"],
        "hostnqn": ["nqn.2014-08.org.nvmexpress:uuid:evil", "nqn.é"],
        "nic": ["mlx5_1", "lo", "a/b"],
    }
    if name == "path":
        return blocks if tag == "block" else files
    return table.get(name, [])


def _generic(typ, name: str, current: str | None) -> list[str]:
    kind = type(typ).__name__
    if kind == "YesNo":
        return ["yes", "no", "true", "YES"]
    if kind == "Enum":
        return list(typ.values) + ["bogus", ""]
    if kind == "Int":
        valid = {typ.lo, typ.hi, typ.lo + 1, min(typ.hi, (int(current) + 1) if current and current.isdigit() else typ.lo)}
        return [str(v) for v in sorted(valid)] + [
            "-1", str(typ.hi + 1), str(1 << 62), "0x3", " 1", "１", "99999999999999999999999", "1e3"]
    if kind == "CpuList":
        return ["0-4095", "5-3", "", "0", "2,18", "17", "0-99999", "1,0-63", "16-31,48-63"]
    if kind == "CpuSequence":
        return ["", "0", "2", "18", "17,17", "99999", "4095", "1,3", "17,49,19,51,20,52,21,54"]
    return ["", "x" * 5000, "a\nb"]


def _same_value(typ, text: str, current: str | None, default) -> bool:
    """Would the record mean the same with `text` as with what it holds now?"""
    try:
        new = typ.parse(text, "x")
    except Exception:
        return False
    if current is None:
        return new == default
    try:
        return new == typ.parse(current, "x")
    except Exception:
        return False


def _label(value) -> str:
    if value is DELETE:
        return "(deleted)"
    text = value if len(value) <= 40 else f"{value[:20]}...({len(value)} chars)"
    text = text.replace(WORLD.dir, "W")
    return text.encode("unicode_escape").decode() or "''"


@dataclasses.dataclass(frozen=True)
class Forgery:
    id: str                 # '<base>:<element>@<attribute>=<value>' or '<base>:<structure change>'
    base: str
    kind: str               # 'plan/disk@socket', or 'structure' (coverage key)
    xml: bytes
    name: str


def _plan_of(root):
    return root.find(f"metadata/{Q}vstor/{Q}plan")


def _walk(plan):
    """(path key, element) for the plan and everything under its disks."""
    yield "plan", plan
    for disk in plan.findall(Q + "disk"):
        yield "plan/disk", disk
        for child in disk:
            if not isinstance(child.tag, str) or child.tag == Q + "reason":
                continue
            tag = etree.QName(child).localname
            yield f"plan/disk/{tag}", child
            for sub in child:
                if isinstance(sub.tag, str):
                    yield f"plan/disk/{tag}/{etree.QName(sub).localname}", sub


def _where(e) -> str:
    """A readable locator of an element of the plan record."""
    parts = []
    while e is not None and e.tag != Q + "vstor":
        tag = etree.QName(e).localname
        if tag == "disk":
            tag = f"disk[{e.get('target')}]"
        elif tag in ("attach", "path"):
            same = [s for s in e.getparent() if s.tag == e.tag]
            tag = f"{tag}[{same.index(e)}]" if len(same) > 1 else tag
        parts.append(tag)
        e = e.getparent()
    return "/".join(reversed(parts))


def _serialise(root) -> bytes:
    return etree.tostring(root, encoding="utf-8")


def attribute_forgeries(w: World, base: str) -> list[Forgery]:
    xml = w.bases[base]
    root = etree.fromstring(xml)
    name = root.findtext("name")
    out = []
    for index, (key, elem) in enumerate(list(_walk(_plan_of(root)))):
        tag = key.rsplit("/", 1)[-1]
        decl = declared_attributes(DECLARED[tag])
        for attr, (typ, default) in decl.items():
            if (key, attr) in INERT:
                continue
            current = elem.get(attr)
            values = _specific(w, tag, attr, current) + _generic(typ, attr, current)
            values = [v for v in dict.fromkeys(values) if not _same_value(typ, v, current, default)]
            if current is not None:
                values.append(DELETE)
            for value in values:
                copy_root = etree.fromstring(xml)
                target = [e for _k, e in _walk(_plan_of(copy_root))][index]
                if value is DELETE:
                    del target.attrib[attr]
                else:
                    target.set(attr, value)
                out.append(Forgery(f"{base}:{_where(elem)}@{attr}={_label(value)}", base,
                                   f"{key}@{attr}", _serialise(copy_root), name))
    return out


def structure_forgeries(w: World, base: str) -> list[Forgery]:
    xml = w.bases[base]
    name = etree.fromstring(xml).findtext("name")
    out = []

    def forge(label, change):
        root = etree.fromstring(xml)
        change(root, _plan_of(root))
        out.append(Forgery(f"{base}:{label}", base, "structure", _serialise(root), name))

    def first_disk(plan):
        return plan.find(Q + "disk")

    def add_disk(plan, target):
        extra = copy.deepcopy(first_disk(plan))
        extra.set("target", target)
        if extra.get("socket"):
            extra.set("socket", f"{w.vhost}/{name}-{target}")
        plan.insert(list(plan).index(first_disk(plan)) + 1, extra)

    def source_is(kind, **attrs):
        def change(root, plan):
            disk = first_disk(plan)
            for old in [c for c in disk if etree.QName(c).localname in ("nvme", "nvmf", "file", "block")]:
                new = etree.Element(Q + kind, **attrs)
                disk.replace(old, new)
        return change

    forge("plan-record-twice", lambda r, p: p.addnext(copy.deepcopy(p)))
    forge("plan-record-removed", lambda r, p: p.getparent().remove(p))
    forge("plan-record-in-another-namespace", lambda r, p: p.set("{urn:x}forged", "1") or
          setattr(p, "tag", "{https://vstor.dev/xmlns/domain/2}plan"))
    forge("plan-record-outside-vstor-block", lambda r, p: (p.getparent().remove(p), r.find("metadata").append(p)))
    forge("plan-disk-duplicated", lambda r, p: first_disk(p).addnext(copy.deepcopy(first_disk(p))))
    forge("plan-disk-removed", lambda r, p: p.remove(first_disk(p)))
    forge("plan-disk-extra-target", lambda r, p: add_disk(p, "vdz"))
    forge("plan-disk-source-removed", lambda r, p: [first_disk(p).remove(c) for c in list(first_disk(p))
                                                     if etree.QName(c).localname in ("nvme", "nvmf", "file", "block")])
    forge("plan-disk-source-is-shadow-file", source_is("file", path="/etc/shadow"))
    forge("plan-disk-source-is-decoy-file", source_is("file", path=w.secret))
    forge("plan-disk-source-is-escaping-symlink", source_is("file", path=f"{w.images}/escape.raw"))
    forge("plan-disk-source-is-victims-image", source_is("file", path=f"{w.images}/victim.raw"))
    forge("plan-disk-source-is-root-disk", source_is("block", path="/dev/sda"))
    forge("plan-disk-source-is-other-nvme", source_is("nvme", controller="0000:3b:00.0"))
    forge("plan-disk-source-is-nvmf", source_is("nvmf", transport="tcp", traddr="10.0.0.1",
                                                subnqn="nqn.2016-06.io.spdk:cnode9"))
    forge("plan-disk-attach-to-10.0.0.1", lambda r, p: first_disk(p).insert(
        1, etree.Element(Q + "attach", trtype="TCP", traddr="10.0.0.1", adrfam="IPv4", trsvcid="4420",
                         subnqn="nqn.2016-06.io.spdk:cnode9")))
    forge("plan-disk-attach-pcie-other-controller", lambda r, p: first_disk(p).insert(
        1, etree.Element(Q + "attach", trtype="PCIe", traddr="0000:3b:00.0")))
    forge("plan-disk-attach-duplicated", lambda r, p: [
        a.addnext(copy.deepcopy(a)) for a in first_disk(p).findall(Q + "attach")[:1]] or
        first_disk(p).set("evil", "1"))
    forge("plan-disk-attach-removed", lambda r, p: [first_disk(p).remove(a) for a in first_disk(p).findall(Q + "attach")]
          or first_disk(p).set("evil", "1"))
    forge("plan-unknown-attribute", lambda r, p: p.set("evil", "1"))
    forge("plan-disk-unknown-attribute", lambda r, p: first_disk(p).set("evil", "1"))
    forge("plan-namespaced-attribute", lambda r, p: first_disk(p).set("{urn:x}socket", "/etc/shadow"))
    forge("plan-unknown-child", lambda r, p: p.insert(0, etree.Element(Q + "exec", cmd="/bin/sh")))
    forge("plan-disk-unknown-child", lambda r, p: first_disk(p).insert(0, etree.Element(Q + "hook", run="/bin/sh")))
    forge("plan-disk-foreign-child", lambda r, p: first_disk(p).insert(0, etree.Element("{urn:x}x")))
    forge("plan-children-out-of-order", lambda r, p: p.insert(0, p.findall(Q + "reason")[-1]))
    forge("plan-text-inside", lambda r, p: setattr(p, "text", "/etc/shadow"))
    forge("plan-disk-text-inside", lambda r, p: setattr(first_disk(p), "text", "/etc/shadow"))
    forge("plan-reason-with-element", lambda r, p: p.find(Q + "reason").append(etree.Element(Q + "x")))
    forge("plan-reason-with-attribute", lambda r, p: p.find(Q + "reason").set("evil", "1"))
    forge("plan-disks-swapped-sockets", lambda r, p: _swap(p, "socket"))
    forge("plan-disks-swapped-sources", lambda r, p: _swap_sources(p))
    return out


def _swap(plan, attr) -> None:
    disks = plan.findall(Q + "disk")
    if len(disks) < 2:
        disks[0].set(attr, "/etc/shadow")
        return
    a, b = disks[0].get(attr), disks[1].get(attr)
    disks[0].set(attr, b)
    disks[1].set(attr, a)


def _swap_sources(plan) -> None:
    disks = plan.findall(Q + "disk")
    if len(disks) < 2:
        disks[0].set("readonly", "yes" if disks[0].get("readonly") != "yes" else "no")
        return
    src = [[c for c in d if etree.QName(c).localname in ("nvme", "nvmf", "file", "block")][0] for d in disks[:2]]
    a, b = copy.deepcopy(src[0]), copy.deepcopy(src[1])
    disks[0].replace(src[0], b)
    disks[1].replace(src[1], a)


def _forgeries() -> list[Forgery]:
    out = []
    for base in WORLD.bases:
        out += attribute_forgeries(WORLD, base) + structure_forgeries(WORLD, base)
    ids = [f.id for f in out]
    assert len(ids) == len(set(ids)), "forgery ids must be unique"
    return out


FORGERIES = _forgeries()


def _group(f: Forgery, per_base: bool) -> tuple:
    kind = f.kind if f.kind != "structure" else f.id.split(":", 1)[1]
    return (f.base, kind) if per_base else (kind,)


def _sample(forgeries: list[Forgery], per_group: int, seed: int, per_base: bool) -> list[Forgery]:
    """A fixed-seed sample holding `per_group` forgeries (or all there are) of
    every attribute kind (element path @ attribute) and structure change, of
    every base if `per_base`."""
    rng = random.Random(seed)
    groups: dict[tuple, list[Forgery]] = {}
    for f in forgeries:
        groups.setdefault(_group(f, per_base), []).append(f)
    picked = []
    for key in sorted(groups):
        picked += rng.sample(groups[key], min(per_group, len(groups[key])))
    return sorted(picked, key=lambda f: f.id)


# All of them (about 2400) run in about 90 s; every attribute of every base's
# record goes through the dry run, every attribute kind through prepare
# (twice) and through the hook.  HOSTILE_ALL=1 runs every forgery everywhere.
if os.environ.get("HOSTILE_ALL"):
    FORGED_BY_ENTRY = {entry: FORGERIES for entry in START}
else:
    FORGED_BY_ENTRY = {
        "dry-run": _sample(FORGERIES, 1, SEED, per_base=True),
        "prepare": _sample(FORGERIES, 2, SEED + 1, per_base=False),
        "hook": _sample(FORGERIES, 1, SEED + 2, per_base=False),
    }

# Forgeries that a bug lets through, by id pattern: the reason.
FORGERY_BUGS: dict[str, str] = {}


def _forged_params():
    for entry, forgeries in FORGED_BY_ENTRY.items():
        for f in forgeries:
            reason = next((r for pattern, r in FORGERY_BUGS.items() if re.search(pattern, f"{entry} {f.id}")), None)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(f, entry, id=f"{entry}-{f.id}", marks=marks)


@pytest.mark.parametrize("forgery, entry", list(_forged_params()))
def test_a_forged_plan_record_is_refused_before_anything_changes(w, forgery, entry):
    assert_refused(w, entry, forgery.xml, forgery.name, {BAD, FIT})


def _hook_jobs(w: World) -> list[tuple[str, bytes]]:
    """The hook runs expected to change nothing (no known bug; not the huge
    inputs, whose time is measured alone)."""
    jobs = [(c.name, case_xml(w, c, "hook")) for c in CASES
            if not c.id.startswith("huge-") and not c.bugs.get("hook", c.bugs.get("*"))]
    jobs += [(f.name, f.xml) for f in FORGED_BY_ENTRY["hook"]
             if not any(re.search(p, f"hook {f.id}") for p in FORGERY_BUGS)]
    return jobs


def test_every_plan_attribute_is_forged_through_every_start_entry_point():
    """The sample covers every declared attribute of every element the bases'
    plan records hold (and every structure change), through each entry point."""
    kinds = {f.kind for f in FORGERIES}
    for tag in ("plan", "plan/disk", "plan/disk/attach", "plan/disk/nvme", "plan/disk/nvmf",
                "plan/disk/file", "plan/disk/block", "plan/disk/nvmf/path", "plan/disk/nvmf/reconnect"):
        for attr in declared_attributes(DECLARED[tag.rsplit("/", 1)[-1]]):
            if (tag, attr) not in INERT:
                assert f"{tag}@{attr}" in kinds, f"no base's plan record has <{tag}> to forge {attr} on"
    structures = {f.id.split(":", 1)[1] for f in FORGERIES if f.kind == "structure"}
    for entry, forgeries in FORGED_BY_ENTRY.items():
        assert {f.kind for f in forgeries} == kinds, entry
        assert {f.id.split(":", 1)[1] for f in forgeries if f.kind == "structure"} == structures, entry


def test_the_dry_run_of_a_rendered_10k_disk_domain_is_bounded_and_changes_nothing(w):
    xml = render_in(w, _ten_thousand_disks(w, existing=True).encode(), "10k")
    o = assert_refused(w, "dry-run", xml, "hx1", 0)
    assert o.out.count("would start qemu-storage-daemon") == 10000


# -- what a forged plan may change without a refusal: nothing but itself ---------------------------
#
# The plan's `host` (where it was made) and its reasons decide nothing and are
# compared by nothing: a forged one must be carried out exactly as the honest
# plan is.  This is also the harness's own check: the honest start is seen by
# the snapshot (a daemon, a socket, a record), and its release puts the host back.

def _inert_forgeries(w: World) -> dict[str, bytes]:
    xml = w.bases["qsd-file"].decode()
    assert ' host="compute-7"' in xml and "<vstor:reason>" in xml
    return {
        "host=other-host": xml.replace(' host="compute-7"', ' host="other-host"', 1).encode(),
        "host-deleted": xml.replace(' host="compute-7"', "", 1).encode(),
        "reasons-rewritten": re.sub(r"<vstor:reason>[^<]*</vstor:reason>",
                                    "<vstor:reason>exported /etc/shadow&#10;\u202e&#9;a second line</vstor:reason>", xml).encode(),
    }


def _normalised(changes: list[str]) -> list[str]:
    """What changed, without pids, inodes, times and record contents."""
    return sorted({re.sub(r"qsd-pid:\d+", "qsd-pid:N", c.split(": ", 1)[0]) for c in changes})


_HONEST: dict[str, list[str]] = {}


def _start_and_release(w: World, entry: str, xml: bytes) -> tuple[Outcome, list[str]]:
    """Start for real through `entry`, release the same way (the hook's
    `release end`, or `vstor release`); the start's outcome, and whatever
    the release left changed."""
    before = w.snapshot()
    o = _run_keeping(w, entry, xml)
    if entry == "hook":
        code, _, err = hook(w, "demo1", xml, op="release")
    else:
        code, _, err = cli(w, "release", "--force", "demo1")
    left = snapshot.diff(before, w.snapshot())
    if code != 0 or left:
        _clean_up(w, "demo1", xml, before)
    assert code == 0, err
    return o, left


def _run_keeping(w: World, entry: str, xml: bytes) -> Outcome:
    """run_entry without its clean-up: this start is meant to succeed."""
    path = w.write("case.xml", xml)
    before = w.snapshot()
    t0 = time.monotonic()
    if entry == "hook":
        code, out, err = hook(w, "demo1", xml)
    else:
        code, out, err = cli(w, "prepare", *(["--dry-run"] if entry == "dry-run" else []), path)
    return Outcome(entry, code, out, err, time.monotonic() - t0, snapshot.diff(before, w.snapshot()))


@pytest.mark.parametrize("label", ["host=other-host", "host-deleted", "reasons-rewritten"])
@pytest.mark.parametrize("entry", START)
def test_an_inert_plan_field_is_carried_out_exactly_as_the_honest_plan(w, entry, label):
    forged = _inert_forgeries(w)[label]
    if entry == "dry-run":
        o = _run_keeping(w, entry, forged)
        assert (o.code, o.changes) == (0, []), o.err
        assert o.out == w.base_dry_run["qsd-file"]
        return
    if entry not in _HONEST:
        honest, left = _start_and_release(w, entry, w.bases["qsd-file"])
        assert honest.code == 0 and not left, (honest.err, left)
        _HONEST[entry] = _normalised(honest.changes)
        assert any(c.startswith("added   qsd-pid:") for c in _HONEST[entry]), "the snapshot must see a start"
        assert any("/vhost/demo1-vdb" in c for c in _HONEST[entry])
    o, left = _start_and_release(w, entry, forged)
    assert (o.code, o.err) == (0, ""), o.err
    assert _normalised(o.changes) == _HONEST[entry]
    assert not left, left


# -- block devices judged by what they stack on (issue 28) -----------------------------------------
#
# The world's host (_host_layout) has dm-0 on loop0, md5 on loop1 and nbd0:
# each serves a file vstor never opened.  Each is refused when planned; and a
# plan made for the free disk sdb, then re-pointed at one (metadata and plan,
# the digest made anew: it is no signature), is refused at start with the
# planner's own words, before anything changes.

STACKED = {"dm-over-loop": "/dev/dm-0", "md-over-loop": "/dev/md5", "nbd": "/dev/nbd0"}


def _block_domain(w: World, path: str) -> str:
    return domain_xml(w, name="stk1", disks=f"<vstor:disk target='vdb'><vstor:block path='{path}'/></vstor:disk>")


def _repointed(w: World, path: str) -> bytes:
    from vstor.meta.document import Domain
    from vstor.meta.metadata import digest
    from vstor.planner import Request
    xml = render_in(w, _block_domain(w, "/dev/sdb").encode(), "stacked-sdb").decode().replace("/dev/sdb", path)
    (old,) = set(re.findall(r'digest="(sha256:[0-9a-f]{64})"', xml))
    return xml.replace(old, digest(Request.from_domain(Domain.parse(xml)).intent)).encode()


@pytest.mark.parametrize("entry", ["plan", "render"])
@pytest.mark.parametrize("label", STACKED)
def test_a_block_device_on_a_file_vstor_never_opened_is_refused_when_planned(w, label, entry):
    o = assert_refused(w, entry, _block_domain(w, STACKED[label]).encode(), "stk1", BAD)
    assert o.err.startswith(f"vstor: error: {STACKED[label]} ")


@pytest.mark.parametrize("entry", START)
@pytest.mark.parametrize("label", STACKED)
def test_a_plan_repointed_at_such_a_device_is_refused_at_start_with_the_planners_words(w, label, entry):
    path = STACKED[label]
    o = assert_refused(w, entry, _repointed(w, path), "stk1", FIT)
    reason = o.err.split("cannot start: ", 1)[1].split(" (if the host changed for good", 1)[0]
    assert reason.startswith(f"{path} ") and ("loop device" in reason or "nbd" in reason)
    assert cli(w, "plan", w.write("stk1.xml", _block_domain(w, path)))[2].startswith(f"vstor: error: {reason} (")


# -- the state directory: root's alone, and vstor's files in it never followed nor blocked on ------
#
# vstor trusts its records because root alone can write them (threats.md).
# A state directory someone else may change is refused before anything is
# read from it or done; a link planted at a name vstor writes is replaced,
# never written through; a record that is no regular file is damaged (exit
# 4) and found without blocking.  Each ran against a host of its own (no
# victim): these break the state directory on purpose.

@pytest.fixture
def bare():
    w = World()
    yield w
    planted = f"{w.state}/domains/x.json"         # what a test put there, whatever it is
    if os.path.isdir(planted) and not os.path.islink(planted):
        os.rmdir(planted)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(planted)
    cli(w, "release", "--force", "hx1")
    w.remove()


def _domain_in(w: World) -> str:
    xml = domain_xml(w)
    code, _, err = cli(w, "render", w.write("hx1-in.xml", xml), "-o", f"{w.cases}/hx1.xml")
    assert code == 0, err
    return f"{w.cases}/hx1.xml"


def _one_line(err: str) -> bool:
    return err.startswith("vstor: error: ") and err.count("\n") == 1 and "Traceback" not in err


NOBODY = 65534


@pytest.mark.parametrize("how", ["owner", "mode", "parent", "domains", "link"])
def test_a_state_directory_anyone_else_may_change_is_refused_before_anything(bare, how):
    w = bare
    xml = _domain_in(w)
    os.makedirs(f"{w.state}/domains", mode=0o700)
    where = w.state
    if how == "owner":
        os.chown(w.state, NOBODY, -1)
    elif how == "mode":
        os.chmod(w.state, 0o777)
    elif how == "parent":
        where = w.dir
        os.chmod(w.dir, 0o777)
    elif how == "domains":
        where = f"{w.state}/domains"
        os.chmod(where, 0o733)
    else:                       # the configured path is a link someone else owns
        os.rename(w.state, f"{w.dir}/real-state")
        os.symlink(f"{w.dir}/real-state", w.state)
        os.lchown(w.state, NOBODY, -1)
    before = w.snapshot()
    for args in (("status",), ("prepare", "--dry-run", xml), ("prepare", xml), ("gc",)):
        code, out, err = cli(w, *args)
        assert code == 4 and _one_line(err), (args, code, err)
        fix = f"chown -h root:root {where}" if how == "link" else "chmod go-w"     # not the link's target
        assert f"{where} " in err and "not root's alone" in err and fix in err, err
    assert snapshot.diff(before, w.snapshot()) == []
    assert not os.path.exists(f"{w.vhost}/hx1-vdb")


def _plant(w: World, at: str, names, directories: bool = False) -> dict[str, str]:
    """A link at each of `names` (under `at`) to a file of root's own
    outside, or to a directory holding one: link -> target."""
    planted = {}
    for name in names:
        target = f"{w.outside}/{name.replace('/', '-')}"
        if directories:
            os.makedirs(target)
        with open(f"{target}/kept" if directories else target, "w") as f:
            f.write("root's own\n")
        link = f"{at}/{name}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        os.symlink(target, link)
        planted[link] = target
    return planted


def _not_written_through(planted: dict[str, str]) -> None:
    for link, target in planted.items():
        if os.path.isdir(target):
            assert os.listdir(target) == ["kept"], f"{link} was written through"
            target = f"{target}/kept"
        with open(target) as f:
            assert f.read() == "root's own\n", f"{link} was written through"


def test_an_index_its_owner_forged_frees_no_cores_for_a_second_domain(bare):
    """Issue 28's input: the owner of a state directory that is not root's
    forged the index so that it held nothing, and a second domain planned
    onto the first one's dedicated cores started too (both exit 0).  The
    second start is refused before the index is read (exit 4), and the
    first keeps its cores and daemon."""
    w = bare
    dedicated = "<vstor:vm cpus='dedicated'/>"
    first = w.write("hx1.xml", render_in(w, domain_xml(w, vm=dedicated).encode(), "first"))
    second = w.write("hx2.xml", render_in(w, domain_xml(w, name="hx2", vm=dedicated,
                                                        disks=file_disk(f"{w.images}/data.raw")).encode(), "second"))
    pins = [re.search(r'pins="([0-9,]+)"', open(p).read()).group(1) for p in (first, second)]
    assert pins[0] == pins[1], pins         # planned alone, both ask for the same cores
    code, _, err = cli(w, "prepare", first)
    assert code == 0, err
    index = f"{w.state}/index"
    with open(f"{index}/sums.json") as f:
        sums = json.load(f)
    assert sums["cpus"], sums
    sums["cpus"] = {}                       # the forgery: nobody holds a core
    with open(f"{index}/sums.json", "w") as f:
        json.dump(sums, f)
    owned = [w.state] + [os.path.join(top, n) for top, dirs, files in os.walk(w.state) for n in dirs + files]
    for p in owned:
        os.lchown(p, NOBODY, -1)
    try:        # a process of its own, as every start is (one vstor process trusts what it checked)
        with open(second, "rb") as f:
            code, _, err = hook(w, "hx2", f.read())
        assert code == 4 and err.count("\n") == 1 and "not root's alone" in err, (code, err)
        assert not os.path.exists(f"{w.vhost}/hx2-vdb")
    finally:
        for p in owned:
            os.lchown(p, 0, -1)
        cli(w, "release", "--force", "hx2")     # had it started (the bug), its daemon goes
    assert os.path.exists(f"{w.vhost}/hx1-vdb")


def test_links_planted_at_the_names_vstor_writes_are_never_written_through(bare):
    """What root's own state files are replaced by is vstor's JSON at
    vstor's own names, never a file a link there points at: the temporary
    each save writes beside what it replaces (a record, the index's sums and
    summaries, the plans' cache: vstor.runtime.recordfile.write_text), the
    index's dirty mark, the directories its rebuild builds aside
    (index.new, index.old), the locks, and what vstor writes outside its
    state directory (vstor.atomic).  Each name is one vstor reaches: the
    link there is gone afterwards, replaced or refused."""
    w = bare
    xml = _domain_in(w)
    for args in (("prepare", xml), ("release", "hx1")):        # the index made
        code, _, err = cli(w, *args)
        assert code == 0, err
    index = os.stat(f"{w.state}/index").st_ino
    # Saves under an index that is trusted as it is.  The plans' cache is
    # written by define, its temporary named by the writer's pid: this
    # process's, as cli() runs vstor in it.
    saves = _plant(w, w.state, ("domains/hx1.json.tmp", "index/sums.json.tmp", "index/keys/hx1.json.tmp",
                                f"plans.json.{os.getpid()}.tmp"))
    try:
        code, _, err = cli(w, "define", w.write("hx2-in.xml", domain_xml(w, name="hx2")))
        assert code == 0, err
    finally:
        with contextlib.suppress(Exception):        # test:///default is shared while a connection is open
            libvirt = pytest.importorskip("libvirt")
            libvirt.open("test:///default").lookupByName("hx2").undefine()
    code, _, err = cli(w, "prepare", xml)
    assert code == 0, err
    _not_written_through(saves)
    assert [link for link in saves if os.path.islink(link)] == []
    assert os.stat(f"{w.state}/index").st_ino == index          # no rebuild took the links away
    # A change under way (the dirty mark) is found, and the index rebuilt
    # aside past what is at the names it builds in.
    rebuild = {**_plant(w, w.state, ("index/dirty",)),
               **_plant(w, w.state, ("index.new", "index.old"), directories=True)}
    code, _, err = cli(w, "release", "hx1")
    assert code == 0, err
    assert os.stat(f"{w.state}/index").st_ino != index
    assert [link for link in rebuild if os.path.lexists(link)] == []
    _not_written_through(rebuild)
    # A lock file that is a link is refused: nothing is started.
    locks = _plant(w, w.state, ("lock", "plan.lock"))
    for args in (("define", w.write("hx2-in.xml", domain_xml(w, name="hx2"))), ("prepare", xml)):
        code, out, err = cli(w, *args)
        assert code == 4 and _one_line(err) and "Too many levels of symbolic links" in err, (args, code, err)
    assert not os.path.exists(f"{w.vhost}/hx1-vdb")
    _not_written_through(locks)
    for link in locks:
        os.unlink(link)
    # Outside the state directory: a temporary made anew, never opened through a link.
    out = f"{w.cases}/out.xml"
    written = _plant(w, w.cases, (f"out.xml.tmp.{os.getpid()}",))
    code, _, err = cli(w, "render", w.write("hx1-in.xml", domain_xml(w)), "-o", out)
    assert code == BAD and _one_line(err) and f"cannot write {out}: File exists" in err, (code, err)
    assert not os.path.lexists(out)
    _not_written_through(written)


def test_planning_refuses_a_state_directory_anyone_else_may_change(bare):
    """(review i28) Planning reads the state directory too (what domains
    prepared outside libvirt hold, and plans.json): only one vstor may not
    read (not root) is a warning; one someone else may change is refused,
    as docs/security.md says."""
    w = bare
    xml = w.write("hx1-in.xml", domain_xml(w))
    os.makedirs(f"{w.state}/domains", mode=0o700)
    os.chown(w.state, NOBODY, -1)
    for args in (("plan", xml), ("render", xml), ("define", "--dry-run", xml), ("nova", "config")):
        code, out, err = cli(w, *args)
        assert code == 4 and _one_line(err) and "not root's alone" in err, (args, code, err)


# (review i28) Reached through a chain of links, the kernel passes through
# every directory and link on the way: one someone else may change there
# re-points the state directory after any check.
@pytest.mark.parametrize("how", ["their-link", "roots-link-in-their-directory"])
def test_a_state_directory_reached_through_a_link_someone_else_may_change_is_refused(bare, how):
    w = bare
    xml = _domain_in(w)
    real, theirs = f"{w.dir}/real-state", f"{w.dir}/theirs"
    os.makedirs(f"{real}/domains", mode=0o700)
    os.mkdir(theirs)
    os.chown(theirs, NOBODY, -1)
    if how == "their-link":         # in root's directory, a link of theirs
        link, where = f"{w.dir}/link", f"{w.dir}/link "
        os.symlink(real, link)
        os.lchown(link, NOBODY, -1)
    else:                           # root's link, in their directory
        link, where = f"{theirs}/link", f"{theirs} "
        os.symlink("../real-state", link)
    os.symlink(link, w.state)
    for args in (("status",), ("prepare", "--dry-run", xml)):
        code, out, err = cli(w, *args)
        assert code == 4 and _one_line(err), (args, code, err)
        assert "not root's alone" in err and where in err, err
        if how == "their-link":
            assert f"(chown -h root:root {link};" in err, err


def _fifo(path):
    os.mkfifo(path)


def _zero(path):
    os.symlink("/dev/zero", path)


def _directory(path):
    os.mkdir(path)


def _socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def _link_to_a_record(path):
    with open(path + ".elsewhere", "w") as f:
        f.write('{"format":1,"key":"x","domain":"x","uuid":null,"status":"prepared","holding":{},'
                '"steps":[],"updated":0}')
    os.symlink(path + ".elsewhere", path)


@pytest.mark.parametrize("make", [_fifo, _zero, _directory, _socket, _link_to_a_record],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_record_that_is_not_a_regular_file_is_damaged_and_found_without_blocking(bare, make):
    w = bare
    xml = _domain_in(w)
    os.makedirs(f"{w.state}/domains", mode=0o700)
    make(f"{w.state}/domains/x.json")
    for args, want in ((("status",), 1), (("prepare", "--dry-run", xml), 4), (("prepare", xml), 4),
                       (("gc",), 4)):
        t0 = time.monotonic()
        code, out, err = _in_thread(lambda: cli(w, *args), TIME_LIMIT)
        assert time.monotonic() - t0 < TIME_LIMIT
        assert code == want and "Traceback" not in out + err, (args, code, out, err)
        assert "x.json is damaged (it is " in out + err, (args, out, err)
    assert not os.path.exists(f"{w.vhost}/hx1-vdb")


def _in_thread(fn, timeout: float):
    """fn() in a thread: a hang fails the test instead of stopping the suite."""
    import threading
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"did not finish within {timeout:g}s (it blocks)"
    return box[0]


# -- issue 28: numbers and sources that were internal errors ------------------------------------
#
# A guest cell's memory of 400 digits reached float arithmetic (OverflowError);
# a cell's CPU range in non-ASCII digits was expanded whole (a billion CPUs);
# a link into /proc of a process that ended raised from the walk's readlink.
# So was a plan record's version of 4,400 digits, or '²'.  Each is now a
# one-line refusal, exit 2.  The cells and the version are a rendered
# domain's own, edited: plan and render re-plan without reading them.

def _cell(w: World, new: str) -> bytes:
    return _edited(w, 'id="0" cpus="0-0" memory="524288" unit="KiB"', new)


_CELLS_READ_AT_START = {"plan": 0, "render": 0}
NUMBER_CASES = [
    Case("cell-memory-400-digits-KB", lambda w: _cell(w, f'id="0" cpus="0-0" memory="{"9" * 400}" unit="KB"'),
         expect=_CELLS_READ_AT_START),
    Case("cell-memory-over-1-EiB", lambda w: _cell(w, f'id="0" cpus="0-0" memory="{2**50 + 1}" unit="KiB"'),
         expect=_CELLS_READ_AT_START),
    Case("cell-cpus-arabic-indic-billion", lambda w: _cell(w, 'id="0" cpus="0-١٠٠٠٠٠٠٠٠٠" memory="524288" '
                                                             'unit="KiB"'), expect=_CELLS_READ_AT_START),
    Case("cell-id-fullwidth", lambda w: _cell(w, 'id="０" cpus="0-0" memory="524288" unit="KiB"'),
         expect=_CELLS_READ_AT_START),
    # the plan record's version, compared as a number: plan and render re-plan over it
    Case("plan-version-superscript", lambda w: _edited(w, 'version="2"', 'version="²"'),
         expect=_CELLS_READ_AT_START),
    Case("plan-version-4400-digits", lambda w: _edited(w, 'version="2"', f'version="{"9" * 4400}"'),
         expect=_CELLS_READ_AT_START),
]


@pytest.mark.parametrize("case, entry", list(_entry_params(NUMBER_CASES)))
def test_a_number_vstor_cannot_read_is_refused_with_one_line(w, case, entry):
    assert_refused(w, entry, case_xml(w, case, entry), case.name, case.expected(entry))


@pytest.fixture
def ended(w):
    """A link in the image root into /proc/PID/cwd of a process that has
    ended (tests.ended_process)."""
    child = ended_process()
    link = f"{w.images}/proc.raw"
    os.symlink(f"/proc/{child.pid}/cwd/a.raw", link)
    yield link
    os.unlink(link)
    child.wait()


@pytest.mark.parametrize("entry", START)
def test_a_link_into_proc_of_an_ended_process_is_refused_at_start(w, ended, entry):
    xml = render_in(w, domain_xml(w, disks=file_disk(ended)).encode(), "proc")     # not there: the start's to refuse
    o = assert_refused(w, entry, xml, "hx1", BAD)
    assert "No such file or directory" in o.err


def test_define_refuses_a_link_out_of_the_image_root_as_the_start_does(w):
    xml = domain_xml(w, disks=file_disk(f"{w.images}/escape.raw")).encode()
    started = render_in(w, xml, "escape")
    start = assert_refused(w, "dry-run", started, "hx1", BAD).err
    assert "outside the image roots" in start
    for args in (["define", "--dry-run"], ["define"], ["plan"], ["render"]):
        code, _, err = cli(w, *args, w.write("escape.xml", xml))
        assert (code, err) == (BAD, start), args


def test_the_prepared_mark_is_written_only_at_vstors_own_name_and_never_through_a_link(bare):
    """(review i30) The fw_cfg entry's file is chosen by whoever wrote the
    domain's XML: anything but <vhost_dir>/<domain>.vstor-prepared is
    refused, and nothing is written there.  At vstor's own name a symbolic
    or a hard link (one a writer of a vhost directory shared with an
    unprivileged SPDK may plant; protected_hardlinks only guards files the
    planter cannot write) is refused: the file it names keeps its content,
    owner and mode."""
    w = bare
    xml = _domain_in(w)
    with open(xml) as f:
        text = f.read()
    mark = f"{w.vhost}/hx1.vstor-prepared"
    assert mark in text
    other = f"{w.outside}/root-file"
    with open(other, "w") as f:
        f.write("root's own\n")
    os.chmod(other, 0o600)
    code, _, err = cli(w, "prepare", w.write("hx1-other.xml", text.replace(mark, other)))
    assert code == BAD and _one_line(err) and f"vstor writes it only at {mark}" in err, (code, err)
    os.makedirs(w.vhost, exist_ok=True)
    for plant in (os.symlink, os.link):
        plant(other, mark)
        code, _, err = cli(w, "prepare", xml)
        assert code != 0 and _one_line(err) and mark in err, (plant, code, err)
        with open(other) as f:
            assert f.read() == "root's own\n", plant
        assert os.stat(other).st_mode & 0o777 == 0o600 and os.stat(other).st_gid == 0, plant
        os.unlink(mark)
    assert not os.path.exists(f"{w.state}/domains/hx1.json")       # rolled back
