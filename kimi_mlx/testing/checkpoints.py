"""Small deterministic Kimi K3.1 checkpoints in the official file layout, for tests and demos.

`build_checkpoint(out_dir)` writes what the release has, at toy size: `config.json` (the
multimodal wrapper with `text_config`, `dsa_config`, compressed-tensors
`quantization_config`), sharded `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`, the `language_model.` prefix, BF16 weights (F32 for KDA
conv/A_log/dt_bias and the router bias), MXFP4 `weight_packed` + E8M0 `weight_scale`
routed experts, a zero-padded `A_log[128]`, vision-tower / projector tensors and an MTP
layer (both must be skipped; with `mtp_layers` a real MTP layer and
`num_nextn_predict_layers`, for `--draft mtp`), and tokenizer files (`tiktoken.model` +
`tokenizer_config.json`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.model.config import ARCHITECTURE, MODEL_TYPE, ModelArgs
from kimi_mlx.model.tensor_map import EXPERT_FIELD, EXPERT_PROJ

F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


def tiny_text_config(**overrides) -> Dict[str, Any]:
    """A toy K3.1 text config: 6 layers (0 dense; KDA 0,1,3,4; DSA 2,5), AttnRes blocks of
    2, 8 routed experts top-2 + 1 shared, index_topk 8, hidden 64, vocab 512."""
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [3, 6],
            "kda_layers": [1, 2, 4, 5],
        },
        "dsa_config": {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8},
        "eos_token_id": 258,
    }
    cfg.update(overrides)
    cfg.setdefault("dsa_config", {})
    cfg["dsa_config"].setdefault("dsa_layers", cfg["linear_attn_config"]["full_attn_layers"])
    return cfg


def tiny_vision_config(**overrides) -> Dict[str, Any]:
    """A toy MoonViT3d `vision_config` in the release's key names: 2 blocks, hidden 32,
    2 heads x 16, MLP 64, the real 64 x 64 position grid, patch 14, merge 2 x 2."""
    cfg = {
        "model_type": "moonvit3d", "patch_size": 14, "init_pos_emb_height": 64,
        "init_pos_emb_width": 64, "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear", "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 2, "vt_hidden_size": 32, "vt_intermediate_size": 64,
        "qkv_hidden_size": 32, "norm_type": "rmsnorm", "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "linear_bias": False,
        "patch_embed_proj_bias": False, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2", "mm_hidden_size": 32,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    }
    cfg.update(overrides)
    return cfg


def random_vision(config: Dict[str, Any], seed: int = 0):
    """`kimi_mlx.vision.tower.VisionModel` for a full config (its `vision_config`) with
    deterministic random float32 weights: norms U(0.8, 1.2), the position grid N(0, 1),
    every matrix N(0, fan_in^-1/2) (fan_in = 3 p p for the patch projection)."""
    from kimi_mlx.vision.config import VisionArgs
    from kimi_mlx.vision.tower import VisionModel

    model = VisionModel(VisionArgs.from_config(config))
    rng = np.random.default_rng(seed + 77)
    new = []
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if "norm" in name:
            v = rng.uniform(0.8, 1.2, shape)
        elif name.endswith("pos_emb.weight"):
            v = rng.normal(0.0, 1.0, shape)
        elif name.endswith("bias"):
            v = rng.normal(0.0, 0.05, shape)
        else:
            v = rng.normal(0.0, int(np.prod(shape[1:])) ** -0.5, shape)
        new.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(new)
    return model


def full_config(text: Dict[str, Any], vision: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Wrap a text config the way the release does (top level + text_config + quantization);
    `vision`: the vision_config (default: a stand-in with no tower to run)."""
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "scale_dtype": "uint8",
                },
                "targets": ["Linear"],
            }
        },
        "ignore": ["re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "lm_head"],
    }
    text = dict(text, quantization_config=quant)
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "text_config": text,
        "vision_config": vision or {"model_type": "moonvit3d", "hidden_size": 16, "patch_size": 14},
        "media_placeholder_token_id": text["vocab_size"] - 1,
        "pad_token_id": 0,
        "quantization_config": quant,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }


def random_model(args: ModelArgs, seed: int = 0, conditioned: bool = False):
    """Our unquantized model with deterministic, non-trivial random weights (float32).

    Args:
        args: model config. seed: weight seed (same seed, same weights).
        conditioned: draw the weights so that the model does not amplify rounding error,
            for tests that compare two computations of it (see `tolerance`). Three
            amplifiers of the plain draw are removed, each measured on the tiny config
            (relative gain of a layer to a perturbation of its input: 2 to 27 plain,
            1.05 to 2.2 conditioned; ours vs mlx-lm's kimi_k3 over 6 layers: 2e-5 to
            3e-4 plain, 0.8e-6 to 2.3e-6 conditioned):
            - AttnRes `*_res_proj` fan-in scaled (std hidden^-1/2, not 0.5), so the
              mixing logits are O(1): a softmax's relative sensitivity grows with its
              logits (std 4 before).
            - KDA decay temperature exp(A_log) in [1, 2] (not [1, 16]): g = lb *
              sigmoid(exp(A_log) a) has slope up to |lb| exp(A_log) / 4.
            - KDA keys correlated with queries (k_proj = (q_proj + k_proj / 2) / 1.118,
              same conv), so no head's output S^T q is a near-cancellation that the
              per-head output RMSNorm (`o_norm`) would scale up with its rounding error.
            And one for the indexer's top-k: index heads come in pairs with opposite
            queries (wq_b rows of head 2j+1 = -head 2j's), so a key's score
            sum_h w_h relu(q_h . k) is never exactly 0 (with independent heads a
            quarter of the keys score exactly 0 at 2 heads: exact ties that either
            computation may break either way).
            The discrete choices (expert and indexer top-k) are not pinned: tests check
            that they have margins with `margins()`.
    """
    from kimi_mlx.model.model import Model

    mx.random.seed(seed)
    model = Model(args)
    return _randomize(model, args, seed, conditioned)


def random_mtp(args: ModelArgs, depths: int = 1, seed: int = 1, conditioned: bool = False):
    """`kimi_mlx.speculative.mtp.MTP` with `depths` MTP layers (layers N..N+depths-1) and random
    weights drawn by `random_model`'s rules (its `conditioned` included)."""
    from kimi_mlx.speculative.mtp import MTP

    return _randomize(MTP(args, depths), args, seed, conditioned)


def _randomize(model, args: ModelArgs, seed: int, conditioned: bool):
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(model.parameters()))
    new = {}
    for name, p in params.items():
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 2.0 if conditioned else 16.0, shape))
        elif name.endswith("dt_bias"):
            v = rng.normal(0.0, 0.5, shape)
        elif name.endswith("e_score_correction_bias"):
            v = rng.normal(0.0, 0.1, shape)
        elif name.endswith("_res_proj.weight"):
            v = rng.normal(0.0, shape[-1] ** -0.5 if conditioned else 0.5, shape)
        elif "norm" in name and name.endswith("weight"):
            v = rng.uniform(0.8, 1.2, shape)
        elif name.endswith("bias"):
            v = rng.normal(0.0, 0.05, shape)
        elif name.endswith("conv1d.weight"):
            v = rng.normal(0.0, 0.5, shape)
        elif name.endswith("embed_tokens.weight"):
            v = rng.normal(0.0, 1.0, shape)
        else:
            fan_in = shape[-1]
            v = rng.normal(0.0, fan_in**-0.5, shape)
        new[name] = v.astype(np.float32)
    if conditioned:
        for name in new:
            if name.endswith("self_attn.k_proj.weight"):  # KDA only (MLA has no k_proj)
                pre = name[: -len("k_proj.weight")]
                new[name] = ((new[pre + "q_proj.weight"] + 0.5 * new[name]) / 1.25**0.5)
                new[pre + "k_conv1d.weight"] = new[pre + "q_conv1d.weight"].copy()
            if name.endswith("indexer.wq_b.weight"):  # head 2j+1 queries = -(head 2j's)
                w = new[name].reshape(args.index_n_heads, args.index_head_dim, -1)
                w[1::2] = -w[0 : 2 * (args.index_n_heads // 2) : 2]
                new[name] = w.reshape(new[name].shape)
    model.load_weights([(k, mx.array(v)) for k, v in new.items()])
    return model


# ------------------------------------------------------------------ numerical comparisons

F32_UNIT_ROUNDOFF = 2.0**-24  # u: relative error of one rounded float32 operation


def reduction_length(args: ModelArgs, tokens: int) -> int:
    """n: the longest sum a forward pass of `tokens` tokens rounds (a matmul's inner
    dimension, or the token count that attention and the KDA state accumulate over)."""
    kda = args.linear_attn_config or {}
    widths = [
        args.hidden_size, args.intermediate_size, args.q_lora_rank or 0, args.kv_lora_rank,
        args.num_attention_heads * args.v_head_dim,
        args.moe_intermediate_size * max(1, args.num_shared_experts or 0),
        args.routed_expert_hidden_size or 0,
        kda.get("num_heads", 0) * kda.get("head_dim", 0),
    ]
    return max(max(widths), int(tokens))


def tolerance(depth: int, n: int, unit_roundoff: float = F32_UNIT_ROUNDOFF) -> float:
    """THE tolerance rule for comparing two float32 computations of the same (conditioned)
    model: kimi-mlx vs mlx-lm's kimi_k3, kernels vs reference ops, cached vs uncached,
    stages vs one process, chunked vs whole prefill.

    Compare with `rel_err(a, b) = max|a - b| / max|b|`; the bound is

        tol = 2 * (depth + 1) * n * u

    - u = 2^-24: one float32 operation rounds with relative error <= u.
    - n * u: the deterministic bound on the relative error of a sum of n products
      (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1,
      gamma_n = n u / (1 - n u)); n = `reduction_length` (inner dimensions, tokens).
    - (depth + 1): each of `depth` layers, and the final norm + head, adds one such error;
      on a conditioned model (`random_model(conditioned=True)`) a layer passes the error
      it receives on with a gain of ~1 (measured 1.05 to 2.2 per layer), so errors add
      up linearly in depth instead of compounding.
    - 2: both computations carry their own rounding error.

    On the tiny config (6 layers, n = 128) tol = 1.1e-4, against measured differences of
    1.4e-6 to 1.8e-6 (ours vs mlx-lm, kernels vs reference, cached vs full): ~60x margin
    for another machine's summation order (BLAS threads, SIMD width), and still below
    what a 0.1% error in one layer's attention scale gives (tests/test_model.py). The discrete choices a comparison crosses
    must have margins of at least this tolerance (`Margins.check`).

    Args:
        depth: layers the compared values went through (1 for a single layer).
        n: longest rounded sum (`reduction_length`).
        unit_roundoff: u of the arithmetic (float32 by default).
    Returns:
        relative tolerance (float).
    """
    return 2.0 * (depth + 1) * n * unit_roundoff


def model_tolerance(args: ModelArgs, tokens: int, depth: Optional[int] = None) -> float:
    """`tolerance` for logits (or states) of a forward pass of `tokens` tokens through
    `depth` layers (default: all of `args`)."""
    depth = args.num_hidden_layers if depth is None else depth
    return tolerance(depth, reduction_length(args, tokens))


def rel_err(a, b) -> float:
    """max|a - b| / max|b| (float32; NaN or inf in a gives inf)."""
    a = mx.array(a).astype(mx.float32)
    b = mx.array(b).astype(mx.float32)
    if a.shape != b.shape:
        raise ValueError(f"rel_err: shapes differ, {a.shape} vs {b.shape}")
    err = mx.abs(a - b).max().item()
    if not np.isfinite(err):
        return float("inf")
    scale = mx.abs(b).max().item()
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


class Margins:
    """Margins of the discrete choices made by our model while recording (`margins()`).

    A margin is the gap between the last selected and the first unselected candidate,
    in units of the relative input error that would swap them:
    - router (expert top-k on sigmoid(logits) + e_score_correction_bias): a relative error
      d of the logits moves a choice value by at most d * max|logits| / 4 (the sigmoid's
      slope is <= 1/4), so margin = gap / (max|logits| / 4), per token;
    - indexer (top-k of I[t, s] = sum_h w_h relu(q_h . k_s) over s <= t, rows with more
      than index_topk candidates): relative errors d of w, q and k move I by at most
      3 d max_s sum_h |w_h| |q_h . k_s|, so margin = gap / (3 * that), per pair of a
      selected and an unselected key near the boundary; a pair of keys within tol of
      each other (relative) may swap unharmed and is not counted.
    Two computations whose outputs agree within `tol` make the same choices when every
    margin is above tol: the router and indexer inputs lie upstream of those outputs, and
    on a conditioned model errors grow, not shrink, with depth. `check` asks for that.
    """

    def __init__(self):
        self.router: list = []  # lazy mx arrays of per-token margins
        self.indexer: list = []  # [P, 2] arrays: (margin, key difference) per pair

    @property
    def router_min(self) -> float:
        """Smallest expert-choice margin seen (inf if no routing happened)."""
        vals = [mx.min(p).item() for p in self.router if p.size]
        return min(vals) if vals else float("inf")

    def indexer_min(self, tol: float = 0.0) -> float:
        """Smallest indexer-choice margin seen among pairs of keys more than `tol` apart
        (inf if none)."""
        vals = [mx.min(mx.where(p[:, 1] > tol, p[:, 0], mx.inf)).item()
                for p in self.indexer if p.size]
        return min(vals) if vals else float("inf")

    def check(self, tol: float, need_indexer: bool = False) -> None:
        """Assert every recorded margin is >= tol (and that some routing, and with
        need_indexer some indexer selection, was recorded).

        Raises:
            AssertionError: naming the choice kind, its margin and the tolerance; the
                remedy is another seed or prompt for the test, not a looser tolerance.
        """
        assert self.router, "no expert routing was recorded"
        if need_indexer:
            assert self.indexer, "no indexer selection past index_topk was recorded"
        for kind, m in (("router", self.router_min), ("indexer", self.indexer_min(tol))):
            assert m >= tol, (
                f"{kind} top-k margin {m:.3g} < tolerance {tol:.3g}: a near tie that "
                f"rounding may flip; pick another seed or prompt for this test")


def _router_margin(logits, bias, top_k):
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)
    E = choice.shape[-1]
    if top_k >= E:
        return mx.array([np.inf], mx.float32)
    top = mx.topk(choice, top_k + 1, axis=-1)  # ascending: [k+1-th, k-th, ...]
    top = mx.sort(top, axis=-1)
    gap = top[..., 1] - top[..., 0]
    scale = mx.abs(logits.astype(mx.float32)).max(axis=-1) / 4
    return (gap / mx.maximum(scale, 1e-30)).reshape(-1)


def _indexer_margin(q_idx, weights, k_idx, topk, offset, starts=None):
    """Indexer margins (see `Margins`) of the queries with more than `topk` candidates:
    [P, 2] float32 rows (margin, key difference), one per pair of a selected and an
    unselected key near the boundary (the 4 lowest selected against the 4 highest left
    out; `starts` [B]: first real key of each left-padded batch row, or None). The key difference is max|k_i - k_j| / max|k| of the row: a swap of two keys
    that close changes the attention by about that much, so a near tie between them is
    harmless to a comparison whose tolerance is larger (the same token in the same local
    context gets nearly the same key, and natural text repeats).
    """
    from kimi_mlx.metal.dsa import dequantize_rows, dsa_index_scores, quant_format

    if isinstance(k_idx, (tuple, list)):  # an 8-bit cache's index keys, read packed
        k_idx = dequantize_rows(k_idx, *quant_format(k_idx, q_idx.shape[-1], "index keys"))
    if k_idx.shape[1] <= topk:
        return mx.zeros((0, 2), mx.float32)
    scores = np.array(dsa_index_scores(q_idx, weights, k_idx, offset, starts))  # [B, L, S]
    first = [0] * scores.shape[0] if starts is None else np.array(starts).tolist()
    q = np.array(q_idx.astype(mx.float32))
    k = np.array(k_idx.astype(mx.float32))
    w = np.abs(np.array(weights.astype(mx.float32)))
    out = []
    for b in range(scores.shape[0]):
        for l in range(scores.shape[1]):
            s0, n = first[b], offset + l + 1  # allowed keys s0..offset+l
            if n - s0 <= topk:
                continue
            row = scores[b, l, s0:n]
            kb = k[b, s0:n]
            order = np.argsort(-row, kind="stable")
            kmax = max(float(np.abs(kb).max()), 1e-30)
            bound = (w[b, l][:, None] * np.abs(q[b, l] @ kb.T)).sum(axis=0).max()
            for i in order[max(0, topk - 4) : topk]:
                for j in order[topk : topk + 4]:
                    out.append(((row[i] - row[j]) / max(3 * bound, 1e-30),
                                np.abs(kb[i] - kb[j]).max() / kmax))
    return mx.array(np.array(out, dtype=np.float32).reshape(-1, 2))


def argmax_margin(logits) -> float:
    """Smallest gap between the largest and second-largest logit of any row of `logits`
    [..., vocab], relative to that row's max |logit|: two computations within `tol` of
    each other pick the same greedy token where this is above tol."""
    x = mx.array(logits).astype(mx.float32)
    top2 = mx.sort(mx.topk(x, 2, axis=-1), axis=-1)
    gap = (top2[..., 1] - top2[..., 0]) / mx.maximum(mx.abs(x).max(axis=-1), 1e-30)
    return mx.min(gap).item()


@contextlib.contextmanager
def margins():
    """Record the margins of our model's expert and indexer top-k choices made inside
    the block (reference ops and kernels alike; see `Margins`). Yields a `Margins`."""
    from kimi_mlx.model import dsa as dsa_mod
    from kimi_mlx.model import ffn as ffn_mod

    rec = Margins()
    real_route = ffn_mod.route
    real_prefill = dsa_mod.dsa_prefill_indices
    real_decode = dsa_mod.dsa_sparse_decode

    def route(logits, bias, top_k, *a, **kw):
        rec.router.append(_router_margin(logits, bias, top_k))
        return real_route(logits, bias, top_k, *a, **kw)

    def prefill(q_idx, weights, k_idx, topk, offset, starts=None):
        rec.indexer.append(_indexer_margin(q_idx, weights, k_idx, topk, offset, starts))
        return real_prefill(q_idx, weights, k_idx, topk, offset, starts=starts)

    def decode(q_lat, q_pe, latent, k_pe, scale, q_idx, weights, k_idx, topk, offset,
               starts=None):
        rec.indexer.append(_indexer_margin(q_idx, weights, k_idx, topk, offset, starts))
        return real_decode(q_lat, q_pe, latent, k_pe, scale, q_idx, weights, k_idx, topk,
                           offset, starts=starts)

    ffn_mod.route, dsa_mod.dsa_prefill_indices, dsa_mod.dsa_sparse_decode = route, prefill, decode
    try:
        yield rec
    finally:
        ffn_mod.route = real_route
        dsa_mod.dsa_prefill_indices, dsa_mod.dsa_sparse_decode = real_prefill, real_decode


def checkpoint_tensors(model, args: ModelArgs, dtype=mx.bfloat16) -> Dict[str, mx.array]:
    """Our unquantized model's parameters under the official names and dtypes.

    Experts become per-expert MXFP4 `weight_packed` (U8 [out, in/2]) and `weight_scale`
    (U8 [out, in/32]) via `mx.quantize(mode="mxfp4")`; A_log is zero padded to [128].
    """
    out = {}
    inv_proj = {v: k for k, v in EXPERT_PROJ.items()}
    inv_field = {v: k for k, v in EXPERT_FIELD.items()}
    for name, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:
            moe, rest = name.split(".switch_mlp.")
            proj, _ = rest.split(".")
            q, scales = mx.quantize(p, group_size=32, bits=4, mode="mxfp4")
            packed = q.view(mx.uint8)
            for e in range(p.shape[0]):
                w = inv_proj[proj]
                out[f"{moe}.experts.{e}.{w}.{inv_field['weight']}"] = packed[e]
                out[f"{moe}.experts.{e}.{w}.{inv_field['scales']}"] = scales[e]
            continue
        if name.endswith("self_attn.A_log"):
            pad = max(128, p.shape[0])
            p = mx.concatenate([p, mx.zeros((pad - p.shape[0],), p.dtype)])
        keep_f32 = name.endswith(F32_SUFFIXES)
        out[name] = p.astype(mx.float32 if keep_f32 else dtype)
    return out


def extra_tensors(args: ModelArgs, dtype=mx.bfloat16) -> Dict[str, mx.array]:
    """Tensors the loader must skip: a vision tower, the projector and one MTP layer."""
    n = args.num_hidden_layers
    d = args.hidden_size
    return {
        "vision_tower.encoder.blocks.0.wqkv.weight": mx.ones((48, 16), dtype),
        "vision_tower.patch_embed.proj.weight": mx.ones((16, 3, 14, 14), dtype),
        "mm_projector.proj.0.weight": mx.ones((64, 64), dtype),
        f"language_model.model.layers.{n}.enorm.weight": mx.ones((d,), dtype),
        f"language_model.model.layers.{n}.eh_proj.weight": mx.ones((d, 2 * d), dtype),
    }


def shard_plan(names, args: ModelArgs, n_shards: int) -> Dict[str, int]:
    """Shard number (1-based) per tensor: layers spread evenly, embedding in the first,
    norm / head in the last, skipped extras in the last."""
    from kimi_mlx.model.tensor_map import layer_of

    n = args.num_hidden_layers
    plan = {}
    for name in names:
        layer = layer_of(name)
        if name.startswith(("vision_tower", "mm_projector")) or (layer is not None and layer >= n):
            plan[name] = n_shards
        elif layer is None:
            plan[name] = 1 if "embed_tokens" in name else n_shards
        else:
            plan[name] = 1 + layer * n_shards // n
    return plan


def write_safetensors_sharded(
    tensors: Dict[str, mx.array], plan: Dict[str, int], out_dir: Path, n_shards: int
) -> None:
    """Write shards and `model.safetensors.index.json` in the Hugging Face layout."""
    weight_map = {}
    total = 0
    for k in range(1, n_shards + 1):
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        part = {name: t for name, t in tensors.items() if plan[name] == k}
        if not part:
            continue
        mx.save_safetensors(str(out_dir / fname), part, metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def byte_level_ranks() -> Dict[bytes, int]:
    """256 single-byte ranks: the smallest valid tiktoken vocabulary."""
    return {bytes([i]): i for i in range(256)}


def build_checkpoint(
    out_dir,
    text_config: Optional[Dict[str, Any]] = None,
    seed: int = 0,
    n_shards: int = 3,
    dtype=mx.bfloat16,
    model=None,
    ranks: Optional[Dict[bytes, int]] = None,
    extras: bool = True,
    conditioned: bool = False,
    mtp_layers: int = 0,
    vision: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write a checkpoint folder in the official layout; returns its path.

    Args:
        out_dir: destination folder (must not exist; written atomically via a temp dir).
        text_config: text config (default `tiny_text_config()`).
        seed: weight seed (deterministic output for a given seed).
        n_shards: number of safetensors shards.
        dtype: dtype of the non-expert, non-F32 tensors (BF16 like the release).
        model: optional unquantized `Model` to export instead of random weights.
        ranks: tokenizer ranks (default: 256 byte tokens); specials follow them.
        extras: also write vision / projector / MTP tensors that loaders must skip.
        conditioned: random weights drawn for numerical comparisons
            (`random_model(conditioned=True)`); ignored when `model` is given.
        mtp_layers: write that many real MTP layers (`layers.N..N+mtp_layers-1`, official
            names, MXFP4 experts; random weights by `random_mtp` with seed + 1000, so the
            trunk is the one the same seed gives without them) and set the text config's
            `num_nextn_predict_layers`; they replace the extras' stand-in MTP tensors.
        vision: a `vision_config` (e.g. `tiny_vision_config()`): write a real vision tower
            and projector for it (`random_vision(config, seed)`, official names, BF16 by
            `dtype`) instead of the extras' stand-in vision tensors.
            `media_placeholder_token_id` is the tokenizer's `<|media_pad|>` either way.
    Raises:
        FileExistsError: out_dir exists.
    """
    from kimi_mlx.text.tokenizer import kimi_special_tokens, write_tokenizer_files

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists")
    text = copy.deepcopy(text_config or tiny_text_config())
    ranks = ranks or byte_level_ranks()
    specials = kimi_special_tokens(len(ranks))
    text["vocab_size"] = max(text["vocab_size"], len(ranks) + len(specials))
    text["eos_token_id"] = specials["<|end_of_msg|>"]
    if mtp_layers:
        text["num_nextn_predict_layers"] = mtp_layers
    config = full_config(text, vision)
    config["media_placeholder_token_id"] = specials["<|media_pad|>"]  # as the release: its pad
    args = ModelArgs.from_config(config)
    model = model if model is not None else random_model(args, seed, conditioned)
    tensors = checkpoint_tensors(model, args, dtype)
    if extras:
        tensors.update(extra_tensors(args, dtype))
    if mtp_layers:
        n = args.num_hidden_layers
        tensors = {k: v for k, v in tensors.items()
                   if not k.startswith(f"language_model.model.layers.{n}.")}
        tensors.update(checkpoint_tensors(random_mtp(args, mtp_layers, seed + 1000, conditioned),
                                          args, dtype))
    if vision is not None:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(("vision_tower.", "mm_projector."))}
        tensors.update({k: v.astype(dtype) for k, v in
                        tree_flatten(random_vision(config, seed).parameters())})
    plan = shard_plan(tensors, args, n_shards)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_safetensors_sharded(tensors, plan, tmp, n_shards)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": text["eos_token_id"]}, indent=2)
        )
        write_tokenizer_files(tmp, ranks, specials)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
