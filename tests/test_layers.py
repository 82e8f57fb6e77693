"""The layers hold: every module of vstor sits in one part of LAYERS and
imports only from its own part and from the layers below it, wherever the
import is (function-level imports count); the pure core (metadata model,
planner, renderers, host model, Proxmox's formats, plan-to-steps) can reach
nothing that changes the host or talks to a service; and no module of the
product grows past a few hundred lines."""

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PKG = os.path.join(ROOT, "vstor")

# vstor's parts, the bottom layer first.  A module is in the longest part
# whose name it is or is inside (vstor.pve.hookscript is not vstor.pve).  It
# may import its own part and the parts of lower layers; never a higher
# layer, nor another part of its own layer: those are independent (the
# renderers ask the planner nothing, Proxmox's code nothing of Nova's).
LAYERS = (
    ("vstor.errors", "vstor.records", "vstor.cpulist", "vstor.log_handlers", "vstor.counters"),
    ("vstor.atomic", "vstor.log", "vstor.locking", "vstor.formats"),
    ("vstor.host.model",),
    ("vstor.meta",),
    ("vstor.config",),
    ("vstor.host", "vstor.planner", "vstor.render"),
    ("vstor.backends",),
    ("vstor.runtime",),
    ("vstor.migration", "vstor.pve", "vstor.nova"),
    ("vstor.metrics",),                             # what runs, for Prometheus and vstor top
    ("vstor.hook",),                                # the libvirt hook, past hooks/vstor
    ("vstor.cli", "vstor.pve.hookscript"),          # the CLI; Proxmox's hookscript
    ("vstor.docgen",),                              # built from the CLI's parsers
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}

PURE = ("vstor.meta", "vstor.planner", "vstor.render", "vstor.host.model", "vstor.formats",
        "vstor.runtime.actions", "vstor.runtime.kinds", "vstor.backends.qsd.export", "vstor.backends.vfio_record",
        "vstor.migration.verdict", "vstor.pve.request", "vstor.nova.config", "vstor.nova.instance",
        "vstor.nova.placement")
# What touches the host or a service: process control, sockets, signals, locks,
# libvirt, SPDK's client, QMP, and vstor's own host-changing modules.
FORBIDDEN = ("subprocess", "socket", "signal", "select", "fcntl", "pwd", "grp", "ctypes",
             "multiprocessing", "shutil", "tarfile", "libvirt", "spdk", "qemu",
             "vstor.host.sysfs", "vstor.host.read", "vstor.host.capture", "vstor.host.doctor",
             "vstor.backends.spdk", "vstor.backends.spdk_app", "vstor.backends.vfio", "vstor.backends.qsd.daemon",
             "vstor.runtime.state", "vstor.runtime.journal", "vstor.runtime.executor",
             "vstor.runtime.lifecycle", "vstor.locking", "vstor.runtime.inventory",
             "vstor.runtime.virt", "vstor.runtime.gc", "vstor.runtime.context", "vstor.runtime.supervise",
             "vstor.migration.peer",
             "vstor.cli", "vstor.hook")
MAX_LINES = 800     # modules sized by what they hold (issue 29)


def _modules(top: str = PKG) -> dict[str, str]:
    """Every Python module under `top` (the package, or tests/), by its dotted name."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def _named(mod: str, path: str, modules: dict) -> dict[str, int]:
    """Each module name `mod`'s imports name (and any other imported name,
    left to the callers to tell apart), with the line of its first import."""
    tree = ast.parse(open(path).read(), path)
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        else:
            continue
        for name in names:
            found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def _imports(mod: str, path: str, modules: dict) -> set[str]:
    found = set(_named(mod, path, modules))
    # Importing a.b.c runs a/__init__ and a/b/__init__ too.
    for name in list(found):
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return found


def _reach(start: str, modules: dict) -> dict[str, str]:
    """Every module reachable from `start`, with the module that imported it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        mod = todo.pop()
        if mod not in modules:
            continue
        for dep in _imports(mod, modules[mod], modules):
            if dep not in seen:
                seen[dep] = mod
                todo.append(dep)
    return seen


def _chain(seen, mod) -> str:
    out = [mod]
    while seen.get(out[-1]):
        out.append(seen[out[-1]])
    return " <- ".join(out)


def test_the_pure_core_reaches_nothing_that_touches_the_host():
    modules = _modules()
    pure = [m for m in modules if any(m == p or m.startswith(p + ".") for p in PURE)]
    assert len(pure) > 15
    bad = []
    for mod in pure:
        seen = _reach(mod, modules)
        for dep in seen:
            if any(dep == f or dep.startswith(f + ".") for f in FORBIDDEN):
                bad.append(_chain(seen, dep))
    assert bad == []


def test_the_walk_sees_a_forbidden_import(tmp_path):
    """The check above would catch one: a function-level import counts."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from vstor.backends import vfio\n")
    modules = {"vstor.fake": str(path), **_modules()}
    assert "vstor.backends.vfio" in _reach("vstor.fake", modules)


# -- the order of the parts ---------------------------------------------------------------

def _part(mod: str) -> str | None:
    names = [p for p in LAYER if mod == p or mod.startswith(p + ".")]
    return max(names, key=len, default=None)


def _undeclared(modules: dict) -> list[str]:
    return sorted(m for m in modules if m != "vstor" and _part(m) is None)


def _edges(mod: str, modules: dict) -> list[tuple[str, int, str]]:
    """(module, line, through) for each vstor module that importing `mod`
    runs: each it names, and each package __init__ on the way that is in
    another part (vstor.host for vstor.host.model).  A package whose
    __init__ imports nothing of vstor is no dependency."""
    def inert(pkg: str) -> bool:
        return modules[pkg].endswith("__init__.py") and not any(
            n.startswith("vstor.") for n in _named(pkg, modules[pkg], modules))
    out = []
    for name, line in _named(mod, modules[mod], modules).items():
        while name not in modules and "." in name:     # from vstor.x import f: f is no module
            name = name.rsplit(".", 1)[0]
        if name not in modules or name == "vstor":
            continue
        parts = name.split(".")
        for pkg in (".".join(parts[:i]) for i in range(2, len(parts))):
            if pkg in modules and _part(pkg) != _part(name) and not inert(pkg):
                out.append((pkg, line, f" (the package of {name})"))
        if not inert(name):
            out.append((name, line, ""))
    return out


def _upward(modules: dict) -> list[str]:
    """Each import of a module from a higher layer, or from another part of
    its own layer, as `importer (its part) -> imported (its part) ...,
    file:line`."""
    bad = []
    for mod, path in sorted(modules.items()):
        mine = _part(mod)
        if mine is None:
            continue            # _undeclared says so
        for dep, line, through in _edges(mod, modules):
            theirs = _part(dep)
            if theirs == mine or (theirs is not None and LAYER[theirs] < LAYER[mine]):
                continue
            why = ("in no layer" if theirs is None else "a higher layer" if LAYER[theirs] > LAYER[mine]
                   else "beside it in its layer")
            bad.append(f"{mod} ({mine}) -> {dep}{through} ({theirs}: {why}), "
                       f"{os.path.relpath(path, ROOT)}:{line}")
    return bad


def test_every_module_is_in_a_part_of_the_layers():
    modules = _modules()
    assert _undeclared(modules) == []
    assert [p for p in LAYER if p not in modules] == []       # no name left from a move


def test_no_import_runs_upward_or_sideways():
    assert _upward(_modules()) == []


def _circles(modules: dict) -> list[list[str]]:
    """Each set of two or more vstor modules that import each other, round
    a circle (function-level imports count), as Tarjan's strongly connected
    components of the import graph."""
    graph = {m: sorted({d for d, _line, _through in _edges(m, modules) if d != m and d in modules})
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        walk = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while walk:
            mod, deps = walk[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    walk.append((dep, iter(graph[dep])))
                elif dep in stack:
                    low[mod] = min(low[mod], index[dep])
                continue
            walk.pop()
            if walk:
                low[walk[-1][0]] = min(low[walk[-1][0]], low[mod])
            if low[mod] == index[mod]:
                comp = []
                while True:
                    m = stack.pop()
                    comp.append(m)
                    if m == mod:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle():
    assert _circles(_modules()) == []


def test_an_import_circle_is_found(tmp_path):
    """Two modules of one part that import each other, one of them in a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from vstor.runtime import fake_b\n")
    b.write_text("def f():\n    from vstor.runtime.fake_a import x\n")
    found = _circles({**_modules(), "vstor.runtime.fake_a": str(a), "vstor.runtime.fake_b": str(b)})
    assert found == [["vstor.runtime.fake_a", "vstor.runtime.fake_b"]], found


@pytest.mark.parametrize("mod, code, says", [
    # The five upward imports of issue 23, as they were (at the top, or in a function).
    ("vstor.migration.fake", "def f(ctx):\n    from vstor.cli.runtime import _runtime, _state\n",
     "vstor.migration.fake (vstor.migration) -> vstor.cli.runtime (vstor.cli: a higher layer)"),
    ("vstor.backends.fake", "from vstor.runtime.actions import SpdkAttach, SpdkVhost\n",
     "vstor.backends.fake (vstor.backends) -> vstor.runtime.actions (vstor.runtime: a higher layer)"),
    ("vstor.render.fake", "from vstor.pve import manage\n",
     "vstor.render.fake (vstor.render) -> vstor.pve.manage (vstor.pve: a higher layer)"),
    ("vstor.runtime.fake", "def f():\n    from vstor.migration.peer import Peer\n",
     "vstor.runtime.fake (vstor.runtime) -> vstor.migration.peer (vstor.migration: a higher layer)"),
    # A relative import, `import a.b`, and parts of one layer.
    ("vstor.meta.fake", "from ..planner import plan_domain\n",
     "vstor.meta.fake (vstor.meta) -> vstor.planner (vstor.planner: a higher layer)"),
    ("vstor.formats.fake", "import vstor.meta.names\n",
     "vstor.formats.fake (vstor.formats) -> vstor.meta.names (vstor.meta: a higher layer)"),
    ("vstor.render.fake", "from vstor.planner.ledger import Ledger\n",
     "vstor.render.fake (vstor.render) -> vstor.planner.ledger (vstor.planner: beside it in its layer)"),
    ("vstor.pve.fake", "def f():\n    from vstor.nova import instance\n",
     "vstor.pve.fake (vstor.pve) -> vstor.nova.instance (vstor.nova: beside it in its layer)"),
    ("vstor.pve.fake", "from vstor.pve.hookscript import run\n",
     "vstor.pve.fake (vstor.pve) -> vstor.pve.hookscript (vstor.pve.hookscript: a higher layer)"),
])
def test_an_upward_import_is_found_with_where_it_is(tmp_path, mod, code, says):
    path = tmp_path / "fake.py"
    path.write_text(code)
    bad = _upward({**_modules(), mod: str(path)})
    assert len(bad) == 1 and bad[0].startswith(says), bad
    assert bad[0].endswith(f"fake.py:{code.count(chr(10))}")


def test_a_package_that_imports_is_a_dependency_of_its_modules(tmp_path):
    """vstor.meta.plan imports vstor.host.model, which runs vstor/host/__init__:
    harmless while that imports nothing, upward once it does."""
    init = tmp_path / "__init__.py"
    init.write_text("from vstor.host import sysfs\n")
    bad = _upward({**_modules(), "vstor.host": str(init)})
    assert [b for b in bad if b.startswith("vstor.meta.plan (vstor.meta) -> vstor.host (the package "
                                           "of vstor.host.model) (vstor.host: a higher layer)")], bad


def test_a_new_package_must_be_given_a_layer(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("")
    assert _undeclared({**_modules(), "vstor.gadgets.m": str(path)}) == ["vstor.gadgets.m"]


def test_no_product_module_is_over_800_lines():
    long = {mod: n for mod, path in _modules().items()
            if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert long == {}


def _private_imports(modules: dict) -> list[str]:
    """Every `from vstor.x import _name` between vstor's modules."""
    found = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vstor"):
                found += [f"{mod}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    assert _private_imports(_modules()) == []


def test_a_private_import_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from vstor.meta.document import _hidden\n")
    assert _private_imports({"vstor.x.m": str(path)}) == ["vstor.x.m: vstor.meta.document._hidden"]


# -- the tests: none imports a test module ------------------------------------------------

TESTS = os.path.join(ROOT, "tests")


def _test_tree() -> dict[str, str]:
    return _modules(TESTS)


def _test_module_imports(modules: dict) -> list[str]:
    """Each import of a test module (test_*.py) by any module under tests/
    (a test module, conftest, a helper), wherever the import is, as
    `importer -> imported, file:line`.  What test modules share lives in a
    module of its own (tests/helpers.py, tests/e2e/helpers.py) or a conftest."""
    bad = []
    for mod, path in sorted(modules.items()):
        for name, line in sorted(_named(mod, path, modules).items()):
            while name not in modules and "." in name:       # from tests.x import f: f is no module
                name = name.rsplit(".", 1)[0]
            if name in modules and name != mod and name.rsplit(".", 1)[-1].startswith("test_"):
                bad.append(f"{mod} -> {name}, {os.path.relpath(path, ROOT)}:{line}")
    return bad


def test_no_module_of_the_tests_imports_a_test_module():
    modules = _test_tree()
    assert len([m for m in modules if m.startswith("tests.e2e.test_")]) > 5
    assert _test_module_imports(modules) == []


@pytest.mark.parametrize("mod, code, says", [
    # The forms tests/e2e used before its helpers.py: relative, absolute, in a function.
    ("tests.e2e.test_fake", "from .test_hook import cleanup as undefine\n", "tests.e2e.test_fake -> tests.e2e.test_hook"),
    ("tests.e2e.test_fake", "def f():\n    from tests.test_guestkit import addressed\n",
     "tests.e2e.test_fake -> tests.test_guestkit"),
    ("tests.test_fake", "from tests.e2e import test_hook\n", "tests.test_fake -> tests.e2e.test_hook"),
    ("tests.test_fake", "import tests.test_cells\n", "tests.test_fake -> tests.test_cells"),
    ("tests.e2e.fake", "from ..test_cells import running\n", "tests.e2e.fake -> tests.test_cells"),
])
def test_an_import_of_a_test_module_is_found_with_where_it_is(tmp_path, mod, code, says):
    path = tmp_path / "fake.py"
    path.write_text(code)
    bad = _test_module_imports({**_test_tree(), mod: str(path)})
    assert bad == [f"{says}, {os.path.relpath(path, ROOT)}:{code.count(chr(10))}"], bad


def test_the_synthetic_host_builder_is_not_in_the_product():
    assert not os.path.exists(os.path.join(PKG, "testing"))


@pytest.mark.process
@pytest.mark.parametrize("mod", ["vstor.planner", "vstor.render.libvirt", "vstor.meta.metadata"])
def test_importing_a_pure_module_loads_no_service_client(mod):
    """At run time too: a fresh interpreter importing it has not loaded them."""
    import subprocess
    code = (f"import sys, {mod}; bad = [m for m in ('subprocess', 'libvirt', 'spdk', 'qemu', "
            "'vstor.host.sysfs', 'vstor.backends.vfio') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.process
def test_the_hooks_release_path_loads_no_lxml_nor_the_planner():
    """The hook's release and reconnect read the domain's name and UUID with
    expat and the state record as JSON: what they import (vstor.hook and
    vstor.runtime.recorded, fresh) loads neither lxml, the declarations nor
    the planner (19 ms of every stop when holders.py imported the Ledger
    at its top; docs/performance.md, "The hook")."""
    import subprocess
    code = ("import sys, vstor.hook, vstor.runtime.recorded; print(sorted(m for m in sys.modules "
            "if m == 'lxml' or m.startswith(('lxml.', 'vstor.planner', 'vstor.meta.document', "
            "'vstor.meta.xmlmodel'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
