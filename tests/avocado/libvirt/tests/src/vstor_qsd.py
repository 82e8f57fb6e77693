"""vstor.lab.qsd: the embedded default, no hardware. A raw file behind
qemu-storage-daemon as vhost-user-blk (xml-templates/qsd-file.xml): the guest
writes and reads back a pattern, the file holds it, the domain and its daemon
are on the planned node, and vstor holds nothing once the domain stopped."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestFail  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-qsd"


def run(test, params, env):
    lab = open_lab(params)
    ready(lab)
    seed, size = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 1 << 20)
    disk = guestrun.backing_file(lab, NAME)
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block({"cpus": "dedicated"}, [guestrun.file_disk("vdb", disk)]),
        tiny.job("write-verify", "vda", seed, size, timeout=lab.number("vstor_guest_timeout", 240),
                 hold=lab.number("vstor_guest_hold", 10)))
    try:
        dom.define()
        dom.start()
        dom.wait("HOLD")
        (held,) = [r for r in lab.vstor.json("status") if r["domain"] == NAME]
        problems = [s for s in held["steps"] if s["problem"]]
        if problems or held["libvirt"] != "running":
            raise TestFail(f"vstor status: {held['libvirt']}, problems {problems}")
        (sock,) = held["holding"]["sockets"]
        daemon = hostdev.storage_daemon(sock)
        place = numa.check(dom)
        numa.threads_within(daemon, set(place.emulator), "qemu-storage-daemon")

        guestrun.check_guest_io(dom.wait("DONE"), "vda", seed, size)
        dom.wait_off()
        dom.wait_released()
        hostdev.holds_pattern(disk, tiny.expected_pattern(seed, size))
        hostdev.wait_gone(daemon, sock, "the domain stopped")
    finally:
        dom.clean_up()
        disk.unlink(missing_ok=True)
