"""The log of host changes and refusals, for the CLI and the hooks alike.

One line per host change (a journaled step done, undone, or failed) and
per refusal, to the first of (vstor.log_handlers):

- the systemd journal, over its native protocol (a datagram of KEY=VALUE
  fields on /run/systemd/journal/socket, https://systemd.io/JOURNAL_NATIVE_PROTOCOL/),
  with the fields VSTOR_DOMAIN, VSTOR_STEP, VSTOR_RESULT, VSTOR_COMMAND
  (and VSTOR_EXIT for a refusal) next to MESSAGE, PRIORITY and
  SYSLOG_IDENTIFIER=vstor: `journalctl SYSLOG_IDENTIFIER=vstor VSTOR_DOMAIN=web1`;
- syslog (/dev/log), the same MESSAGE, for hosts without journald;
- nowhere.

Logging never fails a command and never writes to stderr on its own:
lines go to stderr only with --verbose.  The sinks are made at the first
line logged, not before: the libvirt hook runs for every start, stop and
reconnect of a vstor domain, and most of those runs log nothing.  Python's
`logging` is not used (its import is most of a line's cost in the hook);
vstor's other loggers (the Nova driver's, in nova-compute) are `logging`'s
and go through their host's handlers.
What is logged is a step's description, a domain name and an error's one
line: never a domain's XML, a config file or a key.
"""

from __future__ import annotations

import os
import sys

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_SOCKET = "/dev/log"
IDENTIFIER = "vstor"

# syslog(3) priorities, as journald's PRIORITY field takes them
ERR, WARNING, INFO, DEBUG = 3, 4, 6, 7

# Results a host change is logged with (VSTOR_RESULT)
DONE, FAILED, UNDONE, UNDO_FAILED, REFUSED = "done", "failed", "undone", "undo failed", "refused"

_settings = {"command": "", "verbose": False}
_sinks: list | None = None      # where lines go, made at the first line


def setup(command: str, verbose: bool = False) -> None:
    """Once per run, by the entry point (the CLI's main, a hook): what
    every line carries as VSTOR_COMMAND, and whether lines also go to
    stderr.  Cheap: the sinks are made at the first line logged."""
    global _sinks
    _settings.update(command=command, verbose=verbose)
    if _sinks is not None:          # a second run in one process (tests): made again
        _close(_sinks)
        _sinks = None


def change(domain: str | None, step: str, result: str, error: str | None = None) -> None:
    """A host change: `step` (its description) for `domain` (None: for no
    domain, e.g. the hook installed), with its result."""
    text = (f"{domain}: " if domain else "") + f"{step}: {result}" + (f": {error}" if error else "")
    ok = result in (DONE, UNDONE)
    _emit(INFO if ok else ERR, text, VSTOR_DOMAIN=domain, VSTOR_STEP=step, VSTOR_RESULT=result)


def refusal(message: str, exit_code: int, domain: str | None = None) -> None:
    """A command or hook that refused (the error's one line, its exit code)."""
    text = f"refused (exit {exit_code}): {message}"
    from vstor import counters
    counters.add("refusal", (_settings["command"].replace(" ", "-") or "vstor", str(exit_code)))
    _emit(ERR if exit_code in (1, 5) else WARNING, text, console=False, VSTOR_DOMAIN=domain,
          VSTOR_RESULT=REFUSED, VSTOR_EXIT=str(exit_code))


def note(domain: str | None, message: str, priority: int = INFO) -> None:
    """Another line of a hook's run (a summary, a warning), with its domain."""
    _emit(priority, f"{domain}: {message}" if domain else message, VSTOR_DOMAIN=domain)


def _emit(priority: int, text: str, console: bool = True, **fields) -> None:
    try:
        from vstor.errors import one_line
        fields = {k: one_line(v) for k, v in fields.items() if v is not None}
        for sink in _sinks if _sinks is not None else _make():
            sink.write(priority, one_line(text), fields, console)
    except Exception:       # noqa: BLE001 (a log that cannot be written never stops a change)
        pass


def _make() -> list:
    """The sinks, chosen now: the journal when its socket is there, else
    syslog, else none; stderr too with --verbose."""
    global _sinks
    from vstor import log_handlers
    journal = os.environ.get("VSTOR_JOURNAL_SOCKET", JOURNAL_SOCKET)
    sink = log_handlers.journal(journal, _settings["command"]) if journal else None
    if sink is None:
        sink = log_handlers.syslog(os.environ.get("VSTOR_SYSLOG_SOCKET", SYSLOG_SOCKET))
    _sinks = [sink] if sink is not None else []
    if _settings["verbose"]:
        _sinks.append(log_handlers.Stderr())
    return _sinks


def _close(sinks: list) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception:   # noqa: BLE001
            pass
