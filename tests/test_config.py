import os

import pytest

from vstor import config
from vstor.errors import BadInput


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


def test_the_readme_sample_config_loads_as_written(tmp_path, host_model):
    """README's /etc/vstor/vstor.conf block, inline comments and all; its
    [cpu] fits the templates' host (tests/hosts/two-socket.toml): a reactor
    and housekeeping cores on each node."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = readme[readme.index("## Configuration: /etc/vstor/vstor.conf"):]
    start = block.index("```ini") + len("```ini")
    path = tmp_path / "vstor.conf"
    path.write_text(block[start:block.index("```", start)])
    cfg = config.load(str(path))
    assert cfg.reactors == (2, 18) and cfg.export_address == "192.168.100.7"
    assert cfg.peer_command == "ssh -o BatchMode=yes -- {host} vstor migrate agent"
    host = host_model("two-socket")
    for node in host.nodes:
        assert set(cfg.reactors) & set(node.cpus) and set(cfg.housekeeping) & set(node.cpus)
