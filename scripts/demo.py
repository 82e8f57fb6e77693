"""The main job, end to end on this machine:

1. start virtlogd and libvirtd if they are not running (with vstor's hook),
2. `vstor define` an annotated domain (xml-templates/qsd-file.xml, made
   bootable here with a tiny guest built from Debian's kernel and busybox),
   and show the <disk type='vhostuser'> vstor rendered (target vdb in the XML;
   the guest's kernel calls its first virtio disk vda),
3. start it: the hook starts a qemu-storage-daemon for its vhost-user-blk disk,
4. the guest writes a known pattern to the disk and reads it back,
5. `vstor status` and the daemon's pid and socket while it runs, then the
   host checks the bytes in the file,
6. destroy: the hook releases; everything is cleaned up.

With --installed it runs the installed package instead of this checkout:
/usr/bin/vstor with /etc/vstor/vstor.conf, and the hook the package put in
/etc/libvirt/hooks/qemu.d (none is installed here; libvirtd must start
after it, as the package step in CI does: scripts/ci-package.sh, which
holds the e2e session lock around install, demo and purge and says so
with VSTOR_E2E_LOCK_HELD=1).  The disk image then lies in libvirt's own
image directory, an image root of vstor's default configuration.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import libvirt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.guest import build_guest, expected_pattern, job, parse_console  # noqa: E402
from tests.e2e.libvirtd import Daemons, read_console                        # noqa: E402
from tests.e2e.helpers import annotated                                      # noqa: E402

WORK = Path("/run/vstor-demo")
NAME, SEED, SIZE = "vstor-demo", 2026, 1 << 20
INSTALLED = "--installed" in sys.argv[1:]
PACKAGED_HOOK = Path("/etc/libvirt/hooks/qemu.d/vstor")
# The checkout's vstor with the demo's own config, or the installed package with its own.
VSTOR = ["/usr/bin/vstor"] if INSTALLED else [sys.executable, "-m", "vstor.cli.main", "--config",
                                             str(WORK / "vstor.conf")]
RUN = Path("/run/vstor") if INSTALLED else WORK      # state_dir, qsd_dir: the config's
DISK = Path("/var/lib/libvirt/images/vstor-demo.raw") if INSTALLED else WORK / "data.raw"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def vstor(*args: str) -> None:
    print("$ vstor " + " ".join(args), flush=True)
    subprocess.run([*VSTOR, *args], check=True, cwd="/" if INSTALLED else ROOT)


def show_disk(domain_xml: str) -> None:
    from lxml import etree
    for disk in etree.fromstring(domain_xml).iterfind("devices/disk[@type='vhostuser']"):
        disk.tail = None
        etree.indent(disk, "  ")
        for line in etree.tostring(disk, encoding="unicode").splitlines():
            print(f"  {line}")


def show_daemon(pidfile: Path) -> None:
    pid = pidfile.read_text().strip()
    args = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
    # vstor opened the image and bound the socket itself; the daemon was
    # handed both descriptors, so its command line names neither path.
    opts = dict(o.split("=", 1) for a in args for o in a.decode().split(",") if "=" in o)
    src_fd, sock_fd = opts.get("filename", "?").rsplit("/", 1)[-1], opts.get("addr.str", "?")
    source = os.readlink(f"/proc/{pid}/fd/{src_fd}")
    inode = str(os.stat(f"/proc/{pid}/fd/{sock_fd}").st_ino)
    socket = next((line.split()[7] for line in open(f"/proc/{pid}/net/unix").read().splitlines()[1:]
                   if len(line.split()) == 8 and line.split()[6] == inode), "?")
    print(f"  pid {pid}: {args[0].decode()} serving {source} (fd {src_fd}) on {socket} (fd {sock_fd}),"
          " both opened by vstor and handed over")


def wait_for(console: Path, ready, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    parsed = parse_console(read_console(console))
    while not ready(parsed) and not parsed["fail"] and time.monotonic() < deadline:
        time.sleep(0.3)
        parsed = parse_console(read_console(console))
    return parsed


def main() -> int:
    if os.geteuid() != 0:
        print("demo: run as root (it starts libvirtd and installs a hook)", file=sys.stderr)
        return 2
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    WORK.chmod(0o755)
    (WORK / "vstor.conf").write_text(f"[paths]\nstate_dir = {WORK}/state\nvhost_dir = {WORK}/vhost\n"
                                     f"qsd_dir = {WORK}/qsd\nimages = {WORK}\n")
    say("building the tiny test guest (Debian kernel + busybox; cached)")
    guest = build_guest()
    libvirt.registerErrorHandler(lambda *_: None, None)   # errors are handled here
    if INSTALLED:
        say(f"starting virtlogd/libvirtd if needed; the package's hook is {PACKAGED_HOOK}")
        if not os.access(PACKAGED_HOOK, os.X_OK):
            print(f"demo: {PACKAGED_HOOK} is missing or not executable: is vstor installed?",
                  file=sys.stderr)
            return 1
        daemons = Daemons().start()     # under ci-package.sh, on its session lock (VSTOR_E2E_LOCK_HELD)
        if not daemons.owns_libvirtd():
            print("demo: libvirtd ran before the package's hook was installed and only sees hooks "
                  "present at its start: stop it first", file=sys.stderr)
            daemons.stop()
            return 1
    else:
        say("starting virtlogd/libvirtd if needed, with vstor's hook")
        from vstor.cli.hooks import render_hook
        daemons = Daemons().start()
    conn = None
    try:
        if not INSTALLED:
            daemons.install_hook("vstor", render_hook(str(WORK / "vstor.conf")))
        conn = daemons.connect()
        disk = DISK
        with open(disk, "wb") as f:
            f.truncate(64 << 20)
        xml = WORK / "demo.xml"
        xml.write_text(annotated(NAME, guest, str(disk), job("write-verify", "vda", SEED, SIZE, hold=5),
                                 workdir=WORK))
        say("what vstor decides for the annotated domain")
        vstor("plan", str(xml))
        say("rendering and defining it")
        vstor("define", str(xml))
        say("the disk vstor rendered into the domain (a vhost-user-blk socket, no image path)")
        show_disk(conn.lookupByName(NAME).XMLDesc(0))
        say("starting it (the hook starts a qemu-storage-daemon first)")
        dom = conn.lookupByName(NAME)
        dom.create()
        console = WORK / f"{NAME}.console"
        wait_for(console, lambda p: any(m.startswith("HOLD") for m in p["markers"]))
        say("vstor status while the domain runs (the guest sees its disk and waits)")
        vstor("status")
        say("the qemu-storage-daemon serving that socket")
        show_daemon(RUN / "qsd" / f"{NAME}-vdb.pid")
        parsed = wait_for(console, lambda p: p["done"])
        say("the guest's console (vstor's target vdb is a name in the domain XML; the guest's "
            "kernel names its first virtio disk vda)")
        for marker in parsed["markers"]:
            print(f"  guest: {marker}")
        if not parsed["done"] or parsed["wrote"] != parsed["read"]:
            print("demo: the guest did not write and read back its disk", file=sys.stderr)
            return 1
        with open(disk, "rb") as f:
            ok = f.read(SIZE) == expected_pattern(SEED, SIZE)
        say(f"host check: the backing file holds the guest's pattern: {'yes' if ok else 'NO'}")
        say("stopping it (the hook stops the daemon and removes the socket)")
        if dom.isActive():
            try:
                dom.destroy()
            except libvirt.libvirtError:
                pass        # it powered off by itself in the meantime
        deadline = time.monotonic() + 15
        while (RUN / "state" / "domains" / f"{NAME}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        vstor("status")
        return 0 if ok else 1
    finally:
        say("cleaning up")
        if conn is not None:
            try:
                d = conn.lookupByName(NAME)
                if d.isActive():
                    d.destroy()
                d.undefine()
            except Exception:
                pass
        daemons.stop()
        shutil.rmtree(WORK, ignore_errors=True)
        if INSTALLED:
            DISK.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
