"""8-bit Gated DSA caches (`--kv-bits 8`, kimi_mlx/model/cache.py) in every place a cache
goes: the format against a NumPy unpacking, one process against the model-dtype cache,
batched rows against their single runs, prompt-cache snapshots on disk, and rollback of
a rejected draft against a fresh prefill of the kept tokens.

References are independent of the code under test: NumPy for the packed format (the
affine rule q * scale + bias, read from the raw uint32 words), the same model with the
model-dtype cache for quality, single-sequence runs for batches, and a plain prefill
for rollback. The micro checkpoint runs with its sparse path active (index_topk 64,
prompts past it).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import _merge_caches

from kimi_mlx.model.cache import (AUX_QUANT, KV_DEFAULT_GROUP, DSACache, check_kv_quant, restore, snapshot,
                                  snapshot_kv_quant, snapshot_nbytes)
from kimi_mlx.testing.checkpoints import model_tolerance, rel_err

MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"


@pytest.fixture(scope="module")
def micro():
    """Our own micro model (its cache format is changed per test; the session's shared
    model is never touched)."""
    from kimi_mlx.checkpoint.loader import load_model

    if not MICRO.exists():
        pytest.skip("no shipped micro checkpoint")
    model, _, _ = load_model(MICRO, verbose=False)
    yield model
    model.set_kv_quant(None)


def _text_prompts(n: int, length: int, seed: int = 0):
    """n token windows of `length` from the held-out prose (natural text)."""
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(MICRO)
    ids = tok.encode((MICRO / "heldout" / "prose.txt").read_text()[:60000])
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - length, n)
    return [list(ids[s : s + length]) for s in starts]


# ------------------------------------------------------------------ the format, by NumPy

def _np_dequant(packed, scales, biases, bits=8):
    """NumPy: uint32 words [.., W] -> values [.., W*32/bits] by the affine rule, the
    element j of a word in bits [bits*j, bits*(j+1)) (little end first)."""
    w = np.asarray(packed, dtype=np.uint32)
    per = 32 // bits
    q = (w[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
    q = q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.float64)
    s = np.asarray(scales.astype(mx.float32), dtype=np.float64)
    b = np.asarray(biases.astype(mx.float32), dtype=np.float64)
    g = q.shape[-1] // s.shape[-1]
    qs, b = q * np.repeat(s, g, axis=-1), np.repeat(b, g, axis=-1)
    return qs + b, np.repeat(s, g, axis=-1), np.abs(qs) + np.abs(b)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_format_is_affine_8bit_with_group_scales(group):
    """K3.1's sizes: latent 512 and index key 128 packed 4 values per uint32 word, one
    scale and bias per `group` values in the cache dtype, the rope part untouched; what the
    cache reads back is the NumPy dequantization of its own words, within a step of what
    was written; bytes per token as counted by hand."""
    rng = np.random.default_rng(group)
    T = 7
    lat = mx.array(rng.normal(size=(1, 1, T, 512)).astype(np.float32)).astype(mx.bfloat16)
    pe = mx.array(rng.normal(size=(1, 1, T, 64)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(rng.normal(size=(1, 1, T, 128)).astype(np.float32)).astype(mx.bfloat16)
    c = DSACache(8, group)
    c.update_and_fetch_all(lat[:, :, :3], pe[:, :, :3], idx[:, :, :3])
    got_lat, got_pe, got_idx = c.update_and_fetch_all(lat[:, :, 3:], pe[:, :, 3:], idx[:, :, 3:])
    q = c.quantized()
    assert q.latent[0].dtype == mx.uint32 and q.latent[0].shape == (1, 1, T, 128)
    assert q.latent[1].shape == (1, 1, T, 512 // group) and q.latent[1].dtype == mx.bfloat16
    assert q.index[0].shape == (1, 1, T, 32) and q.index[2].shape == (1, 1, T, 128 // group)
    assert np.array_equal(np.asarray(got_pe.astype(mx.float32)), np.asarray(pe.astype(mx.float32)))
    for (packed, s, b), read, orig in ((q.latent, got_lat, lat), (q.index, got_idx, idx)):
        ref, step, size = _np_dequant(packed, s, b)
        read = np.asarray(read.astype(mx.float32), dtype=np.float64)
        # q*s+b in bf16: two roundings (the product, the sum), each half a bf16 step
        assert np.all(np.abs(read - ref) <= 2 ** -8 * (size + np.abs(ref)) + 1e-6)
        orig = np.asarray(orig.astype(mx.float32), dtype=np.float64)
        # half a step of rounding, plus the bf16 rounding of the scale and the bias
        # themselves (up to 255 x 2^-9 of a step, half a bf16 step of the bias) and of
        # the value written
        bias = np.abs(np.asarray(b.astype(mx.float32), dtype=np.float64))
        bias = np.repeat(bias, orig.shape[-1] // bias.shape[-1], axis=-1)
        bound = np.abs(step) * (0.5 + 255 * 2 ** -9) + 2 ** -8 * (bias + np.abs(orig)) + 1e-4
        assert np.all(np.abs(ref - orig) <= bound)
    # bytes per token: 512 + 128 packed bytes, 2 x bf16 scale/bias per group, 64 x bf16 rope
    want = 512 + 128 + 2 * 2 * (512 // group + 128 // group) + 64 * 2
    assert sum(a.nbytes for a in (q.latent + q.index + (q.k_pe,))) == want * T
    assert want / ((512 + 64 + 128) * 2) <= {32: 0.603, 64: 0.574, 128: 0.5597}[group]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--kv-bits 4"):
        check_kv_quant(4)
    with pytest.raises(ValueError, match="--kv-group-size 48"):
        check_kv_quant(8, 48)


# ------------------------------------------------------------------ one process

def _greedy(model, prompt, steps):
    """(tokens, logits [steps, vocab] float32) of a plain prefill and greedy decode."""
    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache)[0, -1]
    toks, rows = [], []
    for _ in range(steps):
        rows.append(logits.astype(mx.float32))
        toks.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[toks[-1]]]), cache)[0, -1]
    return toks, np.stack([np.asarray(r) for r in rows]), cache


def test_one_process_follows_the_model_dtype_cache(micro):
    """Held-out text past index_topk, decoded on the model-dtype cache's greedy tokens:
    the 8-bit cache's logits are within 6% of the model-dtype ones (max error / max
    |logit|; measured 4.2% on micro, whose 64-value latent is one group per token) and
    1% on average, it picks the same greedy token wherever the model-dtype cache's top
    two logits are more than 0.1 apart (a near tie may go either way), and the caches
    hold the 8-bit arrays."""
    for p in _text_prompts(3, 200):
        micro.set_kv_quant(None)
        ref_toks, ref, _ = _greedy(micro, p, 12)
        micro.set_kv_quant(8)
        got = _single_logits(micro, p, ref_toks[:-1])
        cache = micro.make_cache()
        micro(mx.array(p)[None], cache)
        dsa = [c for c in cache if isinstance(c, DSACache)]
        assert dsa and all(c.keys.dtype == mx.uint32 and c.index_keys.dtype == mx.uint32
                           for c in dsa)
        assert rel_err(got, ref) < 0.06
        assert np.abs(got - ref).mean() < 0.01 * np.abs(ref).mean()
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 0.1
        assert clear.sum() >= 6
        assert (got.argmax(-1)[clear] == np.array(ref_toks)[clear]).all()


# ------------------------------------------------------------------ batched rows

LENGTHS = [30, 90, 70, 130]  # index_topk 64: dense and sparse rows, crossing over


def _single_logits(model, prompt, tokens):
    cache = model.make_cache()
    out = [model(mx.array(prompt)[None], cache)[0, -1]]
    for t in tokens:
        out.append(model(mx.array([[t]]), cache)[0, -1])
    return np.stack([np.asarray(o.astype(mx.float32)) for o in out])


@pytest.mark.parametrize("padding", ["left", "right"])
def test_batched_rows_equal_single_runs(micro, padding):
    """8-bit caches batched by mlx-lm's operations (merge: left padding; prepare /
    finalize: right-padded prefill; then filter, extend and extract) give every row what
    its single run gives, within the float tolerance rule."""
    micro.set_kv_quant(8)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 4000, L).tolist() for L in LENGTHS]
    steps = [rng.integers(10, 4000, 3).tolist() for _ in prompts]
    tol = model_tolerance(micro.args, max(LENGTHS) + 4)
    refs = [_single_logits(micro, p, s) for p, s in zip(prompts, steps)]

    def batch_of(rows):
        ps = [prompts[i] for i in rows]
        if padding == "left":
            singles = []
            for p in ps:
                c = micro.make_cache()
                micro(mx.array(p[:-1])[None], c)
                singles.append(c)
            return _merge_caches(singles)
        cache = _merge_caches([micro.make_cache() for _ in ps])
        lengths = [len(p) - 1 for p in ps]
        n = max(lengths)
        for c in cache:
            c.prepare(lengths=lengths, right_padding=[n - k for k in lengths])
        micro(mx.array([p[:-1] + [0] * (n + 1 - len(p)) for p in ps]), cache)
        for c in cache:
            c.finalize()
        return cache

    rows = [0, 1, 2]
    cache = batch_of(rows)
    out = {r: [] for r in range(4)}
    lo = micro(mx.array([[prompts[r][-1]] for r in rows]), cache)[:, -1]
    for j, r in enumerate(rows):
        out[r].append(lo[j])
    # row 1 leaves, row 3 joins (filter, then extend with its own batch)
    for c in cache:
        c.filter([0, 2])
    rows = [0, 2]
    late = batch_of([3])
    lo3 = micro(mx.array([[prompts[3][-1]]]), late)[:, -1]
    out[3].append(lo3[0])
    # catch row 3 up to the others' step count before joining
    for c, o in zip(cache, late):
        c.extend(o)
    rows = [0, 2, 3]
    for t in range(3):
        lo = micro(mx.array([[steps[r][t]] for r in rows]), cache)[:, -1]
        for j, r in enumerate(rows):
            out[r].append(lo[j])
    for r in rows:
        got = np.stack([np.asarray(o.astype(mx.float32)) for o in out[r]])
        assert rel_err(got, refs[r][: len(got)]) < tol, (padding, r)
    # extract: a row's own 8-bit cache, which decodes on as its single run does
    ex = [c.extract(1) for c in cache]
    dsa = [c for c in ex if isinstance(c, DSACache)]
    assert all(c.kv_bits == 8 and c.offset == LENGTHS[2] + 3 for c in dsa)
    got = micro(mx.array([[5]]), ex)[0, -1]
    single = micro.make_cache()
    micro(mx.array(prompts[2] + steps[2])[None], single)
    want = micro(mx.array([[5]]), single)[0, -1]
    assert rel_err(got, want) < tol


def test_merging_formats_is_refused(micro):
    a, b = DSACache(8), DSACache(None)
    x = mx.zeros((1, 1, 2, 64))
    a.update_and_fetch_all(x, x[..., :16], x[..., :32])
    b.update_and_fetch_all(x, x[..., :16], x[..., :32])
    with pytest.raises(ValueError, match="kv_bits"):
        DSACache.merge([a, b])


# ------------------------------------------------------------------ snapshots

def test_disk_snapshot_round_trip_and_identity(micro, tmp_path):
    """An 8-bit snapshot written to disk and read back decodes exactly as the cache it
    was taken from; a model-dtype server's fingerprint names another folder (the 8-bit
    file is never offered to it), a restore across formats raises, and a file of the
    previous format version is ignored and counted."""
    from kimi_mlx.server import disk_cache
    from kimi_mlx.server.disk_cache import DiskSnapshotStore, token_key
    from kimi_mlx.server.serving import model_cache_fingerprint

    micro.set_kv_quant(8)
    p = _text_prompts(1, 120, seed=5)[0]
    cache = micro.make_cache()
    micro(mx.array(p)[None], cache)
    snap = snapshot(cache)
    assert snapshot_kv_quant(snap) == (8, KV_DEFAULT_GROUP)
    fp8 = model_cache_fingerprint(MICRO, micro)
    store = DiskSnapshotStore(tmp_path, 1 << 30, fp8)
    store.put(token_key(p), len(p), snap, snapshot_nbytes(snap))
    store.flush()
    store.close()
    store = DiskSnapshotStore(tmp_path, 1 << 30, fp8)
    back = store.get(token_key(p), len(p))
    assert back is not None and snapshot_kv_quant(back) == (8, KV_DEFAULT_GROUP)
    for (k1, s1), (k2, s2) in zip(snap, back):
        if k1 == "dsa":
            assert np.array_equal(np.asarray(s1[0]), np.asarray(s2[0]))  # packed words
            for a1, a2 in zip(s1[4][:4], s2[4][:4]):
                assert np.array_equal(np.asarray(a1.astype(mx.float32)),
                                      np.asarray(a2.astype(mx.float32)))
    want = micro(mx.array([[7]]), cache)[0, -1]
    got = micro(mx.array([[7]]), restore(back, 8, KV_DEFAULT_GROUP))[0, -1]
    assert np.array_equal(np.asarray(got), np.asarray(want))
    store.close()
    with pytest.raises(ValueError, match="kv_bits=8"):
        restore(back, None)

    micro.set_kv_quant(None)
    fp16 = model_cache_fingerprint(MICRO, micro)
    assert fp16 != fp8
    other = DiskSnapshotStore(tmp_path, 1 << 30, fp16)
    assert other.dir != store.dir and other.get(token_key(p), len(p)) is None
    assert other.ignored_foreign >= 1  # the 8-bit folder's file, counted, never read
    other.close()

    # a file written under the previous format version: its folder is never read
    old_root = tmp_path / "old"
    version = disk_cache.FORMAT_VERSION
    try:
        disk_cache.FORMAT_VERSION = version - 1
        old = DiskSnapshotStore(old_root, 1 << 30, fp8)
        old.put(token_key(p), len(p), snap, snapshot_nbytes(snap))
        old.flush()
        old.close()
    finally:
        disk_cache.FORMAT_VERSION = version
    new = DiskSnapshotStore(old_root, 1 << 30, fp8)
    assert new.get(token_key(p), len(p)) is None and new.ignored_foreign >= 1
    new.close()


# ------------------------------------------------------------------ rollback

def test_rollback_after_rejected_draft_equals_fresh_prefill(micro):
    """One sequence and a batch of two: verify 5 drafted tokens, keep 2 (and 4 in the
    second row), roll back; the next decode step's logits equal those of a fresh
    prefill of the kept tokens (8-bit caches on both sides)."""
    from kimi_mlx.speculative.rollback import begin_verify, end_verify, rollback, rollback_rows

    micro.set_kv_quant(8)
    rng = np.random.default_rng(9)
    p = rng.integers(10, 4000, 100).tolist()
    draft = rng.integers(10, 4000, 5).tolist()
    tol = model_tolerance(micro.args, 110)

    def fresh(tokens, nxt):
        c = micro.make_cache()
        micro(mx.array(tokens)[None], c)
        return micro(mx.array([[nxt]]), c)[0, -1]

    cache = micro.make_cache()
    micro(mx.array(p)[None], cache)
    v = begin_verify(cache)
    micro(mx.array(draft)[None], cache)
    rollback(cache, v, 2)
    end_verify(cache)
    got = micro(mx.array([[11]]), cache)[0, -1]
    assert rel_err(got, fresh(p + draft[:2], 11)) < tol

    q = rng.integers(10, 4000, 80).tolist()
    singles = []
    for pr in (p, q):
        c = micro.make_cache()
        micro(mx.array(pr)[None], c)
        singles.append(c)
    batch = _merge_caches(singles)
    v = begin_verify(batch)
    micro(mx.array([draft, draft]), batch)
    rollback_rows(batch, v, [2, 4])
    end_verify(batch)
    got = micro(mx.array([[11], [11]]), batch)[:, -1]
    assert rel_err(got[0], fresh(p + draft[:2], 11)) < tol
    assert rel_err(got[1], fresh(q + draft[:4], 11)) < tol
    assert all(c.kv_bits == 8 for c in batch if hasattr(c, "kv_bits"))
    assert all(getattr(c, a).shape[2] == c.keys.shape[2] for c in batch
               if hasattr(c, "kv_bits") for a in AUX_QUANT)
