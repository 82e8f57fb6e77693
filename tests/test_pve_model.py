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


def test_the_model_gives_qemu_servers_passthrough_devices_for_every_hostpci_case():
    from tests.pve.qemu_server import hostpci_args, hostpci_part, modelled_hostpci
    checked = 0
    for path, cfg in cases():
        lines = [cfg.get(f"hostpci{i}") for i in range(16) if cfg.get(f"hostpci{i}")]
        if not any(modelled_hostpci(v) for v in lines):
            continue
        want = hostpci_part(command(open(path + ".cmd").read()))
        got = hostpci_args(cfg)
        # The model leaves out what it does not know (mappings, several
        # functions, vendor overrides): each device it gives is qemu-server's,
        # in qemu-server's order.
        got, want = got[1::2], want[1::2]
        assert got == [v for v in want if v in got] and set(got) <= set(want), os.path.basename(path)
        pcie = sum(1 for v in lines if modelled_hostpci(v) and "pcie=1" in v)
        assert sum(1 for a in got if "bus=ich9-pcie-port-" in a) == pcie
        checked += len(got)
    assert checked >= 10        # pci.0 and pcie ports, with and without an extra root port


def test_every_case_qemu_server_started_passes_the_models_refusals():
    from tests.pve.qemu_server import refusal
    for path, cfg in cases():
        assert refusal(cfg) is None, os.path.basename(path)
