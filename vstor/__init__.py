"""vstor: per-VM NVMe storage for libvirt/QEMU."""

__version__ = "0.1.0"

#: The XML namespace of vstor's element in a domain's <metadata>.
NS = "https://vstor.dev/xmlns/domain/1"
#: The fixed prefix vstor writes that namespace with.
PREFIX = "vstor"
