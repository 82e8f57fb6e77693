"""qemu-storage-daemon's QMP monitor, through QEMU's own library (qemu.qmp).

One connection, one command at a time: connect (greeting and capability
negotiation are the library's), then `execute(cmd, args)` returns the
command's "return" value.  What goes wrong becomes vstor's errors: a monitor
that cannot be reached, hangs up, stays silent or speaks nonsense is
QmpConnectionError (Unavailable); a command the daemon refused is QmpError
(ActionFailed) with QMP's error class and description.

qemu.qmp is asyncio and vstor is not, so a Monitor owns a private event loop
and runs each library call under a deadline.  The library's own synchronous
wrapper (qemu.qmp.legacy) is not used: its connect() has no timeout, and a
stopped daemon's socket accepts a connection and then never greets.
"""

from __future__ import annotations

import asyncio

from qemu.qmp import ConnectError, ExecInterruptedError, ExecuteError, QMPClient, QMPError

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


class Monitor:
    def __init__(self, path: str, timeout: float = 5.0):
        self.path = path
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: QMPClient | None = None

    def connect(self) -> "Monitor":
        self._loop = asyncio.new_event_loop()
        self._client = QMPClient(self.path)
        try:
            self._run(self._client.connect(self.path), self.timeout)
        except TimeoutError:
            self.close()
            raise QmpConnectionError(f"QMP greeting: no answer from {self.path} "
                                     f"within {self.timeout:g}s") from None
        except ConnectError as e:
            self.close()
            if isinstance(e.exc, OSError):
                raise QmpConnectionError(f"cannot connect to QMP socket {self.path}: "
                                         f"{e.exc.strerror or e.exc}") from None
            raise QmpConnectionError(f"{self.path} is not a usable QMP monitor: "
                                     f"{_one_line(e.exc)}") from None
        except BaseException:
            self.close()
            raise
        return self

    @property
    def version(self) -> dict:
        """The daemon's version from its greeting: {"qemu": {"major": ...}, "package": ...}."""
        if self._client is None or self._client.greeting is None:
            raise QmpConnectionError(f"QMP: not connected to {self.path}")
        return self._client.greeting.QMP.version

    def execute(self, command: str, args: dict | None = None, *, timeout: float | None = None):
        """Run one command; its "return" value, or QmpError."""
        if self._client is None:
            raise QmpConnectionError(f"QMP {command}: not connected to {self.path}")
        wait = self.timeout if timeout is None else timeout
        try:
            return self._run(self._client.execute(command, args), wait)
        except ExecuteError as e:
            raise QmpError(command, e.error_class, e.error.error.desc) from None
        except TimeoutError:
            self.close()
            raise QmpConnectionError(f"QMP {command}: no answer from {self.path} "
                                     f"within {wait:g}s") from None
        except ExecInterruptedError:
            self.close()
            raise QmpConnectionError(f"QMP {command}: {self.path} closed the connection") from None
        except QMPError as e:
            # StateError, or a reply the library did not understand.
            self.close()
            raise QmpConnectionError(f"QMP {command}: {self.path}: {_one_line(e)}") from None

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._client is not None:
                self._run(self._client.disconnect(), self.timeout)
        except Exception:       # noqa: BLE001
            pass    # disconnect() re-raises why the peer went away (EOFError after quit)
        finally:
            self._loop.close()
            self._loop, self._client = None, None

    def __enter__(self) -> "Monitor":
        return self.connect() if self._client is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coro, timeout: float):
        return self._loop.run_until_complete(asyncio.wait_for(coro, timeout))


def _one_line(err: BaseException) -> str:
    # Some of qemu.qmp's protocol errors append the offending message on
    # further lines; vstor's messages are one line.
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
