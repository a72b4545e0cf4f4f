"""Make mlx-lm find our `kimi_k31` model type (run at interpreter start via a .pth file).

mlx-lm resolves `model_type` with `importlib.import_module(f"mlx_lm.models.{type}")`.
We register `kimi_mlx.model` under that name lazily, with a meta-path finder, so nothing is
imported (not even MLX) until mlx-lm actually asks for the module.
"""

import importlib.abc
import importlib.util
import sys

_ALIASES = {"mlx_lm.models.kimi_k31": "kimi_mlx.model"}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _ALIASES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        # The alias *is* our module object: mlx-lm gets kimi_mlx.model itself.
        return importlib.import_module(_ALIASES[spec.name])

    def exec_module(self, module):
        pass  # already executed by the import in create_module


def install():
    """Add the alias finder once (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


install()
