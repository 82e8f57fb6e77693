"""Hostile review of issue 22's changes: each test is a problem found (it
failed before its fix)."""

import os

import pytest

from tests.test_pve import Pve
from vstor.formats.pve.config import PveConfig

QEMU = ("--qemu-version", "9.2")


@pytest.fixture
def pve(tmp_path):
    return Pve(tmp_path)


def test_placement_lines_of_the_users_equal_to_the_plans_stay_when_apply_wrote_none(pve, capsys):
    """A config that already carried numa/numa0/hugepages/affinity exactly as
    the plan says (copied from a vstor VM, say): apply changes none of them,
    so none is vstor's, and unapply keeps them all."""
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    applied = PveConfig.parse(pve.config())
    assert pve.vstor("pve", "unapply", "100") == 0
    conf = PveConfig.parse(pve.config())
    for key in ("numa", "numa0", "hugepages", "affinity"):
        if applied.get(key):
            conf.set(key, applied.get(key))
    before = conf.to_text()
    pve.vm(before)
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    assert "wrote args" in capsys.readouterr().out
    assert pve.vstor("pve", "unapply", "100") == 0, capsys.readouterr().err
    assert pve.config() == before
    assert not os.path.exists(f"{pve.snippets}/vstor-100.plan.keys")


@pytest.mark.parametrize("space", ["\x1c", "\x1f", "\x85", "\u00a0", "\u2028"])
def test_a_line_qemu_server_does_not_take_as_a_section_header_does_not_end_the_main_section(space):
    """qemu-server's \\s is ASCII whitespace: '[x]<U+00A0>' is no section
    header to it, and the hostpci0 line after it is the main section's (it
    passes the controller through).  vstor reads the config by qemu-server's
    rules, or its guards (a controller vstor holds for another VM) and
    unapply look at another config than the one Proxmox starts."""
    from tests.pve.oracle import require, showcmd
    from tests.test_pve import PCI
    require()
    text = f"cores: 2\nmemory: 1024\n[x]{space}\nhostpci0: 0000:5e:00.0\nhookscript: local:snippets/vstor{space}\n"
    start = showcmd(text, PCI)
    passed = any(a.startswith("vfio-pci,host=0000:5e:00.0") for a in start.argv)
    conf = PveConfig.parse(text)
    assert passed and conf.get("hostpci0") == "0000:5e:00.0"
    # A value qemu-server reads with the character (and refuses) is not vstor's hookscript.
    assert conf.get("hookscript") != "local:snippets/vstor"


# -- vstor.conf: hostile or broken files -----------------------------------------------------

def _check(path, timeout=20):
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {k: v for k, v in os.environ.items() if k != "VSTOR_CONFIG"} | {"PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "config", "check", str(path)],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert "Traceback" not in out.stderr
    return out


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "huge"])
def test_config_check_of_a_fifo_a_device_or_a_huge_file_refuses_at_once(tmp_path, what):
    """A FIFO or /dev/zero as the config never hangs (the libvirt hook reads
    the config too); a 64 MiB file is refused, not read whole."""
    path = tmp_path / "vstor.conf"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "huge":
        with open(path, "w") as f:
            f.write("[cpu]\n" + "# x\n" * (16 << 20))
    else:
        path = what
    out = _check(path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and str(path) in out.stderr, out.stderr


@pytest.mark.parametrize("text, line, words", [
    ("[paths]\nstate_dir = /var/lib/vstor\n  /x\n", 3, "continues"),       # a path with a newline
    ("[cpu] reactors = 7\n", 1, "after"),                                # silently dropped
    ("[cpu]\rreactors = x\r", 1, "carriage return"),                     # a CR-only file: all dropped
    ("[\0none]\nstate_dir = /x\n[paths]\n", 1, "NUL"),   # configparser's DEFAULT here: spilled into [paths]
])
def test_config_lines_configparser_would_drop_or_join_are_refused(tmp_path, text, line, words):
    path = tmp_path / "vstor.conf"
    path.write_text(text)
    os.chmod(path, 0o644)
    out = _check(path)
    assert out.returncode == 2 and out.stderr.startswith(f"vstor: error: {path}:{line}: "), out.stderr
    assert words in out.stderr and out.stderr.count("\n") == 1


def test_config_line_numbers_count_newlines_only(tmp_path):
    """A form feed or U+2028 is no line break to configparser: the line
    named is the file's line (as an editor and `sed -n Np` count)."""
    path = tmp_path / "vstor.conf"
    path.write_text("[cpu]\x0c\n# a \u2028 note\nreactors = x\n")
    out = _check(path)
    assert out.returncode == 2 and f"{path}:3: [cpu] reactors" in out.stderr, out.stderr


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


# -- hooks install over what is not vstor's hook --------------------------------------------

@pytest.mark.parametrize("what", ["fifo", "someone-elses", "symlink"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_hooks_install_leaves_what_is_not_vstors_hook(tmp_path, monkeypatch, capsys, what, dry_run):
    """As uninstall: a FIFO (which --dry-run opened and waited on for ever),
    someone else's script, a symlink in the hook's place is refused, one
    line, and left as it is."""
    import subprocess
    import sys
    hooks = tmp_path / "qemu.d"
    hooks.mkdir()
    target = hooks / "vstor"
    if what == "fifo":
        os.mkfifo(target)
    elif what == "someone-elses":
        target.write_text("#!/bin/sh\necho mine\n")
    else:
        (tmp_path / "elsewhere").write_text("#!/bin/sh\necho theirs\n")
        target.symlink_to(tmp_path / "elsewhere")
    before = {p: (os.lstat(p).st_mode, os.lstat(p).st_ino) for p in (target,)}
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": root, "VSTOR_JOURNAL_SOCKET": str(tmp_path / "none"),
           "VSTOR_SYSLOG_SOCKET": str(tmp_path / "none")}
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(conf), "hooks",
                          "install", "--dir", str(hooks)] + (["--dry-run"] if dry_run else []),
                         env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "left as it is" in out.stderr, out
    assert {p: (os.lstat(p).st_mode, os.lstat(p).st_ino) for p in (target,)} == before


# -- the package's prerm ---------------------------------------------------------------------

def test_prerm_refuses_a_remove_when_the_config_naming_the_state_dir_cannot_be_read(tmp_path):
    """vstor's records live where vstor.conf says: a config that does not
    load (a typo made since, a key a newer vstor refuses) is no reason to
    look in the default place, find nothing there and remove vstor while
    it holds backends nobody would then release."""
    import subprocess
    state = tmp_path / "state"
    (state / "domains").mkdir(parents=True)
    (state / "domains" / "web1.json").write_text("{}")
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {state}\n[cpu]\nreactors = 2-\n")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": root, "VSTOR_CONFIG": str(conf)}
    env.pop("VSTOR_REMOVE_KEEP_BACKENDS", None)
    done = subprocess.run(["sh", os.path.join(root, "debian", "vstor.prerm"), "remove"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done
    assert "vstor.conf" in done.stderr and "VSTOR_REMOVE_KEEP_BACKENDS=1" in done.stderr
    conf.write_text(f"[paths]\nstate_dir = {state}\n")          # as before: the record refuses it
    done = subprocess.run(["sh", os.path.join(root, "debian", "vstor.prerm"), "remove"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "web1" in done.stderr, done
    (state / "domains" / "web1.json").unlink()
    done = subprocess.run(["sh", os.path.join(root, "debian", "vstor.prerm"), "remove"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done


# -- the Nova finder's .pth, at every interpreter start of Nova's venv ------------------------

@pytest.mark.parametrize("pth", ["file", "install-driver"])
def test_the_pth_of_a_half_removed_vstor_never_troubles_an_interpreters_start(tmp_path, pth):
    """vstor-nova.pth without _vstor_nova beside it (a removal half done, a
    finder deleted by hand): every Python of that venv still starts, and
    says nothing on stderr (site printed a traceback at each start)."""
    import subprocess
    import sys
    from vstor.nova import install
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, install.PTH)) as f:
        text = f.read() if pth == "file" else install.PTH_TEXT
    if pth == "file":
        assert text == install.PTH_TEXT      # one text: the wheel's and install-driver's
    (tmp_path / install.PTH).write_text(text)
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
            "print([f.__name__ for f in sys.meta_path if isinstance(f, type)])")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0 and "VstorNovaFinder" not in done.stdout and done.stderr == "", done
    # With the finder there, it is installed as before.
    with open(os.path.join(root, install.FINDER)) as f:
        (tmp_path / install.FINDER).write_text(f.read())
    code = f"import site, sys; site.addsitedir({str(tmp_path)!r}); print([f.__name__ for f in sys.meta_path][-1])"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert (done.returncode, done.stdout, done.stderr) == (0, "VstorNovaFinder\n", "")


# -- unapply and a state record of another domain by the VM's name ----------------------------

def test_unapply_releases_no_record_of_another_uuid_by_the_vms_name(pve, capsys):
    """A libvirt domain may be named pve-100 (any libvirt client chooses
    names): its record is not VM 100's, whose UUID is in smbios1.  unapply
    leaves it, refusing in one line, and changes nothing."""
    from vstor.runtime.state import Record, StateDir
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    applied = pve.config()
    state = StateDir(f"{pve.root}/state")
    state.save(Record("pve-100", "pve-100", "11111111-2222-3333-4444-555555555555", status="prepared"))
    capsys.readouterr()
    assert pve.vstor("pve", "unapply", "100") == 3
    err = capsys.readouterr().err
    assert "11111111-2222-3333-4444-555555555555" in err and err.count("\n") == 1, err
    assert state.load("pve-100") is not None and pve.config() == applied
    assert os.path.exists(f"{pve.snippets}/vstor-100.plan.xml")


# -- args split as qemu-server splits it, on its bytes -----------------------------------------

def test_args_split_on_ascii_blanks_only_as_perl_splits_qemu_servers_bytes():
    """qemu-server reads the config as bytes: to Perl's shellwords U+00A0,
    U+2028 or \\x1c are no blank, to Python's \\s they are.  Split apart,
    '-foo\\x1c-chardev socket,id=vstor-...' would let unapply take a word of
    the user's for the start of vstor's part."""
    import random
    import shutil
    import subprocess
    from vstor.formats.pve.words import shellwords
    from vstor.render.pve import has_vstor_args
    if not shutil.which("perl"):
        pytest.fail("perl is missing")
    perl = (r'use Text::ParseWords; while (my $l = <STDIN>) { chomp $l; my $s = pack("H*", $l); '
            r'my @w = shellwords($s); print scalar(@w), ":", join(",", map { unpack("H*", $_) } @w), "\n"; }')
    rng = random.Random(5)
    alphabet = ["a", "-", " ", "\t", "'", '"', "\\", "\x1c", "\x1f", "\x85", "\xa0", "\u2028", "\u3000"]
    cases = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(2000)]
    cases = [c for c in cases if c.strip(" \t")]
    stdin = "".join(c.encode().hex() + "\n" for c in cases)
    out = subprocess.run(["perl", "-e", perl], input=stdin, capture_output=True, text=True, check=True)
    for case, line in zip(cases, out.stdout.split("\n")):
        count, _, words = line.partition(":")
        want = [bytes.fromhex(w).decode() for w in words.split(",")] if int(count) else []
        assert (shellwords(case) or []) == want, repr(case)
    assert not has_vstor_args("-foo\x1c-chardev socket,id=vstor-vdb,path=/a,reconnect=1")


# -- purge after a removal that kept backends, with the records elsewhere -----------------------

def test_purge_keeps_run_vstor_after_a_removal_that_kept_backends_recorded_elsewhere(tmp_path):
    """[paths] state_dir elsewhere, vhost_dir and qsd_dir at their defaults
    under /run/vstor: a removal forced with VSTOR_REMOVE_KEEP_BACKENDS=1
    leaves daemons serving from /run/vstor (their sockets, their pidfiles,
    which the guide says to stop them by), and purge must not delete those
    because /run/vstor/state holds no record.  In a private mount namespace
    with its own /run."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a private /run)")
    root = os.path.join(os.path.dirname(__file__), "..")
    state = tmp_path / "state"
    (state / "domains").mkdir(parents=True)
    (state / "domains" / "web1.json").write_text("{}")
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {state}\n")
    script = (f"mount -t tmpfs tmpfs /run && mkdir -p /run/vstor/qsd && touch /run/vstor/qsd/web1.pid && "
              f"VSTOR_REMOVE_KEEP_BACKENDS=1 sh {root}/debian/vstor.prerm remove && "
              f"sh {root}/debian/vstor.postrm purge && ls /run/vstor/qsd")
    env = {**os.environ, "PYTHONPATH": root, "VSTOR_CONFIG": str(conf)}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "web1.pid\n", done
    assert "keeping /run/vstor" in done.stderr


def test_keys_left_by_an_unapply_killed_before_their_removal_are_not_taken_by_the_next_apply(pve, capsys):
    """unapply removes the plan, then the keys file: killed in between, the
    keys of a plan no longer recorded stay.  The next apply must not take
    them for lines it wrote: a user's `numa: 1` equal to the plan's stays
    theirs, and the next unapply keeps it."""
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    keys = open(f"{pve.snippets}/vstor-100.plan.keys").read()
    assert "numa\n" in keys
    assert pve.vstor("pve", "unapply", "100") == 0
    with open(f"{pve.snippets}/vstor-100.plan.keys", "w") as f:     # as a kill there leaves it
        f.write(keys)
    conf = PveConfig.parse(pve.config())
    conf.set("numa", "1")
    before = conf.to_text()
    pve.vm(before)
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0, capsys.readouterr().err
    assert pve.vstor("pve", "unapply", "100") == 0, capsys.readouterr().err
    assert pve.config() == before


# -- the Proxmox commands' host changes in the log ----------------------------------------------

def test_pve_apply_unapply_and_hooks_install_log_their_host_changes(pve, capsys, tmp_path, monkeypatch):
    """They write /etc/pve/qemu-server/VMID.conf, the plan records and the
    hookscript: each a host change, logged with the VM's domain as the
    libvirt side's are."""
    from tests.test_logging import FakeJournal
    from vstor import log
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
