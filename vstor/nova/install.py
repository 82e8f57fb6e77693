"""How Nova finds vstor's compute driver, and who owns the files that make it.

Nova loads `compute_driver` from its own package only ('nova.virt.' + the
option), so `compute_driver = vstor.VstorLibvirtDriver` needs a module named
nova.virt.vstor.  No file in Nova's package provides it (an upgrade of Nova
would orphan or delete it): vstor-nova.pth, beside vstor in the same
site-packages, imports _vstor_nova when the interpreter starts, and its
finder answers that one name with vstor.nova.shim.

Who owns the two files:
- a wheel (`pip install vstor[nova]`) and the Debian package ship them:
  pip's RECORD or dpkg own them, and removing vstor removes them;
- an editable install (`pip install -e`) cannot ship them: `vstor nova
  install-driver` writes them and adds them to vstor's own RECORD, so that
  `pip uninstall vstor` removes them too.
Older vstor wrote nova/virt/vstor.py into Nova's package; install-driver
removes that file when it is exactly what vstor wrote.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
from importlib import metadata

import vstor
from vstor.atomic import write_file
from vstor.errors import BadInput
from vstor.records import record

PTH = "vstor-nova.pth"
FINDER = "_vstor_nova.py"
# Tolerant of a missing finder (a removal half done): site would print a
# traceback at every start of every Python of the environment.
PTH_TEXT = 'import sys; exec("try: import _vstor_nova\\nexcept ImportError: pass")\n'
# What older vstor's install-driver wrote into Nova's package (nothing owned it).
LEGACY_SHIM = ('"""Written by `vstor nova install-driver`: Nova loads compute drivers from\n'
               'nova.virt only.  compute_driver = vstor.VstorLibvirtDriver"""\n'
               "from vstor.nova.driver import VstorLibvirtDriver  # noqa: F401\n")


@record
class DriverSetup:
    site: str                       # the site-packages directory vstor is installed in
    write: tuple[str, ...] = ()     # files to write there (PTH, FINDER), owned through RECORD
    record_file: str = ""           # vstor's RECORD, to which they are added
    remove_legacy: str = ""         # nova/virt/vstor.py as older vstor wrote it

    @property
    def changes(self) -> bool:
        return bool(self.write or self.remove_legacy)


def plan(nova_virt_dir: str) -> DriverSetup:
    """What install-driver must do in this interpreter's environment; reads only."""
    dist = _vstor_dist()
    site = os.path.dirname(dist)
    record_file = os.path.join(dist, "RECORD")
    recorded = {line.split(",", 1)[0] for line in (_read(record_file) or "").splitlines()}
    # A file with other bytes, or one vstor's RECORD does not list (nobody would remove it).
    write = tuple(name for name, text in ((PTH, PTH_TEXT), (FINDER, _finder_text()))
                  if _read(os.path.join(site, name)) != text or name not in recorded)
    if write and not os.path.exists(record_file):
        raise BadInput(f"vstor's installation in {site} has no RECORD ({record_file}), so files "
                       "written for it would belong to nobody",
                       hint="install vstor with pip (pip install 'vstor[nova]') or its Debian package")
    legacy = os.path.join(nova_virt_dir, "vstor.py")
    text = _read(legacy)
    if text is not None and text != LEGACY_SHIM:
        raise BadInput(f"{legacy} is not the module vstor wrote; it would hide vstor's driver",
                       hint="see what installed it; remove it, then run install-driver again")
    return DriverSetup(site, write, record_file if write else "",
                       legacy if text is not None else "")


def describe(s: DriverSetup) -> list[str]:
    lines = [f"write {os.path.join(s.site, name)} (added to {s.record_file})" for name in s.write]
    if s.remove_legacy:
        lines.append(f"remove {s.remove_legacy} (written by an older vstor; nothing owns it)")
    return lines


def apply(s: DriverSetup) -> None:
    texts = {PTH: PTH_TEXT, FINDER: _finder_text()}
    rows = []
    for name in s.write:
        write_file(os.path.join(s.site, name), texts[name], hint="run as the owner of that "
                   "environment (root for nova-compute's)")
        rows.append(_record_row(name, texts[name].encode()))
    if rows:
        _add_to_record(s.record_file, rows)
    if s.remove_legacy:
        try:
            os.unlink(s.remove_legacy)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise BadInput(f"cannot remove {s.remove_legacy}: {e.strerror}",
                           hint="run as the owner of that environment") from None


def _vstor_dist() -> str:
    """The .dist-info directory of vstor's installation in this environment
    (a checkout's vstor.egg-info, found first when run from the checkout,
    is not one: it lists no files)."""
    path = next((p for p in (getattr(d, "_path", None) for d in metadata.distributions(name="vstor"))
                 if p is not None and str(p).endswith(".dist-info")), None)
    if path is None:
        raise BadInput(f"vstor (imported from {os.path.dirname(vstor.__file__)}) is not installed "
                       "in this environment", hint="pip install 'vstor[nova]' into nova-compute's "
                                                   "environment, then run install-driver again")
    return str(path)


def _finder_text() -> str:
    spec = importlib.util.find_spec("_vstor_nova")
    if spec is None or not spec.origin:
        raise BadInput("vstor's _vstor_nova module is missing", hint="reinstall vstor")
    with open(spec.origin) as f:
        return f.read()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {path}: {e}") from None


def _record_row(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _add_to_record(record_file: str, rows: list[str]) -> None:
    text = _read(record_file) or ""
    names = {row.split(",", 1)[0] for row in rows}
    kept = [line for line in text.splitlines() if line.split(",", 1)[0] not in names]
    write_file(record_file, "\n".join(kept + rows) + "\n",
               hint="run as the owner of that environment")
