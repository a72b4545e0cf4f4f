"""Registering our ``TikTokenTokenizer`` with transformers, so
``AutoTokenizer.from_pretrained(kimi folder)`` (and so ``mlx_lm.load``) returns it and never
runs the folder's ``tokenization_kimi.py`` / ``configuration_kimi.py``.

Importing this module imports nothing heavy: by default registration waits for
transformers' AutoTokenizer module to be imported (a one-shot meta-path finder).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["register_with_transformers"]

_TOKENIZATION_AUTO = "transformers.models.auto.tokenization_auto"
_REGISTERED = False
# Top-level model_type values of Kimi K3/K3.1 checkpoints. Registering a config class for
# them means AutoConfig never offers to run the checkpoint's configuration_*.py.
_MODEL_TYPES = ("kimi_k31", "kimi_k3")


def _register_now() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kimi_mlx.text.hf_tokenizer import TikTokenTokenizer as cls

    for model_type in _MODEL_TYPES:
        if model_type not in CONFIG_MAPPING:
            name = "".join(p.capitalize() for p in model_type.split("_")) + "Config"
            config_cls = type(name, (PretrainedConfig,), {"model_type": model_type, "__module__": __name__})
            AutoConfig.register(model_type, config_cls, exist_ok=True)
    # AutoTokenizer.register is what makes the name "TikTokenTokenizer" resolve to our
    # class. It is keyed on a config class that AutoConfig never returns on purpose: when
    # a folder's config type is *in* the tokenizer mapping, transformers runs the folder's
    # auto_map code under trust_remote_code=True; when it is not, our class always wins.
    marker = type("_KimiTikTokenMarkerConfig", (PretrainedConfig,), {"model_type": "", "__module__": __name__})
    AutoTokenizer.register(marker, tokenizer_class=cls, exist_ok=True)
    _REGISTERED = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """One-shot finder: registers our tokenizer right after transformers' AutoTokenizer
    module is executed, so `import kimi_mlx` does not pay for importing transformers."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TOKENIZATION_AUTO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _register_now()
        except Exception as e:  # never break transformers itself
            warnings.warn(f"kimi_mlx: could not register TikTokenTokenizer with transformers: {e}")


def register_with_transformers(lazy: bool = True) -> None:
    """Make ``AutoTokenizer.from_pretrained(folder)`` return our ``TikTokenTokenizer``.

    Applies to folders whose ``tokenizer_config.json`` says
    ``"tokenizer_class": "TikTokenTokenizer"``, even with an ``auto_map`` pointing at
    ``tokenization_kimi.py``: no ``trust_remote_code`` is needed and no file from the
    folder is executed. Also registers minimal ``AutoConfig`` types ``kimi_k31`` and
    ``kimi_k3`` (unless transformers already knows them), so AutoConfig does not prompt
    to run the checkpoint's configuration code. ``mlx_lm.load`` goes through
    AutoTokenizer, so it picks this up too.

    With ``lazy=True`` (default) and transformers' tokenizer module not yet imported,
    registration is deferred to that import (no transformers import cost now).
    Idempotent.
    """
    if _REGISTERED:
        return
    if lazy and _TOKENIZATION_AUTO not in sys.modules:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        return
    _register_now()
