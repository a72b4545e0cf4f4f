"""Checkpoint tensor names -> module paths: the one place where names are mapped.

The official release (K31_SPEC.md section 2) names every text tensor
`language_model.model.layers.N.<module>.<param>`; our modules use those same paths, so the
table is short:

| checkpoint tensor                                                    | module path                                        |
|----------------------------------------------------------------------|----------------------------------------------------|
| `...block_sparse_moe.experts.E.w1.weight_packed` (U8 [out, in/2])    | `...block_sparse_moe.switch_mlp.gate_proj.weight` (uint32 view, stacked over E) |
| `...block_sparse_moe.experts.E.w1.weight_scale` (U8 E8M0 [out, in/32]) | `...block_sparse_moe.switch_mlp.gate_proj.scales` (stacked)             |
| `w3` / `w2`                                                          | `up_proj` / `down_proj`                            |
| `...experts.E.w1.{weight,scales,biases}` (experts requantized to MLX affine by `--expert-bits`: U32 [out, in*bits/32], BF16 [out, in/group] x2) | `...switch_mlp.gate_proj.{weight,scales,biases}` (stacked over E) |
| `X.weight` (U32 [out, in*bits/32]) + `X.scales` + `X.biases` (BF16 [out, in/group]) for X a trunk linear / embedding matching `QUANTIZABLE_RE` (`kimi-mlx convert`, `prune --q-bits`) | `X.weight` / `X.scales` / `X.biases` of an MLX affine `QuantizedLinear` / `QuantizedEmbedding` |
| `...self_attn.A_log` [128] (96 per-head values, zero padded)         | `...self_attn.A_log` [num_heads]                   |
| `model.*`, `lm_head.*` (text-only files without the prefix)          | `language_model.model.*`, `language_model.lm_head.*` |
| `vision_tower.*`, `mm_projector.*`, layers >= num_hidden_layers (MTP) | skipped by the text loader (one notice); the vision tensors load, under their own names, with `checkpoint.loader.load_vision` only when a request has images |

MXFP4 bytes are bit-identical to MLX `mode="mxfp4"` (K31_SPEC.md section 6), so packed
experts are reinterpreted, never dequantised. Quantized layers' modes, bits and group
sizes are read off their tensors (`mlx_lm.utils.infer_quant_config`: uint8 scales =
mxfp4, float scales = affine with bits = 32 * packed columns / in), so one checkpoint can
mix MXFP4 experts with an affine trunk.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.model.config import ModelArgs

PREFIX = "language_model."
LAYER_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
EXPERT_RE = re.compile(
    r"^(?P<moe>language_model\.model\.layers\.\d+\.block_sparse_moe)\.experts\."
    r"(?P<e>\d+)\.(?P<w>w[123])\.(?P<f>weight_packed|weight_scale|weight|scales|biases)$"
)
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_FIELD = {"weight_packed": "weight", "weight_scale": "scales"}  # official MXFP4
# Experts requantized to MLX affine (`--expert-bits`) keep MLX's own field names.
EXPERT_AFFINE_FIELD = {"weight": "weight", "scales": "scales", "biases": "biases"}
# Trunk tensors `kimi-mlx convert` / `prune --q-bits` quantize (MLX affine): the weights
# of every nn.Linear / nn.Embedding outside the routed experts, as mlx-lm's kimi_k3
# `quant_predicate`, except the AttnRes `*_res_proj` ([1, hidden] mixing logits, as
# there), `kv_b_proj` (the attention reads its matrix directly to absorb W_UK / W_UV) and
# the router (`block_sparse_moe.gate`, not a Linear). Norms, conv, A_log, dt_bias and
# the correction bias are not linear weights and keep their stored dtype.
QUANTIZABLE_RE = re.compile(
    r"^language_model\.(?:lm_head|model\.embed_tokens|model\.layers\.\d+\.(?:"
    r"self_attn\.(?:[qkvgob]_proj|f_[ab]_proj|q_[ab]_proj|kv_a_proj_with_mqa"
    r"|indexer\.(?:wq_b|wk|weights_proj))"
    r"|mlp\.(?:gate|up|down)_proj"
    r"|block_sparse_moe\.(?:routed_expert_(?:down|up)_proj|shared_experts\.(?:gate|up|down)_proj)"
    r"))\.weight$"
)
NON_TEXT_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.")
FIRST_STAGE = ("language_model.model.embed_tokens.",)
LAST_STAGE = (
    "language_model.model.norm.",
    "language_model.model.output_attn_res_",
    "language_model.lm_head.",
)


class TensorError(ValueError):
    """A checkpoint tensor is missing, extra, or of the wrong shape/dtype (names it)."""


def canonical(name: str) -> str:
    """Add the `language_model.` prefix to text-only names (`model.*`, `lm_head.*`)."""
    if name.startswith(("model.", "lm_head.")):
        return PREFIX + name
    return name


def kind(name: str, args: ModelArgs) -> str:
    """'text', 'vision' (vision tower / projector) or 'mtp' (layers >= num_hidden_layers)."""
    name = canonical(name)
    if name.startswith(NON_TEXT_PREFIXES):
        return "vision"
    if name.startswith((PREFIX + "model.mtp", "mtp.")):
        return "mtp"
    m = LAYER_RE.match(name)
    if m and int(m.group(1)) >= args.num_hidden_layers:
        return "mtp"
    return "text"


def quantizable(name: str) -> bool:
    """Whether trunk tensor `name` (a `.weight`) is one that trunk quantization converts
    (`QUANTIZABLE_RE`; the in-dimension must also be a multiple of the group size)."""
    return bool(QUANTIZABLE_RE.match(canonical(name)))


# -- quantized tensors: names and shapes (writer and planner both use these) ----------

def packed_shapes(shape: Sequence[int], bits: int, group: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(weight uint32 shape, scales / biases shape) of an affine-quantized [..., out, in]."""
    *lead, inp = shape
    return (*lead, inp * bits // 32), (*lead, inp // group)


def trunk_outputs(name: str, dtype: str, shape: Sequence[int], bits: int,
                  group: int) -> Optional[List[Tuple[str, str, Tuple[int, ...]]]]:
    """[(name, safetensors dtype, shape)] a trunk `X.weight` becomes, or None when it is
    not quantized (not 2-D float, or in-dimension not a multiple of `group`)."""
    if dtype not in ("BF16", "F16", "F32") or len(shape) != 2 or shape[-1] % group:
        return None
    base = name[: -len(".weight")]
    wshape, sshape = packed_shapes(shape, bits, group)
    return [(f"{base}.weight", "U32", wshape), (f"{base}.scales", dtype, sshape),
            (f"{base}.biases", dtype, sshape)]


def expert_outputs(base: str, packed_shape: Sequence[int], bits: int,
                   group: int) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """[(name, dtype, shape)] of one requantized expert projection `base` (`...experts.E.w1`)
    from its MXFP4 `weight_packed` U8 [out, in/2]."""
    out, half = packed_shape
    inp = 2 * half
    if inp % group:
        raise ValueError(f"{base}: input dimension {inp} is not a multiple of "
                         f"--expert-group-size {group}")
    wshape, sshape = packed_shapes((out, inp), bits, group)
    return [(f"{base}.weight", "U32", wshape), (f"{base}.scales", "BF16", sshape),
            (f"{base}.biases", "BF16", sshape)]


def layer_of(name: str) -> Optional[int]:
    """Layer index of a text tensor, or None for embedding / norm / head."""
    m = LAYER_RE.match(canonical(name))
    return int(m.group(1)) if m else None


def in_range(name: str, args: ModelArgs, start: int, end: int) -> bool:
    """Whether a checkpoint tensor is needed by a model of layers [start, end)."""
    name = canonical(name)
    if kind(name, args) != "text":
        return False
    layer = layer_of(name)
    if layer is not None:
        return start <= layer < end
    if name.startswith(FIRST_STAGE):
        return start == 0 or (args.tie_word_embeddings and end == args.num_hidden_layers)
    if name.startswith(LAST_STAGE):
        return end == args.num_hidden_layers
    return True


def sanitize_weights(
    weights: Dict[str, mx.array], args: ModelArgs, start: int = 0, end: Optional[int] = None
) -> Dict[str, mx.array]:
    """Map checkpoint tensors to module paths for a model of layers [start, end).

    Non-text and out-of-range tensors are dropped. Raises TensorError for an expert set
    that is not 0..num_experts-1 in full, or an A_log that is not [>= num_heads].
    """
    end = args.num_hidden_layers if end is None else end
    out: Dict[str, mx.array] = {}
    experts: Dict[Tuple[str, str, str], Dict[int, mx.array]] = defaultdict(dict)
    heads = args.linear_attn_config["num_heads"]
    for name, w in weights.items():
        name = canonical(name)
        if not in_range(name, args, start, end):
            continue
        m = EXPERT_RE.match(name)
        if m:
            experts[(m["moe"], m["w"], m["f"])][int(m["e"])] = w
            continue
        if name.endswith(".self_attn.A_log"):
            w = _a_log(name, w, heads)
        out[name] = w
    for (moe, wname, field), by_expert in experts.items():
        n_exp = _layer_experts(moe, args)
        missing = sorted(set(range(n_exp)) - set(by_expert))
        extra = sorted(set(by_expert) - set(range(n_exp)))
        if missing or extra:
            what = "num_experts_per_layer" if args.num_experts_per_layer else "num_experts"
            raise TensorError(
                f"{moe}.experts.*.{wname}.{field}: expected experts 0..{n_exp - 1}"
                f" ({what}), missing {missing[:8]}, unexpected {extra[:8]}"
            )
        stacked = mx.stack([by_expert[e] for e in range(n_exp)])
        if field == "weight_packed":
            if stacked.dtype != mx.uint8 or stacked.shape[-1] % 4:
                raise TensorError(
                    f"{moe}.experts.0.{wname}.weight_packed: expected U8 with a multiple of 4"
                    f" bytes per row, got {stacked.dtype} {tuple(stacked.shape[1:])}"
                )
            stacked = stacked.view(mx.uint32)
        fields = EXPERT_FIELD if field in EXPERT_FIELD else EXPERT_AFFINE_FIELD
        out[f"{moe}.switch_mlp.{EXPERT_PROJ[wname]}.{fields[field]}"] = stacked
    return out


def _layer_experts(moe: str, args: ModelArgs) -> int:
    """Expert count of the layer a `model.layers.<i>.block_sparse_moe` prefix names."""
    m = re.search(r"layers\.(\d+)\.", moe)
    return args.experts_in(int(m.group(1))) if m else args.num_experts


def _a_log(name: str, w: mx.array, heads: int) -> mx.array:
    # K31_SPEC.md conventions: [128] = per-head values, zero padded; per-channel refused.
    if w.ndim != 1 or w.shape[0] < heads:
        raise TensorError(f"{name}: expected [>= {heads}] per-head values, got {tuple(w.shape)}")
    if w.shape[0] > 128 and w.shape[0] != heads:
        raise TensorError(
            f"{name}: shape {tuple(w.shape)} looks per-channel; only per-head A_log "
            "([128] zero padded) is supported until seen in a real file"
        )
    return w[:heads]


def original_names(name: str, args: ModelArgs) -> Tuple[str, ...]:
    """Checkpoint tensor name(s) a module path is read from (for error messages)."""
    m = re.match(r"^(.*\.block_sparse_moe)\.switch_mlp\.(\w+)\.(weight|scales|biases)$", name)
    if m:
        w = {v: k for k, v in EXPERT_PROJ.items()}[m.group(2)]
        f = {"weight": "weight_packed", "scales": "weight_scale", "biases": "biases"}[m.group(3)]
        return (f"{m.group(1)}.experts.E.{w}.{f} (E = 0..{args.num_experts - 1})",)
    return (name,)
