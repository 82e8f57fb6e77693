"""What the step kinds share: the interface each class implements, what a
preflight says a step will write, and the form of a dry run's RPC lines."""

from __future__ import annotations

import json

from vstor.records import record

# What every kind's class defines in its own body (tests/test_kinds.py holds
# each to it), so that one module tells everything about one kind:
METHODS = ("describe", "dry_run", "to_data", "from_data", "makes", "preflight",
           "observe", "do", "undo", "undo_waits", "in_use", "check", "repair")
ATTRIBUTES = ("kind", "parallel", "private", "rpc_methods")


@record
class Writes:
    """The one file or device a step will serve, however it is named (a
    symlink, a second path): `thing` is ("dev", st_rdev) or ("file",
    st_dev, st_ino) of what was opened."""
    thing: tuple
    readonly: bool
    name: str       # the step's (its daemon's)
    path: str       # as the plan names it


def rpc_line(method: str, params: dict) -> str:
    """A dry run's line for one SPDK RPC."""
    return "SPDK RPC: " + json.dumps({"method": method, "params": params}, sort_keys=True)
