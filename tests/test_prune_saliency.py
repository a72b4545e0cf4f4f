"""Pruner unit tests: the recorder against a hand computation, ranking rules, heat map, --keep."""

import json

import matplotlib
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.ffn import LatentMoE
from kimi_mlx.prune.observe import ExpertRecorder, LayerStats
from kimi_mlx.prune.report import cell_colours, heat_map_figure, write_report
from kimi_mlx.prune.saliency import KeepError, experts_to_keep, scores, select, super_experts
from kimi_mlx.testing.prune import moe_text_config
from kimi_mlx.testing.checkpoints import full_config

E, K = 16, 4


def _situ(g, u, beta=4.0, lin=25.0):
    a = beta * np.tanh(g / beta) / (1 + np.exp(-g))
    return a * lin * np.tanh(u / lin)


@pytest.fixture(scope="module")
def hand_moe():
    """A LatentMoE with hand-set weights, experts quantized to MXFP4 as the loader does."""
    args = ModelArgs.from_config(full_config(moe_text_config(num_experts=E, top_k=K)))
    rng = np.random.default_rng(7)
    moe = LatentMoE(args)
    d, lat, inter = args.hidden_size, args.routed_expert_hidden_size, args.moe_intermediate_size
    w = {
        "gate.weight": rng.normal(0, 0.3, (E, d)),
        "gate.e_score_correction_bias": rng.normal(0, 0.05, (E,)),
        "routed_expert_down_proj.weight": rng.normal(0, d ** -0.5, (lat, d)),
        "routed_expert_up_proj.weight": rng.normal(0, lat ** -0.5, (d, lat)),
        "routed_expert_norm.weight": rng.uniform(0.8, 1.2, (lat,)),
        "switch_mlp.gate_proj.weight": rng.normal(0, 0.5, (E, inter, lat)),
        "switch_mlp.up_proj.weight": rng.normal(0, 0.5, (E, inter, lat)),
        "switch_mlp.down_proj.weight": rng.normal(0, 0.3, (E, lat, inter)),
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        w[f"shared_experts.{name}.weight"] = rng.normal(0, 0.1, moe.shared_experts[name].weight.shape)
    moe.load_weights([(k, mx.array(v.astype(np.float32))) for k, v in w.items()])
    nn.quantize(moe, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: p.startswith("switch_mlp") and hasattr(m, "to_quantized"))
    return args, moe


def _dequant(layer):
    return np.array(mx.dequantize(layer.weight, layer.scales, group_size=32, bits=4,
                                  mode="mxfp4", dtype=mx.float32)).astype(np.float64)


def test_recorder_matches_a_hand_computation(hand_moe, tmp_path):
    args, moe = hand_moe
    x = mx.array(np.random.default_rng(1).normal(0, 1, (2, 40, args.hidden_size)).astype(np.float32))
    plain = moe(x)
    stats = LayerStats(1, E, K)
    rec = ExpertRecorder(moe, stats).install()
    try:
        observed = moe(x)
        mx.eval(observed, *rec.pending())
        rec.flush()
    finally:
        rec.uninstall()
    assert mx.array_equal(plain, observed).item(), "recording must not change the output"
    assert type(moe.switch_mlp).__name__ == "SwitchGLU" and "route" not in vars(moe)

    # The same numbers, by hand, in float64 from the dequantized MXFP4 experts.
    xs = np.array(x, np.float64).reshape(-1, args.hidden_size)
    logits = xs @ np.array(moe.gate.weight, np.float64).T
    s = 1 / (1 + np.exp(-logits))
    choice = s + np.array(moe.gate.e_score_correction_bias, np.float64)
    top = np.argsort(-choice, axis=-1)[:, :K]
    g = np.take_along_axis(s, top, -1)
    g = g / g.sum(-1, keepdims=True)  # renormalised; routed_scaling_factor divided out
    # REAP's reference gate: softmax over all raw logits, then renormalised over the
    # model's selection (top-k of sigmoid + correction bias), computed the long way.
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    gs = np.take_along_axis(p, top, -1)
    gs = gs / gs.sum(-1, keepdims=True)
    z = xs @ np.array(moe.routed_expert_down_proj.weight, np.float64).T
    w1, w3, w2 = (_dequant(moe.switch_mlp[n]) for n in ("gate_proj", "up_proj", "down_proj"))
    want = {k: np.zeros(E) for k in ("count", "gate", "norm", "gate_norm", "peak", "soft",
                                     "soft_norm")}
    routed = {j: [] for j in range(E)}
    routed_soft = {j: [] for j in range(E)}
    for t in range(xs.shape[0]):
        for slot, j in enumerate(top[t]):
            f = _situ(w1[j] @ z[t], w3[j] @ z[t]) @ w2[j].T  # expert j's latent output
            n = np.linalg.norm(f)
            want["count"][j] += 1
            want["gate"][j] += g[t, slot]
            want["norm"][j] += n
            want["gate_norm"][j] += g[t, slot] * n
            want["peak"][j] = max(want["peak"][j], np.abs(f).max())
            want["soft"][j] += gs[t, slot]
            want["soft_norm"][j] += gs[t, slot] * n
            routed[j].append(g[t, slot] * n)
            routed_soft[j].append(gs[t, slot] * n)
    reap = np.array([np.mean(v) if v else 0.0 for v in routed.values()])
    reap_soft = np.array([np.mean(v) if v else 0.0 for v in routed_soft.values()])
    # The softmax gate must tell experts apart more than the near-uniform model gate does,
    # else the two gates would not be distinguished by this test.
    assert np.abs(gs - 1 / K).max() > 2 * np.abs(g - 1 / K).max()

    assert stats.tokens == 80
    np.testing.assert_array_equal(stats.count, want["count"])
    np.testing.assert_allclose(stats.gate_sum, want["gate"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.gate_sum.sum(), 80, rtol=1e-6)
    np.testing.assert_allclose(stats.norm_sum, want["norm"], rtol=1e-4)
    np.testing.assert_allclose(stats.gate_norm_sum, want["gate_norm"], rtol=1e-4)
    np.testing.assert_allclose(stats.max_abs, want["peak"], rtol=1e-4)
    np.testing.assert_allclose(stats.softmax_gate_sum, want["soft"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.softmax_gate_norm_sum, want["soft_norm"], rtol=1e-4)
    np.testing.assert_allclose(stats.reap("model"), reap, rtol=1e-4)
    np.testing.assert_allclose(stats.reap("softmax"), reap_soft, rtol=1e-4)
    np.testing.assert_allclose(scores(stats, "ean"), want["norm"], rtol=1e-4)
    np.testing.assert_array_equal(scores(stats, "frequency"), want["count"])

    # ... and the pruner's saliency.json carries the same numbers for both gates and both
    # reductions, with the ranking score of the method and gate it was asked for.
    hand = {("reap", "model"): reap, ("reap", "softmax"): reap_soft,
            ("reap-sum", "model"): want["gate_norm"], ("reap-sum", "softmax"): want["soft_norm"]}
    for (method, gate), expected in hand.items():
        sel = select({1: stats}, method, E // 2, gate=gate)
        write_report(tmp_path, {1: stats}, sel, {}, "card")
        report = json.loads((tmp_path / "saliency.json").read_text())
        layer = report["layers"][0]
        assert (report["method"], report["gate"]) == (method, gate)
        np.testing.assert_allclose(layer["score"], expected, rtol=1e-4, atol=1e-9)
        key = "reap" if method == "reap" else "reap_sum"
        np.testing.assert_allclose(layer[key][gate], expected, rtol=1e-4, atol=1e-9)
        top_half = sorted(np.argsort(-expected, kind="stable")[: E // 2].tolist())
        margin = np.sort(expected)[::-1]
        if margin[E // 2 - 1] - margin[E // 2] > 1e-3 * margin[0]:  # a clear cut
            assert layer["kept"] == top_half, (method, gate)


def _stats(layer, count, gate_norm, norm=None, peak=None):
    count = np.asarray(count)
    return LayerStats(layer, len(count), 2, int(count.sum()), count=count,
                      gate_sum=count * 0.5, norm_sum=norm if norm is not None else count * 1.0,
                      gate_norm_sum=gate_norm, max_abs=peak if peak is not None else np.ones(len(count)),
                      softmax_gate_sum=count * 0.5, softmax_gate_norm_sum=gate_norm)


def test_never_routed_expert_is_dropped_first_by_every_criterion():
    # Expert 2 was never routed; expert 5 was routed once, with the smallest mean and sum.
    count = np.array([9, 8, 0, 7, 6, 1, 5, 4])
    st = {1: _stats(1, count, gate_norm=0.1 * count * count)}
    for method in ("reap", "frequency", "ean"):
        assert 2 not in select(st, method, 7).kept[1], method
        assert select(st, method, 6).kept[1] == [0, 1, 3, 4, 6, 7], method


def test_reap_ranks_by_mean_not_sum():
    # Expert 0: routed often, small contributions; expert 1: rarely, large ones.
    st = {1: _stats(1, [100, 2, 50, 50], gate_norm=np.array([10.0, 4.0, 20.0, 30.0]))}
    # REAP means: 0.1, 2.0, 0.4, 0.6 -> expert 0 goes first; frequency drops expert 1.
    assert select(st, "reap", 3).kept[1] == [1, 2, 3]
    assert select(st, "frequency", 3).kept[1] == [0, 2, 3]


def test_random_is_seeded_and_uniform_count():
    st = {l: _stats(l, np.arange(1, 17), gate_norm=np.arange(1, 17) * 1.0) for l in (1, 2, 3)}
    a, b, c = (select(st, "random", 5, seed=s) for s in (0, 0, 1))
    assert a.kept == b.kept and a.kept != c.kept
    assert all(len(v) == 5 for v in a.kept.values())
    assert a.kept[1] != a.kept[2]  # a different draw per layer


def test_super_experts_follow_reaps_threshold_and_are_kept():
    peaks = {l: np.ones(8) for l in range(1, 9)}
    peaks[2][6] = 500.0  # an outlier in an early layer: protected
    peaks[8][3] = 400.0  # an outlier in the last quarter of layers: ignored (REAP's rule)
    st = {l: _stats(l, np.arange(8) + 1, gate_norm=np.arange(8) + 1.0, peak=p) for l, p in peaks.items()}
    assert super_experts(st) == {2: [6]}
    sel = select(st, "reap", 2, protect_super_experts=True)
    assert sel.kept[2] == [6, 7] and sel.protected == {2: [6]}
    assert sel.kept[3] == [6, 7]
    assert select(st, "reap", 2).kept[2] == [6, 7]  # expert 6 ranks 2nd anyway here
    assert select(st, "reap", 1).kept[2] == [7]
    assert select(st, "reap", 1, protect_super_experts=True).kept[2] == [6]


@pytest.mark.parametrize("keep, experts, msg", [
    (0.0, None, "--keep must be a fraction in (0, 1]"),
    (1.5, None, "--keep must be a fraction in (0, 1]"),
    (-0.2, None, "--keep must be a fraction in (0, 1]"),
    (0.05, None, "fewer than num_experts_per_token = 4"),
    (None, 3, "--experts must be in [4, 32] (num_experts_per_token to num_experts), got 3"),
    (None, 0, "--experts must be in [4, 32]"),
    (None, 33, "--experts must be in [4, 32]"),
    (None, None, "exactly one of"),
    (0.5, 16, "exactly one of"),
])
def test_keep_out_of_range(keep, experts, msg):
    with pytest.raises(KeepError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        experts_to_keep(32, 4, keep=keep, experts=experts)
    assert experts_to_keep(32, 4, keep=0.2) == 6 and experts_to_keep(32, 4, keep=1.0) == 32
    assert experts_to_keep(32, 4, experts=4) == 4


def test_heat_map_marks_each_expert_and_labels_the_figure(tmp_path):
    # Layer 1: expert 1 never routed (dropped), expert 0 most salient (kept);
    # layer 2: expert 3 protected although least salient.
    st = {l: _stats(l, [3, 0, 2, 1], gate_norm=np.array([3.0, 0, 2, 1])) for l in (1, 2)}
    sel = select(st, "reap-sum", 2, gate="model")  # scores = gate_norm sums 3, 0, 2, 1
    sel.protected = {2: [3]}
    sel.kept[2] = [0, 3]
    rgb, norm, layers = cell_colours(st, sel)
    assert layers == [1, 2] and rgb.shape == (2, 4, 3)
    np.testing.assert_allclose(norm[0], [1.0, 0.0, 2 / 3, 1 / 3])  # saliency / layer max
    assert tuple(rgb[0, 1]) == (1.0, 1.0, 1.0)  # never routed, dropped: white
    np.testing.assert_allclose(rgb[1, 3], [0.85, 0.0, 0.75])  # protected: magenta
    assert sel.kept[1] == [0, 2]
    kept, dropped = rgb[0, 2], rgb[0, 3]  # a kept cell is the colour map; a dropped one greyer
    np.testing.assert_allclose(kept, matplotlib.colormaps["viridis"](2 / 3)[:3])
    assert np.ptp(dropped) < 0.5 * np.ptp(matplotlib.colormaps["viridis"](1 / 3)[:3])

    fig = heat_map_figure(st, sel)
    top, bottom = fig.axes[:2]  # the two panels (then their colour bars)
    assert "reap-sum, model gate" in top.get_title() and "keep 2 of 4" in top.get_title()
    assert (top.get_xlabel(), top.get_ylabel()) == ("expert id", "MoE layer")
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "kept (colour = saliency)", "dropped (faded)", "never routed", "protected super expert"]
    assert len(bottom.lines) == 3 and bottom.get_legend().get_texts()[0].get_text() == "cut: 2 kept"
    write_report(tmp_path, st, sel, {}, "card")
    png = (tmp_path / "saliency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_gate_diagnostic_reports_gate_range_and_rank_correlation():
    """Two layers of 4 experts, hand-made: mean gates 0.1..0.4 and 0.2..0.3 (unrouted
    expert ignored); layer 0's REAP order equals its frequency order (+1), layer 1's is
    reversed (-1): the mean is 0."""
    from kimi_mlx.prune.bench.pruning import gate_diagnostic

    a = LayerStats(layer=1, num_experts=4, top_k=2, count=[10, 20, 30, 40],
                   gate_sum=[1.0, 4.0, 9.0, 16.0], gate_norm_sum=[1.0, 4.0, 9.0, 16.0])
    b = LayerStats(layer=2, num_experts=5, top_k=2, count=[40, 30, 20, 10, 0],
                   gate_sum=[8.0, 7.5, 5.0, 3.0, 0.0], gate_norm_sum=[4.0, 6.0, 8.0, 9.0, 0.0])
    line = gate_diagnostic({1: a, 2: b}, top_k=2)
    assert "0.100-0.400" in line and "1/top_k = 0.500" in line
    assert "frequency +0.00" in line


def test_bench_default_is_the_best_mean_rank():
    """Two keeps x two domains of hand-made perplexities: ranks per cell, then the mean;
    random enters as the mean over its seeds."""
    from kimi_mlx.prune.bench.pruning import CANDIDATES, mean_ranks

    names = [n for n, _, _ in CANDIDATES]  # 5 candidates
    def cell(order, rand):
        rows = {n: {"code": 10.0 + order.index(n), "prose": 20.0 + order.index(n)} for n in names}
        rows.update({f"random-{s}": {"code": v, "prose": v + 10} for s, v in enumerate(rand)})
        return {"rows": rows}
    second = [names[1], names[2], names[0], names[3], names[4]]
    keeps = {"0.5": cell(names, [9.0, 9.5]),           # random mean 9.25: rank 1, then names
             "0.25": cell(second, [100.0, 200.0])}     # random last
    ranks = mean_ranks(keeps, ["code", "prose"])
    assert ranks["random (mean)"] == (1 + 1 + 6 + 6) / 4
    assert ranks[names[0]] == (2 + 2 + 3 + 3) / 4 and ranks[names[2]] == (4 + 4 + 2 + 2) / 4
    assert list(ranks)[0] == names[1] and ranks[names[1]] == (3 + 3 + 1 + 1) / 4
