"""The log of host changes and refusals (vstor.log): one journal entry per
change and per refusal, in journald's native protocol, read back from a
datagram socket bound where the journal's would be; real
qemu-storage-daemons for the CLI's changes, the real installed hook for
the hook's."""

import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from tests.helpers import FakeJournal, J, Pve, make_site, parse, pve_applied, steps
from tests.helpers import site_fixture  # noqa: F401 (the fixture site)
from tests.helpers import site_vstor as vstor
from vstor import log
from vstor.cli.main import main
from vstor.errors import ActionFailed
from vstor.runtime.state import Record, StateDir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QEMU = ("--qemu-version", "9.2")
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="starts qemu-storage-daemons handed to root:kvm (needs root)")


@pytest.fixture
def journal(tmp_path, monkeypatch):
    j = FakeJournal(tmp_path / "journal.sock")
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", j.path)
    monkeypatch.setenv("VSTOR_SYSLOG_SOCKET", str(tmp_path / "no-syslog"))
    log.setup("test")
    yield j
    j.sock.close()
    log.setup("")


def test_the_native_protocol_carries_a_value_with_a_newline_length_prefixed():
    from vstor.log_handlers import journal_fields
    data = journal_fields({"MESSAGE": "a\nb", "PRIORITY": "6"})
    assert data == b"MESSAGE\n" + struct.pack("<Q", 3) + b"a\nb\nPRIORITY=6\n"
    assert parse(data) == {"MESSAGE": "a\nb", "PRIORITY": "6"}


def test_each_journaled_change_is_one_entry_with_its_domain_step_and_result(tmp_path, journal):
    state = StateDir(str(tmp_path / "state"))
    with pytest.raises(ActionFailed):
        J(state, Record("vm1", "vm1", None), None).run(steps(tmp_path, 3, {2: {"fail_do": True}}))
    got = [(e["VSTOR_DOMAIN"], e["VSTOR_STEP"], e["VSTOR_RESULT"], e["PRIORITY"]) for e in journal.entries()]
    assert got == [("vm1", "touch f0", "done", "6"), ("vm1", "touch f1", "done", "6"),
                   ("vm1", "touch f2", "failed", "3"),
                   ("vm1", "touch f2", "undone", "6"), ("vm1", "touch f1", "undone", "6"),
                   ("vm1", "touch f0", "undone", "6")]


def test_an_undo_that_fails_is_logged_as_such(tmp_path, journal):
    state = StateDir(str(tmp_path / "state"))
    with pytest.raises(ActionFailed):
        J(state, Record("vm1", "vm1", None), None).run(
            steps(tmp_path, 3, {1: {"fail_undo": True}, 2: {"fail_do": True}}))
    last = journal.entries()[-2:]
    assert [(e["VSTOR_STEP"], e["VSTOR_RESULT"]) for e in last] == [("touch f2", "undone"),
                                                                    ("touch f1", "undo failed")]
    assert last[1]["MESSAGE"] == "vm1: touch f1: undo failed: [Errno 16] injected busy"


def test_no_journal_and_no_syslog_logs_nothing_and_fails_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", str(tmp_path / "none"))
    monkeypatch.setenv("VSTOR_SYSLOG_SOCKET", str(tmp_path / "none"))
    log.setup("test")
    J(StateDir(str(tmp_path / "state")), Record("vm1", "vm1", None), None).run(steps(tmp_path, 2))
    assert capsys.readouterr() == ("", "")
    # a journal socket nobody reads any more: still nothing on stderr, no failure
    dead = FakeJournal(tmp_path / "dead.sock")
    dead.sock.close()
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", dead.path)
    log.setup("test")
    log.change("vm1", "touch f0", log.DONE)
    log.refusal("vm1 cannot start", 3, "vm1")
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", str(tmp_path / "none"))
    log.setup("test")
    log.refusal("vm1 cannot start", 3, "vm1")       # nowhere to log: not logging's stderr either
    assert capsys.readouterr() == ("", "")


def test_without_a_journal_lines_go_to_syslog(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "log"))
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", str(tmp_path / "none"))
    monkeypatch.setenv("VSTOR_SYSLOG_SOCKET", str(tmp_path / "log"))
    log.setup("test")
    log.change("vm1", "bind 0000:01:00.0 to vfio-pci", log.DONE)
    line = sock.recv(4096)
    sock.close()
    log.setup("")
    # <30>: facility daemon (3) * 8 + info (6)
    assert line.startswith(b"<30>vstor[%d]: " % os.getpid())
    assert line.rstrip(b"\0").endswith(b"vm1: bind 0000:01:00.0 to vfio-pci: done")


def test_a_refusal_is_one_entry_with_its_exit_code(journal, tmp_path, capsys):
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    assert main(["--config", str(conf), "status", "nosuch"]) == 2
    err = capsys.readouterr().err
    (entry,) = journal.entries()
    assert entry["VSTOR_RESULT"] == "refused" and entry["VSTOR_EXIT"] == "2"
    assert entry["VSTOR_COMMAND"] == "status" and entry["SYSLOG_IDENTIFIER"] == "vstor"
    assert entry["MESSAGE"] == "refused (exit 2): vstor holds nothing for domain 'nosuch' (see: vstor status)"
    assert err.count("\n") == 1         # the error's one line, and no other


def test_verbose_prints_the_changes_on_stderr_and_a_refusal_once(journal, tmp_path, capsys):
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    assert main(["--verbose", "--config", str(conf), "status", "nosuch"]) == 2
    assert capsys.readouterr().err.count("vstor holds nothing") == 1
    log.change("vm1", "touch f0", log.DONE)
    assert capsys.readouterr().err == "vstor: vm1: touch f0: done\n"
    assert len(journal.entries()) == 2


# -- the CLI and the hook, changing the host for real ---------------------------------------

@needs_root
def test_cli_prepare_and_release_log_each_change(site, journal, capsys):
    assert journal.entries() == []          # rendered: nothing changed, nothing logged
    assert vstor(site, "prepare", str(site / "r.xml")) == 0
    entries = journal.entries()
    assert [(e["VSTOR_DOMAIN"], e["VSTOR_RESULT"], e["VSTOR_COMMAND"]) for e in entries] == \
        [("log1", "done", "prepare")] * 3
    assert sorted(e["VSTOR_STEP"] for e in entries) == [
        f"mark log1 prepared for QEMU ({site}/vhost/log1.vstor-prepared)"] + [
        f"start qemu-storage-daemon for {site}/d{i}.raw on {site}/vhost/log1-vd{'bc'[i]}" for i in (0, 1)]
    assert vstor(site, "release", "log1", "--dry-run") == 0
    assert journal.entries() == []          # a dry run changes nothing and logs nothing
    assert vstor(site, "release", "log1") == 0
    assert [(e["VSTOR_RESULT"], e["VSTOR_COMMAND"]) for e in journal.entries()] == [("undone", "release")] * 3
    assert "vstor:" not in capsys.readouterr().err


@needs_root
def test_a_failed_start_logs_the_failure_each_undo_and_the_refusal(tmp_path, journal, capsys):
    site = make_site(tmp_path)      # pytest's 0700 directory: QEMU's group cannot reach the socket
    assert vstor(site, "prepare", str(site / "r.xml")) == 5
    entries = journal.entries()
    *changes, refusal = entries
    # both daemons (started side by side with the prepared mark) failed; the mark was made; each
    # of the three was undone (a half-done step is undone too)
    assert sorted((e["VSTOR_DOMAIN"], e["VSTOR_RESULT"]) for e in changes[:3]) == \
        [("log1", "done")] + [("log1", "failed")] * 2
    assert [(e["VSTOR_DOMAIN"], e["VSTOR_RESULT"]) for e in changes[3:]] == [("log1", "undone")] * 3
    assert {e["VSTOR_STEP"] for e in changes[:3]} == {e["VSTOR_STEP"] for e in changes[3:]}
    changes = [e for e in changes if e["VSTOR_RESULT"] == "failed"]
    assert "Permission denied" in changes[0]["MESSAGE"] and changes[0]["PRIORITY"] == "3"
    assert (refusal["VSTOR_RESULT"], refusal["VSTOR_EXIT"]) == ("refused", "5")
    assert capsys.readouterr().err.count("vstor: error:") == 1


@needs_root
def test_the_hook_logs_its_changes_and_a_refused_start(site, journal):
    from vstor.cli.hooks import render_hook
    conf = str(site / "vstor.conf")
    hook = site / "hook"
    hook.write_text(render_hook(conf))
    hook.chmod(0o755)
    xml = (site / "r.xml").read_bytes()
    env = {"PATH": "/usr/bin:/bin", "VSTOR_JOURNAL_SOCKET": journal.path}     # libvirt's scrubbed one

    def run(*argv, stdin=xml):
        return subprocess.run([str(hook), "log1", *argv], input=stdin, env=env, capture_output=True)
    done = run("prepare", "begin", "-")
    assert done.returncode == 0, done.stderr
    entries = journal.entries()
    changes = [e for e in entries if "VSTOR_RESULT" in e]
    assert [(e["VSTOR_RESULT"], e["VSTOR_COMMAND"], e["VSTOR_DOMAIN"]) for e in changes] == \
        [("done", "hook prepare", "log1")] * 3
    assert entries[-1]["MESSAGE"] == "log1: prepared: 3 host changes recorded"
    assert run("started", "begin", "-").returncode == 0 and journal.entries() == []
    # a domain never rendered (no plan): refused before any change, one line
    unplanned = (site / "vm.xml").read_bytes().replace(b"<name>log1</name>", b"<name>log2</name>")
    done = subprocess.run([str(hook), "log2", "prepare", "begin", "-"], input=unplanned, env=env,
                          capture_output=True)
    assert done.returncode == 2 and done.stderr.decode().count("\n") == 1
    (entry,) = journal.entries()
    assert (entry["VSTOR_DOMAIN"], entry["VSTOR_RESULT"], entry["VSTOR_EXIT"]) == ("log2", "refused", "2")
    assert entry["MESSAGE"].startswith("refused (exit 2): log2: prepare failed: domain 'log2' has vstor")
    assert run("release", "end", "-").returncode == 0
    assert [(e["VSTOR_RESULT"], e["VSTOR_COMMAND"]) for e in journal.entries()
            if "VSTOR_RESULT" in e] == [("undone", "hook release")] * 3


def test_the_hook_imports_no_logging_when_it_has_nothing_to_log():
    code = ("import sys; from vstor.hook import run; "
            "run(['x', 'started', 'begin', '-'], b''); print('logging' in sys.modules)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr


@needs_root
def test_the_proxmox_hookscript_logs_its_changes_and_refusals(tmp_path, journal):
    pve = Pve(tmp_path / "pve")
    try:
        text = pve_applied(pve)
        assert pve.vstor("pve", "hooks", "install") == 0     # logged itself: before what is read
        journal.entries()
        env = {"VSTOR_JOURNAL_SOCKET": journal.path}
        assert pve.hook(100, "pre-start", env=env).returncode == 0
        entries = journal.entries()
        assert [(e["VSTOR_DOMAIN"], e["VSTOR_RESULT"], e["VSTOR_COMMAND"]) for e in entries
                if "VSTOR_RESULT" in e] == [("pve-100", "done", "hookscript pre-start")]
        assert entries[-1]["MESSAGE"] == "pve-100: VM 100: pre-start: 1 host changes recorded"
        assert pve.hook(100, "post-stop", env=env).returncode == 0
        assert [(e["VSTOR_RESULT"], e["VSTOR_COMMAND"]) for e in journal.entries()
                if "VSTOR_RESULT" in e] == [("undone", "hookscript post-stop")]
        pve.vm(text.replace("cores: 2", "cores: 4"))
        done = pve.hook(100, "pre-start", env=env)
        assert done.returncode == 2
        (entry,) = journal.entries()
        assert (entry["VSTOR_DOMAIN"], entry["VSTOR_RESULT"], entry["VSTOR_EXIT"]) == ("pve-100", "refused", "2")
        assert entry["MESSAGE"] == f"refused (exit 2): VM 100: pre-start failed: {done.stderr.strip()[len('vstor: '):]}"
    finally:
        pve.vstor("release", "--force", "pve-100")


JOURNALD = "/lib/systemd/systemd-journald"
REAL_JOURNAL = r"""
set -e
mount -t tmpfs tmpfs /run/systemd
mkdir -p /run/log && mount -t tmpfs tmpfs /run/log
mkdir -p /run/systemd/journal
{journald} >/dev/null 2>&1 &
pid=$!
trap 'kill $pid; wait $pid || true' EXIT
for i in $(seq 100); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
{python} -c "$1"
sleep 0.3
journalctl --directory=/run/log/journal SYSLOG_IDENTIFIER=vstor -o json --no-pager
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(JOURNALD) or not shutil.which("unshare")
                    or not shutil.which("journalctl"), reason="needs root, systemd-journald, unshare")
def test_a_real_journald_keeps_the_fields():
    """Optional: the real systemd-journald, in a mount namespace of its own
    (its sockets and journal on tmpfs), reads what vstor sends."""
    import json
    code = ("from vstor import log; from vstor.log_handlers import journal_fields; import socket\n"
            "log.setup('prepare')\n"
            "log.change('web1', 'bind 0000:5e:00.0 to vfio-pci', log.DONE)\n"
            "log.refusal('web1 cannot start: no free core', 3, 'web1')\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "s.sendto(journal_fields({'MESSAGE': 'two\\nlines', 'SYSLOG_IDENTIFIER': 'vstor'}),"
            " log.JOURNAL_SOCKET)\n")
    script = REAL_JOURNAL.format(journald=JOURNALD, python=sys.executable)
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", code],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": ROOT})
    if out.returncode and "mount" in out.stderr:
        pytest.skip(f"cannot make a private journal here: {out.stderr.strip()[:200]}")
    entries = [json.loads(line) for line in out.stdout.splitlines()]
    got = [(e["MESSAGE"], e.get("VSTOR_DOMAIN"), e.get("VSTOR_RESULT"), e.get("VSTOR_EXIT"),
            e.get("VSTOR_COMMAND"), e.get("PRIORITY")) for e in entries]
    assert got == [("web1: bind 0000:5e:00.0 to vfio-pci: done", "web1", "done", None, "prepare", "6"),
                   ("refused (exit 3): web1 cannot start: no free core", "web1", "refused", "3", "prepare", "4"),
                   ("two\nlines", None, None, None, None, None)]


def test_vstors_other_loggers_keep_their_hosts_handlers(journal, caplog):
    """In nova-compute, vstor.nova.driver logs through Nova's handlers (the
    root logger's): making vstor's change log must not take them over."""
    import logging
    log.change("vm1", "touch f0", log.DONE)
    with caplog.at_level(logging.INFO):
        logging.getLogger("vstor.nova.driver").info("driver line")
    assert [r.getMessage() for r in caplog.records] == ["driver line"]
    assert [e["MESSAGE"] for e in journal.entries()] == ["vm1: touch f0: done"]


# -- logging: a journal or syslog that stopped reading ----------------------------------------


def _stuck_socket(path):
    """A datagram socket bound and never read, its queue full: a journald
    or syslog daemon that hangs."""
    import socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    try:
        while True:
            filler.sendto(b"x" * 64, str(path))
    except BlockingIOError:
        pass
    return server, filler


@pytest.mark.parametrize("via", ["journal", "syslog"])
def test_a_log_daemon_that_stopped_reading_holds_a_run_seconds_not_forever(tmp_path, via):
    """A hook logs a line per step: with journald or syslog stuck, the run
    waits once (SEND_TIMEOUT), not per line and never for ever."""
    import subprocess
    import sys
    import time
    sock = tmp_path / "stuck.sock"
    held = _stuck_socket(sock)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), ".."),
           "VSTOR_JOURNAL_SOCKET": str(sock) if via == "journal" else str(tmp_path / "none"),
           "VSTOR_SYSLOG_SOCKET": str(sock) if via == "syslog" else str(tmp_path / "none")}
    code = ("from vstor import log\nlog.setup('test')\n"
            "for i in range(10):\n    log.change('vm1', f'step {i}', log.DONE)\nprint('ok')\n")
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"10 lines to a stuck {via} took over 30 s")
    finally:
        for s in held:
            s.close()
    took = time.monotonic() - started
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")
    assert took < 6, f"{took:.1f} s"


# -- the Proxmox commands' host changes in the log ----------------------------------------------


@pytest.fixture
def pve(tmp_path):
    return Pve(tmp_path)


def test_pve_apply_unapply_and_hooks_install_log_their_host_changes(pve, capsys, tmp_path, monkeypatch):
    """They write /etc/pve/qemu-server/VMID.conf, the plan records and the
    hookscript: each a host change, logged with the VM's domain as the
    libvirt side's are."""
    j = FakeJournal(tmp_path / "journal.sock")
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", j.path)
    monkeypatch.setenv("VSTOR_SYSLOG_SOCKET", str(tmp_path / "no-syslog"))
    try:
        pve.vm()
        pve.intent(pve.file_disk())
        assert pve.vstor("pve", "hooks", "install") == 0
        assert pve.vstor("pve", "apply", "100", *QEMU) == 0
        assert pve.vstor("pve", "unapply", "100", "--dry-run") == 0
        dry = j.entries()
        assert pve.vstor("pve", "unapply", "100") == 0
        entries = dry + j.entries()
    finally:
        j.sock.close()
        log.setup("")
    conf = f"{pve.etc}/qemu-server/100.conf"
    said = [(e.get("VSTOR_DOMAIN"), e["MESSAGE"]) for e in entries]
    assert any(f"{pve.snippets}/vstor" in m and d is None for d, m in said), said
    applied = [m for d, m in said if d == "pve-100" and conf in m and "write" in m]
    removed = [m for d, m in said if d == "pve-100" and conf in m and "remove" in m]
    assert applied and removed, said
    assert any(d == "pve-100" and "remove the plan records" in m for d, m in said), said
    assert not any("would" in m for _, m in said)
