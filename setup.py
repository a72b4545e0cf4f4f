"""Install-time hook: ship `kimi_mlx_mlx_lm.pth` into site-packages.

The .pth line runs `kimi_mlx._mlx_lm_hook` at interpreter start, which registers the
`kimi_k31` model type with mlx-lm (by a module alias, nothing is written into mlx-lm), so
`mlx_lm.generate --model <our checkpoint>` works without `import kimi_mlx`.
Everything else about the package lives in pyproject.toml.
"""

import os
import shutil
import warnings

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kimi_mlx_mlx_lm.pth"

try:  # `make demo` / `make test` install editable: setuptools then prints an 11-line
    # "Editable installation" notice (folders named like the package may shadow it), which
    # pip shows even with -q. Here the folder named like the package *is* the package.
    from setuptools.warnings import InformationOnly

    warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)
except ImportError:  # older setuptools: no such notice either
    pass


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class editable_wheel_with_pth(editable_wheel):
    # Editable installs never copy build_lib into the wheel; put the .pth beside the
    # namespace stubs that setuptools writes into the unpacked wheel root.
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
