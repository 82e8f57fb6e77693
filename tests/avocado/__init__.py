"""vstor's avocado-vt test provider (libvirt/) and the library its tests share
(vstorlab/). `install.py` registers the provider with avocado-vt."""
