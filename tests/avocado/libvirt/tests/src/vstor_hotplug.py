"""vstor.lab.hotplug: no hardware. `vstor attach` gives the running guest a
second qsd disk; the guest sees it, writes and reads it back, and the file
holds the bytes; `vstor detach` unplugs it while the guest waits for it to go,
and its daemon and socket go with it. The first disk is untouched throughout."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestFail  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-hotplug"


def sockets(dom):
    return [s.get("path") for s in dom.live_xml().iterfind("devices/disk[@type='vhostuser']/source")]


def run(test, params, env):
    lab = open_lab(params)
    ready(lab)
    seed, size = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 1 << 20)
    first, added = guestrun.backing_file(lab, NAME), guestrun.backing_file(lab, f"{NAME}-vdc")
    # The guest waits for vda (vstor's vdb, there from the start), then for
    # vdb (vstor's vdc, hot-plugged), holds, writes and reads both, and then
    # waits for its vdb to be unplugged. It powers off the moment it sees the
    # device go, while vstor detach still has the backend to release and the
    # domain's metadata to set: on_poweroff=restart (a reset in the same QEMU)
    # keeps the domain running for that. The rebooted guest waits for the
    # unplugged vdb and writes nothing.
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block({"cpus": "dedicated"}, [guestrun.file_disk("vdb", first)]),
        tiny.job("write-verify", "vda,vdb", seed, size, timeout=lab.number("vstor_guest_timeout", 240),
                 hold=lab.number("vstor_guest_hold", 10), unplug="vdb"),
        root_ports=2, on_poweroff="restart")
    snippet = lab.workdir / f"{NAME}-vdc.xml"
    try:
        dom.define()
        dom.start()
        dom.wait("READY dev=vda")
        (before,) = sockets(dom)
        snippet.write_text(guestrun.file_disk("vdc", added) + "\n")
        lab.vstor("attach", NAME, str(snippet))
        now = sockets(dom)
        if len(now) != 2 or now[0] != before:
            raise TestFail(f"after vstor attach the domain's vhost-user disks are {now}")
        dom.wait("HOLD")
        place = numa.check(dom)
        daemon = hostdev.storage_daemon(now[1])
        numa.threads_within(daemon, set(place.emulator), "the hot-plugged disk's qemu-storage-daemon")

        parsed = dom.wait("AWAIT-UNPLUG")
        for dev in ("vda", "vdb"):
            guestrun.check_guest_io(parsed, dev, seed, size)
        hostdev.holds_pattern(added, tiny.expected_pattern(seed, size))

        lab.vstor("detach", NAME, "vdc", "--timeout", str(lab.number("vstor_detach_timeout", 90)))
        dom.wait("DONE", timeout=60)            # after GONE dev=vdb
        if sockets(dom) != [before]:
            raise TestFail(f"after vstor detach the domain's vhost-user disks are {sockets(dom)}")
        hostdev.wait_gone(daemon, now[1], "vdc was detached")
        (held,) = [r for r in lab.vstor.json("status") if r["domain"] == NAME]
        if held["holding"]["sockets"] != [before]:
            raise TestFail(f"vstor still holds {held['holding']['sockets']} after the detach")

        dom.forget()
        hostdev.holds_pattern(first, tiny.expected_pattern(seed, size))
    finally:
        dom.clean_up()
        for f in (first, added, snippet):
            f.unlink(missing_ok=True)
