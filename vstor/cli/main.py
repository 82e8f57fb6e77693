"""Argument parsing and the one place errors become exit codes."""

from __future__ import annotations

import argparse
import os
import sys

from vstor import __version__, log
from vstor.cli import config, domains, guestkit, hostcmds, hotplug, metrics, migrate, nova, pve, repair, runtime
from vstor.cli.context import Context
from vstor.cli.domains import is_file
from vstor.errors import EXIT_BAD_INPUT, EXIT_ERROR, VstorError, one_line

COMMAND_MODULES = [hostcmds, domains, guestkit, runtime, repair, hotplug, migrate, pve, nova, config, metrics]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line and the usage-error exit code, like every other bad input.
        print(f"vstor: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vstor", description="Per-VM NVMe storage for libvirt/QEMU: "
                "VFIO passthrough or SPDK/qemu-storage-daemon vhost-user-blk, NUMA-pinned.")
    p.add_argument("--version", action="version", version=f"vstor {__version__}")
    p.add_argument("-c", "--connect", metavar="URI",
                   help="libvirt URI (default: $LIBVIRT_DEFAULT_URI or qemu:///system)")
    p.add_argument("--config", metavar="FILE",
                   help="vstor.conf (default: $VSTOR_CONFIG or /etc/vstor/vstor.conf)")
    p.add_argument("--host-root", metavar="DIR",
                   help="read sysfs/procfs under DIR, e.g. an extracted `vstor host capture` "
                        "(default: $VSTOR_HOST_ROOT or /)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the log's lines (each host change, each refusal) on stderr")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.setup(command_of(args), verbose=args.verbose)
    ctx = Context(args)
    try:
        return args.func(ctx, args) or 0
    except VstorError as e:
        print(f"vstor: error: {e}", file=sys.stderr)
        log.refusal(str(e), e.exit_code, _domain(args))
        return e.exit_code
    except KeyboardInterrupt:
        print("vstor: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:   # a bug: still one line, the traceback on request
        log.refusal(f"internal error: {type(e).__name__}: {e}", EXIT_ERROR, _domain(args))
        if os.environ.get("VSTOR_DEBUG"):
            raise
        print(one_line(f"vstor: internal error: {type(e).__name__}: {e} "
                       "(run with VSTOR_DEBUG=1 for a traceback)"), file=sys.stderr)
        return EXIT_ERROR


def command_of(args) -> str:
    """The command as typed, without its arguments: 'prepare', 'hooks install'."""
    return " ".join([args.command] + [v for k, v in vars(args).items()
                                      if k.endswith("_command") and isinstance(v, str)])


def _domain(args) -> str | None:
    """The domain a refusal is about, when the command names one."""
    name = getattr(args, "domain", None)
    if isinstance(name, str):
        return name
    source = getattr(args, "source", None)      # FILE|DOMAIN: a domain when it is not a file
    if isinstance(source, str):
        return None if is_file(source) else source
    vm = getattr(args, "vmid", None)
    return f"pve-{vm}" if isinstance(vm, str) and vm.isdigit() else None


if __name__ == "__main__":
    sys.exit(main())
