"""Register vstor's avocado-vt test provider and bootstrap avocado-vt offline.

    python3 tests/avocado/install.py          (with the Python that has avocado-vt)

Writes vstor.ini (tests/avocado/vstor.ini with this checkout's absolute path)
into avocado-vt's test-providers.d, then runs `avocado vt-bootstrap --vt-type
libvirt` without downloads. The bootstrap is what turns the provider's cfg
files into avocado-vt's subtests.cfg, so it runs again whenever the provider's
cfg, its ini or the avocado-vt version changed, and is skipped otherwise (a
stamp in avocado-vt's data directory records what it was run for). Safe to
run again; about a second when there is something to do.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

PROVIDER = Path(__file__).resolve().parent
NAME = "vstor"
BOOTSTRAP = ("vt-bootstrap", "--vt-type", "libvirt", "--vt-no-downloads", "--yes-to-all",
             "--vt-skip-verify-download-assets")
FINISHED = "VT-BOOTSTRAP FINISHED"


def ini_text() -> str:
    return (PROVIDER / f"{NAME}.ini").read_text().replace("@PROVIDER@", str(PROVIDER))


def fingerprint(ini: str) -> str:
    """What the bootstrap's output depends on: avocado-vt, the ini, every cfg."""
    from importlib.metadata import version
    digest = hashlib.sha256(f"avocado-vt {version('avocado-framework-plugin-vt')}\n{ini}".encode())
    for cfg in sorted((PROVIDER / "libvirt").rglob("*.cfg")):
        digest.update(f"\n{cfg.relative_to(PROVIDER)}\n".encode() + cfg.read_bytes())
    return digest.hexdigest()


def register(providers_dir: Path, ini: str) -> Path:
    """vstor.ini in test-providers.d; and an entry in its downloads/ directory:
    avocado-vt's run plugin refuses to load ("Bootstrap missing") while that
    directory is empty, which it always is when every provider is local."""
    providers_dir.mkdir(parents=True, exist_ok=True)
    target = providers_dir / f"{NAME}.ini"
    if not target.exists() or target.read_text() != ini:
        tmp = target.with_name(f".{NAME}.ini.tmp")
        tmp.write_text(ini)
        tmp.replace(target)
    link = providers_dir / "downloads" / NAME
    link.parent.mkdir(exist_ok=True)
    if not link.is_symlink() or os.readlink(link) != str(PROVIDER):
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            sys.exit(f"vstor: {link} exists and is not vstor's link: remove it and run again")
        link.symlink_to(PROVIDER, target_is_directory=True)
    return target


def subtests_cfg(data_dir) -> Path:
    return Path(data_dir.get_backend_dir("libvirt")) / "cfg" / "subtests.cfg"


def main() -> int:
    try:
        from virttest import data_dir
    except ImportError:
        sys.exit(f"vstor: avocado-vt is not installed for {sys.executable} "
                 "(pip install avocado-framework avocado-framework-plugin-vt)")
    ini = ini_text()
    target = register(Path(data_dir.get_test_providers_dir()), ini)
    stamp = Path(data_dir.get_data_dir()) / ".vstor-bootstrap"
    want = fingerprint(ini)
    subtests = subtests_cfg(data_dir)
    if stamp.exists() and stamp.read_text() == want and subtests.exists():
        print(f"vstor: avocado-vt provider registered ({target}), bootstrap up to date")
        return 0
    out = subprocess.run([sys.executable, "-m", "avocado", *BOOTSTRAP],
                         capture_output=True, text=True)
    if out.returncode or FINISHED not in out.stdout + out.stderr:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        sys.exit(f"vstor: avocado vt-bootstrap failed (exit {out.returncode}); its output is above")
    if f"- {NAME}." not in subtests.read_text():
        sys.exit(f"vstor: the bootstrap did not take vstor's cfg into {subtests}")
    stamp.write_text(want)
    print(f"vstor: avocado-vt provider registered ({target}) and bootstrapped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
