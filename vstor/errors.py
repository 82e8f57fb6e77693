"""The one error hierarchy: every error a user can cause carries a one-line
message (what is wrong and how to fix it) and the exit code the CLI and the
hook return for it."""

from __future__ import annotations

# Exit codes, documented in docs/troubleshooting.md.
EXIT_OK = 0
EXIT_ERROR = 1          # an unexpected failure (still one line, no traceback)
EXIT_BAD_INPUT = 2      # usage, malformed XML or metadata, unknown device
EXIT_DOES_NOT_FIT = 3   # the host cannot take the request (cores, hugepages, device busy)
EXIT_UNAVAILABLE = 4    # a service vstor needs is missing: libvirt, SPDK, qemu-storage-daemon
EXIT_ACTION_FAILED = 5  # a host change failed; what was done has been undone


class VstorError(Exception):
    """Base of every error vstor reports to a user."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.message} ({self.hint})" if self.hint else self.message
        return one_line(text)


def one_line(text: str) -> str:
    """Control characters (a newline in a domain name, an escape sequence in a
    path) shown escaped: a message stays one line on a terminal and in syslog."""
    if len(text) > MESSAGE_MAX:     # a megabyte of domain name is not a message
        text = text[:MESSAGE_MAX // 2] + " [...] " + text[-MESSAGE_MAX // 4:]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


MESSAGE_MAX = 2000


class BadInput(VstorError):
    """The request itself is wrong: XML, metadata, arguments, names."""

    exit_code = EXIT_BAD_INPUT


class DoesNotFit(VstorError):
    """The request is valid but this host cannot take it now."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, *, hint: str | None = None,
                 reasons: tuple[str, ...] = ()):
        super().__init__(message, hint=hint)
        self.reasons = reasons


class InUse(DoesNotFit):
    """What the request would take or undo is in use: a domain or VM that
    runs, a QEMU still connected to a backend, a start or migration under
    way.  One class on every path (release, gc, detach, the hooks), so "in
    use" is one exit code: does not fit, 3."""


class Unavailable(VstorError):
    """A component vstor needs cannot be reached (libvirt, SPDK, qsd)."""

    exit_code = EXIT_UNAVAILABLE


class ActionFailed(VstorError):
    """A host change failed; everything done before it was rolled back."""

    exit_code = EXIT_ACTION_FAILED


def from_exit_code(code: int, message: str) -> VstorError:
    """The error another vstor reported with `code` (its exit code, or the
    exit_code of an answer), carrying that code; 1 for anything else."""
    code = code if isinstance(code, int) and not isinstance(code, bool) and 1 <= code <= 5 else 1
    err = {2: BadInput, 3: DoesNotFit, 4: Unavailable, 5: ActionFailed}.get(code, VstorError)(
        one_line(message))
    err.exit_code = code
    return err
