"""hooks install / uninstall: the libvirt hook as `vstor hooks install`
writes it (hooks/vstor with this interpreter, its paths and the config)."""

from __future__ import annotations

import os
import sys

from vstor.errors import BadInput

HOOK_DIR = "/etc/libvirt/hooks/qemu.d"     # where libvirt (libvirtd, virtqemud) looks


def register(sub) -> None:
    hooks = sub.add_parser("hooks", help="install or remove the libvirt hook")
    hsub = hooks.add_subparsers(dest="hooks_command", metavar="SUBCOMMAND")
    hsub.required = True
    p = hsub.add_parser("install", help="install the hook into libvirt's qemu.d")
    p.add_argument("--dir", default=HOOK_DIR, help="hook directory")
    p.set_defaults(func=cmd_hooks_install)
    p = hsub.add_parser("uninstall", help="remove the hook")
    p.add_argument("--dir", default=HOOK_DIR, help="hook directory")
    p.set_defaults(func=cmd_hooks_uninstall)


def hook_source(name: str = "vstor") -> str:
    """hooks/<name> from a checkout, or the copy pip installs under share/."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.path.join(here, "hooks", name),
                 os.path.join(sys.prefix, "share", "vstor", "hooks", name)):
        if os.path.exists(path):
            return path
    raise BadInput(f"cannot find vstor's hook script (hooks/{name})", hint="reinstall vstor")


def render_hook(config_path: str | None, name: str = "vstor") -> str:
    import shlex
    with open(hook_source(name)) as f:
        text = f.read()
    # The interpreter that has vstor installed: libvirt runs the hook with a
    # bare PATH, where `python3` may be another Python.
    if text.startswith("#!/bin/sh"):     # the libvirt hook: its fast path is the shell's
        text = text.replace("\nPYTHON=python3\n", f"\nPYTHON={shlex.quote(sys.executable)}\n", 1)
        if config_path:
            text = text.replace("\nCONFIG=\n", f"\nCONFIG={shlex.quote(os.path.abspath(config_path))}\n", 1)
        return text.replace("\nSYSPATH=\n", f"\nSYSPATH={shlex.quote(':'.join(site_paths()))}\n", 1)
    lines = text.splitlines(keepends=True)
    paths = site_paths()
    # -S with the paths (no site), -P where Python has it (3.11: the script's
    # own directory, the snippets storage, never on sys.path).
    flags = ("S" if paths else "") + ("P" if sys.version_info >= (3, 11) else "")
    lines[0] = f"#!{sys.executable} -{flags}\n" if flags else f"#!{sys.executable}\n"
    text = "".join(lines).replace("\nSYSPATH = []\n", f"\nSYSPATH = {paths!r}\n", 1)
    if config_path:
        text = text.replace("CONFIG = None", f"CONFIG = {os.path.abspath(config_path)!r}", 1)
    return text


def site_paths() -> list[str]:
    """What site adds to this interpreter's sys.path (site-packages, the
    directories .pth files name), and the directory vstor is imported from
    when only an import hook finds it (pip install -e): the hook's Python
    starts with -S and appends these.  Paths that cannot be carried (one
    with ':') give none: the hook then runs site itself."""
    import json
    import subprocess
    import vstor
    ask = "import json, sys; print(json.dumps(sys.path[1:]))"
    try:
        bare, full = (json.loads(subprocess.run([sys.executable, "-E", *flag, "-c", ask], check=True,
                                                capture_output=True, text=True).stdout)
                      for flag in (["-S"], []))
    except (OSError, ValueError, subprocess.CalledProcessError):
        return []
    paths = [p for p in full if p not in bare and os.path.isdir(p)]
    home = os.path.dirname(os.path.dirname(os.path.abspath(vstor.__file__)))
    if home not in bare + paths:
        paths.append(home)
    return [] if any(":" in p or "\n" in p for p in paths) else paths


def installed_hook_text(ctx) -> str:
    """What `vstor hooks install` writes, with this command's config path."""
    return render_hook(ctx.args.config or os.environ.get("VSTOR_CONFIG"))


def cmd_hooks_install(ctx, args) -> int:
    if not args.dir:
        raise BadInput("hooks install --dir is empty", hint=f"leave it out for libvirt's {HOOK_DIR}")
    if not args.dir.isprintable():      # a newline or an escape: a slip, never a directory meant
        raise BadInput(f"hooks install --dir {args.dir} holds a control character",
                       hint=f"check the path, or leave out --dir for libvirt's {HOOK_DIR}")
    target = os.path.join(args.dir, "vstor")
    where = os.path.normpath(args.dir)
    parent = os.path.dirname(where)
    if where != HOOK_DIR and not os.path.lexists(args.dir) and not os.path.lexists(parent):
        # libvirt's own directory is made as needed; another one only one level
        # down from a directory that exists: a mistyped path gets no hook nobody reads.
        raise BadInput(f"cannot install the hook into {args.dir}: neither it nor {parent} exists",
                       hint=f"check the path, or leave out --dir for libvirt's {HOOK_DIR}")
    from vstor.atomic import write_file
    try:
        write_file(target, installed_hook_text(ctx), mode=0o755, makedirs=True,
                   failure=f"cannot install the hook into {args.dir}")
    except BadInput as e:
        if os.geteuid() != 0:
            hint = "run as root"
        elif not os.path.isdir(args.dir):
            hint = (f"{args.dir} does not exist and cannot be made: create it, or give "
                    "the directory libvirt reads hooks from with --dir")
        else:
            hint = None
        raise BadInput(e.message, hint=hint) from None
    print(f"Installed {target}; restart libvirtd (or virtqemud) so it picks the hook up")
    return 0


def cmd_hooks_uninstall(ctx, args) -> int:
    return remove_hook(os.path.join(args.dir, "vstor"), "hook",
                       "restart libvirtd (or virtqemud) so it forgets the hook")


def remove_hook(target: str, noun: str, then: str) -> int:
    """`hooks uninstall` (libvirt's hook, Proxmox's hookscript)."""
    if not os.path.exists(target):
        print(f"No vstor {noun} at {target}")
        return 0
    try:
        os.unlink(target)
    except OSError as e:
        raise BadInput(f"cannot remove {target}: {e.strerror}",
                       hint="run as root" if os.geteuid() else None) from None
    print(f"Removed {target}; {then}")
    return 0
