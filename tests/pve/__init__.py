"""Proxmox's own data for the tests: ../shared/pve (never copied in)."""

import glob
import os

from tests.helpers import SHARED, unavailable

CFG2CMD = os.path.join(SHARED, "pve", "cfg2cmd")


def proxmox_configs(recursive: bool = False) -> list[str]:
    """The cfg2cmd VM configs; missing in CI is a failure, elsewhere a skip."""
    pattern = os.path.join(CFG2CMD, "**", "*.conf") if recursive else os.path.join(CFG2CMD, "*.conf")
    found = sorted(glob.glob(pattern, recursive=recursive))
    if not found:
        missing_cfg2cmd()
    return found


def missing_cfg2cmd() -> None:
    unavailable(f"Proxmox's cfg2cmd test configs are not at {CFG2CMD} "
                "(../shared/pve next to the checkout, where CI puts it)")
