"""What every command may need, built lazily from the global options."""

from __future__ import annotations

import sys
from functools import cached_property

from vstor import config as config_mod
from vstor import counters
from vstor.errors import Unavailable
from vstor.runtime.context import HostContext, host_root
from vstor.runtime.holders import recorded
from vstor.runtime.inventory import load_ledger, plans_cache
from vstor.runtime.recordfile import DamagedRecord, UntrustedState


class Context(HostContext):
    """This host as the runtime acts on it (vstor.runtime.context), from
    the global options; the config is read when first needed."""

    def __init__(self, args):
        self.args = args
        self.host_root = host_root(args.host_root)
        self.uri = args.connect

    @cached_property
    def config(self):
        return _counting(config_mod.load(self.args.config), self.args)

    def undoing(self) -> "Context":
        """For a command that undoes what vstor holds (release, gc): the
        config's keys that read well when vstor.conf does not load, with a
        warning (vstor.config.for_undo)."""
        if "config" not in self.__dict__:
            self.config = _counting(config_mod.for_undo(self.args.config, warn), self.args)
        return self

    def ledger(self):
        """The ledger from libvirt; planning offline (another host's capture,
        or no libvirt here) goes on without it, and says so."""
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
        return self.state().planning(dry_run=dry_run)

    def records(self) -> list:
        """The state records as planning needs them (what each holds, from
        the index: vstor.runtime.holders.recorded): unreadable (not root) is a
        warning, as the start checks them again, as root."""
        try:
            return recorded(self.state())
        except (DamagedRecord, UntrustedState):
            raise
        except (OSError, Unavailable) as e:
            why = e.strerror if isinstance(e, OSError) else e.message
            warn(f"cannot read {self.config.state_dir} ({why}); planning without what "
                 "domains prepared outside libvirt hold")
            return []


def _counting(cfg, args):
    """`cfg`, with this run's events (a refusal, a record gc released)
    counted in its state directory for vstor's metrics; a dry run counts
    nothing (it changes nothing on the host)."""
    if not getattr(args, "dry_run", False):
        counters.at(cfg.state_dir)
    return cfg


def say(message: str) -> None:
    """One line of a command's progress, indented under its heading."""
    print(f"  {message}", flush=True)


def warn(message: str) -> None:
    print(f"vstor: warning: {message}", file=sys.stderr)
