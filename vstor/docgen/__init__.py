"""The files made from the code: man pages, bash completion, the sample
vstor.conf and the configuration reference.

`python3 scripts/gen-docs.py` writes them; tests/test_generated.py fails
when a committed one differs from what the code makes now.
"""

from __future__ import annotations

import argparse
import os
import sys

from vstor.docgen import cli, completion, conffiles, roff

COMMAND = "python3 scripts/gen-docs.py"

# Paths relative to the repository root; the Debian package installs the
# first four from here.
FILES = ("man/vstor.8", "man/vstor.conf.5", "completion/vstor", "etc/vstor.conf",
         "docs/configuration.md")


def generate(repo: str) -> dict[str, str]:
    """Each generated file's text as the code makes it now (docs/configuration.md:
    its hand-written prose from `repo`, the reference made anew)."""
    root = cli.commands()
    with open(os.path.join(repo, "docs/configuration.md"), encoding="utf-8") as f:
        guide = f.read()
    return {
        "man/vstor.8": roff.vstor8(root),
        "man/vstor.conf.5": roff.vstor_conf5(),
        "completion/vstor": completion.script(root),
        "etc/vstor.conf": conffiles.sample(),
        "docs/configuration.md": conffiles.configuration_md(guide),
    }


def stale(repo: str) -> list[str]:
    """The generated files whose committed text differs from the code's."""
    out = []
    for rel, text in generate(repo).items():
        try:
            with open(os.path.join(repo, rel), encoding="utf-8") as f:
                if f.read() == text:
                    continue
        except FileNotFoundError:
            pass
        out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gen-docs.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), help="the repository root (default: this checkout)")
    args = p.parse_args(argv)
    if args.check:
        old = stale(args.repo)
        for rel in old:
            print(f"{rel}: stale (run: {COMMAND})", file=sys.stderr)
        return 1 if old else 0
    for rel, text in generate(args.repo).items():
        path = os.path.join(args.repo, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    continue
        except FileNotFoundError:
            pass
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {rel}")
    return 0
