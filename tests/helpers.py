"""What the test modules share besides fixtures (those are in
tests/conftest.py): a test module imports from here, never from another
test module."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Data of other projects, never copied into the checkout: ../shared next to it, where CI puts it.
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def unavailable(reason: str) -> None:
    """A test that cannot run here is skipped saying why, except in CI
    (CI=true), where a missing piece must not pass as green: it fails."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)
