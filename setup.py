"""setup.cfg declares the package; this adds what setuptools cannot declare:
vstor-nova.pth at the top of the wheel (beside _vstor_nova), so that Nova
finds vstor's driver as nova.virt.vstor without a file in Nova's package
(see _vstor_nova.py)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vstor-nova.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:      # an editable install: `vstor nova install-driver`
            self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else outputs + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPy})
