"""The fast paths of speculative decoding: the fused KDA draft step, the compiled greedy
draft chain, and the verify step's per-token states (rollback by pick, not replay).

References: the model's own forward pass (`Model.__call__`, a separate implementation of
the same layer math) for the fused step; plain greedy decoding (mlx-lm `generate_step`)
for the output; a plain token-by-token decode for the caches after a rollback.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step

import kimi_mlx.model.kda as kda_mod
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.speculative.draft_step import FusedKDAStep, supports
from kimi_mlx.speculative.rollback import begin_verify, end_verify, rollback
from kimi_mlx.speculative.loop import SpecStats, _GreedyChain, speculative_generate_step
from kimi_mlx.testing.checkpoints import full_config, random_model, tiny_text_config

F32_EPS = float(np.finfo(np.float32).eps)


def kda_only_args(layers: int) -> ModelArgs:
    """Tiny K3.1 with only KDA layers and dense MLPs (the shipped draft's shape)."""
    cfg = tiny_text_config(
        num_hidden_layers=layers, num_experts=0, num_experts_per_token=0,
        num_shared_experts=0, first_k_dense_replace=layers,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                            "full_attn_layers": [], "kda_layers": list(range(1, layers + 1))},
        dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
                    "dsa_layers": []})
    return ModelArgs.from_config(full_config(cfg))


def perturbed(args, seed, noise_seed, scale=0.05):
    """`random_model(args, seed)` with every matrix perturbed by `scale` of its mean
    magnitude: agrees with the unperturbed model often, not always."""
    d = random_model(args, seed=seed)
    mx.random.seed(noise_seed)
    d.update(tree_map(
        lambda p: p + scale * mx.abs(p).mean() * mx.random.normal(p.shape) if p.ndim >= 2 else p,
        d.parameters()))
    return d


@pytest.fixture(scope="module")
def kda_target():
    """3 KDA layers; with `kda_draft` (measured on this seed) steps accept 0 to k drafts."""
    return random_model(kda_only_args(3), seed=1)


@pytest.fixture(scope="module")
def kda_draft(kda_target):
    return perturbed(kda_target.args, seed=1, noise_seed=5)


@pytest.fixture(scope="module")
def conditioned():
    """A 2-layer KDA-only model that does not amplify rounding (for numeric comparisons)."""
    return random_model(kda_only_args(2), seed=2, conditioned=True)


# --------------------------------------------------------------------- fused step


def test_fused_step_equals_the_model_forward(conditioned):
    """Logits and both states of every layer, over several tokens, against
    `Model.__call__` with its caches; the fused matmuls only reorder float32 sums."""
    m = conditioned
    step = FusedKDAStep(m)
    cache = m.make_cache()
    m(mx.array([[3, 1, 4, 1, 5, 9]]), cache)
    states = [tuple(c.cache) for c in cache]
    for tok in (2, 6, 5, 3):
        want = m(mx.array([[tok]]), cache)[0, -1]
        got, states = step(mx.array([tok]), states)
        scale = float(mx.abs(want).max())
        assert float(mx.abs(got - want).max()) <= 64 * F32_EPS * scale, tok
        for (conv, st), c in zip(states, cache):
            assert float(mx.abs(conv - c[0]).max()) <= 64 * F32_EPS * float(mx.abs(c[0]).max())
            assert float(mx.abs(st - c[1]).max()) <= 64 * F32_EPS * float(mx.abs(c[1]).max())


def test_fused_step_comparison_can_fail(conditioned):
    """The check above is sharp: one token of history more (a stale cache) is caught."""
    m = conditioned
    step = FusedKDAStep(m)
    cache = m.make_cache()
    m(mx.array([[3, 1, 4, 1, 5, 9]]), cache)
    states = [tuple(c.cache) for c in cache]
    m(mx.array([[7]]), cache)  # the model sees one token the fused step did not
    want = m(mx.array([[2]]), cache)[0, -1]
    got, _ = step(mx.array([2]), states)
    assert float(mx.abs(got - want).max()) > 1e3 * F32_EPS * float(mx.abs(want).max())


def test_fused_step_refuses_a_model_with_attention_or_experts():
    full = random_model(ModelArgs.from_config(full_config(tiny_text_config())), seed=0)
    assert not supports(full)
    with pytest.raises(ValueError, match="KDA layers with dense MLPs"):
        FusedKDAStep(full)


# ------------------------------------------------------------- greedy chain + verify


@pytest.mark.parametrize("ks", [(1, 3), (5,)])
def test_greedy_speculation_with_the_compiled_chain_equals_plain(kda_target, kda_draft, ks):
    """KDA-only draft: the drafts come from the compiled fused chain (checked used); the
    verify keeps per-token states; output token for token plain greedy, with accepted
    and rejected drafts both seen (all-accepted steps feed the chain two tokens)."""
    prompt = [(11 * i + 5) % 256 for i in range(9)]
    n = 16
    plain = [t for t, _ in generate_step(mx.array(prompt), kda_target, max_tokens=n)]
    chain = _GreedyChain.of(kda_draft, kda_target.args.vocab_size)
    assert chain.fused is not None
    for k in ks:
        stats = SpecStats()
        got = [t for t, _, _ in speculative_generate_step(
            prompt, kda_target, kda_draft, num_draft_tokens=k, max_tokens=n, stats=stats)]
        assert got == plain, k
        assert 0 < stats.accepted < stats.drafted
        assert any(key[0] == k for key in chain._fns), "the chain did not run"


def test_greedy_chain_with_the_full_target_equals_plain(kda_draft):
    """A target with DSA layers and experts (verify past index_topk) and a KDA-only
    draft of another vocabulary-compatible model: still plain greedy."""
    target = random_model(ModelArgs.from_config(full_config(tiny_text_config())), seed=0)
    prompt = [(7 * i + 3) % 256 for i in range(11)]
    plain = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=12)]
    got = [t for t, _, _ in speculative_generate_step(
        prompt, target, kda_draft, num_draft_tokens=3, max_tokens=12)]
    assert got == plain


# ------------------------------------------------------- rollback: pick or replay


def state_tensors(cache):
    return [(np.array(c[0], np.float64), np.array(c[1], np.float64)) for c in cache]


@pytest.mark.parametrize("keep_states", [True, False])
def test_rollback_by_pick_and_by_replay_equal_plain_decode(conditioned, monkeypatch,
                                                          keep_states):
    """Per-token states kept (small states, the default here) or not (K3.1-size states:
    forced by a zero byte limit): after rejecting drafts, every KDA state equals a plain
    decode of the accepted tokens to float32 rounding (the verify's token loop is the
    decode's op sequence: measured exact, 64 eps of margin)."""
    if not keep_states:
        monkeypatch.setattr(kda_mod, "STEP_STATES_MAX_BYTES", 0)
    m = conditioned
    prompt, verify = [5, 9, 2, 7, 1], [41, 99, 250, 7, 180]
    for n_keep in (0, 1, 3, 5):
        cache = m.make_cache()
        m(mx.array([prompt]), cache)
        v = begin_verify(cache)
        mx.eval(m(mx.array([verify]), cache))
        assert all((r.states is not None) == keep_states for r in v.records), n_keep
        rollback(cache, v, n_keep)
        end_verify(cache)
        want = m.make_cache()
        m(mx.array([prompt]), want)
        for t in verify[:n_keep]:
            m(mx.array([[t]]), want)
        for (gc, gs), (wc, ws) in zip(state_tensors(cache), state_tensors(want)):
            assert np.abs(gc - wc).max() <= 64 * F32_EPS * np.abs(wc).max(), n_keep
            assert np.abs(gs - ws).max() <= 64 * F32_EPS * np.abs(ws).max(), n_keep
