"""CPU lists in the kernel's and libvirt's notation ('0-3,8'): read and
written by the host model, the plan, the config and the renderers."""

from __future__ import annotations


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return tuple(sorted(cpus))


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
