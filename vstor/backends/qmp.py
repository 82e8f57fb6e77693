"""A tiny QMP client over a Unix socket, for qemu-storage-daemon's monitor.

One connection, one command at a time: read the greeting, negotiate
capabilities, then `execute(cmd, args)` returns the command's "return"
value or raises QmpError carrying QMP's error class and description.
Asynchronous events arriving in between are kept in `events`.
"""

from __future__ import annotations

import json
import socket
import time

from vstor.errors import ActionFailed, Unavailable


class QmpError(ActionFailed):
    """The daemon answered a command with an error."""

    def __init__(self, command: str, error_class: str, desc: str):
        super().__init__(f"QMP {command} failed: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class QmpConnectionError(Unavailable):
    """The monitor cannot be reached, closed, timed out or spoke nonsense."""


class QmpClient:
    def __init__(self, path: str, timeout: float = 5.0):
        self.path = path
        self.timeout = timeout
        self.greeting: dict | None = None
        self.events: list[dict] = []
        self._sock: socket.socket | None = None
        self._buf = b""
        self._next_id = 0

    # -- connection ---------------------------------------------------------------

    def connect(self) -> "QmpClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise QmpConnectionError(f"cannot connect to QMP socket {self.path}: "
                                     f"{e.strerror or e}") from None
        self._sock = sock
        try:
            self.greeting = self._read(time.monotonic() + self.timeout, "greeting")
            if "QMP" not in self.greeting:
                raise QmpConnectionError(f"{self.path} is not a QMP monitor "
                                         f"(greeting {_short(self.greeting)})")
            self.execute("qmp_capabilities")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = b""

    def __enter__(self) -> "QmpClient":
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands -----------------------------------------------------------------

    def execute(self, command: str, args: dict | None = None, *, timeout: float | None = None):
        """Run one command; its "return" value, or QmpError."""
        if self._sock is None:
            raise QmpConnectionError(f"QMP {command}: not connected to {self.path}")
        self._next_id += 1
        req_id = f"vstor-{self._next_id}"
        msg = {"execute": command, "id": req_id}
        if args:
            msg["arguments"] = args
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            self._sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            self.close()
            raise QmpConnectionError(f"QMP {command}: cannot send to {self.path}: "
                                     f"{e.strerror or e}") from None
        while True:
            reply = self._read(deadline, command)
            if "event" in reply:
                self.events.append(reply)
                continue
            if reply.get("id") != req_id:
                continue    # an answer to an earlier command that timed out
            if "error" in reply:
                err = reply["error"]
                raise QmpError(command, err.get("class", "GenericError"), err.get("desc", ""))
            if "return" in reply:
                return reply["return"]
            raise QmpConnectionError(f"QMP {command}: unexpected reply {_short(reply)}")

    def _read(self, deadline: float, what: str) -> dict:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise QmpConnectionError(f"QMP {what}: no answer from {self.path} "
                                         f"within {self.timeout:g}s")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                self.close()
                raise QmpConnectionError(f"QMP {what}: {self.path}: {e.strerror or e}") from None
            if not chunk:
                self.close()
                raise QmpConnectionError(f"QMP {what}: {self.path} closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self.close()
            raise QmpConnectionError(f"QMP {what}: {self.path} sent something that is "
                                     f"not JSON: {line[:80]!r}") from None


def _short(obj) -> str:
    text = json.dumps(obj)
    return text if len(text) <= 120 else text[:117] + "..."
