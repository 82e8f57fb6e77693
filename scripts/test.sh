#!/bin/bash
# The test command from README.md: installs what the tests need, then runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
# --durations: the slowest tests, named in every run (CI time is watched: docs/testing.md).
exec "$(sh scripts/python.sh)" -m pytest -q -ra --durations=25 "$@"
