"""A Nova live migration of an instance with vstor disks, as vstor's compute
driver carries it: nova-compute runs as the nova user, vstor's migration
needs root, so the driver runs `vstor nova migrate STEP INSTANCE` through
`[nova] migrate_command` (`sudo -n vstor` by default; the sudoers line is
in docs/nova.md).  No nova import here.

    prepare  before Nova's migration: the destination plans the instance's
             vstor disks and makes their backends (vstor migrate prepare)
    finish   after it: the instance arrived, the source lets go
    abort    Nova rolled the migration back: the destination gives up
"""

from __future__ import annotations

import shlex
import subprocess

from vstor.config import Config
from vstor.errors import BadInput, Unavailable, from_exit_code

STEPS = ("prepare", "finish", "abort")


def argv(cfg: Config, step: str, instance: str, dest: str | None = None) -> list[str]:
    if step not in STEPS:
        raise ValueError(step)
    try:
        prefix = shlex.split(cfg.nova_migrate_command)
    except ValueError as e:
        raise BadInput(f"{cfg.file}: [nova] migrate_command cannot be split ({e})",
                       hint="like: sudo -n vstor") from None
    if not prefix:
        raise BadInput(f"{cfg.file}: [nova] migrate_command is empty", hint="like: sudo -n vstor")
    return [*prefix, "nova", "migrate", step, instance, *(("--to", dest) if dest else ())]


def run(cfg: Config, step: str, instance: str, dest: str | None = None,
        timeout: float = 900.0) -> str:
    """Its output; a refusal raised as the VstorError of its exit code,
    with its one line."""
    cmd = argv(cfg, step, instance, dest)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise Unavailable(f"cannot run {cmd[0]} for vstor's migration of {instance}",
                          hint=f"install it, or set [nova] migrate_command in {cfg.file}") from None
    except subprocess.TimeoutExpired:
        raise Unavailable(f"vstor nova migrate {step} {instance} took over {timeout:.0f} s",
                          hint="see vstor status on both hosts") from None
    if done.returncode:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise from_exit_code(done.returncode, why.removeprefix("vstor: "))
    return done.stdout
