"""`--num-draft-tokens auto` (kimi_mlx/speculative/auto_k.py): the controller finds the k a
brute-force NumPy search over the true acceptance and step times finds, and greedy output
with k changing step to step equals plain greedy output (mlx-lm's generate_step) for the
draft-model and n-gram loops; the flag is accepted where --num-draft-tokens is parsed."""

import argparse

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.speculative.auto_k import AutoK, FixedK, draft_policy, parse_num_draft_tokens
from kimi_mlx.speculative.loop import SpecStats, speculative_generate_step
from kimi_mlx.testing.checkpoints import full_config, random_model, tiny_text_config


# ------------------------------------------------------------------- the controller


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(alpha, cost, steps=1500, seed=0, max_k=8):
    """Run AutoK against a simulated draft whose draft i is accepted with probability
    alpha[i] (given the ones before were) and a step of m drafts takes cost(m) seconds."""
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    auto = AutoK(max_k, clock=clock, decay=0.995)
    for _ in range(steps):
        k = auto.choose(10**6)
        n = 0
        while n < k and rng.random() < alpha[n]:
            n += 1
        clock.t += cost(k)
        auto.record(k, n)
    return auto


def numpy_best(alpha, cost, max_k=8):
    """argmax_k E(k)/T(k) by brute force, and the margin of the best over the runner-up."""
    a = np.asarray(alpha[:max_k], np.float64)
    tokens = 1 + np.cumsum(np.cumprod(a))  # E(1..max_k)
    rate = tokens / np.array([cost(k) for k in range(1, max_k + 1)])
    order = np.argsort(rate)[::-1]
    return int(order[0]) + 1, rate[order[0]] / rate[order[1]]


@pytest.mark.parametrize("alpha,cost", [
    # a MoE verify on a Mac: each drafted token adds a lot, acceptance falls fast
    ([0.6, 0.4, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2], lambda m: 1.0 + 0.45 * m),
    # cheap verify, a draft that is nearly always right (a copy)
    ([0.97] * 8, lambda m: 1.0 + 0.03 * m),
    # in between: the best k is neither end nor the start k (3)
    ([0.9, 0.85, 0.8, 0.75, 0.3, 0.2, 0.1, 0.1], lambda m: 1.0 + 0.12 * m),
])
def test_auto_k_settles_on_the_numpy_best_k(alpha, cost):
    want, margin = numpy_best(alpha, cost)
    assert margin > 1.02  # the best is well separated (not a near-tie)
    auto = simulate(alpha, cost)
    assert auto.best_k() == want
    # and it ran mostly at that k (exploration tries neighbours 1 step in 5)
    assert auto.ks[-500:].count(want) >= 350


def test_auto_k_follows_a_change_of_text():
    """Acceptance high then low (a copy, then new prose): the k it settles on drops."""
    clock = FakeClock()
    auto = AutoK(8, clock=clock)
    rng = np.random.default_rng(1)
    for alpha in (0.97, 0.3):
        for _ in range(600):
            k = auto.choose(100)
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            clock.t += 1.0 + 0.1 * k
            auto.record(k, n)
        if alpha == 0.97:
            high = auto.best_k()
    assert high >= 6 and auto.best_k() <= 2


def test_policies_and_parsing():
    assert parse_num_draft_tokens("auto") == "auto"
    assert parse_num_draft_tokens("AUTO:12") == "auto:12"
    assert parse_num_draft_tokens("4") == 4
    for bad in ("0", "auto:0", "auto:x", "many", -1):
        with pytest.raises(ValueError, match="--num-draft-tokens"):
            parse_num_draft_tokens(bad)
    assert isinstance(draft_policy(3), FixedK) and draft_policy(3).choose(1) == 1
    assert draft_policy("auto:5").max_k == 5
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        draft_policy(0)


def test_flag_is_accepted_by_every_front_end_parser():
    """generate, chat, server and the cluster commands all add --num-draft-tokens through
    `add_draft_arguments`; auto reaches DraftSettings and the factory's Speculation."""
    from kimi_mlx.generation.request import add_draft_arguments, add_mtp_argument, draft_settings
    from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation

    p = argparse.ArgumentParser()
    add_draft_arguments(p, mtp=True)
    add_mtp_argument(p)
    args = p.parse_args(["--draft", "ngram", "--num-draft-tokens", "auto:6"])
    settings = draft_settings(args)
    assert settings.num_draft_tokens == "auto:6"
    spec = build_speculation(settings, where=ONE_PROCESS)
    assert isinstance(spec.num_draft_tokens, AutoK) and spec.num_draft_tokens.max_k == 6
    with pytest.raises(SystemExit):
        p.parse_args(["--draft", "ngram", "--num-draft-tokens", "sometimes"])


# ------------------------------------------------------------ greedy equality


@pytest.fixture(scope="module")
def target():
    """Tiny K3.1 (6 layers: KDA 0,1,3,4; DSA 2,5; index_topk 8), float32."""
    return random_model(ModelArgs.from_config(full_config(tiny_text_config())), seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """The target perturbed by 2%: accepts often, not always (as in test_speculative)."""
    d = random_model(target.args, seed=0)
    mx.random.seed(7)
    d.update(tree_map(
        lambda p: p + 0.02 * mx.abs(p).mean() * mx.random.normal(p.shape) if p.ndim >= 2 else p,
        d.parameters()))
    return d


def test_auto_k_greedy_draft_model_equals_plain_greedy(target, draft):
    """Past index_topk (8) so verify blocks of several sizes hit the sparse DSA path."""
    prompt = [(11 * i + 5) % 256 for i in range(12)]
    n = 24
    plain = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n)]
    auto = AutoK(6, explore_every=2)  # explores a lot: many block sizes in one short run
    stats = SpecStats()
    got = [t for t, _, _ in speculative_generate_step(
        prompt, target, draft, num_draft_tokens=auto, max_tokens=n, stats=stats)]
    assert got == plain
    assert len({k for k in auto.ks if k}) >= 3, auto.ks  # k really changed
    assert 0 < stats.accepted < stats.drafted


def test_auto_k_greedy_ngram_equals_plain_greedy(target):
    from kimi_mlx.speculative.ngram import NgramDraft, ngram_generate_step

    prompt = [(5 * i + 1) % 40 for i in range(10)] * 3  # repeats: the n-gram draft matches
    n = 24
    plain = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n)]
    auto = AutoK(6, explore_every=2)
    stats = SpecStats()
    got = [t for t, _, _ in ngram_generate_step(prompt, target, NgramDraft(),
                                                num_draft_tokens=auto, max_tokens=n,
                                                stats=stats)]
    assert got == plain
    assert stats.steps > 0 and len({k for k in auto.ks if k}) >= 2, auto.ks
