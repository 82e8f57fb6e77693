"""What every command may need, built lazily from the global options."""

from __future__ import annotations

import os
import sys
from functools import cached_property

from vstor import config as config_mod
from vstor.errors import Unavailable


class Context:
    def __init__(self, args):
        self.args = args

    @cached_property
    def config(self):
        return config_mod.load(self.args.config)

    @property
    def host_root(self) -> str:
        return self.args.host_root or os.environ.get("VSTOR_HOST_ROOT") or "/"

    @cached_property
    def host(self):
        from vstor.errors import BadInput
        from vstor.host.read import read_host
        from vstor.host.sysfs import SysFS
        root = self.host_root
        if not os.path.isdir(os.path.join(root, "sys/devices/system/cpu")):
            raise BadInput(f"{root} holds no sysfs tree (no sys/devices/system/cpu)",
                           hint="extract a `vstor host capture` there, or build a layout "
                                "with python3 -m tests.hostlayout from a vstor checkout")
        return read_host(SysFS(root))

    @cached_property
    def conn(self):
        from vstor.runtime import virt
        return virt.connect(self.args.connect)

    def ledger(self):
        """The ledger from libvirt; planning offline (another host's capture,
        or no libvirt here) goes on without it, and says so."""
        from vstor.runtime.inventory import load_ledger, plans_cache
        if self.host_root != "/" and not self.args.connect:
            warn("planning against a host capture: other domains' holdings are not known")
            return load_ledger(None)
        records = self.records()
        try:
            return load_ledger(self.conn, records, plans_cache(self.config))
        except Unavailable as e:
            warn(f"{e}; planning without the ledger of other defined domains")
            return load_ledger(None, records)


    def planning(self, dry_run: bool = False):
        """The host's planning lock (vstor.runtime.state): held from before
        the ledger is read until the plan is written."""
        from vstor.runtime.state import StateDir
        return StateDir(self.config.state_dir).planning(dry_run=dry_run)

    def records(self) -> list:
        """The state records, for planning: unreadable (not root) is a
        warning, as the start checks them again, as root."""
        from vstor.runtime.state import StateDir
        try:
            return StateDir(self.config.state_dir).records()
        except OSError as e:
            warn(f"cannot read {self.config.state_dir} ({e.strerror}); planning without what "
                 "domains prepared outside libvirt hold")
            return []


def warn(message: str) -> None:
    print(f"vstor: warning: {message}", file=sys.stderr)
