"""The supervisor (vstor.runtime.supervise) with real qemu-storage-daemons:
a daemon that dies is started again through the checked path its prepare
took, a daemon that keeps dying is left dead and named by `vstor status`,
and a source swapped for a link out of the image roots is never served.
tests/e2e/test_supervise.py kills daemons under a running guest."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import time

from tests import qsd_fds
from tests.helpers import needs_root, site_fixture, until  # noqa: F401 (the fixture site)
from tests.helpers import site_vstor as vstor
from vstor.runtime import supervise
from vstor.runtime.state import StateDir

pytestmark = needs_root


def pid_of(site, disk="vdb") -> int | None:
    try:
        pid = int((site / "qsd" / f"log1-{disk}.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            alive = f.read().rsplit(") ", 1)[1][0] != "Z"   # a killed daemon nobody reaped yet
    except FileNotFoundError:
        alive = False
    return pid if alive else None


def killed(site, disk="vdb") -> int:
    """Kill the daemon; the new one's pid (0 when none came within 5 s)."""
    old = pid_of(site, disk)
    os.kill(old, 9)
    return pid_of(site, disk) if until(lambda: pid_of(site, disk) not in (None, old), 5) else 0


def test_a_killed_daemon_is_started_again_and_serves_again(site, capsys):
    assert vstor(site, "prepare", str(site / "r.xml")) == 0
    assert until(lambda: supervise.running(str(site / "state")), 5)     # started detached
    others = pid_of(site, "vdc")
    new = killed(site)
    assert new, "the daemon was not started again"
    assert pid_of(site, "vdc") == others            # the other disk's daemon untouched
    capsys.readouterr()
    assert vstor(site, "status", "log1") == 0       # it answers its monitor, its socket is there
    assert f"ok (qemu-storage-daemon pid {new})" in capsys.readouterr().out
    # The daemon serves the file the record names, opened again (not by a name it was given).
    assert [p for p in qsd_fds.serving(str(site / "d0.raw"))] == [new]


def test_a_daemon_that_keeps_dying_stays_dead_and_status_names_it(site, capsys):
    with open(site / "vstor.conf", "a") as f:      # 3 in 5 minutes: however slow the machine
        f.write("[vhost]\nrestart_limit = 3\nrestart_window = 300\n")
    assert vstor(site, "prepare", str(site / "r.xml")) == 0
    for _ in range(3):
        assert killed(site)
    old = pid_of(site)
    os.kill(old, 9)
    assert not until(lambda: pid_of(site) not in (None, old), 2)
    capsys.readouterr()
    assert vstor(site, "status", "log1") == 1
    out = capsys.readouterr().out
    assert "PROBLEM: qemu-storage-daemon log1-vdb stays dead: it died 4 times within 300s" in out
    # Prepared again, it is supervised again from a fresh count.
    assert vstor(site, "release", "log1") == 0
    assert vstor(site, "prepare", str(site / "r.xml")) == 0
    assert killed(site)
    capsys.readouterr()
    assert vstor(site, "status", "log1") == 0 and "stays dead" not in capsys.readouterr().out


def test_a_source_swapped_for_a_link_out_of_the_image_roots_is_never_served(site, capsys):
    secret = pathlib.Path(tempfile.mkdtemp(prefix="vs-sup-out-")) / "secret"
    secret.write_bytes(b"root's own" * 100)
    try:
        assert vstor(site, "prepare", str(site / "r.xml")) == 0
        (site / "d0.raw").unlink()
        (site / "d0.raw").symlink_to(secret)        # whoever may write in the image root
        old = pid_of(site)
        os.kill(old, 9)
        assert not until(lambda: pid_of(site) not in (None, old), 3)
        assert qsd_fds.serving(str(secret)) == []
        capsys.readouterr()
        assert vstor(site, "status", "log1") == 1
        assert "PROBLEM: qemu-storage-daemon is not running" in capsys.readouterr().out
    finally:
        shutil.rmtree(secret.parent)


def test_no_supervisor_runs_where_the_config_says_no(site):
    with open(site / "vstor.conf", "a") as f:
        f.write("[vhost]\nsupervise = no\n")
    assert vstor(site, "prepare", str(site / "r.xml")) == 0
    assert not until(lambda: supervise.running(str(site / "state")), 2)


def test_one_supervisor_per_state_directory_and_it_leaves_when_nothing_is_left(tmp_path):
    state = StateDir(str(tmp_path / "state"))
    os.makedirs(state.domains, mode=0o700)
    os.chmod(state.path, 0o700)
    with supervise._holding(state) as mine:
        assert mine and supervise.running(state.path)
        assert supervise.run(None, state, idle=0.1) is False       # another one holds it
    t0 = time.monotonic()
    assert supervise.run(None, state, idle=0.2) is True
    assert time.monotonic() - t0 < 3 and not supervise.running(state.path)
