"""The SPDK application vstor talks to: reaching its JSON-RPC socket through
SPDK's official client (one-line reasons when it cannot), and what it is
(version, the vhost methods it serves, its -S directory) for `vstor doctor`."""

from __future__ import annotations

import errno
import os
import re
import stat

from vstor.backends.qsd.proc import cmdline
from vstor.errors import Unavailable

try:
    from spdk.rpc.client import JSONRPCClient, JSONRPCException
    TRANSPORT_ERRORS: tuple = (JSONRPCException, OSError)
except ImportError:     # said when a connection is needed; dry runs work without it
    JSONRPCClient = None
    TRANSPORT_ERRORS = (OSError,)

DEFAULT_SOCKET = "/var/tmp/spdk.sock"
DEFAULT_VHOST_DIR = "/run/vstor/vhost"
CONFIG_FILE = "/etc/vstor/vstor.conf"
# The SPDK releases vstor supports, oldest and newest, as (year, month): the
# tests run against the SPDK test double told to be each of them.
SUPPORTED = ((24, 1), (26, 9))


def release_of(version: str) -> tuple[int, int] | None:
    """'SPDK v26.09-pre git sha1 3230130e6a' -> (26, 9)."""
    m = re.search(r"v(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def app_facts(client, needed) -> dict:
    """What `vstor doctor` says about the SPDK application: its version, which
    of the `needed` methods it lacks (those vstor's SPDK steps send to serve a
    disk: the runtime declares them), and (from its command line in /proc,
    when vstor can read it) the app's name and its -S socket directory."""
    version = client.get_version()
    facts = {"version": version.removeprefix("SPDK ").strip(), "release": release_of(version),
             "missing": client.missing(needed), "app": None, "socket_dir": None}
    pid = client.app_pid()
    # [] when vstor cannot read it: another pid namespace (a container), or no pid given.
    argv = cmdline(pid) if pid else []
    facts["app"] = os.path.basename(argv[0]) if argv else None
    for i, arg in enumerate(argv):
        if arg == "-S" and i + 1 < len(argv):
            facts["socket_dir"] = argv[i + 1]
        elif arg.startswith("--vhost-socket-dir="):
            facts["socket_dir"] = arg.split("=", 1)[1]
        elif arg == "--vhost-socket-dir" and i + 1 < len(argv):
            facts["socket_dir"] = argv[i + 1]
    return facts


# -- reaching SPDK ------------------------------------------------------------------------

def connect(socket_path: str, timeout: float, vhost_dir: str = DEFAULT_VHOST_DIR,
            config: str = CONFIG_FILE):
    """SPDK's JSONRPCClient on socket_path, or Unavailable saying why not."""
    def unreachable(why: str) -> Unavailable:
        return Unavailable(f"SPDK is not reachable at {socket_path}: {why}",
                           hint=f"start SPDK's vhost app with -r {socket_path} -S {vhost_dir}, "
                                f"or set [spdk] rpc_socket in {config}")
    if JSONRPCClient is None:
        raise Unavailable("SPDK's Python client is not installed", hint="pip install spdk")
    _check_socket(socket_path, unreachable)
    try:
        rpc = JSONRPCClient(socket_path, timeout=timeout)
    except TRANSPORT_ERRORS as e:
        raise unreachable(_connect_failure(e.__cause__ or e)) from None
    # Each JSONRPCClient adds one more log handler to the logger shared by
    # every client of the same address; keep a single one.
    del rpc.get_logger().handlers[:-1]
    return rpc


def _check_socket(path: str, unreachable) -> None:
    # JSONRPCClient treats any address that is not an existing path as an IP
    # address and fails with a three-line message: say it in one line first.
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise unreachable("no such socket") from None
    except PermissionError:
        raise unreachable("permission denied (run as root)") from None
    if not stat.S_ISSOCK(mode):
        raise unreachable("not a socket")


def _connect_failure(cause: BaseException | None) -> str:
    code = getattr(cause, "errno", None)
    if code == errno.ECONNREFUSED:
        return "connection refused (a stale socket: SPDK is not running)"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied (run as root)"
    if code == errno.ENOENT or code is None:
        return "no such socket"
    return os.strerror(code).lower()
