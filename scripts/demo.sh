#!/bin/sh
# vstor's main job, end to end, on the embedded default (qemu-storage-daemon;
# no SPDK, no NVMe): see scripts/demo.py.  Run as root on Debian 12.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
exec "$(sh scripts/python.sh)" scripts/demo.py "$@"
