"""Makes `nova.virt.vstor` import vstor's Nova driver (vstor.nova.shim), so
nova.conf can say `compute_driver = vstor.VstorLibvirtDriver` although Nova
loads compute drivers from its own nova.virt package only
(nova.virt.driver.load_compute_driver: 'nova.virt.' + compute_driver).

Nothing is written into Nova's package: vstor-nova.pth (installed beside
this module, by the same wheel or Debian package) imports this module when
the interpreter starts, and it adds a finder that answers for that one name
only.  An upgrade or reinstall of Nova never sees these files; removing vstor
removes them.  setuptools' distutils-precedence.pth works the same way.

Kept tiny and without imports: every interpreter of the environment runs it
at start-up."""

import sys

NAME = "nova.virt.vstor"


class VstorNovaFinder:
    """A meta path finder for nova.virt.vstor alone, after every other one:
    a module of that name in Nova's own package would still win."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        import importlib.util
        spec = importlib.util.find_spec("vstor.nova.shim")
        if spec is None:
            return None
        return importlib.util.spec_from_file_location(NAME, spec.origin)


def install() -> None:
    if not any(getattr(f, "__name__", "") == "VstorNovaFinder" for f in sys.meta_path):
        sys.meta_path.append(VstorNovaFinder)


install()
