"""The layers hold: the pure core (metadata model, planner, renderers, host
model, plan-to-steps) can reach nothing that changes the host or talks to a
service, whatever it imports and wherever (function-level imports count),
and no module of the product grows past a few hundred lines."""

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PKG = os.path.join(ROOT, "vstor")

PURE = ("vstor.meta", "vstor.planner", "vstor.render", "vstor.host.model",
        "vstor.runtime.actions", "vstor.runtime.kinds", "vstor.backends.qsd.export", "vstor.backends.vfio_record",
        "vstor.migration.verdict", "vstor.pve.config", "vstor.pve.vm",
        "vstor.pve.storage", "vstor.nova.config", "vstor.nova.instance")
# What touches the host or a service: process control, sockets, signals, locks,
# libvirt, SPDK's client, QMP, and vstor's own host-changing modules.
FORBIDDEN = ("subprocess", "socket", "signal", "select", "fcntl", "pwd", "grp", "ctypes",
             "multiprocessing", "shutil", "tarfile", "libvirt", "spdk", "qemu",
             "vstor.host.sysfs", "vstor.host.read", "vstor.host.capture", "vstor.host.doctor",
             "vstor.backends.spdk", "vstor.backends.spdk_app", "vstor.backends.vfio", "vstor.backends.qsd.daemon",
             "vstor.runtime.state", "vstor.runtime.journal", "vstor.runtime.steps",
             "vstor.runtime.lifecycle", "vstor.locking", "vstor.runtime.inventory",
             "vstor.runtime.virt", "vstor.runtime.gc", "vstor.cli", "vstor.hook")
MAX_LINES = 350


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def _imports(mod: str, path: str, modules: dict) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
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


def test_no_product_module_is_over_350_lines():
    long = {mod: n for mod, path in _modules().items()
            if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert long == {}


def test_the_synthetic_host_builder_is_not_in_the_product():
    assert not os.path.exists(os.path.join(PKG, "testing"))


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
