"""vstor's port of Text::ParseWords::shellwords (how qemu-server splits
`args:`) against the real Perl module, on generated strings heavy in
quotes, backslashes and blanks.  Perl is part of every Debian system."""

import json
import random
import shutil
import subprocess

import pytest

from vstor.formats.pve.words import shellwords

PERL = r'''use Text::ParseWords; use JSON::PP; local $/; my $in = decode_json(<STDIN>);
print encode_json([map { [shellwords($_)] } @$in]);'''


def test_the_port_splits_as_perl_does():
    if not shutil.which("perl"):
        pytest.fail("perl is missing (Debian's perl-base has it): the oracle for qemu-server's args split")
    rng = random.Random(11)
    alphabet = ["a", "b", "-", "=", ",", " ", "\t", "\n", '"', "'", "\\"]
    cases = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16))) for _ in range(4000)]
    cases += ["-msg 'timestamp=on\\'", '"\\-m" 8192', "-set 'device.x.y=a b'", "a\\ b", "'", '"a""b"']
    want = json.loads(subprocess.run(["perl", "-e", PERL], input=json.dumps(cases), text=True,
                                     capture_output=True, check=True).stdout)
    for case, words in zip(cases, want):
        assert (shellwords(case) or []) == words, repr(case)
    assert shellwords("-msg 'timestamp=on\\'") is None       # Perl gives nothing: qemu-server drops args


# -- args split as qemu-server splits it, on its bytes -----------------------------------------


def test_args_split_on_ascii_blanks_only_as_perl_splits_qemu_servers_bytes():
    """qemu-server reads the config as bytes: to Perl's shellwords U+00A0,
    U+2028 or \\x1c are no blank, to Python's \\s they are.  Split apart,
    '-foo\\x1c-chardev socket,id=vstor-...' would let unapply take a word of
    the user's for the start of vstor's part."""
    import random
    import shutil
    import subprocess
    from vstor.formats.pve.words import shellwords
    from vstor.render.pve import has_vstor_args
    if not shutil.which("perl"):
        pytest.fail("perl is missing")
    perl = (r'use Text::ParseWords; while (my $l = <STDIN>) { chomp $l; my $s = pack("H*", $l); '
            r'my @w = shellwords($s); print scalar(@w), ":", join(",", map { unpack("H*", $_) } @w), "\n"; }')
    rng = random.Random(5)
    alphabet = ["a", "-", " ", "\t", "'", '"', "\\", "\x1c", "\x1f", "\x85", "\xa0", "\u2028", "\u3000"]
    cases = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(2000)]
    cases = [c for c in cases if c.strip(" \t")]
    stdin = "".join(c.encode().hex() + "\n" for c in cases)
    out = subprocess.run(["perl", "-e", perl], input=stdin, capture_output=True, text=True, check=True)
    for case, line in zip(cases, out.stdout.split("\n")):
        count, _, words = line.partition(":")
        want = [bytes.fromhex(w).decode() for w in words.split(",")] if int(count) else []
        assert (shellwords(case) or []) == want, repr(case)
    assert not has_vstor_args("-foo\x1c-chardev socket,id=vstor-vdb,path=/a,reconnect=1")
