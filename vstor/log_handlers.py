"""The handlers vstor.log chooses from: the journal's native protocol and
syslog.  Imported at the first line logged (vstor.log), never before."""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct

SEND_TIMEOUT = 2.0      # a journald that stopped reading must not hold a start for long


def quiet(handler: logging.Handler) -> logging.Handler:
    """A line that cannot be written is dropped: logging's own report of it
    (a traceback on stderr) would break the command's output contract.
    After one such line the handler writes no more in this run: a daemon
    that stopped reading costs a run one SEND_TIMEOUT, not one per line."""
    def failed(record, handler=handler):
        handler.vstor_broken = True
    handler.vstor_broken = False
    handler.handleError = failed
    handler.addFilter(lambda record: not handler.vstor_broken)
    return handler


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


class JournalHandler(logging.Handler):
    """A datagram per line to journald's native socket."""

    def __init__(self, path: str, command: str):
        super().__init__()
        self.path = path
        self.command = command
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(SEND_TIMEOUT)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {"MESSAGE": record.getMessage(),
                      "PRIORITY": str(getattr(record, "vstor_priority", 6)),
                      "SYSLOG_IDENTIFIER": "vstor",
                      "SYSLOG_FACILITY": "3"}      # daemon, as the syslog lines
            if self.command:
                fields["VSTOR_COMMAND"] = self.command
            fields.update(getattr(record, "vstor_fields", {}))
            self.sock.sendto(journal_fields(fields), self.path)
        except Exception:       # noqa: BLE001
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def journal_handler(path: str, command: str) -> logging.Handler | None:
    if not is_socket(path):
        return None
    return quiet(JournalHandler(path, command))


def syslog_handler(path: str) -> logging.Handler | None:
    """syslog's socket, the message as the journal's MESSAGE (the fields
    only in the text): for hosts without journald."""
    if not is_socket(path):
        return None
    from logging.handlers import SysLogHandler

    class Handler(SysLogHandler):
        def _connect_unixsocket(self, address):     # also its reconnect after a failed send
            super()._connect_unixsocket(address)
            self.socket.settimeout(SEND_TIMEOUT)    # a stuck syslog daemon: never a hung run

    try:
        handler = Handler(address=path, facility=SysLogHandler.LOG_DAEMON)
    except OSError:
        return None
    handler.ident = f"vstor[{os.getpid()}]: "
    return quiet(handler)
