"""What the e2e test modules share: vstor's config and hook installed in
the session's libvirtd (under WORK), vstor's CLI run as a user runs it,
the annotated test guest, and the checks that a domain left nothing
behind.  A test module imports from here (or guest.py, libvirtd.py,
migration_lab.py), never from another test module; the fixtures are in
conftest.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import libvirt
import pytest
from lxml import etree

from vstor.cli.hooks import render_hook

from .guest import domain_xml, parse_console
from .libvirtd import URI, read_console

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "xml-templates" / "qsd-file.xml"
WORK = Path("/run/vstor-e2e")
SIZE = 1 << 20


def hooked(libvirt_daemons, housekeeping: str):
    """vstor's config under WORK with these housekeeping cores, and its hook
    installed; WORK removed afterwards."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    WORK.chmod(0o755)
    conf = WORK / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {WORK}/state\nvhost_dir = {WORK}/vhost\nqsd_dir = {WORK}/qsd\nimages = {WORK}\n"
                    f"[cpu]\nhousekeeping = {housekeeping}\nreactors =\n")
    libvirt_daemons.install_hook("vstor", render_hook(str(conf)))
    yield conf
    shutil.rmtree(WORK, ignore_errors=True)


def vstor(conf, *args, code=0):
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(conf), *args],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == code, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


def annotated(name: str, guest, disk_path: str, guest_job: str, workdir: Path = WORK) -> str:
    """xml-templates/qsd-file.xml, made bootable here: the test guest's kernel
    and initrd under TCG, a console log, the given backing file."""
    base = etree.fromstring(domain_xml(name, guest, guest_job, memory_backing=None,
                                       console_log=workdir / f"{name}.console"))
    tpl = etree.fromstring(TEMPLATE.read_bytes())
    tpl.set("type", "qemu")
    tpl.find("name").text = name
    tpl.find("memory").text, tpl.find("memory").attrib["unit"] = "256", "MiB"
    for tag in ("os", "features", "devices"):
        old = tpl.find(tag)
        if old is not None:
            tpl.remove(old)
        tpl.append(base.find(tag))
    for tag in ("on_poweroff", "on_reboot", "on_crash"):
        tpl.append(base.find(tag))
    ns = {"vstor": "https://vstor.dev/xmlns/domain/1"}
    tpl.find(".//vstor:file", ns).set("path", disk_path)
    return etree.tostring(tpl, encoding="unicode")


def backing(name: str) -> str:
    path = WORK / f"{name}.raw"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    return str(path)


def define(conf, xml: str, name: str) -> None:
    conn = libvirt.open(URI)
    cleanup(conn, name)          # a leftover of an interrupted run
    conn.close()
    path = WORK / f"{name}.xml"
    path.write_text(xml)
    vstor(conf, "define", str(path))


def wait_for_marker(console: Path, marker: str, dom, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parsed = parse_console(read_console(console))
        if parsed["fail"]:
            pytest.fail(f"guest failed: {parsed['fail']}")
        if marker == "DONE" and parsed["done"]:
            return parsed
        if marker != "DONE" and any(m.startswith(marker) for m in parsed["markers"]):
            return parsed
        if not dom.isActive():
            break
        time.sleep(0.5)
    pytest.fail(f"no {marker} from the guest; console:\n{read_console(console)[-2000:]}")


def stop(dom) -> None:
    """Destroy it if the guest has not powered off by itself yet."""
    try:
        dom.destroy()
    except libvirt.libvirtError:
        if dom.isActive():
            raise


def nothing_left(name: str) -> None:
    record = WORK / "state" / "domains" / f"{name}.json"
    deadline = time.monotonic() + 15       # libvirt runs `release end` just after QEMU exits
    while record.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not record.exists()
    assert not [p for p in (WORK / "vhost").glob(f"{name}-*")]
    assert not (WORK / "vhost" / f"{name}.vstor-prepared").exists()     # the prepared mark
    assert not [p for p in (WORK / "qsd").glob(f"{name}-*")]
    ps = subprocess.run(["pgrep", "-f", f"{WORK}/qsd/{name}-"], capture_output=True)
    assert ps.returncode == 1, "a qemu-storage-daemon of the domain is still running"


def cleanup(conn, name):
    try:
        dom = conn.lookupByName(name)
    except libvirt.libvirtError:
        return
    if dom.isActive():
        dom.destroy()
    dom.undefine()


def daemons(name: str) -> list[str]:
    """The pid files of the domain's running qemu-storage-daemons."""
    ps = subprocess.run(["pgrep", "-af", f"{WORK}/qsd/{name}-"], capture_output=True, text=True)
    return sorted(line.split("--pidfile", 1)[-1].split()[0] for line in ps.stdout.splitlines()
                  if "--pidfile" in line)
