"""How qemu-server splits `args:` into arguments: Perl's
Text::ParseWords::shellwords (PC:src/PVE/Cmd.pm), ported.  Pure.

Python's shlex differs where it matters: Perl drops a backslash before any
character outside quotes and inside double quotes, keeps it inside single
quotes, and returns nothing at all for a line with an unbalanced quote,
after which qemu-server passes no `args` to QEMU.  tests/test_pve_words.py
holds this port to the real Perl on thousands of strings."""

from __future__ import annotations

import re

_WORD = re.compile(r'''(?:(")((?:[^\\"]*(?:\\.[^\\"]*)*))"|(')((?:[^\\']*(?:\\.[^\\']*)*))'|'''
                   r'''((?:\\.|[^\\"'])*?)(\Z|\s+|(?!^)(?=["'])))''', re.S | re.ASCII)
# re.ASCII: qemu-server's Perl splits the config's bytes, where only ASCII
# blanks are \s (U+00A0 or \x1c are not).


def shellwords(line: str) -> list[str] | None:
    """The words, or None where Perl returns none (an unbalanced quote)."""
    line = line.lstrip(" \t\n\r\f\v")
    pieces: list[str] = []
    word = None
    while line:
        m = _WORD.match(line)
        if not m:
            return None
        if m.group(1) or m.group(3):
            quote, quoted = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            delim = None
            text = re.sub(r"\\(.)", r"\1", quoted, flags=re.S) if quote == '"' else quoted
        else:
            unquoted, delim = m.group(5), m.group(6)
            if not (unquoted or delim):
                return None
            text = re.sub(r"\\(.)", r"\1", unquoted, flags=re.S)
        line = line[m.end():]
        word = (word or "") + text
        if delim:
            pieces.append(word)
            word = None
        if not line and word is not None:
            pieces.append(word)
    return pieces
