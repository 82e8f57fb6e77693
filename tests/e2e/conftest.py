"""Fixtures for end-to-end tests against a real libvirtd, QEMU (TCG) and
qemu-storage-daemon. Skipped where those are missing, failed instead in CI."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from .guest import Guest, build_guest
from .helpers import hooked
from .libvirtd import Daemons, which

HERE = Path(__file__).parent
TOOLS = ("qemu-system-x86_64", "qemu-storage-daemon", "libvirtd", "virtlogd")


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.e2e)
    # The live migrations run first: their TCG guests were lost after the move
    # far more often late in a full run (docs/testing.md has the
    # figures; see test_migration.GuestLost).
    first = HERE / "test_migration.py"
    items.sort(key=lambda item: Path(item.fspath) != first)


def unavailable(reason: str) -> None:
    """Skip, except in CI, where a missing piece must not pass as green."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"e2e: {reason} (CI is set, so this fails instead of skipping)",
                    pytrace=False)
    pytest.skip(f"e2e: {reason}")


@pytest.fixture(scope="session", autouse=True)
def _e2e_host() -> None:
    if os.geteuid() != 0:
        unavailable("needs root (libvirtd, hugepages, /etc/libvirt/hooks)")
    missing = [tool for tool in TOOLS if not which(tool)]
    if missing:
        unavailable("not installed: " + ", ".join(missing))


@pytest.fixture(scope="session")
def libvirt_daemons() -> Daemons:
    daemons = Daemons().start()
    yield daemons
    daemons.stop()


@pytest.fixture(scope="session")
def guest_image() -> Guest:
    return build_guest()


class _LiveConnection:
    """qemu:///system that survives Daemons.restart_libvirtd(): every call goes
    to the daemons' current connection. Objects fetched before a restart
    (domains) are dead after it: look them up again."""

    def __init__(self, daemons: Daemons) -> None:
        self._daemons = daemons

    def __getattr__(self, name):
        return getattr(self._daemons.connect(), name)


@pytest.fixture(scope="session")
def libvirt_conn(libvirt_daemons: Daemons):
    return _LiveConnection(libvirt_daemons)


@pytest.fixture(scope="module")
def vstor_env(libvirt_daemons):
    """A vstor config of its own, the hook installed into libvirt's qemu.d.
    No housekeeping cores on this 2-CPU machine: two 1-vCPU domains get a
    dedicated core each, with their emulator threads on their own core."""
    yield from hooked(libvirt_daemons, housekeeping="")
