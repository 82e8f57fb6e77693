"""python3 -m tests.hostlayout LAYOUT.toml DIR (from the repository root)."""

from __future__ import annotations

import sys

import tests.hostlayout as package
from vstor.errors import VstorError

from .build import build_tree

PROG = "tests.hostlayout"
USAGE = f"usage: python3 -m {PROG} LAYOUT.toml DIR"


def help_text() -> str:
    """The usage line, then the package's description of the layout format."""
    doc = package.__doc__
    return (f"{USAGE}\n\nWrite the sysfs/procfs tree of the host LAYOUT.toml describes under DIR.\n\n"
            + doc[doc.index("The tree has"):].rstrip())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(help_text())
        return 0
    if len(args) != 2 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        root = build_tree(args[0], args[1])
    except VstorError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"host tree written to {root}; read it with: vstor --host-root {root} host show")
    return 0


if __name__ == "__main__":
    sys.exit(main())
