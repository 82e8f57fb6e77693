"""Value types of vstor's metadata attributes: each parses text, formats a
value, and says its RelaxNG (through `rng`, vstor.meta.xmlmodel's helper)."""

from __future__ import annotations

import functools
import re

from lxml import etree

from vstor.records import record

RNG = "http://relaxng.org/ns/structure/1.0"
XSD = "http://www.w3.org/2001/XMLSchema-datatypes"


def rng(parent, tag, **attrs):
    """A RelaxNG element."""
    return etree.SubElement(parent, f"{{{RNG}}}{tag}", **attrs)


_DIGITS = re.compile(r"[0-9]{1,20}", re.ASCII)


@functools.cache
def _pattern(pattern: str) -> re.Pattern:
    """A Text's pattern, compiled once (a plan record holds a dozen)."""
    return re.compile(pattern, re.ASCII)


class Invalid(Exception):
    """A value does not fit its type: what is wrong, and the hint."""

    def __init__(self, problem: str, hint: str):
        super().__init__(problem)
        self.problem, self.hint = problem, hint


@record
class Enum:
    values: tuple[str, ...]

    def parse(self, text, name):
        if text not in self.values:
            raise Invalid("is not allowed", f"{name} is one of: " + ", ".join(self.values))
        return text

    def format(self, value):
        return value

    def rng(self, e):
        c = rng(e, "choice")
        for v in self.values:
            rng(c, "value", type="string").text = v


class YesNo(Enum):
    def __init__(self):
        super().__init__(("yes", "no"))

    def parse(self, text, name):
        return super().parse(text, name) == "yes"

    def format(self, value):
        return "yes" if value else "no"


@record
class Int:
    lo: int
    hi: int

    def parse(self, text, name):
        # Digits only: no sign, no spaces (libxml2 checks the pattern on the
        # value as written), leading zeros allowed as XSD allows them.
        if not _DIGITS.fullmatch(text) or not self.lo <= int(text) <= self.hi:
            raise Invalid("is out of range", f"a whole number from {self.lo} to {self.hi}")
        return int(text)

    def format(self, value):
        return str(value)

    def rng(self, e):
        d = rng(e, "data", type="integer")
        rng(d, "param", name="pattern").text = "[0-9]{1,20}"
        rng(d, "param", name="minInclusive").text = str(self.lo)
        rng(d, "param", name="maxInclusive").text = str(self.hi)


@record
class Text:
    """A string matching `pattern` (an XSD regex that Python reads the same:
    character classes, groups, quantifiers; anchored at both ends)."""
    pattern: str
    problem: str
    hint: str
    max_length: int = 4096
    normalise: object = None        # text -> canonical text, after the check

    def parse(self, text, name):
        if len(text) > self.max_length or not _pattern(self.pattern).fullmatch(text):
            raise Invalid(self.problem, self.hint)
        return self.normalise(text) if self.normalise else text

    def format(self, value):
        return value

    def rng(self, e):
        d = rng(e, "data", type="string")
        rng(d, "param", name="pattern").text = self.pattern
        rng(d, "param", name="maxLength").text = str(self.max_length)


class FreeText:
    """Any text (a reason line written by vstor)."""

    def parse(self, text, name):
        return text

    def format(self, value):
        return value

    def rng(self, e):
        rng(e, "text")
