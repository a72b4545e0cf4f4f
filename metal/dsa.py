"""DeepSeek Sparse Attention (lightning indexer) for K3.1: pure-MLX reference ops.

Math: DeepSeek-V3.2 indexer (transformers `modeling_deepseek_v32.py` Indexer, mlx-lm
`deepseek_v32.py`) without RoPE, as K3.1 uses it (K31_SPEC.md section 3):

    I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s])        for s <= t
    S_t     = top-min(index_topk, t+1) of I[t, :]             (causal set includes t)

Positive constant factors (DSv3.2's 128^-1/2 * 32^-1/2) do not change the selection and
are left out. Scores are computed in float32.
"""

from __future__ import annotations

import mlx.core as mx


def dsa_index_scores(
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, offset: int
) -> mx.array:
    """Indexer scores of L queries against all S cached index keys, causally masked.

    Args:
        q_idx: [B, L, Hi, Di] index queries (wq_b of the MLA query latent).
        weights: [B, L, Hi] per-head weights (weights_proj of the layer input).
        k_idx: [B, S, Di] index keys (LayerNorm(wk x)), S = offset + L.
        offset: position of the first query (tokens already in the cache).
    Returns:
        [B, L, S] float32; -inf where s > offset + l.
    """
    q = q_idx.astype(mx.float32)
    k = k_idx.astype(mx.float32)
    # [B, L, Hi, Di] x [B, 1, Di, S] -> [B, L, Hi, S]
    logits = mx.maximum(q @ k[:, None].swapaxes(-1, -2), 0.0)
    scores = (weights.astype(mx.float32)[..., None] * logits).sum(axis=2)
    L, S = scores.shape[-2:]
    causal = (mx.arange(S)[None] <= (mx.arange(L) + offset)[:, None])
    return mx.where(causal, scores, -mx.inf)


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
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, topk: int, offset: int
) -> mx.array:
    """Selected key positions per query (reference for the `dsa_index_topk` kernel).

    Shapes as `dsa_index_scores`. Returns [B, L, min(topk, S)] int32, unordered; entries
    past a row's causal limit (fewer than topk allowed keys) point at disallowed keys and
    must be masked by the caller with `pos <= offset + l`.
    """
    scores = dsa_index_scores(q_idx, weights, k_idx, offset)
    k = min(topk, scores.shape[-1])
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k].astype(mx.int32)
