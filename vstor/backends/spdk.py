"""vstor's thin client for SPDK's JSON-RPC socket.

SPDK's official Python client (``spdk.rpc.client.JSONRPCClient``) does the
connecting and the framing; this module adds what vstor needs on top: one
exception type carrying SPDK's error code, one-line "SPDK is not reachable"
errors, typed helpers for the handful of methods vstor sends (parameters
left out when None), "not found" answers turned into empty lists so steps can
look before they create, and a dry-run mode that sends nothing.

Every method name and parameter here is checked against SPDK's schema by the
tests (vstor/data/spdk_methods.json, through the SPDK target double).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any, TextIO

from vstor.backends.spdk_app import (TRANSPORT_ERRORS, CONFIG_FILE, DEFAULT_SOCKET,
                                     DEFAULT_VHOST_DIR, connect)
from vstor.errors import ActionFailed, InUse, Unavailable

# JSON-RPC error codes SPDK uses (include/spdk/jsonrpc.h).
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


class SpdkRpcError(ActionFailed):
    """SPDK answered a request with a JSON-RPC error.

    An ActionFailed: SPDK was reached and refused (or failed) what vstor
    asked, so the host change did not happen; the journal rolls back what
    came before it, and the exit code is the one for a failed host change.
    A missing or dead SPDK is Unavailable instead."""

    def __init__(self, method: str, code: int, message: str):
        super().__init__(f"SPDK refused {method}: {message} (error {code})",
                         hint=_hint(method, code, message))
        self.method = method
        self.code = code
        self.rpc_message = message


def _hint(method: str, code: int, message: str) -> str | None:
    if code == METHOD_NOT_FOUND:
        return f"this SPDK application has no {method}: start SPDK's vhost app, or a newer SPDK"
    if method == "vhost_delete_controller" and message == os.strerror(errno.EBUSY):
        return "QEMU is still connected to it: stop the domain first"
    if code == INVALID_PARAMS and method == "vhost_create_blk_controller" and message == os.strerror(errno.EINVAL):
        return "is the reactor core in SPDK's -m mask? ([cpu] reactors must be SPDK's cores)"
    return None


class SpdkClient:
    """A connection to one SPDK application, opened on first use.

    dry_run=True sends nothing: every request is recorded in ``requests`` and
    printed to ``out`` as one JSON line, and "get" methods answer empty."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 30.0, *,
                 dry_run: bool = False, out: TextIO | None = None,
                 vhost_dir: str = DEFAULT_VHOST_DIR, config: str = CONFIG_FILE):
        self.socket_path = socket_path
        self.timeout = timeout
        self.dry_run = dry_run
        self.out = out
        self.vhost_dir = vhost_dir
        self.config = config
        self.requests: list[dict] = []      # dry run only: what would have been sent
        self._rpc = None

    def __enter__(self) -> SpdkClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        rpc, self._rpc = self._rpc, None
        if rpc is not None and rpc.sock is not None:
            try:
                rpc.close()
            except OSError:
                pass    # SPDK already hung up: nothing to shut down

    # -- the one way requests go out ----------------------------------------------------

    def call(self, method: str, params: dict | None = None, timeout: float | None = None) -> Any:
        """`timeout`: for this call only (the connection's otherwise)."""
        params = _without_none(params or {})
        if self.dry_run:
            return self._record(method, params)
        rpc = self._connection()
        rpc.timeout = self.timeout if timeout is None else timeout
        try:
            # send()/recv() rather than JSONRPCClient.call(): call() folds the
            # error object into a message string (losing the code) and writes
            # "method"/"req_id" into the caller's params dict on error.
            req_id = rpc.send(method, params)
            response = rpc.recv()
        except TRANSPORT_ERRORS as e:
            self._drop()
            raise self._lost(method, e) from None
        if response.get("id") != req_id:
            # The client reads whatever comes next; a late answer to an
            # earlier, timed-out request must not pass for this one.
            self._drop()
            raise Unavailable(f"SPDK at {self.socket_path} answered request {response.get('id')} "
                              f"while vstor waited for {req_id} ({method})",
                              hint="retry; if it persists, restart SPDK")
        if "error" in response:
            error = response["error"] or {}
            raise SpdkRpcError(method, int(error.get("code", 0)), str(error.get("message", "")))
        return response.get("result")

    def _record(self, method: str, params: dict) -> Any:
        request = {"method": method, "params": params} if params else {"method": method}
        self.requests.append(request)
        print(f"SPDK RPC (dry run): {json.dumps(request)}", file=self.out or sys.stdout)
        return _DRY_RUN_RESULTS.get(method)

    def _connection(self):
        if self._rpc is None:
            self._rpc = connect(self.socket_path, self.timeout, self.vhost_dir, self.config)
        return self._rpc

    def _drop(self) -> None:
        rpc, self._rpc = self._rpc, None
        if rpc is not None and rpc.sock is not None:
            try:
                rpc.sock.close()
            except OSError:
                pass

    def _lost(self, method: str, e: Exception) -> Unavailable:
        text = getattr(e, "message", None) or str(e) or type(e).__name__
        if text.startswith("Timeout"):
            why = f"no answer to {method} within {self.timeout:g} s"
            hint = f"SPDK is busy or hung; raise [spdk] timeout in {self.config} if it is only slow"
        else:
            why = f"the connection broke during {method} ({text.splitlines()[0]})"
            hint = "check that SPDK is still running"
        return Unavailable(f"SPDK at {self.socket_path}: {why}", hint=hint)

    # -- typed helpers ------------------------------------------------------------------

    def get_version(self) -> str:
        result = self.call("spdk_get_version") or {}
        return result.get("version", "")

    def missing(self, methods) -> list[str]:
        """The methods this SPDK application does not serve (rpc_get_methods);
        a dry run sends nothing and assumes none are missing."""
        if self.dry_run:
            return []
        return sorted(set(methods) - set(self.call("rpc_get_methods") or ()))

    def require(self, methods) -> None:
        """Unavailable unless this SPDK application serves every method: an
        app without vhost (nvmf_tgt), or too old, is found out before the
        first change, not half-way through a plan."""
        missing = self.missing(methods)
        if missing:
            raise Unavailable(f"the SPDK application at {self.socket_path} has no {', '.join(missing)}",
                              hint=f"run SPDK's vhost app (or spdk_tgt) there, started with -S {self.vhost_dir}")

    def app_pid(self) -> int | None:
        """The SPDK application's pid, as it reports it (framework_get_reactors)."""
        pid = self.framework_get_reactors().get("pid")
        return pid if isinstance(pid, int) and pid > 0 else None

    def attach_nvme_controller(self, name: str, trtype: str, traddr: str, adrfam: str | None = None,
                               trsvcid: str | None = None, subnqn: str | None = None,
                               hostnqn: str | None = None, multipath: str | None = None,
                               ctrlr_loss_timeout_sec: int | None = None,
                               reconnect_delay_sec: int | None = None,
                               fast_io_fail_timeout_sec: int | None = None) -> list[str]:
        """Attach a controller (or one more path to it); returns the bdev names
        SPDK reports, ``<name>n<nsid>``. An added failover path reports none."""
        return self.call("bdev_nvme_attach_controller", {
            "name": name, "trtype": trtype, "traddr": traddr, "adrfam": adrfam,
            "trsvcid": trsvcid, "subnqn": subnqn, "hostnqn": hostnqn, "multipath": multipath,
            "ctrlr_loss_timeout_sec": ctrlr_loss_timeout_sec,
            "reconnect_delay_sec": reconnect_delay_sec,
            "fast_io_fail_timeout_sec": fast_io_fail_timeout_sec}) or []

    def detach_nvme_controller(self, name: str, trtype: str | None = None, traddr: str | None = None,
                               adrfam: str | None = None, trsvcid: str | None = None,
                               subnqn: str | None = None) -> None:
        """Detach a controller, or only the path the transport fields name."""
        self.call("bdev_nvme_detach_controller", {
            "name": name, "trtype": trtype, "traddr": traddr, "adrfam": adrfam,
            "trsvcid": trsvcid, "subnqn": subnqn})

    def get_nvme_controllers(self, name: str | None = None) -> list[dict]:
        # Unknown name (module/bdev/nvme/bdev_nvme_rpc.c): "Controller X does
        # not exist" with -EINVAL since v26.05 (recorded from v26.09-pre),
        # +EINVAL before; -32602 "Invalid parameters" in older releases.
        gone = "Controller {name} does not exist"
        return self._lookup("bdev_nvme_get_controllers", {"name": name},
                            {(-errno.EINVAL, gone), (errno.EINVAL, gone),
                             (INVALID_PARAMS, "Invalid parameters")})

    def vhost_create_blk_controller(self, ctrlr: str, dev_name: str, cpumask: str | None = None,
                                    readonly: bool | None = None,
                                    packed_ring: bool | None = None) -> None:
        """SPDK creates the socket <vhost dir>/<ctrlr> (its -S option)."""
        self.call("vhost_create_blk_controller", {
            "ctrlr": ctrlr, "dev_name": dev_name, "cpumask": cpumask,
            "readonly": readonly, "packed_ring": packed_ring})

    def vhost_delete_controller(self, ctrlr: str, wait: float = 10.0) -> None:
        """Delete a vhost controller and follow it until it is gone.

        While QEMU is connected, SPDK before v24.09 refuses with EBUSY; since
        v24.09 it sends no answer and retries until QEMU disconnects (logging
        a line per retry), then deletes and drops the answer.  So the request
        gets a short timeout, and then vstor watches vhost_get_controllers for
        up to `wait` seconds: gone is done; still there is an InUse
        saying SPDK will finish when QEMU lets go.  Callers check `sessions`
        first and do not send this while QEMU is connected."""
        try:
            self.call("vhost_delete_controller", {"ctrlr": ctrlr}, timeout=min(2.0, self.timeout))
            return
        except SpdkRpcError as e:
            if e.code == INVALID_PARAMS and e.rpc_message == os.strerror(errno.ENODEV):
                return      # gone already (an earlier, deferred delete finished)
            if e.code == INVALID_PARAMS and e.rpc_message == os.strerror(errno.EBUSY):
                raise InUse(f"SPDK refused deleting vhost controller {ctrlr}: an initiator (QEMU) "
                            "is still connected", hint="stop the domain's QEMU, then run vstor "
                                                       "release again") from None
            raise
        except Unavailable as e:
            if "no answer" not in e.message:
                raise
        deadline = time.monotonic() + wait
        while self.vhost_get_controllers(ctrlr):
            if time.monotonic() >= deadline:
                raise InUse(f"SPDK deferred deleting vhost controller {ctrlr}: an initiator "
                            "(QEMU) is still connected, and SPDK deletes it when it disconnects",
                            hint="stop the domain's QEMU, then run vstor release again")
            time.sleep(0.1)

    def vhost_sessions(self, ctrlr: str) -> int | None:
        """How many initiators (QEMUs) are connected to a vhost controller;
        None when there is no such controller."""
        found = self.vhost_get_controllers(ctrlr)
        if not found:
            return None
        return len(found[0].get("sessions") or ())

    def vhost_get_controllers(self, name: str | None = None) -> list[dict]:
        # Unknown name: -32603 with strerror(ENODEV), "No such device"
        # (lib/vhost/vhost_rpc.c); the same code also means a decode failure.
        return self._lookup("vhost_get_controllers", {"name": name},
                            {(INTERNAL_ERROR, os.strerror(errno.ENODEV))})

    def framework_get_reactors(self) -> dict:
        return self.call("framework_get_reactors") or {}

    def nvmf_create_transport(self, trtype: str, **options: Any) -> None:
        """options: any nvmf_create_transport parameter (no_srq, max_srq_depth, num_cqe, ...)."""
        self.call("nvmf_create_transport", {"trtype": trtype, **options})

    def nvmf_create_subsystem(self, nqn: str, serial_number: str | None = None,
                              model_number: str | None = None, allow_any_host: bool | None = None,
                              max_namespaces: int | None = None) -> None:
        self.call("nvmf_create_subsystem", {
            "nqn": nqn, "serial_number": serial_number, "model_number": model_number,
            "allow_any_host": allow_any_host, "max_namespaces": max_namespaces})

    def nvmf_subsystem_add_ns(self, nqn: str, bdev_name: str, nsid: int | None = None) -> int:
        """Returns the namespace id SPDK assigned."""
        namespace = _without_none({"bdev_name": bdev_name, "nsid": nsid})
        return self.call("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": namespace}) or 0

    def nvmf_subsystem_add_listener(self, nqn: str, trtype: str, traddr: str, trsvcid: str,
                                    adrfam: str | None = None) -> None:
        address = _without_none({"trtype": trtype, "adrfam": adrfam, "traddr": traddr,
                                 "trsvcid": trsvcid})
        self.call("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": address})

    def nvmf_subsystem_add_host(self, nqn: str, host: str) -> None:
        self.call("nvmf_subsystem_add_host", {"nqn": nqn, "host": host})

    def nvmf_delete_subsystem(self, nqn: str) -> None:
        self.call("nvmf_delete_subsystem", {"nqn": nqn})

    def nvmf_get_subsystems(self, nqn: str | None = None) -> list[dict]:
        # Filtered here rather than by SPDK: how an unknown nqn is answered
        # differs between releases, and an empty list is what callers want.
        subsystems = self.call("nvmf_get_subsystems") or []
        return [s for s in subsystems if nqn is None or s.get("nqn") == nqn]

    def _lookup(self, method: str, params: dict, not_found: set[tuple[int, str | None]]) -> list:
        try:
            return self.call(method, params) or []
        except SpdkRpcError as e:
            if params.get("name") is not None and _matches(e, not_found, params["name"]):
                return []
            raise


def _matches(e: SpdkRpcError, answers: set[tuple[int, str | None]], name: str) -> bool:
    """`message` None: any message; else the exact text, with {name} the name asked for."""
    return any(e.code == code and (message is None or e.rpc_message == message.format(name=name))
               for code, message in answers)


def _without_none(params: dict) -> dict:
    return {k: v for k, v in params.items() if v is not None}


_DRY_RUN_RESULTS: dict[str, Any] = {
    "spdk_get_version": {"version": "(dry run)", "fields": {}},
    "bdev_nvme_get_controllers": [],
    "vhost_get_controllers": [],
    "nvmf_get_subsystems": [],
    "framework_get_reactors": {"reactors": []},
    "rpc_get_methods": [],
    "bdev_nvme_attach_controller": [],
}
