"""A guest in a vstor domain: defined through `vstor define`, started through
libvirt (vstor's hook prepares its storage), its job on the kernel command
line and its markers read from the serial console (tests/e2e/guest.py)."""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from xml.sax.saxutils import quoteattr

from avocado.core.exceptions import TestError, TestFail
from lxml import etree

from tests.e2e import guest as tiny

from .lab import Lab

NS = "https://vstor.dev/xmlns/domain/1"
LOG = logging.getLogger("avocado.test")


def vstor_block(vm: dict[str, str], disks: list[str]) -> str:
    """<vstor:vstor> with a <vstor:vm> of these attributes and these <vstor:disk> elements."""
    attrs = "".join(f" {k}={quoteattr(v)}" for k, v in vm.items())
    # Each disk's own xmlns:vstor (a disk snippet stands alone) is dropped
    # inside the block: libvirt's setMetadata, which vstor attach uses,
    # refuses an element that declares the prefix again.
    inner = "".join(d.replace(f" xmlns:vstor='{NS}'", "") for d in disks)
    return f"<vstor:vstor xmlns:vstor='{NS}'><vstor:vm{attrs}/>{inner}</vstor:vstor>"


def file_disk(target: str, path: Path, backend: str = "qsd") -> str:
    return (f"<vstor:disk xmlns:vstor='{NS}' target='{target}' backend='{backend}'>"
            f"<vstor:file path={quoteattr(str(path))}/></vstor:disk>")


def guest_image(lab: Lab) -> tiny.Guest:
    kernel, initrd = lab.get("vstor_guest_kernel"), lab.get("vstor_guest_initrd")
    if bool(kernel) != bool(initrd):
        raise TestError("give both vstor_guest_kernel and vstor_guest_initrd, or neither")
    if kernel:
        for p in (kernel, initrd):
            if not Path(p).is_file():
                raise TestError(f"guest file {p} does not exist")
        return tiny.Guest(Path(kernel), Path(initrd))
    return tiny.build_guest()


def backing_file(lab: Lab, name: str) -> Path:
    """A fresh sparse raw file of vstor_disk_size bytes in vstor_image_dir."""
    path = lab.image_dir / f"{name}.raw"
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(lab.number("vstor_disk_size", 64 << 20))
    return path


def check_guest_io(parsed: dict, dev: str, seed: int, size: int) -> None:
    """The guest read back from /dev/<dev> exactly the pattern it wrote."""
    want = hashlib.sha256(tiny.expected_pattern(seed, size)).hexdigest()
    got = parsed["devices"].get(dev, {})
    if got.get("wrote") != want or got.get("read") != want:
        raise TestFail(f"the guest's /dev/{dev}: wrote {got.get('wrote')}, read {got.get('read')}, "
                       f"the pattern is {want}")
    LOG.info("guest /dev/%s: wrote and read back %d bytes, sha256 %s", dev, size, want)


class GuestDomain:
    def __init__(self, lab: Lab, name: str, vstor_xml: str, job: str, *, cmdline_extra: str = "",
                 root_ports: int = 0, console: Path | None = None, on_poweroff: str = "destroy") -> None:
        self.lab, self.name = lab, name
        self.console = console or lab.workdir / f"{name}.console"
        self.xml = self._xml(vstor_xml, f"{job} {cmdline_extra}".strip(), root_ports) if job else ""
        if on_poweroff != "destroy":
            root = etree.fromstring(self.xml)
            root.find("on_poweroff").text = on_poweroff
            if on_poweroff == "restart":    # libvirt's QEMU driver refuses it with on_reboot destroy
                root.find("on_reboot").text = "restart"
            self.xml = etree.tostring(root, encoding="unicode")

    @classmethod
    def existing(cls, lab: Lab, name: str, console: Path | None = None) -> GuestDomain:
        """A domain that is already defined (e.g. on a migration's destination)."""
        return cls(lab, name, "", "", console=console)

    def _xml(self, vstor_xml: str, cmdline: str, root_ports: int) -> str:
        lab = self.lab
        text = tiny.domain_xml(self.name, guest_image(lab), cmdline, memory_backing=None,
                               memory_mib=lab.number("vstor_guest_memory_mib", 256),
                               vcpus=lab.number("vstor_guest_vcpus", 1), console_log=self.console)
        root = etree.fromstring(text)
        root.set("type", lab.virt_type)
        metadata = etree.Element("metadata")
        metadata.append(etree.fromstring(vstor_xml))
        root.find("vcpu").addnext(metadata)
        devices = root.find("devices")
        if root_ports:
            # q35 hot-plugs PCIe devices into free root ports only; libvirt
            # numbers controllers in order, and index 0 must be the pcie-root.
            etree.SubElement(devices, "controller", type="pci", index="0", model="pcie-root")
        for _ in range(root_ports):
            etree.SubElement(devices, "controller", type="pci", model="pcie-root-port")
        return etree.tostring(root, encoding="unicode")

    def define(self) -> None:
        self.forget()
        self.console.unlink(missing_ok=True)
        path = self.lab.workdir / f"{self.name}.xml"
        path.write_text(self.xml)
        said = self.lab.vstor("define", str(path)).stdout.strip()
        LOG.info("vstor define: %s", said)

    def start(self) -> None:
        self.lab.virsh("start", self.name)

    def active(self) -> bool:
        return self.lab.virsh("domstate", self.name).strip() in ("running", "paused", "in shutdown")

    def live_xml(self) -> etree._Element:
        return etree.fromstring(self.lab.virsh("dumpxml", self.name).encode())

    def qemu_pid(self) -> int:
        return int(Path(f"/run/libvirt/qemu/{self.name}.pid").read_text())

    def markers(self) -> dict:
        return tiny.parse_console(read_console(self.console))

    def wait(self, marker: str, timeout: float | None = None) -> dict:
        """The console's markers once `marker` ("DONE", or the start of any
        marker line) is there; TestFail on the guest's FAIL, its power-off
        without the marker, or the timeout."""
        timeout = timeout or self.lab.number("vstor_guest_timeout", 240)
        deadline = time.monotonic() + timeout
        while True:
            parsed = self.markers()
            if parsed["fail"]:
                raise TestFail(f"the guest in {self.name} failed: {parsed['fail']}")
            if (parsed["done"] if marker == "DONE" else
                    any(m.startswith(marker) for m in parsed["markers"])):
                LOG.info("guest %s: %s", self.name, parsed["markers"][-1])
                return parsed
            if time.monotonic() > deadline or not self.active():
                tail = read_console(self.console)[-1500:]
                raise TestFail(f"no '{marker}' from the guest in {self.name} within {timeout:.0f}s; "
                               f"console ends:\n{tail}")
            time.sleep(0.5)

    def wait_off(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.active():
            if time.monotonic() > deadline:
                raise TestFail(f"{self.name} still runs {timeout:.0f}s after its guest finished")
            time.sleep(0.3)

    def wait_released(self, timeout: float = 30) -> None:
        """vstor holds nothing for the domain any more (libvirt runs the hook's
        release just after QEMU exits)."""
        deadline = time.monotonic() + timeout
        while True:
            held = [r for r in self.lab.vstor.json("status") if r["domain"] == self.name]
            if not held:
                return
            if time.monotonic() > deadline:
                raise TestFail(f"vstor still holds {held[0]['holding']} for {self.name} "
                               f"{timeout:.0f}s after it stopped")
            time.sleep(0.3)

    def forget(self, released: bool = True) -> None:
        """Destroy and undefine the domain if it exists (also a leftover of an
        interrupted run), then (`released`) wait until vstor released it here."""
        if self.lab.virsh("dominfo", self.name, codes=None) == "":
            return
        if self.active():
            self.lab.virsh("destroy", self.name, codes=None)
        self.lab.virsh("undefine", self.name, codes=None)
        if released:
            self.wait_released()

    def clean_up(self, released: bool = True) -> None:
        """forget() for a finally block: a failure is logged, not raised over
        the test's own; what vstor still holds then is released by force, so
        that it does not stand in the next case's way."""
        try:
            self.forget(released)
        except Exception as e:      # noqa: BLE001 (the test's own error comes first)
            LOG.error("cleaning up %s: %s", self.name, e)
            if released:
                self.lab.vstor("release", self.name, "--force", codes=None)


def read_console(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace").replace("\r", "")
    except FileNotFoundError:
        return ""
