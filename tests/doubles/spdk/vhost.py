"""vhost-blk controllers (vhost, spdk_tgt).

Each controller has a real listening socket ``<vhost_dir>/<ctrlr>`` (mode
0755, like SPDK's), or with ``backing_dir`` a real qemu-storage-daemon
exporting a file as vhost-user-blk there, so a real QEMU can connect. Every
initiator connected to it (a real client on the socket, or one marked with
``mark_connected``) is a session in vhost_get_controllers, in the recorded
shape (``{"vid", "id", "name": "<ctrlr>s<vid>", "started": false, ...}``:
an initiator that only connects never starts the device).

vhost_delete_controller while an initiator is connected: before v24.09 SPDK
refuses it (-32602 "Device or resource busy"); since then it sends no answer
and retries until the initiator leaves, then deletes the controller and its
socket and answers the request (dropped if that client has gone)
(vhost-delete-while-connected.jsonl).

vhost-blk does not claim its bdev (two controllers may share one; an NVMe-oF
namespace may be added on it afterwards), but it opens it for writing, which
a bdev claimed exclusive_write refuses: -32602 "Operation not permitted"
(export-claim-order.jsonl).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field
from errno import EBUSY, EEXIST, EINVAL, EIO, ENODEV, EPERM

from tests.doubles.spdk.schema import INTERNAL_ERROR, INVALID_PARAMS, RpcError


@dataclass
class Session:
    vid: int
    id: int

    def info(self, ctrlr: str) -> dict:
        return {"vid": self.vid, "id": self.id, "name": f"{ctrlr}s{self.vid}", "started": False,
                "max_queues": 0, "inflight_task_cnt": 0}


class Endpoint:
    """A controller's socket when no qemu-storage-daemon serves it: accepts
    initiators and holds them until they hang up, like rte_vhost. Its own
    thread alone closes the sockets."""

    def __init__(self, path: str, new_session, end_session):
        self.new_session, self.end_session = new_session, end_session
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.setblocking(False)
        self.peers: dict[socket.socket, Session] = {}
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def sessions(self) -> list[Session]:
        """Who is connected now (a connect() that returned counts already)."""
        with self.lock:
            self._accept()
            return list(self.peers.values())

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self.listener.accept()
            except OSError:         # BlockingIOError: nobody waiting
                return
            peer.setblocking(False)
            self.peers[peer] = self.new_session()

    def _run(self) -> None:
        try:
            while not self.closing.is_set():
                with self.lock:
                    watched = [self.listener, *self.peers]
                try:
                    ready, _, _ = select.select(watched, [], [], 0.05)
                except (OSError, ValueError):
                    continue
                with self.lock:
                    for s in ready:
                        if s is self.listener:
                            self._accept()
                        elif s in self.peers and not _still_there(s):
                            self.end_session(self.peers.pop(s))
                            s.close()
        finally:
            with self.lock:
                for s, session in self.peers.items():
                    s.close()
                    self.end_session(session)
                self.peers.clear()
                self.listener.close()


@dataclass
class VhostController:
    name: str
    bdev: str | None
    cpumask: int
    readonly: bool
    packed_ring: bool
    socket_path: str
    endpoint: Endpoint | None = None
    qsd_pid: int | None = None
    marked: Session | None = None
    next_session_id: int = 0
    pending: list = field(default_factory=list)     # (channel, id) of deletions SPDK deferred


class Deferred:
    """A handler's "no answer now": ``register(channel, rid)`` keeps the
    request to answer later (or to drop, if its client has gone)."""

    def __init__(self, register):
        self.register = register


class VhostTarget:
    """The vhost_* handlers of SpdkTargetDouble (a mixin)."""

    # -- initiators -----------------------------------------------------------------------

    def mark_connected(self, ctrlr: str, connected: bool = True) -> None:
        """Pretend an initiator (QEMU) is connected to vhost controller ctrlr."""
        with self._lock:
            vc = self.vhost[ctrlr]
            if connected and vc.marked is None:
                vc.marked = self._new_session(vc)
            elif not connected and vc.marked is not None:
                self._end_session(vc.marked)
                vc.marked = None

    def sessions_of(self, vc: VhostController) -> list[Session]:
        found = [vc.marked] if vc.marked else []
        if vc.endpoint is not None:
            found += vc.endpoint.sessions()
        elif vc.qsd_pid is not None:        # the daemon's initiators, counted in /proc/net/unix
            found += [Session(i, i) for i in range(_unix_peers(vc.socket_path))]
        return found

    def is_connected(self, ctrlr: str) -> bool:
        with self._lock:
            vc = self.vhost.get(ctrlr)
            return vc is not None and bool(self.sessions_of(vc))

    def wait_disconnected(self, ctrlr: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.is_connected(ctrlr):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _new_session(self, vc: VhostController) -> Session:
        with self._vid_lock:
            vid = next(i for i in range(len(self._vids) + 1) if i not in self._vids)
            self._vids.add(vid)
        vc.next_session_id += 1
        return Session(vid, vc.next_session_id - 1)

    def _end_session(self, session: Session) -> None:
        with self._vid_lock:
            self._vids.discard(session.vid)

    def backing_file(self, bdev: str) -> str:
        return os.path.join(self.backing_dir or "", f"{bdev}.raw")

    # -- handlers -------------------------------------------------------------------------

    def _create_vhost(self, p: dict) -> bool:
        name, dev = p["ctrlr"], p["dev_name"]
        if p.get("transport", "vhost_user_blk") != "vhost_user_blk":
            raise RpcError(INVALID_PARAMS, os.strerror(EINVAL))
        bdev = self._bdev(dev)
        if bdev is None:
            raise RpcError(INVALID_PARAMS, os.strerror(ENODEV))     # spdk_bdev_open_ext first
        if self.claims.get(bdev.name):
            raise RpcError(INVALID_PARAMS, os.strerror(EPERM))      # opened for writing, even readonly
        if name in self.vhost:
            raise RpcError(INVALID_PARAMS, os.strerror(EEXIST))     # vhost_dev_register
        mask = self._cpumask(p.get("cpumask"))
        path = os.path.join(self.vhost_dir, name)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise RpcError(INVALID_PARAMS, os.strerror(EIO))        # not a socket: refused
        vc = VhostController(name, bdev.name, mask, bool(p.get("readonly")), bool(p.get("packed_ring")), path)
        self._serve_vhost(vc)
        self.vhost[name] = vc
        return True

    def _cpumask(self, text: str | None) -> int:
        app_mask = sum(1 << core for core in self.cores)
        if text is None:
            return app_mask
        mask = _parse_cpumask(text)
        if mask is None or mask == 0 or mask & ~app_mask:
            raise RpcError(INVALID_PARAMS, os.strerror(EINVAL))    # "cpumask 0x4 is invalid (core mask is 0x2)"
        return mask

    def _delete_vhost(self, p: dict):
        vc = self.vhost.get(p["ctrlr"])
        if vc is None:
            raise RpcError(INVALID_PARAMS, os.strerror(ENODEV))
        if self.sessions_of(vc):
            if not self.release.deferred_delete:
                raise RpcError(INVALID_PARAMS, os.strerror(EBUSY))     # "has still valid connection"
            return Deferred(lambda channel, rid: self._defer_delete(vc, channel, rid))
        self._tear_down(vc)
        del self.vhost[vc.name]
        return True

    def _get_vhost(self, p: dict) -> list:
        if "name" in p:
            vc = self.vhost.get(p["name"])
            if vc is None:
                raise RpcError(INTERNAL_ERROR, os.strerror(ENODEV))
            return [self._vhost_info(vc)]
        return [self._vhost_info(self.vhost[name]) for name in sorted(self.vhost)]

    def _vhost_info(self, vc: VhostController) -> dict:
        return {"ctrlr": vc.name, "cpumask": f"0x{vc.cpumask:x}", "delay_base_us": 0,
                "iops_threshold": 60000, "socket": vc.socket_path,
                "sessions": [s.info(vc.name) for s in self.sessions_of(vc)],
                "backend_specific": {"block": {"readonly": vc.readonly, "bdev": vc.bdev,
                                               "transport": "vhost_user_blk"}}}

    # -- a deletion SPDK defers -----------------------------------------------------------

    def _defer_delete(self, vc: VhostController, channel, rid) -> None:
        vc.pending.append((channel, rid))
        if not self._watching:
            self._watching = True
            self._spawn(self._finish_deferred)

    def _finish_deferred(self) -> None:
        """SPDK's retry loop: once the last initiator has gone, the pending
        deletions complete and their answers go out (or are dropped)."""
        while not self._stopping.is_set():
            with self._lock:
                waiting = [vc for vc in self.vhost.values() if vc.pending]
                if not waiting:
                    self._watching = False
                    return
                for vc in waiting:
                    if not self.sessions_of(vc):
                        self._tear_down(vc)
                        del self.vhost[vc.name]
                        for channel, rid in vc.pending:
                            if channel is not None and rid is not None:
                                channel.send({"jsonrpc": "2.0", "id": rid, "result": True})
                        vc.pending.clear()
            time.sleep(0.01)
        with self._lock:
            self._watching = False

    # -- the socket -----------------------------------------------------------------------

    def _serve_vhost(self, vc: VhostController) -> None:
        if os.path.lexists(vc.socket_path):
            os.unlink(vc.socket_path)       # a stale socket is replaced, as rte_vhost does
        if self.backing_dir:
            vc.qsd_pid = self._start_qsd(vc)
        else:
            vc.endpoint = Endpoint(vc.socket_path, lambda: self._new_session(vc), self._end_session)
        os.chmod(vc.socket_path, 0o755)     # what SPDK 26.09 was seen to create

    def _start_qsd(self, vc: VhostController) -> int:
        image = self.backing_file(vc.bdev)
        if not os.path.exists(image):
            info = self._bdev(vc.bdev)
            with open(image, "wb") as f:
                f.truncate(info.block_size * info.num_blocks)
        pidfile = os.path.join(self.backing_dir, f"{vc.name}.pid")
        subprocess.run([
            self.qsd_binary,
            "--blockdev", f"driver=file,node-name=f0,filename={image}",
            "--blockdev", "driver=raw,node-name=d0,file=f0",
            "--export", f"type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,"
                        f"addr.path={vc.socket_path},writable={'off' if vc.readonly else 'on'}",
            "--pidfile", pidfile, "--daemonize"], check=True, capture_output=True, timeout=30)
        with open(pidfile, encoding="ascii") as f:
            return int(f.read().strip())

    def _tear_down(self, vc: VhostController) -> None:
        if vc.endpoint is not None:
            vc.endpoint.close()
            vc.endpoint = None
        if vc.qsd_pid is not None:
            _stop_process(vc.qsd_pid)
            vc.qsd_pid = None
        if vc.marked is not None:
            self._end_session(vc.marked)
            vc.marked = None
        if os.path.lexists(vc.socket_path):
            os.unlink(vc.socket_path)


def _parse_cpumask(text: str) -> int | None:
    """spdk_cpuset_parse: a hex mask (0x optional) or a [list] of cores and ranges."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        mask = 0
        for part in filter(None, text[1:-1].split(",")):
            low, _, high = part.partition("-")
            if not low.strip().isdigit() or (high and not high.strip().isdigit()):
                return None
            for core in range(int(low), int(high or low) + 1):
                mask |= 1 << core
        return mask
    try:
        return int(text, 16)
    except ValueError:
        return None


def _still_there(s: socket.socket) -> bool:
    """Read what an initiator sent; False once it hung up."""
    try:
        return bool(s.recv(4096))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _unix_peers(path: str) -> int:
    """Connected server-side sockets bound to path (/proc/net/unix state 02/03):
    the initiators of a qemu-storage-daemon."""
    count = 0
    try:
        with open("/proc/net/unix", encoding="utf-8") as f:
            next(f)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].rstrip("\n") == path and fields[5] in ("02", "03"):
                    count += 1
    except OSError:
        return 0
    return count


def _stop_process(pid: int) -> None:
    """Stop a qemu-storage-daemon this double started (by its pid)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False
