"""The JSON-RPC 2.0 server on a real Unix socket: what
``spdk.rpc.client.JSONRPCClient`` sends and reads (JSON values back to back
on a stream socket, no delimiter required; a batch is answered as a list;
a notification is done and not answered). Each connection may keep
requests open: an answer SPDK defers goes out on that connection later, or
is dropped once its client has gone ("attempt to send response on closed
connection")."""

from __future__ import annotations

import codecs
import copy
import json
import socket
import threading
import time

from tests.doubles.spdk.apps import family
from tests.doubles.spdk.bdev import Poll
from tests.doubles.spdk.schema import (DECODE_FAILURE, INTERNAL_ERROR, INVALID_REQUEST,
                                       METHOD_NOT_FOUND, NVMF_DECODE, PARSE_ERROR, RpcError,
                                       check_params)
from tests.doubles.spdk.vhost import Deferred


class Channel:
    """One client connection; answers may go out through it later."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.lock = threading.Lock()
        self.open = True

    def send(self, reply) -> bool:
        with self.lock:
            if not self.open:
                return False        # the client has gone: the answer is dropped
            try:
                self.conn.sendall(_encode(reply))
                return True
            except OSError:
                self.open = False
                return False

    def close(self) -> None:
        with self.lock:
            self.open = False


class JsonRpcServer:
    """The server half of SpdkTargetDouble (a mixin)."""

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._spawn(self._converse, conn)

    def _converse(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        channel = Channel(conn)
        buf = ""
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with conn:
            try:
                while not self._stopping.is_set():
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        if buf.strip():
                            # An unparsable request that no further bytes completed.
                            channel.send(_error(None, PARSE_ERROR, "Parse error"))
                            buf = ""
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    buf += text.decode(data)
                    buf = self._answer_all(channel, buf)
            finally:
                channel.close()

    def _answer_all(self, channel: Channel, buf: str) -> str:
        decoder = json.JSONDecoder()
        while buf.strip():
            buf = buf.lstrip()
            try:
                request, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                return buf      # incomplete, so far
            buf = buf[end:]
            reply = self.answer(request, channel)
            if reply is not None:
                channel.send(reply)
        return buf

    def answer(self, request, channel: Channel | None = None):
        """The response to one decoded request, or to a JSON-RPC 2.0 batch (what
        SPDK's client sends in batch mode); None for notifications and for
        answers SPDK defers."""
        if isinstance(request, list):
            replies = [r for r in (self._answer_one(item, channel) for item in request) if r is not None]
            return replies or (None if request else _error(None, INVALID_REQUEST, "Invalid request"))
        return self._answer_one(request, channel)

    def _answer_one(self, request, channel: Channel | None) -> dict | None:
        if (not isinstance(request, dict) or request.get("jsonrpc") != "2.0"
                or not isinstance(request.get("method"), str)):
            rid = request.get("id") if isinstance(request, dict) else None
            return _error(rid, INVALID_REQUEST, "Invalid request")
        method, params, rid = request["method"], request.get("params"), request.get("id")
        wants_answer = "id" in request
        try:
            with self._lock:
                self.requests.append({"method": method, "params": copy.deepcopy(params)})
                result = self._dispatch(method, params)
                if isinstance(result, Deferred):
                    result.register(channel if wants_answer else None, rid)
                    return None
            if isinstance(result, Poll):
                result = self._poll(result)
        except RpcError as e:
            return _error(rid, e.code, e.message) if wants_answer else None
        except Exception as e:     # a bug in the double: say so rather than hang the client
            return _error(rid, INTERNAL_ERROR, f"SPDK target double failed: {e!r}")
        return {"jsonrpc": "2.0", "id": rid, "result": result} if wants_answer else None

    def _poll(self, wait: Poll):
        deadline = time.monotonic() + wait.seconds
        while time.monotonic() < deadline and not self._stopping.is_set():
            time.sleep(0.01)
            with self._lock:
                found = wait.probe()
            if found is not None:
                return found
        raise wait.error

    def serves(self, method: str) -> bool:
        """Whether this app has the method (and the double models it)."""
        group = family(method)
        return method in self._handlers and (group is None or group in self.families)

    def _dispatch(self, method: str, params):
        if not self.serves(method) or method not in self.facts:
            raise RpcError(METHOD_NOT_FOUND, "Method not found")
        spec = self.facts[method]["params"]
        failure = DECODE_FAILURE.get(method, NVMF_DECODE)
        if not spec and params is not None:
            raise RpcError(*failure)        # these handlers refuse any params object
        if check_params(spec, params) is not None:
            raise RpcError(*failure)
        fault = self.faults.get(method)
        if fault and fault[2] > 0:
            fault[2] -= 1
            raise RpcError(fault[0], fault[1])
        return self._handlers[method](params or {})

    def why_rejected(self, method: str, params) -> str | None:
        """The schema's reason for refusing params (tests use it to explain)."""
        return check_params(self.facts[method]["params"], params)


def _error(rid, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def _encode(reply) -> bytes:
    return (json.dumps(reply) + "\n").encode("utf-8")
