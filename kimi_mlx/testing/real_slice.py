"""A checkpoint slice of Kimi K3.1 Pro at its real widths, for `make check-real`.

`build_real_slice(out_dir)` writes, in the official file layout (`config.json` with
`text_config`, one `model-0000N-of-00093.safetensors` shard per layer, and
`model.safetensors.index.json`), only the tensors of a contiguous layer range of the real
model (`kimi_mlx/assets/official/Kimi-K3.1-Pro/config.json`: hidden 7168, 96 KDA heads of
128, MLA ranks 1536 / 512, 32 indexer heads of 128, index_topk 2048, vocabulary 163840).
The one change to the config is the number of routed experts (and how many a token
picks): a few instead of 896, each at its real widths (3584 -> 3072 -> 3584, MXFP4).
The default range, layers [2, 4), is one KDA layer (2) and one Gated DSA layer (3), both
with the latent MoE; a middle range needs neither the embedding nor lm_head, so the slice
is about 2.4 GB instead of the release's 1.56 TB.

Tensor names and shapes come from our model of one layer at a time (built lazily: its own
random initialisation is never computed), named and typed as `kimi_mlx.testing.checkpoints.
checkpoint_tensors` does; one layer is written per shard, so memory stays near one
layer's BF16 weights.

Weights are random and conditioned so that outputs stay O(1) through the layers: linear
weights N(0, 1/fan_in) (unit gain), norm weights in [0.8, 1.2], KDA A_log = log U(1, 16)
per head, dt_bias N(0, 0.5^2), conv taps N(0, 0.5^2), AttnRes projections N(0, 0.5^2),
router correction bias N(0, 0.1^2); routed experts are random MXFP4 codes with E8M0 scales
chosen for an RMS near 1/sqrt(fan_in) (`random_mxfp4`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.tensor_map import EXPERT_PROJ
from kimi_mlx.testing.checkpoints import F32_SUFFIXES

OFFICIAL_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "official" / "Kimi-K3.1-Pro" / "config.json"

__all__ = ["OFFICIAL_CONFIG", "real_slice_config", "build_real_slice", "real_value", "random_mxfp4"]


def real_slice_config(num_experts: int = 8, experts_per_token: int = 2) -> Dict[str, Any]:
    """The shipped official K3.1 Pro config with `num_experts` routed experts, of which a
    token picks `experts_per_token`; every width is the release's.

    Raises:
        ValueError: experts_per_token not in [1, num_experts].
    """
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(
            f"experts_per_token must be in [1, num_experts={num_experts}], got {experts_per_token}"
        )
    config = json.loads(OFFICIAL_CONFIG.read_text())
    text = config["text_config"]
    text["num_experts"] = int(num_experts)
    text["num_experts_per_token"] = int(experts_per_token)
    return config


def real_value(name: str, shape, dtype, seed: int) -> mx.array:
    """Deterministic conditioned random value of one parameter (rules in the module doc).

    Args:
        name: the parameter's module path (= checkpoint name, `...layers.N.<module>.<param>`).
        shape: its shape; dtype: the mx dtype to produce.
        seed: slice seed; each tensor's generator is seeded from (seed, name), so a
            tensor's value does not depend on which other tensors are built.
    Returns:
        mx.array of `shape` and `dtype` (NumPy's generator: MLX's is ~4x slower on CPU).
    """
    rng = _rng(name, seed)
    shape = tuple(shape)
    if name.endswith("A_log"):
        v = np.log(rng.uniform(1.0, 16.0, shape))
    elif name.endswith(("dt_bias", "conv1d.weight", "_res_proj.weight")):
        v = 0.5 * rng.standard_normal(shape, dtype=np.float32)
    elif name.endswith("e_score_correction_bias"):
        v = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif "norm" in name and name.endswith("weight"):
        v = rng.uniform(0.8, 1.2, shape)
    elif name.endswith("bias"):
        v = 0.05 * rng.standard_normal(shape, dtype=np.float32)
    else:
        v = rng.standard_normal(shape, dtype=np.float32)
        v *= np.float32(shape[-1] ** -0.5)
    return mx.array(v.astype(np.float32, copy=False)).astype(dtype)


def _rng(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# E8M0 scales of the random experts: an MXFP4 code drawn uniformly from its 16 values has
# RMS sqrt(mean{0,.5,1,1.5,2,3,4,6}^2) = 2.93; 2^(119-127) and 2^(120-127) times that
# bracket fan_in^-1/2 (0.0167 for 3584, 0.0180 for 3072).
_EXPERT_SCALES = (119, 120)


def random_mxfp4(name: str, out_dim: int, in_dim: int, seed: int):
    """(weight_packed U8 [out, in/2], weight_scale U8 [out, in/32]) of one expert projection:
    uniformly random E2M1 codes (two per byte) and E8M0 scales from `_EXPERT_SCALES`,
    drawn directly in the packed format (quantizing float weights is ~30x slower here)."""
    rng = _rng(name, seed)
    packed = rng.integers(0, 256, (out_dim, in_dim // 2), dtype=np.uint8)
    scale = rng.choice(np.array(_EXPERT_SCALES, dtype=np.uint8), (out_dim, in_dim // 32))
    return mx.array(packed), mx.array(scale)


def _layer_tensors(args: ModelArgs, i: int, seed: int) -> Dict[str, mx.array]:
    """Checkpoint tensors of layer i: official names and dtypes (K31_SPEC.md s.2), BF16
    except the F32 ones, A_log zero padded to [128], per-expert MXFP4 experts."""
    from kimi_mlx.model.model import Model

    model = Model(args, i, i + 1)  # lazy: its own random init is never computed
    inv_proj = {v: k for k, v in EXPERT_PROJ.items()}
    out: Dict[str, mx.array] = {}
    for name, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:
            moe, rest = name.split(".switch_mlp.")
            w = inv_proj[rest.split(".")[0]]
            n_exp, out_dim, in_dim = p.shape
            for e in range(n_exp):
                base = f"{moe}.experts.{e}.{w}"
                out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = random_mxfp4(
                    base, out_dim, in_dim, seed)
            continue
        dtype = mx.float32 if name.endswith(F32_SUFFIXES) else mx.bfloat16
        v = real_value(name, p.shape, dtype, seed)
        if name.endswith("self_attn.A_log"):  # the release pads 96 per-head values to 128
            v = mx.concatenate([v, mx.zeros((max(128, v.shape[0]) - v.shape[0],), dtype)])
        out[name] = v
    return out


def build_real_slice(
    out_dir,
    start: int = 2,
    end: int = 4,
    num_experts: int = 8,
    experts_per_token: int = 2,
    seed: int = 0,
    config: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write layers [start, end) of K3.1 Pro at real widths (few experts); returns the path.

    Args:
        out_dir: destination folder (must not exist; written to a temp folder beside it
            and renamed into place).
        start, end: 0-based layer range inside [0, 93). Default [2, 4): KDA layer 2 and
            Gated DSA layer 3. A range with layer 0 or 92 also writes the embedding or
            the head (2.3 GB each in BF16).
        num_experts, experts_per_token: routed experts per MoE layer and picked per token.
        seed: weight seed.
        config: a full config to use instead of `real_slice_config(num_experts,
            experts_per_token)` (tests pass a toy one; the expert counts are then its own).
    Returns:
        out_dir as a Path. Size: about 1.2 GB per layer of the default range.
    Raises:
        FileExistsError: out_dir exists. ValueError: a bad layer range or expert counts.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists")
    if config is None:
        config = real_slice_config(num_experts, experts_per_token)
    args = ModelArgs.from_config(config)
    n = args.num_hidden_layers
    if not 0 <= start < end <= n:
        raise ValueError(f"layer range [{start}, {end}) is not inside [0, {n})")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        weight_map: Dict[str, str] = {}
        total = 0
        for i in range(start, end):
            tensors = _layer_tensors(args, i, seed)
            if i == start and start == 0:
                tensors.update(_ends(args, "first", seed))
            if i == end - 1 and end == n:
                tensors.update(_ends(args, "last", seed))
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            mx.save_safetensors(str(tmp / fname), tensors, metadata={"format": "pt"})
            for name, t in tensors.items():
                weight_map[name] = fname
                total += t.nbytes
            del tensors
            mx.clear_cache()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _ends(args: ModelArgs, which: str, seed: int) -> Dict[str, mx.array]:
    """Embedding (first stage) or output mix + norm + lm_head (last stage), BF16."""
    d, v = args.hidden_size, args.vocab_size
    m = "language_model.model."
    if which == "first":
        shapes = {f"{m}embed_tokens.weight": (v, d)}
    else:
        shapes = {f"{m}norm.weight": (d,), f"{m}output_attn_res_norm.weight": (d,),
                  f"{m}output_attn_res_proj.weight": (1, d)}
        if not args.tie_word_embeddings:
            shapes["language_model.lm_head.weight"] = (v, d)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("embed_tokens.weight"):
            out[name] = mx.array(_rng(name, seed).standard_normal(shape, dtype=np.float32))
            out[name] = out[name].astype(mx.bfloat16)
        else:
            out[name] = real_value(name, shape, mx.bfloat16, seed)
    return out

