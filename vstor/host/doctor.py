"""`vstor doctor`: host readiness, one check per line with the fix.

The host checks are pure functions of the host model and config; the few
that need a live service (SPDK, libvirt, the qsd binary) take a probe, so
tests drive them with real-but-local things.
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import stat
from typing import Callable

from vstor.config import Config
from vstor.errors import VstorError
from vstor.host.model import Host, format_cpulist
from vstor.records import record

OK, WARN, FAIL = "ok", "warn", "fail"


@record
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def spdk_in_use(cfg: Config) -> bool:
    return cfg.default_backend == "spdk" or bool(cfg.reactors)


def check_iommu(host: Host, cfg: Config) -> Check:
    words = host.cmdline.split()
    on = any(w in ("intel_iommu=on", "amd_iommu=on") for w in words) or host.iommu_enabled
    pt = "iommu=pt" in words
    if not host.iommu_enabled:
        return Check("iommu", WARN, "IOMMU is off: no passthrough, no SPDK on vfio-pci",
                     "add intel_iommu=on iommu=pt (AMD: amd_iommu=on iommu=pt) to the kernel "
                     "command line and reboot")
    if on and not pt:
        return Check("iommu", WARN, "IOMMU on, without iommu=pt (host DMA pays for translation)",
                     "add iommu=pt to the kernel command line")
    return Check("iommu", OK, "IOMMU on, iommu=pt")


def check_vfio(host: Host, cfg: Config) -> Check:
    if host.vfio_available:
        return Check("vfio-pci", OK, "vfio-pci available")
    return Check("vfio-pci", WARN, "vfio-pci is not loaded", "modprobe vfio-pci")


def check_hugepages(host: Host, cfg: Config) -> list[Check]:
    out = []
    for node in host.nodes:
        pools = [p for p in node.hugepages if p.total]
        if pools:
            text = ", ".join(f"{p.free}/{p.total} free x {p.size_kib} KiB" for p in pools)
            out.append(Check(f"hugepages node{node.id}", OK, text))
            continue
        status = WARN if spdk_in_use(cfg) else OK
        out.append(Check(f"hugepages node{node.id}", status,
                         "no hugepages reserved (SPDK disks need them; qsd disks do not)",
                         f"echo 2048 > /sys/devices/system/node/node{node.id}/hugepages/"
                         "hugepages-2048kB/nr_hugepages" if status == WARN else ""))
    return out


def check_thp(host: Host, cfg: Config) -> Check:
    if not spdk_in_use(cfg) or host.thp in ("never", ""):
        return Check("transparent hugepages", OK, host.thp or "not reported")
    return Check("transparent hugepages", WARN, f"'{host.thp}' on an SPDK host",
                 "echo never > /sys/kernel/mm/transparent_hugepage/enabled")


def check_irqbalance(host: Host, cfg: Config) -> Check:
    if not host.irqbalance_running:
        return Check("irqbalance", OK, "not running")
    return Check("irqbalance", WARN, "running: it moves IRQs onto dedicated and reactor cores",
                 "stop it, or ban those cores with IRQBALANCE_BANNED_CPULIST")


def check_nvme(host: Host, cfg: Config) -> list[Check]:
    out = []
    for ctrl in host.controllers:
        if ctrl.driver != "nvme":
            continue
        local = set(ctrl.local_cpus)
        stray = sorted({c for _, cpus in ctrl.irqs for c in cpus if local and c not in local})
        name = f"nvme {ctrl.address}"
        if stray:
            out.append(Check(f"{name} irqs", WARN, f"IRQs may run on CPUs {format_cpulist(stray)}, "
                             f"off node {ctrl.numa_node}",
                             f"write {format_cpulist(sorted(local))} to /proc/irq/N/smp_affinity_list "
                             "for its vectors"))
        elif ctrl.irqs:
            out.append(Check(f"{name} irqs", OK, f"{len(ctrl.irqs)} vectors on local CPUs"))
        for ns in ctrl.namespaces:
            if ns.scheduler and ns.scheduler != "none":
                out.append(Check(f"{ns.name} scheduler", WARN, f"'{ns.scheduler}' adds latency",
                                 f"echo none > /sys/block/{ns.name}/queue/scheduler"))
    return out


def check_rdma(host: Host, cfg: Config) -> list[Check]:
    if not host.rdma_nics:
        return [Check("rdma", OK, "no RDMA NICs (NVMe-oF over RDMA unavailable here)")]
    out = []
    for nic in host.rdma_nics:
        low = [n for n in nic.netdevs if n.mtu and n.mtu < 4096]
        if low:
            out.append(Check(f"rdma {nic.name}", WARN,
                             ", ".join(f"{n.name} MTU {n.mtu}" for n in low),
                             "; ".join(f"ip link set dev {n.name} mtu 4096" for n in low)))
        else:
            out.append(Check(f"rdma {nic.name}", OK, f"node {nic.numa_node}"))
    return out


def check_cores(host: Host, cfg: Config) -> Check:
    online = {c.id for c in host.cpus}
    missing = [c for c in (*cfg.reactors, *(cfg.housekeeping or ())) if c not in online]
    if missing:
        return Check("cores", FAIL, f"vstor.conf names CPUs {format_cpulist(missing)}, "
                     "which are not online here", "fix [cpu] in vstor.conf")
    hk = "first core of each node" if cfg.housekeeping is None else format_cpulist(cfg.housekeeping)
    return Check("cores", OK, f"housekeeping {hk}; reactors {format_cpulist(cfg.reactors) or 'none'}")


def check_qsd(binary: str | None = None) -> Check:
    path = binary or shutil.which("qemu-storage-daemon")
    if path:
        return Check("qemu-storage-daemon", OK, path)
    return Check("qemu-storage-daemon", FAIL, "not installed (the embedded backend)",
                 "apt-get install qemu-system-common")


def check_sources(cfg: Config, root: str = "/") -> list[Check]:
    """What one open per source stands on: the socket directory only root
    can change (vstor binds each socket there and sets its owner before it
    listens), and the kernel's hard-link protection (nobody links a file
    into an image root that they could not already write)."""
    where = cfg.vhost_dir
    try:
        st = os.lstat(os.path.join(root, where.lstrip("/")))
    except FileNotFoundError:
        sock = Check("socket directory", OK, f"{where} does not exist yet (vstor makes it "
                     "root:<qemu group> 0750)")
    except OSError as e:
        sock = Check("socket directory", FAIL, f"cannot look at {where}: {e.strerror}", "run as root")
    else:
        if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
            sock = Check("socket directory", OK, f"{where} is root's alone")
        else:
            sock = Check("socket directory", FAIL,
                         f"{where} is not root's alone (uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): vstor refuses to make sockets there",
                         f"chown root {where} && chmod go-w {where}")
    try:
        with open(os.path.join(root, "proc/sys/fs/protected_hardlinks")) as f:
            on = f.read().strip() == "1"
    except OSError:
        on = False
    links = (Check("hard links", OK, "fs.protected_hardlinks=1") if on else
             Check("hard links", WARN, "fs.protected_hardlinks is not 1: whoever can write an "
                   "image root can link a host file they cannot write into it",
                   "sysctl -w fs.protected_hardlinks=1"))
    return [sock, links]


def check_spdk(cfg: Config, probe: Callable[[], dict], supported) -> Check:
    """probe() returns the SPDK app's facts (backends.spdk.app_facts) or
    raises a VstorError saying why not; `supported`: the oldest and newest
    (year, month) releases vstor supports."""
    bad = FAIL if cfg.default_backend == "spdk" else WARN
    try:
        facts = probe()
    except VstorError as e:
        return Check("spdk", bad, e.message, e.hint or "")
    oldest, newest = supported
    span = f"v{oldest[0]}.{oldest[1]:02} to v{newest[0]}.{newest[1]:02}"
    app = facts.get("app") or "app"
    where = f"SPDK {facts['version']} ({app}) at {cfg.spdk_socket}"
    if facts["missing"]:
        return Check("spdk", bad, f"{where} has no {', '.join(facts['missing'])}",
                     f"run SPDK's vhost app (or spdk_tgt) with -S {cfg.vhost_dir} -r {cfg.spdk_socket}")
    release = facts.get("release")
    if release is None or release < oldest:
        return Check("spdk", bad, f"{where}: vstor supports {span}", "upgrade SPDK")
    sdir = facts.get("socket_dir")
    if sdir is not None and os.path.normpath(sdir) != os.path.normpath(cfg.vhost_dir):
        return Check("spdk", bad, f"{where} makes its sockets in {sdir}, not in [paths] vhost_dir "
                     f"{cfg.vhost_dir}", f"start it with -S {cfg.vhost_dir}, or set [paths] "
                     f"vhost_dir in {cfg.file}")
    notes = [f"supported {span}" + (", newer than vstor was tested with" if release > newest else "")]
    notes.append(f"sockets in {sdir}" if sdir else "its -S directory cannot be read from /proc")
    status = OK if sdir and release <= newest else WARN
    return Check("spdk", status, f"{where}; {'; '.join(notes)}")


HOOK_MARKER = "https://vstor.dev/xmlns/domain/1"     # what every vstor hook looks for
RESTART = ("restart libvirtd (systemctl restart libvirtd; without systemd: stop the running "
           "libvirtd, then libvirtd -d)")


def libvirt_daemons(proc: str = "/proc") -> list[tuple[int, str, float]]:
    """(pid, name, start time in seconds since the epoch) of each libvirtd or
    virtqemud that sees this host's /etc (its mount namespace is ours, when
    both can be read: a lab's daemon in a namespace of its own has its own)."""
    try:
        with open(os.path.join(proc, "stat")) as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        ours = os.readlink(os.path.join(proc, "self/ns/mnt"))
    except (OSError, StopIteration, ValueError):
        return []
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in sorted((int(p) for p in os.listdir(proc) if p.isdigit())):
        try:
            with open(os.path.join(proc, str(pid), "stat")) as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name not in ("libvirtd", "virtqemud"):
                continue
            if os.readlink(os.path.join(proc, str(pid), "ns/mnt")) != ours:
                continue
            # Field 22, starttime in clock ticks since boot (fields after the
            # name: state is field 3).
            out.append((pid, name, btime + int(stat[stat.rindex(")") + 2:].split()[19]) / tick))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _baked(key: str, hook: str) -> str:
    """A value `vstor hooks install` writes into a hook: KEY=value (the shell
    hook) or KEY = 'value' (Python); '' when unset."""
    for line in hook.splitlines():
        k, sep, value = line.partition("=")
        if sep and k.strip() == key:
            try:
                value = (" ".join(shlex.split(value)) if k == key
                         else ast.literal_eval(value.split("#")[0].strip()))
            except (ValueError, SyntaxError):
                pass
            return str(value or "").strip()
    return ""


def _interpreter(hook: str) -> str:
    """The Python a hook runs vstor with: its PYTHON= line (the shell hook),
    else its #! line."""
    first = hook.split("\n", 1)[0]
    return _baked("PYTHON", hook) or (first[2:].strip() if first.startswith("#!") else "")


def same_python(a: str, b: str) -> bool:
    """Two interpreter commands that run the same Python with the same
    packages: the same file (through symlinks: a venv's python, python3 and
    python3.11 are one) in the same environment (a venv's directory: two
    venvs of one base Python are not the same), and the same arguments."""
    try:
        (x, *xs), (y, *ys) = shlex.split(a), shlex.split(b)
        if xs != ys or not os.path.samefile(x, y):
            return False
    except (ValueError, OSError):
        return False
    return _environment(x) == _environment(y)


def _environment(python: str) -> str | None:
    """The venv an interpreter path is in (its bin/../pyvenv.cfg), else None."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    return os.path.realpath(venv) if os.path.isfile(os.path.join(venv, "pyvenv.cfg")) else None


def check_hook(path: str, expected: str, daemons: list[tuple[int, str, float]],
               packaged: bool = False) -> Check:
    """The libvirt hook at `path`: there, vstor's, what `vstor hooks install`
    writes now, or with `packaged` what the vstor Debian package installs
    (`expected`), and installed before the running libvirt daemon started
    (libvirt looks for hooks when it starts)."""
    name = "libvirt hook"
    if packaged:
        now = open_text(path)
        if now is None:
            return Check(name, FAIL, f"the vstor package's hook {path} is gone: vstor domains get no "
                         "backends at start", f"apt-get install --reinstall vstor, then {RESTART}")
        if now != expected:
            return Check(name, WARN, f"{path}, the vstor package's hook, was changed since the "
                         "package installed it", "apt-get install --reinstall vstor")
        return _read_by(name, path, daemons, "the vstor package's hook")
    running = ", ".join(f"{n} pid {pid}" for pid, n, _ in daemons)
    try:
        st = os.stat(path)
        with open(path, errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return Check(name, FAIL if daemons else WARN,
                     f"no vstor hook at {path}: vstor domains get no backends at start"
                     + ("" if daemons else "; no libvirtd runs either"),
                     f"vstor hooks install, then {RESTART}")
    if HOOK_MARKER not in text:
        return Check(name, FAIL, f"{path} is not vstor's hook",
                     f"move it away, then vstor hooks install and {RESTART}")
    if not st.st_mode & 0o111:
        return Check(name, FAIL, f"{path} is not executable (libvirt skips it)",
                     f"vstor hooks install, then {RESTART}")
    interp, want = _interpreter(text), _interpreter(expected)
    if text != expected and interp != want and same_python(interp, want):
        text = text.replace(interp, want)       # one Python by two names (a venv's python, python3)
    if text != expected:
        config, ours = _baked("CONFIG", text), _baked("CONFIG", expected)
        if interp == want and config != ours:
            return Check(name, WARN, f"{path} reads config {config or 'from the default path'}; "
                         f"this command reads {ours or 'the default'}",
                         "run doctor with the hook's --config, or vstor --config FILE hooks install")
        if interp == want:
            return Check(name, WARN, f"{path} is another version of the hook than this vstor's",
                         "vstor hooks install")
        missing = not os.path.exists(interp.split()[0] if interp else "")
        return Check(name, FAIL if missing else WARN,
                     f"{path} runs {interp or 'no interpreter'}"
                     + (", which does not exist" if missing else "")
                     + f"; this vstor runs under {want}", "vstor hooks install")
    return _read_by(name, path, daemons, "installed")


NOVA_MARK = "# Written by `vstor nova config`"


def check_nova_offers(host: Host, etc: str = "/etc/nova") -> list[Check]:
    """A nova.conf fragment `vstor nova config` wrote that offers a
    controller which is now an SR-IOV PF with VFs enabled, or a VF: Nova's
    placement translator then stops nova-compute at its start.  No
    fragment: no check."""
    import glob
    import json
    by_address = {c.address: c for c in host.controllers}
    out = []
    for path in sorted(glob.glob(os.path.join(etc, "nova.conf")) +
                       glob.glob(os.path.join(etc, "nova.conf.d", "*.conf"))):
        text = open_text(path)
        if not text or NOVA_MARK not in text:
            continue
        offered = []
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "device_spec":
                try:
                    offered.append(json.loads(value).get("address"))
                except (ValueError, AttributeError):
                    continue
        bad = [(a, by_address[a]) for a in offered if a in by_address
               and (by_address[a].virtfns or by_address[a].physfn)]
        if not bad:
            out.append(Check("nova offers", OK, f"{path}: {len(offered)} controllers, none an "
                                                "SR-IOV PF with VFs enabled or a VF"))
            continue
        address, ctrl = bad[0]
        what = (f"now has {len(ctrl.virtfns)} SR-IOV virtual functions enabled" if ctrl.virtfns
                else f"is now a virtual function of {ctrl.physfn}")
        out.append(Check("nova offers", FAIL,
                         f"{path} offers {address}, which {what}: Nova's placement translator "
                         "stops nova-compute at its start (PlacementPciDependentDeviceException)",
                         f"vstor nova config -o {path}, then restart nova-compute"))
    return out


def open_text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read(1 << 20)
    except OSError:
        return None


def _read_by(name: str, path: str, daemons, what: str) -> Check:
    """The hook as it should be: read by the running libvirt daemons, if
    they started after it was installed."""
    running = ", ".join(f"{n} pid {pid}" for pid, n, _ in daemons)
    st = os.stat(path)
    if not daemons:
        return Check(name, OK, f"{path} {what}; no libvirtd runs (it reads the hook when "
                               "it starts)")
    # /proc's boot time is whole seconds: a daemon started within a second
    # of the install counts as started after it.
    stale = [(pid, n) for pid, n, started in daemons if st.st_mtime > started + 1]
    if stale and what != "installed":
        # libvirt enables qemu hooks when, at its start, qemu.d holds one;
        # it runs each one there as it is at every call: a hook replaced by
        # an upgrade needs no restart, a first install does.
        return Check(name, WARN, f"{path} ({what}) was written after "
                     + ", ".join(f"{n} pid {pid}" for pid, n in stale)
                     + " started: after the package's first install libvirt has not seen it yet; "
                       "after an upgrade nothing needs restarting", f"after a first install: {RESTART}")
    if stale:
        return Check(name, WARN, f"{path} was installed after "
                     + ", ".join(f"{n} pid {pid}" for pid, n in stale)
                     + " started: libvirt looks for hooks when it starts", RESTART)
    return Check(name, OK, f"{path} {what}, read by {running}")


HOST_CHECKS = (check_iommu, check_vfio, check_hugepages, check_thp, check_irqbalance,
               check_nvme, check_rdma, check_cores)


def run(host: Host, cfg: Config, extra: list[Check] = ()) -> list[Check]:
    out: list[Check] = []
    for check in HOST_CHECKS:
        result = check(host, cfg)
        out.extend(result if isinstance(result, list) else [result])
    out.extend(extra)
    return out
