"""The lab a test runs in, read from its avocado-vt params (tests/avocado/
libvirt/tests/cfg/vstor.cfg documents each one)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from avocado.core.exceptions import TestCancel, TestError

from .cli import Virsh, Vstor


@dataclass(frozen=True)
class Lab:
    params: object
    vstor: Vstor
    virsh: Virsh
    config: str
    workdir: Path
    image_dir: Path
    virt_type: str

    def get(self, key: str, default: str = "") -> str:
        return str(self.params.get(key, default) or "").strip()

    def number(self, key: str, default: int) -> int:
        raw = self.get(key, str(default))
        try:
            return int(raw)
        except ValueError:
            raise TestError(f"parameter {key} = {raw!r} is not a whole number") from None

    def need(self, key: str, why: str) -> str:
        """A parameter naming the lab's hardware; the test is cancelled
        (not failed) where the lab has not named it."""
        value = self.get(key)
        if not value:
            raise TestCancel(f"{key} is not set: {why}")
        return value


def open_lab(params) -> Lab:
    """The lab from the params (nothing checked or touched yet: see ready())."""
    uri = str(params.get("vstor_uri", "qemu:///system") or "")
    config = str(params.get("vstor_config", "") or "")
    lab = Lab(params=params, vstor=Vstor(str(params.get("vstor_command", "") or ""), config, uri),
              virsh=Virsh(uri), config=config,
              workdir=Path(str(params.get("vstor_workdir") or "/var/lib/vstor/avocado")),
              image_dir=Path(str(params.get("vstor_image_dir") or "/var/lib/vstor/images")),
              virt_type=str(params.get("vstor_virt_type") or "kvm"))
    if lab.virt_type not in ("kvm", "qemu"):
        raise TestError(f"vstor_virt_type = {lab.virt_type!r}: use kvm or qemu")
    return lab


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestCancel("vstor's lab tests need root (libvirt's hooks, qemu-storage-daemon, "
                         "device binding)")


def check_setup(lab: Lab) -> None:
    """vstor's hook is installed for this config and seen by the running
    libvirtd (`vstor doctor`'s own check); the work directories exist."""
    if lab.config and not Path(lab.config).is_file():
        raise TestError(f"vstor_config {lab.config} does not exist")
    checks = lab.vstor.json_codes("doctor", codes=(0, 1))
    hook = [c for c in checks if c.get("name") == "libvirt hook"]
    if not hook or hook[0].get("status") != "ok":
        said = hook[0] if hook else {"detail": "vstor doctor has no libvirt hook check", "fix": ""}
        raise TestError(f"vstor's libvirt hook is not ready: {said.get('detail')}"
                        + (f" (fix: {said['fix']})" if said.get("fix") else ""))
    for d in (lab.workdir, lab.image_dir):
        d.mkdir(parents=True, exist_ok=True)
    lab.workdir.chmod(0o755)


def ready(lab: Lab) -> None:
    """After a case's hardware checks (absent hardware cancels first): root,
    vstor's hook, the work directories."""
    require_root()
    check_setup(lab)
