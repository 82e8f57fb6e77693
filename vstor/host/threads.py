"""A process's threads as the kernel lists them (/proc/PID/task), their CPU
affinity, and a guard against the pid's reuse: what pins threads after a
start (vstor.pve.pinning: a Proxmox VM's QEMU) and what checks and puts
back a qemu-storage-daemon's (vstor.runtime.drift) read and change.

`who` names the process in every refusal ("QEMU pid 4711",
"qemu-storage-daemon pid 4712")."""

from __future__ import annotations

import contextlib
import os
import signal

from vstor.errors import ActionFailed, Unavailable

# The task flags (/proc/PID/task/TID/stat, the ninth field) of a thread the
# kernel runs in a user process: a kernel thread, a user worker (vhost), an
# io_uring worker; and one whose affinity nobody may set.
PF_IO_WORKER, PF_USER_WORKER, PF_KTHREAD = 0x00000010, 0x00004000, 0x00200000
PF_NO_SETAFFINITY = 0x04000000
KERNEL = PF_IO_WORKER | PF_USER_WORKER | PF_KTHREAD | PF_NO_SETAFFINITY
ROUNDS = 3      # a thread the process starts while it is pinned is pinned by the next round


def tasks(pid: int, who: str) -> set[int]:
    """The thread ids of `pid`; Unavailable when it is gone or cannot be listed."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        raise Unavailable(f"{who} is gone") from None
    except OSError as e:
        raise Unavailable(f"cannot list /proc/{pid}/task: {e.strerror}") from None


def kernel_worker(pid: int, tid: int) -> bool:
    """A thread the kernel runs in the process, whose affinity is the
    kernel's (kvm-nx-lpage-recovery, vhost, iou-wrk): never pinned, never
    judged."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return False
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return bool(int(fields[6]) & KERNEL)
    except (IndexError, ValueError):
        return False


def affinity(tid: int) -> frozenset[int] | None:
    """The cores thread `tid` may run on; None when it ended."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except ProcessLookupError:
        return None


def online() -> frozenset[int]:
    """The host's online cores (the running kernel's: a pin is a change to this host)."""
    from vstor.cpulist import parse_cpulist
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return frozenset(parse_cpulist(f.read().strip()))
    except (OSError, ValueError) as e:
        raise Unavailable(f"cannot read /sys/devices/system/cpu/online: {e}") from None


@contextlib.contextmanager
def alive(pid: int, who: str):
    """A check that `pid` is still the process it was when this began (a
    pidfd: a pid reused since is another process, and fails the check)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise Unavailable(f"{who} is gone: nothing pinned") from None

    def check() -> None:
        try:
            signal.pidfd_send_signal(fd, 0)
        except ProcessLookupError:
            raise Unavailable(f"{who} ended while its threads were pinned") from None
    try:
        check()
        yield check
    finally:
        os.close(fd)



def pin(pid: int, who: str, want_of, alive, moved) -> bool:
    """Each thread of `pid` on the cores want_of(tid) gives (None or empty:
    left where it is), round after round until a round moves none, at most
    ROUNDS; the kernel's own threads in it left (kernel_worker).  `alive()`
    (the caller's pidfd check) before each round; each thread checked to be
    still `pid`'s just before its set (a thread id is reused once it ends);
    moved(tid, had, now) after each set.  ActionFailed when the kernel
    refuses one.  False when threads still moved in the last round."""
    for _ in range(ROUNDS):
        alive()
        changed = 0
        for tid in sorted(tasks(pid, who)):
            want = want_of(tid)
            if not want or kernel_worker(pid, tid):
                continue
            want = frozenset(want)
            have = affinity(tid)
            if have is None or have == want or not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue
            try:
                os.sched_setaffinity(tid, want)
            except ProcessLookupError:
                continue        # a worker thread that just ended
            except OSError as e:
                from vstor.cpulist import format_cpulist
                raise ActionFailed(f"cannot pin thread {tid} of {who} to cores "
                                   f"{format_cpulist(sorted(want))}: {e.strerror}") from None
            moved(tid, have, want)
            changed += 1
        if not changed:
            return True
    return False
