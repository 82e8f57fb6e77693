"""A state record's file: what is checked before vstor trusts it (its
format, its shape), and the refusal when it cannot be (DamagedRecord).
vstor.runtime.state reads and writes the files."""

from __future__ import annotations

from vstor.errors import Unavailable


class DamagedRecord(Unavailable):
    """A state record that cannot be read: what it holds is unknown, so its
    domain, and every decision that needs every record, is refused until an
    operator looks at it (docs/security.md)."""


_FIX = "inspect it, undo by hand what it lists, then remove it"

# The layout of a record file, written into it as "format".  0: a record
# from before the field (vstor 0.1.0 wrote none), read as it always was.
# An upgrade that changes the layout raises this and keeps reading every
# older format (domains that started before the upgrade stop after it);
# an older vstor refuses a newer record rather than guess what it holds.
RECORD_FORMAT = 1


def check_format(data, path: str) -> None:
    fmt = data.get("format", 0) if isinstance(data, dict) else 0
    if type(fmt) is not int or not 0 <= fmt <= RECORD_FORMAT:
        from vstor import __version__
        raise DamagedRecord(f"state record {path} has format {fmt!r}, which vstor {__version__} "
                            f"cannot read (it reads 0 to {RECORD_FORMAT}): a newer vstor wrote it",
                            hint="install that vstor again, or a newer one: going back to an older "
                                 "vstor while it holds backends is not supported")


def check_shape(rec) -> None:
    """What the rest of vstor relies on in a record; TypeError/ValueError if not."""
    from vstor.meta.holding import holding_from_json
    if not all(isinstance(v, str) for v in (rec.key, rec.domain, rec.status)):
        raise TypeError("key, domain and status must be strings")
    for e in rec.steps:
        if not (isinstance(e, dict) and isinstance(e.get("kind"), str)
                and e.get("state") in ("doing", "done") and isinstance(e.get("data"), dict)):
            raise ValueError(f"a step is not {{kind, state, data}}: {str(e)[:60]}")
    if not isinstance(rec.holding, dict):
        raise TypeError("holding is not an object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in rec.migration.items()):
        raise TypeError("migration is not an object of strings")
    if rec.holding:
        holding_from_json(rec.holding)
