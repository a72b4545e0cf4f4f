"""The Metal kernels over an affine-quantized DSA cache (the `--kv-bits` cache format:
`mx.quantize` along the last axis, packed uint32 words + a scale and a bias per group):
`dsa_index_topk_q` and `sparse_mla_decode_q` (metal/dsa_index_topk.metal,
metal/sparse_mla_decode.metal, wrappers in metal/kernels.py), run in the CPU emulator with
the race checker on, against the reference computation: `mx.dequantize` of the cache, then
the BF16 path's reference ops (metal/dsa.py `dsa_index_scores` / `dsa_index_topk` /
`sparse_mla_decode` / `sparse_mla_attend`).

- The packing order the kernels assume (value j of a word in bits bits*j.., little end
  first) is pinned against `mx.quantize` / `mx.dequantize` with NumPy.
- Top-k: the kernel's selected set equals the reference's exactly where the row's margin
  (K-th minus (K+1)-th reference score) exceeds the project's tolerance rule
  (`kimi_mlx.testing.checkpoints.tolerance`); within the margin, the selected scores agree
  as multisets within the tolerance (ties may swap).
- Attention: float32 within the tolerance rule, bf16 caches within bf16 tolerance.
- The prefill path over a quantized cache (reference ops: `dsa_prefill_indices_quantized`
  then `sparse_mla_attend_quantized`) and the decode dispatch point, kernels vs reference
  mode vs the BF16 path on the dequantized cache.
- A planted bug in each new kernel is caught, a removed barrier is reported as a race.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.metal import dispatch, kernels, selfcheck
from kimi_mlx.metal import dsa as dsa_ref
from kimi_mlx.metal.dispatch import use_sim
from kimi_mlx.testing.checkpoints import tolerance

from fixtures.planted import DEV_BARRIER, TG_BARRIER, assert_close, assert_raced, plant, weaken

BF16_RTOL = 2e-2
Q_KERNELS = ("dsa_index_topk_q", "sparse_mla_partial_q", "sparse_mla_combine_q")


def _f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _dequant(parts, gs, bits):
    """The reference's dequantization: mx.dequantize with float32 scales and biases."""
    w, s, b = parts
    return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs,
                         bits=bits)


# ------------------------------------------------------------------ the packing order


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_packing_order_is_mlx_quantize(bits, gs, dtype):
    """NumPy unpacking of mx.quantize's words, value j of a word in bits bits*j..
    (little end first), times the group scale plus the group bias, is mx.dequantize."""
    x = (mx.random.normal((3, 5, 256), key=mx.random.key(bits + gs)) * 3).astype(dtype)
    w, s, b = mx.quantize(x, group_size=gs, bits=bits)
    assert w.dtype == mx.uint32 and s.dtype == dtype and b.dtype == dtype
    words = np.array(w).astype(np.uint64)
    vpw = 32 // bits
    q = np.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(vpw)], axis=-1)
    q = q.reshape(3, 5, 256).astype(np.float32)
    sc = np.repeat(_f32(s), gs, axis=-1)
    bi = np.repeat(_f32(b), gs, axis=-1)
    mine = sc * q + bi
    np.testing.assert_allclose(mine, _f32(_dequant((w, s, b), gs, bits)), rtol=0, atol=1e-5)
    if dtype == mx.float32:  # (bf16 scales and biases add their own rounding)
        # what the cache holds is within a quantization step of what was stored
        step = np.repeat(np.abs(_f32(s)), gs, axis=-1)
        assert np.all(np.abs(mine - _f32(x)) <= step + 1e-6)
    # dsa.dequantize_rows is the same computation
    np.testing.assert_array_equal(_f32(dsa_ref.dequantize_rows((w, s, b), gs, bits)),
                                  _f32(_dequant((w, s, b), gs, bits)))


# ------------------------------------------------------------------- dsa_index_topk_q


def _index_inputs(B, L, S, Hi, Di, dtype, seed, groups=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, L, Hi, Di), key=ks[0]).astype(dtype)
    w = mx.random.normal((B, L, Hi), key=ks[1]).astype(dtype)
    if groups:  # `groups` distinct keys repeated along S: exact ties in every row
        distinct = mx.random.normal((B, groups, Di), key=ks[2])
        k = mx.take(distinct, mx.arange(S) % groups, axis=1).astype(dtype)
    else:
        k = mx.random.normal((B, S, Di), key=ks[2]).astype(dtype)
    return q, w, k


INDEX_CASES = [
    # B, L, S, Hi, Di, topk, offset, bits, gs, dtype, starts, groups
    (1, 1, 1, 2, 32, 4, 0, 8, 32, mx.float32, None, 0),  # one key, k > context
    (2, 1, 40, 2, 32, 8, 39, 8, 32, mx.float32, None, 0),  # decode, batch 2
    (2, 3, 20, 2, 64, 5, 17, 8, 64, mx.float32, [3, 13], 0),  # padded rows at an offset
    (1, 12, 12, 4, 64, 4, 0, 8, 32, mx.float32, None, 0),  # prefill: rows below/above k
    (2, 1, 300, 2, 32, 37, 299, 8, 32, mx.float32, [0, 97], 0),  # S > threads, start % NT
    (1, 4, 64, 3, 32, 10, 60, 8, 32, mx.float32, None, 4),  # heavy exact ties
    (2, 2, 33, 32, 128, 7, 31, 8, 64, mx.float32, None, 0),  # the real indexer shape
    (1, 2, 50, 4, 128, 9, 48, 8, 128, mx.bfloat16, None, 0),  # a bf16 cache, group 128
    (2, 2, 40, 2, 64, 6, 38, 4, 32, mx.float32, [0, 7], 0),  # 4-bit keys
]


def check_index_q(B, L, S, Hi, Di, topk, offset, bits, gs, dtype, starts, groups, seed=0):
    q, w, k = _index_inputs(B, L, S, Hi, Di, dtype, seed, groups)
    parts = mx.quantize(k, group_size=gs, bits=bits)
    st = None if starts is None else mx.array(starts, dtype=mx.int32)
    with use_sim():
        idx = kernels.dsa_index_topk_q(q, w, parts, topk, offset, st, group_size=gs,
                                       bits=bits)
    # the reference: dequantize the whole cache, then the BF16 path's reference op
    kd = _dequant(parts, gs, bits)
    ref = dsa_ref.dsa_index_topk(q, w, kd, topk, offset, st)
    scores = np.array(dsa_ref.dsa_index_scores(q, w, kd, offset, st))
    K = min(topk, S)
    assert idx.shape == (B, L, K) and idx.dtype == mx.int32
    got, want = np.array(idx), np.array(ref)
    first = [0] * B if starts is None else starts
    finite = np.abs(scores[np.isfinite(scores)])
    tol = tolerance(1, Hi * Di) * max(float(finite.max()) if finite.size else 0.0, 1e-30)
    exact_rows = 0
    for bi in range(B):
        for l in range(L):
            end = min(S, offset + l + 1)
            n_allowed = max(0, end - first[bi])
            chosen = got[bi, l][got[bi, l] >= 0]
            theirs = want[bi, l][want[bi, l] >= 0]
            assert len(set(chosen.tolist())) == len(chosen), f"row ({bi}, {l}): repeated"
            assert np.all((chosen >= first[bi]) & (chosen < end)), f"row ({bi}, {l}): not allowed"
            assert len(chosen) == min(K, n_allowed), f"row ({bi}, {l}): {len(chosen)} selected"
            row = np.sort(scores[bi, l][np.isfinite(scores[bi, l])])[::-1]
            if n_allowed > K and row[K - 1] - row[K] > tol:
                # a margin above the tolerance: the very same keys
                assert set(chosen.tolist()) == set(theirs.tolist()), (
                    f"row ({bi}, {l}): {sorted(chosen)} vs {sorted(theirs)}")
                exact_rows += 1
            mine = np.sort(scores[bi, l, chosen])
            ref_sc = np.sort(scores[bi, l, theirs])
            assert np.all(np.abs(mine - ref_sc) <= tol), (
                f"row ({bi}, {l}): selected scores {mine} vs top-k {ref_sc}")
    return exact_rows


@pytest.mark.parametrize("B,L,S,Hi,Di,topk,offset,bits,gs,dtype,starts,groups", INDEX_CASES)
def test_dsa_index_topk_q_matches_dequantize_then_reference(
        B, L, S, Hi, Di, topk, offset, bits, gs, dtype, starts, groups):
    exact = check_index_q(B, L, S, Hi, Di, topk, offset, bits, gs, dtype, starts, groups)
    if not groups and S > topk:  # random keys: most rows have a margin, compared exactly
        assert exact > 0


def test_selection_text_is_shared_with_the_bf16_kernel():
    """dsa_index_topk_q differs from dsa_index_topk only in its score loop: from the radix
    select on, the bodies are the same text (so a fix to one reaches the other)."""
    src = kernels.load_sources("dsa_index_topk.metal")
    tail = lambda body: body[body.index("// 2. Radix select"):]  # noqa: E731
    assert tail(src["dsa_index_topk_q"]) == tail(src["dsa_index_topk"])
    assert "kx[" not in src["dsa_index_topk_q"] and "kx_w[" in src["dsa_index_topk_q"]


# ---------------------------------------------------------------- sparse_mla_decode_q


def _mla_inputs(B, H, R, P, S, K, dtype, seed, invalid=0.0):
    rng = np.random.default_rng(seed)
    ks = mx.random.split(mx.random.key(seed), 4)
    q_lat = mx.random.normal((B, H, 1, R), key=ks[0]).astype(dtype)
    q_pe = mx.random.normal((B, H, 1, P), key=ks[1]).astype(dtype)
    latent = mx.random.normal((B, S, R), key=ks[2]).astype(dtype)
    k_pe = mx.random.normal((B, S, P), key=ks[3]).astype(dtype)
    idx = np.stack([rng.permutation(max(S, K))[:K] for _ in range(B)]).astype(np.int32)
    idx[idx >= S] = -1
    idx[rng.uniform(size=idx.shape) < invalid] = -1
    # boundary entries: one past the end (skipped), the last row, the first row, masked
    for j, v in enumerate([S, S - 1, 0, -1][: K]):
        if K > 4:
            idx[0, j] = v
    return q_lat, q_pe, latent, k_pe, mx.array(idx)


MLA_CASES = [
    # B, H, R, P, S, K, splits, bits, gs, dtype, invalid
    (1, 1, 32, 8, 1, 1, None, 8, 32, mx.float32, 0.0),  # one key
    (2, 3, 64, 8, 30, 12, 3, 8, 32, mx.float32, 0.2),  # batch, heads, masked, 3 splits
    (1, 5, 64, 16, 20, 50, 4, 8, 64, mx.float32, 0.0),  # k larger than the context
    (1, 4, 512, 64, 300, 200, None, 8, 64, mx.float32, 0.0),  # the real latent/rope sizes
    (1, 2, 512, 64, 60, 40, 2, 8, 128, mx.float32, 0.0),  # group 128
    (2, 2, 128, 16, 40, 33, 33, 4, 32, mx.float32, 0.0),  # 4-bit, one key per split
    (1, 3, 128, 16, 50, 24, 2, 8, 64, mx.bfloat16, 0.1),  # a bf16 cache
]


def check_mla_q(B, H, R, P, S, K, splits, bits, gs, dtype, invalid, seed=0):
    q_lat, q_pe, latent, k_pe, idx = _mla_inputs(B, H, R, P, S, K, dtype, seed, invalid)
    parts = mx.quantize(latent, group_size=gs, bits=bits)
    scale = (R // 4 + P) ** -0.5
    with use_sim():
        out = kernels.sparse_mla_decode_q(q_lat, q_pe, parts, k_pe, idx, scale,
                                          group_size=gs, bits=bits, splits=splits)
    ref = dsa_ref.sparse_mla_decode(q_lat, q_pe, _dequant(parts, gs, bits), k_pe, idx, scale)
    assert out.dtype == dtype
    rtol = tolerance(1, max(R + P, K)) if dtype == mx.float32 else BF16_RTOL
    assert_close(out, ref, rtol, "sparse_mla_decode_q")


@pytest.mark.parametrize("B,H,R,P,S,K,splits,bits,gs,dtype,invalid", MLA_CASES)
def test_sparse_mla_decode_q_matches_dequantize_then_reference(
        B, H, R, P, S, K, splits, bits, gs, dtype, invalid):
    check_mla_q(B, H, R, P, S, K, splits, bits, gs, dtype, invalid)


def test_sparse_mla_decode_q_all_masked_row_is_zero():
    q_lat, q_pe, latent, k_pe, _ = _mla_inputs(2, 2, 64, 8, 10, 6, mx.float32, seed=1)
    parts = mx.quantize(latent, group_size=32, bits=8)
    idx = mx.array(np.array([[3, -1, 7, 12, 0, 5], [-1] * 6], dtype=np.int32))
    with use_sim():
        out = kernels.sparse_mla_decode_q(q_lat, q_pe, parts, k_pe, idx, 0.25,
                                          group_size=32, splits=2)
    assert np.all(np.array(out)[1] == 0.0)
    ref = dsa_ref.sparse_mla_decode(q_lat, q_pe, _dequant(parts, 32, 8), k_pe, idx, 0.25)
    assert_close(out, ref, tolerance(1, 72))


# ------------------------------------------------------ dispatch points, decode/prefill


def _cache(B, S, R, P, Hi, Di, H, dtype, seed, gs):
    """A quantized DSA cache in the DSACache layout and one decode token's inputs."""
    ks = mx.random.split(mx.random.key(seed), 7)
    latent = mx.random.normal((B, 1, S, R), key=ks[0]).astype(dtype)
    k_pe = mx.random.normal((B, 1, S, P), key=ks[1]).astype(dtype)
    k_idx = mx.random.normal((B, S, Di), key=ks[2]).astype(dtype)
    q_lat = mx.random.normal((B, H, 1, R), key=ks[3]).astype(dtype)
    q_pe = mx.random.normal((B, H, 1, P), key=ks[4]).astype(dtype)
    q_idx = mx.random.normal((B, 1, Hi, Di), key=ks[5]).astype(dtype)
    w = mx.random.uniform(0.1, 1.0, (B, 1, Hi), key=ks[6]).astype(dtype)
    return (mx.quantize(latent, group_size=gs, bits=8), k_pe,
            mx.quantize(k_idx, group_size=gs, bits=8), q_lat, q_pe, q_idx, w)


@pytest.mark.parametrize("starts", [None, [0, 9]])
def test_decode_dispatch_kernels_reference_and_bf16_path_agree(monkeypatch, starts):
    """`dsa_sparse_decode_quantized` through both kernels (emulator), through the reference
    ops (KIMI_MLX_KERNELS=reference) and the BF16 path's `dsa_sparse_decode` (dense masked
    SDPA) on the dequantized cache: one decode token past index_topk."""
    B, S, R, P, Hi, Di, H, topk, gs = 2, 40, 64, 16, 2, 64, 3, 8, 32
    lat, k_pe, kq, q_lat, q_pe, q_idx, w = _cache(B, S, R, P, Hi, Di, H, mx.float32, 3, gs)
    st = None if starts is None else mx.array(starts, dtype=mx.int32)
    args = (q_lat, q_pe, lat, k_pe, 0.2, q_idx, w, kq, topk, S - 1, st)
    with use_sim():
        got = dsa_ref.dsa_sparse_decode_quantized(*args, group_size=gs, bits=8)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference")
    ref = dsa_ref.dsa_sparse_decode_quantized(*args, group_size=gs, bits=8)
    dense = dsa_ref.dsa_sparse_decode(q_lat, q_pe, _dequant(lat, gs, 8), k_pe, 0.2, q_idx, w,
                                      _dequant(kq, gs, 8), topk, S - 1, starts=st)
    tol = tolerance(1, max(R + P, topk))
    assert_close(got, ref, tol, "kernels vs reference ops")
    assert_close(ref, dense, tol, "reference ops vs the BF16 path on the dequantized cache")


def test_prefill_over_a_quantized_cache_matches_the_bf16_path_on_its_dequantization():
    """The DSA prefill path past index_topk with a quantized cache: the indexer's keys
    (`dsa_prefill_indices_quantized`, kernel in the emulator and reference op) and the
    attention over each query's selected rows (`sparse_mla_attend_quantized`, a reference
    op gathering and dequantizing only the selected rows) equal `dsa_prefill_indices` and
    `sparse_mla_attend` on the dequantized cache."""
    B, L, S, R, P, Hi, Di, H, topk, gs = 2, 6, 30, 64, 16, 2, 32, 3, 5, 32
    offset = S - L
    lat, k_pe, kq, _, _, _, _ = _cache(B, S, R, P, Hi, Di, H, mx.float32, 5, gs)
    ks = mx.random.split(mx.random.key(6), 4)
    q_idx = mx.random.normal((B, L, Hi, Di), key=ks[0])
    w = mx.random.uniform(0.1, 1.0, (B, L, Hi), key=ks[1])
    q_lat = mx.random.normal((B, H, L, R), key=ks[2])
    q_pe = mx.random.normal((B, H, L, P), key=ks[3])
    st = mx.array([0, 4], dtype=mx.int32)
    kd = _dequant(kq, gs, 8)
    want_idx = dsa_ref.dsa_prefill_indices(q_idx, w, kd, topk, offset, starts=st)
    ref_idx = dsa_ref.dsa_prefill_indices_quantized(q_idx, w, kq, topk, offset, st,
                                                    group_size=gs)
    with use_sim():
        got_idx = dsa_ref.dsa_prefill_indices_quantized(q_idx, w, kq, topk, offset, st,
                                                        group_size=gs)
    for a, b in ((got_idx, want_idx), (ref_idx, want_idx)):
        for r, g in zip(np.array(a).reshape(-1, topk), np.array(b).reshape(-1, topk)):
            assert set(r[r >= 0]) == set(g[g >= 0])
    lat3 = [p[:, 0] for p in lat]
    out = dsa_ref.sparse_mla_attend_quantized(q_lat, q_pe, lat3, k_pe[:, 0], ref_idx, 0.2,
                                              group_size=gs)
    want = dsa_ref.sparse_mla_attend(q_lat, q_pe, _dequant(lat3, gs, 8), k_pe[:, 0], ref_idx,
                                     0.2)
    assert_close(out, want, tolerance(1, max(R + P, topk)), "sparse_mla_attend_quantized")


def test_quantized_cache_is_close_to_the_unquantized_one():
    """The 8-bit cache's decode output stays near the unquantized cache's (the format is
    not garbage); a sanity bound, the quality gates are measured on micro elsewhere."""
    B, S, R, P, Hi, Di, H, topk, gs = 1, 64, 512, 64, 4, 128, 4, 16, 64
    ks = mx.random.split(mx.random.key(9), 7)
    latent = mx.random.normal((B, 1, S, R), key=ks[0])
    k_pe = mx.random.normal((B, 1, S, P), key=ks[1])
    k_idx = mx.random.normal((B, S, Di), key=ks[2])
    q_lat = mx.random.normal((B, H, 1, R), key=ks[3])
    q_pe = mx.random.normal((B, H, 1, P), key=ks[4])
    q_idx = mx.random.normal((B, 1, Hi, Di), key=ks[5])
    w = mx.random.uniform(0.1, 1.0, (B, 1, Hi), key=ks[6])
    lat_q = mx.quantize(latent, group_size=gs, bits=8)
    kq = mx.quantize(k_idx, group_size=gs, bits=8)
    with use_sim():
        got = dsa_ref.dsa_sparse_decode_quantized(q_lat, q_pe, lat_q, k_pe, R**-0.5, q_idx, w,
                                                  kq, topk, S - 1, group_size=gs)
    full = dsa_ref.sparse_mla_decode(
        q_lat, q_pe, latent[:, 0], k_pe[:, 0],
        dsa_ref.dsa_index_topk(q_idx, w, k_idx, topk, S - 1)[:, 0], R**-0.5)
    assert_close(got, full, 2e-2, "8-bit vs unquantized cache")


def test_bad_quantized_inputs_are_clear_errors():
    q_lat, q_pe, latent, k_pe, idx = _mla_inputs(1, 2, 64, 8, 10, 4, mx.float32, 0)
    w, s, b = mx.quantize(latent, group_size=32, bits=8)
    call = lambda parts, **kw: kernels.sparse_mla_decode_q(  # noqa: E731
        q_lat, q_pe, parts, k_pe, idx, 0.3, **kw)
    with pytest.raises(ValueError, match="latent.*uint32"):
        call((w.astype(mx.int32), s, b), group_size=32)
    with pytest.raises(ValueError, match="bits=3"):
        call((w, s, b), group_size=32, bits=3)
    with pytest.raises(ValueError, match="group_size=16"):
        call((w, s, b), group_size=16)
    with pytest.raises(ValueError, match="latent.*group_size=64"):
        call((w, s, b), group_size=64)  # scales of group 32 read as group 64
    with pytest.raises(ValueError, match="latent.*scales, biases"):
        call((w, s))
    q, wt, k = _index_inputs(1, 1, 10, 2, 32, mx.float32, 0)
    kw_, ks_, kb_ = mx.quantize(k, group_size=32, bits=8)
    with pytest.raises(ValueError, match="index keys"):
        kernels.dsa_index_topk_q(q, wt, (kw_, ks_[:, :5], kb_), 4, 9, group_size=32)


# ---------------------------------------------------- planted bugs and races are caught


BROKEN = [
    # kernel, bug planted in its body, the check that must now fail
    # big end first: the packing order of mx.quantize read backwards
    ("dsa_index_topk_q", plant("(word >> (BITS * j))", "(word >> (BITS * (VPW - 1 - j)))"),
     lambda: check_index_q(2, 1, 40, 2, 32, 8, 39, 8, 32, mx.float32, None, 0)),
    # the next group's scale and bias
    ("dsa_index_topk_q", plant("krow * NG + (wd * VPW) / GS", "krow * NG + (wd * VPW) / GS + 1"),
     lambda: check_index_q(2, 1, 40, 2, 64, 8, 39, 8, 32, mx.float32, None, 0)),
    ("dsa_index_topk_q", plant("metal::min(start[bi], limit)", "metal::min(start[bi] - 1, limit)"),
     lambda: check_index_q(2, 1, 40, 2, 32, 8, 39, 8, 32, mx.float32, [0, 35], 0)),
    ("sparse_mla_partial_q", plant("(word >> (BITS * j))", "(word >> (BITS * (VPW - 1 - j)))"),
     lambda: check_mla_q(2, 3, 64, 8, 30, 12, 3, 8, 32, mx.float32, 0.0)),
    # scale and bias swapped
    ("sparse_mla_partial_q", plant("gs * static_cast<float>((word", "gb * static_cast<float>((word"),
     lambda: check_mla_q(2, 3, 64, 8, 30, 12, 3, 8, 32, mx.float32, 0.0)),
    ("sparse_mla_partial_q", plant("s >= S", "s > S"),
     lambda: check_mla_q(2, 3, 64, 8, 30, 12, 3, 8, 32, mx.float32, 0.0)),
    ("sparse_mla_combine_q", plant("for (int sp = 0; sp < NSPLIT; ++sp) {\n    const uint prow",
                                    "for (int sp = 1; sp < NSPLIT; ++sp) {\n    const uint prow"),
     lambda: check_mla_q(2, 3, 64, 8, 30, 12, 3, 8, 32, mx.float32, 0.0)),
]


@pytest.mark.parametrize("name,transform,check", BROKEN,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_planted_bug_is_caught(planted, name, transform, check):
    planted.bug(name, transform, check)


def test_every_quantized_kernel_has_a_planted_bug_and_runs_raced():
    assert {n for n in kernels.SPECS if n.endswith("_q")} == set(Q_KERNELS)
    assert {b[0] for b in BROKEN} == set(Q_KERNELS)
    assert_raced(Q_KERNELS)


@pytest.mark.parametrize("n,memory,starts", [(0, "sq", None), (3, "srem", None),
                                             (4, "sgt", None)])
def test_removed_barrier_is_reported_as_a_race(planted, n, memory, starts):
    planted.race("dsa_index_topk_q", weaken(TG_BARRIER, n),
                 lambda: check_index_q(2, 1, 40, 2, 32, 8, 39, 8, 32, mx.float32, starts, 0),
                 memory)


def test_removed_device_barrier_is_reported_for_a_padded_row(planted):
    planted.race("dsa_index_topk_q", weaken(DEV_BARRIER, 0),
                 lambda: check_index_q(2, 1, 40, 2, 32, 8, 39, 8, 32, mx.float32, [0, 5], 0),
                 "scores")


# ------------------------------------------------------------------- the device check


def test_device_checks_pass_in_the_emulator_and_catch_a_planted_bug(monkeypatch):
    with use_sim():
        assert dispatch.run_check("dsa_index_topk_q") is None
        assert dispatch.run_check("sparse_mla_decode_q") is None
    for name, part in (("dsa_index_topk_q", "dsa_index_topk_q"),
                       ("sparse_mla_decode_q", "sparse_mla_partial_q")):
        with monkeypatch.context() as mp:
            mp.setitem(kernels.KERNELS, part, kernels.build_kernel(
                part, plant("(word >> (BITS * j))", "(word >> (BITS * (VPW - 1 - j)))")))
            with use_sim():
                error = dispatch.run_check(name)
        assert error is not None and ("8-bit" in error or "4-bit" in error), error


def test_device_check_covers_both_widths():
    assert {bits for bits, _ in selfcheck.QUANT_CASES} == {4, 8}
