"""Named host layouts (tests/hosts/<name>.toml) built into real temporary
sysfs/procfs trees, once per session; and the suite's last check: it left
the checkout as it found it."""

import os
import subprocess

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


# -- the checkout is left as it was ------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_state(root: str = ROOT) -> set[str] | None:
    """What git says differs in the checkout: changed tracked files and
    untracked files it does not ignore; None outside a git checkout."""
    try:
        done = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=all"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(done.stdout.splitlines()) if done.returncode == 0 else None


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = checkout_state()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the checkout (a stray file at the root, a
    tracked file changed) fails the run, naming what it left."""
    before = session.config.stash.get(_BEFORE, None)
    after = checkout_state() if before is not None else None
    if after is None or after == before:
        return
    left = sorted(after - before) or sorted(before - after)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"the tests changed the checkout ({len(left)} paths): " + "; ".join(left[:8]),
                            red=True, bold=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[object]()
