"""Make mlx-lm open our checkpoints (run at interpreter start via a .pth file).

- Model: mlx-lm resolves `model_type` with `importlib.import_module(f"mlx_lm.models.{type}")`;
  a meta-path finder answers `mlx_lm.models.kimi_k31` with `kimi_mlx.model.mlx_lm_entry`
  (our model module, with the loader's activation dtype policy), lazily, so
  nothing (not even MLX) is imported until mlx-lm asks for it.
- Tokenizer: `kimi_mlx.text.hf_register.register_with_transformers()` (deferred until
  transformers' AutoTokenizer module loads) so `mlx_lm.load` gets our tiktoken tokenizer
  without running the checkpoint's tokenization_kimi.py.
Nothing is written into mlx-lm. Failures here never break interpreter start.
"""

import importlib.abc
import importlib.util
import sys

_ALIASES = {"mlx_lm.models.kimi_k31": "kimi_mlx.model.mlx_lm_entry"}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _ALIASES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        # The alias *is* our module object: mlx-lm gets kimi_mlx.model.mlx_lm_entry itself.
        return importlib.import_module(_ALIASES[spec.name])

    def exec_module(self, module):
        pass  # already executed by the import in create_module


def install():
    """Add the alias finder once (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


try:
    install()
    from kimi_mlx.text.hf_register import register_with_transformers

    register_with_transformers()
except Exception:  # a broken install must not break every Python start in this env
    pass
