"""May a controller leave the host for vfio-pci?  Pure: asked by the planner
when it chooses passthrough or SPDK's PCIe driver, and again at start by the
same fitting code (vstor.planner.fit)."""

from __future__ import annotations

from vstor.host.model import NvmeController, PciDevice
from vstor.meta.names import normalise_bdf

VFIO = "vfio-pci"
# vfio accepts a group only when every member is on a vfio driver, on no
# driver, on pci-stub, or is a bridge (drivers/vfio: vfio_dev_driver_allowed).
VIABLE_PEER_DRIVERS = (None, VFIO, "pci-stub")
# Drivers SPDK's PCIe transport runs on: the controller is already the
# operator's to give SPDK (scripts/setup.sh did it), and vstor binds nothing.
USERSPACE_DRIVERS = ("vfio-pci", "uio_pci_generic", "igb_uio")


def check_passthrough(ctrl: NvmeController, *, iommu_enabled: bool, vfio_available: bool,
                      pci_allowed: tuple[str, ...], pci_blocked: tuple[str, ...],
                      spdk_owned: bool) -> tuple[str, ...]:
    """Why `ctrl` cannot go to vfio-pci now, one reason with its fix each,
    the most important first (what no change on the host can fix, then the
    operator's lists, then what the host uses, then the platform); () when
    it can."""
    reasons = []
    if ctrl.backs_root:
        reasons.append(f"{ctrl.address} holds the host's root filesystem: the host would "
                       "lose its root disk; choose another controller")
    reasons += _pci_list_reasons(ctrl.address, pci_allowed, pci_blocked)
    reasons += [_usage_reason(ns.name, why) for ns in ctrl.namespaces for why in ns.in_use]
    if ctrl.virtfns:
        reasons.append(f"{ctrl.address} has {len(ctrl.virtfns)} SR-IOV virtual functions enabled "
                       f"({', '.join(ctrl.virtfns)}): taking the physical function from its "
                       f"driver takes them away; echo 0 > /sys/bus/pci/devices/{ctrl.address}/"
                       "sriov_numvfs first")
    if not iommu_enabled:
        reasons.append("the IOMMU is off: add intel_iommu=on iommu=pt (or amd_iommu=on) "
                       "to the kernel command line and reboot")
    elif ctrl.iommu_group is None:
        reasons.append(f"{ctrl.address} is in no IOMMU group: the IOMMU does not cover it "
                       "(check the firmware's VT-d/AMD-Vi setting)")
    if not vfio_available:
        reasons.append("vfio-pci is not available: modprobe vfio-pci")
    reasons += [_peer_reason(ctrl, peer) for peer in ctrl.group_peers if not viable(peer)]
    if spdk_owned:
        reasons.append(f"SPDK is using {ctrl.address} (on {ctrl.driver or 'no driver'}): "
                       "detach it from SPDK (stop the domains it serves) first, or give "
                       "this disk the spdk backend too")
    return tuple(reasons)


_USAGE_FIXES = (("mounted", "unmount it"), ("swap", "swapoff it"),
                ("held by", "remove what holds it (LVM, dm, md)"))


def _usage_reason(ns_name: str, why: str) -> str:
    fix = next((f for prefix, f in _USAGE_FIXES if why.startswith(prefix)), "stop using it")
    return (f"namespace {ns_name} is in use by the host ({why}): passthrough takes the whole "
            f"controller away, so {fix} first")


def _pci_list_reasons(address: str, allowed, blocked) -> list[str]:
    # setup.sh semantics: PCI_BLOCKED wins; an empty PCI_ALLOWED allows all.
    address = normalise_bdf(address)
    if address in {normalise_bdf(a) for a in blocked}:
        return [f"{address} is in PCI_BLOCKED ([pci] blocked): remove it from there to allow it"]
    if allowed and address not in {normalise_bdf(a) for a in allowed}:
        return [f"{address} is not in PCI_ALLOWED ([pci] allowed): add it there to allow it"]
    return []


def viable(peer: PciDevice) -> bool:
    return peer.is_bridge or peer.driver in VIABLE_PEER_DRIVERS


def _peer_reason(ctrl: NvmeController, peer: PciDevice) -> str:
    return (f"IOMMU group {ctrl.iommu_group} of {ctrl.address} also holds {peer.address} "
            f"(on {peer.driver}), which would have to leave the host too: unbind it from "
            f"{peer.driver} or move the controller to a slot with its own IOMMU group")
