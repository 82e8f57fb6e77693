#!/bin/bash
# The test command from README.md: installs what the tests need, then runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
exec "$(sh scripts/python.sh)" -m pytest -q -ra "$@"
