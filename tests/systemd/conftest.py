"""tests/systemd: vstor's Debian package under a real systemd, in a
container (harness.py). Every test here starts processes and takes minutes:
marked e2e, process and slow. Skipped where the tools are missing or not
root, failed instead in CI."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import unavailable

HERE = Path(__file__).parent
TOOLS = ("systemd-nspawn", "mmdebstrap", "nsenter")


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            for mark in ("e2e", "process", "slow"):
                item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture(scope="session", autouse=True)
def _systemd_host() -> None:
    if os.geteuid() != 0:
        unavailable("systemd tests: need root (mount, cgroups, systemd-nspawn)")
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [tool for tool in TOOLS if not shutil.which(tool, path=path)]
    if missing:
        unavailable("systemd tests: not installed: " + ", ".join(missing)
                    + " (scripts/install-deps.sh installs them)")
