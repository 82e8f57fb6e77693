"""vstor/formats/pve/grammar.py held to Proxmox's own Perl (tests/pve/oracle.py):
property strings on thousands of generated values, pci.cfg mappings, and
every hostpciN form through qemu-server's own command line."""

import random

import pytest

from tests.pve.oracle import perl, showcmd, vfio_hosts
from vstor.errors import BadInput
from vstor.formats.pve import grammar
from vstor.formats.pve.config import PveConfig

FORMATS = {"pve-qm-hostpci": grammar.HOSTPCI, "pve-qm-numanode": grammar.NUMA,
           "pve-qemu-machine-fmt": grammar.MACHINE, "pve-qm-smbios1": grammar.SMBIOS1}

PARSE = r'''
use strict; use warnings; use JSON; use PVE::QemuServer;
$SIG{__WARN__} = sub {};
while (my $line = <STDIN>) {
    my ($fmt, $value) = @{ JSON->new->allow_nonref->decode($line) };
    my $res = eval { PVE::JSONSchema::parse_property_string($fmt, $value) };
    print encode_json($@ ? { error => "$@" } : { ok => { map { $_ => "$res->{$_}" } keys %$res } }), "\n";
}
'''

PIECES = {
    "pve-qm-hostpci": ["host=", "5e:00.0", "0000:5e:00.0", "5e:00", "0000:5e:00", "5E:00.0", ";", "3b:00.0",
                       "pcie=", "rombar=", "x-vga=", "1", "0", "on", "off", "yes", "TRUE", "mapping=",
                       "nvme-1", "romfile=a.rom", "driver=keep", "driver=", "vfio", "mdev=x", ",", ",", ",",
                       "=", " ", "legacy-igd=1", "vendor-id=0x1234", "10000:5e:00.0", "5e:00.8", "host"],
    "pve-qm-numanode": ["cpus=", "0-3", "0", ";", "7", "memory=", "1024", "1.5", "hostnodes=", "11",
                        "policy=", "bind", "preferred", "interleave", ",", ",", "=", "0-1;4-5", " "],
    "pve-qemu-machine-fmt": ["q35", "pc", "type=", "pc-q35-9.2+pve1", "viommu=", "intel", "virtio",
                             "aw-bits=", "39", "enable-s3=", "1", ",", ",", "=", "pc-i440fx-8.0", "x"],
    "pve-qm-smbios1": ["uuid=", "6ad6b5f0-3b36-4a8e-9e1c-1f0d2d5e8c11", "6AD6B5F0-3B36-4A8E-9E1C-1F0D2D5E8C11",
                       "base64=", "1", "serial=", "QUJD", "a=b", ",", ",", "=", "family=", "x y"],
}


def _generated(n: int) -> list[tuple[str, str]]:
    rng = random.Random(21)
    out = []
    for fmt, pieces in PIECES.items():
        for _ in range(n):
            out.append((fmt, "".join(rng.choice(pieces) for _ in range(rng.randint(1, 7)))))
    return out


@pytest.mark.process
def test_property_strings_parse_as_proxmox_parses_them():
    cases = _generated(1500)
    cases += [("pve-qm-hostpci", v) for v in ("pcie=1,host=0000:5e:00.0", "rombar=0,host=5e:00.0",
                                              "pcie=1,host=5e:00", "x-vga=1,host=5e:00.0", "5e:00.0,,",
                                              ",5e:00.0", "5e:00.0,host=5f:00.0", "host=5e:00.0,5f:00.0")]
    answers = perl(PARSE, [list(c) for c in cases])
    agree = 0
    for (fmt, value), answer in zip(cases, answers):
        try:
            mine = {"ok": grammar.parse(FORMATS[fmt], value)}
        except grammar.Invalid as e:
            mine = {"error": str(e)}
        assert ("ok" in mine) == ("ok" in answer), (fmt, value, mine, answer)
        if "ok" in mine:
            assert mine["ok"] == answer["ok"], (fmt, value)
            agree += 1
    assert agree > 300          # enough of them parse, not only refusals


MAPPINGS = r'''
use strict; use warnings; use JSON; use PVE::Mapping::PCI;
$SIG{__WARN__} = sub {};
while (my $line = <STDIN>) {
    my ($raw, $id, $node) = @{ decode_json($line) };
    my $cfg = PVE::Mapping::PCI->parse_config("mapping/pci.cfg", $raw);
    my $r = PVE::Mapping::PCI::get_node_mapping($cfg, $id, $node);
    print encode_json(defined($r) ? [map { $_->{path} } @$r] : undef), "\n";
}
'''

PCI_CFG = [
    "nvme1\n\tmap node=pve1,path=0000:5e:00.0,id=144d:a80a\n\tmap node=pve2,path=0000:5f:00,id=144d:a80a\n",
    "# cluster mappings\nnvme1\n\tdescription data disk\n\tmap id=144d:a80a,path=0000:5e:00;0000:3b:00.0,"
    "node=pve1,iommugroup=3\n\ngpu\n\tmap node=pve1,path=0000:17:00.0,id=10de:1234\n",
    "nvme1\n\tmap node=pve1,path=0000:5f:00.0,id=144d:a80a\n\nnvme1\n\tmap node=pve1,path=0000:5e:00.0,id=144d:a80a\n",
    "nvme1\n\t# a comment inside\n\tmap node=pve1,path=0000:5e:00.0,id=144d:a80a\n",
    "other\n\tmap node=pve1,path=0000:5e:00.0,id=144d:a80a\n",
    "nvme1\n\tmap node=pve2,path=0000:5e:00.0,id=144d:a80a\n",
]


@pytest.mark.process
@pytest.mark.parametrize("text", PCI_CFG)
def test_mappings_resolve_as_proxmox_resolves_them(text):
    want = perl(MAPPINGS, [[text, "nvme1", "pve1"]])[0]
    want = [p for entry in want for p in entry.split(";")] if want else []
    try:
        got = list(grammar.Mappings(text, "pve1").paths("nvme1", "VM 100: hostpci0"))
    except BadInput as e:
        assert not want, e.message          # refused: Proxmox finds nothing either
        return
    assert got == want


def test_a_mapping_that_cannot_be_resolved_is_refused():
    for mappings in (grammar.Mappings(None, "pve1", "Permission denied"), grammar.Mappings("", "pve1"),
                     grammar.Mappings(PCI_CFG[5], "pve1"),
                     grammar.Mappings("nvme1\n\tmap node=pve1,path=5e:00.0\n", "pve1")):
        with pytest.raises(BadInput, match="mapping=nvme1"):
            grammar.handed("hostpci0", "mapping=nvme1,pcie=1", mappings, "VM 100: hostpci0")


FUNCTIONS = ("0000:3b:00.0", "0000:5e:00.0", "0000:5e:00.1", "0000:5f:00.0")
HOSTPCI = ["pcie=1,host=0000:5e:00.0", "rombar=0,host=5e:00.0", "pcie=1,host=5e:00", "x-vga=1,host=5e:00.0",
           "host=3b:00.0;5e:00.0,pcie=1", "5e:00.0,pcie=on", "pcie=yes,5e:00", ",5e:00.0,", "5e:00.0,,rombar=0",
           "host=5E:00.0", "5e:00.0,pcie=1,pcie=0", " 5e:00.0", "driver=keep,host=5e:00.1",
           "0000:5e:00,rombar=off", "5e:00.0,unknown=1", "romfile=a.rom,5f:00.0", "5e:00.0;5f:00.0",
           "vendor-id=0x1234,5e:00.0", "5e:00.0,host=5f:00.0", "host=0000:5e:00.1,pcie=1,x-vga=0"]


@pytest.mark.process
@pytest.mark.parametrize("value", HOSTPCI)
def test_what_a_hostpci_line_hands_over_is_what_qemu_server_passes(value):
    """The functions qemu-server passes for a line are the ones the grammar
    says (a line qemu-server drops counts here as passing what it writes)."""
    text = f"machine: q35\ncores: 1\nmemory: 512\nhostpci0: {value}\n"
    start = showcmd(text, FUNCTIONS)
    value = PveConfig.parse(text).get("hostpci0")        # as the config line gives it
    passed = set(vfio_hosts(start)) if start.code in (0, 3) else set()
    said = {f for f in FUNCTIONS if grammar.names(grammar.handed("hostpci0", value, grammar.Mappings("", ""),
                                                                 "VM 100"), f)}
    assert passed <= said, (value, start.err)
    try:
        grammar.hostpci("hostpci0", value)
    except grammar.Invalid:
        assert not passed, value        # Proxmox drops it too
        return
    assert passed == said, (value, start.code, start.err)
