"""Which SPDK application and release the double is: the methods each app
serves, what its framework_get_subsystems and rpc_get_methods say, and how
the releases differ.

Apps (the ``-m``/``-S`` of a real one are the double's ``cores``/``vhost_dir``):

- ``vhost``: SPDK's vhost app. ``rpc_get_methods`` is the list recorded from
  a real v26.09-pre vhost app (tests/spdk/transcripts/vhost-attach-and-serve.jsonl),
  verbatim and in its order.
- ``nvmf_tgt``: derived, not recorded: the vhost list without what only the
  vhost app links (vhost_*, virtio_blk_*, scsi_get_devices, nbd_*), with
  SPDK's nvmf_* methods (every nvmf_* in SPDK's schema.yaml) where the vhost
  block was. Its bdev modules (bdev_nvme_*, bdev_malloc_* ...) are the same.
- ``spdk_tgt``: derived: the vhost list with the nvmf_* and iscsi_* methods
  of the schema added; its framework_get_subsystems is the recorded one
  (export-claim-order.jsonl), the other two apps' are that list without the
  subsystems they do not link (vhost: nvmf, iscsi; nvmf_tgt: scsi,
  vhost_scsi, vhost_blk, nbd, iscsi).

Method families: vhost_* is served by vhost and spdk_tgt, nvmf_* by
nvmf_tgt and spdk_tgt; bdev_*, framework_*, rpc_get_methods and
spdk_get_version by all three. Anything else, or a method of a family the
app lacks, is -32601 "Method not found" (recorded: method-not-found.jsonl).
A method an app lists but the double does not model is -32601 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from errno import EALREADY, EEXIST, EINVAL

APPS = {"vhost": frozenset({"vhost"}), "nvmf_tgt": frozenset({"nvmf"}),
        "spdk_tgt": frozenset({"vhost", "nvmf"})}


def family(method: str) -> str | None:
    """The app-specific family a method belongs to, None for the common ones."""
    if method.startswith("vhost_"):
        return "vhost"
    if method.startswith("nvmf_"):
        return "nvmf"
    return None


@dataclass(frozen=True)
class Release:
    """What differs between the SPDK releases the double can be (see the
    package docstring for what each difference is based on)."""
    name: str
    text: str                   # spdk_get_version's "version", after "SPDK v"
    firmware: str               # an NVMe-oF controller's firmware_revision
    deferred_delete: bool       # vhost_delete_controller waits for the initiator to leave
    missing_ctrlr_code: int     # bdev_nvme_get_controllers "Controller X does not exist"
    same_mode_paths: bool       # a path's multipath/failover mode must be its controller's
    known_alternate_errno: int  # failover: adding a trid that is already an alternate


RELEASES = {
    "v24.01": Release("v24.01", "24.01", "24.01", deferred_delete=False, missing_ctrlr_code=EINVAL,
                      same_mode_paths=False, known_alternate_errno=EEXIST),
    "v26.09": Release("v26.09", "26.09-pre git sha1 3230130e6a", "26.09", deferred_delete=True,
                      missing_ctrlr_code=-EINVAL, same_mode_paths=True, known_alternate_errno=EALREADY),
}

SUBSYSTEMS = (      # framework_get_subsystems of spdk_tgt, as recorded
    ("vmd", ()), ("keyring", ()), ("iobuf", ()), ("sock", ()), ("accel", ("iobuf",)),
    ("bdev", ("accel", "keyring", "vmd", "sock", "iobuf")), ("scsi", ("bdev",)),
    ("scheduler", ()), ("vhost_scsi", ("scsi",)), ("vhost_blk", ("bdev",)), ("nbd", ("bdev",)),
    ("nvmf", ("bdev", "keyring", "sock", "accel", "iobuf")), ("iscsi", ("scsi", "sock")),
)
_NOT_LINKED = {"vhost": {"nvmf", "iscsi"}, "nvmf_tgt": {"scsi", "vhost_scsi", "vhost_blk", "nbd", "iscsi"},
               "spdk_tgt": set()}


def subsystems(app: str) -> list[dict]:
    return [{"subsystem": name, "depends_on": list(deps)}
            for name, deps in SUBSYSTEMS if name not in _NOT_LINKED[app]]


def _vhost_only(method: str) -> bool:
    return method.startswith(("vhost_", "virtio_blk_", "nbd_")) or method == "scsi_get_devices"


def rpc_methods(app: str) -> list[str]:
    """rpc_get_methods of an app (see the module docstring)."""
    if app == "vhost":
        return list(VHOST_APP_METHODS)
    at = VHOST_APP_METHODS.index("virtio_blk_create_transport")
    if app == "nvmf_tgt":
        kept = [m for m in VHOST_APP_METHODS if not _vhost_only(m)]
        cut = sum(1 for m in VHOST_APP_METHODS[:at] if not _vhost_only(m))
        return kept[:cut] + list(NVMF_METHODS) + kept[cut:]
    return list(VHOST_APP_METHODS[:at]) + list(ISCSI_METHODS) + list(NVMF_METHODS) + list(VHOST_APP_METHODS[at:])


VHOST_APP_METHODS = (
    "bdev_malloc_delete", "bdev_malloc_create", "bdev_null_resize", "bdev_null_delete",
    "bdev_null_create", "bdev_opal_new_user", "bdev_opal_set_lock_state", "bdev_opal_delete",
    "bdev_opal_get_info", "bdev_opal_create", "bdev_nvme_opal_revert", "bdev_nvme_opal_init",
    "bdev_nvme_send_cmd", "bdev_nvme_set_keys", "bdev_nvme_get_path_iostat",
    "bdev_nvme_get_mdns_discovery_info", "bdev_nvme_stop_mdns_discovery",
    "bdev_nvme_start_mdns_discovery", "bdev_nvme_set_multipath_policy",
    "bdev_nvme_set_preferred_path", "bdev_nvme_get_io_paths",
    "bdev_nvme_remove_error_injection", "bdev_nvme_add_error_injection",
    "bdev_nvme_get_discovery_info", "bdev_nvme_stop_discovery", "bdev_nvme_start_discovery",
    "bdev_nvme_get_controller_health_info", "bdev_nvme_disable_controller",
    "bdev_nvme_enable_controller", "bdev_nvme_reset_controller",
    "bdev_nvme_get_transport_statistics", "bdev_nvme_apply_firmware",
    "bdev_nvme_detach_controller", "bdev_nvme_get_controllers", "bdev_nvme_attach_controller",
    "bdev_nvme_set_hotplug", "bdev_nvme_set_options", "bdev_passthru_delete",
    "bdev_passthru_create", "bdev_lvol_set_parent_bdev", "bdev_lvol_set_parent",
    "bdev_lvol_check_shallow_copy", "bdev_lvol_start_shallow_copy", "bdev_lvol_grow_lvstore",
    "bdev_lvol_get_lvols", "bdev_lvol_get_lvstores", "bdev_lvol_delete",
    "bdev_lvol_set_read_only", "bdev_lvol_resize", "bdev_lvol_decouple_parent",
    "bdev_lvol_inflate", "bdev_lvol_rename", "bdev_lvol_clone_bdev", "bdev_lvol_clone",
    "bdev_lvol_snapshot", "bdev_lvol_create", "bdev_lvol_delete_lvstore",
    "bdev_lvol_rename_lvstore", "bdev_lvol_create_lvstore", "bdev_raid_set_options",
    "bdev_raid_remove_base_bdev", "bdev_raid_add_base_bdev", "bdev_raid_delete",
    "bdev_raid_create", "bdev_raid_get_bdevs", "bdev_error_resume_pending",
    "bdev_error_inject_error", "bdev_error_delete", "bdev_error_create", "bdev_split_delete",
    "bdev_split_create", "bdev_delay_delete", "bdev_delay_create", "bdev_delay_update_latency",
    "bdev_zone_block_delete", "bdev_zone_block_create", "bdev_aio_delete", "bdev_aio_rescan",
    "bdev_aio_create", "bdev_ftl_set_property", "bdev_ftl_get_properties", "bdev_ftl_get_stats",
    "bdev_ftl_unmap", "bdev_ftl_delete", "bdev_ftl_create", "bdev_virtio_attach_controller",
    "bdev_virtio_scsi_get_devices", "bdev_virtio_detach_controller",
    "bdev_virtio_blk_set_hotplug", "accel_error_inject_error", "ioat_scan_accel_module",
    "ae4dma_scan_accel_module", "keyring_file_remove_key", "keyring_file_add_key",
    "virtio_blk_create_transport", "virtio_blk_get_transports",
    "vhost_controller_set_coalescing", "vhost_get_controllers", "vhost_delete_controller",
    "vhost_create_blk_controller", "vhost_scsi_controller_remove_target",
    "vhost_scsi_controller_add_target", "vhost_start_scsi_controller",
    "vhost_create_scsi_controller", "thread_set_cpumask", "scheduler_set_options",
    "framework_get_governor", "framework_get_scheduler", "framework_set_scheduler",
    "framework_get_reactors", "thread_get_io_channels", "thread_get_pollers",
    "thread_get_stats", "framework_monitor_context_switch", "spdk_kill_instance",
    "log_enable_timestamps", "log_get_flags", "log_clear_flag", "log_set_flag", "log_get_level",
    "log_set_level", "log_get_print_level", "log_set_print_level",
    "framework_enable_cpumask_locks", "framework_disable_cpumask_locks", "framework_wait_init",
    "framework_start_init", "scsi_get_devices", "nbd_get_disks", "nbd_stop_disk",
    "nbd_start_disk", "bdev_get_histogram_borders", "bdev_get_histogram",
    "bdev_enable_histogram", "bdev_set_qos_limit", "bdev_set_qd_sampling_period",
    "bdev_get_bdevs", "bdev_reset_iostat", "bdev_get_iostat", "bdev_examine",
    "bdev_wait_for_examine", "bdev_set_options", "notify_get_notifications", "notify_get_types",
    "accel_get_stats", "accel_set_options", "accel_set_driver", "accel_crypto_key_destroy",
    "accel_crypto_keys_get", "accel_crypto_key_create", "accel_assign_opc",
    "accel_get_module_info", "accel_get_opc_assignments", "sock_get_default_impl",
    "sock_set_default_impl", "sock_impl_set_options", "sock_impl_get_options",
    "iobuf_get_stats", "iobuf_set_options", "keyring_get_keys", "vmd_rescan",
    "vmd_remove_device", "vmd_enable", "framework_get_pci_devices", "framework_get_config",
    "framework_get_subsystems", "trace_get_info", "trace_clear", "trace_get_tpoint_group_mask",
    "trace_disable_tpoint_group", "trace_enable_tpoint_group", "trace_clear_tpoint_mask",
    "trace_set_tpoint_mask", "env_dpdk_get_mem_stats", "spdk_get_version", "rpc_get_methods"
)

NVMF_METHODS = (
    "nvmf_create_target", "nvmf_delete_target", "nvmf_get_targets", "nvmf_create_transport",
    "nvmf_get_subsystems", "nvmf_create_subsystem", "nvmf_delete_subsystem",
    "nvmf_subsystem_add_listener", "nvmf_subsystem_remove_listener",
    "nvmf_subsystem_listener_set_ana_state", "nvmf_subsystem_add_ns",
    "nvmf_subsystem_remove_ns", "nvmf_subsystem_set_ns_ana_group", "nvmf_subsystem_add_host",
    "nvmf_subsystem_remove_host", "nvmf_subsystem_allow_any_host", "nvmf_subsystem_set_keys",
    "nvmf_subsystem_get_controllers", "nvmf_subsystem_get_qpairs",
    "nvmf_subsystem_get_listeners", "nvmf_ns_add_host", "nvmf_ns_remove_host",
    "nvmf_set_max_subsystems", "nvmf_discovery_add_referral", "nvmf_discovery_remove_referral",
    "nvmf_discovery_get_referrals", "nvmf_set_config", "nvmf_get_transports", "nvmf_get_stats",
    "nvmf_set_crdt", "nvmf_publish_mdns_prr", "nvmf_stop_mdns_prr"
)

ISCSI_METHODS = (
    "iscsi_set_options", "iscsi_get_options", "iscsi_set_discovery_auth",
    "iscsi_create_auth_group", "iscsi_delete_auth_group", "iscsi_get_auth_groups",
    "iscsi_auth_group_add_secret", "iscsi_auth_group_remove_secret",
    "iscsi_get_initiator_groups", "iscsi_create_initiator_group",
    "iscsi_delete_initiator_group", "iscsi_initiator_group_add_initiators",
    "iscsi_initiator_group_remove_initiators", "iscsi_get_target_nodes",
    "iscsi_create_target_node", "iscsi_target_node_set_auth",
    "iscsi_target_node_add_pg_ig_maps", "iscsi_target_node_remove_pg_ig_maps",
    "iscsi_delete_target_node", "iscsi_get_portal_groups", "iscsi_create_portal_group",
    "iscsi_start_portal_group", "iscsi_delete_portal_group", "iscsi_portal_group_set_auth",
    "iscsi_get_connections", "iscsi_get_stats", "iscsi_target_node_add_lun",
    "iscsi_target_node_set_redirect", "iscsi_target_node_request_logout",
    "iscsi_enable_histogram", "iscsi_get_histogram"
)
