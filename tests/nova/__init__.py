"""Nova's own code as the judge: an interpreter with nova installed
(`.nova-venv`, made by scripts/install-deps.sh; or $VSTOR_NOVA_PYTHON)
runs tests/nova/oracle.py on what vstor wrote."""

import json
import os
import subprocess

from tests.helpers import unavailable

HERE = os.path.dirname(__file__)
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def nova_python() -> str:
    path = os.environ.get("VSTOR_NOVA_PYTHON") or os.path.join(ROOT, ".nova-venv", "bin", "python3")
    if not os.access(path, os.X_OK):
        unavailable(f"no interpreter with nova installed at {path}: scripts/install-deps.sh makes it "
                    "(or set VSTOR_NOVA_PYTHON)")
    return path


def ask(request: dict) -> dict:
    """Run Nova's parsers on `request` (see oracle.py); their answers."""
    done = subprocess.run([nova_python(), os.path.join(HERE, "oracle.py")], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
