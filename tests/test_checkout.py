"""The suite's last check (tests/conftest.py): a run whose tests write into
the checkout fails, naming what they left; pytest's own exit code judges."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, checkout_state

pytestmark = pytest.mark.skipif(checkout_state() is None, reason="not in a git checkout")


def _run(body: str) -> subprocess.CompletedProcess:
    name = f"test_zz_checkout_{os.getpid()}.py"
    path = os.path.join(ROOT, "tests", name)
    stray = os.path.join(ROOT, f"stray-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(body.replace("STRAY", repr(stray)))
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"tests/{name}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
        if os.path.exists(stray):
            os.unlink(stray)


def test_a_run_that_leaves_a_file_in_the_checkout_fails_naming_it():
    done = _run("def test_writes():\n    open(STRAY, 'w').close()\n")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert f"the tests changed the checkout (1 paths): ?? stray-{os.getpid()}.txt" in done.stdout
    assert "1 passed" in done.stdout


def test_a_run_that_leaves_the_checkout_as_it_was_passes():
    done = _run("def test_writes_nothing():\n    pass\n")
    assert done.returncode == 0, done.stdout + done.stderr
