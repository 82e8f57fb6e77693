"""vstor's Nova compute driver: Nova's libvirt driver, with the flavor's
vstor disks added to every guest config it builds (vstor.nova.guest).

Nova loads `compute_driver` from its own `nova.virt` package only: the
name nova.virt.vstor is answered by a finder vstor installs beside itself
(vstor.nova.install: nothing is written into Nova's package); in nova.conf:

    [DEFAULT]
    compute_driver = vstor.VstorLibvirtDriver

A live migration of an instance with vstor disks goes through vstor's
migration (vstor.nova.migrate): the destination makes the backends before
Nova migrates, the source lets go after, and a rollback gives the
destination's up; the destination's hook places the arriving domain.
"""

from __future__ import annotations

import threading
import time

from nova.virt.libvirt import driver as libvirt_driver
from oslo_log import log as logging

from vstor import config as config_mod
from vstor.errors import VstorError
from vstor.host.read import read_host
from vstor.host.sysfs import SysFS
from vstor.meta.holding import Holding
from vstor.nova import disks, migrate
from vstor.nova.guest import augment
from vstor.render.migration import reshare_memory
from vstor.planner.ledger import Ledger
from vstor.runtime.inventory import load_ledger, readable_records

LOG = logging.getLogger(__name__)


def _has_vstor_disks(instance) -> bool:
    return disks.has_disks(dict(instance.flavor.extra_specs or {}))


def _vstor_migrate(step: str, instance, dest: str | None = None) -> str:
    return migrate.run(config_mod.load(), step, instance.name, dest)


# The planning lock of one nova-compute.  It builds several instances'
# guest configs at once (a thread or greenthread each); vstor's own lock is
# root's, and nova-compute runs as `nova`.  So its plans are made one at a
# time here, and each counts in the next one's ledger from the moment it is
# made until libvirt lists its domain (Nova defines it right after) or
# PENDING_SECONDS pass (a spawn that failed before defining it).  The
# hook, as root and under vstor's lock, checks every plan again at the start.
_PLANNING = threading.Lock()
_pending: dict[str, tuple[float, Holding]] = {}
PENDING_SECONDS = 600.0


def plan_under_lock(make, ledger_of, now=time.monotonic):
    """`make(ledger)` -> a Plan or None, with the plans made before it and
    not yet in `ledger_of()` counted; the plan then counts for the next."""
    with _PLANNING:
        ledger = ledger_of()
        known = {h.domain for h in ledger.holdings}
        t = now()
        for name, (at, _) in list(_pending.items()):
            if name in known or t - at > PENDING_SECONDS:
                del _pending[name]
        if _pending:
            ledger = Ledger(ledger.holdings + tuple(h for _, h in _pending.values()))
        plan = make(ledger)
        if plan is not None:
            _pending[plan.domain] = (t, Holding.from_plan(plan))
        return plan


class VstorLibvirtDriver(libvirt_driver.LibvirtDriver):

    def _get_guest_config(self, instance, *args, **kwargs):
        guest = super()._get_guest_config(instance, *args, **kwargs)
        specs = dict(instance.flavor.extra_specs or {})
        if disks.has_disks(specs):
            cfg = config_mod.load()
            plan_under_lock(
                lambda ledger: augment(guest, specs, instance.flavor.name, instance.project_id,
                                       read_host(SysFS("/")), cfg, ledger),
                lambda: load_ledger(self._host.get_connection(), readable_records(cfg.state_dir)))
        return guest

    def live_migration(self, context, instance, dest, post_method, recover_method,
                       block_migration=False, migrate_data=None):
        if not _has_vstor_disks(instance):
            return super().live_migration(context, instance, dest, post_method, recover_method,
                                          block_migration, migrate_data)
        # The source's record (which names the destination) goes with the
        # domain, and a prepare that died half-way may have left the
        # destination holding backends: finish and abort are told where.
        self._vstor_destinations()[instance.uuid] = dest
        try:
            said = _vstor_migrate("prepare", instance, dest)
        except VstorError as e:
            # As Nova's own driver does when the migration fails: its
            # rollback, the instance runs on here.
            LOG.error("vstor refuses to migrate the instance's vstor disks to %s: %s", dest, e,
                      instance=instance)
            recover_method(context, instance, dest, migrate_data)
            return None
        LOG.info("vstor: %s", " ".join(said.split()), instance=instance)
        try:
            return super().live_migration(context, instance, dest, post_method, recover_method,
                                          block_migration, migrate_data)
        except Exception:
            # Nova puts the instance in error without a rollback: still give
            # the destination's backends up (refused if it arrived there).
            self._vstor_abort(instance)
            raise

    def _vstor_destinations(self) -> dict:
        """instance uuid -> the destination vstor prepared, in this nova-compute."""
        if "_vstor_dest" not in self.__dict__:
            self._vstor_dest = {}
        return self._vstor_dest

    def _live_migration_operation(self, context, instance, dest, block_migration, migrate_data,
                                  guest, device_names):
        if _has_vstor_disks(instance):
            guest = SharedMemoryGuest(guest)
        return super()._live_migration_operation(context, instance, dest, block_migration,
                                                 migrate_data, guest, device_names)

    def rollback_live_migration_at_source(self, context, instance, migrate_data):
        super().rollback_live_migration_at_source(context, instance, migrate_data)
        if _has_vstor_disks(instance):
            self._vstor_abort(instance)

    def post_live_migration_at_source(self, context, instance, network_info):
        super().post_live_migration_at_source(context, instance, network_info)
        if _has_vstor_disks(instance):
            try:
                dest = self._vstor_destinations().pop(instance.uuid, None)
                LOG.info("vstor: %s", " ".join(_vstor_migrate("finish", instance, dest).split()),
                         instance=instance)
            except VstorError as e:
                LOG.warning("vstor could not finish the migration here (vstor gc cleans up): %s", e,
                            instance=instance)

    def _vstor_abort(self, instance) -> None:
        dest = self._vstor_destinations().pop(instance.uuid, None)
        try:
            LOG.info("vstor: %s", " ".join(_vstor_migrate("abort", instance, dest).split()),
                     instance=instance)
        except VstorError as e:
            LOG.warning("vstor could not give the destination's backends up (vstor migrate abort "
                        "%s, or vstor gc there): %s", instance.name, e, instance=instance)


class SharedMemoryGuest:
    """Nova's Guest, whose migrate sends the instance's memory shared, as
    vhost-user needs and as it runs (vstor.render.migration.reshare_memory:
    Nova's own XML update strips it, and libvirt refuses that)."""

    def __init__(self, guest):
        self._guest = guest

    def __getattr__(self, name):
        return getattr(self._guest, name)

    def migrate(self, *args, destination_xml=None, **kwargs):
        if destination_xml:
            destination_xml = reshare_memory(destination_xml)
        return self._guest.migrate(*args, destination_xml=destination_xml, **kwargs)
