"""vstor: per-VM NVMe storage for libvirt/QEMU."""

__version__ = "0.1.0"

#: The XML namespace of vstor's element in a domain's <metadata>.
NS = "https://vstor.dev/xmlns/domain/1"
#: The fixed prefix vstor writes that namespace with.
PREFIX = "vstor"


def _vendored(path: str = "/usr/lib/vstor/python") -> None:
    """The Debian package's private copies of what Debian 12 does not package
    (qemu.qmp, spdk: debian/vendor.txt), after every other path, so that a
    copy installed by Debian or pip wins.  Absent elsewhere: nothing to do."""
    import os
    import sys
    if path not in sys.path and os.path.isdir(path):
        sys.path.append(path)


_vendored()
