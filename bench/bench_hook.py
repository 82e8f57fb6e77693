"""The hook's cost, in one run:

1. pass-through: the hook for a domain WITHOUT vstor metadata, divided by
   `python3 -c pass` (target: at most 1.5);
2. `prepare` + `release` for a domain with four qemu-storage-daemon disks
   (real daemons; needs root and qemu-storage-daemon).

    python3 bench/bench_hook.py [--runs N]

Figures go into README.md ("Performance"); nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

PLAIN_DOMAIN = b"""<domain type='kvm'><name>plain</name><memory unit='GiB'>4</memory><vcpu>2</vcpu>
<devices><disk type='file' device='disk'><source file='/var/lib/libvirt/images/plain.qcow2'/>
<target dev='vda' bus='virtio'/></disk></devices></domain>""" + b"<!-- padding -->" * 500


def _time(argv: list[str], stdin: bytes, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, input=stdin, check=True, stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# A Nova instance without vstor: extra specs, as Nova's config classes write
# it (tests/nova/oracle.py), with the usual devices' worth of padding.
NOVA_DOMAIN = b"""<domain type="kvm"><uuid>9f6f1a40-2a35-4a6f-8b0b-5a3c1e2d4f10</uuid>
<name>instance-0000002a</name><memory>4194304</memory><vcpu>4</vcpu><metadata>
<nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1"><nova:package version="34.0.0"/>
<nova:name>web1</nova:name><nova:flavor name="m1.large" id="f1"><nova:memory>4096</nova:memory>
<nova:vcpus>4</nova:vcpus><nova:extraSpecs><nova:extraSpec name="hw:cpu_policy">dedicated</nova:extraSpec>
<nova:extraSpec name="hw:mem_page_size">large</nova:extraSpec></nova:extraSpecs></nova:flavor>
<nova:owner><nova:user uuid="u1">alice</nova:user><nova:project uuid="p1">demo</nova:project></nova:owner>
</nova:instance></metadata><devices/></domain>""" + b"<!-- padding -->" * 500


def pass_through(runs: int) -> None:
    hook = os.path.join(ROOT, "hooks", "vstor")
    for what, xml in (("plain", PLAIN_DOMAIN), ("Nova instance", NOVA_DOMAIN)):
        for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
            python = _time([sys.executable, "-c", "pass"], b"", runs)
            hooked = _time([sys.executable, hook, "plain", *op], xml, runs)
            print(f"hook pass-through, {what} ({op[0]}): {hooked * 1000:.1f} ms vs python3 -c pass "
                  f"{python * 1000:.1f} ms: ratio {hooked / python:.2f}")


FOUR_DISKS = """<domain type='kvm'><name>bench4</name><memory unit='MiB'>512</memory><vcpu>1</vcpu>
<metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'><vstor:vm cpus='shared'/>{disks}
</vstor:vstor></metadata><devices/></domain>"""


def prepare_release(runs: int) -> None:
    if os.geteuid() != 0:
        print("prepare+release: skipped (needs root)")
        return
    from vstor.config import Config
    from vstor.meta.document import Domain
    from vstor.host.read import read_host
    from vstor.planner.ledger import Ledger
    from vstor.runtime.lifecycle import Runtime, prepare, release
    from vstor.planner import Request, plan_domain
    from vstor.render.libvirt import render
    from vstor.runtime.state import StateDir
    from vstor.host.sysfs import SysFS
    work = tempfile.mkdtemp(prefix="vstor-bench-", dir="/var/tmp")
    os.chmod(work, 0o755)
    disks = ""
    for i, t in enumerate("bcde"):
        path = os.path.join(work, f"d{i}.raw")
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        disks += f"<vstor:disk target='vd{t}'><vstor:file path='{path}'/></vstor:disk>"
    cfg = Config(state_dir=f"{work}/state", vhost_dir=f"{work}/vhost", qsd_dir=f"{work}/qsd",
                 images=(work,))
    host = read_host(SysFS("/"))
    dom = Domain.parse(FOUR_DISKS.format(disks=disks))
    dom = render(dom, plan_domain(host, cfg, Request.from_domain(dom), Ledger()))
    state = StateDir(cfg.state_dir)
    rt = Runtime(cfg, SysFS("/"))
    prep, rel = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        prepare(rt, state, read_host(SysFS("/")), dom)
        t1 = time.perf_counter()
        release(rt, state, dom.safe_name)
        rel.append(time.perf_counter() - t1)
        prep.append(t1 - t0)
    print(f"prepare, 4 qsd disks: {statistics.median(prep) * 1000:.0f} ms; "
          f"release: {statistics.median(rel) * 1000:.0f} ms (median of {runs})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    pass_through(args.runs)
    prepare_release(max(3, args.runs // 4))


if __name__ == "__main__":
    main()
