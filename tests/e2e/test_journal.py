"""The e2e harness's journal: what a session killed half way changed on the
machine is undone by the next one (ci-package.sh runs the same reaper), and
only what is still that session's own."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from . import libvirtd


def test_a_killed_session_is_undone_by_the_next(tmp_path, monkeypatch):
    journal = tmp_path / "session.json"
    monkeypatch.setattr(libvirtd, "JOURNAL", journal)
    ours, replaced, taken = tmp_path / "ours", tmp_path / "replaced", tmp_path / "taken"
    replaced.write_bytes(b"the operator's hook")
    # A session in a child process writes three hooks, then dies by SIGKILL.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(libvirtd.Path(__file__).parents[2])!r})
        from pathlib import Path
        from tests.e2e import libvirtd
        libvirtd.JOURNAL = Path({str(journal)!r})
        changes = libvirtd.Changes()
        for path in map(Path, {[str(ours), str(replaced), str(taken)]!r}):
            changes.hook(path, path.read_bytes() if path.exists() else None, b"test hook")
            path.write_bytes(b"test hook")
        changes.started["libvirtd"] = (os.getpid(), libvirtd._starttime(os.getpid()))
        changes.save()
        os.kill(os.getpid(), signal.SIGKILL)
        """)])
    assert child.wait() == -signal.SIGKILL
    taken.write_bytes(b"written since by someone else")

    done = libvirtd.reap_dead_session()

    assert not ours.exists()
    assert replaced.read_bytes() == b"the operator's hook"
    assert taken.read_bytes() == b"written since by someone else"
    assert not journal.exists()
    assert done == [f"restored {ours}", f"restored {replaced}"]    # the dead pid is not signalled
    assert libvirtd.reap_dead_session() == []


def test_a_pid_reused_since_is_not_signalled(tmp_path, monkeypatch):
    monkeypatch.setattr(libvirtd, "JOURNAL", tmp_path / "session.json")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        changes = libvirtd.Changes()
        changes.started["sleep"] = (sleeper.pid, libvirtd._starttime(sleeper.pid) - 1)
        changes.save()
        assert libvirtd.reap_dead_session() == []
        assert sleeper.poll() is None
        changes.started["sleep"] = (sleeper.pid, libvirtd._starttime(sleeper.pid))
        changes.save()
        assert libvirtd.reap_dead_session() == [f"stopped sleep (pid {sleeper.pid})"]
        assert sleeper.wait(5) == -15
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not (tmp_path / "session.json").exists()
