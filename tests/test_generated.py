"""The files generated from the code (man pages, bash completion, the sample
vstor.conf, the key reference): current, and working as their readers use
them (man and groff, bash)."""

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from vstor import config, docgen, errors
from vstor.cli.main import build_parser

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MAN_PAGES = ("man/vstor.8", "man/vstor.conf.5")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("rel", docgen.FILES)
def test_the_committed_file_is_what_the_code_generates(rel):
    made = docgen.generate(ROOT)[rel]
    assert read(rel) == made, f"{rel} is stale: run {docgen.COMMAND}"


def test_gen_docs_finds_a_stale_file_and_regenerates_it(tmp_path):
    for rel in docgen.FILES:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), tmp_path / rel)
    script = [sys.executable, os.path.join(ROOT, "scripts", "gen-docs.py"), "--repo", str(tmp_path)]
    assert subprocess.run(script + ["--check"], capture_output=True).returncode == 0
    (tmp_path / "man/vstor.8").write_text(read("man/vstor.8").replace("vstor hooks install", "x"))
    (tmp_path / "etc/vstor.conf").unlink()
    out = subprocess.run(script + ["--check"], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [f"{rel}: stale (run: python3 scripts/gen-docs.py)"
                                       for rel in ("man/vstor.8", "etc/vstor.conf")]
    out = subprocess.run(script, capture_output=True, text=True)
    assert out.stdout == "wrote man/vstor.8\nwrote etc/vstor.conf\n"
    for rel in docgen.FILES:
        assert (tmp_path / rel).read_text() == read(rel)


# --- man pages --------------------------------------------------------------

@pytest.mark.skipif(not shutil.which("groff"), reason="needs groff (apt-get install groff-base)")
@pytest.mark.parametrize("rel", MAN_PAGES)
@pytest.mark.parametrize("device", ["utf8", "ps"])
def test_groff_renders_the_man_page_without_a_warning(rel, device):
    out = subprocess.run(["groff", "-man", "-ww", "-z", "-T" + device, os.path.join(ROOT, rel)],
                         capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (0, "")


@pytest.mark.skipif(not shutil.which("man"), reason="needs man-db")
@pytest.mark.parametrize("rel", MAN_PAGES)
def test_man_shows_the_page_without_a_warning(rel):
    out = subprocess.run(["man", "-l", os.path.join(ROOT, rel)], capture_output=True, text=True,
                         env={**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "",
                              "MANPAGER": "cat", "PAGER": "cat"})
    assert out.returncode == 0 and out.stderr == ""
    assert "vstor" in out.stdout


def rendered(rel):
    if not shutil.which("groff"):
        pytest.skip("needs groff")
    out = subprocess.run(["groff", "-man", "-Tutf8", "-P-cbou", os.path.join(ROOT, rel)],
                         capture_output=True, text=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
    return out.stdout


def leaf_commands(parser, path=()):
    """(path, parser) of every command that runs something, from argparse itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from leaf_commands(sub, path + (name,))
            return
    yield path, parser


def test_vstor_8_shows_every_command_and_option():
    page = rendered("man/vstor.8")
    for heading in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "OPTIONS", "EXIT STATUS",
                    "FILES", "SEE ALSO"):
        assert f"\n{heading}\n" in page
    commands = list(leaf_commands(build_parser()))
    assert len(commands) > 30
    for path, parser in commands:
        assert "\n   " + " ".join(("vstor",) + path) in page, path
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in page


def test_vstor_8_lists_every_exit_code():
    page = rendered("man/vstor.8")
    status = page[page.index("\nEXIT STATUS\n"):page.index("\nENVIRONMENT\n")]
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert codes == {0, 1, 2, 3, 4, 5}
    for code in codes | {130}:
        assert f"\n       {code} " in status


def test_vstor_conf_5_documents_every_key_with_its_default():
    page = rendered("man/vstor.conf.5")
    for section in config.SECTIONS:
        assert f"\n   [{section}]\n" in page
    for key in config.KEYS:
        section = page[page.index(f"\n   [{key.section}]\n"):]
        entry = section[section.index(f"\n       {key.name} = "):]
        entry = " ".join(entry[:entry.index("\n\n")].split())
        assert f"Default: {key.default_text}." in entry, key


def test_the_reference_table_has_a_row_per_key():
    guide = read("docs/configuration.md")
    for key in config.KEYS:
        assert guide.count(f"\n| `{key.name}` |") >= 1, key
    rows = [line for line in guide.splitlines() if line.startswith("| `")]
    assert len(rows) == len(config.KEYS)


# --- bash completion --------------------------------------------------------

def complete(*words, env=None):
    """The candidates bash offers after `words` (the last one being
    completed), from completion/vstor sourced into a real bash, called as
    readline calls it: COMP_LINE and COMP_POINT, and COMP_WORDS split at
    COMP_WORDBREAKS (so test:///default is three words there)."""
    line = " ".join(words)
    script = (f"source {ROOT}/completion/vstor\n"
              'COMP_LINE=$1; COMP_POINT=${#1}\n'
              # what readline would put in COMP_WORDS: split at blanks, ':' and '='
              'COMP_WORDS=($(sed "s/[:=]/ & /g" <<< "$1")); [[ $1 == *" " ]] && COMP_WORDS+=("")\n'
              "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
              "_vstor; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    out = subprocess.run(["bash", "--norc", "-c", script, "bash", line], capture_output=True,
                         text=True, env={"PATH": os.environ["PATH"], **(env or {})})
    assert out.returncode == 0 and out.stderr == ""
    return sorted(line for line in out.stdout.splitlines() if line)


def subcommand_paths(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield path, sorted(action.choices)
            for name, sub in action.choices.items():
                yield from subcommand_paths(sub, path + (name,))


def test_completion_offers_every_subcommand():
    paths = list(subcommand_paths(build_parser()))
    assert len(paths) >= 8
    for path, names in paths:
        assert complete("vstor", *path, "") == names, path
    assert complete("vstor", "ho") == ["host", "hooks"] or complete("vstor", "ho") == ["hooks", "host"]
    # global options before the command are skipped, with their values
    assert complete("vstor", "--config", "/x", "-c", "test:///default", "pve", "hooks", "") == \
        ["install", "uninstall"]


def test_completion_offers_every_option_of_every_command():
    for path, parser in leaf_commands(build_parser()):
        flags = sorted(f for a in parser._actions for f in a.option_strings)
        assert complete("vstor", *path, "-") == flags, path


def test_completion_offers_an_options_choices():
    assert complete("vstor", "nova", "config", "--page-size", "") == ["1G", "2M"]
    assert complete("vstor", "nova", "config", "--page-size=1") == ["1G"]
    assert complete("vstor", "nova", "config", "--page-size=") == ["1G", "2M"]
    assert complete("vstor", "nova", "migrate", "") == ["abort", "finish", "prepare"]


def test_completion_offers_files_and_directories(tmp_path):
    (tmp_path / "a.xml").write_text("")
    (tmp_path / "sub").mkdir()
    assert complete("vstor", "define", f"{tmp_path}/") == [f"{tmp_path}/a.xml", f"{tmp_path}/sub"]
    assert complete("vstor", "hooks", "install", "--dir", f"{tmp_path}/") == [f"{tmp_path}/sub"]
    assert complete("vstor", "attach", "dom", f"{tmp_path}/a") == [f"{tmp_path}/a.xml"]
    # readline replaces what follows the word's last ':' (a COMP_WORDBREAKS character)
    (tmp_path / "vm:1.xml").write_text("")
    assert complete("vstor", "define", f"{tmp_path}/vm:") == ["1.xml"]


@pytest.mark.skipif(not shutil.which("virsh"), reason="needs virsh (libvirt-clients)")
def test_completion_offers_the_domains_virsh_lists():
    """libvirt's test:///default driver has one domain, "test"."""
    assert complete("vstor", "-c", "test:///default", "release", "") == ["test"]
    assert complete("vstor", "-c", "test:///default", "hooks", "") == ["install", "uninstall"]
    assert complete("vstor", "--connect=test:///default", "migrate", "abort", "t") == ["test"]
    assert complete("vstor", "status", "", env={"LIBVIRT_DEFAULT_URI": "test:///default"}) == ["test"]
    # a DOMAIN|FILE argument: domains and files
    assert "test" in complete("vstor", "-c", "test:///default", "plan", "te")
