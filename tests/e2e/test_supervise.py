"""A qemu-storage-daemon killed under a running guest is started again by
vstor's supervisor (vstor.runtime.supervise), QEMU reconnects, and the
guest's fsync'd write-and-verify rounds go on: 20 kills in a row, each
resumed within 10 s, and every round the guest read back verified."""
from __future__ import annotations

import json
import os
import re
import statistics
import time

from .guest import loop_expected, loop_job, parse_loop, stop_loop
from .helpers import WORK, annotated, backing, cleanup, define, nothing_left, stop
from .libvirtd import read_console

NAME = "e2e-sup"
SEED = 4242
REGION = 32 << 10
KILLS = 20
RESUME = 10.0           # the bound on each resume (issue 30)
SPACING = 3.0           # between a resume and the next kill: within the supervisor's 5 restarts per 10 s
RECORD = re.compile(rb"vstor seed=%d n=(\d+)" % SEED)


def written(path: str) -> int:
    """The highest round whose fsync'd record reached the disk file."""
    with open(path, "rb") as f:
        return max((int(n) for n in RECORD.findall(f.read(REGION))), default=0)


def test_a_killed_daemon_is_started_again_and_the_guest_goes_on(vstor_env, libvirt_conn, guest_image):
    disk = backing(NAME)
    pidfile = WORK / "qsd" / f"{NAME}-vdb.pid"
    console = WORK / f"{NAME}.console"
    try:
        define(vstor_env, annotated(NAME, guest_image, disk, loop_job("vda", SEED, REGION, timeout=900)), NAME)
        dom = libvirt_conn.lookupByName(NAME)
        dom.create()
        deadline = time.monotonic() + 180
        while written(disk) < 20:
            assert time.monotonic() < deadline and dom.isActive(), read_console(console)[-2000:]
            time.sleep(0.2)
        resumed = []
        for kill in range(KILLS):
            pid = int(pidfile.read_text())
            before = written(disk)
            t0 = time.monotonic()
            os.kill(pid, 9)
            # One record may have been in flight at the kill: two more mean the rounds go on.
            while written(disk) < before + 2:
                assert time.monotonic() - t0 < RESUME, \
                    f"kill {kill + 1}: no round reached the disk within {RESUME:g}s; " \
                    f"console:\n{read_console(console)[-2000:]}"
                time.sleep(0.02)
            resumed.append(time.monotonic() - t0)
            assert int(pidfile.read_text()) != pid
            time.sleep(SPACING)
        stop_loop(disk, REGION)         # the guest verifies its region and powers off
        deadline = time.monotonic() + 120
        while dom.isActive() and time.monotonic() < deadline:
            time.sleep(0.5)
        loop = parse_loop(read_console(console))
        assert loop["done"] and not loop["fail"], read_console(console)[-3000:]
        assert loop["wrote"] == loop["read"]
        with open(disk, "rb") as f:
            assert f.read(REGION) == loop_expected(SEED, REGION, loop["rounds"])
        figures = {"kills": KILLS, "median_s": round(statistics.median(resumed), 3),
                   "max_s": round(max(resumed), 3), "rounds": loop["rounds"]}
        print(f"supervised restarts: {json.dumps(figures)}")
        stop(dom)
        nothing_left(NAME)
    finally:
        cleanup(libvirt_conn, NAME)
