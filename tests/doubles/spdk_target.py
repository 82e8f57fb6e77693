"""The SPDK target double, under the name the tests import it by.

It is the package tests/doubles/spdk/: its docstring says what the double
models, per app and per SPDK release, and what each is based on."""

from tests.doubles.spdk import (APPS, BLOCK_SIZE, DECODE_FAILURE, DEFAULT_HOSTNQN, FACTS,
                                INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, NUM_BLOCKS,
                                QSD_BINARY, RELEASES, Fabric, NvmeController, RpcError,
                                SpdkTargetDouble, Trid, VhostController, check_params, check_value,
                                errno_error, load_facts, rpc_methods, spdk_target_double, subsystems)

__all__ = [
    "APPS", "BLOCK_SIZE", "DECODE_FAILURE", "DEFAULT_HOSTNQN", "FACTS", "Fabric", "INTERNAL_ERROR",
    "INVALID_PARAMS", "METHOD_NOT_FOUND", "NUM_BLOCKS", "NvmeController", "QSD_BINARY", "RELEASES",
    "RpcError", "SpdkTargetDouble", "Trid", "VhostController", "check_params", "check_value",
    "errno_error", "load_facts", "rpc_methods", "spdk_target_double", "subsystems",
]
