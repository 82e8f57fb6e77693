import os
import re
import subprocess
import sys

import pytest

from vstor import config, records
from vstor.errors import BadInput

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "etc", "vstor.conf")


def write(tmp_path, text):
    p = tmp_path / "vstor.conf"
    p.write_text(text)
    return str(p)


def test_missing_default_file_means_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.conf"))
    monkeypatch.delenv("VSTOR_CONFIG", raising=False)
    cfg = config.load()
    assert cfg.vhost_dir == "/run/vstor/vhost" and cfg.housekeeping is None and cfg.default_backend == "qsd"


def test_full_file_is_read(tmp_path):
    cfg = config.load(write(tmp_path, """
[paths]
vhost_dir = /run/x/vhost
[cpu]
housekeeping = 0-1,32-33
reactors = 2,34
[qemu]
user = qemu
group = qemu
[spdk]
rpc_socket = /run/spdk.sock
[pci]
allowed = 0000:5e:00.0, 5f:00.0
blocked = 0000:60:00.0
[vhost]
default_backend = spdk
[nvmf]
hostnqn = nqn.2014-08.org.nvmexpress:uuid:1
reconnect_delay_sec = 2
"""))
    assert cfg.housekeeping == (0, 1, 32, 33) and cfg.reactors == (2, 34)
    assert cfg.pci_allowed == ("0000:5e:00.0", "0000:5f:00.0") and cfg.pci_blocked == ("0000:60:00.0",)
    assert cfg.default_backend == "spdk" and cfg.reconnect_delay_sec == 2 and cfg.qemu_user == "qemu"
    assert cfg.vhost_dir == "/run/x/vhost" and cfg.spdk_socket == "/run/spdk.sock"


@pytest.mark.parametrize("text, words", [
    ("[cpu]\nreactor = 2\n", ["unknown key 'reactor'", "reactors"]),
    ("[spdkk]\n", ["unknown section [spdkk]"]),
    ("[cpu]\nreactors = two\n", ["not a CPU list"]),
    ("[pci]\nblocked = 5e:00\n", ["not a PCI address"]),
    ("[vhost]\ndefault_backend = iscsi\n", ["use qsd or spdk"]),
    ("[paths]\nvhost_dir = run/vhost\n", ["absolute path"]),
    ("no section\n", ["vstor.conf"]),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, words):
    with pytest.raises(BadInput) as e:
        config.load(write(tmp_path, text))
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        config.load(str(tmp_path / "nope.conf"))


def test_image_roots_are_a_list_of_absolute_directories(tmp_path):
    p = tmp_path / "vstor.conf"
    p.write_text("[paths]\nimages = /srv/images, /var/lib/libvirt/images/\n")
    assert config.load(str(p)).images == ("/srv/images", "/var/lib/libvirt/images")
    p.write_text("[paths]\nimages = relative/dir\n")
    with pytest.raises(BadInput, match="images"):
        config.load(str(p))


def test_the_sample_file_reads_to_the_defaults():
    """etc/vstor.conf, as the package installs it: every key commented out."""
    cfg = config.load(SAMPLE)
    assert cfg == config.Config() and cfg.source == SAMPLE
    assert cfg.peer_command == "ssh -o BatchMode=yes -- {host} vstor migrate agent"


def sample_examples() -> str:
    """The sample with its '# Example:' lines uncommented."""
    return re.sub(r"(?m)^# Example: (\w+ = .*)$", r"\1", open(SAMPLE).read())


def test_the_samples_examples_load_and_fit_the_templates_host(tmp_path, host_model):
    """Uncommented, the sample's examples are a working file; its [cpu] fits
    the templates' host (tests/hosts/two-socket.toml): a reactor and
    housekeeping cores on each node."""
    cfg = config.load(write(tmp_path, sample_examples()))
    assert cfg.reactors == (2, 18) and cfg.export_address == "192.168.100.7"
    assert cfg.migrate_shared == ("/srv/vmstore", "/dev/mapper/mpatha")
    assert config.conflicts(cfg) is None
    host = host_model("two-socket")
    for node in host.nodes:
        assert set(cfg.reactors) & set(node.cpus) and set(cfg.housekeeping) & set(node.cpus)


@pytest.mark.parametrize("key", config.KEYS, ids=str)
def test_each_key_reads_its_example_and_writes_it_back(tmp_path, key):
    """A key's sample value parses, and the value written back parses to
    the same value (what `vstor config show` and the sample rely on)."""
    cfg = config.load(write(tmp_path, f"[{key.section}]\n{key.name} = {key.sample_value()}\n"))
    value = getattr(cfg, key.attr)
    again = config.load(write(tmp_path, f"[{key.section}]\n{key.name} = {key.kind.format(value)}\n"))
    assert getattr(again, key.attr) == value


@pytest.mark.parametrize("key", [k for k in config.KEYS if type(k.kind).__name__ != "Text"], ids=str)
def test_each_key_refuses_a_bad_value_with_file_line_and_fix(tmp_path, key):
    path = write(tmp_path, f"# a comment\n\n[{key.section}]\n; another\n{key.name} = !bad value!\n")
    with pytest.raises(BadInput) as e:
        config.load(path)
    assert str(e.value).startswith((f"{path}:5: [{key.section}] {key.name}: ",
                                    f"{path}:5: [{key.section}] {key.name} must be "))
    assert "fix: " in str(e.value) and "\n" not in str(e.value)


def test_the_message_names_file_line_key_and_the_fix(tmp_path):
    path = write(tmp_path, "[paths]\nstate_dir = /run/x\n\n[cpu]\nhousekeeping = 0-1\n"
                           "Reactors = 1-x   ; the reactors\n")
    with pytest.raises(BadInput) as e:
        config.load(path)
    assert str(e.value) == f"{path}:6: [cpu] reactors: '1-x' is not a CPU list (fix: e.g. reactors = 2,18)"


@pytest.mark.parametrize("text, message", [
    ("[cpu]\nreactor = 2\n", ":2: unknown key 'reactor' in [cpu] (fix: did you mean reactors? "
                               "known keys: housekeeping, reactors)"),
    ("[paths]\n[spdkk]\n", ":2: unknown section [spdkk] (fix: did you mean spdk?"),
    ("[DEFAULT]\nreactors = 2\n", ":1: unknown section [DEFAULT]"),
    ("[cpu]\nreactors = 2\n[cpu]\n", ":3: section [cpu] appears twice"),
    ("[cpu]\nreactors = 2\nREACTORS = 3\n", ":3: [cpu] reactors is set twice"),
    ("\nreactors = 2\n[cpu]\n", ":2: 'reactors = 2' comes before any [section]"),
    ("[cpu]\nreactors = 2\njunk\n", ":3: 'junk' is neither a [section] nor key = value"),
    ("[cpu]\nreactors = 2-1\n", ":2: [cpu] reactors: '2-1' is not a CPU list: the range 2-1 runs backwards"),
    ("[migrate]\nexport_port = 70000\n", ":2: [migrate] export_port: 70000 is not a port "
                                          "(fix: a number from 1 to 65535, e.g. export_port = 4420)"),
])
def test_each_kind_of_mistake_is_one_line_with_its_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(BadInput) as e:
        config.load(path)
    assert str(e.value).startswith(path + message), str(e.value)


def test_a_file_that_is_not_utf8_is_refused_at_its_line(tmp_path):
    p = tmp_path / "vstor.conf"
    p.write_bytes(b"[qemu]\nuser = qemu\ngroup = k\xe9vm\n")
    with pytest.raises(BadInput, match=r"vstor.conf:3: not UTF-8"):
        config.load(str(p))


def test_empty_text_values_keep_the_default_other_empty_values_are_values(tmp_path):
    cfg = config.load(write(tmp_path, "[nvmf]\nhostnqn =\n[migrate]\npeer_command =\nshared =\n"
                                      "[cpu]\nhousekeeping =\n"))
    assert cfg.hostnqn is None and cfg.peer_command == config.Config().peer_command
    assert cfg.migrate_shared == () and cfg.housekeeping == ()
    with pytest.raises(BadInput, match="timeout must be a whole number of seconds, not ''"):
        config.load(write(tmp_path, "[migrate]\ntimeout =\n"))


def test_reactors_that_are_housekeeping_cores_conflict(tmp_path):
    path = write(tmp_path, "[cpu]\nhousekeeping = 0-3\nreactors = 2-3,8\n")
    err = config.conflicts(config.load(path), path)
    assert str(err) == (f"{path}:3: [cpu] reactors: cores 2-3 are both SPDK reactors and housekeeping cores "
                        "(fix: a core has one owner: take it out of reactors or housekeeping)")


def test_the_config_record_has_a_field_per_key_with_its_default():
    cfg = config.Config()
    assert [f.name for f in records.fields(cfg)] == [k.attr for k in config.KEYS] + ["source"]
    for key in config.KEYS:
        assert getattr(cfg, key.attr) == key.default


ROOT = os.path.join(os.path.dirname(__file__), "..")


def vstor(*args, env=None):
    """The real command, as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if k != "VSTOR_CONFIG"} | {"PYTHONPATH": ROOT} | (env or {})
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", *args], capture_output=True,
                         text=True, env=env)
    assert "Traceback" not in out.stderr
    return out


@pytest.mark.process
def test_config_check_says_ok_for_a_good_file(tmp_path):
    path = write(tmp_path, "[cpu]\nreactors = 2,18\n")
    out = vstor("config", "check", path)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"{path}: ok\n", "")
    # no FILE: --config, then VSTOR_CONFIG
    assert vstor("--config", path, "config", "check").stdout == f"{path}: ok\n"
    assert vstor("config", "check", env={"VSTOR_CONFIG": path}).stdout == f"{path}: ok\n"


@pytest.mark.process
def test_config_check_refuses_a_bad_file_in_one_line_exit_2(tmp_path):
    path = write(tmp_path, "[cpu]\nreactors = 1-x\n")
    out = vstor("--config", path, "config", "check")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"vstor: error: {path}:2: [cpu] reactors: '1-x' is not a CPU list "
                          "(fix: e.g. reactors = 2,18)\n")
    out = vstor("config", "check", write(tmp_path, "[cpu]\nreactors = 2\nhousekeeping = 2\n"))
    assert out.returncode == 2 and ":2: [cpu] reactors: cores 2 are both SPDK reactors and housekeeping cores" in out.stderr


@pytest.mark.process
def test_config_check_refuses_a_file_others_may_write(tmp_path):
    """Root runs the commands the file names: write access to it is root."""
    path = write(tmp_path, "[migrate]\npeer_command = ssh -- {host} vstor migrate agent\n")
    os.chmod(path, 0o664)
    out = vstor("config", "check", path)
    assert out.returncode == 2 and out.stderr == (
        f"vstor: error: {path}: group or others may write it (mode 0664), and root runs the "
        f"commands it names (fix: chmod go-w {path})\n")
    os.chmod(path, 0o644)
    assert vstor("config", "check", path).returncode == 0
    if os.geteuid() == 0:
        os.chown(path, 65534, -1)
        out = vstor("config", "check", path)
        assert out.returncode == 2 and "owned by uid 65534" in out.stderr
        assert f"(fix: chown root: {path})" in out.stderr


@pytest.mark.process
def test_config_check_of_a_file_it_cannot_read_is_a_refusal_never_ok(tmp_path):
    for path in (str(tmp_path), str(tmp_path / "absent.conf")):     # a directory, nothing
        out = vstor("config", "check", path)
        assert out.returncode == 2 and "ok" not in out.stdout and path in out.stderr
        assert out.stderr.count("\n") == 1


def test_config_check_without_a_file_says_the_defaults_apply(monkeypatch, tmp_path, capsys):
    from vstor.cli.main import main
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "vstor.conf"))
    monkeypatch.delenv("VSTOR_CONFIG", raising=False)
    assert main(["config", "check"]) == 0
    assert capsys.readouterr().out == f"{tmp_path}/vstor.conf: absent, vstor runs on the defaults\n"


@pytest.mark.process
def test_config_show_reads_back_to_the_same_values(tmp_path):
    path = write(tmp_path, sample_examples())
    shown = vstor("--config", path, "config", "show")
    assert shown.returncode == 0
    (tmp_path / "shown").mkdir()
    again = config.load(write(tmp_path / "shown", shown.stdout))
    assert again == config.load(path) and again.housekeeping == (0, 1, 16, 17, 32, 33, 48, 49)
    defaults = vstor("--config", write(tmp_path, ""), "config", "show").stdout
    assert "# housekeeping: the first core of each NUMA node\n" in defaults
    assert config.load(write(tmp_path, defaults)) == config.Config()


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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_config_line_numbers_count_newlines_only(tmp_path):
    """A form feed or U+2028 is no line break to configparser: the line
    named is the file's line (as an editor and `sed -n Np` count)."""
    path = tmp_path / "vstor.conf"
    path.write_text("[cpu]\x0c\n# a \u2028 note\nreactors = x\n")
    out = _check(path)
    assert out.returncode == 2 and f"{path}:3: [cpu] reactors" in out.stderr, out.stderr


# -- a config that no longer loads, read to undo what vstor holds (issue 30) ---------------------

@pytest.mark.parametrize("text, unread", [
    ("[paths]\nstate_dir = /srv/st\n[spdk]\nrpc_socket = /x/spdk.sock\n", frozenset()),
    ("[paths]\nstate_dir = /srv/st\nbogus = 1\n[spdk]\nrpc_socket = /x/spdk.sock\n",
     {"vhost_dir", "qsd_dir", "images"}),
    ("[paths]\nstate_dir = /srv/st\n[spdk]\nrpc_sockt = /x/spdk.sock\n", {"spdk_socket"}),
    ("[paths]\nstate_dir = /srv/st\n[cpu]\nreactors = x\n", {"reactors"}),
    ("[paths]\nstate_dr = /srv/st\n", {"state_dir"}),
    ("[path]\nstate_dir = /srv/st\n", {"state_dir", "vhost_dir", "qsd_dir", "images"}),
    ("[paths]\nstate_dir = relative\n", {"state_dir"}),
    ("garbage\n[paths]\nstate_dir = /srv/st\n", None),
])
def test_salvage_reads_every_key_that_reads_and_names_what_it_could_not(tmp_path, text, unread):
    got = config.salvage(write(tmp_path, text))
    assert got.unread == (None if unread is None else frozenset(unread))
    assert (got.problem is None) == (unread == frozenset() and "bogus" not in text)
    if got.knows("state_dir"):
        assert got.config.state_dir == "/srv/st"
    if "rpc_socket" in text:
        assert got.config.spdk_socket == "/x/spdk.sock"


def test_for_undo_warns_and_goes_on_unless_the_records_place_is_unknown(tmp_path):
    said = []
    cfg = config.for_undo(write(tmp_path, "[paths]\nstate_dir = /srv/st\n[cpu]\nreactor = 2\n"), said.append)
    assert cfg.state_dir == "/srv/st"
    assert said == [f"{tmp_path}/vstor.conf:4: unknown key 'reactor' in [cpu] (fix: did you mean reactors? "
                    "known keys: housekeeping, reactors); undoing by the records, with the keys that read"]
    with pytest.raises(BadInput, match="unknown key 'state_dr'"):
        config.for_undo(write(tmp_path, "[paths]\nstate_dr = /srv/st\n"), said.append)
    with pytest.raises(BadInput, match="comes before any"):
        config.for_undo(write(tmp_path, "x\n[paths]\nstate_dir = /srv/st\n"), said.append)
    assert len(said) == 1


@pytest.mark.parametrize("text", [
    "[PATHS]\nstate_dir = /srv/st\n",                   # a section's case: difflib finds no match
    "[DEFAULT]\nstate_dir = /srv/st\n",                 # not configparser's DEFAULT here: unknown
    "[storage]\nstate_dir = /srv/st\n",                 # a section name nothing like [paths]
    "[spdk]\nstate_dir = /srv/st\n",                    # the key under another section
    "[paths]\nrecords = /srv/st\n",                     # a key in [paths] named like none of its keys
])
def test_salvage_never_takes_the_default_state_dir_for_one_the_file_meant(tmp_path, text):
    """Where the file sets a state_dir that does not read (an unknown
    section, a key under another section or named like nothing), the
    default is not the one the operator meant: salvaging by it, gc found no
    record there and swept every qemu-storage-daemon of vstor's directories
    as an orphan, and prerm let a removal leave backends nobody releases."""
    got = config.salvage(write(tmp_path, text))
    assert got.problem is not None and not got.knows("state_dir"), got
    with pytest.raises(BadInput):
        config.for_undo(write(tmp_path, text), lambda m: None)


def test_salvage_still_knows_a_state_dir_the_file_sets_or_never_meant(tmp_path):
    """A problem that cannot be about state_dir leaves it known."""
    for text in ("[paths]\nstate_dir = /srv/st\nbogus = 1\n", "[spdk]\nrpc_sockt = /x\n",
                 "[cpu]\nreactor = 2\n", "[STORAGE]\nfoo = 1\n"):
        got = config.salvage(write(tmp_path, text))
        assert got.problem is not None and got.knows("state_dir"), text


@pytest.mark.parametrize("text", [
    "[paths]\nstate_dir = /srv/st\nqsd_dir = relative\n",
    "[paths]\nstate_dir = /srv/st\nvhost_dr = /srv/v\n",
    "[paths]\nstate_dir = /srv/st\n[pve]\nrun_dir = x\n",
])
def test_for_undo_refuses_when_the_sockets_daemons_or_proxmox_paths_do_not_read(tmp_path, text):
    """gc removes what is stale in vhost_dir and qsd_dir and releases the
    Proxmox VMs qemu-server says do not run: a default taken for a path the
    file meant otherwise would sweep or release the wrong things."""
    said = []
    with pytest.raises(BadInput):
        config.for_undo(write(tmp_path, text), said.append)
    assert said == []
