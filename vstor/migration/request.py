"""One `vstor migrate agent` request, as the source (root there, nobody
here) may send it: read with a bound on its size, its nesting measured
before the JSON parser recurses into it, and checked against the one
declaration of its shape below (OPS).  What the agent reads afterwards is
only what this declaration admits: known keys, values of their exact type
(true is not 1, 1.0 is not 1), strings without NUL, control characters or
half a surrogate pair, names that are names."""

from __future__ import annotations

import json
import re

from vstor.errors import BadInput, one_line
from vstor.meta.intent import ABSPATH, ADDR, TARGET
from vstor.meta.types import Invalid, Text
from vstor.migration.peer import PROTOCOL
from vstor.records import record

MAX_REQUEST = 16 << 20      # a domain's XML with room to spare (as peer.MAX_ANSWER)
MAX_ITEMS = 512             # disks in `files`, `imports`
_HINT = "install the same vstor version on both hosts"


@record
class Str:
    """A string of at most `max_length` characters, all printable (or, for
    XML, what XML 1.0 allows: tab, newline and carriage return besides),
    of the form `form` (a metadata Text type) when given."""
    form: Text | None = None
    max_length: int = 4096
    xml: bool = False

    def check(self, value, where: str):
        if not isinstance(value, str):
            raise _wrong(where, "a string", value)
        if len(value) > self.max_length:
            raise BadInput(f"{where} is longer than {self.max_length} characters")
        bad = _NOT_XML.search(value) if self.xml else not value.isprintable()
        if bad:
            raise BadInput(f"{where} '{_shown(value)}' holds a NUL, a control character or half a "
                           "surrogate pair", hint=_HINT)
        if self.form is not None:
            try:
                return self.form.parse(value, where)
            except Invalid as e:
                raise BadInput(f"{where} '{_shown(value)}' {e.problem}", hint=e.hint) from None
        return value


@record
class Int:
    lo: int
    hi: int

    def check(self, value, where: str):
        # bool is an int to Python, and 1.0 == 1: neither is a whole number here.
        if type(value) is not int or not self.lo <= value <= self.hi:
            raise _wrong(where, f"a whole number from {self.lo} to {self.hi}", value)
        return value


@record
class Bool:
    def check(self, value, where: str):
        if type(value) is not bool:
            raise _wrong(where, "true or false", value)
        return value


@record
class OneOf:
    values: tuple

    def check(self, value, where: str):
        if not isinstance(value, str) or value not in self.values:
            raise _wrong(where, " or ".join(repr(v) for v in self.values), value)
        return value


@record
class Map:
    """{key: value} of at most MAX_ITEMS entries."""
    key: Str
    value: object

    def check(self, value, where: str):
        if not isinstance(value, dict):
            raise _wrong(where, "an object", value)
        if len(value) > MAX_ITEMS:
            raise BadInput(f"{where} has {len(value)} entries, more than {MAX_ITEMS}")
        return {self.key.check(k, f"{where} key"): self.value.check(v, f"{where}.{_shown(k)}")
                for k, v in value.items()}


@record
class Obj:
    """{name: (type, default)}: a default of REQUIRED must be given; None may be null."""
    fields: tuple

    def check(self, value, where: str):
        """`where` is "" for the request itself."""
        if not isinstance(value, dict):
            raise _wrong(where, "an object", value)
        known = dict(self.fields)
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise BadInput(f"{where or 'the request'} has unknown key '{_shown(unknown[0])}'",
                           hint=f"allowed: {', '.join(known) or 'none'}; {_HINT}")
        out = {}
        for name, (kind, default) in self.fields:
            if name not in value:
                if default is REQUIRED:
                    raise BadInput(f"{where or 'the request'} has no {name}", hint=_HINT)
                out[name] = default
            elif value[name] is None and default is None:
                out[name] = None
            else:
                out[name] = kind.check(value[name], f"{where}.{name}" if where else name)
        return out


REQUIRED = object()
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

# -- the declaration ----------------------------------------------------------

NAME = Str(Text(r"[^/]{1,255}", "is not a domain name", "printable, without '/', at most 255 "
                "characters, as libvirt names it"), max_length=255)
UUID = Str(Text(r"[0-9a-fA-F]{8}(-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12}", "is not a UUID",
                "like 6a0c6c5e-7f55-4b4a-9d8e-000000000001"), max_length=36)
HOST = Str(ADDR, max_length=255)
XML = Str(max_length=MAX_REQUEST, xml=True)
TEXT = Str()
FILE = Obj((("path", (Str(ABSPATH), REQUIRED)), ("kind", (OneOf(("file", "block")), REQUIRED)),
            ("size", (Int(0, 2**63 - 1), REQUIRED)), ("fstype", (TEXT, "")), ("mount", (TEXT, "")),
            ("shared_root", (TEXT, ""))))
IMPORT = Map(Str(Text(r"[a-z][a-z_]{0,31}", "is not an attribute name", "like traddr")), TEXT)
FILES = Map(Str(TARGET), FILE)
IMPORTS = Map(Str(TARGET), IMPORT)

OPS = {
    "facts": Obj(()),
    "status": Obj((("name", (NAME, REQUIRED)), ("uuid", (UUID, None)))),
    "abort": Obj((("name", (NAME, REQUIRED)), ("uuid", (UUID, None)))),
    "check": Obj((("xml", (XML, REQUIRED)), ("files", (FILES, {})), ("imports", (IMPORTS, {})),
                  ("cold", (Bool(), False)))),
    "prepare": Obj((("xml", (XML, REQUIRED)), ("from", (HOST, REQUIRED)), ("imports", (IMPORTS, {})),
                    ("cold", (Bool(), False)))),
}


def _depth(kind) -> int:
    if isinstance(kind, Obj):
        return 1 + max((_depth(k) for _, (k, _d) in kind.fields), default=0)
    return 1 + _depth(kind.value) if isinstance(kind, Map) else 0


MAX_DEPTH = max(_depth(kind) for kind in OPS.values())
MAX_BRACKETS = 4 * MAX_ITEMS + 16       # every object and list, opened and closed

# -- reading ------------------------------------------------------------------

# A JSON string, its closing quote optional so that every match succeeds
# where it starts (an unclosed string would make a failing search quadratic).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(rb'[^\[\]{}]+')


def read(stream) -> dict:
    """The request on `stream` (bytes), checked: {"op": ..., and its declared keys}."""
    raw = stream.read(MAX_REQUEST + 1)
    if len(raw) > MAX_REQUEST:
        raise BadInput(f"the request is larger than {MAX_REQUEST >> 20} MiB", hint=_HINT)
    return parse(raw)


def parse(raw: bytes) -> dict:
    _bound_nesting(raw)
    try:
        text = raw.decode("utf-8")
        request = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise BadInput(f"the request is not UTF-8 (byte {e.start})", hint=_HINT) from None
    except ValueError as e:
        raise BadInput(one_line(f"the request is not JSON ({e})"),
                       hint=f"a vstor migrate agent request is one JSON object; {_HINT}") from None
    if not isinstance(request, dict) or type(request.get("vstor_agent")) is not int \
            or request["vstor_agent"] != PROTOCOL:
        raise BadInput(f"not a vstor migrate agent request of protocol {PROTOCOL}", hint=_HINT)
    op = request.get("op")
    kind = OPS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise BadInput(f"unknown agent request '{_shown(op)}'", hint=_HINT)
    rest = {k: v for k, v in request.items() if k not in ("vstor_agent", "op")}
    return {"op": op, **kind.check(rest, "")}


def _bound_nesting(raw: bytes) -> None:
    """Refuse what nests deeper than any request before a parser recurses
    into it (json's C scanner recurses once a level)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    depth = 0
    for b in brackets[:MAX_BRACKETS + 1]:
        depth += 1 if b in b"[{" else -1
        if depth > MAX_DEPTH:
            raise BadInput(f"the request nests deeper than any request ({MAX_DEPTH} levels)",
                           hint=_HINT)
    if len(brackets) > MAX_BRACKETS:
        raise BadInput(f"the request holds {len(brackets) // 2} objects or lists, more than any "
                       "request", hint=_HINT)


def _unique(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:      # two parsers may keep either: say which one counts by refusing both
            raise BadInput(f"the request has key '{_shown(key)}' twice", hint=_HINT)
        out[key] = value
    return out


def _no_constant(name: str):
    raise BadInput(f"the request holds {name}, which is not JSON", hint=_HINT)


def _wrong(where: str, expected: str, value) -> BadInput:
    got = {bool: "a boolean", int: "a number", float: "a fractional number", str: "a string",
           list: "a list", dict: "an object", type(None): "null"}.get(type(value), "something else")
    return BadInput(f"{where} must be {expected}, not {got}", hint=_HINT)


def _shown(value) -> str:
    text = one_line(str(value))
    return text if len(text) <= 80 else text[:77] + "..."
