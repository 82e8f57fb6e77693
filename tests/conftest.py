"""Named host layouts (tests/hosts/<name>.toml) built into real temporary
sysfs/procfs trees, once per session."""

import os

import pytest

from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
from tests.hostlayout import build_tree

HOSTS_DIR = os.path.join(os.path.dirname(__file__), "hosts")


@pytest.fixture(scope="session")
def host_layout(tmp_path_factory):
    """name -> root of the tree built from tests/hosts/<name>.toml."""
    built: dict[str, str] = {}

    def root_of(name: str) -> str:
        if name not in built:
            root = tmp_path_factory.mktemp(f"host-{name}")
            built[name] = build_tree(os.path.join(HOSTS_DIR, f"{name}.toml"), root)
        return built[name]
    return root_of


@pytest.fixture(scope="session")
def host_model(host_layout):
    """name -> the Host read_host builds from that layout's tree."""
    return lambda name: read_host(SysFS(host_layout(name)))
