"""Model correctness against independent references.

- mlx-lm's `kimi_k3` (K3 = K3.1 without the indexer) on the same weights, with
  index_topk >= sequence length so Gated DSA is exactly gated MLA.
- A NumPy float64 re-derivation of one Gated DSA layer with a short index_topk.
- Hand-computed values from K31_SPEC.md section 6 (SiTU, KDA gate).

Every comparison runs on a conditioned model (`random_model(conditioned=True)`), within
`kimi_mlx.testing.checkpoints.tolerance` (derived from float32 rounding), and checks that the expert
and indexer top-k choices it crosses have margins above that tolerance.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.dsa import DSACache, GatedDSA
from kimi_mlx.model.ffn import situ
from kimi_mlx.metal.kda import kda_gate
from kimi_mlx.model.model import Model
from kimi_mlx.testing.checkpoints import (
    checkpoint_tensors, full_config, margins, model_tolerance, random_model, rel_err,
    tiny_text_config, tolerance)


def _load(model, files):
    w = model.sanitize(dict(files))
    nn.quantize(
        model, group_size=32, bits=4, mode="mxfp4",
        class_predicate=lambda p, m: f"{p}.scales" in w,
    )
    model.load_weights(list(w.items()), strict=True)
    return model


@pytest.fixture(scope="module")
def pair():
    """(ours, mlx-lm kimi_k3) loaded from the same official-layout float32 tensors."""
    text = tiny_text_config(
        dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 4096}
    )
    cfg = full_config(text)
    args = ModelArgs.from_config(cfg)
    files = checkpoint_tensors(random_model(args, seed=0, conditioned=True), args, mx.float32)
    ours = _load(Model(args), files)
    kcfg = copy.deepcopy(cfg)
    kcfg["model_type"] = "kimi_k3"
    ref = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(kcfg))
    ref_files = ref.sanitize({k: v for k, v in files.items() if ".indexer." not in k})
    nn.quantize(
        ref, group_size=32, bits=4, mode="mxfp4",
        class_predicate=lambda p, m: f"{p}.scales" in ref_files,
    )
    ref.load_weights(list(ref_files.items()), strict=True)
    return ours, ref


_rel = rel_err


def test_prefill_and_16_decode_steps_match_mlx_lm_kimi_k3(pair):
    ours, ref = pair
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 24)))
    tol = model_tolerance(ours.args, 24 + 16)
    with margins() as m:
        assert _rel(ours(tokens), ref(tokens)) < tol
        c_ours, c_ref = ours.make_cache(), ref.make_cache()
        a, b = ours(tokens, c_ours), ref(tokens, c_ref)
        assert _rel(a, b) < tol
        for _ in range(16):
            nxt = mx.argmax(b[:, -1:], axis=-1)
            a, b = ours(nxt, c_ours), ref(nxt, c_ref)
            assert _rel(a, b) < tol
    m.check(tol)


def test_the_tolerance_catches_a_small_planted_error(pair):
    """A 0.1% error in one layer's attention scale is far outside the tolerance."""
    ours, ref = pair
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 24)))
    attn = ours.layers[2].self_attn
    assert isinstance(attn, GatedDSA)
    good = attn.scale
    attn.scale = good * 1.001
    try:
        err = _rel(ours(tokens), ref(tokens))
    finally:
        attn.scale = good
    assert err > 3 * model_tolerance(ours.args, 24)


def test_layer_range_models_compose_to_the_full_model(pair):
    ours, _ = pair
    args = ours.args
    weights = dict(tree_flatten(ours.parameters()))
    tokens = mx.array([[5, 17, 99, 3, 250, 42, 7]])
    stages = []
    for start, end in [(0, 2), (2, 5), (5, args.num_hidden_layers)]:
        m = Model(args, start, end)
        nn.quantize(m, group_size=32, bits=4, mode="mxfp4",
                    class_predicate=lambda p, _: f"{p}.scales" in weights)
        own = {k for k, _ in tree_flatten(m.parameters())}
        m.load_weights([(k, v) for k, v in weights.items() if k in own], strict=True)
        stages.append(m)
    h = stages[0].text.embed_tokens(tokens)
    banks = Banks(args.rms_norm_eps)
    for m in stages:
        h, banks = m.text.run_layers(h, banks)
        banks = Banks.from_stacked(banks.stack(), args.rms_norm_eps)  # as after a hop
    logits = stages[-1].language_model.logits(stages[-1].text.finish(h, banks))
    with margins() as m:
        assert _rel(logits, ours(tokens)) < model_tolerance(args, tokens.shape[1])
    m.check(model_tolerance(args, tokens.shape[1]))
    assert not hasattr(stages[1].text, "embed_tokens") and not hasattr(stages[1].text, "norm")


def _np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_dsa(layer: GatedDSA, x: np.ndarray, topk: int) -> np.ndarray:
    """Straightforward Gated DSA: full scores, keep the indexer's top-k, softmax."""
    P = {k: np.array(v.astype(mx.float32), dtype=np.float64) for k, v in tree_flatten(layer.parameters())}
    T = x.shape[0]
    H, nope, rope, vd, r = layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.kv_rank
    qr = _np_rms(x @ P["q_a_proj.weight"].T, P["q_a_layernorm.weight"], 1e-6)
    q = (qr @ P["q_b_proj.weight"].T).reshape(T, H, nope + rope)
    ckv = x @ P["kv_a_proj_with_mqa.weight"].T
    c = _np_rms(ckv[:, :r], P["kv_a_layernorm.weight"], 1e-6)
    kpe = ckv[:, r:]
    kvb = (c @ P["kv_b_proj.weight"].T).reshape(T, H, nope + vd)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    # indexer
    qi = (qr @ P["indexer.wq_b.weight"].T).reshape(T, layer.indexer.n_heads, -1)
    ki = x @ P["indexer.wk.weight"].T
    mu, var = ki.mean(-1, keepdims=True), ki.var(-1, keepdims=True)
    ki = (ki - mu) / np.sqrt(var + 1e-5) * P["indexer.k_norm.weight"] + P["indexer.k_norm.bias"]
    hw = x @ P["indexer.weights_proj.weight"].T
    out = np.zeros((T, H, vd))
    scale = (nope + rope) ** -0.5
    for t in range(T):
        I = np.array([(hw[t] * np.maximum(qi[t] @ ki[s], 0)).sum() for s in range(t + 1)])
        keep = np.argsort(-I, kind="stable")[: min(topk, t + 1)]
        for h in range(H):
            s = scale * (k_nope[keep, h] @ q[t, h, :nope] + kpe[keep] @ q[t, h, nope:])
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[keep, h]
    o = out.reshape(T, H * vd) * (1 / (1 + np.exp(-(x @ P["g_proj.weight"].T))))
    return o @ P["o_proj.weight"].T


def test_sparse_dsa_matches_straightforward_reference():
    text = tiny_text_config()  # index_topk 8
    args = ModelArgs.from_config(full_config(text))
    model = random_model(args, seed=5, conditioned=True)
    layer = model.layers[2].self_attn
    assert isinstance(layer, GatedDSA) and layer.index_topk == 8
    x = np.random.default_rng(2).normal(size=(1, 21, args.hidden_size)).astype(np.float32)
    want = _np_dsa(layer, x[0].astype(np.float64), 8)
    tol = tolerance(1, max(args.hidden_size, args.q_lora_rank, 21))
    for block in (None, 3):  # one block of queries, and blocks that split the prompt
        layer.query_block = block
        with margins() as m:
            got = np.array(layer(mx.array(x)))[0]
        m.router.append(mx.array([np.inf]))  # one attention layer: no routing here
        m.check(tol, need_indexer=True)
        assert np.abs(got - want).max() / np.abs(want).max() < tol
    # and the selection really is sparse: dense attention gives a different answer
    dense = _np_dsa(layer, x[0].astype(np.float64), 10_000)
    assert np.abs(dense - want)[8:].max() > 1e-3


def test_sparse_decode_with_cache_equals_fresh_full_forward():
    args = ModelArgs.from_config(full_config(tiny_text_config()))  # index_topk 8
    model = random_model(args, seed=3, conditioned=True)
    tokens = mx.array(np.random.default_rng(3).integers(0, 256, (1, 30)))
    tol = model_tolerance(args, 30)
    with margins() as m:
        full = model(tokens)
        cache = model.make_cache()
        out = [model(tokens[:, :12], cache)]
        for t in range(12, 30):
            out.append(model(tokens[:, t : t + 1], cache))
        step = mx.concatenate(out, axis=1)
    m.check(tol, need_indexer=True)
    assert _rel(step, full) < tol
    dsa_cache = cache[2]
    assert isinstance(dsa_cache, DSACache) and dsa_cache.offset == 30
    assert dsa_cache.index_keys[..., :30, :].shape == (1, 1, 30, args.index_head_dim)


def test_situ_matches_spec_values():
    g = mx.array([1.0, -2.0, 10.0, 0.5])
    u = mx.array([1.0, 3.0, 50.0, -100.0])
    got = np.array(situ(g, u, 4.0, 25.0))
    np.testing.assert_allclose(got, [0.715818, -0.657874, 95.108022, -7.735277], atol=2e-6)


def test_kda_gate_matches_spec_values():
    raw = mx.zeros((1, 1, 2, 1))
    A_log = mx.array([[0.0], [np.log(4.0)]])
    dt_bias = mx.array([[0.0], [1.0]])
    g = np.array(kda_gate(raw, A_log, dt_bias, -5.0)).ravel()
    np.testing.assert_allclose(g, [-2.5, -4.910069], atol=1e-5)
    np.testing.assert_allclose(np.exp(g), [0.082085, 0.007372], atol=1e-6)
