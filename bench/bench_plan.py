"""Time `plan` on a small and a large host, and its growth with the ledger.

    python3 bench/bench_plan.py [--repeat N] [--quick]

Large host: 8 NUMA nodes x 32 cores (SMT2, 512 CPUs), 64 NVMe controllers,
4 RDMA NICs, and a ledger of up to 1000 existing vstor domains.  The figures
go into docs/performance.md.  Not a test: nothing here asserts a time.
`--quick` plans each case once and loads 20 domains from libvirt, then checks
the bench's own sanity (bench/sanity.py); tests/test_bench.py runs it so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from vstor.config import Config                                   # noqa: E402
from vstor.meta.document import Domain                                   # noqa: E402
from vstor.planner.ledger import Holding, Ledger                          # noqa: E402
from vstor.host.model import (Cpu, Host, HugepagePool, Namespace, NetDev,  # noqa: E402
                         NumaNode, NvmeController, RdmaNic)
from vstor.planner import Request, plan_domain                    # noqa: E402
from bench.sanity import Sanity                                   # noqa: E402


def make_host(nodes: int, cores: int, controllers: int) -> Host:
    threads = nodes * cores
    cpus, node_list = [], []
    for n in range(nodes):
        ids = []
        for c in range(cores):
            a = n * cores + c
            b = a + threads
            ids += [a, b]
            cpus += [Cpu(a, n, n, c, (a, b)), Cpu(b, n, n, c, (a, b))]
        node_list.append(NumaNode(n, tuple(sorted(ids)), 256 << 20,
                                  (HugepagePool(2048, 65536, 65536), HugepagePool(1048576, 64, 64))))
    ctrls = []
    for i in range(controllers):
        bus = 0x10 + i
        ctrls.append(NvmeController(f"0000:{bus:02x}:00.0", numa_node=i % nodes, driver="nvme",
                                    name=f"nvme{i}", iommu_group=100 + i,
                                    namespaces=(Namespace(f"nvme{i}n1", 1, 4 * 10**12),)))
    nics = tuple(RdmaNic(f"mlx5_{i}", f"0000:{0xa0 + i:02x}:00.0", i % nodes, (NetDev(f"ib{i}", 4096),))
                 for i in range(min(4, nodes)))
    return Host("bench", tuple(cpus), tuple(node_list), tuple(ctrls), nics,
                iommu_enabled=True, vfio_available=True)


def make_ledger(host: Host, count: int) -> Ledger:
    """`count` existing domains: one in five with 2 dedicated vCPUs (a whole
    core), every one with a qsd file disk and an SPDK namespace."""
    holdings = []
    free = {n.id: [c for c in n.cpus if c >= len(host.nodes) * 2] for n in host.nodes}
    for i in range(count):
        node = i % len(host.nodes)
        cpus = frozenset()
        if i % 5 == 0 and len(free[node]) >= 2:
            first = free[node].pop(0)
            sib = host.cpu(first).siblings
            free[node] = [c for c in free[node] if c not in sib]
            cpus = frozenset(sib)
        ctrl = host.controllers[i % len(host.controllers)].address
        holdings.append(Holding(
            domain=f"vm{i}", uuid=None, active=i % 2 == 0, node=node, cpus=cpus,
            reactors=(node * 32,), hugepages=((node, 2048, 64),), memory=(),
            passthrough=frozenset(), spdk_controllers=frozenset({ctrl}),
            volumes=frozenset({(f"file:/var/lib/vstor/images/vm{i}.raw", False),
                               (f"nvme:{ctrl}/{i}", False)}),
            sockets=frozenset({f"/run/vstor/vhost/vm{i}-vdb"})))
    return Ledger(holdings)


REQUEST = """<domain type='kvm'><name>newvm</name><memory unit='GiB'>8</memory><vcpu>4</vcpu>
<metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>
<vstor:disk target='vdb' backend='spdk'><vstor:nvme controller='{ctrl}'/></vstor:disk>
<vstor:disk target='vdc' backend='qsd'><vstor:file path='/var/lib/vstor/images/newvm.raw'/></vstor:disk>
</vstor:vstor></metadata><devices/></domain>"""


LEDGER_DOMAIN = """<domain type='kvm'><name>vm{i}</name><memory unit='GiB'>1</memory><vcpu>1</vcpu>
<metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'><vstor:vm cpus='shared'/>
<vstor:disk target='vdb' backend='spdk'><vstor:nvme controller='{ctrl}'/></vstor:disk>
<vstor:disk target='vdc' backend='qsd'><vstor:file path='/var/lib/vstor/images/vm{i}.raw'/></vstor:disk>
</vstor:vstor></metadata><os><type arch='x86_64'>hvm</type></os><devices/></domain>"""


def time_plan(host: Host, cfg: Config, count: int, repeat: int) -> float:
    """Median seconds for one plan, ledger construction included (as the CLI does)."""
    holdings_source = make_ledger(host, count).holdings
    assert len(holdings_source) == count
    req = Request.from_domain(Domain.parse(REQUEST.format(ctrl=host.controllers[-1].address)))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_domain(host, cfg, req, Ledger(holdings_source))
        samples.append(time.perf_counter() - t0)
    # What was timed is a whole plan: both disks placed, the SPDK one on its controller's node.
    spdk = [d for d in plan.disks if d.backend == "spdk"]
    assert len(plan.disks) == 2 and len(spdk) == 1, plan.disks
    assert plan.node == host.controllers[-1].numa_node, (plan.node, host.controllers[-1])
    return statistics.median(samples)


SPREAD = """<domain type='kvm'><name>spread</name><memory unit='GiB'>8</memory><vcpu>8</vcpu>
<metadata><vstor:vstor xmlns:vstor='https://vstor.dev/xmlns/domain/1'>{disks}</vstor:vstor></metadata>
<devices/></domain>"""


def time_spread(host: Host, cfg: Config, count: int, repeat: int, nodes: int) -> float:
    """Median seconds for one plan of a guest whose `nodes` SPDK disks sit on
    as many host nodes: one guest cell per node (vstor.planner.cells)."""
    holdings_source = make_ledger(host, count).holdings
    ctrls = [[c for c in host.controllers if c.numa_node == n][-1] for n in range(nodes)]
    disks = "".join(f"<vstor:disk target='vd{chr(98 + i)}' backend='spdk'><vstor:nvme controller='{c.address}'/>"
                    "</vstor:disk>" for i, c in enumerate(ctrls))
    req = Request.from_domain(Domain.parse(SPREAD.format(disks=disks)))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_domain(host, cfg, req, Ledger(holdings_source))
        samples.append(time.perf_counter() - t0)
    assert [c.node for c in plan.cells] == list(range(nodes)), plan.cells
    return statistics.median(samples)


def time_libvirt_ledger(count: int) -> tuple[float, float]:
    """Define `count` rendered vstor domains in libvirt's test driver, then time
    what `vstor plan DOMAIN` adds: loading the ledger from libvirt."""
    import libvirt
    from vstor.runtime.inventory import load_ledger
    from vstor.render.libvirt import render
    host = make_host(8, 32, 64)
    cfg = Config(reactors=tuple(n * 32 for n in range(8)))
    conn = libvirt.open("test:///default")
    ledger = Ledger()
    t0 = time.perf_counter()
    for i in range(count):
        dom = Domain.parse(LEDGER_DOMAIN.format(i=i, ctrl=host.controllers[i % 64].address))
        plan = plan_domain(host, cfg, Request.from_domain(dom), ledger)
        conn.defineXML(render(dom, plan).to_string())
    define_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = load_ledger(conn)
    load_s = time.perf_counter() - t0
    assert len(loaded.holdings) == count
    conn.close()
    return define_s, load_s


COUNTS = (0, 125, 250, 500, 1000)      # domains in the large host's ledger


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true",
                    help="each case once, 20 domains in libvirt; check the bench's own sanity")
    args = ap.parse_args()
    sanity = Sanity(args.quick)
    repeat, defined = (1, 20) if args.quick else (args.repeat, 500)
    small = make_host(1, 4, 1)
    large = make_host(8, 32, 64)
    cfg_small = Config(reactors=(1,))
    cfg_large = Config(reactors=tuple(n * 32 for n in range(8)))
    ms = sanity.figure("small host", time_plan(small, cfg_small, 0, repeat) * 1000)
    print(f"small host (1 node x 4 cores, 1 NVMe), empty ledger: {ms:.2f} ms")
    for count in COUNTS:
        ms = sanity.figure(f"large host, {count}", time_plan(large, cfg_large, count, repeat) * 1000)
        print(f"large host (8 nodes x 32 cores, 64 NVMe), {count:4d} domains in the ledger: {ms:.2f} ms")
    one = time_plan(large, cfg_large, 500, repeat)
    four = sanity.figure("four cells", time_spread(large, cfg_large, 500, repeat, 4) * 1000)
    print(f"large host, 500 domains in the ledger, a guest with disks on 4 nodes (4 guest cells): "
          f"{four:.2f} ms ({four / (one * 1000):.2f}x the one-node guest's plan)")
    _, load_s = time_libvirt_ledger(defined)
    ms = sanity.figure("libvirt ledger", load_s * 1000)
    print(f"loading the ledger from libvirt (test driver), {defined} defined vstor domains: {ms:.0f} ms")
    sanity.finish(expected=3 + len(COUNTS))


if __name__ == "__main__":
    main()
