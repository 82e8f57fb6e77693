"""Run with an interpreter that has nova installed: one JSON request on
stdin, one JSON answer on stdout.  Everything here is Nova's own code.

request: {"conf": nova.conf text, "extra_specs": {key: value},
          "device_specs": [dict] (each parsed alone), "aliases": [str] (alias JSON)}
answer:  {"whitelist": [spec tags], "aliases": {name: [numa_policy, specs]},
          "dedicated": [cpus], "shared": [cpus], "extra_specs": {key: error or null},
          "device_specs": [error or null], "alias_error": error or null}"""

import json
import os
import sys
import tempfile

import nova.conf
from nova import exception

CONF = nova.conf.CONF


def main() -> None:
    req = json.load(sys.stdin)
    out = {}
    if "conf" in req:
        with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
            f.write(req["conf"])
        CONF([], default_config_files=[f.name])
        os.unlink(f.name)
        from nova.pci import request as pci_request, whitelist
        from nova.virt import hardware
        wl = whitelist.Whitelist(CONF.pci.device_spec)
        out["whitelist"] = [spec.get_tags() | {"address": str(spec._address_obj().pci_address_spec.__dict__)}
                            for spec in wl.specs]
        out["aliases"] = {k: [v[0], v[1]] for k, v in pci_request.get_alias_from_config().items()}
        out["dedicated"] = sorted(hardware.get_cpu_dedicated_set() or [])
        out["shared"] = sorted(hardware.get_cpu_shared_set() or [])
    else:
        CONF([], default_config_files=[])
    from nova.api.validation.extra_specs import validators
    out["extra_specs"] = {}
    for key, value in req.get("extra_specs", {}).items():
        try:
            validators.validate(key, value)
            out["extra_specs"][key] = None
        except Exception as e:      # Nova raises webob HTTP errors here
            out["extra_specs"][key] = f"{type(e).__name__}: {e}"
    from nova.pci import devspec
    out["device_specs"] = []
    for spec in req.get("device_specs", []):
        try:
            devspec.PciDeviceSpec(dict(spec))
            out["device_specs"].append(None)
        except exception.NovaException as e:
            out["device_specs"].append(f"{type(e).__name__}: {e}")
    if "aliases" in req:
        from nova.pci import request as pci_request
        CONF.set_override("alias", req["aliases"], group="pci")
        pci_request.get_alias_from_config.cache_clear()
        try:
            pci_request.get_alias_from_config()
            out["alias_error"] = None
        except exception.NovaException as e:
            out["alias_error"] = f"{type(e).__name__}: {e}"
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
