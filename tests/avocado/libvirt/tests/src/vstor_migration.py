"""vstor.lab.migration: a live migration to a second vstor host. The guest
writes without pause (its disk a qsd file and its console log on storage
both hosts see); `vstor migrate check` says it can move, `vstor migrate
prepare` has the destination make its backend and writes the XML it arrives
with, `virsh migrate --live` moves it, `vstor migrate finish` releases the
source. The guest goes on writing on the destination, on the destination's
planned node (its libvirt's answers); then it reads everything back and the
shared file holds exactly what it wrote; the source holds nothing."""
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestFail  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.cli import Virsh  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-migrate"


def rounds(dom, at_least: int, timeout: float = 120) -> int:
    """The guest's loop rounds once at least `at_least` were written."""
    deadline = time.monotonic() + timeout
    while True:
        parsed = tiny.parse_loop(guestrun.read_console(dom.console))
        if parsed["fail"]:
            raise TestFail(f"the guest failed: {parsed['fail']}")
        if parsed["progress"] and parsed["progress"][-1][0] >= at_least:
            return parsed["progress"][-1][0]
        if time.monotonic() > deadline:
            raise TestFail(f"the guest wrote fewer than {at_least} rounds in {timeout:.0f}s")
        time.sleep(0.5)


def run(test, params, env):
    lab = open_lab(params)
    dest = lab.need("vstor_dest", "the lab names no second vstor host to migrate to")
    shared = Path(lab.need("vstor_shared_dir", "the lab names no storage both hosts see"))
    ready(lab)
    dest_uri = lab.get("vstor_dest_uri") or f"qemu+ssh://{dest}/system"
    seed, region = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 32 << 10)
    lab = replace(lab, image_dir=shared)
    disk = guestrun.backing_file(lab, NAME)
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block({"cpus": "dedicated"}, [guestrun.file_disk("vdb", disk)]),
        tiny.loop_job("vda", seed, region, timeout=lab.number("vstor_migrate_timeout", 300) + 120),
        console=shared / f"{NAME}.console")
    there = guestrun.GuestDomain.existing(replace(lab, virsh=Virsh(dest_uri)), NAME, dom.console)
    arrival = lab.workdir / f"{NAME}.{dest}.xml"
    try:
        there.forget(released=False)
        dom.define()
        dom.start()
        before = rounds(dom, 20)
        lab.vstor("migrate", "check", NAME, "--to", dest)
        lab.vstor("migrate", "prepare", NAME, "--to", dest, "-o", str(arrival),
                  *(["--dest-uri", lab.get("vstor_dest_uri")] if lab.get("vstor_dest_uri") else []))
        migrate_uri = lab.get("vstor_migrate_uri")
        lab.virsh("migrate", "--live", "--persistent", "--undefinesource", "--persistent-xml",
                  str(arrival), "--xml", str(arrival), NAME, dest_uri,
                  *(["--migrateuri", migrate_uri] if migrate_uri else []),
                  timeout=lab.number("vstor_migrate_timeout", 300))
        lab.vstor("migrate", "finish", NAME, "--to", dest)
        if lab.virsh("domstate", NAME, codes=None).strip() not in ("", "shut off"):
            raise TestFail(f"{NAME} still runs here after the migration")
        dom.wait_released()
        rounds(dom, before + 20)           # it goes on writing there
        numa.check(there, kernel=False)

        tiny.stop_loop(disk, region)
        parsed = there.wait("DONE")
        if not parsed["wrote"] or parsed["wrote"] != parsed["read"]:
            raise TestFail(f"the guest wrote {parsed['wrote']}, read back {parsed['read']}")
        rounds_done = tiny.parse_loop(guestrun.read_console(dom.console))["rounds"]
        hostdev.holds_pattern(disk, tiny.loop_expected(seed, region, rounds_done))
    finally:
        there.clean_up(released=False)
        dom.clean_up()
        disk.unlink(missing_ok=True)
