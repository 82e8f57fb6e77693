"""Hostile review of issue 22's changes: each test is a problem found (it
failed before its fix)."""

import os

import pytest

from tests.test_pve import Pve
from vstor.pve.config import PveConfig

QEMU = ("--qemu-version", "9.2")


@pytest.fixture
def pve(tmp_path):
    return Pve(tmp_path)


def test_placement_lines_of_the_users_equal_to_the_plans_stay_when_apply_wrote_none(pve, capsys):
    """A config that already carried numa/numa0/hugepages/affinity exactly as
    the plan says (copied from a vstor VM, say): apply changes none of them,
    so none is vstor's, and unapply keeps them all."""
    pve.vm()
    pve.intent(pve.file_disk())
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    applied = PveConfig.parse(pve.config())
    assert pve.vstor("pve", "unapply", "100") == 0
    conf = PveConfig.parse(pve.config())
    for key in ("numa", "numa0", "hugepages", "affinity"):
        if applied.get(key):
            conf.set(key, applied.get(key))
    before = conf.to_text()
    pve.vm(before)
    assert pve.vstor("pve", "apply", "100", *QEMU) == 0
    assert "wrote args" in capsys.readouterr().out
    assert pve.vstor("pve", "unapply", "100") == 0, capsys.readouterr().err
    assert pve.config() == before
    assert not os.path.exists(f"{pve.snippets}/vstor-100.plan.keys")


@pytest.mark.parametrize("space", ["\x1c", "\x1f", "\x85", "\u00a0", "\u2028"])
def test_a_line_qemu_server_does_not_take_as_a_section_header_does_not_end_the_main_section(space):
    """qemu-server's \\s is ASCII whitespace: '[x]<U+00A0>' is no section
    header to it, and the hostpci0 line after it is the main section's (it
    passes the controller through).  vstor reads the config by qemu-server's
    rules, or its guards (a controller vstor holds for another VM) and
    unapply look at another config than the one Proxmox starts."""
    from tests.pve.oracle import require, showcmd
    from tests.test_pve import PCI
    require()
    text = f"cores: 2\nmemory: 1024\n[x]{space}\nhostpci0: 0000:5e:00.0\nhookscript: local:snippets/vstor{space}\n"
    start = showcmd(text, PCI)
    passed = any(a.startswith("vfio-pci,host=0000:5e:00.0") for a in start.argv)
    conf = PveConfig.parse(text)
    assert passed and conf.get("hostpci0") == "0000:5e:00.0"
    # A value qemu-server reads with the character (and refuses) is not vstor's hookscript.
    assert conf.get("hookscript") != "local:snippets/vstor"
