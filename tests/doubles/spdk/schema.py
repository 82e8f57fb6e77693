"""The contract every request is held to, and how SPDK says no.

Every request is checked against vstor/data/spdk_methods.json (generated
from SPDK's schema.yaml by scripts/gen-spdk-facts.py): an unknown parameter,
a missing required one or a wrong type is the decode failure *that method's
handler* answers (not always -32602, see DECODE_FAILURE).
"""

from __future__ import annotations

import json
import os
import uuid
from errno import EINVAL
from pathlib import Path

FACTS = Path(__file__).resolve().parents[3] / "vstor" / "data" / "spdk_methods.json"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND = -32700, -32600, -32601
INVALID_PARAMS, INTERNAL_ERROR = -32602, -32603

_DECODE = (INTERNAL_ERROR, "spdk_json_decode_object failed")
# What each handler answers when spdk_json_decode_object fails (module/bdev/
# nvme/bdev_nvme_rpc.c, module/bdev/malloc/bdev_malloc_rpc.c, lib/bdev/
# bdev_rpc.c, lib/vhost/vhost_rpc.c, lib/nvmf/nvmf_rpc.c, lib/rpc/rpc.c,
# lib/event/app_rpc.c, lib/init/subsystem_rpc.c); recorded for the vhost ones
# (method-not-found.jsonl).
DECODE_FAILURE = {
    "bdev_nvme_attach_controller": _DECODE,
    "bdev_nvme_detach_controller": _DECODE,
    "bdev_nvme_get_controllers": _DECODE,
    "bdev_get_bdevs": _DECODE,
    "bdev_malloc_create": _DECODE,
    "bdev_malloc_delete": _DECODE,
    "vhost_create_blk_controller": (INVALID_PARAMS, os.strerror(EINVAL)),
    "vhost_delete_controller": (INVALID_PARAMS, os.strerror(EINVAL)),
    "vhost_get_controllers": (INTERNAL_ERROR, os.strerror(EINVAL)),
    "spdk_get_version": (INVALID_PARAMS, "spdk_get_version method requires no parameters"),
    "framework_get_reactors": (INVALID_PARAMS, "`framework_get_reactors` requires no arguments"),
    "framework_get_subsystems": (INVALID_PARAMS, "'framework_get_subsystems' requires no arguments"),
    "rpc_get_methods": (INVALID_PARAMS, "Invalid parameters"),
}
NVMF_DECODE = (INVALID_PARAMS, "Invalid parameters")


class RpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def errno_error(code: int) -> RpcError:
    """SPDK's spdk_jsonrpc_send_error_response(request, -errno, spdk_strerror(errno))."""
    return RpcError(-code, os.strerror(code))


_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1), "uint8": (0, 2**8 - 1),
               "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}


def load_facts(path: Path | str = FACTS) -> dict[str, dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["methods"]


def check_params(spec: dict, params) -> str | None:
    """Why params do not decode under spec (a method's or an object's), or None."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return "params must be an object"
    for name in params:
        if name not in spec:
            return f"unknown parameter '{name}'"
    for name, fact in spec.items():
        if name in params:
            why = check_value(fact, params[name])
            if why:
                return f"'{name}': {why}"
        elif fact["required"]:
            return f"missing required parameter '{name}'"
    return None


def check_value(fact: dict, value) -> str | None:
    kind = fact["type"]
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"expected {kind}, got {value!r}"
    if kind == "string":
        return None if isinstance(value, str) else f"expected a string, got {value!r}"
    if kind == "boolean":
        return None if isinstance(value, bool) else f"expected a boolean, got {value!r}"
    if kind == "uuid":
        return None if isinstance(value, str) and is_uuid(value) else f"expected a UUID, got {value!r}"
    if kind == "enum":
        return None if value in fact["values"] else f"expected one of {fact['values']}, got {value!r}"
    if kind == "object":
        return check_params(fact["fields"], value) if isinstance(value, dict) else "expected an object"
    if kind in ("array", "bitmask"):
        return _check_list(fact, value)
    return f"type {kind} is not modelled by the double"


def _check_list(fact: dict, value) -> str | None:
    if not isinstance(value, list):
        return "expected an array"
    if fact["type"] == "bitmask":
        bad = [v for v in value if v not in fact["values"]]
        return f"unknown values {bad}" if bad else None
    if len(value) > fact["items"]["max_count"]:
        return "too many items"
    for item in value:
        why = check_value(fact["items"], item)
        if why:
            return why
    return None


def is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True
