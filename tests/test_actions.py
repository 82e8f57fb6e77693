"""From a plan to its steps, for every plan the planner produces here: every
host layout in tests/hosts x every template (and, per layout, one disk on each
of its NVMe controllers in every mode and backend) x two configs.  Each plan
builds its steps, the steps survive their journal form, and their dry-run
output names exactly the resources the plan names, no more and no fewer."""

import glob
import json
import os
import re

from vstor.config import Config
from vstor.errors import BadInput, DoesNotFit
from vstor.meta.document import Domain
from vstor.planner import Request, plan_domain
from vstor.planner.ledger import Ledger
from vstor.runtime import actions

HERE = os.path.dirname(__file__)
NS = "https://vstor.dev/xmlns/domain/1"
LAYOUTS = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(HERE, "hosts", "*.toml")))
TEMPLATES = sorted(glob.glob(os.path.join(HERE, "..", "xml-templates", "*.xml")))
CONFIGS = [Config(reactors=(2, 18)),
           Config(reactors=(1, 2, 3, 17, 18, 19), default_backend="spdk", vhost_dir="/srv/vs/sock",
                  hostnqn="nqn.2014-08.org.nvmexpress:uuid:0f0e")]
VARIANTS = ["mode='passthrough'", "mode='vhost' backend='spdk'", "mode='vhost' backend='qsd'",
            "mode='auto'", "mode='passthrough' guest='spdk'"]


def _requests(host):
    for path in TEMPLATES:
        yield os.path.basename(path), Request.from_domain(Domain.load(path))
    free = [d.name for d in host.block_devices if not (d.in_use or d.stacks_on)][:2]
    blocks = "".join(f"<vstor:disk target='vd{t}'><vstor:block path='/dev/{n}'/></vstor:disk>"
                     for t, n in zip("cd", free))
    for ctrl in host.controllers:
        for variant in VARIANTS:
            nsid = ctrl.namespaces[0].nsid if ctrl.namespaces else 1
            dom = Domain.parse(f"""<domain type='kvm'><name>p1</name><memory unit='MiB'>2048</memory>
              <vcpu>2</vcpu><metadata><vstor:vstor xmlns:vstor='{NS}'>
              <vstor:disk target='vdb' {variant}><vstor:nvme controller='{ctrl.address}' namespace='{nsid}'/>
              </vstor:disk>{blocks}
              </vstor:vstor></metadata><os><type machine='q35'>hvm</type></os></domain>""")
            yield f"{ctrl.address} {variant}", Request.from_domain(dom)


def _plans(host_model):
    for layout in LAYOUTS:
        host = host_model(layout)
        for cfg in CONFIGS:
            for name, req in _requests(host):
                try:
                    yield f"{layout}/{name}/{cfg.default_backend}", cfg, plan_domain(host, cfg, req, Ledger())
                except (BadInput, DoesNotFit):
                    continue        # not a plan the planner produces


def _named_by_plan(plan, cfg):
    out = {"pci": set(), "names": set(), "sockets": set(), "sources": set(), "masks": set(),
           "traddrs": set()}
    for d in plan.disks:
        if d.bind:
            out["pci"].add(d.controller)
        if d.backend == "spdk":
            out["names"] |= {d.spdk_controller, d.bdev}
            out["masks"].add(hex(1 << d.reactor))
            out["traddrs"] |= {a.traddr for a in d.attach}
            out["pci"] |= {a.traddr for a in d.attach if a.trtype == "PCIe"}
        if d.socket:
            out["sockets"].add(d.socket)
        if d.backend == "qsd":
            out["sources"].add(d.device or d.source.path)
    return out


def _named_by_output(text, cfg):
    return {
        "pci": set(re.findall(r"\b[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\b", text)),
        "names": set(re.findall(r"\bvs_[A-Za-z0-9_]+", text)),
        "sockets": set(re.findall(re.escape(cfg.vhost_dir) + r"/[A-Za-z0-9_.+-]+", text)),
        "sources": set(re.findall(r"# vstor opens source=(\S+) itself", text)),
        "masks": set(re.findall(r'"cpumask": "(0x[0-9a-f]+)"', text)),
        "traddrs": set(re.findall(r'"traddr": "([^"]+)"', text)),
    }


def test_every_plan_builds_steps_whose_dry_run_names_exactly_its_resources(host_model):
    seen = 0
    kinds = set()
    backends = set()
    for where, cfg, plan in _plans(host_model):
        steps = actions.build(plan, cfg)
        for step in steps:        # the journal's form gives the same step back
            assert actions.from_json(json.loads(json.dumps(actions.to_json(step, "done")))) == step, where
        text = "\n".join(line for s in steps for line in (s.describe(), *s.dry_run()))
        assert _named_by_output(text, cfg) == _named_by_plan(plan, cfg), where
        seen += 1
        kinds |= {s.kind for s in steps}
        backends |= {d.backend for d in plan.disks}
    assert seen > 50
    assert kinds == {"vfio-bind", "spdk-attach", "spdk-vhost", "qsd-export"}
    assert backends == {"vfio", "spdk", "qsd"}
