"""The Gated DSA layer reads an 8-bit cache (`--kv-bits 8`) packed past index_topk: the
indexer scores the quantized index keys and only the selected latent rows are
dequantized (kimi_mlx/model/dsa.py through metal/dsa.py's quantized ops).

Reference: the path it replaces, every latent row and index key dequantized on every call
and then the model-dtype path (`kimi_mlx.testing.dsa_reference.dequantize_everything`),
on the same cache contents. A float32 conditioned tiny model (index_topk 8, prompts past
it, a 32-value index key in one group and a 64-value latent in two), so both
sides dequantize to the same float32 values and the project's tolerance rule applies;
the indexer's choices are compared as sets where the reference's top-k margin is clear.
Deployments: one process (chunked prefill + decode), left-padded batched rows, a pipeline
stage pair (layer ranges with the hop's Banks round trip), and the `_q` kernels in the
Metal emulator (race checker on).
"""

from __future__ import annotations

import contextlib
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import _merge_caches

from kimi_mlx.metal import dsa as dsa_ops
from kimi_mlx.metal.dispatch import use_sim
from kimi_mlx.model import cache as cache_mod
from kimi_mlx.model import dsa as dsa_mod
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.testing.checkpoints import (full_config, model_tolerance, random_model, rel_err,
                                          tiny_text_config, tolerance)
from kimi_mlx.testing.dsa_reference import dequantize_everything

TOPK = 8


@pytest.fixture(scope="module")
def tiny():
    """A conditioned float32 tiny K3.1 (2 Gated DSA layers of 6) with an 8-bit cache."""
    cfg = tiny_text_config(kv_lora_rank=64,
                           dsa_config={"index_n_heads": 2, "index_head_dim": 32,
                                       "index_topk": TOPK})
    args = ModelArgs.from_config(full_config(cfg))
    model = random_model(args, seed=5, conditioned=True)
    model.set_kv_quant(8, 32)
    return model


def _tokens(n, seed=0, rows=1):
    return mx.array(np.random.default_rng(seed).integers(0, 256, (rows, n)))


def _run(model, tokens, prefill, chunk=7):
    """Chunked prefill of tokens[:, :prefill], then one decode step per remaining token:
    the logits of every position [B, T, V] and the cache."""
    cache = model.make_cache()
    outs = [model(tokens[:, s : min(s + chunk, prefill)], cache) for s in range(0, prefill, chunk)]
    for t in range(prefill, tokens.shape[1]):
        outs.append(model(tokens[:, t : t + 1], cache))
    return mx.concatenate(outs, axis=1), cache


class _Selections:
    """Records what `dsa_prefill_indices` (the model's call site) is given and returns."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = dsa_mod.dsa_prefill_indices

        def record(q_idx, w, k_idx, k, offset, starts=None):
            idx = real(q_idx, w, k_idx, k, offset, starts=starts)
            self.calls.append((q_idx, w, k_idx, offset, starts, np.array(idx)))
            return idx

        monkeypatch.setattr(dsa_mod, "dsa_prefill_indices", record)


def _assert_same_sets(got, ref, kinds):
    """Each query's selected set is the reference's where the reference's K-th and
    (K+1)-th scores are more than the tolerance rule apart; `kinds` checks that one side
    read packed keys and the other float arrays."""
    assert len(got.calls) == len(ref.calls) > 0
    clear = 0
    for g, r in zip(got.calls, ref.calls):
        assert isinstance(g[2], tuple) == kinds[0] and isinstance(r[2], tuple) == kinds[1]
        q_idx, w, k_idx, offset, starts, want = r
        scores = np.array(dsa_ops.dsa_index_scores(q_idx, w, k_idx, offset, starts))
        finite = np.abs(scores[np.isfinite(scores)])
        tol = tolerance(1, q_idx.shape[-2] * q_idx.shape[-1]) * finite.max()
        for b in range(scores.shape[0]):
            for l in range(scores.shape[1]):
                row = np.sort(scores[b, l][np.isfinite(scores[b, l])])[::-1]
                if len(row) <= TOPK or row[TOPK - 1] - row[TOPK] <= tol:
                    continue
                mine, theirs = g[5][b, l], want[b, l]
                assert set(mine[mine >= 0]) == set(theirs[theirs >= 0]), (b, l, offset)
                clear += 1
    assert clear > 0


def test_one_process_equals_dequantizing_everything(tiny, monkeypatch):
    """Chunked prefill past index_topk and 6 decode steps: the packed read's logits and the
    8-bit cache afterwards equal the dequantize-everything path's within the tolerance rule,
    with the same indexer choices wherever their margin is clear."""
    tokens = _tokens(30, seed=1)
    with monkeypatch.context() as mp:
        got_sel = _Selections(mp)
        got, cache = _run(tiny, tokens, 24)
    with monkeypatch.context() as mp:
        ref_sel = _Selections(mp)
        with dequantize_everything():
            ref, ref_cache = _run(tiny, tokens, 24)
    tol = model_tolerance(tiny.args, 30)
    assert rel_err(got, ref) < tol
    _assert_same_sets(got_sel, ref_sel, (True, False))
    for c, r in zip(cache, ref_cache):
        if isinstance(c, cache_mod.DSACache):
            assert c.keys.dtype == mx.uint32 and c.offset == r.offset == 30
            assert rel_err(cache_mod.dequantize(c.quantized().latent, 8),
                           cache_mod.dequantize(r.quantized().latent, 8)) < tol


def test_only_selected_latent_rows_are_dequantized(tiny, monkeypatch):
    """Past index_topk nothing dequantizes the whole latent: the model-dtype fetch
    (`update_and_fetch_all`, the cache module's `dequantize`) is never used, and every
    latent-width dequantization covers at most (queries x index_topk) rows."""
    R = tiny.args.kv_lora_rank
    rows = []
    real_rows = dsa_ops.dequantize_rows

    def counting(parts, group_size, bits):
        out = real_rows(parts, group_size, bits)
        if out.shape[-1] == R:
            rows.append(int(np.prod(out.shape[:-1])))
        return out

    def refuse(*a, **k):
        raise AssertionError("a whole 8-bit cache was dequantized")

    tokens = _tokens(20, seed=2)
    cache = tiny.make_cache()
    tiny(tokens[:, :TOPK], cache)  # within index_topk: dense (the whole <= 8 rows)
    monkeypatch.setattr(dsa_ops, "dequantize_rows", counting)
    monkeypatch.setattr(dsa_mod, "dequantize", refuse)
    monkeypatch.setattr(cache_mod, "dequantize", refuse)
    mx.eval(tiny(tokens[:, TOPK:16], cache))  # sparse prefill: 8 queries
    assert rows and max(rows) <= 8 * TOPK
    rows.clear()
    for t in range(16, 20):
        mx.eval(tiny(tokens[:, t : t + 1], cache))  # sparse decode
    assert rows and max(rows) == TOPK


@pytest.mark.parametrize("emulated", [False, True], ids=["reference", "emulator"])
def test_batched_rows_equal_dequantizing_everything(tiny, monkeypatch, emulated):
    """Left-padded rows of different lengths (mlx-lm's merge of single caches), decoded
    together past index_topk: the packed read equals the dequantize-everything path
    within the tolerance rule, with the reference ops and with the `_q` kernels in the
    Metal emulator (race checker on; the reference then runs the model-dtype kernels
    there too: an upstream KDA kernel's last-bit difference can move a cached value to
    the neighbouring 8-bit level, so both sides must run the same upstream ops)."""
    from kimi_mlx.metal import kernels

    calls = {n: 0 for n in ("dsa_index_topk_q", "sparse_mla_partial_q", "sparse_mla_combine_q")}
    for name in calls:
        real = kernels.KERNELS[name]

        def counting(_real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(**kw)

        monkeypatch.setitem(kernels.KERNELS, name, counting)
    lengths = [11, 20, 15]
    tokens = [_tokens(n + 4, seed=10 + n)[0] for n in lengths]

    def run():
        singles = []
        for t, n in zip(tokens, lengths):
            c = tiny.make_cache()
            tiny(t[None, :n], c)
            singles.append(c)
        cache = _merge_caches(singles)
        outs = [tiny(mx.stack([t[n + s : n + s + 1] for t, n in zip(tokens, lengths)]), cache)
                for s in range(4)]
        return mx.concatenate(outs, axis=1)

    with use_sim() if emulated else contextlib.nullcontext():
        got = run()
        used = dict(calls)
        with dequantize_everything():
            ref = run()
    assert rel_err(got, ref) < model_tolerance(tiny.args, max(lengths) + 4)
    assert all(used.values()) if emulated else not any(used.values()), used
    assert calls == used  # the reference path never reads the cache packed


def test_pipeline_stages_equal_dequantizing_everything(tiny):
    """Two stages (layers [0, 3) and [3, 6), a Gated DSA layer in each, 8-bit caches of
    their own) with the hop's Banks round trip: the packed read equals the
    dequantize-everything path through the same stages within the tolerance rule."""
    from kimi_mlx.model.attn_res import Banks
    from kimi_mlx.model.model import Model

    args = tiny.args
    weights = dict(tree_flatten(tiny.parameters()))
    stages = []
    for start, end in [(0, 3), (3, args.num_hidden_layers)]:
        m = Model(args, start, end)
        if any(k.endswith(".scales") for k in weights):
            nn.quantize(m, group_size=32, bits=4, mode="mxfp4",
                        class_predicate=lambda p, _: f"{p}.scales" in weights)
        own = {k for k, _ in tree_flatten(m.parameters())}
        m.load_weights([(k, v) for k, v in weights.items() if k in own], strict=True)
        m.set_kv_quant(8, 32)
        stages.append(m)
    tokens = _tokens(18, seed=4)

    def run():
        caches = [m.make_cache() for m in stages]
        outs = []
        for s, e in [(0, 13)] + [(t, t + 1) for t in range(13, 18)]:
            h = stages[0].text.embed_tokens(tokens[:, s:e])
            banks = Banks(args.rms_norm_eps)
            for m, c in zip(stages, caches):
                h, banks = m.text.run_layers(h, banks, c)
                banks = Banks.from_stacked(banks.stack(), args.rms_norm_eps)
            outs.append(stages[-1].language_model.logits(stages[-1].text.finish(h, banks)))
        return mx.concatenate(outs, axis=1)

    got = run()
    with dequantize_everything():
        ref = run()
    tol = model_tolerance(args, 18)
    assert rel_err(got, ref) < tol
    assert rel_err(got, _run(tiny, tokens, 13, chunk=13)[0]) < tol  # = one process


def test_quantized_triples_reach_the_quantized_ops(monkeypatch):
    """metal/dsa.py's model-facing calls read a quantized triple's format from its shapes
    (a 32-value index key in one group, a 64-value latent in groups of 32) and agree with
    the explicit `_quantized` entry points; a triple no format gives is a clear error."""
    ks = mx.random.split(mx.random.key(0), 6)
    B, S, L, Hi, Di, R, P, H = 2, 20, 3, 2, 32, 64, 8, 2
    kq = mx.quantize(mx.random.normal((B, S, Di), key=ks[0]), group_size=32, bits=8)
    lq = mx.quantize(mx.random.normal((B, 1, S, R), key=ks[1]), group_size=32, bits=8)
    k_pe = mx.random.normal((B, 1, S, P), key=ks[2])
    q_idx = mx.random.normal((B, L, Hi, Di), key=ks[3])
    w = mx.random.uniform(0.1, 1, (B, L, Hi), key=ks[4])
    q_lat = mx.random.normal((B, H, L, R), key=ks[5])
    q_pe = mx.zeros((B, H, L, P))
    idx = dsa_ops.dsa_prefill_indices(q_idx, w, kq, 5, S - L)
    want = dsa_ops.dsa_prefill_indices_quantized(q_idx, w, kq, 5, S - L, group_size=32)
    assert np.array_equal(np.sort(np.array(idx), -1), np.sort(np.array(want), -1))
    rows = tuple(p[:, 0] for p in lq)
    assert np.array_equal(
        np.array(dsa_ops.sparse_mla_attend(q_lat, q_pe, rows, k_pe[:, 0], idx, 0.3)),
        np.array(dsa_ops.sparse_mla_attend_quantized(q_lat, q_pe, rows, k_pe[:, 0], idx, 0.3,
                                                     group_size=32)))
    one = (q_lat[:, :, :1], q_pe[:, :, :1])
    got = dsa_ops.dsa_sparse_decode(*one, lq, k_pe, 0.3, q_idx[:, :1], w[:, :1], kq, 5, S - 1)
    ref = dsa_ops.dsa_sparse_decode_quantized(*one, lq, k_pe, 0.3, q_idx[:, :1], w[:, :1], kq,
                                              5, S - 1, group_size=32)
    assert np.array_equal(np.array(got), np.array(ref))
    with pytest.raises(ValueError, match="index keys: 6 packed words"):
        dsa_ops.dsa_prefill_indices(q_idx, w, (kq[0][..., :6], kq[1], kq[2]), 5, S - L)


def test_margins_read_the_packed_index_keys(tiny):
    """`margins()` (kimi_mlx.testing.checkpoints) records the indexer's margins of a model
    reading its 8-bit cache packed: the same margins as on the dequantize-everything
    path, whose index keys are the same values unpacked."""
    from kimi_mlx.testing.checkpoints import margins

    tokens = _tokens(14, seed=7)
    found = []
    for ctx in (contextlib.nullcontext, dequantize_everything):
        with margins() as m, ctx():
            cache = tiny.make_cache()
            tiny(tokens[:, :10], cache)
            tiny(tokens[:, 10:11], cache)
        found.append(np.concatenate([np.array(a) for a in m.indexer]))
    assert found[0].shape[0] > 0 and np.all(np.isfinite(found[0]))
    np.testing.assert_allclose(found[0], found[1], rtol=1e-5, atol=1e-6)
