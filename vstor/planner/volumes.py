"""One volume and who holds it: the names a volume goes by on this host
(an NVMe namespace is a controller's namespace and a kernel block device at
once), and a refusal's words for its holders, with whether each runs and
how to free what it holds.

Pure: the host model and the ledger in, keys and words out.
"""

from __future__ import annotations

from vstor.host.model import Host, NvmeController
from vstor.meta.intent import BlockSource, NvmeSource
from vstor.meta.names import volume_keys
from vstor.planner.ledger import Ledger, held_by


def volumes_of(host: Host, source) -> tuple[str, ...]:
    """A source's volume keys with those of its other name on this host: an
    NVMe namespace is <vstor:nvme controller namespace> and <vstor:block
    path='/dev/nvmeXnY'> at once, and a holding keeps the name its disk
    gave (so the one who asks looks under both)."""
    if source.kind == "nvme":
        ctrl = host.controller(source.controller)
        ns = ctrl.namespace(source.namespace) if ctrl is not None else None
        other = BlockSource(path=ns.dev_path) if ns is not None else None
    elif source.kind == "block":
        found = namespace_at(host, source.path)
        other = NvmeSource(controller=found[0].address, namespace=found[1].nsid) if found else None
    else:
        other = None
    return volume_keys(source) + (volume_keys(other) if other is not None else ())


def namespace_at(host: Host, path: str):
    """(controller, namespace) whose kernel block device `path` is, or None."""
    name = path[len("/dev/"):]
    return next(((c, ns) for c in host.controllers for ns in c.namespaces if ns.name == name), None)


def two_writers(ledger: Ledger, other: str) -> str:
    """Why a volume another domain holds is refused, and how to free it: a
    domain that is not running holds it by its plan while it is defined;
    one whose record vstor keeps may have stopped without a release."""
    if ledger.running(other) is False:
        fix = (f"{other} is not running, but its plan holds it: give {other} another disk and vstor "
               f"apply {other}, or virsh undefine {other}; or make both readonly='yes'")
    else:
        fix = f"make both readonly='yes' or pick another; if {other} has stopped, vstor release {other}"
    return f"is already used by domain {held_by(ledger, other)}; two writers would corrupt it ({fix})"


def controller_taken(ledger: Ledger, address: str) -> str | None:
    """Why no namespace of the controller can be served through the kernel:
    a domain passes it through or SPDK takes it, whole, at that domain's
    start (running or not)."""
    owner = ledger.passthrough.get(address)
    if owner:
        return f"the controller is passed through to {held_by(ledger, owner)}"
    spdk = ledger.spdk_users.get(address)
    if spdk:
        # SPDK's PCIe driver takes the whole controller from the kernel when
        # that domain starts: this namespace's block device would vanish.
        return "SPDK takes the whole controller for " + ", ".join(held_by(ledger, d) for d in sorted(set(spdk)))
    return None


def kernel_users(ctrl: NvmeController, ledger: Ledger) -> set[str]:
    """The domains served a namespace of the controller through the kernel,
    named either way (volumes_of)."""
    by_block = {ledger.volume_conflict(volume_keys(BlockSource(path=ns.dev_path)), False)
                for ns in ctrl.namespaces}
    return (ledger.namespace_users(ctrl.address) | (by_block - {None})) - set(ledger.spdk_users.get(ctrl.address, ()))


def names(ledger: Ledger, domains) -> str:
    """Domains as a refusal lists them (this VM's own disks as 'this VM')."""
    return ", ".join(d if d == "this VM" else held_by(ledger, d) for d in sorted(domains))
