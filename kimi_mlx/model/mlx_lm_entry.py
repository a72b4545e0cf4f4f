"""The module mlx-lm imports as `mlx_lm.models.kimi_k31` (`kimi_mlx._mlx_lm_hook`).

It is `kimi_mlx.model.model` with one difference: `Model` starts with the activation dtype
our loader picks (`default_activation_dtype`: float32 on the CPU backend), because
`mlx_lm.load` builds the model with `Model(args)` and never asks. So `mlx_lm.generate
--model <our checkpoint>` computes as `kimi-mlx generate` does and greedy text is the same.
"""

from __future__ import annotations

from typing import Optional

from kimi_mlx.model.model import DecoderLayer, ModelArgs, TextModel, default_activation_dtype
from kimi_mlx.model.model import Model as _Model

__all__ = ["Model", "ModelArgs", "DecoderLayer", "TextModel"]


class Model(_Model):
    """`kimi_mlx.model.model.Model` with `activation_dtype = default_activation_dtype()`."""

    def __init__(self, args: ModelArgs, start: int = 0, end: Optional[int] = None):
        super().__init__(args, start, end)
        self.activation_dtype = default_activation_dtype()
