"""The hook's cost, in one run, each case as a ratio to its yardstick:

1. pass-through: the installed hook (as `vstor hooks install` writes it,
   executed as libvirt does) for a domain WITHOUT vstor metadata, divided by
   `python3 -c pass` (target: at most 0.1);
2. `prepare begin` + `release end` through the installed hook for a domain
   with four qemu-storage-daemon file disks, divided by the yardstick: a
   minimal Python hook on the same interpreter with the same flags (-S) that
   starts the same four daemons as vstor (their command lines, pinning and
   handed-over descriptors), side by side, waits until each serves, and at
   release stops them and waits until each has exited; no checks (target:
   at most 1.5; real daemons: needs root and qemu-storage-daemon).  Run in
   interleaved pairs, which of the two first alternating; the figure is the
   median of the pairs' ratios, with their quartiles and range;
3. the same `prepare` and `release` in-process (no interpreter start).

    python3 bench/bench_hook.py [--runs N] [--pairs N] [--quick]

The hook and the yardstick run on the Python that runs the bench (what
`hooks install` would write into the hook): run it with /usr/bin/python3
to measure Debian's.  Figures go into docs/performance.md; nothing here
asserts a time.  `--quick` runs each case once and checks the bench's own
sanity (bench/sanity.py): tests/test_bench.py runs it so.  Full or quick,
every timed `prepare` is checked (untimed) to have left four daemons serving
the four disks, and every `release` to have stopped them.
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

from bench.sanity import NO_SUPERVISOR, YARDSTICK_START, Sanity, holders  # noqa: E402

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


YARDSTICK = """#!{python} -S
# The yardstick: a minimal libvirt hook, on the hook's own Python and flags,
# that starts the same four qemu-storage-daemons vstor starts (its command
# lines, confinement and pinning; the source opened and the sockets bound
# and listening, handed over as descriptors, the pidfile made for the
# daemon's uid), side by side, and waits until each serves: a
# daemonized qsd's parent exits once every --export exists, and the socket
# accepted from the moment it was bound, which is what QEMU needs.  At
# release it stops them (SIGTERM) and waits, woken by pidfds, until each has
# exited.  No checks, no records, no lock, no log, no ACL (its sources are
# open to all); it imports only what each of the two needs.
import os, sys
sys.stdin.buffer.read()
DAEMONS = {daemons!r}     # (argv, pidfile, source, socket, uid)
{start}
if sys.argv[2] == "prepare":
    held, started = [], []
    for daemon in DAEMONS:
        proc, keep = start(*daemon)
        started.append(proc)
        held += keep
    if any([p.wait() for p in started]):
        sys.exit(1)
elif sys.argv[2] == "release":
    import select, signal
    fds = [os.pidfd_open(int(open(p).read())) for _, p, _, _, _ in DAEMONS]
    for fd in fds:
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    for fd in fds:     # readable once the daemon has exited
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()
    for _, pidfile, _, path, _ in DAEMONS:
        for where in (path, pidfile[:-4] + ".qmp", pidfile):
            if os.path.exists(where):
                os.unlink(where)
"""


def same_daemons(work: str, dom, cfg) -> list:
    """The four daemons exactly as vstor starts them for `dom` (its plan's
    command lines: the source and the listening socket handed over as
    descriptors, aio=native where O_DIRECT works, the plan's pinning and
    confinement, a QMP monitor; under systemd in a scope of their own, as
    vstor's are), on sockets and pidfiles of the yardstick's own, and uids
    above vstor's."""
    from vstor.backends.qsd.daemon import _pin, _resolved, scope
    from vstor.host import sources
    from vstor.runtime.actions import build
    from vstor.runtime.lifecycle import plan_of
    out = []
    for i, step in enumerate(build(plan_of(dom)[1], cfg)):
        with sources.open_file(step.export.source, cfg.images) as src:
            spec = _resolved(step.export, src)
        uid = cfg.daemon_users[1] - i
        prefix = spec.jail(uid, cfg.images) if spec.users else _pin(spec.cpus)
        argv = prefix + spec.argv("SRC_FD", "SOCK_FD", "QMP_FD")
        argv = [a.replace(spec.pidfile, f"{work}/y{i}.pid") for a in argv]
        out.append((scope(f"yardstick-{i}") + argv, f"{work}/y{i}.pid", spec.source,
                    f"{work}/y{i}.sock", uid))
    return out


def _serving(sanity: Sanity, disks: list[str], after: str, count: int) -> None:
    """Untimed: after `after`, `count` of the disks are held by a process."""
    held = sum(1 for d in disks if holders([d]))
    if held != count:
        sanity.problem(f"after {after}, {held} of the {len(disks)} disks are held by a process, "
                       f"not {count}")


def through_hook(pairs: int, work: str, run: str, dom, cfg, sanity: Sanity) -> None:
    """prepare begin + release end as libvirt runs them, against the
    yardstick, in interleaved pairs (which of the two runs first
    alternates): the figure is the median of the pairs' ratios, with their
    spread; a busy machine slows both of a pair alike."""
    conf = os.path.join(work, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[paths]\nstate_dir = {cfg.state_dir}\nvhost_dir = {cfg.vhost_dir}\n"
                f"qsd_dir = {cfg.qsd_dir}\nimages = {work}\n{NO_SUPERVISOR}")
    hook = installed_hook(work, conf)
    xml = dom.to_string().encode()
    stick = os.path.join(work, "yardstick")
    with open(stick, "w") as f:
        f.write(YARDSTICK.format(python=sys.executable, daemons=same_daemons(run, dom, cfg),
                                 start=YARDSTICK_START))
    os.chmod(stick, 0o755)
    disks = _disks(work)

    def cycle(argv0: str) -> tuple[float, float]:
        took = []
        for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
            t0 = time.perf_counter()
            done = subprocess.run([argv0, dom.name, *op], input=xml, capture_output=True)
            took.append(time.perf_counter() - t0)
            if done.returncode:
                raise SystemExit(f"{argv0} {op[0]}: {done.stderr.decode().strip()}")
            _serving(sanity, disks, f"{os.path.basename(argv0)} {op[0]}",
                     len(disks) if op[0] == "prepare" else 0)
        return took[0], took[1]
    ours, theirs = [], []
    for i in range(pairs):
        if i % 2:
            theirs.append(cycle(stick))
            ours.append(cycle(hook))
        else:
            ours.append(cycle(hook))
            theirs.append(cycle(stick))
    ratios = sorted(sum(a) / sum(b) for a, b in zip(ours, theirs))
    ratio = sanity.figure("ratio to the yardstick", statistics.median(ratios))
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    a, b = (_halves(sanity, who, runs) for who, runs in (("the hook", ours), ("the yardstick", theirs)))
    print(f"hook prepare begin + release end, 4 qsd disks: {a} vs yardstick on the same daemons "
          f"{b}: ratio {ratio:.2f} (median of {pairs} interleaved pairs; IQR {quart[0]:.2f}-"
          f"{quart[2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}; {sys.executable})")


def _halves(sanity: Sanity, who: str, runs: list[tuple[float, float]]) -> str:
    """'TOTAL ms (prepare P, release R)', medians of each."""
    whole = sanity.figure(f"{who}, prepare + release", statistics.median(p + r for p, r in runs))
    prep, rel = (statistics.median(x[i] for x in runs) * 1000 for i in (0, 1))
    return f"{whole * 1000:.0f} ms (prepare {prep:.0f}, release {rel:.0f})"


def prepare_release(runs: int, pairs: int, sanity: Sanity) -> None:
    if os.geteuid() != 0:
        print("prepare+release: skipped (needs root)")
        return
    # The images where O_DIRECT works (aio=native, as on a host's disks); the
    # state, sockets and pidfiles, vstor's and the yardstick's, on a tmpfs,
    # as /run/vstor is on a host (a record's fsync costs nothing there).
    work = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir="/var/tmp"))
    run = sanity.watch(tempfile.mkdtemp(prefix="vstor-bench-", dir=_tmpfs()))
    try:
        _prepare_release(runs, pairs, work, run, sanity)
    finally:
        _clean(work, run)


def _tmpfs() -> str:
    """/run where it is a tmpfs (on a host it is), else /dev/shm."""
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4]: line.split(" - ")[1].split()[0] for line in f}
    return "/run" if mounts.get("/run") == "tmpfs" else "/dev/shm"


def _disks(work: str) -> list[str]:
    return [os.path.join(work, f"d{i}.raw") for i in range(4)]


def _config(work: str, run: str):
    """vstor's configuration for the bench's domain: its images under
    `work`, its state, sockets and pidfiles under `run`."""
    from vstor.config import Config
    return Config(state_dir=f"{run}/state", vhost_dir=f"{run}/vhost", qsd_dir=f"{run}/qsd",
                  images=(work,))


def _prepare_release(runs: int, pairs: int, work: str, run: str, sanity: Sanity) -> None:
    from vstor.meta.document import Domain
    from vstor.host.read import read_host
    from vstor.planner.ledger import Ledger
    from vstor.runtime.lifecycle import Runtime, prepare, release
    from vstor.planner import Request, plan_domain
    from vstor.render.libvirt import render
    from vstor.runtime.state import StateDir
    from vstor.host.sysfs import SysFS
    os.chmod(work, 0o755)
    os.chmod(run, 0o755)
    disks = ""
    for path, t in zip(_disks(work), "bcde"):
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        os.chmod(path, 0o666)   # the yardstick's confined daemons need no ACL entry
        disks += f"<vstor:disk target='vd{t}'><vstor:file path='{path}'/></vstor:disk>"
    cfg = _config(work, run)
    host = read_host(SysFS("/"))
    dom = Domain.parse(FOUR_DISKS.format(disks=disks))
    dom = render(dom, plan_domain(host, cfg, Request.from_domain(dom), Ledger()))
    state = StateDir(cfg.state_dir)
    rt = Runtime(cfg, SysFS("/"))
    through_hook(pairs, work, run, dom, cfg, sanity)
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


def _clean(work: str, run: str) -> None:
    """Leave nothing behind, also after a failure half-way: vstor's daemons
    released through vstor, the yardstick's stopped by their pidfiles."""
    import glob
    import signal
    from vstor.runtime.executor import Runtime
    from vstor.runtime.recorded import release
    from vstor.runtime.state import StateDir
    from vstor.host.sysfs import SysFS
    cfg = _config(work, run)
    try:
        release(Runtime(cfg, SysFS("/")), StateDir(cfg.state_dir), "bench4")
    except Exception as e:  # noqa: BLE001 (report it, go on cleaning)
        print(f"release during cleanup: {e}", file=sys.stderr)
    for pidfile in glob.glob(os.path.join(run, "y[0-9].pid")):
        try:
            with open(pidfile) as f:
                os.kill(int(f.read()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="runs of the pass-through and in-process cases")
    ap.add_argument("--pairs", type=int, default=30,
                    help="interleaved pairs of the hook's and the yardstick's prepare + release")
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
    prepare_release(1 if args.quick else args.runs, 1 if args.quick else args.pairs, sanity)
    sanity.finish(expected=8 + 3 + 2)


if __name__ == "__main__":
    main()
