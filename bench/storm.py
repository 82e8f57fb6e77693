"""A boot storm: many vstor domains with qemu-storage-daemon file disks
prepared at once through the installed hook, as libvirt runs it for
autostarted domains after a host restart, then released at once; and what
checks that it held.  bench/bench_storm.py times it, tests/test_storm.py
checks it.

The domains are planned on a synthetic host (tests/hostlayout) big enough to
give every one its own dedicated cores; the hook reads that host
(VSTOR_HOST_ROOT) and runs real daemons here, unpinned (the planned CPUs are
the synthetic host's: vstor.runtime.kinds.qsd_export's _here).  Everything
lives under one directory: the host tree, the configuration, the state,
socket and daemon directories, the images and the installed hook.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid as uuidlib

# What one qemu-storage-daemon with aio=native takes of the host's AIO
# budget (fs.aio-max-nr, shared by every process): vstor's own figure.
from bench.sanity import NO_SUPERVISOR
from vstor.backends.qsd.aio import EVENTS as QSD_AIO_EVENTS

NS = "https://vstor.dev/xmlns/domain/1"
TARGETS = "bcdefghijklmnopq"
DOMAIN = """<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid>
<memory unit='MiB'>256</memory><vcpu>{vcpus}</vcpu><metadata><vstor:vstor xmlns:vstor='{ns}'>
<vstor:vm cpus='{cpus}'/>{disks}</vstor:vstor></metadata><devices/></domain>"""


def layout(cores: int) -> dict:
    """A two-node host with `cores` physical cores (SMT 2) per node."""
    node = {"cores": cores, "memory": "64GiB"}
    return {"hostname": "storm", "smt": 2, "thp": "never", "node": [node, node]}


class World:
    """The storm's host, configuration, images and domains, under `work`:
    `domains` named storm00, storm01, ..., each with `disks` file disks and
    2 vCPUs; plan() makes their XML.  `here`: planned on this machine
    instead (few cores: cpus='shared'), its daemons pinned as planned."""

    def __init__(self, domains: int, disks: int, here: bool = False):
        from tests.hostlayout import build_tree
        self.work = tempfile.mkdtemp(prefix="vstor-storm-", dir="/var/tmp")   # short: sockets
        os.chmod(self.work, 0o755)
        # Two nodes of SMT-2 cores: room for every domain's dedicated vCPUs,
        # with each node's first core kept for housekeeping.
        self.root = "/" if here else build_tree(layout(domains // 2 + 2), os.path.join(self.work, "host"))
        self.images = os.path.join(self.work, "images")
        os.mkdir(self.images)
        self.conf = os.path.join(self.work, "vstor.conf")
        with open(self.conf, "w") as f:
            f.write(f"[paths]\nstate_dir = {self.work}/state\nvhost_dir = {self.work}/vhost\n"
                    f"qsd_dir = {self.work}/qsd\nimages = {self.images}\n{NO_SUPERVISOR}")
        self.cfg = self.config()
        self.disks = disks
        self.names = [f"storm{i:02d}" for i in range(domains)]
        self.xml: dict[str, bytes] = {}
        self.plans: dict = {}
        self.sources: dict[str, list[str]] = {}
        self.hook = self._install_hook()

    def config(self):
        from vstor import config
        return config.load(self.conf)

    def plan(self, together: bool = True, cpus=lambda i: "dedicated", shared=frozenset()) -> "World":
        """Plan every domain.  `together`: each against those planned before
        it, as `vstor define` does one after the other (no two collide);
        otherwise each against an empty ledger (their plans may collide).
        cpus(i): domain i's cpus= policy; `shared`: the domains whose first
        disk is one image, the same for all of them."""
        from vstor.host.read import read_host
        from vstor.host.sysfs import SysFS
        from vstor.meta.document import Domain
        from vstor.planner import Request, plan_domain
        from vstor.planner.ledger import Holding, Ledger
        from vstor.render.libvirt import render
        host = read_host(SysFS(self.root), processes=False)
        held = []
        for i, name in enumerate(self.names):
            paths = [self._image("shared" if i in shared and t == 0 else f"{name}-vd{TARGETS[t]}")
                     for t in range(self.disks)]
            xml = "".join(f"<vstor:disk target='vd{TARGETS[t]}'><vstor:file path='{p}'/></vstor:disk>"
                          for t, p in enumerate(paths))
            dom = Domain.parse(DOMAIN.format(name=name, uuid=self.uuid(name), vcpus=2, ns=NS,
                                             cpus=cpus(i), disks=xml))
            plan = plan_domain(host, self.cfg, Request.from_domain(dom), Ledger(held))
            if together:
                held.append(Holding.from_plan(plan))
            self.plans[name] = plan
            self.sources[name] = paths
            self.xml[name] = render(dom, plan).to_string().encode()
        return self

    @staticmethod
    def uuid(name: str) -> str:
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, name))

    def _image(self, stem: str) -> str:
        path = os.path.join(self.images, stem + ".raw")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.truncate(16 << 20)
            os.chmod(path, 0o666)   # the yardstick's confined daemons need no ACL entry
        return path

    def _install_hook(self) -> str:
        from vstor.cli.hooks import render_hook
        path = os.path.join(self.work, "qemu")
        with open(path, "w") as f:
            f.write(render_hook(self.conf))
        os.chmod(path, 0o755)
        return path

    # -- what each domain should hold ------------------------------------------------------

    def sockets(self, name: str) -> list[str]:
        return [d.socket for d in self.plans[name].disks]

    def dedicated(self, name: str) -> set[int]:
        return set(self.plans[name].dedicated_cpus)

    # -- the hook, as libvirt runs it ----------------------------------------------------------

    def env(self) -> dict:
        """libvirt runs hooks with a scrubbed environment; the host root is
        the synthetic host's."""
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "VSTOR_HOST_ROOT": self.root}

    def launch(self, name: str, op: str) -> "Run":
        sub = "begin" if op == "prepare" else "end"
        return Run(name, op, self.hook, [name, op, sub, "-"], self.xml[name], self.env())

    def storm(self, ops: list[tuple[str, str]]) -> tuple[float, list["Run"]]:
        """Run (domain, operation) pairs all at once; the wall time until
        the last one ended, and each run."""
        t0 = time.perf_counter()
        runs = [self.launch(name, op) for name, op in ops]
        for r in runs:
            r.wait()
        return time.perf_counter() - t0, runs

    def cleanup(self) -> list[str]:
        """Leave nothing behind, also after a failure half-way: each record
        released through vstor, stray daemons under `work` stopped.  What
        had to be cleaned up this way (the bench's sanity problems)."""
        from vstor.host.sysfs import SysFS
        from vstor.runtime.executor import Runtime
        from vstor.runtime.recorded import release
        from vstor.runtime.state import StateDir
        said = []
        state = StateDir(self.cfg.state_dir)
        try:
            for rec in state.records():
                said.append(f"record {rec.key} left")
                release(Runtime(self.cfg, SysFS(self.root)), state, rec.key, progress=lambda _: None)
        except Exception as e:      # noqa: BLE001 (say it, go on cleaning)
            said.append(f"release during cleanup: {type(e).__name__}: {e}")
        for pid, argv in daemons_under(self.work):
            said.append(f"daemon {pid} left")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.work, ignore_errors=True)
        return said


class Run:
    """One hook process: started on construction, in a session of its own
    (libvirtd's children are not in its process group either)."""

    def __init__(self, name: str, op: str, argv0: str, args: list[str], xml: bytes, env: dict):
        self.name, self.op = name, op
        self.err = tempfile.TemporaryFile()
        # The XML through a pipe, as libvirt gives it: written from here, it
        # fits the pipe's buffer (64 KiB) so no writer thread is needed.
        self.proc = subprocess.Popen([argv0, *args], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=self.err, env=env, start_new_session=True)
        self.proc.stdin.write(xml)
        self.proc.stdin.close()
        self.rc: int | None = None
        self.stderr = ""

    def wait(self, timeout: float = 120) -> int:
        self.rc = self.proc.wait(timeout)
        self.err.seek(0)
        self.stderr = self.err.read().decode(errors="replace").strip()
        self.err.close()
        return self.rc

    def kill(self) -> None:
        """SIGKILL the hook's whole process group (the shell, its Python,
        a daemon not yet detached from it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __repr__(self) -> str:
        return f"{self.name} {self.op}: exit {self.rc}" + (f" ({self.stderr})" if self.stderr else "")




def aio_room() -> int:
    """How many more daemons with aio=native the host's AIO budget allows now."""
    with open("/proc/sys/fs/aio-max-nr") as f, open("/proc/sys/fs/aio-nr") as g:
        return (int(f.read()) - int(g.read())) // QSD_AIO_EVENTS


def daemons_under(work: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every qemu-storage-daemon whose --pidfile lies under `work`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "qemu-storage-daemon" and \
                pidfile_of(argv).startswith(work.rstrip("/") + "/"):
            found.append((int(entry), argv))
    return found


def pidfile_of(argv: list[str]) -> str:
    """A daemon's --pidfile argument; "" without one."""
    i = argv.index("--pidfile") + 1 if "--pidfile" in argv else len(argv)
    return argv[i] if i < len(argv) else ""
