"""Loaded as `nova.virt.vstor` (by _vstor_nova's finder, installed with
vstor): what `compute_driver = vstor.VstorLibvirtDriver` names."""

from vstor.nova.driver import VstorLibvirtDriver  # noqa: F401
