"""Replacing a file whole: a reader sees the old file or the new one, never
half of either.  The one writer for what vstor writes outside its state
directory (rendered XML, Proxmox configs, intents and plans, hook scripts,
the Nova driver shim); the state records keep their own, journaled one."""

from __future__ import annotations

import os

from vstor.errors import BadInput


def write_file(path: str, data: str | bytes, mode: int | None = 0o644, failure: str | None = None,
               hint: str | None = None, makedirs: bool = False) -> None:
    """A temporary file beside `path` (never through a symlink), synced, with
    `mode` (None: as the umask makes it, and no chmod, which Proxmox's
    cluster filesystem refuses for most modes), renamed over it.  Any
    failure: the temporary is gone and BadInput says `failure` (default
    'cannot write PATH') with the OS's reason."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        if makedirs:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)     # what the umask took away
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise BadInput(f"{failure or f'cannot write {path}'}: {e.strerror}", hint=hint) from None
