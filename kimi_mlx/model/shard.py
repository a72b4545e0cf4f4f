"""Tensor-parallel layout of K3.1 over an `mx.distributed` group: which tensor is split how.

Every rank holds a slice of every layer and the ranks combine their partial results with
one `all_sum` per attention block and one per MoE block (Megatron-style column/row
parallel pairs; mlx-lm's `kimi_k3.shard()`, K31_SPEC.md section 8):

| tensor (checkpoint name under `layers.N.`)                  | split            | why |
|-------------------------------------------------------------|------------------|-----|
| KDA `self_attn.{q,k,v,g,f_b,b}_proj`, `{q,k,v}_conv1d`, `dt_bias` | OUT (by head) | each head's streams, gate, decay and beta stay on one rank |
| KDA `self_attn.A_log` ([128]: first num_heads values per head) | HEADS          | the per-head decay temperature |
| KDA `self_attn.o_proj`                                       | IN (by head)     | partial sums -> the attention block's one all_sum |
| KDA `self_attn.f_a_proj` (rank 128), `o_norm` (per head dim) | replicated       | shared by all heads |
| DSA `self_attn.{q_b_proj,kv_b_proj,g_proj}`                  | OUT (by head)    | query heads, W_UK / W_UV per head, output gate |
| DSA `self_attn.o_proj`                                       | IN (by head)     | the attention block's one all_sum |
| DSA `q_a_proj`, `kv_a_proj_with_mqa`, their norms            | replicated       | the latents are shared by all heads (and the latent cache with them) |
| DSA `self_attn.indexer.*`                                    | replicated       | see "indexer" below |
| layer 0 `mlp.{gate,up}_proj` / `mlp.down_proj`               | OUT / IN         | split on the intermediate dim; down's all_sum |
| MoE `experts.E.{w1,w3}` / `experts.E.w2`                     | OUT / IN         | every expert split on its intermediate dim (3072); MXFP4 blocks of 32 kept whole |
| MoE `shared_experts.{gate,up}_proj` / `down_proj`            | OUT / IN         | intermediate dim (6144) |
| MoE `gate` (router), `routed_expert_{down,up}_proj`, `routed_expert_norm` | replicated | the router must pick the same experts on every rank; the latent projections need the full latent |
| `lm_head`                                                    | OUT (by vocab)   | 2.35 GB read per token at K3.1 size; one all_gather of the logits |
| embeddings, norms, AttnRes `*_res_*`, output mix             | replicated       | one embedding row per token is read; the rest is tiny |

OUT splits a weight's output rows (`AllToShardedLinear`), IN its input columns
(`ShardedToAllLinear`, whose product is a partial sum). A quantized tensor (MXFP4 experts:
U8 packed + E8M0 scales; an affine-quantized trunk: U32 + scales + biases) is split on
whole quantization groups: its packed words and its scales are sliced together, never
dequantized. Per MoE block the routed partial sum (latent width) and the shared experts'
partial sum are concatenated into one `all_sum` before `routed_expert_norm` (the norm
needs the full sum); per attention block `o_proj`'s all_sum is the one collective. So a
token costs 2 all_sums per layer plus the logits' all_gather. Every rank receives the same
all_sum result, so the replicated parts (router, indexer, norms, AttnRes mixes, the
sampler) see the same inputs on every rank and make the same choices without another
collective (tests/test_tensor_parallel.py checks both ranks' logits equal bit for bit).

Indexer: replicated. Its weights are ~14.9 MB per DSA layer at K3.1 size (wq_b 12.6 MB,
wk 1.8 MB, weights_proj 0.46 MB; 357 MB per token over 24 layers), its key cache (256
B/token/layer) is read whole by every head anyway, and sharding its 32 heads would need
one more all_sum of the [L, S] scores per DSA layer before top-k (24 per token, growing
with the context). At 4 ranks sharding saves 268 MB per token (0.33 ms at 819 GB/s) and
costs 24 collectives (0.7 ms at 30 us over RDMA, 7 ms at 300 us over TCP), so it never
pays; replicated, every rank computes the same top-k from the same inputs.

`split_of` gives the table's answer for a name, `split_range` the slice a rank gets, and
`shard(model, group)` applies both to a built model (loaded, or with placeholder weights
before a ranged load: `checkpoint.ranged`).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

OUT, IN, HEADS = "out", "in", "heads"

# (pattern on the name after `...layers.N.`, split); checkpoint names and module paths.
_RULES = (
    (r"self_attn\.(?:[qkvgb]|f_b|q_b|kv_b)_proj\.", OUT),
    (r"self_attn\.[qkv]_conv1d\.weight$", OUT),
    (r"self_attn\.dt_bias$", OUT),
    (r"self_attn\.A_log$", HEADS),
    (r"self_attn\.o_proj\.", IN),
    (r"mlp\.(?:gate|up)_proj\.", OUT),
    (r"mlp\.down_proj\.", IN),
    (r"block_sparse_moe\.shared_experts\.(?:gate|up)_proj\.", OUT),
    (r"block_sparse_moe\.shared_experts\.down_proj\.", IN),
    (r"block_sparse_moe\.experts\.\d+\.w[13]\.", OUT),
    (r"block_sparse_moe\.experts\.\d+\.w2\.", IN),
    (r"block_sparse_moe\.switch_mlp\.(?:gate|up)_proj\.", OUT),
    (r"block_sparse_moe\.switch_mlp\.down_proj\.", IN),
)
_RULES_RE = tuple((re.compile(p), s) for p, s in _RULES)
_LAYER_PREFIX = re.compile(r"^(?:language_model\.)?model\.layers\.\d+\.")
_LM_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.")


def split_of(name: str, lm_head: bool = True) -> Optional[str]:
    """OUT, IN, HEADS or None (replicated) for a checkpoint tensor name or module path.

    A bias of an IN-split layer is replicated (added once after the all_sum)."""
    if _LM_HEAD.match(name):
        return OUT if lm_head else None
    m = _LAYER_PREFIX.match(name)
    if not m:
        return None
    rest = name[m.end():]
    for pat, split in _RULES_RE:
        if pat.match(rest):
            return None if split == IN and rest.endswith(".bias") else split
    return None


def split_range(n: int, parts: int, rank: int, unit: int = 1) -> Tuple[int, int]:
    """[start, stop) of `rank`'s share of a dimension of size n, in whole units of `unit`
    (a quantization group, a head): the n / unit units are dealt out as evenly as they
    go, the first ranks taking one more where they do not divide.

    Raises ValueError if n is not a multiple of unit or there are fewer units than parts.
    """
    if n % unit:
        raise ValueError(f"dimension {n} is not a multiple of the unit {unit}")
    units = n // unit
    if units < parts:
        raise ValueError(f"dimension {n} has {units} units of {unit}, fewer than {parts} ranks")
    base, extra = divmod(units, parts)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


class ShardError(ValueError):
    """A model that cannot be split across the group (names the tensor and the constraint)."""


Record = Dict[str, Tuple[int, int, int]]  # param path -> (axis, start, stop) in the full param


def shard(model, group, lm_head: Optional[bool] = None) -> Record:
    """Split `model` (a `kimi_mlx.model.model.Model`, all layers) in place for `group`.

    Linear layers become MLX's `AllToShardedLinear` / `ShardedToAllLinear` (or their
    quantized forms) via `shard_linear`; per-head vectors, convs, `kv_b_proj` and the
    routed experts are sliced in place; attention `num_heads` become the local count and
    each MoE block gets the group for its fused all_sum. Works on a loaded model and on
    one with placeholder weights (the ranged loader then reads exactly the recorded
    slices).

    Args:
        model: the model (all layers, or a pipeline stage's range); its parameters may
            be lazy.
        group: an `mx.distributed.Group` (anything with `size()` and `rank()` for a
            layout-only dry run).
        lm_head: split `lm_head` by vocabulary (logits all_gathered); None (default):
            when the vocabulary divides evenly across the group (the planner's rule).
    Returns:
        {param path: (axis, start, stop)}: the slice of the unsharded parameter each
        sharded parameter holds (parameters not listed are replicated).
    Raises:
        ShardError: heads, widths or vocabulary that do not split evenly or on
            quantization-group boundaries (names the layer and the numbers).
    """
    N, r = group.size(), group.rank()
    rec: Record = {}
    if N == 1:
        return rec
    for layer in model.layers:  # a pipeline stage's layer range shards alike
        pre = f"language_model.model.layers.{layer.idx}."
        if layer.is_kda:
            _shard_kda(layer.self_attn, pre + "self_attn.", group, rec)
        else:
            _shard_dsa(layer.self_attn, pre + "self_attn.", group, rec)
        if "block_sparse_moe" in layer:
            _shard_moe(layer.block_sparse_moe, pre + "block_sparse_moe.", group, rec)
        else:
            _shard_mlp(layer.mlp, pre + "mlp.", group, rec)
    lm = model.language_model
    if lm_head is None:
        lm_head = model.args.vocab_size % N == 0
    if lm_head and "lm_head" in lm:
        lm.lm_head = _linear(lm.lm_head, "language_model.lm_head.", OUT, group, rec)
        lm.logits_group = group
    model.tensor_group = group
    return rec


def _in_dims(layer) -> Tuple[int, int]:
    """(input dims, unit that keeps quantization groups whole) of a (quantized) linear."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[-1] * 32 // layer.bits, layer.group_size
    return layer.weight.shape[-1], 1


def _linear(layer, path: str, split: str, group, rec: Record):
    """shard_linear(layer) with its slices recorded; checks even, group-aligned splits."""
    N, r = group.size(), group.rank()
    out_dims = layer.weight.shape[0]
    in_dims, unit = _in_dims(layer)
    if split == OUT:
        if out_dims % N:
            raise ShardError(f"{path}weight: {out_dims} outputs do not split across {N} ranks")
        a, b = split_range(out_dims, N, r)
        for name, p in layer.parameters().items():
            rec[path + name] = (0, a, b)
        return shard_linear(layer, "all-to-sharded", group=group)
    if in_dims % (N * unit):
        raise ShardError(f"{path}weight: {in_dims} inputs do not split across {N} ranks in "
                         f"whole quantization groups of {unit}")
    for name, p in layer.parameters().items():
        if name != "bias":
            cols = p.shape[-1]
            a, b = split_range(cols, N, r)
            rec[path + name] = (p.ndim - 1, a, b)
    return shard_linear(layer, "sharded-to-all", group=group)


def _take(arr: mx.array, axis: int, a: int, b: int) -> mx.array:
    index = [slice(None)] * arr.ndim
    index[axis] = slice(a, b)
    return mx.contiguous(arr[tuple(index)])


def _slice_param(module, name: str, path: str, axis: int, a: int, b: int, rec: Record) -> None:
    arr = getattr(module, name)
    axis = axis % arr.ndim
    rec[path + name] = (axis, a, b)
    setattr(module, name, _take(arr, axis, a, b))


def _heads(H: int, N: int, what: str) -> int:
    if H % N:
        raise ShardError(f"{what}: {H} heads do not split across {N} ranks")
    return H // N


def _shard_kda(attn, path: str, group, rec: Record) -> None:
    N, r = group.size(), group.rank()
    H, D = attn.num_heads, attn.head_dim
    h = _heads(H, N, path + "num_heads")
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj"):
        setattr(attn, name, _linear(getattr(attn, name), f"{path}{name}.", OUT, group, rec))
    attn.o_proj = _linear(attn.o_proj, path + "o_proj.", IN, group, rec)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        _slice_param(getattr(attn, name), "weight", f"{path}{name}.", 0, r * h * D,
                     (r + 1) * h * D, rec)
    _slice_param(attn, "A_log", path, 0, r * h, (r + 1) * h, rec)
    _slice_param(attn, "dt_bias", path, 0, r * h * D, (r + 1) * h * D, rec)
    attn.num_heads = h
    attn._decode = attn._verify = None  # compiled for the unsharded shapes


def _shard_dsa(attn, path: str, group, rec: Record) -> None:
    N, r = group.size(), group.rank()
    h = _heads(attn.num_heads, N, path + "num_heads")
    attn.q_b_proj = _linear(attn.q_b_proj, path + "q_b_proj.", OUT, group, rec)
    if attn.use_gate:
        attn.g_proj = _linear(attn.g_proj, path + "g_proj.", OUT, group, rec)
    attn.o_proj = _linear(attn.o_proj, path + "o_proj.", IN, group, rec)
    # kv_b_proj is read as a matrix [H * (nope + v), rank] (W_UK / W_UV per head), never
    # quantized (tensor_map.QUANTIZABLE_RE): its head-major rows are sliced in place.
    rows = attn.nope + attn.v_dim
    _slice_param(attn.kv_b_proj, "weight", path + "kv_b_proj.", 0, r * h * rows,
                 (r + 1) * h * rows, rec)
    attn.num_heads = h


def _shard_mlp(mlp, path: str, group, rec: Record) -> None:
    mlp.gate_proj = _linear(mlp.gate_proj, path + "gate_proj.", OUT, group, rec)
    mlp.up_proj = _linear(mlp.up_proj, path + "up_proj.", OUT, group, rec)
    mlp.down_proj = _linear(mlp.down_proj, path + "down_proj.", IN, group, rec)


def _shard_moe(moe, path: str, group, rec: Record) -> None:
    _split_glu(moe.switch_mlp, path + "switch_mlp.", group, rec)
    if moe.shared_experts is not None:
        # in place (plain or quantized Linear kept): their partial sum joins the routed
        # one's all_sum
        _split_glu(moe.shared_experts, path + "shared_experts.", group, rec)
    moe.sharding_group = group


def _split_glu(glu, path: str, group, rec: Record) -> None:
    """Slice a gate/up/down block (SwitchGLU over the experts, or a SiTUMLP) in place on
    its intermediate dim: gate/up rows, down columns, in whole quantization groups of
    down (so the split may be uneven: micro's 96 = 3 MXFP4 blocks go 2 + 1)."""
    N, r = group.size(), group.rank()
    inter = glu.gate_proj.weight.shape[-2]
    down = glu.down_proj
    unit = down.group_size if "scales" in down else 1
    try:
        a, b = split_range(inter, N, r, unit)
    except ValueError as e:
        raise ShardError(f"{path}: intermediate dim: {e}") from None
    for proj in ("gate_proj", "up_proj"):
        m = getattr(glu, proj)
        for name in m.parameters():
            if name != "bias":
                _slice_param(m, name, f"{path}{proj}.", -2, a, b, rec)
    for name, p in down.parameters().items():
        if name != "bias":  # columns of weights / packed words / scales: same fraction
            cols = p.shape[-1]
            _slice_param(down, name, f"{path}down_proj.", -1,
                         a * cols // inter, b * cols // inter, rec)
