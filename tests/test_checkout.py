"""The suite's last check (tests/conftest.py): a run whose tests write into
the checkout fails, naming what they left; pytest's own exit code judges."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, checkout_state

pytestmark = pytest.mark.skipif(checkout_state() is None, reason="not in a git checkout")


def _run(body: str, stray_before: bool = False) -> subprocess.CompletedProcess:
    name = f"test_zz_checkout_{os.getpid()}.py"
    path = os.path.join(ROOT, "tests", name)
    stray = os.path.join(ROOT, f"stray-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(body.replace("STRAY", repr(stray)))
    if stray_before:                # a file of the developer's, untracked before the run
        with open(stray, "w") as f:
            f.write("mine\n")
        os.utime(stray, ns=(0, 0))
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


def test_a_run_that_writes_a_file_already_changed_fails_naming_it():
    """git's status line is the same before and after (`?? stray`): what
    the file is (its size and time) tells the write apart."""
    done = _run("def test_writes():\n    open(STRAY, 'a').write('a test\\n')\n", stray_before=True)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert f"the tests changed the checkout (1 paths): ?? stray-{os.getpid()}.txt" in done.stdout


def test_a_run_that_only_reads_a_file_already_changed_passes():
    done = _run("def test_reads():\n    assert open(STRAY).read() == 'mine\\n'\n", stray_before=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_outside_the_top_of_a_git_checkout_there_is_nothing_to_check(tmp_path):
    """An unpacked sdist or a wheel's tests (no .git), or a tree that sits
    inside another repository: the check is not made, and says nothing."""
    assert checkout_state(str(tmp_path)) is None
    assert checkout_state(os.path.join(ROOT, "tests")) is None
    assert checkout_state(ROOT) is not None
