"""What bench_scale.py fills a host with: state records of other domains,
and libvirt domains that carry vstor plans.

Records are made as vstor makes them: the holding through the planner's
Holding and holding_to_json, the steps through vstor.runtime.actions'
step classes and to_json, each saved with StateDir.save (so the index is
kept as a start keeps it).  Each filler domain has two qemu-storage-daemon
file disks (its own sockets, sources and daemon names) and two done
qsd-export steps; one in five of the first DEDICATED * 5 holds a dedicated
core pair.  Their CPU ids start at FIRST_CPU, above this machine's, so that
no filler holds what the measured domain's plan uses (a core, memory bound
to a node: none of them binds memory), as on a large host where each of a
few hundred dedicated domains has its own core and the rest share.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from types import SimpleNamespace

FIRST_CPU = 64
DEDICATED = 128         # core pairs: a 256-thread host's worth


def filler_name(i: int) -> str:
    return f"fill{i:05d}"


def filler_record(i: int, cfg, images: str):
    """The state record of filler domain `i`, prepared."""
    from vstor.backends.qsd.export import QsdExport as QsdSpec
    from vstor.meta.names import socket_path, volume_keys
    from vstor.planner.ledger import Holding, holding_to_json
    from vstor.runtime.actions import QsdExport, to_json
    from vstor.runtime.state import PREPARED, Record
    name = filler_name(i)
    exports = [QsdSpec(run_dir=cfg.qsd_dir, name=f"{name}-{t}", kind="file",
                       source=os.path.join(images, f"{name}-{t}.raw"),
                       socket_path=socket_path(cfg.vhost_dir, name, t), qemu_user=cfg.qemu_user,
                       qemu_group=cfg.qemu_group, cpus=(0,))
               for t in ("vdb", "vdc")]
    pair = i // 5
    cpus = (FIRST_CPU + 2 * pair, FIRST_CPU + 2 * pair + 1) if i % 5 == 0 and pair < DEDICATED else ()
    ident = str(uuid.UUID(int=i + 1))
    held = Holding(domain=name, uuid=ident, active=True, node=0, cpus=frozenset(cpus), reactors=(),
                   hugepages=(), memory=(), passthrough=frozenset(), spdk_controllers=frozenset(),
                   volumes=frozenset((key, False) for e in exports
                                     for key in volume_keys(SimpleNamespace(kind="file", path=e.source))),
                   sockets=frozenset(e.socket_path for e in exports))
    return Record(key=name, domain=name, uuid=ident, status=PREPARED, holding=holding_to_json(held),
                  steps=[to_json(QsdExport(e), "done") for e in exports])


def fill(state, cfg, images: str, start: int, stop: int) -> None:
    """Filler records start..stop-1, each through StateDir.save."""
    for i in range(start, stop):
        state.save(filler_record(i, cfg, images))


# -- libvirt's test driver with many domains -------------------------------------------

def plan_host_layout() -> dict:
    """bench_plan.make_host's host as a sysfs tree (tests/hostlayout):
    8 NUMA nodes x 32 cores with SMT, 64 NVMe controllers."""
    return {"hostname": "bench", "smt": 2,
            "node": [{"cores": 32, "memory": "256GiB", "hugepages": {"2M": 65536}} for _ in range(8)],
            "nvme": [{"address": f"0000:{0x10 + i:02x}:00.0", "node": i % 8} for i in range(64)]}


def reactors() -> tuple[int, ...]:
    return tuple(n * 32 for n in range(8))


def node_file(path: str, count: int, host, cfg) -> None:
    """A node file for libvirt's test driver (test:///PATH) defining `count`
    domains as `vstor render` writes them: bench_plan's ledger domains (an
    SPDK NVMe namespace and a qsd file each), planned on `host`.  They
    leave its last controller to the planned domain (bench_plan.REQUEST):
    the others' namespace 1 is served to a domain in every 63."""
    from bench.bench_plan import LEDGER_DOMAIN
    from vstor.meta.document import Domain
    from vstor.planner import Request, plan_domain
    from vstor.planner.ledger import Ledger
    from vstor.render.libvirt import render
    with open(path, "w") as f:
        f.write("<node>\n")
        for i in range(count):
            ctrl = host.controllers[i % (len(host.controllers) - 1)].address
            # A UUID of its own, as libvirt keeps it: the test driver makes up
            # a new one at every open for a domain without.
            xml = LEDGER_DOMAIN.format(i=i, ctrl=ctrl).replace(
                "</name>", f"</name><uuid>{uuid.UUID(int=(1 << 64) + i)}</uuid>", 1)
            dom = Domain.parse(xml)
            dom = render(dom, plan_domain(host, cfg, Request.from_domain(dom), Ledger()))
            f.write(dom.to_string() + "\n")
        f.write("</node>\n")


@contextlib.contextmanager
def private_libvirtd(where: str, timeout: float = 30.0):
    """A libvirtd of its own (as nobody, in session mode, everything under
    `where`), so that vstor reads the test driver's domains over libvirt's
    RPC as it reads a host's: the node file parsed and each XML formatted
    in libvirtd, not in vstor's process.  Yields uri(node file)."""
    import pwd
    nobody = pwd.getpwnam("nobody")
    dirs = {k: os.path.join(where, k) for k in ("run", "home", "config")}
    for d in dirs.values():
        os.makedirs(d)
        os.chown(d, nobody.pw_uid, nobody.pw_gid)
    env = {"HOME": dirs["home"], "XDG_RUNTIME_DIR": dirs["run"], "XDG_CONFIG_HOME": dirs["config"],
           "XDG_CACHE_HOME": dirs["home"], "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    sock = os.path.join(dirs["run"], "libvirt", "libvirt-sock")
    with open(os.path.join(where, "libvirtd.log"), "w") as log:
        daemon = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                                   "--clear-groups", "libvirtd"], env=env, cwd=where,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(sock):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a private libvirtd did not start (see {where}/libvirtd.log)")
            time.sleep(0.05)
        yield lambda node: f"test+unix://{node}?socket={sock}"
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def can_run_libvirtd() -> bool:
    """private_libvirtd() can start here: root, with libvirtd and setpriv."""
    import shutil
    tools = [shutil.which(t, path="/usr/sbin:/usr/bin") for t in ("libvirtd", "setpriv")]
    return os.geteuid() == 0 and all(tools)
