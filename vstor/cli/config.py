"""config check / show: vstor.conf as vstor reads it."""

from __future__ import annotations

import os

from vstor import config as config_mod
from vstor.config.keys import BY_SECTION
from vstor.errors import BadInput


def register(sub) -> None:
    p = sub.add_parser("config", help="check or show vstor.conf")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    csub.required = True
    q = csub.add_parser("check", help="read FILE as vstor would: 'FILE: ok', or the first line "
                        "that is wrong with its fix (exit 2)")
    q.add_argument("file", metavar="FILE", nargs="?",
                   help="the file to check (default: --config, $VSTOR_CONFIG or /etc/vstor/vstor.conf)")
    q.set_defaults(func=cmd_check)
    q = csub.add_parser("show", help="every key with the value vstor uses, as a vstor.conf")
    q.set_defaults(func=cmd_show)


def cmd_check(ctx, args) -> int:
    path, explicit = config_mod.locate(args.file or ctx.args.config)
    if not explicit and not os.path.lexists(path):
        print(f"{path}: absent, vstor runs on the defaults")
        return 0
    cfg = config_mod.load(path)     # an explicit file that is missing: refused
    problem = config_mod.conflicts(cfg, path)
    if problem:
        raise problem
    _check_owner(path)
    print(f"{path}: ok")
    return 0


def _check_owner(path: str) -> None:
    """Root runs what the file says ([migrate] peer_command, [nova]
    migrate_command): a file others may write is a way to root."""
    st = os.stat(path)
    if st.st_mode & 0o022:
        raise BadInput(f"{path}: group or others may write it (mode {st.st_mode & 0o777:04o}), and "
                       "root runs the commands it names", hint=f"fix: chmod go-w {path}")
    if os.geteuid() == 0 and st.st_uid != 0:
        raise BadInput(f"{path}: owned by uid {st.st_uid}, and root runs the commands it names",
                       hint=f"fix: chown root: {path}")


def cmd_show(ctx, args) -> int:
    print(show(ctx.config), end="")
    return 0


def show(cfg) -> str:
    """`cfg` as a vstor.conf that reads back to it; a key left unset is a
    comment saying what that means."""
    out = [f"# vstor config show: the values vstor uses (from {cfg.source})\n"]
    for section in config_mod.SECTIONS:
        out.append(f"\n[{section}]\n")
        for key in BY_SECTION[section].values():
            value = getattr(cfg, key.attr)
            if value is None:
                out.append(f"# {key.name}: {key.unset or 'not set'}\n")
            else:
                out.append(f"{key.name} = {key.kind.format(value)}\n".replace(" \n", "\n"))
    return "".join(out)
