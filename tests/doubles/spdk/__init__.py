"""SpdkTargetDouble: a TEST DOUBLE of an SPDK application (vhost, nvmf_tgt,
spdk_tgt), held to answers recorded from a real SPDK.

Not SPDK. The test machines have no SPDK (Debian does not package it), so
this is a JSON-RPC 2.0 server on a real Unix socket that answers the methods
vstor sends the way SPDK does. Where it can, it is held to the answers
recorded from a real SPDK v26.09-pre (tests/spdk/transcripts/, replayed by
tests/test_spdk_replay.py); elsewhere it follows SPDK's handlers as read in
SPDK's source. Every request is checked against SPDK's schema
(vstor/data/spdk_methods.json) first: schema.py.

What it models, by module:

- apps.py: which methods each app serves (vhost_* on vhost and spdk_tgt,
  nvmf_* on nvmf_tgt and spdk_tgt, bdev_*/framework_*/rpc_get_methods/
  spdk_get_version on all; others -32601), and their rpc_get_methods and
  framework_get_subsystems;
- bdev.py: malloc bdevs, bdev_get_bdevs (``timeout``: waits, then -110), and
  bdev_nvme: local PCIe controllers and NVMe-oF paths (multipath, failover
  alternate trids, path-specific detach, the recorded refusals);
- vhost.py: vhost-blk controllers on real sockets, their sessions, the
  delete while an initiator is connected, the claim a vhost-blk open meets;
- nvmf.py: the NVMe-oF target (transports, subsystems, hosts, namespaces
  claiming bdevs, listeners) and the ``Fabric`` that lets an app="vhost"
  double attach over TCP/RDMA to an app="nvmf_tgt" double's listeners;
- server.py: the JSON-RPC framing, including answers sent later or dropped.

Every request received is recorded in ``requests`` (method and params, as
sent) for tests to assert exact parameters.

Releases (``version=``): what differs, and what it is based on.

- "v26.09" (SPDK v26.09-pre, git sha1 3230130e6a): the recorded one. Based on
  the transcripts: spdk_get_version says "SPDK v26.09-pre git sha1
  3230130e6a"; vhost_delete_controller while an initiator is connected sends
  no answer, the controller stays listed with its sessions, and once the
  initiator disconnects the deletion completes (controller and socket gone)
  and the answer (true) is sent, or dropped if that client connection is
  gone (vhost-delete-while-connected.jsonl); bdev_nvme_get_controllers with
  an unknown name is -22 "Controller X does not exist"; a multipath path on
  a failover controller (or the other way round) is -22 "Invalid argument";
  re-adding a known failover trid is -114 "Operation already in progress"
  (vhost-attach-and-serve.jsonl).
- "v24.01" (the oldest SPDK vstor supports; what the double did before it
  had versions, and still the default): spdk_get_version says "SPDK v24.01";
  that delete is refused at once with -32602 "Device or resource busy"
  (SPDK before v24.09: vhost_user_dev_unregister returned -EBUSY when the
  controller "has still valid connection", and vhost_rpc.c answered
  -32602 with spdk_strerror; SPDK issue #993 shows that answer; v24.09 made
  the unregister retry instead); the unknown controller is +22 (a positive
  EINVAL in bdev_nvme_rpc.c until v26.05 changed its sign); paths of both
  modes may share a name, and a known failover trid again is -17 "File
  exists" (the older bdev_nvme.c read, v22-v23 era: no same-mode check in
  bdev_nvme_create, -EEXIST from bdev_nvme_add_secondary_trid).
- Everything else is the same in both, as recorded from v26.09. Seen in
  older SPDK source but NOT modelled (the double's v24.01 keeps what it did
  before; which release changed them was not pinned down): in the
  bdev_nvme_rpc.c of about v23.x an omitted ``multipath`` means "failover"
  (not "multipath"), a failed connect is -32602 "Invalid parameters" (not
  -5), and the bdev_nvme refusals end in a newline. The double lists vhost
  controllers sorted by name, as recorded; older releases may list them in
  creation order.
"""

from tests.doubles.spdk.apps import APPS, RELEASES, rpc_methods, subsystems
from tests.doubles.spdk.bdev import BLOCK_SIZE, DEFAULT_HOSTNQN, NUM_BLOCKS, NvmeController, Trid
from tests.doubles.spdk.nvmf import Fabric
from tests.doubles.spdk.schema import (DECODE_FAILURE, FACTS, INTERNAL_ERROR, INVALID_PARAMS,
                                       METHOD_NOT_FOUND, RpcError, check_params, check_value,
                                       errno_error, load_facts)
from tests.doubles.spdk.target import QSD_BINARY, SpdkTargetDouble, spdk_target_double
from tests.doubles.spdk.vhost import VhostController

__all__ = [
    "APPS", "BLOCK_SIZE", "DECODE_FAILURE", "DEFAULT_HOSTNQN", "FACTS", "Fabric", "INTERNAL_ERROR",
    "INVALID_PARAMS", "METHOD_NOT_FOUND", "NUM_BLOCKS", "NvmeController", "QSD_BINARY", "RELEASES",
    "RpcError", "SpdkTargetDouble", "Trid", "VhostController", "check_params", "check_value",
    "errno_error", "load_facts", "rpc_methods", "spdk_target_double", "subsystems",
]
