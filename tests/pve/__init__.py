"""Proxmox's own data for the tests: ../shared/pve (never copied in)."""

import glob
import os

import pytest

CFG2CMD = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "pve", "cfg2cmd")


def proxmox_configs(recursive: bool = False) -> list[str]:
    """The cfg2cmd VM configs; missing in CI is a failure, elsewhere a skip."""
    pattern = os.path.join(CFG2CMD, "**", "*.conf") if recursive else os.path.join(CFG2CMD, "*.conf")
    found = sorted(glob.glob(pattern, recursive=recursive))
    if not found:
        if os.environ.get("CI"):
            pytest.fail(f"Proxmox's cfg2cmd cases are missing ({CFG2CMD}): CI must have ../shared/pve")
        pytest.skip(f"Proxmox's cfg2cmd cases are not here ({CFG2CMD})")
    return found
