"""Run with an interpreter that has nova installed: one JSON request on
stdin, one JSON answer on stdout.  Nova's own NUMA fitting
(nova.virt.hardware.numa_fit_instance_to_host) of a flavor onto a host
whose cpu sets are the ones a nova.conf fragment gives.

request: {"conf": nova.conf text,
          "nodes": [{"id": int, "cpus": [int], "siblings": [[int]],
                     "memory_mib": int, "pages_2m": int}],
          "flavor": {"vcpus": int, "memory_mb": int, "extra_specs": {...}}}
answer:  {"dedicated": [cpus], "shared": [cpus],
          "fitted": null | [{"id": host cell, "pagesize": KiB, "pins": {vCPU: host CPU}}]}
"""

import json
import os
import sys
import tempfile

import nova.conf
from nova import objects
from nova.virt import hardware

CONF = nova.conf.CONF


def main() -> None:
    req = json.load(sys.stdin)
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(req["conf"])
    CONF([], default_config_files=[f.name])
    os.unlink(f.name)
    objects.register_all()
    dedicated = hardware.get_cpu_dedicated_set() or set()
    shared = hardware.get_cpu_shared_set() or set()
    cells = []
    for n in req["nodes"]:
        cpus = set(n["cpus"])
        cells.append(objects.NUMACell(
            id=n["id"], cpuset=cpus & shared, pcpuset=cpus & dedicated,
            memory=n["memory_mib"], cpu_usage=0, memory_usage=0, pinned_cpus=set(),
            siblings=[set(s) for s in n["siblings"]],
            mempages=[objects.NUMAPagesTopology(size_kb=4, total=n["memory_mib"] * 256, used=0),
                      objects.NUMAPagesTopology(size_kb=2048, total=n["pages_2m"], used=0)],
            network_metadata=objects.NetworkMetadata(physnets=set(), tunneled=False),
            socket=None))
    host = objects.NUMATopology(cells=cells)
    fl = req["flavor"]
    flavor = objects.Flavor(vcpus=fl["vcpus"], memory_mb=fl["memory_mb"], extra_specs=fl["extra_specs"])
    wanted = hardware.numa_get_constraints(flavor, objects.ImageMeta.from_dict({}))
    fitted = hardware.numa_fit_instance_to_host(host, wanted, None)
    out = {"dedicated": sorted(dedicated), "shared": sorted(shared), "fitted": None}
    if fitted is not None:
        out["fitted"] = [{"id": c.id, "pagesize": c.pagesize,
                          "pins": {str(k): v for k, v in (c.cpu_pinning or {}).items()}}
                         for c in fitted.cells]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
