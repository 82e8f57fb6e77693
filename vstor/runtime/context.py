"""This host as vstor acts on it: its config, the root its sysfs is read
under and libvirt's URI, and what is built from them, one way for every
entry point that is given one (the CLI, the Proxmox hookscript, the
migration agent): the host model, the libvirt connection, the Runtime and
the StateDir.  Each is built when first asked for: a command that never
needs libvirt never connects."""

from __future__ import annotations

import os
from functools import cached_property

from vstor.config import Config


def host_root(given: str | None = None) -> str:
    """The root sysfs and procfs are read under: `given` (--host-root), else
    $VSTOR_HOST_ROOT, else /."""
    return given or os.environ.get("VSTOR_HOST_ROOT") or "/"


class HostContext:
    def __init__(self, config: Config, root: str = "/", uri: str | None = None):
        self.config = config
        self.host_root = root
        self.uri = uri

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
        return virt.connect(self.uri)

    def runtime(self, dry_run: bool = False, force: bool = False):
        from vstor.host.sysfs import SysFS
        from vstor.runtime.executor import Runtime
        return Runtime(self.config, SysFS(self.host_root), dry_run=dry_run, force=force)

    def state(self):
        from vstor.runtime.state import StateDir
        return StateDir(self.config.state_dir)
