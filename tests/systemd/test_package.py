"""vstor's Debian package under a real systemd 252 (PID 1 of a Debian 12
container, tests/systemd/harness.py): installed, a vstor domain started
whose guest writes, fsyncs and reads back records without pause; then, one
at a time, an upgrade to a newer build, `systemctl daemon-reload`, a restart
of libvirtd, a run of vstor-gc and an `apt-get remove` (refused).  After
each, the guest's rounds go on, every qemu-storage-daemon keeps its PID and
no record is lost.  Last, the domain stops and `apt-get purge` leaves
nothing of vstor's.

The tests run in file order and share one container; a step that broke the
domain (an expected failure) leaves the next step a domain started again.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.guest import Guest, build_guest, loop_expected, loop_job, parse_loop, stop_loop
from tests.e2e.helpers import annotated

from .harness import Container, ensure_image

ROOT = Path(__file__).resolve().parents[2]
NAME = "vstor-sd"
SIZE = 32 << 10                 # the loop's region: 64 blocks of 512 bytes
DISK = f"/var/lib/libvirt/images/{NAME}.raw"
CONSOLE_DIR = Path("/var/log/libvirt/qemu")
CONSOLE = f"{CONSOLE_DIR}/{NAME}.console"
DEBS = "/var/cache/vstor-test"
GUEST = "/var/lib/vstor-guest"
NEWER = "+upgrade1"
# Rounds the guest must write after a step (it prints LOOP every 10) within PROGRESS s.
ROUNDS_AFTER, PROGRESS = 20, 90

# What a `find` of the container may differ in between before the install
# and after the purge without being vstor's: logs, caches, package
# manager and libvirt state, systemd's journal streams and invocation ids,
# the directory of transient units (its units would show), the test's files.
SNAPSHOT = r"""
find / /run -xdev \
  \( -path /var/lib/dpkg -o -path /var/log -o -path /var/cache -o -path /var/lib/apt \
     -o -path /var/lib/libvirt -o -path /run/libvirt -o -path /run/user -o -path /run/systemd/journal \
     -o -path /run/systemd/units -o -path /tmp -o -path /var/tmp -o -path /proc -o -path /sys \
     -o -path /dev -o -path {guest} -o -path /root -o -path '/run/*.pid' -o -path /run/agetty.reload \) \
  -prune -o -print | grep -vx /run/systemd/transient | sort
for f in /etc/passwd /etc/group /etc/shadow /etc/gshadow /etc/subuid /etc/subgid; do
  [ -e $f ] && echo "$f $(sha256sum < $f | cut -c1-16)"
done
""".format(guest=GUEST)

# The daemons (every qemu-storage-daemon process: pid, start time, cgroup) and
# vstor's records, as seen inside the container.
STATE = r"""
import glob, json, os
out = {"daemons": {}, "records": {}}
for d in os.listdir("/proc"):
    if not d.isdigit():
        continue
    try:
        stat = open(f"/proc/{d}/stat").read()
        argv0 = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")[0].decode()
        cgroup = [l.split(":", 2)[2] for l in open(f"/proc/{d}/cgroup").read().splitlines()
                  if l.startswith(("0::", "1:name=systemd:"))]
    except (OSError, IndexError):
        continue
    if os.path.basename(argv0) == "qemu-storage-daemon" and stat[stat.rindex(")") + 2] not in "ZX":
        out["daemons"][d] = {"start": stat[stat.rindex(")") + 2:].split()[19], "cgroup": cgroup[-1:]}
for p in glob.glob("/run/vstor/state/domains/*.json"):
    with open(p) as f:
        doc = json.load(f)
    doc.pop("updated", None)
    out["records"][os.path.basename(p)] = doc
print(json.dumps(out))
"""


class BackendsStopped(AssertionError):
    """A qemu-storage-daemon that ran before a step is gone or was replaced."""


class UnitsLeft(AssertionError):
    """A unit of vstor is still loaded in systemd after the purge."""


class Lab:
    """The container, the vstor domain in it and what the steps compare."""

    def __init__(self, box: Container, debs: dict[str, Path]) -> None:
        self.box, self.debs = box, debs
        self.seed = 7000
        self.starts = 0
        self.before_install = ""
        self.owned: list[str] = []
        self.purged = False

    # -- the domain ----------------------------------------------------------------------

    def start_domain(self) -> None:
        """(Re)start the domain with a fresh loop job; its first rounds seen."""
        self.starts += 1
        self.seed += 1
        guest = Guest(Path(f"{GUEST}/vmlinuz"), Path(f"{GUEST}/initrd.img"))
        xml = annotated(NAME, guest, DISK, loop_job("vda", self.seed, SIZE, timeout=1800), workdir=CONSOLE_DIR)
        (self.box.root / "var/lib/vstor-test").mkdir(parents=True, exist_ok=True)
        (self.box.root / f"var/lib/vstor-test/{NAME}.xml").write_text(xml)
        self.box.path(CONSOLE).unlink(missing_ok=True)
        disk = self.box.path(DISK)
        with open(disk, "wb") as f:
            f.truncate(64 << 20)
        self.box.run("vstor", "define", f"/var/lib/vstor-test/{NAME}.xml")
        self.box.run("virsh", "-q", "start", NAME, timeout=120)
        self.wait_rounds(0)

    def stop_domain(self) -> None:
        """Destroy and undefine it (the hook releases); its record gone."""
        self.box.run("virsh", "-q", "destroy", NAME, check=False)
        self.wait_released()
        self.box.run("virsh", "-q", "undefine", NAME, check=False)

    def wait_released(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if not state["records"] and not state["daemons"]:
                return
            time.sleep(0.3)
        raise AssertionError(f"the domain stopped, vstor still holds: {self.state()}")

    def loop(self) -> dict:
        try:
            text = self.box.path(CONSOLE).read_bytes().decode("utf-8", "replace").replace("\r", "")
        except FileNotFoundError:
            text = ""
        return parse_loop(text)

    def rounds(self) -> int:
        progress = self.loop()["progress"]
        return progress[-1][0] if progress else 0

    def wait_rounds(self, after: int, more: int = ROUNDS_AFTER, timeout: float = PROGRESS) -> int:
        """The round count once the guest wrote `more` rounds past `after`;
        AssertionError (with the console's tail) if it fails or stalls."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loop = self.loop()
            if loop["fail"]:
                raise AssertionError(f"the guest failed a round: {loop['fail']}")
            if loop["progress"] and loop["progress"][-1][0] >= after + more:
                return loop["progress"][-1][0]
            time.sleep(0.5)
        raise AssertionError(f"the guest's rounds stalled: {self.rounds()} after {timeout:.0f}s "
                             f"(wanted {after + more}); console: {self.console_tail()}")

    def console_tail(self) -> str:
        try:
            return self.box.path(CONSOLE).read_text(errors="replace")[-800:]
        except OSError:
            return "(none)"

    def healthy(self) -> bool:
        """The domain runs, holds its daemons and its guest still writes."""
        if not self.state()["daemons"]:
            return False
        try:
            self.wait_rounds(self.rounds(), more=10, timeout=30)
            return True
        except AssertionError:
            return False

    # -- what the steps compare --------------------------------------------------------------

    def state(self) -> dict:
        return json.loads(self.box.run("python3", "-c", STATE).stdout)

    def survives(self, what: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run one step inside the container; then every daemon has its PID
        (BackendsStopped otherwise), the records are as they were and the
        guest's rounds go on."""
        before = self.state()
        assert before["daemons"] and before["records"], f"nothing runs before {what}: {before}"
        since = self.box.run("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()
        done = self.box.run(*argv, check=False, timeout=timeout)
        after = self.state()
        rounds = self.rounds()
        gone = {pid: d for pid, d in before["daemons"].items() if after["daemons"].get(pid) != d}
        if gone:
            raise BackendsStopped(
                f"{what}: qemu-storage-daemons stopped or replaced: before {before['daemons']}, "
                f"after {after['daemons']}\n--- {' '.join(argv)} (exit {done.returncode}):\n"
                f"{done.stdout[-2000:]}{done.stderr[-2000:]}\n--- journal since {since}:\n"
                + self.journal(since))
        assert after["records"] == before["records"], f"{what} changed vstor's records"
        self.wait_rounds(rounds)
        return done

    def journal(self, since: str) -> str:
        return self.box.run("journalctl", "--no-pager", "-o", "short-monotonic", "--since", since,
                            check=False).stdout[-6000:]

    def snapshot(self) -> str:
        return self.box.run("sh", "-c", SNAPSHOT).stdout


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> dict[str, Path]:
    """This tree's .deb, and a newer build of it for the upgrade."""
    out = tmp_path_factory.mktemp("debs")
    built = {}
    for key, suffix in (("current", ""), ("newer", NEWER)):
        done = subprocess.run(["bash", str(ROOT / "scripts/build-deb.sh"), str(out / key), *([suffix] if suffix else [])],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        built[key] = Path(done.stdout.strip().splitlines()[-1])
    return built


@pytest.fixture(scope="module")
def lab(debs):
    image = ensure_image()
    guest = build_guest()
    box = Container(image)
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(*_):             # a CI job's end: fixtures' teardown still runs
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, terminated)
    try:
        box.start()
        box.put(guest.kernel, f"{GUEST}/vmlinuz")
        box.put(guest.initrd, f"{GUEST}/initrd.img")
        for deb in debs.values():
            box.put(deb, f"{DEBS}/{deb.name}")
        yield Lab(box, {k: Path(DEBS) / d.name for k, d in debs.items()})
    finally:
        try:
            box.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def running(lab):
    """The domain runs and its guest writes; started again if an earlier
    step broke it."""
    if not lab.healthy():
        lab.stop_domain()
        lab.start_domain()
    return lab


def test_install_and_start_a_domain(lab):
    lab.before_install = lab.snapshot()
    done = lab.box.run("apt-get", "install", "-y", "-q", "--no-install-recommends", str(lab.debs["current"]))
    assert "restart libvirtd" in done.stdout + done.stderr      # the postinst says what to do
    lab.owned = lab.box.run("dpkg", "-L", "vstor").stdout.split()
    assert lab.box.run("systemctl", "is-enabled", "vstor-gc.timer").stdout.strip() == "enabled"
    assert lab.box.run("systemctl", "is-active", "vstor-gc.timer").stdout.strip() == "active"
    lab.box.run("systemctl", "restart", "libvirtd")         # it reads its hooks only when it starts
    lab.start_domain()
    state = lab.state()
    assert [r["status"] for r in state["records"].values()] == ["prepared"]
    assert state["daemons"], "no qemu-storage-daemon runs"
    for daemon in state["daemons"].values():                # each in a scope of vstor.slice
        assert "/vstor.slice/" in daemon["cgroup"][0], daemon
    for pid in state["daemons"]:                            # confined as without systemd
        status = dict(line.split(":", 1) for line in
                      lab.box.run("cat", f"/proc/{pid}/status").stdout.splitlines())
        uid = status["Uid"].split()
        assert uid[0] != "0" and len(set(uid)) == 1, status["Uid"]
        assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    # systemd-analyze security rates service units only: the daemons' scopes
    # have no execution settings of systemd's to rate (docs/security.md).
    scope = os.path.basename(next(iter(state["daemons"].values()))["cgroup"][0])
    assert scope.endswith(".scope"), scope
    rated = lab.box.run("systemd-analyze", "security", scope, check=False)
    assert rated.returncode != 0 and "is not a service unit" in rated.stderr, rated
    # Its I/O operations are counted for the metrics (io.stat where the io
    # controller is cgroup v2's; this host's is v1's, so only the setting is seen).
    assert lab.box.run("systemctl", "show", "--property=IOAccounting", "--value", scope).stdout.strip() == "yes"
    shown = lab.box.run("vstor", "metrics", "show").stdout
    assert re.search(r'^vstor_disk_stats_up\{[^}]*backend="qsd"[^}]*\} 1\.0$', shown, re.M), shown
    assert re.search(r'^vstor_disk_read_bytes_total\{[^}]*backend="qsd"', shown, re.M), shown


def test_an_upgrade_keeps_every_daemon(running):
    done = running.survives("the upgrade", "apt-get", "install", "-y", "-q", "--no-install-recommends",
                            str(running.debs["newer"]))
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "vstor: upgraded from 0.1.0: nothing to restart" in said, said     # the postinst
    version = running.box.run("dpkg-query", "-W", "-f=${Version}", "vstor").stdout
    assert version.endswith(NEWER)


def test_a_daemon_reload_keeps_every_daemon(running):
    done = running.survives("daemon-reload", "systemctl", "daemon-reload")
    assert done.returncode == 0, done.stderr


def test_a_libvirtd_restart_keeps_every_daemon(running):
    done = running.survives("the libvirtd restart", "systemctl", "restart", "libvirtd")
    assert done.returncode == 0, done.stderr
    assert running.box.run("virsh", "domstate", NAME).stdout.strip() == "running"


def test_vstor_gc_keeps_every_daemon(running):
    done = running.survives("vstor-gc", "systemctl", "start", "vstor-gc.service")
    assert done.returncode == 0, done.stderr
    shown = running.box.run("systemctl", "show", "-p", "Result", "-p", "ExecMainStatus",
                            "vstor-gc.service").stdout.split()
    assert shown == ["Result=success", "ExecMainStatus=0"], shown


def test_apt_remove_is_refused_while_a_domain_holds_backends(running):
    done = running.survives("apt-get remove", "apt-get", "remove", "-y", "-q", "vstor")
    said = done.stdout + done.stderr        # dpkg passes the prerm's stderr on to apt's stdout
    assert done.returncode != 0, said
    assert f"vstor: refusing to remove vstor: it holds backends for: {NAME}" in said, said
    status = running.box.run("dpkg-query", "-W", "-f=${Status}", "vstor").stdout
    assert status == "install ok installed", status


def test_purge_after_the_domain_stops_leaves_nothing(running):
    lab = running
    rounds_before = lab.rounds()
    stop_loop(lab.box.path(DISK), SIZE)             # the guest verifies its region and powers off
    deadline = time.monotonic() + 120
    while not lab.loop()["done"] and not lab.loop()["fail"] and time.monotonic() < deadline:
        time.sleep(0.5)
    loop = lab.loop()
    assert loop["done"] and not loop["fail"], lab.console_tail()
    assert loop["rounds"] >= rounds_before and loop["wrote"] == loop["read"]
    with open(lab.box.path(DISK), "rb") as f:
        assert f.read(SIZE) == loop_expected(lab.seed, SIZE, loop["rounds"])
    lab.wait_released()
    lab.box.run("virsh", "-q", "undefine", NAME)
    for path in (DISK, CONSOLE, f"/var/lib/vstor-test/{NAME}.xml"):
        lab.box.path(path).unlink(missing_ok=True)
    shutil.rmtree(lab.box.path("/var/lib/vstor-test"), ignore_errors=True)

    lab.box.run("apt-get", "purge", "-y", "-q", "vstor")

    assert lab.box.run("dpkg-query", "-W", "-f=${Status}", "vstor", check=False).stdout in ("", "unknown ok not-installed")
    left = [p for p in lab.owned if lab.box.path(p).exists() and not lab.box.path(p).is_dir()]
    assert not left, f"files of the package still exist: {left}"
    for path in ("/etc/vstor", "/run/vstor", "/var/lib/vstor", "/usr/lib/vstor", "/etc/libvirt/hooks/qemu.d/vstor"):
        assert not lab.box.path(path).exists(), path
    before, after = set(lab.before_install.splitlines()), set(lab.snapshot().splitlines())
    assert not after - before, f"paths or users not there before the install: {sorted(after - before)}"
    assert not before - after, f"paths or users gone since before the install: {sorted(before - after)}"
    lab.box.run("systemctl", "daemon-reload")
    files = lab.box.run("systemctl", "list-unit-files", "--no-legend", "vstor*", check=False).stdout
    assert not files.strip(), files
    lab.purged = True


def test_purge_leaves_no_unit_of_vstor_loaded(lab):
    """vstor.slice, started by the first daemon's scope, stays loaded and
    active after its unit file is gone unless the postrm stops it (it does,
    when the slice holds no process)."""
    if not lab.purged:
        pytest.skip("the purge test did not get through")
    units = lab.box.run("systemctl", "list-units", "--all", "--no-legend", "--plain", "vstor*").stdout
    if units.strip():
        raise UnitsLeft(units)
