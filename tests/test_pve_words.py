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
