"""What the step kinds share: the interface each class implements (StepKind)
and the defaults it inherits (Kind), what a preflight says a step will
write, and the form of a dry run's RPC lines."""

from __future__ import annotations

import json
from typing import ClassVar, Protocol

from vstor.records import record


class StepKind(Protocol):
    """What the journal and the executor ask of a step (vstor.runtime.kinds
    says what each is for).  `rt` is the Runtime (vstor.runtime.executor),
    `others` what the other domains hold (vstor.runtime.holders)."""
    kind: ClassVar[str]
    parallel: ClassVar[bool]
    private: ClassVar[bool]
    whole_domain: ClassVar[bool]
    rpc_methods: ClassVar[tuple[str, ...]]

    def describe(self) -> str: ...
    def dry_run(self) -> list[str]: ...
    def to_data(self) -> dict: ...
    @classmethod
    def from_data(cls, d: dict) -> StepKind: ...
    def makes(self) -> str: ...
    def preflight(self, rt) -> Writes | None: ...
    def observe(self, rt, others) -> StepKind: ...
    def do(self, rt) -> None: ...
    def undo(self, rt, others) -> None: ...
    def undo_waits(self, rt) -> bool: ...
    def in_use(self, rt) -> str | None: ...
    def check(self, rt) -> str | None: ...
    def repair(self, rt) -> None: ...


class Kind:
    """The defaults of StepKind a kind's class inherits unless it says
    otherwise: done one at a time, under the host lock, asking SPDK
    nothing; nothing to open before the start is decided, nothing to read
    before the record is written; an undo that waits on nothing (done in
    turn, not on a thread each), nothing QEMU can still be connected to;
    repaired by doing it again (every `do` looks before it creates); made
    for a disk (an attach makes it, a detach undoes it), not for the whole
    domain (its prepared mark, its outgoing export)."""
    parallel = False
    private = False
    whole_domain = False
    rpc_methods: ClassVar[tuple[str, ...]] = ()

    def preflight(self, rt) -> Writes | None:
        return None

    def observe(self, rt, others):
        return self

    def undo_waits(self, rt) -> bool:
        return False

    def in_use(self, rt) -> str | None:
        return None

    def repair(self, rt) -> None:
        self.do(rt)


@record
class Writes:
    """The one file or device a step will serve, however it is named (a
    symlink, a second path): `thing` is ("dev", st_rdev) or ("file",
    st_dev, st_ino) of what was opened."""
    thing: tuple
    readonly: bool
    name: str       # the step's (its daemon's)
    path: str       # as the plan names it


def rpc_line(method: str, params: dict) -> str:
    """A dry run's line for one SPDK RPC."""
    return "SPDK RPC: " + json.dumps({"method": method, "params": params}, sort_keys=True)
