"""Proxmox VE's real qemu-server as the judge of the configs vstor writes:
../shared/pve/oracle's `showcmd` (its README), run where it is, never
copied in.  scripts/install-deps.sh installs its Perl packages; missing in
CI is a failure, elsewhere a skip."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile

import pytest

from tests.helpers import SHARED, unavailable
from vstor.records import record

HOME = os.path.join(SHARED, "pve", "oracle")
SHOWCMD = os.path.join(HOME, "showcmd")


@record
class Start:
    code: int               # showcmd's: 0 ok, 2 refused, 3 warnings, 4 hugepages_topology refused
    argv: list
    err: str
    topology: dict | None   # hugepages_topology's {page MiB: {host node: pages}}

    def after(self, option: str) -> list[str]:
        """The values of every `option` in the command line, in order."""
        return [b for a, b in zip(self.argv, self.argv[1:]) if a == option]


def require() -> None:
    if os.access(SHOWCMD, os.X_OK):
        return
    unavailable(f"Proxmox's qemu-server oracle is not at {HOME} "
                "(../shared/pve next to the checkout, where CI puts it)")


def showcmd(text: str, pci=(), qemu: str = "9.2", vmid: int = 100) -> Start:
    """qemu-server's command line for a config (and, with hugepages, its
    hugepages_topology step of a start)."""
    require()
    version = qemu if qemu.count(".") == 2 else qemu + ".0"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{vmid}.conf")
        with open(path, "w") as f:
            f.write(text)
        cmd = [SHOWCMD, "--vmid", str(vmid), "--qemu-version", version, "--hugepages-topology"]
        for bdf in pci:
            cmd += ["--pci-dev", bdf]
        done = subprocess.run(cmd + [path], capture_output=True, text=True, timeout=120)
    if done.returncode == 255 or "Can't locate" in done.stderr:
        pytest.fail(f"the oracle did not run: {done.stderr.strip()[:300]} "
                    f"(run {HOME}/install-deps.sh, or scripts/install-deps.sh)")
    m = re.search(r"^HUGEPAGES-TOPOLOGY: (\{.*\})$", done.stderr, re.M)
    return Start(done.returncode, shlex.split(done.stdout), done.stderr,
                 json.loads(m.group(1)) if m else None)


def vfio_hosts(start: Start) -> list[str]:
    """The host functions of every vfio-pci device, in order."""
    return [re.match(r"vfio-pci,host=([^,]+)", v).group(1) for v in start.after("-device")
            if v.startswith("vfio-pci,")]


def cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in (text or "").replace(";", ",").split(","):
        if part:
            a, _, b = part.partition("-")
            out |= set(range(int(a), int(b or a) + 1))
    return out


NS = "https://vstor.dev/xmlns/domain/1"


def agrees_with_plan(start: Start, plan, mib: int, user_vfio=()) -> None:
    """Proxmox's own command line carries exactly the plan: its memory
    backend, guest node, CPUs, hugepages, vhost-user pairs and vfio devices,
    with no error.  `plan`: the <vstor:plan> element."""
    assert start.code == 0, start.err
    node, kb = plan.get("node"), plan.get("hugepage_kib")
    policy = "bind" if plan.get("numa", "strict") == "strict" else "preferred"
    backends = [v for v in start.after("-object") if v.startswith("memory-backend")]
    vcpus = int(plan.get("vcpus"))
    # The guest's cells (a plan without <vstor:cell>: one, on its node, of everything).
    cells = [(c.get("id"), c.get("node"), c.get("vcpus"), int(c.get("memory_kib")) // 1024,
              int(c.get("hugepages", "0"))) for c in plan.findall(f"{{{NS}}}cell")] or \
        [("0", node, "0" if vcpus == 1 else f"0-{vcpus - 1}", mib, int(plan.get("hugepages", "0")))]
    if kb:
        assert backends == [f"memory-backend-file,id=ram-node{k},size={m}M,mem-path=/run/hugepages/kvm/"
                            f"{kb}kB,share=on,prealloc=yes,host-nodes={n},policy={policy}"
                            for k, n, _c, m, _p in cells], backends
        pages: dict = {}
        for _k, n, _c, _m, p in cells:
            pages[n] = pages.get(n, 0) + p
        assert start.topology == {str(int(kb) // 1024): pages}, start.topology
    if backends:
        assert start.after("-numa") == [f"node,nodeid={k},cpus={c},memdev=ram-node{k}"
                                        for k, _n, c, _m, _p in cells]
    # Every QEMU thread on the plan's cores (taskset: Proxmox pins no single vCPU).
    want = cpus(plan.get("pins")) | cpus(plan.get("emulator")) | cpus(plan.get("shared"))
    assert start.argv[:3] == ["/usr/bin/taskset", "--cpu-list", "--all-tasks"]
    assert cpus(start.argv[3]) == want
    disks = plan.findall(f"{{{NS}}}disk")
    chardevs = [v for v in start.after("-chardev") if "id=vstor-" in v]
    devices = [v.split(",bus=")[0] for v in start.after("-device")
               if v.startswith("vhost-user-blk-pci,id=vstor-")]
    vhost = [d for d in disks if d.get("mode") == "vhost"]
    assert len(chardevs) == len(devices) == len(vhost), (chardevs, devices)
    for d, chardev, device in zip(vhost, chardevs, devices):
        t = d.get("target")
        assert chardev.startswith(f"socket,id=vstor-{t},path={d.get('socket')},reconnect")
        assert device == f"vhost-user-blk-pci,id=vstor-{t},chardev=vstor-{t},num-queues={d.get('queues', '1')}"
    passed = [d.get("controller") for d in disks if d.get("mode") == "passthrough"]
    assert sorted(vfio_hosts(start)) == sorted(passed + list(user_vfio)), vfio_hosts(start)


def perl(script: str, lines: list[str]) -> list:
    """Run a Perl script with the oracle's Proxmox modules on the path: one
    JSON answer per input line (read from stdin, JSON-encoded strings)."""
    require()
    env_sh = os.path.join(HOME, "lib", "env.sh")
    shell = f'PVEORACLE_HOME="{HOME}"; . "{env_sh}"; exec perl -e "$0"'
    done = subprocess.run(["sh", "-c", shell, script], input="\n".join(json.dumps(x) for x in lines) + "\n",
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        pytest.fail(f"the oracle's Perl did not run: {done.stderr.strip()[:300]}")
    return [json.loads(line) for line in done.stdout.splitlines()]
