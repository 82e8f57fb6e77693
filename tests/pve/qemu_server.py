"""A small model of how Proxmox's qemu-server turns the config keys vstor
writes into QEMU arguments (../shared/pve/FACTS.md, QS:Mem), held to
Proxmox's own cfg2cmd cases by tests/test_pve_model.py.  Test code: the
oracle is the .conf.cmd files, not this model.

Modelled: memory, numa (one guest node per socket, or numaN) and hugepages,
without memory hotplug or virtiofs (vstor writes neither); hostpciN for one
host function, with or without pcie=1 (QS:PCI); affinity, the taskset
prefix (QS:Srv:3202-3206); args, split shell-style and appended last
(QS:Srv:3813-3836).  cfg2cmd has cases for the first two; the last two are
modelled from FACTS.md alone.

The unit tests judge vstor's configs by Proxmox's real qemu-server instead
(tests/pve/oracle.py); this model builds the QEMU command line the e2e test
(tests/e2e/test_pve.py) starts without Proxmox's own files."""

from __future__ import annotations

import re
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


# hostpciN without pcie=1 sits on pci.0 at a fixed slot (QS:PCI's address
# table; the slots seen in cfg2cmd cases).
PCI0_SLOT = {0: "0x10", 1: "0x11", 2: "0x1b"}


def hostpci_args(conf) -> list[str]:
    """`-device` arguments of the hostpciN lines the model knows: one host
    function (`[host=]BB:DD.F` or `DDDD:BB:DD.F`), options pcie and rombar."""
    out = []
    for i in range(16):
        value = conf.get(f"hostpci{i}")
        if value is None or not modelled_hostpci(value):
            continue
        parts = value.split(",")
        host = parts[0].removeprefix("host=")
        host = host if host.count(":") == 2 else f"0000:{host}"
        opts = dict(p.split("=", 1) for p in parts[1:])
        if opts.get("pcie") == "1":
            port = f"ich9-pcie-port-{i + 1}"
            if i >= 4:
                out += ["-device", f"pcie-root-port,id={port},addr=10.{i - 4},x-speed=16,x-width=32,"
                                   f"multifunction=on,bus=pcie.0,port={i + 1},chassis={i + 1}"]
            device = f"vfio-pci,host={host},id=hostpci{i},bus={port},addr=0x0"
        else:
            device = f"vfio-pci,host={host},id=hostpci{i},bus=pci.0,addr={PCI0_SLOT[i]}"
        if opts.get("rombar") == "0":
            device += ",rombar=0"
        out += ["-device", device]
    return out


def modelled_hostpci(value: str) -> bool:
    parts = value.split(",")
    host = parts[0].removeprefix("host=")
    return (re.fullmatch(r"([0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", host) is not None
            and all(p.split("=")[0] in ("pcie", "rombar") for p in parts[1:]))


def hostpci_part(argv: list[str]) -> list[str]:
    """The vfio-pci devices of single host functions in `argv`, each with the
    root port made for it."""
    out = []
    for i, arg in enumerate(argv[:-1]):
        value = argv[i + 1]
        if arg != "-device":
            continue
        if value.startswith("vfio-pci,host=") and re.search(r",id=hostpci\d+,", value):
            out += [arg, value]
        elif value.startswith("pcie-root-port,id=ich9-pcie-port-"):
            out += [arg, value]
    return out


def prefix(conf) -> list[str]:
    """What goes before the QEMU binary: taskset for `affinity`."""
    return ["/usr/bin/taskset", "--cpu-list", "--all-tasks", conf.get("affinity")] \
        if conf.get("affinity") else []


def extra_args(conf) -> list[str]:
    """`args`, as Text::ParseWords::shellwords splits it: the last arguments."""
    return shlex.split(conf.get("args")) if conf.get("args") else []


def refusal(conf) -> str | None:
    """Why qemu-server would die before starting QEMU with these keys
    (FACTS.md, QS:Mem), or None."""
    memory = int((conf.get("memory") or "512").split(",")[0].removeprefix("current="))
    pages = conf.get("hugepages")
    custom = {i: _props(conf.get(f"numa{i}")) for i in range(8) if conf.get(f"numa{i}")}
    if pages and conf.get("numa") != "1":
        return "hugepages need numa: 1"                                   # QS:Mem:388
    if conf.get("numa") != "1":
        return None
    if custom:
        if sum(int(n["memory"]) for n in custom.values()) != memory:      # QS:Mem:437-438
            return "numaN memory does not add up to memory"
        for i, n in custom.items():
            if "cpus" not in n or "memory" not in n:                       # QS:Mem:401,410
                return f"numa{i} lacks cpus or memory"
            if "hostnodes" in n and "policy" not in n:                     # QS:Mem:426-428
                return f"numa{i} has hostnodes without policy"
            if pages and ("hostnodes" not in n or not re.fullmatch(r"\d+", n["hostnodes"])):
                return f"numa{i} must name exactly one host node with hugepages"  # QS:Mem:430,629
            size = int(n["memory"])
            if pages and (size % (PAGE_KB[pages] // 1024) or size % 2):   # QS:Mem:566-567
                return f"numa{i} memory is not a multiple of the page size"
    return None
