"""Test doubles: local stand-ins, named as such, for what the test machines
lack (an SPDK target, a kernel's NVMe/IOMMU sysfs)."""
