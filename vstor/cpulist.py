"""CPU lists in the kernel's and libvirt's notation ('0-3,8'): read and
written by the host model, the plan, the config and the renderers."""

from __future__ import annotations

import re

# The largest CPU number vstor reads anywhere (the plan's CPU attributes
# take the same): far above any host's (the kernel's NR_CPUS is at most
# 8192), and small enough that a whole list of them is cheap to hold.
MAX_CPU = 65535
_SPAN = re.compile(r"\s*([0-9]{1,5})\s*(?:-\s*([0-9]{1,5})\s*)?", re.ASCII)


def parse_cpulist(text: str, below: int = MAX_CPU + 1) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> (); a range that
    runs backwards ('3-1') names no CPU.  ValueError for anything else (a
    sign, a digit that is not ASCII) and for a CPU of `below` or more: a
    list written by a user costs no more than the CPUs it names, however
    its ranges overlap."""
    spans = []
    for part in text.split(","):
        if not part.strip():
            continue
        m = _SPAN.fullmatch(part)
        lo = int(m[1]) if m else below
        hi = int(m[2]) if m and m[2] else lo
        if lo >= below or hi >= below:
            raise ValueError(f"'{part.strip()[:20]}' is not a CPU or a range of CPUs below {below}")
        spans.append((lo, hi))
    cpus: list[int] = []
    for lo, hi in sorted(spans):
        cpus.extend(range(max(lo, cpus[-1] + 1 if cpus else 0), hi + 1))
    return tuple(cpus)


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8', the kernel's and libvirt's notation."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
