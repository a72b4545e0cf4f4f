"""Install-time hook: ship `kimi_mlx_mlx_lm.pth` into site-packages.

The .pth line runs `kimi_mlx._mlx_lm_hook` at interpreter start, which registers the
`kimi_k31` model type with mlx-lm (by a module alias, nothing is written into mlx-lm), so
`mlx_lm.generate --model <our checkpoint>` works without `import kimi_mlx`.
Everything else about the package lives in pyproject.toml.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kimi_mlx_mlx_lm.pth"


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
