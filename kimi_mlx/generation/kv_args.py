"""`--kv-bits` / `--kv-group-size`: the Gated DSA cache format, shared by every command
that runs the model (`generate`, `chat`, `eval`, `server`, `cluster launch|server`).

Without `--kv-bits` the cache keeps the model dtype (BF16 on K3.1). `--kv-bits 8` keeps
the MLA latent's 512 no-rope values and the indexer's 128-value keys in MLX's affine
8-bit format with one scale and bias per `--kv-group-size` values (default 128,
model/cache.py KV_DEFAULT_GROUP);
the 64 rope values stay in the model dtype.
"""

from __future__ import annotations

import argparse
from typing import Optional, Tuple

from kimi_mlx.model.cache import KV_BITS, KV_DEFAULT_GROUP, KV_GROUP_SIZES, check_kv_quant

__all__ = ["add_kv_arguments", "kv_quant", "apply_kv_quant"]


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """Add --kv-bits and --kv-group-size to a command's parser."""
    p.add_argument("--kv-bits", type=int, default=None, choices=KV_BITS,
                   help="keep the attention cache (MLA latent and indexer keys; the rope "
                        "part stays in the model dtype) in 8-bit: 0.56x the bytes per "
                        "token of BF16 at the default group 128 (0.57x at 64, 0.60x at "
                        "32); same perplexity, not token-for-token the same text (README) "
                        "(default: the model dtype, no quantization)")
    p.add_argument("--kv-group-size", type=int, default=KV_DEFAULT_GROUP, choices=KV_GROUP_SIZES,
                   help=f"values per scale and bias of the 8-bit cache (default "
                        f"{KV_DEFAULT_GROUP})")


def kv_quant(args) -> Tuple[Optional[int], int]:
    """(kv_bits, kv_group_size) from parsed arguments (defaults where a parser has no such
    flag). ValueError for an unsupported pair."""
    bits = getattr(args, "kv_bits", None)
    group = getattr(args, "kv_group_size", KV_DEFAULT_GROUP) or KV_DEFAULT_GROUP
    bits = bits or None
    check_kv_quant(bits, group)
    return bits, group


def apply_kv_quant(model, args) -> None:
    """Give `model` (our `Model`, or anything with `set_kv_quant`) the cache format of the
    parsed arguments; a model without DSA caches (no `set_kv_quant`) is left alone."""
    bits, group = kv_quant(args)
    if hasattr(model, "set_kv_quant"):
        model.set_kv_quant(bits, group)
