"""vstor's Nova compute driver: Nova's libvirt driver, with the flavor's
vstor disks added to every guest config it builds (vstor.nova.guest).

Nova loads `compute_driver` from its own `nova.virt` package only, so
`vstor nova install-driver` writes a one-line module there
(nova/virt/vstor.py) that imports this class; then in nova.conf:

    [DEFAULT]
    compute_driver = vstor.VstorLibvirtDriver
"""

from __future__ import annotations

from nova.virt.libvirt import driver as libvirt_driver


class VstorLibvirtDriver(libvirt_driver.LibvirtDriver):

    def _get_guest_config(self, instance, *args, **kwargs):
        guest = super()._get_guest_config(instance, *args, **kwargs)
        specs = dict(instance.flavor.extra_specs or {})
        from vstor.nova import disks
        if disks.has_disks(specs):
            from vstor import config as config_mod
            from vstor.host.read import read_host
            from vstor.host.sysfs import SysFS
            from vstor.nova.guest import augment
            from vstor.runtime.inventory import load_ledger
            from vstor.runtime.state import StateDir
            cfg = config_mod.load()
            try:
                records = StateDir(cfg.state_dir).records()
            except OSError:
                records = []    # nova-compute runs as nova; the hook checks again as root
            ledger = load_ledger(self._host.get_connection(), records)
            augment(guest, specs, instance.flavor.name, instance.project_id,
                    read_host(SysFS("/")), cfg, ledger)
        return guest
