"""The host-wide ledger: what every other vstor domain holds.

Built from the plans recorded in defined domains and the state directory's
records of running ones; the planner consults it so that no core is
dedicated twice, no vCPU lands on a reactor, and no controller, volume or
socket is handed out twice.  Pure data: loading lives in `vstor.runtime.inventory`.
"""

from __future__ import annotations

from collections import ChainMap, Counter

# What one domain holds, as its state record keeps it (vstor.meta.holding).
from vstor.meta.holding import Holding, connections, holding_from_json, holding_to_json  # noqa: F401


class Ledger:
    """Indexes over a set of holdings, built once (linear in their number)."""

    def __init__(self, holdings: tuple[Holding, ...] | list[Holding] = ()):
        self.holdings = tuple(holdings)
        self.cpu_owner: dict[int, str] = {}
        self.reactor_load: Counter[int] = Counter()
        self.passthrough: dict[str, str] = {}
        self.spdk_users: dict[str, list[str]] = {}
        self.volumes: dict[str, list[tuple[str, bool]]] = {}
        self.sockets: dict[str, str] = {}
        self.connections: dict[str, list[tuple[str, str]]] = {}   # path -> [(controller, domain)]
        self._pages: Counter[tuple[int, int]] = Counter()
        self._bound: Counter[int] = Counter()
        self._running: dict[str, bool] = {}
        for h in self.holdings:
            self._index(h)

    def _index(self, h: Holding) -> None:
        self._running.setdefault(h.domain, h.active)
        for cpu in h.cpus:
            self.cpu_owner.setdefault(cpu, h.domain)
        self.reactor_load.update(h.reactors)
        for addr in h.passthrough:
            self.passthrough.setdefault(addr, h.domain)
        for addr in h.spdk_controllers:
            self.spdk_users.setdefault(addr, []).append(h.domain)
        for key, ro in h.volumes:
            self.volumes.setdefault(key, []).append((h.domain, ro))
        for sock in h.sockets:
            self.sockets.setdefault(sock, h.domain)
        for path, controller in h.connections:
            self.connections.setdefault(path, []).append((controller, h.domain))
        if not h.active:
            for node, size, count in h.hugepages:
                self._pages[(node, size)] += count
        # Running or not: ordinary memory is counted against the node's
        # size, not its free memory (which the page cache moves).
        for node, kib in h.memory:
            self._bound[node] += kib

    def without(self, domain: str, uuid: str | None = None) -> "Ledger":
        """The ledger minus the domain being planned (re-planning is not a
        conflict): its name, and its UUID when both say one.  A holding with
        this UUID under another name stays: it is another domain's, or a
        borrowed UUID must not hide it."""
        keep = [h for h in self.holdings
                if not (h.domain == domain and (uuid is None or h.uuid is None or h.uuid == uuid))]
        if len(keep) == len(self.holdings):
            return self
        return Ledger(keep)

    def running(self, domain: str) -> bool | None:
        """Whether a domain the ledger holds runs (its holding is active:
        libvirt runs it, or its state record is prepared); None when the
        ledger holds nothing of it."""
        return self._running.get(domain)

    def path_conflict(self, path: str, controller: str) -> str | None:
        """The domain whose SPDK controller of another name has this path."""
        return next((domain for name, domain in self.connections.get(path, ())
                     if name != controller), None)

    def promised_hugepages(self, node: int, size_kib: int) -> int:
        """Pages planned for defined domains that are not running: still in the
        free pool, but spoken for."""
        return self._pages[(node, size_kib)]

    def bound_memory_kib(self, node: int) -> int:
        """Ordinary (not hugepage) memory the domains hold bound to `node`."""
        return self._bound[node]

    def namespace_users(self, address: str) -> set[str]:
        """The domains with a volume on a namespace of the NVMe controller at
        `address` (served by the kernel's driver or SPDK's)."""
        prefix = f"nvme:{address}/"
        return {d for key, lst in self.volumes.items() if key.startswith(prefix) for d, _ in lst}

    def volume_conflict(self, keys: tuple[str, ...], readonly: bool) -> str | None:
        """The domain that already writes (or would be written under) this
        volume: one that holds any of its keys."""
        for key in keys:
            for domain, ro in self.volumes.get(key, ()):
                if not (ro and readonly):
                    return domain
        return None


class Overlay:
    """A ledger plus what the domain being planned has claimed so far: its
    disks' controllers, volumes and NVMe-oF paths, its cells' cores, pages,
    bound memory and reactors.  Asked as the ledger it overlays (what the
    overlay does not add is the base ledger's), so no core, page or
    controller is given twice, between domains or within one.  The planner
    and the start check build one per domain."""

    def __init__(self, base):
        self.base = base
        self.own_cpus: dict[int, str] = {}
        self.cpu_owner = ChainMap(self.own_cpus, base.cpu_owner)
        self.reactor_load = Counter(base.reactor_load)
        self.own_passthrough: set[str] = set()        # controller addresses, by backend
        self.own_spdk: set[str] = set()
        self.own_kernel: set[str] = set()
        self.own_connections: dict[str, str] = {}     # NVMe-oF path -> SPDK controller
        self.own_volumes: dict[str, tuple[str, bool]] = {}   # key -> (target, readonly)
        self._pages: Counter[tuple[int, int]] = Counter()
        self._bound: Counter[int] = Counter()

    def __getattr__(self, name):
        return getattr(self.base, name)

    def take_node(self, domain: str, cpus, node: int, page_kib, pages: int, bound_kib: int) -> None:
        """One cell's cores, hugepages and bound memory on `node`."""
        for cpu in cpus:
            self.own_cpus[cpu] = domain
        self._pages[(node, page_kib)] += pages
        self._bound[node] += bound_kib

    def take_disk(self, backend: str, controller: str | None, paths=()) -> None:
        """A disk's controller (by its backend) and NVMe-oF (path, controller)s."""
        self.own_connections.update(paths)
        if controller is not None:
            {"vfio": self.own_passthrough, "spdk": self.own_spdk,
             "qsd": self.own_kernel}[backend].add(controller)

    def promised_hugepages(self, node: int, size_kib: int) -> int:
        return self.base.promised_hugepages(node, size_kib) + self._pages[(node, size_kib)]

    def bound_memory_kib(self, node: int) -> int:
        return self.base.bound_memory_kib(node) + self._bound[node]


def held_by(ledger, domain: str) -> str:
    """A holder as a refusal names it: its name and whether it runs, as the
    ledger (Ledger, or the index's) knows it."""
    running = ledger.running(domain)
    return domain if running is None else f"{domain} ({'running' if running else 'not running'})"
