"""vstor hooks install --dry-run, vstor hooks uninstall (and its --dry-run):
what install wrote goes, nothing else does, and not while vstor holds
backends that only the hook would release."""

import os

import pytest

from tests.snapshot import tree_state
from tests.helpers import FakeJournal
from vstor import log
from vstor.cli.hooks import render_hook
from vstor.cli.main import main
from vstor.runtime.state import Record, StateDir


@pytest.fixture
def site(tmp_path, monkeypatch):
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {tmp_path}/state\n")
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", str(tmp_path / "no-journal"))
    monkeypatch.setenv("VSTOR_SYSLOG_SOCKET", str(tmp_path / "no-syslog"))
    return type("Site", (), {"dir": tmp_path, "conf": str(conf), "hooks": tmp_path / "qemu.d",
                             "state": StateDir(str(tmp_path / "state"))})


def vstor(site, *args):
    return main(["--config", site.conf, "hooks", *args, "--dir", str(site.hooks)])


def test_install_dry_run_writes_nothing_and_says_what_it_would(site, capsys):
    before = tree_state(str(site.dir))
    assert vstor(site, "install", "--dry-run") == 0
    out = capsys.readouterr().out
    assert tree_state(str(site.dir)) == before
    assert f"would create {site.hooks} (mode 0755)" in out
    assert f"would write {site.hooks}/vstor (mode 0755, " in out and f"config {site.conf}" in out
    assert vstor(site, "install") == 0
    capsys.readouterr()
    installed = tree_state(str(site.dir))
    assert vstor(site, "install", "--dry-run") == 0
    assert f"{site.hooks}/vstor is already this hook: nothing to write" in capsys.readouterr().out
    assert tree_state(str(site.dir)) == installed


def test_uninstall_removes_what_install_wrote_and_nothing_else(site, capsys):
    before = tree_state(str(site.dir))      # the directory libvirt reads stays: it is libvirt's
    assert vstor(site, "install") == 0
    (site.hooks / "other-hook").write_text("#!/bin/sh\nexit 0\n")
    with_other = tree_state(str(site.dir))
    assert vstor(site, "uninstall", "--dry-run") == 0
    assert "would remove" in capsys.readouterr().out
    assert tree_state(str(site.dir)) == with_other          # the dry run removed nothing
    assert vstor(site, "uninstall") == 0
    out = capsys.readouterr().out
    assert f"Removed {site.hooks}/vstor; restart libvirtd" in out
    after = tree_state(str(site.dir))
    assert set(with_other) - set(after) == {f"{site.hooks}/vstor"}
    assert vstor(site, "uninstall") == 0
    assert f"No vstor hook at {site.hooks}/vstor: nothing to remove" in capsys.readouterr().out
    assert set(after) - set(before) == {str(site.hooks), f"{site.hooks}/other-hook"}


def test_uninstall_dry_run_says_what_it_would_remove(site, capsys):
    assert vstor(site, "install") == 0
    capsys.readouterr()
    installed = tree_state(str(site.dir))
    assert vstor(site, "uninstall", "--dry-run") == 0
    assert capsys.readouterr().out == (f"would remove {site.hooks}/vstor; then: restart libvirtd "
                                       "(or virtqemud) so it forgets the hook\n")
    assert tree_state(str(site.dir)) == installed


@pytest.mark.parametrize("content", ["#!/bin/sh\n# the site's own hook\nlogger started\n",
                                     "#!/bin/sh\necho '# vstor\\'s libvirt QEMU hook'\n"])
def test_a_file_someone_else_wrote_is_left(site, capsys, content):
    site.hooks.mkdir(parents=True)
    (site.hooks / "vstor").write_text(content)
    before = tree_state(str(site.dir))
    for extra in ((), ("--dry-run",), ("--force",)):
        assert vstor(site, "uninstall", *extra) == 2
        err = capsys.readouterr().err
        assert f"{site.hooks}/vstor is not vstor's hook (someone else's file by that name): left" in err
        assert err.count("\n") == 1
    assert tree_state(str(site.dir)) == before


def test_a_symlink_in_the_hooks_place_is_left(site, capsys):
    site.hooks.mkdir(parents=True)
    real = site.dir / "real-hook"
    real.write_text(render_hook(None))
    os.symlink(real, site.hooks / "vstor")
    before = tree_state(str(site.dir))
    assert vstor(site, "uninstall") == 2
    assert "is not the hook vstor installs (not a regular file)" in capsys.readouterr().err
    assert tree_state(str(site.dir)) == before


def test_uninstall_is_refused_while_vstor_holds_backends_unless_forced(site, capsys):
    assert vstor(site, "install") == 0
    site.state.save(Record("web1", "web1", None))
    site.state.save(Record("pve-101", "pve-101", None))     # a Proxmox VM's: its hookscript releases it
    capsys.readouterr()
    installed = tree_state(str(site.dir))
    for extra in ((), ("--dry-run",)):
        assert vstor(site, "uninstall", *extra) == 3
        err = capsys.readouterr().err
        assert err.startswith("vstor: error: vstor holds backends for 1 domain ('web1'): without the "
                              "hook, libvirt's stop of each would not release them")
        assert "or --force, then `vstor release DOMAIN` for each after it stops" in err
        assert tree_state(str(site.dir)) == installed
    assert vstor(site, "uninstall", "--force") == 0
    out = capsys.readouterr().out
    assert f"Removed {site.hooks}/vstor;" in out
    assert "vstor still holds backends for 1 domain ('web1'): release each after it stops" in out
    assert not (site.hooks / "vstor").exists()


def test_a_damaged_record_counts_as_a_domain_that_may_run(site, capsys):
    assert vstor(site, "install") == 0
    os.makedirs(site.state.domains, exist_ok=True)
    with open(os.path.join(site.state.domains, "db1.json"), "w") as f:
        f.write("{not json")
    capsys.readouterr()
    assert vstor(site, "uninstall") == 3
    assert "a domain of a damaged record" in capsys.readouterr().err
    assert (site.hooks / "vstor").exists()


def test_install_and_uninstall_are_logged_dry_runs_are_not(site, monkeypatch, capsys):
    journal = FakeJournal(site.dir / "journal.sock")
    monkeypatch.setenv("VSTOR_JOURNAL_SOCKET", journal.path)
    try:
        assert vstor(site, "install", "--dry-run") == 0 and journal.entries() == []
        assert vstor(site, "install") == 0
        assert vstor(site, "uninstall", "--dry-run") == 0
        assert vstor(site, "uninstall") == 0
        got = [(e["VSTOR_COMMAND"], e["VSTOR_STEP"], e["VSTOR_RESULT"]) for e in journal.entries()]
        assert got == [("hooks install", f"install the libvirt hook {site.hooks}/vstor", "done"),
                       ("hooks uninstall", f"remove the hook {site.hooks}/vstor", "done")]
    finally:
        journal.sock.close()
        log.setup("")


def test_the_proxmox_hookscript_is_recognised_as_vstors():
    from vstor.cli.hooks import is_vstor_hook
    assert is_vstor_hook(render_hook(None, "proxmox/vstor"))
    assert is_vstor_hook(render_hook("/etc/vstor/vstor.conf"))


def test_no_hook_is_nothing_to_remove_even_while_domains_are_held(site, capsys):
    site.state.save(Record("web1", "web1", None))
    assert vstor(site, "uninstall") == 0
    assert f"No vstor hook at {site.hooks}/vstor: nothing to remove" in capsys.readouterr().out


def test_the_packages_hook_is_not_rewritten_and_its_removal_says_how_back(site, capsys, monkeypatch):
    """On a host where the Debian package installed the hook (a conffile),
    `hooks install` writes nothing (dpkg would ask about a changed conffile
    at every upgrade), refuses a config path the packaged hook cannot carry,
    and `hooks uninstall` says how the package brings it back."""
    from vstor.cli import hooks
    target = site.hooks / "vstor"
    site.hooks.mkdir()
    target.write_text(render_hook(None))
    target.chmod(0o755)
    conffiles = site.dir / "vstor.conffiles"
    conffiles.write_text(f"/etc/vstor/vstor.conf\n{target}\n")
    monkeypatch.setattr(hooks, "DPKG_CONFFILES", str(conffiles))
    before = tree_state(str(site.dir))
    assert main(["hooks", "install", "--dir", str(site.hooks)]) == 0
    assert "is the vstor package's hook" in capsys.readouterr().out
    assert vstor(site, "install") == 2                      # --config: the packaged hook has none
    assert "reads /etc/vstor/vstor.conf" in capsys.readouterr().err
    assert tree_state(str(site.dir)) == before
    assert vstor(site, "uninstall") == 0
    assert "--force-confmiss vstor" in capsys.readouterr().out
    assert not target.exists()


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
