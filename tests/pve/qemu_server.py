"""A small model of how Proxmox's qemu-server turns the config keys vstor
writes into QEMU arguments (../shared/pve/FACTS.md, QS:Mem), held to
Proxmox's own cfg2cmd cases by tests/test_pve_model.py.  Test code: the
oracle is the .conf.cmd files, not this model.

So far: memory, numa (one guest node per socket, or numaN) and hugepages,
without memory hotplug or virtiofs (vstor writes neither)."""

from __future__ import annotations

import shlex

PAGE_KB = {"2": 2048, "1024": 1048576}


def memory_args(conf) -> list[str]:
    """`-m`, then per guest node its memory object and `-numa node`."""
    memory = int((conf.get("memory") or "512").split(",")[0].removeprefix("current="))
    out = ["-m", str(memory)]
    if conf.get("numa") != "1":
        return out
    sockets, cores = int(conf.get("sockets") or 1), int(conf.get("cores") or 1)
    pages = conf.get("hugepages")
    custom = [(i, _props(conf.get(f"numa{i}"))) for i in range(8) if conf.get(f"numa{i}")]
    nodes = custom or [(i, {"cpus": f"{i * cores}-{i * cores + cores - 1}" if cores > 1 else str(i * cores),
                            "memory": str(memory // sockets)}) for i in range(sockets)]
    for i, node in nodes:
        if pages:
            backend = (f"memory-backend-file,id=ram-node{i},size={node['memory']}M,"
                       f"mem-path=/run/hugepages/kvm/{PAGE_KB[pages]}kB,share=on,prealloc=yes")
        else:
            backend = f"memory-backend-ram,id=ram-node{i},size={node['memory']}M"
        if "hostnodes" in node:
            backend += f",host-nodes={node['hostnodes'].replace(';', ',')},policy={node['policy']}"
        cpus = ",".join(f"cpus={c}" for c in node["cpus"].split(";"))
        out += ["-object", backend, "-numa", f"node,nodeid={i},{cpus},memdev=ram-node{i}"]
    return out


def _props(text: str) -> dict:
    return dict(part.split("=", 1) for part in text.split(","))


def command(cmd_text: str) -> list[str]:
    """A .conf.cmd file as argv (shell quoting undone)."""
    return shlex.split(cmd_text.replace("\\\n", " "))


def memory_part(argv: list[str]) -> list[str]:
    """The arguments memory_args() models, in their order in `argv`."""
    out = []
    for i, arg in enumerate(argv[:-1]):
        value = argv[i + 1]
        if arg == "-m" or arg == "-numa" or (arg == "-object" and value.startswith("memory-backend")):
            out += [arg, value]
    return out
