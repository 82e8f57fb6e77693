"""The hook's cost, in one run, each case as a ratio to its yardstick:

1. pass-through: the installed hook (as `vstor hooks install` writes it,
   executed as libvirt does) for a domain WITHOUT vstor metadata, divided by
   `python3 -c pass` (target: at most 0.1);
2. `prepare begin` + `release end` through the installed hook for a domain
   with four qemu-storage-daemon file disks, divided by the yardstick: a
   minimal Python hook that only starts the four daemons (daemonized, with
   a pidfile) and stops them again (target: at most 1.5; real daemons:
   needs root and qemu-storage-daemon);
3. the same `prepare` and `release` in-process (no interpreter start).

    python3 bench/bench_hook.py [--runs N] [--quick]

Figures go into docs/performance.md; nothing here asserts a time.  `--quick`
runs each case once and checks the bench's own sanity (bench/sanity.py):
tests/test_bench.py runs it so.  Full or quick, every timed `prepare` is
checked (untimed) to have left four daemons serving the four disks, and every
`release` to have stopped them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench.sanity import Sanity, holders  # noqa: E402

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


def installed_hook(where: str, config: str | None = None) -> str:
    """hooks/vstor as `vstor hooks install` writes it."""
    from vstor.cli.hooks import render_hook
    path = os.path.join(where, "vstor-hook")
    with open(path, "w") as f:
        f.write(render_hook(config))
    os.chmod(path, 0o755)
    return path


def pass_through(runs: int, sanity: Sanity) -> None:
    where = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-"))
    try:
        _pass_through(runs, installed_hook(where), sanity)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _pass_through(runs: int, hook: str, sanity: Sanity) -> None:
    for what, xml in (("plain", PLAIN_DOMAIN), ("Nova instance", NOVA_DOMAIN)):
        for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
            python = sanity.figure("python3 -c pass", _time([sys.executable, "-c", "pass"], b"", runs))
            hooked = sanity.figure(f"pass-through {what} {op[0]}", _time([hook, "plain", *op], xml, runs))
            print(f"hook pass-through, {what} ({op[0]}): {hooked * 1000:.1f} ms vs python3 -c pass "
                  f"{python * 1000:.1f} ms: ratio {hooked / python:.2f}")


FOUR_DISKS = """<domain type='kvm'><name>bench4</name><memory unit='MiB'>512</memory><vcpu>1</vcpu>
<metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'><vstor:vm cpus='shared'/>{disks}
</vstor:vstor></metadata><devices/></domain>"""


YARDSTICK = """#!{python}
# The yardstick: a minimal hook that starts four qemu-storage-daemons
# (daemonized, with a pidfile) at prepare and stops them at release.  Where a
# daemon's command line takes descriptors (vstor's: the source opened and the
# socket listening, handed over), it opens and binds them first, as vstor does.
import os, signal, socket, subprocess, sys, time
sys.stdin.buffer.read()
DAEMONS = {daemons!r}     # (argv, pidfile, source or None, socket or None)
if sys.argv[2] == "prepare":
    for argv, _, source, path in DAEMONS:
        if source is None:
            subprocess.run(argv, check=True)
            continue
        fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
        with socket.socket(socket.AF_UNIX) as sock:
            if os.path.exists(path):
                os.unlink(path)
            sock.bind(path)
            sock.listen()
            subprocess.run([a.replace("SRC_FD", str(fd)).replace("SOCK_FD", str(sock.fileno()))
                            for a in argv], check=True, pass_fds=(fd, sock.fileno()))
        os.close(fd)
elif sys.argv[2] == "release":
    pids = [int(open(p).read()) for _, p, _, _ in DAEMONS]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:     # gone, or a zombie its new parent has not reaped yet
        while True:
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.002)
    for _, _, _, path in DAEMONS:
        if path and os.path.exists(path):
            os.unlink(path)
"""


def same_daemons(work: str, dom, cfg) -> list:
    """The four daemons exactly as vstor starts them for `dom` (its plan's
    command lines: the source and the listening socket handed over as
    descriptors, aio=native where O_DIRECT works, the plan's pinning, a QMP
    monitor), on sockets and pidfiles of the yardstick's own."""
    from vstor.backends.qsd.daemon import _resolved
    from vstor.host import sources
    from vstor.runtime.actions import build
    from vstor.runtime.lifecycle import plan_of
    out = []
    for i, step in enumerate(build(plan_of(dom)[1], cfg)):
        with sources.open_file(step.export.source, cfg.images) as src:
            spec = _resolved(step.export, src)
        argv = spec.argv("SRC_FD", "SOCK_FD")
        for mine, theirs in ((spec.qmp_path, f"{work}/y{i}.qmp"), (spec.pidfile, f"{work}/y{i}.pid")):
            argv = [a.replace(mine, theirs) for a in argv]
        pin = ["taskset", "--cpu-list", ",".join(map(str, spec.cpus))] if spec.cpus else []
        out.append((pin + argv, f"{work}/y{i}.pid", spec.source, f"{work}/y{i}.sock"))
    return out


def plain_daemons(work: str) -> list:
    """The minimal daemons: aio=threads, no monitor, no pinning."""
    return [(["qemu-storage-daemon", "--blockdev",
              f"driver=file,node-name=f{i},filename={work}/d{i}.raw,aio=threads,cache.direct=on",
              "--export", f"type=vhost-user-blk,id=e{i},node-name=f{i},addr.type=unix,"
              f"addr.path={work}/p{i}.sock,writable=on",
              "--daemonize", "--pidfile", f"{work}/p{i}.pid"], f"{work}/p{i}.pid", None, None)
            for i in range(4)]


def _serving(sanity: Sanity, disks: list[str], after: str, count: int) -> None:
    """Untimed: after `after`, `count` of the disks are held by a process."""
    held = sum(1 for d in disks if holders([d]))
    if held != count:
        sanity.problem(f"after {after}, {held} of the {len(disks)} disks are held by a process, "
                       f"not {count}")


def through_hook(runs: int, work: str, dom, cfg, sanity: Sanity) -> None:
    """prepare begin + release end as libvirt runs them, vs the yardstick
    (started on the same daemons vstor starts, and on minimal ones)."""
    conf = os.path.join(work, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {cfg.state_dir}\nvhost_dir = {cfg.vhost_dir}\n"
                f"qsd_dir = {cfg.qsd_dir}\nimages = {work}\n")
    hook = installed_hook(work, conf)
    xml = dom.to_string().encode()
    sticks = []
    for what, daemons in (("the same daemons", same_daemons(work, dom, cfg)),
                          ("minimal daemons (aio=threads, no monitor, not pinned)", plain_daemons(work))):
        path = os.path.join(work, f"yardstick{len(sticks)}")
        with open(path, "w") as f:
            f.write(YARDSTICK.format(python=sys.executable, daemons=daemons))
        os.chmod(path, 0o755)
        sticks.append((what, path))

    disks = _disks(work)

    def cycle(argv0: str) -> float:
        took = 0.0
        for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
            t0 = time.perf_counter()
            done = subprocess.run([argv0, dom.name, *op], input=xml, capture_output=True)
            took += time.perf_counter() - t0
            if done.returncode:
                raise SystemExit(f"{argv0} {op[0]}: {done.stderr.decode().strip()}")
            _serving(sanity, disks, f"{os.path.basename(argv0)} {op[0]}",
                     len(disks) if op[0] == "prepare" else 0)
        return took
    ours, theirs = [], [[] for _ in sticks]
    for _ in range(runs):
        ours.append(cycle(hook))
        for i, (_, path) in enumerate(sticks):
            theirs[i].append(cycle(path))
    a = sanity.figure("through the hook", statistics.median(ours))
    for (what, _), samples in zip(sticks, theirs):
        b = sanity.figure(f"yardstick on {what}", statistics.median(samples))
        # Each cycle of ours ran right before one of the yardstick's: the
        # median of those pairs' ratios holds still on a busy machine.
        paired = statistics.median(x / y for x, y in zip(ours, samples))
        print(f"hook prepare begin + release end, 4 qsd disks: {a * 1000:.0f} ms vs yardstick on "
              f"{what} {b * 1000:.0f} ms: ratio {a / b:.2f}, paired {paired:.2f} (median of {runs})")


def prepare_release(runs: int, sanity: Sanity) -> None:
    if os.geteuid() != 0:
        print("prepare+release: skipped (needs root)")
        return
    work = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir="/var/tmp"))
    try:
        _prepare_release(runs, work, sanity)
    finally:
        _clean(work)


def _disks(work: str) -> list[str]:
    return [os.path.join(work, f"d{i}.raw") for i in range(4)]


def _config(work: str):
    """vstor's configuration for the bench's domain: everything under `work`."""
    from vstor.config import Config
    return Config(state_dir=f"{work}/state", vhost_dir=f"{work}/vhost", qsd_dir=f"{work}/qsd",
                  images=(work,))


def _prepare_release(runs: int, work: str, sanity: Sanity) -> None:
    from vstor.meta.document import Domain
    from vstor.host.read import read_host
    from vstor.planner.ledger import Ledger
    from vstor.runtime.lifecycle import Runtime, prepare, release
    from vstor.planner import Request, plan_domain
    from vstor.render.libvirt import render
    from vstor.runtime.state import StateDir
    from vstor.host.sysfs import SysFS
    os.chmod(work, 0o755)
    disks = ""
    for path, t in zip(_disks(work), "bcde"):
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        disks += f"<vstor:disk target='vd{t}'><vstor:file path='{path}'/></vstor:disk>"
    cfg = _config(work)
    host = read_host(SysFS("/"))
    dom = Domain.parse(FOUR_DISKS.format(disks=disks))
    dom = render(dom, plan_domain(host, cfg, Request.from_domain(dom), Ledger()))
    state = StateDir(cfg.state_dir)
    rt = Runtime(cfg, SysFS("/"))
    through_hook(runs, work, dom, cfg, sanity)
    prep, rel = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        prepare(rt, state, read_host(SysFS("/"), processes=False), dom)
        prep.append(time.perf_counter() - t0)
        _serving(sanity, _disks(work), "prepare in-process", 4)
        t1 = time.perf_counter()
        release(rt, state, dom.safe_name)
        rel.append(time.perf_counter() - t1)
        _serving(sanity, _disks(work), "release in-process", 0)
    p = sanity.figure("prepare in-process", statistics.median(prep))
    r = sanity.figure("release in-process", statistics.median(rel))
    print(f"prepare, 4 qsd disks: {p * 1000:.0f} ms; release: {r * 1000:.0f} ms (median of {runs})")


def _clean(work: str) -> None:
    """Leave nothing behind, also after a failure half-way: vstor's daemons
    released through vstor, the yardstick's stopped by their pidfiles."""
    import glob
    import signal
    from vstor.runtime.recorded import Runtime, release
    from vstor.runtime.state import StateDir
    from vstor.host.sysfs import SysFS
    cfg = _config(work)
    try:
        release(Runtime(cfg, SysFS("/")), StateDir(cfg.state_dir), "bench4")
    except Exception as e:  # noqa: BLE001 (report it, go on cleaning)
        print(f"release during cleanup: {e}", file=sys.stderr)
    for pidfile in glob.glob(os.path.join(work, "[yp][0-9].pid")):
        try:
            with open(pidfile) as f:
                os.kill(int(f.read()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--quick", action="store_true",
                    help="each case once; check the bench's own sanity (needs root)")
    args = ap.parse_args()
    if args.quick and os.geteuid() != 0:
        sys.exit("bench_hook --quick: needs root (real qemu-storage-daemons)")
    sanity = Sanity(args.quick)
    # Byte-code written first, as pip's install does: with PYTHONDONTWRITEBYTECODE
    # set (it is, in this project's shells), every hook would compile vstor anew.
    import compileall
    compileall.compile_dir(os.path.join(ROOT, "vstor"), quiet=1)
    pass_through(1 if args.quick else args.runs, sanity)
    prepare_release(1 if args.quick else max(3, args.runs // 2), sanity)
    sanity.finish(expected=8 + 3 + 2)


if __name__ == "__main__":
    main()
