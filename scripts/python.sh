#!/bin/sh
# Prints the interpreter vstor is installed with: ${PYTHON:-python3}, or
# .venv/bin/python3 when that interpreter is externally managed (Debian's own
# python3 refuses system-wide pip installs, PEP 668).
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python3 ] || $PY -c 'import os, sys, sysconfig
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
    echo .venv/bin/python3
else
    echo "$PY"
fi
