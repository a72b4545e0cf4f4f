"""The quality claims of the 8-bit DSA cache (`--kv-bits 8`) that are cheap to hold: the
per-value error bound read from a group's scale and bias (model/cache.py
`dequantize_error_bound`) against the real error of `mx.quantize` on random groups, the
near-tie rule of the quality bench (kimi_mlx/bench/kv_quality.py `classify_topk`) on hand
cases, and, on micro with its sparse path active, that the indexer's top-k over the 8-bit
cache equals the BF16 cache's outside near-ties and each equals a float64 NumPy top-k of
its own keys outside float32 ties (kimi_mlx/testing/real_oracles.py).

The heavy measurement (perplexity at 16k, 50 greedy prompts, the 4-turn server) is the
bench, not a test.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.metal.dsa import dequantize_rows, quant_format
from kimi_mlx.bench.kv_quality import bf16_cache, classify_topk, score_bounds
from kimi_mlx.model.cache import (KV_DEFAULT_GROUP, DSACache, dequantize,
                                  dequantize_error_bound)
from kimi_mlx.testing.real_oracles import index_scores64, selection_report

MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_error_bound_holds_and_is_tight(dtype, bits, group):
    """Groups of all signs and scales (offset, skewed, constant, containing zero): the
    error of a quantize/dequantize round trip never exceeds the bound, and the bound is
    not loose by more than a small factor (its largest use is >= 0.3)."""
    rng = np.random.default_rng(bits * 1000 + group)
    n = 1024
    x = (rng.standard_normal((n, 256)) * rng.uniform(0.01, 30, (n, 1))
         + rng.standard_normal((n, 1)) * rng.uniform(0, 5, (n, 1)))
    x[:8] = 1.5  # constant groups
    x[8:16, ::3] = 0.0
    x[16:24] = np.abs(x[16:24])  # one-signed groups (the scale's edge moves)
    xm = mx.array(x.astype(np.float32)).astype(dtype)
    q = mx.quantize(xm, group_size=group, bits=bits)
    ref = np.asarray(xm.astype(mx.float32)).astype(np.float64)
    err = np.abs(np.asarray(dequantize(q, bits).astype(mx.float32)) - ref)
    bound = np.asarray(dequantize_error_bound(q, bits)).astype(np.float64)
    assert bound.shape == ref.shape
    ratio = err / np.maximum(bound, 1e-30)
    assert ratio.max() <= 1.0, f"error {ratio.max():.3f}x the bound"
    assert ratio.max() >= 0.3, f"bound loose: errors reach only {ratio.max():.3f}x of it"


def test_classify_topk_by_hand():
    """k = 2 of 4 keys with scores 10, 9, 8.9, 1 and bound 0.1 each: swapping the 2nd and
    3rd (9 vs 8.9) is a near-tie; swapping the 1st and 4th is not; equal sets are equal."""
    scores = np.array([[10.0, 9.0, 8.9, 1.0]] * 3)
    bound = np.full_like(scores, 0.1)
    ref = np.array([[0, 1]] * 3)
    got = np.array([[1, 0], [0, 2], [1, 3]])
    equal, tie = classify_topk(ref, got, scores, bound)
    assert equal.tolist() == [True, False, False]
    assert tie.tolist() == [False, True, False]
    # the same swap with a bound too small for a 0.1 gap is not a tie
    _, tie = classify_topk(ref, got, scores, np.full_like(scores, 0.04))
    assert tie.tolist() == [False, False, False]


@pytest.fixture(scope="module")
def micro():
    from kimi_mlx.checkpoint.loader import load_model

    if not MICRO.exists():
        pytest.skip("no shipped micro checkpoint")
    model, _, _ = load_model(MICRO, verbose=False)
    yield model
    model.set_kv_quant(None)


def _first_dsa_call(model, ids, bits):
    """(q_idx [L,Hi,D], w [L,Hi], k_idx [S,D], selected [L,k], offset, cache) of the first
    Gated DSA layer's indexer during a one-chunk prefill of `ids` with the cache written
    in BF16 (`bf16_cache`), 8-bit when bits is 8; queries before index_topk dropped."""
    from kimi_mlx.model import dsa as dsa_mod

    real = dsa_mod.dsa_prefill_indices
    seen = []

    def record(q_idx, w, k_idx, k, offset, starts=None):
        idx = real(q_idx, w, k_idx, k, offset, starts=starts)
        if not seen:
            keys = k_idx
            if isinstance(k_idx, (tuple, list)):  # an 8-bit cache is read packed: the keys it holds
                group, nbits = quant_format(k_idx, q_idx.shape[-1], "index keys")
                keys = dequantize_rows(k_idx, group, nbits)  # in float32, as the indexer reads
            seen.append((np.asarray(q_idx[0]), np.asarray(w[0]), np.asarray(keys[0]),
                         np.asarray(idx[0]), offset))
        return idx

    model.set_kv_quant(bits, KV_DEFAULT_GROUP)
    cache = model.make_cache()
    dsa_mod.dsa_prefill_indices = record
    try:
        with bf16_cache():
            mx.eval(model(mx.array(ids)[None], cache))
    finally:
        dsa_mod.dsa_prefill_indices = real
        model.set_kv_quant(None)
    q, w, k, sel, off = seen[0]
    keep = off + np.arange(q.shape[0]) >= model.args.index_topk
    return q[keep], w[keep], k, sel[keep], off + int(np.argmax(keep)), cache


def test_topk_over_8bit_cache_equals_bf16_outside_near_ties(micro):
    """Micro's first Gated DSA layer follows only KDA layers, so its queries are the same
    whatever the DSA cache format: the 8-bit cache (default group) changes only its keys.
    Over a 200-token prompt of held-out prose: each format's selection is NumPy's float64
    top-k of the keys it read (outside float32 ties); the 8-bit keys are within the
    bound of the BF16 keys; and every pair whose 8-bit selection differs from BF16's is a
    near-tie by the bound derived from the group scales (the bench's rule); the sets
    overlap >= 98% (the bench's 4k-token figure for this layer and the next: 98.9%)."""
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(MICRO)
    ids = tok.encode((MICRO / "heldout" / "prose.txt").read_text()[:20000])[1000:1200]
    topk = micro.args.index_topk
    q16, w16, k16, sel16, off, _ = _first_dsa_call(micro, ids, None)
    q8, w8, k8, sel8, off8, cache = _first_dsa_call(micro, ids, 8)
    assert off8 == off and np.array_equal(q8, q16) and np.array_equal(w8, w16)
    assert sel16.shape == sel8.shape and sel16.shape[0] == len(ids) - topk

    # each selection against a float64 NumPy top-k of its own keys
    for q, w, k, sel in ((q16, w16, k16, sel16), (q8, w8, k8, sel8)):
        sc, tol = index_scores64(q[None], w[None], k[None], off)
        rep = selection_report(sel[None], sc, tol, topk)
        assert rep["bad_rows"] == 0 and rep["worst"] <= 1.0, rep

    # the 8-bit keys the indexer read: BF16 keys within the bound from the stored scales
    dsa = next(c for c in cache if isinstance(c, DSACache))
    n = dsa.offset
    qi = tuple(a[..., :n, :] for a in (dsa.index_keys, dsa.index_scales, dsa.index_biases))
    err = np.asarray(dequantize_error_bound(qi, 8))[0, 0]
    # what the indexer read is the stored bytes times scale plus bias (NumPy, float64)
    packed = np.asarray(qi[0])[0, 0].view(np.uint8).astype(np.float64)  # little-endian bytes
    sc = np.repeat(np.asarray(qi[1].astype(mx.float32))[0, 0], k8.shape[-1] // qi[1].shape[-1], -1)
    bi = np.repeat(np.asarray(qi[2].astype(mx.float32))[0, 0], k8.shape[-1] // qi[2].shape[-1], -1)
    assert np.allclose(packed * sc + bi, k8, rtol=1e-6, atol=1e-6 * np.abs(bi).max())
    assert np.all(np.abs(k8 - k16) <= err)

    scores, bound, _ = score_bounds(q16, w16, k16, err, off)
    equal, tie = classify_topk(sel16, sel8, scores, bound)
    assert not equal.all(), "no pair differs: the check below would hold trivially"
    outside = np.flatnonzero(~equal & ~tie)
    assert outside.size == 0, f"queries {outside[:10].tolist()} differ beyond the bound"
    # micro's 64th and 65th scores are closer (median 0.06) than the bound (median 4), so
    # the rule above cannot tell formats apart; the overlap of the sets can: 8-bit keeps
    # 99.3% here, 4-bit index keys (not a --kv-bits option) keep 95.5%
    overlap = np.mean([len(np.intersect1d(a, b)) for a, b in zip(sel16, sel8)]) / topk
    assert overlap >= 0.98, overlap


def test_default_group_is_the_one_within_the_byte_target():
    """The flags, the model, the cache and the planner share one default group, and at it
    K3.1's DSA layer keeps 788 B a token by hand (512 latent bytes + 4 groups x a BF16
    scale and bias, 64 BF16 rope values, 128 index bytes + 1 group's scale and bias):
    within 0.56x of BF16's 1,408 B, which group 64 (808 B) is not."""
    import argparse

    from kimi_mlx.generation.kv_args import add_kv_arguments, kv_quant
    from kimi_mlx.model.model import Model
    from kimi_mlx.placement.layer_bytes import KV_CACHE_DEFAULT_GROUP, kv_token_bytes

    p = argparse.ArgumentParser()
    add_kv_arguments(p)
    args = p.parse_args(["--kv-bits", "8"])
    assert kv_quant(args) == (8, KV_DEFAULT_GROUP) == (8, KV_CACHE_DEFAULT_GROUP)
    assert Model.kv_group_size == KV_DEFAULT_GROUP == DSACache(8).kv_group_size
    hand = 512 + 2 * (512 // 128) * 2 + 64 * 2 + 128 + 2 * 1 * 2
    got = kv_token_bytes(512, 2, 8) + 64 * 2 + kv_token_bytes(128, 2, 8)
    assert got == hand == 788 and hand / 1408 <= 0.56
    assert kv_token_bytes(512, 2, 8, 64) + 128 + kv_token_bytes(128, 2, 8, 64) == 808 > 0.56 * 1408
