"""Where vstor.log's lines go: the journal's native protocol, syslog's
socket, stderr.  Plain sockets, not Python's `logging` (its import alone
cost the hook 6 to 9 ms per prepare and per release: docs/performance.md):
one datagram per line.  Imported at the first line logged, never before."""

from __future__ import annotations

import os
import socket
import stat
import struct
import sys

SEND_TIMEOUT = 2.0      # a journald that stopped reading must not hold a start for long
DAEMON = 3              # syslog's facility for the lines (the journal's SYSLOG_FACILITY too)


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def journal_fields(fields: dict[str, str]) -> bytes:
    """One journal entry in the native protocol: KEY=VALUE lines; a value
    with a newline as KEY, newline, its length (64-bit little endian), the
    value and a newline."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class Sink:
    """One destination.  A line that cannot be written is dropped, and the
    sink writes no more in this run: a daemon that stopped reading costs a
    run one SEND_TIMEOUT, not one per line; nothing reaches stderr."""

    broken = False

    def write(self, priority: int, text: str, fields: dict[str, str], console: bool) -> None:
        if self.broken:
            return
        try:
            self._write(priority, text, fields, console)
        except Exception:       # noqa: BLE001
            self.broken = True

    def close(self) -> None:
        pass


class Journal(Sink):
    """A datagram per line to journald's native socket."""

    def __init__(self, path: str, command: str):
        self.path, self.command = path, command
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(SEND_TIMEOUT)

    def _write(self, priority, text, fields, console):
        entry = {"MESSAGE": text, "PRIORITY": str(priority), "SYSLOG_IDENTIFIER": "vstor",
                 "SYSLOG_FACILITY": str(DAEMON)}
        if self.command:
            entry["VSTOR_COMMAND"] = self.command
        entry.update(fields)
        self.sock.sendto(journal_fields(entry), self.path)

    def close(self):
        self.sock.close()


class Syslog(Sink):
    """syslog's socket (a datagram, or a stream where syslog listens so),
    the message as the journal's MESSAGE (the fields only in the text), as
    syslog(3) writes it: <PRI>vstor[PID]: text, NUL-terminated."""

    def __init__(self, path: str):
        self.path = path
        self.sock = self._connect()

    def _connect(self):
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
            sock.settimeout(SEND_TIMEOUT)
            try:
                sock.connect(self.path)
                return sock
            except OSError:
                sock.close()
        raise OSError(f"cannot connect to {self.path}")

    def _write(self, priority, text, fields, console):
        line = f"<{DAEMON * 8 + priority}>vstor[{os.getpid()}]: {text}\0".encode("utf-8", "replace")
        try:
            self.sock.sendall(line)
        except OSError:         # syslog restarted: once more on a new connection
            self.sock.close()
            self.sock = self._connect()
            self.sock.sendall(line)

    def close(self):
        self.sock.close()


class Stderr(Sink):
    """--verbose: each line but those said already (a refusal) on stderr."""

    def _write(self, priority, text, fields, console):
        if console:
            print(f"vstor: {text}", file=sys.stderr)


def journal(path: str, command: str) -> Sink | None:
    return Journal(path, command) if is_socket(path) else None


def syslog(path: str) -> Sink | None:
    if not is_socket(path):
        return None
    try:
        return Syslog(path)
    except OSError:
        return None
