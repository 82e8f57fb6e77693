"""One class per step kind (vstor.runtime.kinds): each defines every part
of a kind itself, reaches the host only through the operations the
executor passes in, keeps its journal form, and its dry run is what
`vstor prepare --dry-run` prints.

Regenerate the golden dry run after an intended change with:
    VSTOR_REGENERATE_GOLDEN=1 python3 -m pytest tests/test_kinds.py
"""

import ast
import inspect
import json
import os
import subprocess
import sys

import pytest

from tests.hostlayout import build_tree
from tests.helpers import on, running_nvme_on_a, two  # noqa: F401 (two: a fixture)
from vstor.runtime import actions, executor, kinds
from vstor.runtime.kinds.base import Kind, StepKind

HERE = os.path.dirname(__file__)
ROOT = os.path.join(HERE, "..")
GOLDEN = os.path.join(HERE, "golden", "prepare-dry-run.txt")
NS = "https://vstor.dev/xmlns/domain/1"


def test_the_six_kinds_are_registered_by_their_names():
    assert list(kinds.KINDS) == ["vfio-bind", "spdk-attach", "spdk-vhost", "qsd-export", "nvmf-export", "gate"]
    for name, cls in kinds.KINDS.items():
        assert cls.kind == name
        assert getattr(actions, cls.__name__) is cls      # what callers import today


# The interface, as the Protocol declares it; what each kind must say itself
# (no default in Kind): one module tells everything a kind does.
METHODS = [m for m in vars(StepKind) if not m.startswith("_")]
ATTRIBUTES = list(StepKind.__annotations__)
OWN = [m for m in METHODS if m not in vars(Kind)] + ["kind"]


@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_each_kind_is_a_step_kind_saying_itself_what_has_no_default(name):
    cls = kinds.KINDS[name]
    assert issubclass(cls, Kind)
    assert [m for m in METHODS if not callable(getattr(cls, m, None))] == []
    assert [a for a in ATTRIBUTES if not hasattr(cls, a)] == []
    assert [m for m in OWN if m not in vars(cls)] == []
    assert isinstance(vars(cls)["from_data"], classmethod)
    assert isinstance(cls.parallel, bool) and isinstance(cls.private, bool)
    assert isinstance(cls.rpc_methods, tuple)
    params = {m: list(inspect.signature(getattr(cls, m)).parameters) for m in METHODS}
    assert params == {m: list(inspect.signature(getattr(StepKind, m)).parameters) for m in METHODS}
    assert params["observe"] == ["self", "rt", "others"] and params["undo"] == ["self", "rt", "others"]
    for m in ("preflight", "do", "in_use", "check", "repair"):
        assert params[m] == ["self", "rt"], m


def test_the_interface_is_the_thirteen_methods_and_five_attributes():
    assert sorted(METHODS) == sorted(["describe", "dry_run", "to_data", "from_data", "makes", "preflight",
                                      "observe", "do", "undo", "undo_waits", "in_use", "check", "repair"])
    assert sorted(ATTRIBUTES) == ["kind", "parallel", "private", "rpc_methods", "whole_domain"]


def test_the_journal_reads_parallel_and_private_from_the_classes():
    """As before the classes said it: one daemon per disk side by side; the
    domain's own daemons and vhost controllers without the host lock."""
    assert executor.PARALLEL == {"qsd-export", "gate"}
    assert executor.PRIVATE == {"qsd-export", "spdk-vhost", "gate"}


def _ops_used(cls) -> set[str]:
    """Every attribute the kind's module reads from a parameter named rt,
    and every operation of a backend's (`rt.qsd.start`: "qsd.start")."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "rt":
            out.add(n.attr)
        elif (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
              and isinstance(n.value.value, ast.Name) and n.value.value.id == "rt"):
            out.add(f"{n.value.attr}.{n.attr}")
    return out


@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_a_kind_asks_the_host_only_for_operations_the_executor_passes_in(name):
    from vstor.config import Config
    rt = executor.Runtime(Config(), object())
    offered = {a for a in vars(rt) if not a.startswith("_")}
    offered |= {a for a in vars(executor.Runtime) if not a.startswith("_")}
    # One attribute per backend, each with its operations.
    offered |= {f"{a}.{op}" for a in vars(rt) if not a.startswith("_")
                for op in dir(type(getattr(rt, a))) if not op.startswith("_")
                and type(getattr(rt, a)).__module__ == executor.__name__}
    offered |= {f"spdk.{op}" for op in _spdk_methods()}
    backends = {"qsd", "vfio", "sources", "ownership", "spdk"}
    used = {u for u in _ops_used(kinds.KINDS[name]) if "." not in u or u.split(".")[0] in backends}
    assert used and used <= offered, used - offered


def _spdk_methods() -> set[str]:
    from vstor.backends.spdk import SpdkClient
    return {op for op in dir(SpdkClient) if not op.startswith("_")}


def test_the_runtime_has_one_attribute_per_backend():
    from vstor.config import Config
    rt = executor.Runtime(Config(), object())
    backends = {a for a in vars(rt) if not a.startswith("_")} - {"cfg", "sysfs", "dry_run", "handover", "force"}
    assert backends == {"qsd", "vfio", "sources", "ownership"}
    assert isinstance(vars(executor.Runtime)["spdk"], property)


# One of each, with every optional part set: the journal gives each back.
def _samples():
    from vstor.backends.qsd.export import QsdExport as Spec
    from vstor.backends.vfio_record import BindRecord
    from vstor.meta.plan import AttachPath
    return [
        actions.VfioBind("0000:5e:00.0", BindRecord("0000:5e:00.0", "nvme", None,
                                                    (BindRecord("0000:5e:00.1", None, "x"),))),
        actions.VfioBind("0000:3b:00.0"),
        actions.SpdkAttach("vs_nvmf_1", (AttachPath(trtype="RDMA", traddr="192.168.100.8", trsvcid=4420,
                                                    subnqn="nqn.2016-06.io.spdk:cnode1"),
                                         AttachPath(trtype="RDMA", traddr="192.168.101.8", trsvcid=4420,
                                                    subnqn="nqn.2016-06.io.spdk:cnode1")), found=True),
        actions.SpdkVhost("k1-vdb", "vs_0000_5e_00_0n1", 18, True, "/run/vstor/vhost/k1-vdb", "kvm"),
        actions.QsdExport(Spec(run_dir="/run/vstor/qsd", name="k1-vdc", source="/srv/k1.raw", kind="file",
                               socket_path="/run/vstor/vhost/k1-vdc", readonly=True, queues=2,
                               cpus=(16, 48))),
        actions.NvmfExport("nqn.2016-06.io.vstor:migrate:k1-vdb", "vs_0000_5e_00_0n1", "TCP", "IPv4",
                           "10.0.0.1", 4420, "nqn.2014-08.org.nvmexpress:uuid:0f0e"),
        actions.Gate("/run/vstor/vhost/k1.vstor-prepared", "k1", "kvm"),
    ]


def test_every_kind_survives_its_journal_form_and_knows_what_it_makes():
    made = _samples()
    assert {s.kind for s in made} == set(kinds.KINDS)
    for step in made:
        entry = json.loads(json.dumps(executor.encode(step, "done")))
        assert entry["kind"] == step.kind and entry["state"] == "done"
        again = executor.decode(entry)
        assert again == step and kinds.identity(again) == kinds.identity(step)
        assert step.describe() and all(isinstance(line, str) and line for line in step.dry_run())
    assert [kinds.identity(s)[1] for s in made] == [
        "0000:5e:00.0", "0000:3b:00.0", "vs_nvmf_1", "k1-vdb", "k1-vdc", "nqn.2016-06.io.vstor:migrate:k1-vdb",
        "/run/vstor/vhost/k1.vstor-prepared"]


# -- the dry run an operator reads -------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A two-socket host tree, an image, and a domain with an SPDK disk on
    local NVMe (bind, attach, vhost), an SPDK disk over NVMe-oF and a qsd file."""
    d = str(tmp_path_factory.mktemp("kinds"))
    root = build_tree(os.path.join(HERE, "hosts", "two-socket.toml"), os.path.join(d, "host"))
    with open(os.path.join(d, "k1.raw"), "wb") as f:
        f.truncate(1 << 20)
    conf = os.path.join(d, "vstor.conf")
    with open(conf, "w") as f:
        f.write(f"[cpu]\nreactors = 2,18\n[paths]\nstate_dir = {d}/state\nvhost_dir = {d}/vhost\n"
                f"qsd_dir = {d}/qsd\nimages = {d}\n")
    with open(os.path.join(d, "k1.xml"), "w") as f:
        f.write(f"""<domain type='kvm'><name>k1</name><memory unit='MiB'>2048</memory><vcpu>2</vcpu>
          <metadata><vstor:vstor xmlns:vstor='{NS}'>
          <vstor:disk target='vdb' mode='vhost' backend='spdk'>
            <vstor:nvme controller='0000:5e:00.0' namespace='1'/></vstor:disk>
          <vstor:disk target='vdc' mode='vhost' backend='spdk' readonly='yes'>
            <vstor:nvmf transport='rdma' traddr='192.168.100.8' trsvcid='4420'
                        subnqn='nqn.2016-06.io.spdk:cnode1' namespace='1'>
              <vstor:path traddr='192.168.101.8' trsvcid='4420'/></vstor:nvmf></vstor:disk>
          <vstor:disk target='vdd' backend='qsd'><vstor:file path='{d}/k1.raw'/></vstor:disk>
          </vstor:vstor></metadata><os><type machine='q35'>hvm</type></os></domain>""")
    return type("Site", (), {"dir": d, "root": root, "conf": conf})


def vstor(site, *args):
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", site.conf,
                          "--host-root", site.root, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


@pytest.mark.process
def test_prepare_dry_run_prints_each_steps_own_description_and_dry_run(site):
    """What `vstor prepare --dry-run` prints is, step by step, the kind's
    describe() and dry_run() of the steps the recorded plan builds: no
    other text about a step anywhere; and that text is the golden file's
    (taken from vstor before the kinds were classes)."""
    from vstor.config import load as load_config
    from vstor.meta.document import Domain
    rendered = os.path.join(site.dir, "k1-rendered.xml")
    vstor(site, "render", os.path.join(site.dir, "k1.xml"), "-o", rendered)
    out = vstor(site, "prepare", "--dry-run", rendered)
    dom = Domain.load(rendered)
    assert dom.gate() == f"{site.dir}/vhost/k1.vstor-prepared"     # the mark render names, prepare writes
    built = actions.build(dom.recorded_plan(), load_config(site.conf), dom.gate())
    assert {s.kind for s in built} == set(kinds.KINDS) - {"nvmf-export"}     # a migration's only
    expected = ["Preparing k1 (dry run):"]
    for step in built:
        expected += [f"  would {step.describe()}", *(f"      {line}" for line in step.dry_run())]
    assert out.splitlines() == expected
    from vstor.backends.qsd.export import JAIL
    text = (out.replace(site.dir, "@WORK@")
            .replace(f"{sys.executable} -I -S {JAIL}", "@PYTHON@ -I -S @JAIL@"))
    if os.environ.get("VSTOR_REGENERATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read(), "the dry run changed; regenerate with VSTOR_REGENERATE_GOLDEN=1 if intended"
    assert not os.path.exists(os.path.join(site.dir, "state", "domains", "k1.json"))   # a dry run records nothing


@pytest.mark.process
def test_migrate_prepare_dry_run_prints_the_exports_own_dry_run(two, capsys):
    """nvmf-export, a migration's kind: `vstor migrate prepare --dry-run`
    prints its dry run under the line naming the disk: the subsystem made
    for the migration's one host NQN, never for any host."""
    xml_path = running_nvme_on_a(two)
    capsys.readouterr()
    assert on(two, "a", "migrate", "prepare", xml_path, "--to", "hostb", "-o", f"{two.work}/o.xml",
              "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  would export vdb "))
    nqn, host = lines[at].split(" as ")[1].split()[0], lines[at].rsplit("host NQN ", 1)[1].split()[0]
    rpcs = [json.loads(line.removeprefix("      SPDK RPC: ")) for line in lines[at + 1:at + 6]]
    assert [r["method"] for r in rpcs] == ["nvmf_create_transport", "nvmf_create_subsystem",
                                           "nvmf_subsystem_add_ns", "nvmf_subsystem_add_listener",
                                           "nvmf_subsystem_add_host"]
    assert all(r["params"].get("nqn", nqn) == nqn for r in rpcs)
    assert rpcs[1]["params"]["allow_any_host"] is False and rpcs[4]["params"]["host"] == host
    assert rpcs[2]["params"]["namespace"] == {"bdev_name": "vs_0000_5f_00_0n1", "nsid": 1}
    assert not lines[at + 6].startswith("      ")
