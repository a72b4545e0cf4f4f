"""k from cost (issue 36 part 4): the distinct-experts model against a Monte-Carlo count,
the routing counter against brute force, the verify cost model against a NumPy hand
computation from the layer sizes, and `kimi-mlx plan`'s per-k table."""

import numpy as np
import pytest
from fixtures.verify_cost import REPO, hand_verify, moe_two_stage_plan, monte_carlo_union

from kimi_mlx.bench.routing import block_counts
from kimi_mlx.placement.expert_union import load_curve, union_experts
from kimi_mlx.placement.verify_cost import (alpha_from_acceptance_length, expected_tokens,
                                            parse_acceptance, verify_seconds)


def test_uniform_union_matches_a_monte_carlo_count():
    """rho = beta = 1: n tokens each picking 4 distinct of 32 experts uniformly."""
    rng = np.random.default_rng(0)
    E, k, draws = 32, 4, 6000
    for n in (1, 2, 5, 16):
        mean, se = monte_carlo_union(rng, E, k, n, draws)
        assert abs(union_experts(n, E, k) - mean) < 5 * se + 1e-9, n


def test_block_counts_match_brute_force():
    rng = np.random.default_rng(1)
    E, k = 12, 3
    chunks = [np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for L in (9, 20)]
    got = block_counts(chunks, E, max_n=6, draws=10)["block"]
    for n in range(1, 7):
        want = np.mean([len(set(c[s:s + n].ravel().tolist()))
                        for c in chunks for s in range(len(c) - n + 1)])
        assert got[n - 1] == pytest.approx(want, rel=1e-12)


def test_shipped_curve_is_micro_moes_and_its_fit_follows_it():
    curve = load_curve()
    assert "micro-moe" in curve.source and (curve.num_experts, curve.top_k) == (32, 4)
    mean = curve.mean_block()
    assert mean[0] == pytest.approx(4) and all(b > a for a, b in zip(mean, mean[1:]))
    fit = [curve.distinct(n, 32, 4) for n in range(1, 17)]
    assert max(abs(f - m) / m for f, m in zip(fit, mean)) < 0.06  # measured: < 4%
    # fewer distinct experts than uniform routing at every n > 1 (skew and locality)
    assert all(curve.distinct(n, 896, 16) < union_experts(n, 896, 16) for n in range(2, 17))


def test_acceptance_length_conversion():
    a = alpha_from_acceptance_length(3.45, 16)
    assert np.sum(a ** np.arange(16)) == pytest.approx(3.45, rel=1e-9)
    assert expected_tokens([a], 15) == pytest.approx(3.45, rel=1e-9)
    acc, how = parse_acceptance("0.8,0.5")
    assert acc == [0.8, 0.5] and expected_tokens(acc, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    for bad in ("17", "0", "1.2,0.5", "x"):
        with pytest.raises(ValueError, match="acceptance"):
            parse_acceptance(bad)


def test_verify_cost_matches_a_numpy_hand_computation():
    model, plan = moe_two_stage_plan()
    hop = 0.5e-3
    for k in (0, 1, 3, 7):
        want_b, want_t = hand_verify(model, plan, k, hop_s=hop, draft_s=0.002)
        got_b, got_t = verify_seconds(plan, model, k, load_curve(), hop, draft_s=0.002)
        assert got_b == pytest.approx(want_b, rel=1e-6, abs=k + 1)  # embed rows: integer bytes
        assert got_t == pytest.approx(want_t, rel=1e-6)
    # k = 0 is the planner's own plain decode step (its read_bytes / seconds_per_step)
    plain_b, plain_t = verify_seconds(plan, model, 0, load_curve(), plan.hops and
                                      (plan.seconds_per_step - sum(s.seconds for s in plan.stages))
                                      / plan.hops)
    assert plain_b == pytest.approx(plan.read_bytes_per_step, abs=2)
    assert plain_t == pytest.approx(plan.seconds_per_step, rel=1e-9)


def test_plan_prints_tok_s_per_k(capsys):
    """On micro-moe's headers over 2 Macs (K3.1 on 4x512GB is the same code, ~50 s here
    for the tensor-parallel comparison the plan also prints)."""
    from kimi_mlx.commands.main import main

    micro = str(REPO / "kimi_mlx/assets/micro-moe")
    assert main(["plan", "--model", micro, "--macs", "2x16GB", "--max-draft-tokens", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert out.rstrip().endswith("fits")
    assert "mean acceptance length 3.45 at blocks of 16 positions" in out
    start = next(i for i, l in enumerate(lines) if l.startswith("speculative decoding, one "
                                                                "sequence through the pipeline"))
    pipeline = lines[start:start + next(i for i, l in enumerate(lines[start:]) if not l.strip())]
    rows = {l.split()[0]: l.split() for l in pipeline if l.startswith("  ") and
            l.split()[0] in [str(k) for k in range(9)]}
    plain = float(next(l for l in lines if l.startswith("decode estimate")).split(
        "tokens/s")[0].split()[-1])
    assert float(rows["0"][-2]) == pytest.approx(plain, abs=0.051)  # k = 0 is plain decode
    rates = {k: float(rows[str(k)][-2]) for k in range(1, 9)}
    best = max(rates, key=rates.get)
    assert f"best k: {best} " in out
