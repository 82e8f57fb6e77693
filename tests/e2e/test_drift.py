"""Drift found and repaired (issue 32), with a real libvirtd, QEMU (TCG) and
qemu-storage-daemon: one running domain, with an I/O thread, is moved off
its plan four ways at once (`virsh vcpupin`, `virsh emulatorpin`, `virsh
iothreadpin`, `taskset -p` on one daemon thread); `vstor status` names each
(exit 1); `vstor repair --dry-run` changes nothing; `vstor repair` puts
each back, as libvirt and the kernel (/proc) then say; a second repair
changes nothing; `vstor repair --undo` puts each injected pin back, and a
repair fixes them again.  One domain start for it all: this machine has 2 cores."""
from __future__ import annotations

import json
import os
import subprocess

import libvirt
from lxml import etree

from vstor.cpulist import format_cpulist, parse_cpulist

from .guest import job
from .helpers import SIZE, WORK, annotated, backing, cleanup, define, nothing_left, stop, vstor, wait_for_marker
from .libvirtd import URI

NAME = "e2e-drift"
LIVE = libvirt.VIR_DOMAIN_AFFECT_LIVE


def cores(cpumap) -> set[int]:
    return {i for i, on in enumerate(cpumap) if on}


def allowed(pid: int, tid: int) -> set[int]:
    """The thread's affinity as the kernel shows it."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    return set(parse_cpulist(line.split(":", 1)[1].strip()))


def virsh(*args: str) -> None:
    subprocess.run(["virsh", "-q", "-c", URI, *args], check=True, capture_output=True, text=True)


def test_drift_is_reported_repaired_and_a_second_repair_changes_nothing(vstor_env, libvirt_conn, guest_image):
    xml = etree.fromstring(annotated(NAME, guest_image, backing(NAME),
                                     job("write-verify", "vda", 31, SIZE, hold=600)))
    xml.find("vcpu").addnext(etree.fromstring("<iothreads>1</iothreads>"))
    try:
        define(vstor_env, etree.tostring(xml, encoding="unicode"), NAME)
        dom = libvirt_conn.lookupByName(NAME)
        dom.create()
        wait_for_marker(WORK / f"{NAME}.console", "HOLD", dom)
        vcpu, emulator = cores(dom.vcpuPinInfo(LIVE)[0]), cores(dom.emulatorPinInfo(LIVE))
        [(iothread, iocores)] = [(i, cores(m)) for i, m in dom.ioThreadInfo(LIVE)]
        assert iocores == emulator, "the I/O thread is not on the emulator's cores (iothreadpin)"
        status = json.loads(vstor(vstor_env, "status", "--json", NAME))[0]
        assert status["drift"] == [] and status["problem"] is None, status
        pid = int((WORK / "qsd" / f"{NAME}-vdb.pid").read_text())
        planned = allowed(pid, pid)
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        tid = next((t for t in tids if t != pid), pid)
        host = set(range(os.cpu_count()))
        other = sorted(host - vcpu) or sorted(host)
        elsewhere = sorted(host - planned) or sorted(host)

        # -- four ways off the plan -------------------------------------------------------
        virsh("vcpupin", NAME, "0", format_cpulist(other), "--live")
        virsh("emulatorpin", NAME, format_cpulist(host), "--live")
        virsh("iothreadpin", NAME, str(iothread), format_cpulist(other), "--live")
        subprocess.run(["taskset", "-p", "-c", format_cpulist(elsewhere), str(tid)], check=True,
                       capture_output=True)
        moved = {"vcpu": cores(dom.vcpuPinInfo(LIVE)[0]), "emulator": cores(dom.emulatorPinInfo(LIVE)),
                 "daemon": allowed(pid, tid)}
        wrong = {"vcpu", "emulator", "daemon"} if emulator != host else {"vcpu", "daemon"}
        wrong |= {"iothread"} if set(other) != emulator else set()

        out = vstor(vstor_env, "status", NAME, code=1)
        print(out)
        assert f"PROBLEM: vCPU 0 runs on CPUs {format_cpulist(other)}, the plan pins it to " \
               f"{format_cpulist(vcpu)} (fix: vstor repair {NAME})" in out, out
        assert f"qemu-storage-daemon {NAME}-vdb (pid {pid}): 1 thread (thread {tid}: CPUs " \
               f"{format_cpulist(elsewhere)})" in out, out
        found = json.loads(vstor(vstor_env, "status", "--json", NAME, code=1))[0]["drift"]
        assert {d["what"] for d in found} == wrong and all(d["repairable"] for d in found), found

        # -- a dry run prints each change and makes none ---------------------------------------
        out = vstor(vstor_env, "repair", "--dry-run", NAME)
        print(out)
        assert out.count("would pin") == len(wrong), out
        assert f"virsh vcpupin {NAME} 0 {format_cpulist(vcpu)} --live" in out, out
        assert cores(dom.vcpuPinInfo(LIVE)[0]) == moved["vcpu"] and allowed(pid, tid) == moved["daemon"]
        assert cores(dom.emulatorPinInfo(LIVE)) == moved["emulator"]

        # -- repaired, as libvirt and the kernel say ----------------------------------------------
        out = vstor(vstor_env, "repair", NAME)
        print(out)
        assert f"{len(wrong)} difference" in out and "repaired" in out, out
        assert cores(dom.vcpuPinInfo(LIVE)[0]) == vcpu
        assert cores(dom.emulatorPinInfo(LIVE)) == emulator
        assert [cores(m) for _, m in dom.ioThreadInfo(LIVE)] == [emulator]
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                assert allowed(pid, int(t)) == planned, t
            except FileNotFoundError:
                pass        # a worker thread that ended
        status = json.loads(vstor(vstor_env, "status", "--json", NAME))[0]
        assert status["drift"] == [] and status["problem"] is None, status
        assert status["repair"]["status"] == "done", status     # journaled: what it found, for --undo

        # -- a second repair changes nothing --------------------------------------------------------
        out = vstor(vstor_env, "repair", NAME)
        assert "nothing to repair" in out, out

        # -- undone: each pin as it was injected; then repaired again ---------------------------
        out = vstor(vstor_env, "repair", NAME, "--undo")
        print(out)
        assert "its last repair undone" in out, out
        assert cores(dom.vcpuPinInfo(LIVE)[0]) == moved["vcpu"] and allowed(pid, tid) == moved["daemon"]
        assert cores(dom.emulatorPinInfo(LIVE)) == moved["emulator"]
        assert [cores(m) for _, m in dom.ioThreadInfo(LIVE)] == [set(other) if "iothread" in wrong else emulator]
        vstor(vstor_env, "repair", NAME, "--undo", code=2)      # nothing left to undo
        out = vstor(vstor_env, "repair", NAME)
        assert f"{len(wrong)} difference" in out, out
        assert cores(dom.vcpuPinInfo(LIVE)[0]) == vcpu and allowed(pid, tid) == planned
        assert cores(dom.emulatorPinInfo(LIVE)) == emulator
        stop(dom)
        nothing_left(NAME)
    finally:
        cleanup(libvirt_conn, NAME)
