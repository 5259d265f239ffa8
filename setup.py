"""Installs ``beam_shared_prefix_autoload.pth`` at the top of site-packages (metadata is in pyproject.toml).

Python's ``site`` module runs ``.pth`` files found directly in a site-packages directory at every
interpreter start-up; that is how TensorRT-LLM worker processes register the library. setuptools
has no declarative option for a top-level file in site-packages (``data-files`` are relative to the
install prefix, where Linux Pythons never look for ``.pth`` files), so ``build_py`` copies the file
into the root of the wheel's purelib tree.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "beam_shared_prefix_autoload.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return list(super().get_outputs(include_bytecode)) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):  # setuptools >= 64, editable installs
        mapping = dict(super().get_output_mapping())
        mapping[os.path.join(self.build_lib, PTH)] = os.path.join(HERE, PTH)
        return mapping


setup(cmdclass={"build_py": build_py_with_pth})
