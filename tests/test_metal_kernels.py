"""Our Metal kernels (metal/*.metal, wrappers in metal/kernels.py) run in the CPU emulator
against their pure-MLX reference ops, and the model run through them.

- Each kernel over a shape grid with length 1, lengths not a multiple of the chunk,
  batch > 1, several heads, k larger than the context, the real head sizes; float32 within
  1e-4 (relative to the largest reference value), bf16 inputs within bf16 tolerance.
- Top-k is compared as sets robust to ties: the reference scores at the kernel's indices
  must equal, as a multiset, the reference scores at the reference's indices.
- Boundary inputs join the grids: a zero-norm q and k row in every KDA case (l2norm with
  eps added to the sum of squares gives 0, not NaN: K31_SPEC section 3), and selected
  indices at exactly S (one past the end), S - 1, 0 and -1 in every sparse MLA case.
- One planted off-by-one per kernel body must make those same checks fail.
- The emulator's race checker runs on every call (two thread schedules each); a barrier
  removed or weakened in a kernel body must be reported as a race naming the memory, both
  threads and both source lines.
- The foundation model tests (tests/test_model.py) pass with the emulator switched on, and
  every kernel is called by the model on that path; reference mode never touches a kernel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.metal import dispatch, kernels
from kimi_mlx.metal import dsa as dsa_ref
from kimi_mlx.metal import kda as kda_ref
from kimi_mlx.metal.dispatch import use_sim
from kimi_mlx.testing.checkpoints import (
    full_config, margins, model_tolerance, random_model, rel_err, tiny_text_config)

from fixtures.planted import (DEV_BARRIER, TG_BARRIER, assert_close, assert_raced, both, plant,
                              weaken)

F32_RTOL = 1e-4
BF16_RTOL = 2e-2


def _f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _rtol(dtype):
    return F32_RTOL if dtype == mx.float32 else BF16_RTOL


# --------------------------------------------------------------------- kda_decode


def _zero_rows(q, k):
    """q's first (b, t, h) row and k's last one set to zero: the l2norm's eps case."""
    B, T, H, D = q.shape
    first = mx.arange(B * T * H).reshape(B, T, H, 1) == 0
    last = mx.arange(B * T * H).reshape(B, T, H, 1) == B * T * H - 1
    return mx.where(first, 0, q).astype(q.dtype), mx.where(last, 0, k).astype(k.dtype)


def _decode_inputs(B, T, H, Dk, Dv, dtype, seed, with_state=True):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, H, Dk)).astype(dtype)
    k = mx.random.normal((B, T, H, Dk)).astype(dtype)
    q, k = _zero_rows(q, k)
    v = mx.random.normal((B, T, H, Dv)).astype(dtype)
    a = mx.random.normal((B, T, H, Dk)).astype(dtype)
    b = mx.random.normal((B, T, H)).astype(dtype)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,)))
    dt_bias = mx.random.normal((H, Dk)) * 0.5
    state = mx.random.normal((B, H, Dv, Dk)) * 0.3 if with_state else None
    return q, k, v, a, b, A_log, dt_bias, state


DECODE_CASES = [
    # B, T, H, Dk, Dv, lower_bound, dtype
    (1, 1, 1, 32, 8, -5.0, mx.float32),  # one token, one head
    (2, 1, 3, 16, 16, -5.0, mx.float32),  # batch, heads, Dk < 32 (the tiny model)
    (1, 1, 2, 128, 8, -5.0, mx.float32),  # the real head_dim
    (2, 3, 2, 40, 12, -5.0, mx.float32),  # a few tokens, Dk not a multiple of 32
    (1, 2, 2, 32, 8, None, mx.float32),  # softplus gate (no lower bound)
    (2, 1, 2, 64, 16, -5.0, mx.bfloat16),
]


def check_kda_decode(B, T, H, Dk, Dv, lower_bound, dtype, seed=0, with_state=True):
    inputs = _decode_inputs(B, T, H, Dk, Dv, dtype, seed, with_state)
    with use_sim():
        y, s = kernels.kda_decode(*inputs, lower_bound=lower_bound)
    y_ref, s_ref = kda_ref.kda_decode(*inputs, lower_bound=lower_bound)
    assert y.dtype == dtype and s.dtype == mx.float32
    # the zero-norm q row reads out exactly 0 (not NaN), in both
    assert np.all(_f32(y)[0, 0, 0] == 0) and np.all(_f32(y_ref)[0, 0, 0] == 0)
    assert_close(y, y_ref, _rtol(dtype), "kda_decode y")
    assert_close(s, s_ref, _rtol(dtype), "kda_decode state")


@pytest.mark.parametrize("B,T,H,Dk,Dv,lower_bound,dtype", DECODE_CASES)
def test_kda_decode_matches_reference(B, T, H, Dk, Dv, lower_bound, dtype):
    check_kda_decode(B, T, H, Dk, Dv, lower_bound, dtype)


def test_kda_decode_without_initial_state():
    check_kda_decode(2, 1, 2, 16, 8, -5.0, mx.float32, seed=4, with_state=False)


# -------------------------------------------------------------------- kda_prefill


def _prefill_inputs(B, T, H, Dk, Dv, dtype, seed, with_state=True, softplus=False):
    mx.random.seed(seed)
    q, k = _zero_rows(mx.random.normal((B, T, H, Dk)), mx.random.normal((B, T, H, Dk)))
    q = kda_ref.l2_normalize(q) * Dk**-0.5
    k = kda_ref.l2_normalize(k)
    v = mx.random.normal((B, T, H, Dv))
    raw = mx.random.normal((B, T, H, Dk))
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H, 1)))
    dt_bias = mx.random.normal((H, Dk)) * 0.5
    if softplus:  # unbounded decay: g down to about -25 per token
        g = kda_ref.kda_gate_softplus(raw * 3.0, A_log, dt_bias)
    else:
        g = kda_ref.kda_gate(raw, A_log, dt_bias, -5.0)
    beta = mx.sigmoid(mx.random.normal((B, T, H)))
    state = mx.random.normal((B, H, Dv, Dk)) * 0.3 if with_state else None
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), state


PREFILL_CASES = [
    # B, T, H, Dk, Dv, dtype
    (1, 1, 1, 16, 8, mx.float32),  # one token
    (2, 37, 2, 16, 8, mx.float32),  # batch, T not a multiple of the chunk
    (1, 16, 1, 32, 16, mx.float32),  # exactly one chunk
    (1, 33, 2, 128, 12, mx.float32),  # real head_dim: 27.6 KiB of threadgroup memory
    (2, 20, 3, 24, 40, mx.float32),  # Dk % 32 != 0, Dv over three threadgroups
    (1, 21, 2, 32, 16, mx.bfloat16),
]


def check_kda_prefill(B, T, H, Dk, Dv, dtype, seed=0, with_state=True, chunk=16):
    inputs = _prefill_inputs(B, T, H, Dk, Dv, dtype, seed, with_state)
    with use_sim():
        y, s = kernels.kda_prefill(*inputs, chunk=chunk)
    y_ref, s_ref = kda_ref.kda_chunked(*inputs)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert np.all(_f32(y)[0, 0, 0] == 0) and np.all(_f32(y_ref)[0, 0, 0] == 0)
    assert_close(y, y_ref, _rtol(dtype), "kda_prefill y vs kda_chunked")
    assert_close(s, s_ref, _rtol(dtype), "kda_prefill state vs kda_chunked")
    if dtype == mx.float32:
        y_rec, s_rec = kda_ref.kda_recurrent(*inputs)
        assert_close(y, y_rec, F32_RTOL, "kda_prefill y vs kda_recurrent")
        assert_close(s, s_rec, F32_RTOL, "kda_prefill state vs kda_recurrent")


@pytest.mark.parametrize("B,T,H,Dk,Dv,dtype", PREFILL_CASES)
def test_kda_prefill_matches_reference(B, T, H, Dk, Dv, dtype):
    check_kda_prefill(B, T, H, Dk, Dv, dtype)


@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_kda_prefill_other_chunks_and_no_initial_state(chunk):
    check_kda_prefill(2, 19, 2, 16, 8, mx.float32, seed=chunk, with_state=False, chunk=chunk)


def test_kda_prefill_state_carries_across_calls():
    """Two calls (prompt split at a non-chunk boundary) equal one call."""
    q, k, v, g, beta, state = _prefill_inputs(1, 29, 2, 16, 8, mx.float32, seed=9)
    with use_sim():
        y1, s1 = kernels.kda_prefill(q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], state)
        y2, s2 = kernels.kda_prefill(q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], s1)
        y, s = kernels.kda_prefill(q, k, v, g, beta, state)
    assert_close(mx.concatenate([y1, y2], axis=1), y, F32_RTOL, "split y")
    assert_close(s2, s, F32_RTOL, "split state")


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_reference_matches_the_loop_at_the_gate_lower_bound(chunk):
    """The chunked reference (`kda_chunked`, the prefill path off-Mac) equals the per-token
    loop where its decay factoring is tightest: every channel at K3's lower bound
    (g = -5 per token: e^{+-40} around a 16-token chunk's middle, e^{+-80} for 32), then
    half the channels there and half random, at head size 128 with an initial state."""
    q, k, v, g, beta, state = _prefill_inputs(1, 75, 2, 128, 128, mx.float32, seed=4)
    floor = mx.full(g.shape, -5.0)
    mixed = mx.where(mx.random.uniform(shape=g.shape) < 0.5, floor, g)
    for gates, what in ((floor, "all at the bound"), (mixed, "half at the bound")):
        y, s = kda_ref.kda_chunked(q, k, v, gates, beta, state, chunk=chunk)
        y_rec, s_rec = kda_ref.kda_recurrent(q, k, v, gates, beta, state)
        assert_close(y, y_rec, F32_RTOL, f"y, {what}")
        assert_close(s, s_rec, F32_RTOL, f"state, {what}")


def test_kda_prefill_is_exact_for_unbounded_gates():
    """Decays far below the K3 lower bound (cumulative log decay of several hundred in a
    chunk): the kernel never forms e^{-G}, so it still matches the per-token loop."""
    inputs = _prefill_inputs(1, 40, 2, 16, 8, mx.float32, seed=2, softplus=True)
    assert float(inputs[3].min()) < -20.0
    with use_sim():
        y, s = kernels.kda_prefill(*inputs)
    y_rec, s_rec = kda_ref.kda_recurrent(*inputs)
    assert_close(y, y_rec, F32_RTOL, "y")
    assert_close(s, s_rec, F32_RTOL, "state")


# ----------------------------------------------------------------- dsa_index_topk


def _index_inputs(B, L, S, Hi, Di, dtype, seed, ties=False):
    mx.random.seed(seed)
    if ties:  # small integers: many exactly equal scores
        q = mx.random.randint(-1, 2, (B, L, Hi, Di)).astype(dtype)
        k = mx.random.randint(-1, 2, (B, S, Di)).astype(dtype)
        w = mx.random.randint(1, 3, (B, L, Hi)).astype(dtype)
    else:
        q = mx.random.normal((B, L, Hi, Di)).astype(dtype)
        k = mx.random.normal((B, S, Di)).astype(dtype)
        w = mx.random.normal((B, L, Hi)).astype(dtype)
    return q, w, k


INDEX_CASES = [
    # B, L, S, Hi, Di, topk, offset, dtype, ties
    (1, 1, 1, 2, 8, 4, 0, mx.float32, False),  # one key, k > context
    (2, 1, 40, 2, 16, 8, 39, mx.float32, False),  # decode, batch 2
    (2, 3, 20, 2, 16, 5, 17, mx.float32, False),  # several queries at an offset
    (1, 12, 12, 4, 16, 4, 0, mx.float32, False),  # prefill: rows below and above k
    (2, 5, 5, 2, 8, 8, 0, mx.float32, False),  # k larger than the whole context
    (1, 2, 300, 2, 8, 37, 298, mx.float32, False),  # S > threads: blocked compaction
    (1, 4, 64, 3, 8, 10, 60, mx.float32, True),  # heavy ties
    (2, 2, 33, 32, 128, 7, 31, mx.float32, False),  # the real indexer head shape
    (1, 3, 30, 2, 16, 6, 27, mx.bfloat16, False),
]


def check_dsa_index_topk(B, L, S, Hi, Di, topk, offset, dtype, ties, seed=0, starts=None):
    q, w, k = _index_inputs(B, L, S, Hi, Di, dtype, seed, ties)
    st = None if starts is None else mx.array(starts, dtype=mx.int32)
    with use_sim():
        idx = kernels.dsa_index_topk(q, w, k, topk, offset, st)
    ref = dsa_ref.dsa_index_topk(q, w, k, topk, offset, st)
    K = min(topk, S)
    assert idx.shape == (B, L, K) and idx.dtype == mx.int32
    scores = np.array(dsa_ref.dsa_index_scores(q, w, k, offset, st))  # [B, L, S], -inf masked
    first = [0] * B if starts is None else starts
    got, want = np.array(idx), np.array(ref)
    tol = F32_RTOL * max(float(np.max(np.abs(scores[np.isfinite(scores)]))), 1e-30)
    for bi in range(B):
        for l in range(L):
            end = min(S, offset + l + 1)
            n_allowed = max(0, end - first[bi])
            row = got[bi, l]
            chosen = row[row >= 0]
            # a valid selection: distinct allowed keys, -1 only where fewer than K exist
            assert len(set(chosen.tolist())) == len(chosen), f"repeated index in row {l}"
            assert np.all(chosen < end), f"row {l} selects a future key"
            assert np.all(chosen >= first[bi]), f"row ({bi}, {l}) selects a padding key"
            assert len(chosen) == min(K, n_allowed), f"row {l}: {len(chosen)} selected"
            mine = np.sort(scores[bi, l, chosen])
            theirs = np.sort(scores[bi, l, want[bi, l][want[bi, l] >= 0]])
            theirs = theirs[np.isfinite(theirs)]
            assert mine.shape == theirs.shape and np.all(np.abs(mine - theirs) <= tol), (
                f"row ({bi}, {l}): selected scores {mine} vs top-k {theirs}"
            )


@pytest.mark.parametrize("B,L,S,Hi,Di,topk,offset,dtype,ties", INDEX_CASES)
def test_dsa_index_topk_matches_reference(B, L, S, Hi, Di, topk, offset, dtype, ties):
    check_dsa_index_topk(B, L, S, Hi, Di, topk, offset, dtype, ties)


PADDED_INDEX_CASES = [
    # B, L, S, topk, offset, starts: first real key per row (left padding of a batch)
    (3, 1, 40, 8, 39, [0, 5, 35]),  # decode; the last row has fewer keys than topk
    (2, 3, 20, 5, 17, [3, 13]),  # several queries at an offset
    (2, 4, 10, 3, 6, [0, 9]),  # queries before a row's start see nothing (-1 only)
    (2, 1, 300, 37, 299, [0, 97]),  # S > threads, a start that is not a multiple of NT
]


@pytest.mark.parametrize("B,L,S,topk,offset,starts", PADDED_INDEX_CASES)
def test_dsa_index_topk_skips_each_rows_padding(B, L, S, topk, offset, starts):
    check_dsa_index_topk(B, L, S, 2, 16, topk, offset, mx.float32, False, seed=2, starts=starts)


def test_dsa_prefill_indices_select_the_reference_sets():
    """The dispatch point selects the same key sets through the kernel (no ties)."""
    q, w, k = _index_inputs(2, 6, 14, 2, 16, mx.float32, seed=5)
    ref = np.array(dsa_ref.dsa_prefill_indices(q, w, k, 4, 8))
    with use_sim():
        got = np.array(dsa_ref.dsa_prefill_indices(q, w, k, 4, 8))
    assert ref.shape == got.shape
    for r, g in zip(ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])):
        assert set(r[r >= 0]) == set(g[g >= 0])


# -------------------------------------------------------------- sparse_mla_decode


def _mla_inputs(B, H, R, P, S, K, dtype, seed, invalid=0.0):
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    q_lat = mx.random.normal((B, H, 1, R)).astype(dtype)
    q_pe = mx.random.normal((B, H, 1, P)).astype(dtype)
    latent = mx.random.normal((B, S, R)).astype(dtype)
    k_pe = mx.random.normal((B, S, P)).astype(dtype)
    idx = np.stack([rng.permutation(max(S, K))[:K] for _ in range(B)]).astype(np.int32)
    idx[idx >= S] = -1  # K > S: the extra entries are masked
    idx[rng.uniform(size=idx.shape) < invalid] = -1
    # Boundary entries: one past the end (skipped), the last row, the first row, masked.
    edge = np.array([S, S - 1, 0, -1], dtype=np.int32)[:K]
    idx[:, : len(edge)] = edge
    return q_lat, q_pe, latent, k_pe, mx.array(idx)


MLA_CASES = [
    # B, H, R, P, S, K, splits, dtype, invalid fraction
    (1, 1, 32, 8, 1, 1, None, mx.float32, 0.0),  # one key
    (2, 3, 40, 8, 30, 12, 3, mx.float32, 0.2),  # batch, heads, masked entries, 3 splits
    (1, 5, 32, 8, 20, 50, 4, mx.float32, 0.0),  # k larger than the context
    (1, 4, 512, 64, 300, 200, None, mx.float32, 0.0),  # the real latent/rope sizes
    (2, 2, 64, 16, 40, 33, 33, mx.float32, 0.0),  # one key per split
    (1, 3, 64, 16, 50, 24, 2, mx.bfloat16, 0.1),
]


def check_sparse_mla_decode(B, H, R, P, S, K, splits, dtype, invalid, seed=0):
    q_lat, q_pe, latent, k_pe, idx = _mla_inputs(B, H, R, P, S, K, dtype, seed, invalid)
    scale = (R // 4 + P) ** -0.5
    with use_sim():
        out = kernels.sparse_mla_decode(q_lat, q_pe, latent, k_pe, idx, scale, splits=splits)
    ref = dsa_ref.sparse_mla_decode(q_lat, q_pe, latent, k_pe, idx, scale)
    assert out.dtype == dtype
    assert_close(out, ref, _rtol(dtype), "sparse_mla_decode")


@pytest.mark.parametrize("B,H,R,P,S,K,splits,dtype,invalid", MLA_CASES)
def test_sparse_mla_decode_matches_reference(B, H, R, P, S, K, splits, dtype, invalid):
    check_sparse_mla_decode(B, H, R, P, S, K, splits, dtype, invalid)


def test_sparse_mla_decode_equals_dense_attention_over_all_keys():
    """Selecting every key is dense absorbed MLA (SDPA with the rope scores as a bias)."""
    q_lat, q_pe, latent, k_pe, _ = _mla_inputs(2, 3, 32, 8, 17, 17, mx.float32, seed=3)
    idx = mx.broadcast_to(mx.arange(17, dtype=mx.int32), (2, 17))
    scale = 0.3
    with use_sim():
        out = kernels.sparse_mla_decode(q_lat, q_pe, latent, k_pe, idx, scale, splits=4)
    bias = (q_pe * scale) @ k_pe[:, None].swapaxes(-1, -2)
    dense = mx.fast.scaled_dot_product_attention(
        q_lat, latent[:, None], latent[:, None], scale=scale, mask=bias
    )
    assert_close(out, dense, F32_RTOL, "vs dense SDPA")


def test_sparse_mla_decode_all_masked_row_is_zero():
    q_lat, q_pe, latent, k_pe, _ = _mla_inputs(2, 2, 32, 8, 10, 6, mx.float32, seed=1)
    idx = mx.array(np.array([[3, -1, 7, 12, 0, 5], [-1] * 6], dtype=np.int32))
    with use_sim():
        out = kernels.sparse_mla_decode(q_lat, q_pe, latent, k_pe, idx, 0.25, splits=2)
    ref = dsa_ref.sparse_mla_decode(q_lat, q_pe, latent, k_pe, idx, 0.25)
    assert np.all(np.array(out)[1] == 0.0)
    assert_close(out, ref, F32_RTOL)


# ------------------------------------------------ planted bugs are caught by the checks


BROKEN = [
    # kernel, off-by-one planted in its body, the check that must now fail
    ("kda_decode", plant("v[row * Dv + dv]", "v[row * Dv + (dv + 1) % Dv]"),
     lambda: check_kda_decode(2, 1, 2, 16, 8, -5.0, mx.float32)),
    # eps dropped from the l2norm: NaN for the zero-norm rows
    ("kda_decode", plant("metal::rsqrt(qq + eps)", "metal::rsqrt(qq)"),
     lambda: check_kda_decode(2, 1, 2, 16, 8, -5.0, mx.float32)),
    ("kda_decode", plant("metal::rsqrt(kk + eps)", "metal::rsqrt(kk)"),
     lambda: check_kda_decode(2, 1, 2, 16, 8, -5.0, mx.float32)),
    # one past the end: key channel Dk, token T, value column Dv
    ("kda_decode", plant("if (d < Dk) {\n      qv[i]", "if (d <= Dk) {\n      qv[i]"),
     lambda: check_kda_decode(2, 3, 2, 40, 12, -5.0, mx.float32)),
    ("kda_prefill", plant("if (tok < T) {\n      const uint off", "if (tok <= T) {\n      const uint off"),
     lambda: check_kda_prefill(2, 37, 2, 16, 8, mx.float32)),
    ("kda_prefill", plant("(j < Dv && d < Dk) ? static_cast<float>(state_in",
                           "(j <= Dv && d < Dk) ? static_cast<float>(state_in"),
     lambda: check_kda_prefill(2, 20, 3, 24, 40, mx.float32)),
    ("kda_prefill", plant("for (int m = 0; m <= t; ++m)", "for (int m = 0; m < t; ++m)"),
     lambda: check_kda_prefill(1, 20, 2, 16, 8, mx.float32)),
    ("kda_prefill", plant("const float gend = sgc[C - 1][d];", "const float gend = sgc[C - 2][d];"),
     lambda: check_kda_prefill(1, 20, 2, 16, 8, mx.float32)),
    ("dsa_index_topk", plant("offset + int(l) + 1)", "offset + int(l))"),
     lambda: check_dsa_index_topk(1, 6, 6, 2, 8, 3, 0, mx.float32, False)),
    ("dsa_index_topk", plant("(key >> shift) & 255u", "((key >> shift) + 1) & 255u"),
     lambda: check_dsa_index_topk(2, 1, 40, 2, 16, 8, 39, mx.float32, False)),
    # a batch row's last padding key taken as real
    ("dsa_index_topk", plant("metal::min(start[bi], limit)", "metal::min(start[bi] - 1, limit)"),
     lambda: check_dsa_index_topk(2, 1, 40, 2, 16, 8, 39, mx.float32, False, starts=[0, 35])),
    ("sparse_mla_partial", plant("metal::min(K, k0 + per)", "metal::min(K, k0 + per - 1)"),
     lambda: check_sparse_mla_decode(2, 3, 40, 8, 30, 12, 3, mx.float32, 0.0)),
    # index S (one past the end) taken as valid
    ("sparse_mla_partial", plant("s >= S", "s > S"),
     lambda: check_sparse_mla_decode(2, 3, 40, 8, 30, 12, 3, mx.float32, 0.0)),
    ("sparse_mla_combine", plant("for (int sp = 0; sp < NSPLIT; ++sp) {\n    const uint prow",
                                  "for (int sp = 1; sp < NSPLIT; ++sp) {\n    const uint prow"),
     lambda: check_sparse_mla_decode(2, 3, 40, 8, 30, 12, 3, mx.float32, 0.0)),
]


@pytest.mark.parametrize("name,transform,check", BROKEN,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_planted_off_by_one_is_caught(planted, name, transform, check):
    planted.bug(name, transform, check)


# ---------------------------------------------- planted races are reported as races


# dsa_index_topk scores each key on the thread that later reads it back, so its device
# barrier orders nothing; this mapping (a legal change on its own) makes other threads
# read the scores, and the barrier then matters.
_REVERSED_SCORES = plant("for (int s = tid; s < S; s += NT) {\n  float sc",
                          "for (int s = S - 1 - int(tid); s >= 0; s -= NT) {\n  float sc")


def _check_prefill():
    check_kda_prefill(1, 20, 2, 16, 8, mx.float32)  # two chunks


def _check_topk():
    check_dsa_index_topk(2, 1, 40, 2, 16, 8, 39, mx.float32, False)  # radix path


def _check_topk_padded():
    # a row start (5) that is not a multiple of the threads: each thread reads scores
    # another thread wrote, so the device barrier is needed without any planted change
    check_dsa_index_topk(2, 1, 40, 2, 16, 8, 39, mx.float32, False, starts=[0, 5])


def _check_topk_blocked():
    # S > threads, and the top keys reach past the first 256: two compaction blocks
    check_dsa_index_topk(1, 1, 300, 4, 16, 37, 299, mx.float32, False, seed=1)


RACES = [
    # kernel, body change, check, memory the report must name (None: found as outputs that
    # differ between thread schedules, e.g. a race through atomics)
    ("kda_prefill", weaken(TG_BARRIER, 0), _check_prefill, "sgc"),  # after the chunk load
    ("kda_prefill", weaken(TG_BARRIER, 1), _check_prefill, "sgc"),  # after the cumsum
    ("kda_prefill", weaken(TG_BARRIER, 2), _check_prefill, "sA"),  # after A and M
    ("kda_prefill", weaken(TG_BARRIER, 3), _check_prefill, "sk"),  # after the e^G products
    ("kda_prefill", weaken(TG_BARRIER, 4), _check_prefill, "sq"),  # end of a chunk
    ("kda_prefill", weaken(TG_BARRIER, 0, "threadgroup_barrier(mem_flags::mem_device);"),
     _check_prefill, "sgc"),  # the wrong kind of barrier
    ("kda_prefill", weaken(TG_BARRIER, 2, "simdgroup_barrier(mem_flags::mem_threadgroup);"),
     _check_prefill, "sA"),  # orders one SIMD-group only
    ("dsa_index_topk", weaken(TG_BARRIER, 0), _check_topk, "sq"),
    ("dsa_index_topk", weaken(TG_BARRIER, 1), _check_topk, None),  # histogram cleared
    ("dsa_index_topk", weaken(TG_BARRIER, 2), _check_topk, None),  # histogram filled
    ("dsa_index_topk", weaken(TG_BARRIER, 3), _check_topk, "srem"),
    ("dsa_index_topk", weaken(TG_BARRIER, 4), _check_topk, "sgt"),
    ("dsa_index_topk", weaken(TG_BARRIER, 5), _check_topk_blocked, "sgt"),
    ("dsa_index_topk", both(_REVERSED_SCORES, weaken(DEV_BARRIER, 0)), _check_topk, "scores"),
    ("dsa_index_topk", weaken(DEV_BARRIER, 0), _check_topk_padded, "scores"),
    ("dsa_index_topk", both(_REVERSED_SCORES, weaken(DEV_BARRIER, 0, TG_BARRIER)),
     _check_topk, "scores"),
]


@pytest.mark.parametrize("name,transform,check,memory", RACES,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(RACES)])
def test_planted_race_is_reported(planted, name, transform, check, memory):
    planted.race(name, transform, check, memory)


def test_kernel_tests_run_with_the_race_checker_on():
    """Every kernel above ran with the race checker and two thread schedules (the
    defaults; KIMI_MLX_SIM_RACECHECK=0 or KIMI_MLX_SIM_SCHEDULES=1 would weaken them)."""
    assert_raced(kernels.KERNELS)


def test_device_barrier_orders_the_reversed_scores(planted):
    """The control for the planted device race: with other threads reading the scores,
    threadgroup_barrier(mem_device) is what makes the kernel race-free."""
    planted.swap("dsa_index_topk", _REVERSED_SCORES)
    _check_topk()


def test_every_metal_source_has_a_kernel():
    here = Path(kernels.__file__).parent
    files = {p.name for p in here.glob("*.metal")}
    assert files == {spec[0] for spec in kernels.SPECS.values()}
    for name, (file, _, _) in kernels.SPECS.items():
        assert name in kernels.load_sources(file)
    # (the quantized-cache kernels' planted bugs: tests/test_metal_kernels_quantized.py)
    assert {b[0] for b in BROKEN} == {n for n in kernels.SPECS if not n.endswith("_q")}


# ---------------------------------------------------------------- dispatch and model


class _Counting:
    """Wraps a DispatchKernel and counts its calls."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.kernel(**kwargs)


@pytest.fixture
def counted(monkeypatch):
    """KERNELS wrapped with call counters: {name: _Counting}."""
    wrapped = {name: _Counting(k) for name, k in kernels.KERNELS.items()}
    for name, w in wrapped.items():
        monkeypatch.setitem(kernels.KERNELS, name, w)
    return wrapped


def test_reference_mode_never_calls_a_kernel(monkeypatch, counted):
    monkeypatch.delenv(dispatch.SIM_ENV, raising=False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert dispatch.kernel_mode() == "reference"
    args = ModelArgs.from_config(full_config(tiny_text_config()))  # index_topk 8
    model = random_model(args, seed=1)
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (1, 12)))
    cache = model.make_cache()
    mx.eval(model(tokens, cache), model(tokens[:, :1], cache))
    assert all(c.calls == 0 for c in counted.values())
    with pytest.raises(dispatch.MetalUnavailableError):
        kernels.kda_decode(*_decode_inputs(1, 1, 1, 32, 8, mx.float32, 0))


def test_model_through_kernels_matches_reference_mode(counted):
    """Batch 2, prompt past index_topk and not a multiple of the chunk, then decode steps
    past index_topk: emulator path vs reference path on a conditioned model, within the
    float32 tolerance rule, with the top-k choices' margins checked; every kernel used."""
    args = ModelArgs.from_config(full_config(tiny_text_config()))  # index_topk 8
    model = random_model(args, seed=5, conditioned=True)
    tokens = mx.array(np.random.default_rng(4).integers(0, 256, (2, 25)))

    def run():
        cache = model.make_cache()
        outs = [model(tokens[:, :19], cache)]
        for t in range(19, 25):
            outs.append(model(tokens[:, t : t + 1], cache))
        return mx.concatenate(outs, axis=1), cache

    tol = model_tolerance(args, 25)
    with margins() as m:
        ref, ref_cache = run()
        with use_sim():
            got, cache = run()
            full = model(tokens)
    m.check(tol, need_indexer=True)
    assert rel_err(got, ref) < tol
    assert rel_err(full, ref) < tol
    for c, r in zip(cache, ref_cache):
        if isinstance(c.state, list) and len(c.state) == 2:  # KDA: conv, recurrent state
            assert rel_err(c.state[1], r.state[1]) < tol
    for name, c in counted.items():
        if name.endswith("_q"):  # a quantized (--kv-bits) cache's kernels: not this cache
            continue
        assert c.calls > 0, f"the model never called kernel {name}"


def _foundation():
    """tests/test_model.py, loaded under a private name (its `pair` fixture reused here)."""
    spec = importlib.util.spec_from_file_location(
        "_foundation_model_tests", Path(__file__).with_name("test_model.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_F = _foundation()
pair = _F.pair  # module-scoped fixture: (ours, mlx-lm kimi_k3) on the same weights

FOUNDATION = [
    ("test_prefill_and_16_decode_steps_match_mlx_lm_kimi_k3", True),
    ("test_layer_range_models_compose_to_the_full_model", True),
    ("test_sparse_dsa_matches_straightforward_reference", False),
    ("test_sparse_decode_with_cache_equals_fresh_full_forward", False),
]


@pytest.mark.parametrize("name,needs_pair", FOUNDATION, ids=[f[0] for f in FOUNDATION])
def test_foundation_model_tests_pass_in_the_emulator(request, counted, name, needs_pair):
    test = getattr(_F, name)
    with use_sim():
        if needs_pair:
            test(request.getfixturevalue("pair"))
        else:
            test()
    assert sum(c.calls for c in counted.values()) > 0
