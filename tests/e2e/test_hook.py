"""vstor's hook end to end: a real libvirtd runs hooks/vstor, real QEMU (TCG)
boots the test guest, real qemu-storage-daemons serve its disks, and the
guest's writes must land where vstor says they do."""
from __future__ import annotations

import json
import os
import threading

import libvirt
import pytest
from lxml import etree

from .guest import domain_xml, expected_pattern, job, parse_console
from .helpers import SIZE, WORK, annotated, backing, cleanup, define, nothing_left, stop, vstor, wait_for_marker
from .libvirtd import read_console, wait_shutoff


# -- the embedded default ------------------------------------------------------------------

def test_qsd_domain_from_the_template_writes_through_vhost_user(vstor_env, libvirt_conn, guest_image):
    name, disk = "e2e-qsd", backing("e2e-qsd")
    try:
        define(vstor_env, annotated(name, guest_image, disk, job("write-verify", "vda", 4242, SIZE, hold=3)), name)
        dom = libvirt_conn.lookupByName(name)
        assert "vhostuser" in dom.XMLDesc(0)
        dom.create()
        console = WORK / f"{name}.console"
        wait_for_marker(console, "HOLD", dom)          # the guest sees its disk and waits
        status = json.loads(vstor(vstor_env, "status", "--json", name))
        assert status[0]["status"] == "prepared"
        assert all(s["problem"] is None for s in status[0]["steps"])
        parsed = wait_for_marker(console, "DONE", dom)
        assert parsed["wrote"] == parsed["read"] and parsed["wrote"]
        with open(disk, "rb") as f:
            assert f.read(SIZE) == expected_pattern(4242, SIZE)     # the guest's bytes, in the file
        stop(dom)                                                   # the hook releases
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def test_a_missing_backing_file_fails_the_start_with_vstors_reason(vstor_env, libvirt_conn, guest_image):
    name = "e2e-missing"
    try:
        define(vstor_env, annotated(name, guest_image, str(WORK / "absent.raw"), job("read", "vda")), name)
        with pytest.raises(libvirt.libvirtError) as e:
            libvirt_conn.lookupByName(name).create()
        assert "vstor:" in str(e.value) and "absent.raw" in str(e.value)
        assert not libvirt_conn.lookupByName(name).isActive()
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def test_a_start_vstors_hook_did_not_prepare_fails_at_once_naming_vstor(vstor_env, libvirt_daemons, libvirt_conn,
                                                                         guest_image):
    """Issue 30: without vstor's prepare (the package removed, the hook gone,
    libvirt never ran it) QEMU 7.2 would wait for the vhost-user socket for
    ever (its chardev's reconnect retries the first connect).  vstor's fw_cfg
    entry makes QEMU read the prepared mark before it creates any device:
    the start fails at once, and the error names vstor."""
    import time
    from vstor.cli.hooks import render_hook
    name = "e2e-nohook"
    try:
        define(vstor_env, annotated(name, guest_image, backing(name), job("read", "vda")), name)
        xml = libvirt_conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        mark = WORK / "vhost" / f"{name}.vstor-prepared"
        entries = etree.fromstring(xml.encode()).findall("sysinfo[@type='fwcfg']/entry")
        assert [(e.get("name"), e.get("file")) for e in entries] == [("opt/dev.vstor/prepared", str(mark))]
        libvirt_daemons.install_hook("vstor", "#!/bin/sh\nexit 0\n")     # libvirt runs no vstor
        began = time.monotonic()
        with pytest.raises(libvirt.libvirtError) as e:
            libvirt_conn.lookupByName(name).create()
        took = time.monotonic() - began
        assert took < 30, took
        # libvirt's DAC driver, which hands the file to QEMU's user, finds it
        # missing first (QEMU's own error names the fw_cfg entry too).
        assert str(mark) in str(e.value) and "No such file or directory" in str(e.value), str(e.value)
        print(f"a start without vstor's prepare failed after {took:.2f} s: {e.value}")
        assert not libvirt_conn.lookupByName(name).isActive()
    finally:
        libvirt_daemons.install_hook("vstor", render_hook(str(vstor_env)))
        cleanup(libvirt_conn, name)
    assert not (WORK / "vhost" / f"{name}.vstor-prepared").exists()


def test_two_domains_started_at_once_get_distinct_cores_and_sockets(vstor_env, libvirt_conn, guest_image):
    names = ["e2e-a", "e2e-b"]
    try:
        for i, name in enumerate(names):
            define(vstor_env, annotated(name, guest_image, backing(name),
                                        job("write-verify", "vda", 100 + i, SIZE)), name)
        doms = [libvirt_conn.lookupByName(n) for n in names]
        errors = []

        def start(d):
            try:
                d.create()
            except libvirt.libvirtError as e:
                errors.append(str(e))
        threads = [threading.Thread(target=start, args=(d,)) for d in doms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        pins, sockets = [], []
        for d in doms:
            live = etree.fromstring(d.XMLDesc(0))
            pins.append({p.get("cpuset") for p in live.findall("cputune/vcpupin")})
            sockets.append(live.find("devices/disk[@type='vhostuser']/source").get("path"))
        assert not pins[0] & pins[1] and sockets[0] != sockets[1]
        for i, (name, d) in enumerate(zip(names, doms)):
            parsed = wait_for_marker(WORK / f"{name}.console", "DONE", d)
            assert parsed["wrote"] == parsed["read"]
            with open(WORK / f"{name}.raw", "rb") as f:
                assert f.read(SIZE) == expected_pattern(100 + i, SIZE)
        for name, d in zip(names, doms):
            stop(d)
            nothing_left(name)
    finally:
        for name in names:
            cleanup(libvirt_conn, name)


def test_libvirtd_restart_reconnects_and_repairs_then_destroy_cleans_up(vstor_env, libvirt_daemons,
                                                                        libvirt_conn, guest_image):
    if not libvirt_daemons.owns_libvirtd():
        pytest.skip("libvirtd was started outside the tests: not restarting it")
    name = "e2e-reconnect"
    try:
        define(vstor_env, annotated(name, guest_image, backing(name),
                                    job("write-verify", "vda", 7, SIZE, hold=25)), name)
        libvirt_conn.lookupByName(name).create()
        console = WORK / f"{name}.console"
        wait_for_marker(console, "HOLD", libvirt_conn.lookupByName(name))
        pid = int((WORK / "qsd" / f"{name}-vdb.pid").read_text())
        os.kill(pid, 9)                           # the backend dies while the domain runs
        libvirt_daemons.restart_libvirtd()        # ... and libvirtd restarts: `reconnect begin`
        dom = libvirt_conn.lookupByName(name)
        assert dom.isActive()
        # libvirtd runs `reconnect` hooks in a thread after it answers again: wait for it
        import time
        deadline = time.monotonic() + 30
        while True:
            status = json.loads(vstor(vstor_env, "status", "--json", name))
            if all(s["problem"] is None for s in status[0]["steps"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert all(s["problem"] is None for s in status[0]["steps"]), status
        assert int((WORK / "qsd" / f"{name}-vdb.pid").read_text()) != pid
        # the guest's I/O, after its hold, goes through the repaired backend
        parsed = wait_for_marker(console, "DONE", dom)
        assert parsed["wrote"] == parsed["read"]
        with open(WORK / f"{name}.raw", "rb") as f:
            assert f.read(SIZE) == expected_pattern(7, SIZE)
        stop(dom)
        nothing_left(name)
    finally:
        cleanup(libvirt_conn, name)


def test_a_domain_without_vstor_metadata_passes_through(vstor_env, libvirt_conn, guest_image):
    name = "e2e-plain"
    try:
        libvirt_conn.defineXML(domain_xml(name, guest_image, job("read", "vda", timeout=1),
                                          memory_backing=None, console_log=WORK / f"{name}.console"))
        dom = libvirt_conn.lookupByName(name)
        dom.create()                 # the hook ran prepare and let it through
        wait_shutoff(dom, 120)
        assert parse_console(read_console(WORK / f"{name}.console"))["markers"], "the guest never booted"
        assert not (WORK / "state" / "domains" / f"{name}.json").exists()
    finally:
        cleanup(libvirt_conn, name)
