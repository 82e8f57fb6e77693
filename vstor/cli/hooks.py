"""hooks install / uninstall: the libvirt hook as `vstor hooks install`
writes it (hooks/vstor with this interpreter, its paths and the config)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import stat
import subprocess
import sys

import vstor
from vstor import log
from vstor.atomic import write_file
from vstor.config import DEFAULT_PATH
from vstor.errors import BadInput, InUse
from vstor.formats.pve.vm import vmid_of
from vstor.runtime.state import StateDir

HOOK_DIR = "/etc/libvirt/hooks/qemu.d"     # where libvirt (libvirtd, virtqemud) looks


def register(sub) -> None:
    hooks = sub.add_parser("hooks", help="install or remove the libvirt hook")
    hsub = hooks.add_subparsers(dest="hooks_command", metavar="SUBCOMMAND")
    hsub.required = True
    p = hsub.add_parser("install", help="install the hook into libvirt's qemu.d")
    p.add_argument("--dir", default=HOOK_DIR, help="hook directory")
    p.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    p.set_defaults(func=cmd_hooks_install)
    p = hsub.add_parser("uninstall", help="remove the hook `hooks install` wrote (refused while "
                                          "vstor holds backends for domains)")
    p.add_argument("--dir", default=HOOK_DIR, help="hook directory")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--force", action="store_true",
                   help="even while vstor holds backends for domains (their stop then releases nothing)")
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


# The Debian package's libvirt hook (debian/rules writes it with this
# function): Debian's python3 and dist-packages, not one venv, and a fix
# that names apt.
PACKAGED_PYTHON = "/usr/bin/python3"
PACKAGED_SYSPATH = "/usr/lib/python3/dist-packages"
PACKAGED_FIX = "install the vstor package again (apt-get install vstor), or purge it"


def packaged_hook() -> str:
    """The libvirt hook the vstor Debian package installs."""
    with open(hook_source("vstor")) as f:
        text = f.read()
    for old, new in (("\nPYTHON=python3\n", f"\nPYTHON={PACKAGED_PYTHON}\n"),
                     ("\nSYSPATH=\n", f"\nSYSPATH={PACKAGED_SYSPATH}\n"),
                     ("\nFIX='reinstall vstor, then: vstor hooks install'\n",
                      f"\nFIX={shlex.quote(PACKAGED_FIX)}\n")):
        if old not in text:
            raise BadInput(f"hooks/vstor lost its line {old.strip()!r}", hint="restore it")
        text = text.replace(old, new, 1)
    return text


def installed_hook_text(ctx) -> str:
    """What `vstor hooks install` writes, with this command's config path."""
    return render_hook(ctx.args.config or os.environ.get("VSTOR_CONFIG"))


def _check_dir(args) -> None:
    verb = f"hooks {args.hooks_command}"
    if not args.dir:
        raise BadInput(f"{verb} --dir is empty", hint=f"leave it out for libvirt's {HOOK_DIR}")
    if not args.dir.isprintable():      # a newline or an escape: a slip, never a directory meant
        raise BadInput(f"{verb} --dir {args.dir} holds a control character",
                       hint=f"check the path, or leave out --dir for libvirt's {HOOK_DIR}")


def cmd_hooks_install(ctx, args) -> int:
    _check_dir(args)
    target = os.path.join(args.dir, "vstor")
    where = os.path.normpath(args.dir)
    parent = os.path.dirname(where)
    if where != HOOK_DIR and not os.path.lexists(args.dir) and not os.path.lexists(parent):
        # libvirt's own directory is made as needed; another one only one level
        # down from a directory that exists: a mistyped path gets no hook nobody reads.
        raise BadInput(f"cannot install the hook into {args.dir}: neither it nor {parent} exists",
                       hint=f"check the path, or leave out --dir for libvirt's {HOOK_DIR}")
    text = installed_hook_text(ctx)
    if packaged(target):
        # dpkg installs and upgrades it; rewriting it would make dpkg ask
        # about a changed conffile at every upgrade.
        if "\nCONFIG=\n" not in text:
            raise BadInput(f"{target} is the vstor package's hook, which reads {DEFAULT_PATH}",
                           hint=f"keep the configuration in {DEFAULT_PATH}, or drop --config/VSTOR_CONFIG")
        print(f"{target} is the vstor package's hook (a conffile the package installs and "
              "upgrades): nothing to write; `apt-get install --reinstall vstor` restores it")
        return 0
    now = check_replaceable(target, "hook")
    if args.dry_run:
        for line in _would_install(args.dir, target, text, now):
            print(line)
        return 0
    try:
        write_file(target, text, mode=0o755, makedirs=True,
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
    log.change(None, f"install the libvirt hook {target}", log.DONE)
    print(f"Installed {target}; restart libvirtd (or virtqemud) so it picks the hook up")
    return 0


def _would_install(directory: str, target: str, text: str, now: str | None) -> list[str]:
    out = [] if os.path.isdir(directory) else [f"would create {directory} (mode 0755)"]
    if now == text:
        return out + [f"{target} is already this hook: nothing to write"]
    verb = "replace" if now is not None else "write"
    python = next((line.split("=", 1)[1] for line in text.splitlines() if line.startswith("PYTHON=")), "?")
    config = next((line.split("=", 1)[1] for line in text.splitlines() if line.startswith("CONFIG=")), "")
    return out + [f"would {verb} {target} (mode 0755, {len(text.encode())} bytes): the libvirt hook, "
                  f"run by {python}, config {config or 'the default'}",
                  "then: restart libvirtd (or virtqemud) so it picks the hook up"]


def cmd_hooks_uninstall(ctx, args) -> int:
    _check_dir(args)
    target = os.path.join(args.dir, "vstor")
    if not check_hook(target, "hook"):
        return 0
    held = _held_domains(ctx)
    if held and not args.force:
        raise InUse(f"vstor holds backends for {_names(held)}: without the hook, libvirt's stop of "
                    "each would not release them (its sockets, daemons, devices stay until "
                    "`vstor release`)", hint="stop those domains first, or `vstor gc` for ones that "
                                            "no longer run; or --force, then `vstor release DOMAIN` "
                                            "for each after it stops")
    then = "restart libvirtd (or virtqemud) so it forgets the hook"
    if held:
        then += (f"; vstor still holds backends for {_names(held)}: release each after it stops "
                 "(vstor release DOMAIN), as no hook will")
    if packaged(target):
        then += ("; it was the vstor package's conffile: upgrades keep it removed, and "
                 "`apt-get install --reinstall -o Dpkg::Options::=--force-confmiss vstor` brings it back")
    return _remove_checked(target, "hook", then, args.dry_run)


DPKG_CONFFILES = "/var/lib/dpkg/info/vstor.conffiles"


def packaged(target: str) -> bool:
    """Whether `target` is a conffile of the installed vstor Debian package."""
    try:
        with open(DPKG_CONFFILES) as f:
            owned = {line.split()[0] for line in f if line.strip()}
    except FileNotFoundError:
        return False
    return os.path.normpath(target) in owned


def _held_domains(ctx) -> list[str]:
    """The libvirt domains vstor holds backends for (its state records; a
    Proxmox VM's are released by the hookscript, not this hook).  A record
    that cannot be read may be one: it counts."""
    damaged: list[str] = []
    try:
        records = StateDir(ctx.config.state_dir).records(damaged)
    except OSError as e:
        raise BadInput(f"cannot read {ctx.config.state_dir} ({e.strerror}): cannot tell which "
                       "domains vstor holds backends for", hint="run as root") from None
    return ([r.domain for r in records if not vmid_of(r.domain)]
            + [f"a domain of a damaged record ({d})" for d in damaged])


def _names(held: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return f"{len(held)} domain{'s' if len(held) != 1 else ''} ({shown})"


# The lines each hook `hooks install` (and `pve hooks install`) writes opens
# with, whatever vstor version wrote it: a file without one is not vstor's.
MARKERS = ("# vstor's libvirt QEMU hook", "# vstor's Proxmox VE hookscript")


def is_vstor_hook(text: str) -> bool:
    head = text.splitlines()[:3]
    return any(line.startswith(MARKERS) for line in head) and "from vstor.hook import" in text


def remove_hook(target: str, noun: str, then: str, dry_run: bool = False) -> int:
    """`hooks uninstall` (libvirt's hook, Proxmox's hookscript): only a file
    vstor wrote (check_hook), never one someone else put there under that name."""
    if not check_hook(target, noun):
        return 0
    return _remove_checked(target, noun, then, dry_run)


def _remove_checked(target: str, noun: str, then: str, dry_run: bool) -> int:
    """Remove `target`, which check_hook found to be vstor's."""
    if dry_run:
        print(f"would remove {target}; then: {then}")
        return 0
    try:
        os.unlink(target)
    except OSError as e:
        raise BadInput(f"cannot remove {target}: {e.strerror}",
                       hint="run as root" if os.geteuid() else None) from None
    log.change(None, f"remove the {noun} {target}", log.DONE)
    print(f"Removed {target}; {then}")
    return 0


def check_hook(target: str, noun: str) -> bool:
    """True when `target` is a hook vstor wrote (a regular file with vstor's
    hook in it); False, said, when there is none; BadInput when it is
    someone else's file."""
    if _vstors_hook_text(target, noun, "remove it by hand if it is no longer wanted") is None:
        print(f"No vstor {noun} at {target}: nothing to remove")
        return False
    return True


def _read_hook(target: str, noun: str) -> str | None:
    """The text of the regular file at `target` (None: nothing there),
    opened once: never through a symlink, never waiting on a FIFO."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None     # no such file, or a file where its directory would be
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise BadInput(f"cannot read {target}: {e.strerror}",
                           hint="run as root" if os.geteuid() else None) from None
        fd = None       # a symlink
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise BadInput(f"{target} is not the {noun} vstor installs (not a regular file): left as it is",
                       hint="look at what it is, and remove it by hand if it is no longer wanted")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(1 << 20).decode(errors="replace")
        except OSError as e:
            raise BadInput(f"cannot read {target}: {e.strerror}",
                           hint="run as root" if os.geteuid() else None) from None


def check_replaceable(target: str, noun: str) -> str | None:
    """What install may write over: nothing, or a hook vstor wrote (its
    text); anything else is refused, as uninstall refuses it."""
    return _vstors_hook_text(target, noun, "remove it by hand if it is no longer wanted, then install again")


def _vstors_hook_text(target: str, noun: str, hint: str) -> str | None:
    """The text of vstor's hook at `target` (None: nothing there); anyone
    else's file by that name is refused and left as it is."""
    text = _read_hook(target, noun)
    if text is not None and not is_vstor_hook(text):
        raise BadInput(f"{target} is not vstor's {noun} (someone else's file by that name): left as it is",
                       hint=hint)
    return text
