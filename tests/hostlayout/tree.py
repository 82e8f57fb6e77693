"""Files and relative symlinks under a root, addressed by host paths."""

from __future__ import annotations

import os


class Tree:
    """Files and relative symlinks under a root, addressed by host paths."""

    def __init__(self, root: str):
        self.root = root

    def path(self, host_path: str) -> str:
        return self.root + host_path

    def mkdir(self, host_path: str) -> None:
        os.makedirs(self.path(host_path), exist_ok=True)

    def write(self, host_path: str, value="") -> None:
        self.mkdir(os.path.dirname(host_path))
        with open(self.path(host_path), "w") as f:
            f.write(f"{value}\n" if value != "" else "")

    def link(self, host_path: str, target: str) -> None:
        """A relative symlink, as sysfs makes them."""
        self.mkdir(os.path.dirname(host_path))
        if os.path.lexists(self.path(host_path)):
            os.unlink(self.path(host_path))
        os.symlink(os.path.relpath(target, os.path.dirname(host_path)), self.path(host_path))


def cpumask(cpus, width: int) -> str:
    """The kernel's hex mask notation: 32-bit words, high first, comma separated."""
    mask = sum(1 << cpu for cpu in cpus)
    words = [f"{(mask >> (32 * i)) & 0xFFFFFFFF:08x}" for i in range(max(1, (width + 31) // 32))]
    return ",".join(reversed(words))
