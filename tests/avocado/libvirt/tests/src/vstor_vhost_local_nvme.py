"""vstor.lab.vhost_local_nvme: SPDK on the host serves a local NVMe namespace
as vhost-user-blk (xml-templates/vhost-local-nvme.xml). While the domain
runs, SPDK has the controller and a vhost controller on the domain's socket
polled by one reactor on the controller's node (SPDK's own answers); the
guest writes and reads back; after the stop SPDK has let the controller go
and the host reads the guest's bytes from the namespace. vCPUs and memory on
the controller's node."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))   # the vstor checkout

from avocado.core.exceptions import TestCancel  # noqa: E402

from tests.avocado.vstorlab import guestrun, hostdev, numa  # noqa: E402
from tests.avocado.vstorlab.lab import open_lab, ready  # noqa: E402
from tests.e2e import guest as tiny  # noqa: E402

NAME = "vstor-avo-vhost-nvme"


def run(test, params, env):
    lab = open_lab(params)
    address = lab.need("vstor_nvme_controller", "the lab names no NVMe controller for SPDK to serve")
    ctrl = hostdev.nvme_controller(lab, address)
    nsid = lab.number("vstor_nvme_namespace", 1)
    if ctrl["driver"] == "nvme" and not any(ns["nsid"] == nsid for ns in ctrl["namespaces"]):
        raise TestCancel(f"{address} has no namespace {nsid} (vstor_nvme_namespace)")
    spdk = hostdev.spdk_socket(lab)
    ready(lab)
    seed, size = lab.number("vstor_seed", 4242), lab.number("vstor_io_size", 1 << 20)
    disk = (f"<vstor:disk xmlns:vstor='{guestrun.NS}' target='vdb' mode='vhost' backend='spdk'>"
            f"<vstor:nvme controller='{address}' namespace='{nsid}'/></vstor:disk>")
    vm = {"numa": "strict", "cpus": "dedicated", "hugepages": lab.get("vstor_hugepages", "2M")}
    dom = guestrun.GuestDomain(
        lab, NAME, guestrun.vstor_block(vm, [disk]),
        tiny.job("write-verify", "vda", seed, size, timeout=lab.number("vstor_guest_timeout", 240),
                 hold=lab.number("vstor_guest_hold", 10)))
    before = ctrl["driver"]
    try:
        dom.define()
        dom.start()
        dom.wait("HOLD")
        place = numa.check(dom, ctrl["numa_node"])
        numa.reactor(spdk, dom, place)

        guestrun.check_guest_io(dom.wait("DONE"), "vda", seed, size)
        dom.wait_off()
        dom.wait_released()
        hostdev.namespace_holds(test, lab, address, nsid, before, tiny.expected_pattern(seed, size))
    finally:
        dom.clean_up()
