"""vstor's tests; a package so that `python3 -m tests.hostlayout` and
`from tests.doubles ...` resolve here, not to some other installed `tests`."""


def installed_hook() -> str:
    """hooks/vstor as `vstor hooks install` writes it (this Python on its
    PYTHON line), to run as libvirt does: the file itself, executed."""
    import atexit
    import shutil
    import tempfile
    global _HOOK
    if _HOOK is None:
        from vstor.cli.hooks import render_hook
        where = tempfile.mkdtemp(prefix="vstor-hook-")
        atexit.register(shutil.rmtree, where, True)
        path = f"{where}/vstor"
        with open(path, "w") as f:
            f.write(render_hook(None))
        import os
        os.chmod(path, 0o755)
        _HOOK = path
    return _HOOK


_HOOK = None


def ended_process():
    """A process that has ended and is not reaped (the caller waits for it):
    its /proc entry is there, its cwd link answers ENOENT, as a short-lived
    process's does between a walk's open of the link and its readlink."""
    import subprocess
    import time
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)
