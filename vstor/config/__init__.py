"""The host configuration file, /etc/vstor/vstor.conf (INI).

Every key is optional and declared once, in vstor.config.keys; unknown
sections or keys are refused so a typo never silently falls back to a
default.  A refusal names the file, the line, the key and the fix.
"""

from __future__ import annotations

import configparser
import os

from vstor.config.keys import BY_SECTION, KEYS, SECTIONS, Key
from vstor.config.kinds import Bad
from vstor.errors import BadInput
from vstor.records import field, record

DEFAULT_PATH = "/etc/vstor/vstor.conf"

__all__ = ["DEFAULT_PATH", "Config", "KEYS", "SECTIONS", "Salvaged", "load", "locate", "parse", "conflicts",
           "salvage", "for_undo"]


def _make_config():
    """The Config record: a field per key, with the key's default."""
    notes: dict[str, str] = {}
    body: dict = {"__module__": __name__, "__qualname__": "Config", "__annotations__": notes,
                  "__doc__": "vstor.conf's values (the defaults for keys the file leaves out)."}
    for key in KEYS:
        notes[key.attr] = key.kind.annotation + (" | None" if key.default is None else "")
        body[key.attr] = key.default
    notes["source"] = "str"
    body["source"] = field(default="(defaults)", compare=False)
    body["file"] = property(lambda self: DEFAULT_PATH if self.source == "(defaults)" else self.source,
                            doc="The file an operator edits to change this configuration.")
    return record(type("Config", (), body))


Config = _make_config()


def locate(path: str | None = None) -> tuple[str, bool]:
    """The config file to read, and whether it was asked for (--config,
    VSTOR_CONFIG) rather than the default."""
    explicit = path or os.environ.get("VSTOR_CONFIG")
    return explicit or DEFAULT_PATH, bool(explicit)


def load(path: str | None = None) -> Config:
    """Read the config file; a missing default file means all defaults."""
    path, explicit = locate(path)
    if not os.path.exists(path):
        if explicit:
            raise BadInput(f"config file {path} does not exist",
                           hint="create it or drop --config/VSTOR_CONFIG")
        return Config()
    return parse(_text(path), path)


@record
class Salvaged:
    """A config read to undo what vstor holds although the file does not
    load: every key that reads well, the defaults for the rest, and the
    first problem (None when the file loads). `unread`: the keys (their
    attributes) the file sets but that could not be read; None: the whole
    file could not be read."""
    config: Config
    problem: BadInput | None = None
    unread: frozenset | None = frozenset()

    def knows(self, attr: str) -> bool:
        """Is the value of `attr` the one the operator meant?"""
        return self.unread is not None and attr not in self.unread


def salvage(path: str | None = None) -> Salvaged:
    """The config for a release, a stop or gc, which must undo what vstor
    holds even when vstor.conf no longer loads (a typo made after the
    domain started): what `load` reads, else every key that reads well."""
    try:
        return Salvaged(load(path))
    except BadInput as e:
        first = e
    path, _ = locate(path)
    try:
        text = _text(path)
    except BadInput:
        return Salvaged(Config(), first, None)
    problems: list[BadInput] = []
    cfg = parse(text, path, problems)
    return Salvaged(cfg, first, None if cfg.source == "(defaults)" else
                    frozenset().union(*(getattr(p, "attrs", ()) for p in problems)))


# What an undo must read as the operator meant it: where the records are,
# where the daemons' sockets and files are (gc removes what is stale there),
# and where Proxmox says what runs (gc releases what does not).
UNDO_NEEDS = ("state_dir", "vhost_dir", "qsd_dir", "pve_etc", "pve_run_dir", "pve_lock_dir")


def for_undo(path: str | None, warn) -> Config:
    """The config a release, a stop or gc reads: `load`'s, else what
    `salvage` reads, with `warn` told the problem; but when the file does
    not say what an undo must know (UNDO_NEEDS: where the records, the
    sockets and daemons' files are, what runs on Proxmox), the problem
    itself: another state directory would hold nothing and a release would
    say so, another socket directory gc would sweep as stale."""
    got = salvage(path)
    if got.problem is None:
        return got.config
    if not all(got.knows(attr) for attr in UNDO_NEEDS):
        raise got.problem
    warn(f"{got.problem}; undoing by the records, with the keys that read")
    return got.config


def _text(path: str) -> str:
    data = _read(path)
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise BadInput(f"{path}:{line}: not UTF-8 text", hint="fix: write the file as UTF-8") from None


MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """The file's bytes: a regular file of at most MAX_BYTES (a FIFO or a
    device named by mistake is refused at once, never waited on)."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"cannot read config file {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"config file {path} is not a regular file",
                       hint="fix: name the file itself with --config or VSTOR_CONFIG")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise BadInput(f"cannot read config file {path}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise BadInput(f"config file {path} is larger than 1 MiB", hint="fix: is it the right file?")
    return data


def _lines_configparser_drops(text: str, path: str) -> None:
    """What configparser would read silently otherwise: a NUL, a carriage
    return inside a line (a CR-only file is one line to it), text after a
    [section] on its line (dropped)."""
    for n, line in enumerate(text.split("\n"), 1):
        if "\0" in line:     # "[\0none]" would be configparser's DEFAULT, spilled into every section
            raise BadInput(f"{path}:{n}: a NUL byte", hint="fix: is it the right file? vstor.conf is text")
        if "\r" in line.rstrip("\r"):
            raise BadInput(f"{path}:{n}: a carriage return inside the line",
                           hint="fix: end lines with newlines (LF or CR LF)")
        stripped = line.strip()
        if line[:1] == "[" and "]" in stripped:
            rest = stripped[stripped.rindex("]") + 1:].strip()
            if rest and rest[0] not in "#;":
                raise BadInput(f"{path}:{n}: '{rest[:40]}' after [section] on its line is not read",
                               hint="fix: put each key on a line of its own under the [section]")


def parse(text: str, path: str, problems: list | None = None) -> Config:
    """A Config from the text of a vstor.conf; `path` names it in errors.
    With `problems`, a list, nothing is raised: each key or section that
    does not read is left out and its refusal added there (a refusal of a
    key's value carries the key's attribute as .attr); a file that does not
    parse at all is the defaults (source "(defaults)")."""
    # default_section: no [DEFAULT] whose keys would spill into every section.
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",),
                                       default_section="\0none")
    try:
        _lines_configparser_drops(text, path)
        try:
            parser.read_string(text, source=path)
        except configparser.Error as e:
            raise _syntax_error(e, path, text) from None
    except BadInput as e:
        if problems is None:
            raise
        problems.append(e)
        return Config()
    lines = _Lines(text)
    kw: dict = {"source": path}
    for section in parser.sections():
        known = BY_SECTION.get(section)
        if known is None:
            _refuse(problems, BadInput(f"{path}:{lines.section(section)}: unknown section [{section}]",
                                       hint="fix: " + _suggest(section, SECTIONS, "known sections")),
                    *_meant_by_section(section, parser.options(section)))
            continue
        for name, raw in parser.items(section):
            key = known.get(name)
            where = f"{path}:{lines.key(section, name)}"
            if key is None:
                _refuse(problems, BadInput(f"{where}: unknown key '{name}' in [{section}]",
                                           hint="fix: " + _suggest(name, known, "known keys")),
                        *_meant_by_key(name, known, parser.options(section)))
                continue
            if "\n" in raw.strip():     # an indented line: configparser's continuation
                more = next(i for i, part in enumerate(raw.split("\n")) if i and part.strip())
                line = lines.key(section, name)
                _refuse(problems, BadInput(
                    f"{path}:{line + more if isinstance(line, int) else line}: [{section}] "
                    f"{name} continues on this indented line",
                    hint="fix: write the value on one line, or unindent the line"), key)
                continue
            raw = raw.strip()
            if raw == "" and key.kind.empty_is_default:
                continue
            try:
                kw[key.attr] = key.kind.parse(raw)
            except Bad as e:
                sep = " " if e.reason.startswith("must ") else ": "
                _refuse(problems, BadInput(f"{where}: [{section}] {name}{sep}{e.reason}",
                                           hint="fix: " + fix(key, e.hint)), key)
    return Config(**kw)


def _refuse(problems: list | None, e: BadInput, *keys: Key) -> None:
    """Raise `e`, or (salvaging) add it with the keys whose value the file
    meant but could not give (a typo of a key's or section's name counts
    for the closest one): `e.attrs`."""
    if problems is None:
        raise e
    e.attrs = frozenset(k.attr for k in keys)
    problems.append(e)


def _meant_by_section(section: str, options) -> list[Key]:
    """The keys an unknown [section] may have meant to set: those of the
    section its name is closest to (in any case), and each of its keys
    taken as the closest key of any section (a key under the wrong one)."""
    near = _closest(section, SECTIONS) or _closest(section.strip().lower(), SECTIONS)
    return [*BY_SECTION.get(near, {}).values(), *(k for o in options for k in _named_like(o))]


def _meant_by_key(name: str, known: dict, options) -> list[Key]:
    """The keys an unknown key of a known section may have meant: the
    closest one there, else the closest of another section and any key of
    its section the file does not set."""
    near = _closest(name, known)
    if near:
        return [known[near]]
    return _named_like(name) + [k for n, k in known.items() if n not in options]


def _named_like(name: str) -> list[Key]:
    near = _closest(name, {k.name for k in KEYS})
    return [k for k in KEYS if k.name == near]


def fix(key: Key, hint: str | None = None) -> str:
    """How to write `key` right: the kind's hint and an example line."""
    example = f"e.g. {key.name} = {key.sample_value()}"
    hint = hint or key.kind.hint
    return f"{hint}, {example}" if hint else example


def conflicts(cfg: Config, path: str | None = None) -> BadInput | None:
    """What no single key shows wrong: a core both a reactor and a
    housekeeping core.  The planner refuses to plan with it, `vstor config
    check` refuses the file; `path`, the file cfg was read from, adds the
    line of [cpu] reactors (the planner, pure, reads no file)."""
    from vstor.cpulist import format_cpulist
    both = set(cfg.reactors) & set(cfg.housekeeping or ())
    if not both:
        return None
    where = path or cfg.file
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                where += f":{_Lines(f.read()).key('cpu', 'reactors')}"
        except (OSError, UnicodeDecodeError):
            pass
    return BadInput(f"{where}: [cpu] reactors: cores {format_cpulist(both)} are both SPDK reactors "
                    "and housekeeping cores",
                    hint="fix: a core has one owner: take it out of reactors or housekeeping")


def _closest(word: str, known) -> str | None:
    import difflib
    close = difflib.get_close_matches(word, list(known), n=1)
    return close[0] if close else None


def _suggest(word: str, known, what: str) -> str:
    close = _closest(word, known)
    listed = f"{what}: " + ", ".join(known)
    return f"did you mean {close}? {listed}" if close else listed


def _syntax_error(e: configparser.Error, path: str, text: str) -> BadInput:
    if isinstance(e, configparser.MissingSectionHeaderError):
        return BadInput(f"{path}:{e.lineno}: '{e.line.strip()[:60]}' comes before any [section]",
                        hint="fix: put each key under its section, e.g. [paths]")
    if isinstance(e, configparser.DuplicateSectionError):
        return BadInput(f"{path}:{e.lineno}: section [{e.section}] appears twice",
                        hint="fix: merge its keys into the first [" + e.section + "]")
    if isinstance(e, configparser.DuplicateOptionError):
        return BadInput(f"{path}:{e.lineno}: [{e.section}] {e.option} is set twice",
                        hint="fix: keep one line")
    if isinstance(e, configparser.ParsingError) and e.errors:
        lineno = e.errors[0][0]     # with the line as repr() gives it: read it from the text
        line = text.split("\n")[lineno - 1]
        return BadInput(f"{path}:{lineno}: '{line.strip()[:60]}' is neither a [section] nor key = value",
                        hint="fix: write key = value, or comment the line out with #")
    return BadInput(f"{path}: {str(e).splitlines()[0]}")


class _Lines:
    """Line numbers of sections and keys, which configparser does not keep:
    found again by reading the text the way configparser does (a header is
    [name] on a line of its own, a key ends at the first = or :, lower-cased)."""

    def __init__(self, text: str):
        self.sections: dict[str, int] = {}
        self.keys: dict[tuple[str, str], int] = {}
        section = None
        for n, line in enumerate(text.split("\n"), 1):     # configparser's lines
            stripped = line.strip()
            if not stripped or stripped[0] in "#;":
                continue
            if stripped.startswith("[") and "]" in stripped and line[0] not in " \t":
                header = stripped.split(" ;")[0].split("\t;")[0].rstrip()
                section = header[1:header.rindex("]")]
                self.sections.setdefault(section, n)
            elif section is not None and line[0] not in " \t":
                cut = min((i for i in (stripped.find("="), stripped.find(":")) if i >= 0), default=-1)
                name = (stripped[:cut] if cut >= 0 else stripped).strip().lower()
                self.keys.setdefault((section, name), n)

    def section(self, name: str) -> int | str:
        return self.sections.get(name, "?")

    def key(self, section: str, name: str) -> int | str:
        return self.keys.get((section, name), self.section(section))
