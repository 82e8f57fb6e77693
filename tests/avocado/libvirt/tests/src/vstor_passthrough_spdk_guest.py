"""vstor.lab.passthrough_spdk_guest: a whole NVMe controller passed through
over VFIO with a vIOMMU in caching mode, which SPDK inside the guest needs
(xml-templates/passthrough-guest-spdk.xml). While the domain runs, the
controller is on vfio-pci and the domain has it as a hostdev behind an intel
vIOMMU; the guest (its kernel booted with intel_iommu=on, so its DMA goes
through the vIOMMU as SPDK's would) writes the namespace and reads it back;
after the stop the controller is back on its driver and the host reads the
guest's bytes from the namespace. vCPUs and memory on the controller's node."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestCancel, TestFail  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-passthrough"


def driver(address: str) -> str:
    link = Path("/sys/bus/pci/devices", address, "driver")
    return Path(link.resolve()).name if link.exists() else ""


def run(test, params, env):
    lab = open_lab(params)
    address = lab.need("vstor_nvme_controller", "the lab names no spare NVMe controller to pass through")
    ctrl = hostdev.nvme_controller(lab, address)
    if not hostdev.host_model(lab)["iommu_enabled"]:
        raise TestCancel("the host's IOMMU is off (intel_iommu=on or amd_iommu=on): no VFIO passthrough")
    busy = [f"{ns['name']}: {', '.join(ns['in_use'])}" for ns in ctrl["namespaces"] if ns["in_use"]]
    if busy:
        raise TestCancel(f"{address} is in use on this host, not a spare controller ({'; '.join(busy)})")
    ready(lab)
    seed, size = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 1 << 20)
    nsid, gdev = lab.number("vstor_nvme_namespace", 1), lab.get("vstor_guest_nvme_dev", "nvme0n1")
    vm = {"latency": "critical"}
    if lab.get("vstor_hugepages"):
        vm["hugepages"] = lab.get("vstor_hugepages")
    disk = (f"<vstor:disk xmlns:vstor='{guestrun.NS}' target='vdb' mode='passthrough' guest='spdk'>"
            f"<vstor:nvme controller='{address}'/></vstor:disk>")
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block(vm, [disk]),
        tiny.job("write-verify", gdev, seed, size, timeout=lab.number("vstor_guest_timeout", 240),
                 hold=lab.number("vstor_guest_hold", 10)),
        cmdline_extra="intel_iommu=on iommu=strict")
    before = driver(address)
    try:
        dom.define()
        dom.start()
        dom.wait("HOLD")
        if driver(address) != "vfio-pci":
            raise TestFail(f"{address} is on '{driver(address)}' while the domain runs, not vfio-pci")
        live = dom.live_xml()
        domain, bus, slot_fn = address.split(":")
        want = (int(domain, 16), int(bus, 16), *(int(x, 16) for x in slot_fn.split(".")))
        hostdevs = [a for a in live.iterfind("devices/hostdev/source/address")
                    if tuple(int(a.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function")) == want]
        iommu = live.find("devices/iommu[@model='intel']/driver")
        if not hostdevs or iommu is None or iommu.get("caching_mode") != "on":
            raise TestFail(f"{NAME} runs without {address} as a hostdev behind an intel vIOMMU "
                           "with caching_mode on")
        numa.check(dom, ctrl["numa_node"])

        guestrun.check_guest_io(dom.wait("DONE"), gdev, seed, size)
        dom.wait_off()
        dom.wait_released()
        if driver(address) != before:
            raise TestFail(f"{address} is on '{driver(address)}' after the stop, was on '{before}'")
        hostdev.namespace_holds(test, lab, address, nsid, before, tiny.expected_pattern(seed, size))
    finally:
        dom.clean_up()
