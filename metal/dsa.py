"""DeepSeek Sparse Attention (lightning indexer) for K3.1: pure-MLX reference ops.

Math: DeepSeek-V3.2 indexer (transformers `modeling_deepseek_v32.py` Indexer, mlx-lm
`deepseek_v32.py`) without RoPE, as K3.1 uses it (K31_SPEC.md section 3):

    I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s])        for s <= t
    S_t     = top-min(index_topk, t+1) of I[t, :]             (causal set includes t)

Positive constant factors (DSv3.2's 128^-1/2 * 32^-1/2) do not change the selection and
are left out. Scores are computed in float32.

Batch rows of a continuous batch are left-padded (kimi_mlx/model/cache.py `BatchDSACache`): every
op takes an optional `starts` [B] (the first real key of each row) and never selects or
attends to a key before it, so a padded row computes what its single run computes.

Dispatch points (kernel on Metal / in the emulator where `dispatch.kernel_enabled` says so,
these references otherwise):
`dsa_prefill_indices` (selected keys of a block of queries) and `dsa_sparse_decode` (one decode token past index_topk).

Over an affine-quantized cache (the `--kv-bits 8` cache: MLX's `mx.quantize` along the last
axis, the 512 latent values and the 128 index-key values quantized, the 64 rope values
not) the same three steps have `_quantized` entry points, each taking a cache tensor as
the tuple (packed uint32, scales, biases) plus `group_size` and `bits`:
`dsa_prefill_indices_quantized`, `sparse_mla_attend_quantized` (prefill past index_topk)
and `dsa_sparse_decode_quantized` (decode past index_topk). The model's three calls
(`dsa_prefill_indices`, `sparse_mla_attend`, `dsa_sparse_decode`) take either form: a
cache tensor given as such a triple is read quantized, its group size and bits read from
the shapes (`quant_format`), so one call site (and whatever wraps it) serves both
caches. Their kernels (`dsa_index_topk_q`, `sparse_mla_decode_q`) dequantize in the
kernel; their reference ops (`dsa_index_topk_q_reference`,
`sparse_mla_decode_q_reference`, `sparse_mla_attend_quantized`) dequantize only what
they read (`dequantize_rows`): the index keys, and the selected latent rows, never the
whole latent cache.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from kimi_mlx.metal import selfcheck
from kimi_mlx.metal.dispatch import kernel_enabled, register_check


def allowed_keys(L: int, S: int, offset: int, starts: Optional[mx.array] = None) -> mx.array:
    """Which keys each query may see: causal, and not before its batch row's start.

    Args:
        L: queries at positions offset .. offset+L-1; S: keys at positions 0 .. S-1.
        starts: [B] int, first real key of each batch row (left padding), or None (0).
    Returns:
        bool [L, S] without starts, [B, L, S] with: s <= offset + l and s >= starts[b].
    """
    ok = mx.arange(S)[None] <= (mx.arange(L) + offset)[:, None]  # [L, S]
    if starts is None:
        return ok
    return ok & (mx.arange(S)[None, None] >= starts.astype(mx.int32)[:, None, None])


def dsa_index_scores(
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, offset: int,
    starts: Optional[mx.array] = None,
) -> mx.array:
    """Indexer scores of L queries against all S cached index keys, causally masked.

    Args:
        q_idx: [B, L, Hi, Di] index queries (wq_b of the MLA query latent).
        weights: [B, L, Hi] per-head weights (weights_proj of the layer input).
        k_idx: [B, S, Di] index keys (LayerNorm(wk x)), S = offset + L.
        offset: position of the first query (tokens already in the cache).
        starts: [B] int, first real key of each batch row, or None (`allowed_keys`).
    Returns:
        [B, L, S] float32; -inf where s > offset + l or s < starts[b].
    """
    q = q_idx.astype(mx.float32)
    k = k_idx.astype(mx.float32)
    # [B, L, Hi, Di] x [B, 1, Di, S] -> [B, L, Hi, S]
    logits = mx.maximum(q @ k[:, None].swapaxes(-1, -2), 0.0)
    scores = (weights.astype(mx.float32)[..., None] * logits).sum(axis=2)
    L, S = scores.shape[-2:]
    return mx.where(allowed_keys(L, S, offset, starts), scores, -mx.inf)


def dsa_topk_mask(scores: mx.array, topk: int) -> mx.array:
    """Boolean selection mask: True for the top-`topk` finite scores of each row.

    Args:
        scores: [B, L, S] float32 from `dsa_index_scores` (-inf = not allowed).
        topk: `index_topk`.
    Returns:
        [B, L, S] bool. Rows with fewer than `topk` allowed positions select all of them.
    """
    S = scores.shape[-1]
    allowed = scores > -mx.inf
    if S <= topk:
        return allowed
    idx = mx.argpartition(-scores, kth=topk - 1, axis=-1)[..., :topk]
    picked = mx.put_along_axis(
        mx.zeros(scores.shape, dtype=mx.bool_), idx, mx.array(True), axis=-1
    )
    return picked & allowed


def dsa_index_topk(
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, topk: int, offset: int,
    starts: Optional[mx.array] = None,
) -> mx.array:
    """Top-`topk` key positions per query (reference for the `dsa_index_topk` kernel).

    Shapes and `starts` as `dsa_index_scores`. Returns [B, L, min(topk, S)] int32,
    unordered; -1 where a row has fewer than `topk` allowed keys (the kernel's format).
    """
    scores = dsa_index_scores(q_idx, weights, k_idx, offset, starts)
    k = min(topk, scores.shape[-1])
    idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k].astype(mx.int32)
    ok = mx.take_along_axis(scores, idx, axis=-1) > -mx.inf
    return mx.where(ok, idx, -1)


def sparse_mla_decode(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: mx.array,
    k_pe: mx.array,
    indices: mx.array,
    scale: float,
) -> mx.array:
    """Absorbed-MLA decode attention over only the selected latent + rope-key rows
    (reference for the `sparse_mla_decode` kernel; K31_SPEC.md section 3, "Gated DSA").

    Args:
        q_lat: [B, H, 1, R] absorbed queries (q_nope . W_UK); q_pe: [B, H, 1, P].
        latent: [B, S, R] latent cache; k_pe: [B, S, P] rope-key cache (shared by heads).
        indices: [B, K] int32 selected positions; entries outside [0, S) (e.g. -1) are
            skipped.
        scale: softmax scale.
    Returns:
        [B, H, 1, R] in q_lat's dtype: sum_s softmax_s(scale (q_lat . c_s + q_pe . kpe_s)) c_s
        over the valid selected s (float32 softmax); zeros for a row with none.
    """
    B, H, _, R = q_lat.shape
    S = latent.shape[1]
    valid = (indices >= 0) & (indices < S)  # [B, K]
    # Flat row numbers (b * S + s): one `take` per cache, no broadcast gather.
    rows = (mx.where(valid, indices, 0) + mx.arange(B)[:, None] * S).astype(mx.int32)
    c = mx.take(latent.reshape(B * S, R), rows, axis=0).astype(mx.float32)  # [B, K, R]
    kp = mx.take(k_pe.reshape(B * S, -1), rows, axis=0).astype(mx.float32)  # [B, K, P]
    # Heads as the matmul rows: [B, H, R] @ [B, R, K].
    s = q_lat.reshape(B, H, R).astype(mx.float32) @ c.swapaxes(-1, -2)
    s = scale * (s + q_pe.reshape(B, H, -1).astype(mx.float32) @ kp.swapaxes(-1, -2))
    s = mx.where(valid[:, None, :], s, -mx.inf)  # [B, H, K]
    m = s.max(axis=-1, keepdims=True)
    p = mx.exp(s - mx.where(m > -mx.inf, m, 0.0))
    den = p.sum(axis=-1, keepdims=True)
    o = (p @ c) / mx.where(den > 0, den, 1.0)  # [B, H, R]
    return o.reshape(B, H, 1, R).astype(q_lat.dtype)


def dsa_prefill_indices(
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, topk: int, offset: int,
    starts: Optional[mx.array] = None,
) -> mx.array:
    """Selected keys of a block of queries past `index_topk` (dispatch point: the
    `dsa_index_topk` kernel on Metal or in the emulator, its reference op otherwise).

    Shapes and `starts` as `dsa_index_scores`; k_idx may instead be the quantized triple
    (packed, scales, biases) of [B, S, Di] keys, then read by
    `dsa_prefill_indices_quantized` (format from the shapes: `quant_format`). Returns
    [B, L, min(topk, S)] int32, -1 padded where a row has fewer allowed keys; the
    selected set (not the order) is what is defined.
    """
    if isinstance(k_idx, (tuple, list)):
        group, bits = quant_format(k_idx, q_idx.shape[-1], "index keys")
        return dsa_prefill_indices_quantized(q_idx, weights, k_idx, topk, offset, starts,
                                             group_size=group, bits=bits)
    if not kernel_enabled("dsa_index_topk"):
        return dsa_index_topk(q_idx, weights, k_idx, topk, offset, starts)
    from kimi_mlx.metal.kernels import dsa_index_topk as kernel

    return kernel(q_idx, weights, k_idx, topk, offset, starts)


def dsa_sparse_decode(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: mx.array,
    k_pe: mx.array,
    scale: float,
    q_idx: mx.array,
    weights: mx.array,
    k_idx: mx.array,
    topk: int,
    offset: int,
    starts: Optional[mx.array] = None,
) -> mx.array:
    """One decode token of Gated DSA in the absorbed latent form (dispatch point).

    Args:
        q_lat: [B, H, 1, R]; q_pe: [B, H, 1, P]; latent: [B, 1, S, R]; k_pe: [B, 1, S, P]
            (the DSACache layout); scale: softmax scale.
        q_idx, weights, k_idx, topk, offset, starts: the indexer inputs
            (`dsa_index_scores`, L = 1); a batch row attends to no key before its start.
    Returns:
        [B, H, 1, R] in q_lat's dtype. On Metal or in the emulator: the `dsa_index_topk`
        kernel, then `sparse_mla_decode` over the selected rows (either one replaced by
        its reference op where `kernel_enabled` refuses it). With neither kernel:
        the selection mask as an additive -inf bias on the rope scores, and dense SDPA.
        With latent and k_idx given as quantized triples (packed, scales, biases) of the
        [B, 1, S, R] latent and the [B, S, Di] index keys: `dsa_sparse_decode_quantized`,
        each tensor's format read from its shapes (`quant_format`).
    """
    if isinstance(latent, (tuple, list)):
        group, bits = quant_format(latent, q_lat.shape[-1], "latent")
        igroup, ibits = quant_format(k_idx, q_idx.shape[-1], "index keys")
        if ibits != bits:
            raise ValueError(f"latent {bits}-bit and index keys {ibits}-bit: one width per cache")
        return dsa_sparse_decode_quantized(q_lat, q_pe, latent, k_pe, scale, q_idx, weights,
                                           k_idx, topk, offset, starts, group_size=group,
                                           bits=bits, index_group_size=igroup)
    use_index = kernel_enabled("dsa_index_topk")
    use_attend = kernel_enabled("sparse_mla_decode")
    if not use_index and not use_attend:
        allowed = dsa_topk_mask(dsa_index_scores(q_idx, weights, k_idx, offset, starts), topk)
        pe = (q_pe * scale) @ k_pe.swapaxes(-1, -2)  # [B, H, 1, S]
        bias = mx.where(allowed[:, None], pe, mx.array(-mx.inf, pe.dtype))
        return mx.fast.scaled_dot_product_attention(
            q_lat, latent, latent, scale=scale, mask=bias
        )
    from kimi_mlx.metal import kernels

    # One of the two may have fallen back (its device check failed): its reference op
    # takes its place, with the same inputs and output format.
    index_op = kernels.dsa_index_topk if use_index else dsa_index_topk
    attend_op = kernels.sparse_mla_decode if use_attend else sparse_mla_decode
    idx = index_op(q_idx, weights, k_idx, topk, offset, starts)  # [B, 1, k]
    return attend_op(q_lat, q_pe, latent[:, 0], k_pe[:, 0], idx[:, 0], scale)


def sparse_mla_attend(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: mx.array,
    k_pe: mx.array,
    indices: mx.array,
    scale: float,
) -> mx.array:
    """Absorbed-MLA attention of L queries, each over its own selected rows (reference).

    Generalises `sparse_mla_decode` to a block of queries (prefill past `index_topk`),
    gathering only K rows per query, so memory is O(L*K), not O(L*S).

    Args:
        q_lat: [B, H, L, R]; q_pe: [B, H, L, P].
        latent: [B, S, R]; k_pe: [B, S, P].
        indices: [B, L, K] int32; entries outside [0, S) (e.g. -1) are skipped.
        scale: softmax scale.
        latent may instead be the quantized triple (packed, scales, biases) of [B, S, R]:
        then `sparse_mla_attend_quantized` (format from the shapes: `quant_format`).
    Returns:
        [B, H, L, R] in q_lat's dtype (float32 softmax); zeros for a row with no valid key.
    """
    if isinstance(latent, (tuple, list)):
        group, bits = quant_format(latent, q_lat.shape[-1], "latent")
        return sparse_mla_attend_quantized(q_lat, q_pe, latent, k_pe, indices, scale,
                                           group_size=group, bits=bits)
    B, H, L, R = q_lat.shape
    S = latent.shape[1]
    valid = (indices >= 0) & (indices < S)  # [B, L, K]
    rows = (mx.where(valid, indices, 0) + (mx.arange(B) * S)[:, None, None]).astype(mx.int32)
    c = mx.take(latent.reshape(B * S, R), rows, axis=0).astype(mx.float32)  # [B, L, K, R]
    kp = mx.take(k_pe.reshape(B * S, -1), rows, axis=0).astype(mx.float32)  # [B, L, K, P]
    return _attend_gathered(q_lat, q_pe, c, kp, valid, scale)


def _attend_gathered(q_lat: mx.array, q_pe: mx.array, c: mx.array, kp: mx.array,
                     valid: mx.array, scale: float) -> mx.array:
    """`sparse_mla_attend`'s math on rows already gathered per query: c [B, L, K, R] and
    kp [B, L, K, P] float32, valid [B, L, K] bool. Returns [B, H, L, R] in q_lat's dtype."""
    # Per query l: heads as matmul rows, [B, L, H, R] @ [B, L, R, K].
    ql = q_lat.transpose(0, 2, 1, 3).astype(mx.float32)
    qp = q_pe.transpose(0, 2, 1, 3).astype(mx.float32)
    s = scale * (ql @ c.swapaxes(-1, -2) + qp @ kp.swapaxes(-1, -2))  # [B, L, H, K]
    s = mx.where(valid[:, :, None, :], s, -mx.inf)
    m = s.max(axis=-1, keepdims=True)
    p = mx.exp(s - mx.where(m > -mx.inf, m, 0.0))
    den = p.sum(axis=-1, keepdims=True)
    o = (p @ c) / mx.where(den > 0, den, 1.0)  # [B, L, H, R]
    return o.transpose(0, 2, 1, 3).astype(q_lat.dtype)


QUERY_BLOCK_BUDGET = 1 << 24  # elements (64 MiB in float32) per prefill-block intermediate


def query_block(L: int, S: int, K: int, heads: int, index_heads: int, row: int,
                budget: int = QUERY_BLOCK_BUDGET) -> int:
    """Queries per block for Gated DSA prefill so that no intermediate of a block exceeds
    `budget` elements: indexer scores (index_heads * S per query), gathered latent + rope
    rows (K * row) and attention scores (heads * K); the dense path within index_topk
    passes K = S (its bias and scores are heads * S per query). The model evaluates one
    block at a time, so prefill memory is bounded by a few times the budget whatever the
    prompt and context length.

    Args:
        L: queries in the chunk; S: keys (cached + new); K: selected keys per query;
        heads: attention heads; index_heads: indexer heads; row: latent + rope width.
        budget: elements per intermediate.
    Returns:
        block size in [1, L].
    """
    per_query = max(index_heads * S, K * row, heads * K, 1)
    return max(1, min(L, budget // per_query))


# ---------------------------------------------------------- over a quantized cache


def quant_format(parts, dim: int, what: str = "cache tensor") -> Tuple[int, int]:
    """(group_size, bits) of a quantized cache tensor of `dim`-value vectors, read from
    its shapes: packed words [.., dim * bits / 32], scales [.., dim / group_size].

    Raises:
        ValueError (naming `what`): not a (packed, scales, biases) triple, or shapes no
        supported format (bits 4 or 8, group 32, 64 or 128) gives for `dim`.
    """
    if len(parts) != 3:
        raise ValueError(f"{what}: expected (packed, scales, biases), got {len(parts)} arrays")
    words, groups = parts[0].shape[-1], parts[1].shape[-1]
    bits, group = words * 32 // dim, dim // max(groups, 1)
    if (bits not in (4, 8) or bits * dim != 32 * words or group not in (32, 64, 128)
            or group * groups != dim):
        raise ValueError(f"{what}: {words} packed words and {groups} scales per vector do not "
                         f"hold {dim} values in 4 or 8 bits with groups of 32, 64 or 128")
    return group, bits


def dequantize_rows(parts, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize` of one quantized cache tensor, computed in float32.

    Args:
        parts: (packed uint32 [..., D * bits / 32], scales [..., D / group_size], biases
            [..., D / group_size]) from `mx.quantize(x, group_size, bits)`.
    Returns:
        [..., D] float32: scale * q + bias with the scales and biases taken to float32
        first (what the `_q` kernels compute), so a bf16 cache's values are not rounded
        to bf16 again after dequantizing.

    8-bit words are read as their bytes (value j of a word is byte j on the little-endian
    machines MLX runs on: mx.quantize's order) and scaled in one broadcast multiply-add,
    the same float32 arithmetic as `mx.dequantize`, whose CPU version is about 5x
    slower; other widths go through `mx.dequantize`.
    """
    w, sc, bi = parts
    sc, bi = sc.astype(mx.float32), bi.astype(mx.float32)
    if bits != 8:
        return mx.dequantize(w, sc, bi, group_size=group_size, bits=bits)
    lead, groups = w.shape[:-1], sc.shape[-1]
    q = mx.view(w, mx.uint8).astype(mx.float32).reshape(*lead, groups, group_size)
    return (q * sc[..., None] + bi[..., None]).reshape(*lead, groups * group_size)


def _gather_rows(parts, rows: mx.array, group_size: int, bits: int) -> mx.array:
    """Rows `rows` (int32, any shape, into the flattened leading axes) of a quantized
    tensor, dequantized in float32: [*rows.shape, D]."""
    flat = [p.reshape(-1, p.shape[-1]) for p in parts]
    picked = [mx.take(p, rows.reshape(-1), axis=0) for p in flat]
    return dequantize_rows(picked, group_size, bits).reshape(*rows.shape, -1)


def dsa_index_topk_q_reference(
    q_idx: mx.array, weights: mx.array, k_idx, topk: int, offset: int,
    starts: Optional[mx.array] = None, *, group_size: int = 64, bits: int = 8,
) -> mx.array:
    """`dsa_index_topk` over quantized index keys (reference for the `dsa_index_topk_q`
    kernel): the keys dequantized (`dequantize_rows`), then `dsa_index_topk`.

    Args:
        k_idx: (packed uint32 [B, S, Di * bits / 32], scales [B, S, Di / group_size],
            biases [B, S, Di / group_size]); the rest as `dsa_index_topk`.
    Returns:
        [B, L, min(topk, S)] int32, -1 padded (as `dsa_index_topk`).
    """
    return dsa_index_topk(q_idx, weights, dequantize_rows(k_idx, group_size, bits), topk,
                          offset, starts)


def sparse_mla_decode_q_reference(
    q_lat: mx.array, q_pe: mx.array, latent, k_pe: mx.array, indices: mx.array,
    scale: float, *, group_size: int = 64, bits: int = 8,
) -> mx.array:
    """`sparse_mla_decode` over a quantized latent cache (reference for the
    `sparse_mla_decode_q` kernel): only the K selected rows are gathered and dequantized.

    Args:
        latent: (packed uint32 [B, S, R * bits / 32], scales [B, S, R / group_size],
            biases [B, S, R / group_size]); k_pe: [B, S, P] unquantized; the rest as
            `sparse_mla_decode`.
    Returns:
        [B, H, 1, R] in q_lat's dtype.
    """
    B, K = indices.shape
    S = k_pe.shape[1]
    valid = (indices >= 0) & (indices < S)
    rows = (mx.where(valid, indices, 0) + mx.arange(B)[:, None] * S).astype(mx.int32)
    c = _gather_rows(latent, rows, group_size, bits)  # [B, K, R] float32
    kp = mx.take(k_pe.reshape(B * S, -1), rows, axis=0)  # [B, K, P]
    local = mx.where(valid, mx.arange(K, dtype=mx.int32)[None], -1)
    return sparse_mla_decode(q_lat, q_pe, c, kp, local, scale)


def sparse_mla_attend_quantized(
    q_lat: mx.array, q_pe: mx.array, latent, k_pe: mx.array, indices: mx.array,
    scale: float, *, group_size: int = 64, bits: int = 8,
) -> mx.array:
    """`sparse_mla_attend` (prefill past index_topk, a block of queries) over a quantized
    latent cache; a reference op (no kernel): each query's K selected rows are gathered
    and dequantized (`dequantize_rows`), so memory stays O(L * K) as in `sparse_mla_attend`.

    Args:
        q_lat: [B, H, L, R]; q_pe: [B, H, L, P].
        latent: (packed uint32 [B, S, R * bits / 32], scales [B, S, R / group_size],
            biases [B, S, R / group_size]); k_pe: [B, S, P] unquantized.
        indices: [B, L, K] int32 (outside [0, S) skipped); scale: softmax scale.
        group_size: 32, 64 or 128; bits: 4 or 8.
    Returns:
        [B, H, L, R] in q_lat's dtype.
    """
    B = indices.shape[0]
    S = k_pe.shape[1]
    valid = (indices >= 0) & (indices < S)  # [B, L, K]
    rows = (mx.where(valid, indices, 0) + (mx.arange(B) * S)[:, None, None]).astype(mx.int32)
    c = _gather_rows(latent, rows, group_size, bits)  # [B, L, K, R] float32
    kp = mx.take(k_pe.reshape(B * S, -1), rows, axis=0).astype(mx.float32)  # [B, L, K, P]
    return _attend_gathered(q_lat, q_pe, c, kp, valid, scale)


def dsa_prefill_indices_quantized(
    q_idx: mx.array, weights: mx.array, k_idx, topk: int, offset: int,
    starts: Optional[mx.array] = None, *, group_size: int = 64, bits: int = 8,
) -> mx.array:
    """`dsa_prefill_indices` over quantized index keys (dispatch point: the
    `dsa_index_topk_q` kernel on Metal or in the emulator, `dsa_index_topk_q_reference`
    otherwise).

    Args:
        q_idx: [B, L, Hi, Di]; weights: [B, L, Hi].
        k_idx: (packed uint32 [B, S, Di * bits / 32], scales [B, S, Di / group_size],
            biases [B, S, Di / group_size]): `mx.quantize(keys, group_size, bits)` of the
            [B, S, Di] index keys (a [B, 1, S, *] cache entry indexed [:, 0]).
        topk, offset, starts: as `dsa_prefill_indices`.
        group_size: 32, 64 or 128; bits: 4 or 8 (keyword-only).
    Returns:
        [B, L, min(topk, S)] int32, -1 padded; the selected set is what is defined.
    Raises:
        ValueError: shapes or format the kernel cannot read (`kernels.quantized_parts`).
    """
    if not kernel_enabled("dsa_index_topk_q"):
        return dsa_index_topk_q_reference(q_idx, weights, k_idx, topk, offset, starts,
                                          group_size=group_size, bits=bits)
    from kimi_mlx.metal import kernels

    return kernels.dsa_index_topk_q(q_idx, weights, k_idx, topk, offset, starts,
                                    group_size=group_size, bits=bits)


def dsa_sparse_decode_quantized(
    q_lat: mx.array,
    q_pe: mx.array,
    latent,
    k_pe: mx.array,
    scale: float,
    q_idx: mx.array,
    weights: mx.array,
    k_idx,
    topk: int,
    offset: int,
    starts: Optional[mx.array] = None,
    *,
    group_size: int = 64,
    bits: int = 8,
    index_group_size: Optional[int] = None,
) -> mx.array:
    """`dsa_sparse_decode` (one decode token past index_topk) over a quantized cache
    (dispatch point).

    Args:
        q_lat: [B, H, 1, R]; q_pe: [B, H, 1, P]; scale: softmax scale.
        latent: (packed uint32 [B, 1, S, R * bits / 32], scales [B, 1, S, R / group_size],
            biases [B, 1, S, R / group_size]): the quantized MLA latent cache in the DSACache
            layout (`mx.quantize(latent, group_size, bits)` of [B, 1, S, R]).
        k_pe: [B, 1, S, P] rope keys, unquantized (the cache dtype).
        q_idx: [B, 1, Hi, Di]; weights: [B, 1, Hi].
        k_idx: (packed uint32 [B, S, Di * bits / 32], scales [B, S, Di / group_size],
            biases [B, S, Di / group_size]): the quantized index keys (a [B, 1, S, *] cache
            entry indexed [:, 0], as `dsa_sparse_decode` takes k_idx).
        topk, offset, starts: as `dsa_sparse_decode`.
        group_size: 32, 64 or 128; bits: 4 or 8 (keyword-only; both tensors share the
            bits). index_group_size: the index keys' group where it differs from the
            latent's (a vector shorter than the group is one group: model/cache.py
            `group_for`); None: group_size.
    Returns:
        [B, H, 1, R] in q_lat's dtype: the `dsa_index_topk_q` kernel (or its reference op),
        then the `sparse_mla_decode_q` kernel (or its reference op) over the selected rows;
        each falls back alone where `kernel_enabled` refuses it. Without kernels nothing
        is dequantized beyond the index keys and the K selected latent rows.
    Raises:
        ValueError: shapes or format the kernels cannot read (`kernels.quantized_parts`).
    """
    from kimi_mlx.metal import kernels

    B = q_lat.shape[0]
    S = k_pe.shape[2]
    lat = [p.reshape(B, S, p.shape[-1]) for p in latent]
    index_op = (kernels.dsa_index_topk_q if kernel_enabled("dsa_index_topk_q")
                else dsa_index_topk_q_reference)
    attend_op = (kernels.sparse_mla_decode_q if kernel_enabled("sparse_mla_decode_q")
                 else sparse_mla_decode_q_reference)
    idx = index_op(q_idx, weights, k_idx, topk, offset, starts, bits=bits,
                   group_size=index_group_size or group_size)  # [B, 1, k]
    return attend_op(q_lat, q_pe, lat, k_pe[:, 0], idx[:, 0], scale, group_size=group_size,
                     bits=bits)


def _check_dsa_index_topk_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_dsa_index_topk(kernels.dsa_index_topk, dsa_index_topk,
                                          dsa_index_scores)


def _check_sparse_mla_decode_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_sparse_mla_decode(kernels.sparse_mla_decode, sparse_mla_decode)


def _check_dsa_index_topk_q_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_dsa_index_topk_q(kernels.dsa_index_topk_q, dsa_index_topk_q_reference,
                                            dsa_index_scores, dequantize_rows)


def _check_sparse_mla_decode_q_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_sparse_mla_decode_q(kernels.sparse_mla_decode_q,
                                               sparse_mla_decode_q_reference)


# The device checks `kernel_enabled` runs before these kernels' first use on Metal.
register_check("dsa_index_topk", _check_dsa_index_topk_kernel)
register_check("sparse_mla_decode", _check_sparse_mla_decode_kernel)
register_check("dsa_index_topk_q", _check_dsa_index_topk_q_kernel)
register_check("sparse_mla_decode_q", _check_sparse_mla_decode_q_kernel)
