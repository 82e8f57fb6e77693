"""The systemd harness itself: a session killed half way is undone by the
next one, and a canary of the machine's /tmp that went missing fails loudly."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import harness
from tests.e2e.libvirtd import HELD_BY_PARENT, take_session_lock

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    return harness._comm(pid) is not None


@pytest.fixture
def session_lock():
    lock = take_session_lock(1800)      # the child's session rides on it (HELD_BY_PARENT)
    yield
    lock.close()


def test_a_killed_session_is_undone_by_the_next(session_lock):
    image = harness.ensure_image()
    name = f"vstor-sd-killed-{os.getpid()}"
    # A session in a child process boots a container, then dies by SIGKILL.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from tests.systemd.harness import Container
        box = Container(Path({str(image)!r}), name={name!r}, log=lambda line: None).start()
        print(box.leader, box._nspawn.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, **HELD_BY_PARENT})
    leader, nspawn = map(int, child.stdout.readline().split())
    assert child.wait() == -9
    directory = harness.BASE / "run" / name
    assert _alive(leader) and _alive(nspawn), "the container died with its session"
    cgroups = [Path(c) for c in harness.Journal.load(directory).doc["cgroups"]]
    assert all(c.is_dir() for c in cgroups)

    done = harness.reap_dead(log=lambda line: None)

    assert done[0] == f"stopped container {name} (nspawn pid {nspawn})"
    assert not _alive(leader) and not _alive(nspawn)
    assert not any(c.exists() for c in cgroups)
    assert not harness._mounted(directory / "root")
    assert not directory.exists()
    assert not Path(f"/run/systemd/nspawn/propagate/{name}").exists()
    assert not list(Path("/tmp").glob(f".vstor-systemd-canary-{name}"))
    assert harness.reap_dead(log=lambda line: None) == []


def test_a_missing_canary_fails_loudly(tmp_path, capsys):
    box = harness.Container(tmp_path, name="vstor-sd-canary")
    box.canaries = [tmp_path / "tmp-canary", tmp_path / "run-canary"]
    box.canaries[0].write_text("x")
    with pytest.raises(harness.HostTmpTouched, match="run-canary"):
        box.check_canaries("after the boot")
    assert "!!! after the boot" in capsys.readouterr().err


def test_no_tree_but_a_cached_image_is_booted(tmp_path):
    box = harness.Container(Path("/"), name="vstor-sd-refused")
    box.root = tmp_path
    with pytest.raises(RuntimeError, match="never booting systemd on another tree"):
        box._refuse_host_root()
    box.root = Path("/")
    with pytest.raises(RuntimeError, match="the machine's own root"):
        box._refuse_host_root()
