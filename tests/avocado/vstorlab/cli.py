"""vstor's CLI and virsh, as a lab runs them: every command logged, an
unexpected exit a TestFail with the command's own one-line error."""
from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path

from avocado.core.exceptions import TestFail

ROOT = Path(__file__).resolve().parents[3]      # the vstor checkout
LOG = logging.getLogger("avocado.test")


def run(argv: list[str], *, codes=(0,), timeout: float = 300, cwd=None,
        label: str = "") -> subprocess.CompletedProcess:
    """`label`: how a failure names the command (default: the command line)."""
    LOG.info("$ %s", shlex.join(argv))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    for line in (out.stdout + out.stderr).strip().splitlines()[-20:]:
        LOG.debug("  | %s", line)
    if codes is not None and out.returncode not in codes:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()
        raise TestFail(f"{label or shlex.join(argv)}: exit {out.returncode}"
                       + (f": {said[-1]}" if said else ""))
    return out


class Vstor:
    """`vstor [-c URI] [--config FILE] ...`: by default this checkout's vstor,
    run by the Python that runs avocado (the one vstor is installed for)."""

    def __init__(self, command: str, config: str, uri: str) -> None:
        self.argv = shlex.split(command) if command else [sys.executable, "-m", "vstor.cli.main"]
        self.cwd = None if command else ROOT
        if uri:
            self.argv += ["-c", uri]
        if config:
            self.argv += ["--config", config]

    def __call__(self, *args: str, codes=(0,), timeout: float = 300) -> subprocess.CompletedProcess:
        out = run(self.argv + list(args), codes=codes, timeout=timeout, cwd=self.cwd,
                  label=shlex.join(["vstor", *args]))
        if "Traceback" in out.stderr:
            raise TestFail(f"vstor {' '.join(args)} crashed: {out.stderr.strip().splitlines()[-1]}")
        return out

    def json(self, *args: str):
        return json.loads(self(*args, "--json").stdout)

    def json_codes(self, *args: str, codes):
        """--json output of a command that may exit with one of `codes`."""
        return json.loads(self(*args, "--json", codes=codes).stdout)


class Virsh:
    def __init__(self, uri: str) -> None:
        self.argv = ["virsh", "-q"] + (["-c", uri] if uri else [])

    def __call__(self, *args: str, codes=(0,), timeout: float = 300) -> str:
        return run(self.argv + list(args), codes=codes, timeout=timeout,
                   label=shlex.join(["virsh", *args])).stdout
