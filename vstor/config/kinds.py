"""The kinds of value a vstor.conf key holds: how each is read from the
file, written back (the sample, `vstor config show`) and described (the
reference table, vstor.conf(5)).

A kind's parse() raises Bad with what is wrong with the value; the loader
adds the file, line and key, and the fix from the key's example.
"""

from __future__ import annotations

import os
import re


class Bad(ValueError):
    """A value the kind refuses: `reason` says what is wrong (a clause,
    "'x' is not a CPU list", or a predicate of the key, "must be ..."),
    `hint` (if any) how to write it instead."""

    def __init__(self, reason: str, hint: str | None = None):
        super().__init__(reason)
        self.reason, self.hint = reason, hint


class Kind:
    annotation = "str"
    what = "text"           # the reference's Type column, the man page's
    hint = None             # how to write it, when an example is not enough
    # An empty value ("key =") leaves the default in place: a blank hostnqn
    # means "not configured", never the empty string.
    empty_is_default = False

    def parse(self, raw: str):
        return raw

    def format(self, value) -> str:
        return "" if value is None else str(value)


class Text(Kind):
    empty_is_default = True
    what = "text"


class Path(Kind):
    what = "absolute path"

    def parse(self, raw: str) -> str:
        if not raw.startswith("/") or ".." in raw.split("/"):
            raise Bad(f"must be an absolute path without '..', not '{raw}'")
        return os.path.normpath(raw)


class Paths(Kind):
    annotation = "tuple[str, ...]"
    what = "absolute paths, separated by spaces or commas"

    def parse(self, raw: str) -> tuple[str, ...]:
        return tuple(Path().parse(item) for item in raw.replace(",", " ").split())

    def format(self, value) -> str:
        return " ".join(value)


class CpuList(Kind):
    annotation = "tuple[int, ...]"
    what = "CPU list, as in /sys (0-1,32-33)"

    def parse(self, raw: str) -> tuple[int, ...]:
        from vstor.cpulist import MAX_CPU, parse_cpulist
        for part in raw.split(","):
            lo, dash, hi = (p.strip() for p in part.partition("-"))
            if not lo and not dash:
                continue
            if not (_whole(lo) and (not dash or _whole(hi))):
                raise Bad(f"'{raw}' is not a CPU list")
            if max(len(lo), len(hi)) > len(str(MAX_CPU)) or int(hi or lo) > MAX_CPU:
                raise Bad(f"'{raw[:40]}' is not a CPU list: CPUs are numbered 0 to {MAX_CPU}")
            if dash and int(hi) < int(lo):
                raise Bad(f"'{raw}' is not a CPU list: the range {part.strip()} runs backwards")
        return parse_cpulist(raw)

    def format(self, value) -> str:
        from vstor.cpulist import format_cpulist
        return "" if value is None else format_cpulist(value)


class PciList(Kind):
    annotation = "tuple[str, ...]"
    what = "PCI addresses, separated by spaces or commas"

    def parse(self, raw: str) -> tuple[str, ...]:
        from vstor.errors import BadInput
        from vstor.meta.names import normalise_bdf
        out = []
        for item in raw.replace(",", " ").split():
            try:
                out.append(normalise_bdf(item))
            except BadInput:
                raise Bad(f"'{item.lower()}' is not a PCI address", "write it like 0000:5e:00.0") from None
        return tuple(out)

    def format(self, value) -> str:
        return " ".join(value)


class Int(Kind):
    annotation = "int"

    def __init__(self, unit: str, lo: int = 0, hi: int = 999_999_999, noun: str | None = None):
        self.unit, self.lo, self.hi, self.noun = unit, lo, hi, noun
        self.what = f"whole number of {unit}" if unit else "whole number"
        if (lo, hi) != (0, 999_999_999):
            self.what += f", {lo} to {hi}"

    def parse(self, raw: str) -> int:
        if not _whole(raw) or len(raw) > 9:
            raise Bad(f"must be a {self.what}, not '{raw}'")
        n = int(raw)
        if not self.lo <= n <= self.hi:
            raise Bad(f"{n} is not a {self.noun or self.what}", f"a number from {self.lo} to {self.hi}")
        return n


class IdRange(Kind):
    """FIRST-LAST, a range of user and group ids (neither 0 nor above 2^31-1:
    many programs take uid_t for signed)."""
    annotation = "tuple[int, int]"
    what = "range of uids, FIRST-LAST"

    def parse(self, raw: str) -> tuple[int, int]:
        lo, dash, hi = (p.strip() for p in raw.partition("-"))
        if not (dash and _whole(lo) and _whole(hi)) or max(len(lo), len(hi)) > 10:
            raise Bad(f"must be a range of uids FIRST-LAST, not '{raw}'")
        first, last = int(lo), int(hi)
        if not 1000 <= first <= last <= 2**31 - 2:
            raise Bad(f"'{raw}' is not a range of unprivileged uids",
                      "FIRST-LAST, from 1000 up to 2147483646, FIRST not above LAST")
        return first, last

    def format(self, value) -> str:
        return "" if value is None else f"{value[0]}-{value[1]}"


class Seconds(Int):
    """Whole seconds, held as a float (the SPDK client's timeout)."""
    annotation = "float"

    def __init__(self):
        super().__init__("seconds")

    def parse(self, raw: str) -> float:
        return float(super().parse(raw))

    def format(self, value) -> str:
        return str(int(value))


class Choice(Kind):
    def __init__(self, *choices: str):
        self.choices = choices
        self.what = " or ".join(choices)
        self.hint = "use " + " or ".join(choices)

    def parse(self, raw: str) -> str:
        value = raw.lower()
        if value not in self.choices:
            raise Bad(f"'{raw}' is not {' or '.join(self.choices)}", self.hint)
        return value


class Bool(Choice):
    annotation = "bool"

    def __init__(self):
        super().__init__("yes", "no")

    def parse(self, raw: str) -> bool:
        return super().parse(raw) == "yes"

    def format(self, value) -> str:
        return "yes" if value else "no"


class Address(Kind):
    empty_is_default = True
    what = "IPv4/IPv6 address or host name"

    def parse(self, raw: str) -> str:
        from vstor.meta.intent import ADDR
        from vstor.meta.types import Invalid
        try:
            ADDR.parse(raw, "export_address")
        except Invalid:
            raise Bad(f"'{raw}' is not an address", "an IPv4/IPv6 address or host name of this host") from None
        return raw


class StorageId(Kind):
    what = "Proxmox storage ID"

    def parse(self, raw: str) -> str:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", raw):
            raise Bad(f"'{raw[:40]}' is not a Proxmox storage ID", "like local or cephfs")
        return raw


def _whole(text: str) -> bool:
    return text.isascii() and text.isdigit()
