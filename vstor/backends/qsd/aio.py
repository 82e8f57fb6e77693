"""The host's AIO events, which a qemu-storage-daemon with aio=native
holds while it runs: io_setup(2) of QEMU's linux-aio takes a context of
EVENTS of fs.aio-max-nr (65536 by default, shared by every process: about
64 such daemons fill it), and fails with EAGAIN past it."""

from __future__ import annotations

EVENTS = 1024
FULL = "failed to create linux AIO context"      # qemu-storage-daemon's message then
FIX = "sysctl -w fs.aio-max-nr=1048576, and keep it in /etc/sysctl.d/"


def room(nr: str = "/proc/sys/fs/aio-nr", most: str = "/proc/sys/fs/aio-max-nr") -> bool:
    """Room for one more daemon's AIO context now (True when it cannot be
    read: the start then says)."""
    try:
        with open(nr) as f:
            used = int(f.read())
        with open(most) as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return True
    return used + EVENTS <= limit
