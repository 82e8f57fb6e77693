"""What a running qemu-storage-daemon serves, read from its command line
and its descriptors: its source (the descriptor it inherited, or, for a
daemon started before vstor passed descriptors, its filename), its socket
(the name its inherited listening socket was bound to), and whether
another daemon already writes a source."""

from __future__ import annotations

import os

from vstor.backends.qsd import files, proc
from vstor.backends.qsd.export import QsdExport, export_opts, option_value
from vstor.errors import DoesNotFit
from vstor.meta.names import is_disk_name


def differs(export: QsdExport, src, p: int, opts: dict) -> str | None:
    """Why the running daemon `p` is not the one `export` describes, or None."""
    writable = "off" if export.readonly else "on"
    if opts.get("writable") != writable:
        return f"writable={opts.get('writable')}, not {writable}"
    served = _source_of(p, opts)
    if served is None or not files.same_file(src.st, served):
        return f"it serves another source than {export.source}"
    sock = _socket_of(p, opts)
    if sock != export.socket_path:
        return f"it listens on {sock or 'no socket vstor can name'}, not {export.socket_path}"
    return None


def _source_of(p: int, opts: dict) -> str | None:
    """Where daemon `p`'s source can be looked at: its inherited descriptor,
    or (a daemon started by vstor before it passed descriptors) its
    filename, relative to its own cwd, not ours."""
    name = opts.get("filename")
    if name is None:
        return None
    if name.startswith("/proc/self/fd/"):
        return f"/proc/{p}/fd/{name[len('/proc/self/fd/'):]}"
    return os.path.join(f"/proc/{p}/cwd", name)


def _socket_of(p: int, opts: dict) -> str | None:
    if opts.get("addr.type") == "fd":
        return proc.socket_path_of(p, opts.get("addr.str", ""))
    return opts.get("addr.path")


def check_no_other_writer(export: QsdExport, mine: os.stat_result, handover: bool = False,
                           daemons: list[int] | None = None) -> None:
    """qsd's exports share every permission on their node, so QEMU's image
    locking lets two daemons write one source: refuse it here.  One exception,
    with `handover` (the destination of a live migration): the source host's
    daemon for the same disk, which is another host's (two hosts on one
    machine, as the tests run them: _another_hosts) and has a pidfile of
    the same name; the source's QEMU drains and stops before the
    destination's runs."""
    if daemons is None or os.path.basename(export.binary) != "qemu-storage-daemon":
        daemons = proc.pids_of("qemu-storage-daemon")
    for p in daemons:
        argv = proc.cmdline(p)
        if not argv or os.path.basename(argv[0]) != "qemu-storage-daemon":
            continue
        opts = export_opts(argv)
        served = _source_of(p, opts)
        if served is None or not files.same_file(mine, served):
            continue
        if export.readonly and opts.get("writable") == "off":
            continue        # readers share
        if handover and _another_hosts(export, p, argv, opts):
            continue
        raise _second_writer(export, p, _socket_of(p, opts))


def _another_hosts(export: QsdExport, p: int, argv: list[str], opts: dict) -> bool:
    """Daemon `p` serves the disk of export's name for another host: its
    pidfile has the name of export's, and it is another host's pidfile (two
    hosts' configurations on one machine) or the same path in another
    host's mount namespace (its socket not in this host's network one)."""
    pidfile = option_value(argv, "--pidfile") or ""
    if os.path.basename(pidfile) != os.path.basename(export.pidfile):
        return False
    return pidfile != export.pidfile or (
        opts.get("addr.type") == "fd"
        and proc.socket_path_of(p, opts.get("addr.str", ""), here_only=True) is None)


def _second_writer(export: QsdExport, pid: int, sock: str | None) -> DoesNotFit:
    """The refusal, naming the vstor disk the other daemon serves when its
    socket has vstor's name (<domain>-<target>): a domain that stopped
    without its release keeps it until vstor release."""
    name = os.path.basename(sock or "")
    if not is_disk_name(name):
        return DoesNotFit(f"disk source {export.source} is already exported by qemu-storage-daemon "
                          f"pid {pid} ({sock or 'a socket'})",
                          hint="two writers would corrupt it; make both readonly or stop the other")
    domain = name.rsplit("-", 1)[0]
    return DoesNotFit(f"disk source {export.source} is already exported by qemu-storage-daemon pid {pid} "
                      f"for vstor disk {name} ({sock})",
                      hint=f"two writers would corrupt it: if domain {domain} does not run, vstor release "
                           f"{domain} stops it; otherwise make both readonly or stop the other")

