#!/usr/bin/env python3
"""Regenerate the files made from the code: man/vstor.8, man/vstor.conf.5,
completion/vstor, etc/vstor.conf and the key reference in
docs/configuration.md.  --check: write nothing, exit 1 when one is stale."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vstor.docgen import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
