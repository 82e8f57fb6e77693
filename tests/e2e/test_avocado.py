"""vstor's avocado-vt test provider (tests/avocado) through the real `avocado
run --vt-type libvirt`: the cases that need no special hardware (qsd,
hotplug) boot the tiny guest under this session's libvirtd and must PASS;
the hardware cases must be cancelled (avocado's CANCEL) with the reason,
both where the lab names no device and where the named device is absent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import unavailable
from .helpers import ROOT, WORK

HARDWARE = ("passthrough_spdk_guest", "vhost_local_nvme", "vhost_nvmf_rdma", "migration")
# Devices a lab would name, none of them on this machine.
ABSENT = {
    "vstor_nvme_controller": "0000:5e:00.0",
    "vstor_nvmf_subnqn": "nqn.2016-06.io.spdk:cnode1",
    "vstor_nvmf_traddr": "192.0.2.8",
    "vstor_nvmf_traddr2": "192.0.2.9",
    "vstor_path_down_cmd": "false",
    "vstor_path_up_cmd": "false",
    "vstor_rdma_nic": "mlx5_0",
}


@pytest.fixture(scope="module")
def provider():
    """avocado-vt installed for this Python, vstor's provider registered and
    the offline bootstrap done (tests/avocado/install.py, cheap when done)."""
    import importlib.util
    if not (importlib.util.find_spec("avocado") and importlib.util.find_spec("virttest")):
        unavailable(f"avocado-vt is not installed for {sys.executable} (scripts/install-deps.sh)")
    out = subprocess.run([sys.executable, "tests/avocado/install.py"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def vstor_hooked(vstor_env, libvirt_daemons):
    """vstor_env's config and hook, seen by the running libvirtd. The hook
    fixture restarts a libvirtd it started only when the hook is new; a hook
    file left by an earlier session and rewritten now is newer than libvirtd,
    and vstor doctor (which the provider's cases check) says so."""
    out = subprocess.run([sys.executable, "-m", "vstor.cli.main", "--config", str(vstor_env),
                          "doctor", "--json"], capture_output=True, text=True, cwd=ROOT)
    hook = [c for c in json.loads(out.stdout) if c["name"] == "libvirt hook"]
    if hook and hook[0]["status"] != "ok" and libvirt_daemons.owns_libvirtd():
        libvirt_daemons.restart_libvirtd()
    return vstor_env


def avocado_run(tmp: Path, cases: list[str], params: dict[str, str], timeout: float) -> dict[str, dict]:
    """One `avocado run` job; each case's entry of its results.json."""
    results = tmp / "results.json"
    argv = [sys.executable, "-m", "avocado", "run", "--vt-type", "libvirt",
            "--max-parallel-tasks", "1", "--job-results-dir", str(tmp / "jobs"),
            "--json", str(results), "--disable-sysinfo"]
    for key, value in params.items():
        argv += ["--vt-extra-params", f"{key}={value}"]
    argv += ["--", *(f"vstor.lab.{c}" for c in cases)]
    # avocado starts each test with the first avocado-runner-avocado-vt on
    # PATH: this Python's own (its venv's), so the tests run vstor with it.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert results.exists(), f"avocado wrote no results (exit {out.returncode}):\n{out.stdout}{out.stderr}"
    tests = json.loads(results.read_text())["tests"]
    by_case = {t["name"].split(";")[0].rsplit(".", 1)[-1]: t for t in tests}
    assert sorted(by_case) == sorted(cases), (sorted(by_case), out.stdout[-3000:])
    return by_case


def lab_params(conf: Path) -> dict[str, str]:
    """This machine as the lab: the e2e session's vstor config and hook, TCG."""
    return {"vstor_config": str(conf), "vstor_uri": "qemu:///system", "vstor_virt_type": "qemu",
            "vstor_workdir": str(WORK / "avocado"), "vstor_image_dir": str(WORK)}


def debug_log(entry: dict) -> str:
    log = Path(entry.get("logfile") or "")
    return log.read_text(errors="replace")[-4000:] if log.is_file() else "(no log)"


def test_the_no_hardware_cases_pass(provider, vstor_hooked, guest_image, tmp_path):
    ran = avocado_run(tmp_path, ["qsd", "hotplug"], lab_params(vstor_hooked), timeout=1200)
    for case, entry in ran.items():
        assert entry["status"] == "PASS", f"{case}: {entry['status']}: {entry.get('fail_reason')}\n" \
                                          + debug_log(entry)


def test_hardware_cases_are_cancelled_where_the_lab_names_no_device(provider, vstor_hooked, tmp_path):
    ran = avocado_run(tmp_path, list(HARDWARE), lab_params(vstor_hooked), timeout=600)
    reasons = {case: str(entry.get("fail_reason")) for case, entry in ran.items()}
    assert {c: e["status"] for c, e in ran.items()} == dict.fromkeys(HARDWARE, "CANCEL"), reasons
    assert reasons["passthrough_spdk_guest"].startswith("vstor_nvme_controller is not set")
    assert reasons["vhost_local_nvme"].startswith("vstor_nvme_controller is not set")
    assert reasons["vhost_nvmf_rdma"].startswith("vstor_nvmf_subnqn is not set")
    assert reasons["migration"].startswith("vstor_dest is not set")


def test_hardware_cases_are_cancelled_where_the_named_device_is_absent(provider, vstor_hooked, tmp_path):
    cases = ["passthrough_spdk_guest", "vhost_local_nvme", "vhost_nvmf_rdma"]
    ran = avocado_run(tmp_path, cases, {**lab_params(vstor_hooked), **ABSENT}, timeout=600)
    reasons = {case: str(entry.get("fail_reason")) for case, entry in ran.items()}
    assert {c: e["status"] for c, e in ran.items()} == dict.fromkeys(cases, "CANCEL"), reasons
    for case in ("passthrough_spdk_guest", "vhost_local_nvme"):
        assert reasons[case] == "no PCI device 0000:5e:00.0 on this host (vstor_nvme_controller)"
    assert reasons["vhost_nvmf_rdma"].startswith("no RDMA NIC mlx5_0 on this host"), reasons
