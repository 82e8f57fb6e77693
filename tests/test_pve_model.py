"""The test model of qemu-server (tests/pve/qemu_server.py) against Proxmox's
own cfg2cmd cases: for every case it models (no memory hotplug, no virtiofs,
no template), the memory and NUMA arguments must be exactly the ones
qemu-server generated."""

import os

from tests.pve import proxmox_configs
from tests.pve.qemu_server import command, memory_args, memory_part
from vstor.pve.config import PveConfig


def cases():
    found = proxmox_configs()
    out = []
    for path in found:
        cfg = PveConfig.parse(open(path).read(), path)
        if cfg.get("hotplug") and "memory" in cfg.get("hotplug") or cfg.get("template") == "1" \
                or any(k.startswith("virtiofs") for k in cfg.keys()):
            continue
        out.append((path, cfg))
    return out


def test_the_model_gives_qemu_servers_memory_and_numa_arguments_for_every_case():
    modelled = cases()
    assert len(modelled) >= 20
    numa = 0
    for path, cfg in modelled:
        want = memory_part(command(open(path + ".cmd").read()))
        assert memory_args(cfg) == want, os.path.basename(path)
        numa += "-numa" in want
    assert numa >= 8            # the NUMA cases are among them, not only plain -m ones
