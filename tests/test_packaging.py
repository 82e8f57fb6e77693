"""How vstor is installed: the Debian package's inputs (debian/), and the
Nova driver as nova-compute loads it (nova.virt.driver.load_compute_driver)
through the finder vstor installs beside itself, never a file in Nova's
package.

The wheel tests (a fresh venv, `pip install vstor-*.whl[nova]`, Nova
reinstalled and upgraded over it, vstor uninstalled) take a minute and
install Nova from PyPI: they run in CI's package step
(scripts/ci-package.sh sets VSTOR_PACKAGE_TESTS=1), which also builds,
installs, smokes and purges the Debian package."""

import os
import re
import subprocess
import sys

import pytest

import vstor
from tests.nova import ROOT, nova_python
from vstor.nova import install

PACKAGE_STEP = pytest.mark.skipif(not os.environ.get("VSTOR_PACKAGE_TESTS"),
                                  reason="the package step's test (scripts/ci-package.sh)")
# nova-compute's own way: its config parsed, then load_compute_driver.
LOAD = """
import sys, warnings
warnings.simplefilter("ignore")
from nova import config, objects
from nova.virt import driver, virtapi
config.parse_args(["nova-compute"], default_config_files=[])
objects.register_all()
if sys.argv[1:] == ["class"]:     # no libvirt-python here (.nova-venv): the class Nova would build
    from oslo_utils import importutils
    cls = importutils.import_class("nova.virt.vstor.VstorLibvirtDriver")
    assert issubclass(cls, driver.ComputeDriver)
    print(cls.__module__ + "." + cls.__name__)
else:
    drv = driver.load_compute_driver(virtapi.VirtAPI(), "vstor.VstorLibvirtDriver")
    assert isinstance(drv, driver.ComputeDriver)
    print(type(drv).__module__ + "." + type(drv).__name__)
"""


def _run(argv, **kw) -> subprocess.CompletedProcess:
    """Another interpreter's run: without this one's PYTHONPATH (a checkout on
    it would be the vstor pip sees as installed already)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, **kw)


def _loads(python: str, *how: str) -> None:
    done = _run([python, "-c", LOAD, *how], cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "vstor.nova.driver.VstorLibvirtDriver"


def _site(python: str) -> str:
    ask = "import os; from vstor.nova.install import _vstor_dist; print(os.path.dirname(_vstor_dist()))"
    return _run([python, "-c", ask], cwd="/").stdout.strip()


# -- the Debian package's inputs ----------------------------------------------------

def _read(*path) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_the_debian_version_is_vstors():
    first = _read("debian", "changelog").splitlines()[0]
    assert re.match(rf"vstor \({re.escape(vstor.__version__)}(-[0-9.]+)?\) ", first), first


def test_the_hook_has_the_lines_the_package_fills():
    """debian/rules writes the package's hook with vstor.cli.hooks.packaged_hook
    (Debian's interpreter, dist-packages and apt's fix into exactly these
    lines, as `vstor hooks install` does for a venv), the form `vstor
    doctor` checks the installed hook against."""
    from vstor.cli.hooks import packaged_hook
    lines = _read("hooks", "vstor").splitlines()
    assert lines.count("PYTHON=python3") == 1 and lines.count("SYSPATH=") == 1
    assert "from vstor.cli.hooks import packaged_hook" in _read("debian", "rules")
    ours = packaged_hook().splitlines()
    assert [a for a, b in zip(lines, ours) if a != b] == [
        "PYTHON=python3", "SYSPATH=", "FIX='reinstall vstor, then: vstor hooks install'"]
    assert "PYTHON=/usr/bin/python3" in ours and "SYSPATH=/usr/lib/python3/dist-packages" in ours


def test_the_maintainer_scripts_never_name_the_slice_the_daemons_run_in():
    """dh_installsystemd stops or restarts every unit it is given on an
    upgrade or a removal; vstor.slice holds every running domain's daemons."""
    rules = _read("debian", "rules")
    installs = [line for line in rules.splitlines() if "dh_installsystemd" in line and not line.startswith("#")]
    assert installs and not any("vstor.slice" in line for line in installs)
    assert any("--no-stop-on-upgrade --no-restart-after-upgrade vstor-gc.service" in line for line in installs)


def test_the_vendored_wheels_satisfy_setup_cfg():
    required = dict(re.findall(r"^\s+([A-Za-z0-9_.]+)>=([0-9.]+)$", _read("setup.cfg"), re.M))
    vendored = {}
    for line in _read("debian", "vendor.txt").splitlines():
        if line and not line.startswith("#"):
            wheel, digest = line.split()
            name, version = wheel.split("-")[:2]
            vendored[name.replace("_", ".")] = version
            assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert set(vendored) == {"qemu.qmp", "spdk"}

    def key(v):
        return tuple(int(p) for p in v.split("."))
    for name, version in vendored.items():
        assert key(version) >= key(required[name]), (name, version, required[name])


def test_the_units_the_package_installs_exist():
    listed = [line.split()[0] for line in _read("debian", "vstor.install").splitlines() if line]
    for path in listed:
        assert os.path.isfile(os.path.join(ROOT, path)) or path.startswith(("etc/", "man/", "completion/")), path
    assert {"systemd/vstor-gc.service", "systemd/vstor-gc.timer", "systemd/vstor.slice"} <= set(listed)
    timer = _read("systemd", "vstor-gc.timer")
    assert "WantedBy=timers.target" in timer
    assert "ExecStart=/usr/bin/vstor gc\n" in _read("systemd", "vstor-gc.service")


# -- the Nova driver: an editable install (.nova-venv, as the tests make it) ---------

@pytest.mark.process
def test_install_driver_owns_what_it_writes_and_removes_the_old_shim():
    """An editable install cannot ship vstor-nova.pth: install-driver writes
    it and the finder into vstor's site-packages and adds both to vstor's
    RECORD (pip uninstall vstor removes them); a nova/virt/vstor.py that an
    older vstor wrote is removed, and --dry-run only says so."""
    python = nova_python()
    cmd = [python, "-m", "vstor.cli.main", "nova", "install-driver"]
    done = _run(cmd, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    site = _site(python)
    for name in (install.PTH, install.FINDER):
        assert os.path.isfile(os.path.join(site, name))
    record = [row.split(",")[0] for row in open(os.path.join(site, f"vstor-{vstor.__version__}.dist-info",
                                                             "RECORD")).read().splitlines()]
    assert install.PTH in record and install.FINDER in record
    nova_virt = _run([python, "-c", "import os, nova.virt; print(os.path.dirname(nova.virt.__file__))"],
                     cwd="/").stdout.strip()
    legacy = os.path.join(nova_virt, "vstor.py")
    with open(legacy, "w") as f:
        f.write(install.LEGACY_SHIM)
    try:
        dry = _run([*cmd, "--dry-run"], cwd=ROOT)
        assert dry.returncode == 0 and f"Would remove {legacy}" in dry.stdout, dry.stdout + dry.stderr
        assert os.path.exists(legacy)
        done = _run(cmd, cwd=ROOT)
        assert done.returncode == 0 and not os.path.exists(legacy), done.stdout + done.stderr
    finally:
        if os.path.exists(legacy):
            os.unlink(legacy)
    again = _run([*cmd, "--dry-run"], cwd=ROOT)
    assert "Nova loads vstor's driver already" in again.stdout, again.stdout + again.stderr
    _loads(python, "class")


def test_install_driver_leaves_a_module_it_did_not_write(tmp_path):
    (tmp_path / "vstor.py").write_text("# someone else's\n")
    with pytest.raises(Exception) as e:
        install.plan(str(tmp_path))
    assert "is not the module vstor wrote" in str(e.value)


# -- the wheel, in a fresh venv with Nova (the package step) ---------------------------

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """`python3 -m build --wheel`, as the install guide says (PyPA's build, in a venv of its own)."""
    out = tmp_path_factory.mktemp("wheel")
    venv = out / "build-venv"
    python = str(venv / "bin" / "python3")
    for argv in ([sys.executable, "-m", "venv", str(venv)],
                 [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "build"],
                 [python, "-m", "build", "--wheel", "--outdir", str(out), ROOT]):
        done = _run(argv)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
    (found,) = [p for p in os.listdir(out) if p.startswith("vstor-") and p.endswith(".whl")]
    return str(out / found)


@pytest.mark.process
@PACKAGE_STEP
def test_the_wheel_into_a_venv_with_nova_survives_novas_upgrade(wheel, tmp_path):
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    python, pip = str(venv / "bin" / "python3"), [str(venv / "bin" / "python3"), "-m", "pip", "install",
                                                   "-q", "--disable-pip-version-check"]
    done = _run([*pip, f"{wheel}[nova]", "nova==34.0.0"])
    assert done.returncode == 0, done.stderr[-3000:]
    _loads(python)
    site = _site(python)
    nova_virt = os.path.join(site, "nova", "virt")
    assert not os.path.exists(os.path.join(nova_virt, "vstor.py"))     # nothing in Nova's package
    # Nova replaced under it: an older release, then back to the newer one,
    # and a reinstall of the same (pip removes every file Nova's RECORD lists).
    for step in (["--no-deps", "nova==33.0.2"], ["--no-deps", "--upgrade", "nova==34.0.0"],
                 ["--no-deps", "--force-reinstall", "nova==34.0.0"]):
        done = _run([*pip, *step])
        assert done.returncode == 0, (step, done.stderr[-2000:])
        _loads(python)
    # Nothing of vstor's stays behind it.
    done = _run([python, "-m", "pip", "uninstall", "-y", "-q", "vstor"])
    assert done.returncode == 0, done.stderr
    for name in (install.PTH, install.FINDER, "vstor"):
        assert not os.path.exists(os.path.join(site, name)), name
    gone = _run([python, "-c", "import nova.virt.vstor"], cwd="/")
    assert gone.returncode == 1 and "No module named 'nova.virt.vstor'" in gone.stderr, gone.stderr


# -- upgrades: what an older vstor recorded still loads ------------------------------

RECORDS = os.path.join(ROOT, "tests", "records")


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(RECORDS, "0.1.0"))))
def test_plan_records_of_vstor_0_1_0_still_load(name):
    """Domains planned by vstor 0.1.0 (tests/records/0.1.0: frozen copies of
    what it wrote, never regenerated) start and stop with this vstor: an
    upgrade must not ask for a re-plan of a running domain."""
    from vstor.meta.document import Domain
    dom = Domain.load(os.path.join(RECORDS, "0.1.0", name))
    plan = dom.recorded_plan()
    assert plan is not None and plan.version == "2" and plan.disks


def test_a_plan_record_from_a_newer_vstor_is_refused_not_replanned():
    from vstor.errors import BadInput
    from vstor.meta.document import Domain
    with open(os.path.join(RECORDS, "0.1.0", "qsd-file.xml")) as f:
        text = f.read().replace('<vstor:plan version="2"', '<vstor:plan version="3"')
    with pytest.raises(BadInput) as e:
        Domain.parse(text).recorded_plan()
    assert "newer than this vstor's 2" in e.value.message and "install the vstor release" in e.value.hint


def test_state_records_without_a_format_load_and_newer_ones_are_refused(tmp_path):
    """A record vstor 0.1.0 wrote has no "format" (format 0): read as before;
    new records say format 1; a format this vstor does not know is refused
    (exit 4), never read as if it held nothing."""
    import json
    from vstor.runtime.state import RECORD_FORMAT, DamagedRecord, Record, StateDir
    state = StateDir(str(tmp_path))
    os.makedirs(state.domains)
    old = {"key": "vm1", "domain": "vm1", "uuid": None, "status": "prepared", "holding": {},
           "steps": [], "updated": 0.0}
    with open(os.path.join(state.domains, "vm1.json"), "w") as f:
        json.dump(old, f)
    assert state.load("vm1") == Record.from_json(old)
    state.save(state.load("vm1"))
    with open(os.path.join(state.domains, "vm1.json")) as f:
        assert json.load(f)["format"] == RECORD_FORMAT
    with open(os.path.join(state.domains, "vm2.json"), "w") as f:
        json.dump({**old, "key": "vm2", "domain": "vm2", "format": RECORD_FORMAT + 1}, f)
    with pytest.raises(DamagedRecord) as e:
        state.load("vm2")
    assert "a newer vstor wrote it" in e.value.message and e.value.exit_code == 4


@pytest.mark.process
def test_the_maintainer_scripts_are_posix_sh():
    for name in ("vstor.prerm", "vstor.postrm"):
        done = _run(["sh", "-n", os.path.join(ROOT, "debian", name)])
        assert done.returncode == 0, (name, done.stderr)
        assert _read("debian", name).startswith("#!/bin/sh\n") and "#DEBHELPER#" in _read("debian", name)


# -- the package's prerm and postrm ------------------------------------------------------------


@pytest.mark.process
def test_prerm_refuses_a_remove_when_the_config_naming_the_state_dir_cannot_be_read(tmp_path):
    """vstor's records live where vstor.conf says: a config whose [paths]
    state_dir does not read (a typo made since) is no reason to look in the
    default place, find nothing there and remove vstor while it holds
    backends nobody would then release.  A problem elsewhere in the file
    hides nothing: the records are judged where it says (issue 30: it
    never blocks a removal on its own)."""
    import subprocess
    state = tmp_path / "state"
    (state / "domains").mkdir(parents=True)
    (state / "domains" / "web1.json").write_text("{}")
    conf = tmp_path / "vstor.conf"
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": root, "VSTOR_CONFIG": str(conf)}
    env.pop("VSTOR_REMOVE_KEEP_BACKENDS", None)

    def prerm():
        return subprocess.run(["sh", os.path.join(root, "debian", "vstor.prerm"), "remove"], env=env,
                              capture_output=True, text=True, timeout=60)
    conf.write_text(f"[paths]\nstate_dr = {state}\n")
    done = prerm()
    assert done.returncode == 1, done
    assert "unknown key 'state_dr'" in done.stderr and "VSTOR_REMOVE_KEEP_BACKENDS=1" in done.stderr
    conf.write_text(f"[PATHS]\nstate_dir = {state}\n")     # no match by name: still not the default
    done = prerm()
    assert done.returncode == 1 and "unknown section [PATHS]" in done.stderr, done
    conf.write_text(f"[paths]\nstate_dir = {state}\n[cpu]\nreactors = 2-\n")
    done = prerm()
    assert done.returncode == 1 and "holds backends for: web1" in done.stderr, done
    (state / "domains" / "web1.json").unlink()
    done = prerm()
    assert done.returncode == 0, done


@pytest.mark.process
def test_purge_keeps_run_vstor_after_a_removal_that_kept_backends_recorded_elsewhere(tmp_path):
    """[paths] state_dir elsewhere, vhost_dir and qsd_dir at their defaults
    under /run/vstor: a removal forced with VSTOR_REMOVE_KEEP_BACKENDS=1
    leaves daemons serving from /run/vstor (their sockets, their pidfiles,
    which the guide says to stop them by), and purge must not delete those
    because /run/vstor/state holds no record.  In a private mount namespace
    with its own /run."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a private /run)")
    root = os.path.join(os.path.dirname(__file__), "..")
    state = tmp_path / "state"
    (state / "domains").mkdir(parents=True)
    (state / "domains" / "web1.json").write_text("{}")
    conf = tmp_path / "vstor.conf"
    conf.write_text(f"[paths]\nstate_dir = {state}\n")
    script = (f"mount -t tmpfs tmpfs /run && mkdir -p /run/vstor/qsd && touch /run/vstor/qsd/web1.pid && "
              f"VSTOR_REMOVE_KEEP_BACKENDS=1 sh {root}/debian/vstor.prerm remove && "
              f"sh {root}/debian/vstor.postrm purge && ls /run/vstor/qsd")
    env = {**os.environ, "PYTHONPATH": root, "VSTOR_CONFIG": str(conf)}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "web1.pid\n", done
    assert "keeping /run/vstor" in done.stderr


# -- the Nova finder's .pth, at every interpreter start of Nova's venv ------------------------


@pytest.mark.process
@pytest.mark.parametrize("pth", ["file", "install-driver"])
def test_the_pth_of_a_half_removed_vstor_never_troubles_an_interpreters_start(tmp_path, pth):
    """vstor-nova.pth without _vstor_nova beside it (a removal half done, a
    finder deleted by hand): every Python of that venv still starts, and
    says nothing on stderr (site printed a traceback at each start)."""
    import subprocess
    import sys
    from vstor.nova import install
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, install.PTH)) as f:
        text = f.read() if pth == "file" else install.PTH_TEXT
    if pth == "file":
        assert text == install.PTH_TEXT      # one text: the wheel's and install-driver's
    (tmp_path / install.PTH).write_text(text)
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
            "print([f.__name__ for f in sys.meta_path if isinstance(f, type)])")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0 and "VstorNovaFinder" not in done.stdout and done.stderr == "", done
    # With the finder there, it is installed as before.
    with open(os.path.join(root, install.FINDER)) as f:
        (tmp_path / install.FINDER).write_text(f.read())
    code = f"import site, sys; site.addsitedir({str(tmp_path)!r}); print([f.__name__ for f in sys.meta_path][-1])"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert (done.returncode, done.stdout, done.stderr) == (0, "VstorNovaFinder\n", "")


@pytest.mark.process
@pytest.mark.parametrize("cgroups, stopped", [
    ([], True),
    (["0::/system.slice/libvirtd.service"], True),
    (["0::/vstor.slice/run-r1.scope"], False),                        # cgroup v2
    (["12:pids:/\n1:name=systemd:/vstor.slice/run-r2.scope"], False),  # hybrid, as on these machines
])
def test_postrm_stops_vstor_slice_only_when_no_process_runs_in_it(tmp_path, cgroups, stopped):
    """`apt remove` stops vstor.slice only when no process runs in it, as
    the kernel says (/proc/PID/cgroup): daemons left running unmanaged
    (records elsewhere, no /run/vstor for prerm's kept-backends) would be
    stopped with it.  systemd's TasksCurrent is not asked: it is '[not set]'
    without task accounting (a container without the pids controller).  A
    fake systemctl and /proc, in a private mount namespace with its own /run."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a private /run and /proc)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "systemctl").write_text(
        f"#!/bin/sh\necho \"$*\" >> {calls}\ncase \"$*\" in is-active*) exit 0;; esac\n")
    (bin_dir / "systemctl").chmod(0o755)
    procs = "".join(f"mkdir -p /proc/{100 + i} && printf '%s\\n' '{c}' > /proc/{100 + i}/cgroup && "
                    for i, c in enumerate(cgroups))
    script = (f"mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system && "
              f"mount -t tmpfs tmpfs /proc && {procs}sh {ROOT}/debian/vstor.postrm remove")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    said = calls.read_text() if calls.exists() else ""
    assert ("stop vstor.slice" in said) == stopped, (said, done.stderr)


def test_what_the_debian_build_leaves_in_the_tree_is_ignored():
    """(issue 28) dh-python's pybuild leaves .pybuild/ in the checkout: git
    must not offer it for a commit."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = f.read().split()
    assert ".pybuild/" in ignored


def test_the_metrics_units_are_shipped_but_not_enabled():
    """A scrape endpoint is the operator's choice (which address, which
    collector): the package installs both ways and enables neither."""
    listed = [line.split()[0] for line in _read("debian", "vstor.install").splitlines() if line]
    assert {"systemd/vstor-metrics.service", "systemd/vstor-metrics-textfile.service",
            "systemd/vstor-metrics-textfile.timer", "etc/grafana/vstor-dashboard.json"} <= set(listed)
    rules = [line for line in _read("debian", "rules").splitlines() if "vstor-metrics" in line]
    assert rules and all("--no-enable --no-start" in line for line in rules)
    serve = _read("systemd", "vstor-metrics.service")
    assert "ExecStart=/usr/bin/vstor metrics serve --listen 127.0.0.1:" in serve
    assert "ExecStart=/usr/bin/vstor metrics textfile /var/lib/prometheus/node-exporter/vstor.prom\n" in \
        _read("systemd", "vstor-metrics-textfile.service")
    assert "python3-prometheus-client" in _read("debian", "control")
