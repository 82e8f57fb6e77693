"""The process tests/test_crash.py kills: one vstor prepare or release,
run against the test's sysfs tree, state directory and SPDK double, that
kills itself with SIGKILL at its k-th crash point.

Crash points are made here, in the child, by wrapping (never by changing
vstor):

- `StateDir.save`: before the save, and after its temporary file is written
  but before the rename (a `<key>.json.tmp` is left behind);
- `executor.do` and `executor.undo`: before and after each call.

A job is a JSON object: {"op": "prepare" | "release", "crash_at": k (0:
never), "cfg": Config's fields, "root": the sysfs tree, "domain": a file
holding the domain XML (with its plan), "out": where the result goes}.  The
result (written unless the process was killed) is {"points": [label, ...],
"error": one line or null, "exit_code": n}.

Two ways to run it:

    python -m tests.crash_child JOB.json     one job; the exit status is the
                                             job's (-9 when it crashed)
    python -m tests.crash_child --serve      a fork server: vstor imported
                                             once, then one forked process per
                                             job line on stdin, answering
                                             {"rc": n} per line on stdout
                                             (n = -signal when killed)
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback


class CrashPoints:
    def __init__(self, crash_at: int = 0):
        self.crash_at = crash_at
        self.labels: list[str] = []

    def point(self, label: str) -> None:
        self.labels.append(label)
        if len(self.labels) == self.crash_at:
            print(f"crash point {self.crash_at}: {label}: SIGKILL", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def install(points: CrashPoints) -> None:
    """Wrap StateDir.save, the rename inside it, executor.do and executor.undo."""
    from vstor.runtime import executor, recordfile, state

    real_save, real_do, real_undo = state.StateDir.save, executor.do, executor.undo
    saving: list[str] = []

    def save(self, rec):
        what = _record(rec)
        points.point(f"save {what}: before")
        saving.append(what)
        try:
            real_save(self, rec)
        finally:
            saving.pop()

    class OsInState:
        """The `os` the state's files are written with (recordfile): its
        replace() of a record is a crash point while a save runs (the
        temporary file is written and fsynced)."""
        def __getattr__(self, name):
            return getattr(os, name)

        def replace(self, src, dst, **kw):
            if saving and os.path.basename(os.path.dirname(dst)) == "domains":
                points.point(f"save {saving[-1]}: temporary written, before rename")
            return os.replace(src, dst, **kw)

    def do(a, rt):
        points.point(f"do {a.describe()}: before")
        real_do(a, rt)
        points.point(f"do {a.describe()}: after")

    def undo(a, rt, others):
        points.point(f"undo {a.describe()}: before")
        real_undo(a, rt, others)
        points.point(f"undo {a.describe()}: after")

    state.StateDir.save = save
    recordfile.os = OsInState()
    executor.do = do
    executor.undo = undo


def _record(rec) -> str:
    entries = ", ".join(f"{e.get('kind')}:{e.get('state')}" for e in rec.steps)
    return f"{rec.status} [{entries}]"


def preload() -> None:
    """Everything a run imports, so a forked run starts warm."""
    import vstor.backends.qsd.daemon  # noqa: F401
    import vstor.backends.spdk  # noqa: F401
    import vstor.backends.vfio  # noqa: F401
    import vstor.host.read  # noqa: F401
    import vstor.meta.document  # noqa: F401
    import vstor.runtime.lifecycle  # noqa: F401
    import tests.doubles.kernel_sysfs  # noqa: F401


def run(job: dict) -> int:
    from tests.doubles.kernel_sysfs import KernelSysfsDouble
    from vstor.config import Config
    from vstor.errors import VstorError
    from vstor.host.read import read_host
    from vstor.host.sysfs import SysFS
    from vstor.meta.document import Domain
    from vstor.runtime.lifecycle import Runtime, prepare, release
    from vstor.runtime.state import StateDir

    points = CrashPoints(int(job.get("crash_at") or 0))
    install(points)
    cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["cfg"].items()})
    result = {"points": points.labels, "error": None, "exit_code": 0}
    say = lambda m: print(f"{job['op']}: {m}", flush=True)   # noqa: E731
    try:
        dom = Domain.load(job["domain"])
        rt = Runtime(cfg, KernelSysfsDouble(job["root"]))
        state = StateDir(cfg.state_dir)
        if job["op"] == "prepare":
            prepare(rt, state, read_host(SysFS(job["root"])), dom, progress=say)
        elif job["op"] == "release":
            release(rt, state, dom.safe_name, progress=say, domain=dom.name, uuid=dom.uuid)
        else:
            raise ValueError(f"unknown op {job['op']!r}")
    except VstorError as e:
        traceback.print_exc()
        result.update(error=str(e).splitlines()[0], exit_code=e.exit_code or 1)
    except Exception as e:
        traceback.print_exc()
        result.update(error=f"{type(e).__name__}: {e}".splitlines()[0], exit_code=70)
    with open(job["out"], "w") as f:
        json.dump(result, f)
    return result["exit_code"]


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(stdin, stdout) -> None:
    preload()
    stdout.write('{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job)
        rc = _reap(pid, float(job.get("timeout", 60)))
        stdout.write(json.dumps({"rc": rc}) + "\n")
        stdout.flush()


def _child(job: dict) -> None:
    code = 70
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = run(job)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pid: int, timeout: float) -> int:
    """The job's status; a job still running after `timeout` is killed (-9
    would look like a crash point: report it as -1000)."""
    fd = os.pidfd_open(pid)
    try:
        ready = select.select([fd], [], [], timeout)[0]
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1000
        return _status(os.waitpid(pid, 0)[1])
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if argv[1:] == ["--serve"]:
        serve(sys.stdin, sys.stdout)
        return 0
    with open(argv[1]) as f:
        return run(json.load(f))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
