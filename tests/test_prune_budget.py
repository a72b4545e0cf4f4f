"""`--budget spread`: per-layer expert counts, and builds whose layers hold different
numbers of experts (`num_experts_per_layer`) loading everywhere."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.model.config import ConfigError, ModelArgs
from kimi_mlx.prune.saliency import layer_budgets
from kimi_mlx.testing.checkpoints import (build_checkpoint, full_config, random_model,
                                          reduction_length, tolerance)
from kimi_mlx.testing.prune import moe_text_config, write_code_text

E, K = 16, 2


def kept_share(layer_scores, counts):
    """Sum over layers of the share of the layer's saliency its `counts` best experts hold."""
    total = 0.0
    for l, s in layer_scores.items():
        share = np.sort(s / s.sum())[::-1]
        total += share[: counts[l]].sum()
    return total


def test_spread_budget_is_the_best_allocation_by_exhaustive_search():
    """Against every allocation of the same total (each layer in [top_k, E]): the spread
    budget keeps the largest summed share of saliency, and it gives a flat layer more
    experts than a peaked one."""
    rng = np.random.default_rng(0)
    e, top_k, n_keep = 6, 2, 3
    layer_scores = {1: rng.random(e) ** 8, 2: rng.random(e) + 1.0, 3: rng.random(e) ** 2}
    counts = layer_budgets(layer_scores, n_keep, top_k)
    assert sum(counts.values()) == n_keep * 3 and all(top_k <= c <= e for c in counts.values())
    best = max(kept_share(layer_scores, dict(zip((1, 2, 3), c)))
               for c in itertools.product(range(top_k, e + 1), repeat=3) if sum(c) == n_keep * 3)
    assert kept_share(layer_scores, counts) == pytest.approx(best, rel=1e-12)
    assert counts[2] > counts[1]  # flat (layer 2) keeps more than peaked (layer 1)


def test_spread_budget_of_equal_layers_is_uniform_and_bad_requests_are_refused():
    s = np.arange(1.0, 9.0)
    assert layer_budgets({1: s, 2: s.copy(), 3: s.copy()}, 4, 2) == {1: 4, 2: 4, 3: 4}
    with pytest.raises(ValueError, match="n_keep"):
        layer_budgets({1: s}, 1, 2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    cfg = moe_text_config(num_experts=E, top_k=K)
    model = random_model(ModelArgs.from_config(full_config(cfg)), seed=3)
    return build_checkpoint(tmp_path_factory.mktemp("budget") / "src", cfg, model=model)


@pytest.fixture(scope="module")
def spread(src, tmp_path_factory):
    """`kimi-mlx prune --budget spread --keep 0.25`, run once through the command line."""
    code = write_code_text(tmp_path_factory.mktemp("data") / "code.txt", n=120)
    out = tmp_path_factory.mktemp("out") / "spread"
    assert cli_main(["prune", "--model", str(src), "--calib", str(code), "--out", str(out),
                     "--seq-len", "96", "--calib-tokens", "1200", "--quiet", "--keep", "0.25",
                     "--budget", "spread", "--heldout-tokens", "0"]) == 0
    return out


def _kept(build):
    report = json.loads((build / "saliency.json").read_text())
    return {int(l["layer"]): l["kept"] for l in report["layers"]}


def test_spread_build_equals_the_source_routed_only_to_the_kept_experts(src, spread):
    """The build's logits against an independent reference: the unpruned source whose
    dropped experts get a correction bias of -1e4 (never selected), so it routes exactly
    as the build does; the kept experts' weights and router rows are the same."""
    cfg = json.loads((spread / "config.json").read_text())["text_config"]
    per = cfg["num_experts_per_layer"]
    assert len(set(per.values())) > 1, "the test needs a non-uniform build"
    assert sum(per.values()) == (E // 4) * len(per) and cfg["num_experts"] == max(per.values())
    kept = _kept(spread)
    assert {str(l): len(ids) for l, ids in kept.items()} == per

    ref, _, _ = load_model(src, verbose=False)
    for layer in ref.layers:
        if "block_sparse_moe" in layer:
            gate = layer.block_sparse_moe.gate
            mask = np.full(E, -1e4, np.float32)
            mask[kept[layer.idx]] = 0.0
            gate.e_score_correction_bias = gate.e_score_correction_bias + mx.array(mask)
    got, _, _ = load_model(spread, verbose=False)
    x = mx.array([list(range(5, 77, 3))])
    want = np.array(ref(x))
    err = np.abs(np.array(got(x)) - want).max() / np.abs(want).max()
    assert err <= tolerance(ref.args.num_hidden_layers, reduction_length(ref.args, x.shape[1]))


def test_spread_build_loads_in_stages_and_mlx_lm(spread):
    """Two layer ranges (what pipeline stages load) and `mlx_lm.load` give the logits of
    the whole build loaded by our loader."""
    import mlx_lm

    from kimi_mlx.model.attn_res import Banks

    full, _, _ = load_model(spread, verbose=False)
    x = mx.array([[7, 8, 9, 10, 11, 12]])
    want = np.array(full(x))
    a, _, _ = load_model(spread, 0, 3, verbose=False)
    b, _, _ = load_model(spread, 3, 6, verbose=False)
    h, banks = a.text.run_layers(a.text.embed(x), Banks(a.args.rms_norm_eps))
    h, banks = b.text.run_layers(h, Banks.from_stacked(banks.stack(), b.args.rms_norm_eps))
    staged = np.array(b.language_model.logits(b.text.finish(h, banks)))
    m, _ = mlx_lm.load(str(spread))
    m.activation_dtype = mx.float32  # as our loader picks on the CPU
    viamlx = np.array(m(x).astype(mx.float32))
    tol = tolerance(full.args.num_hidden_layers, reduction_length(full.args, x.shape[1]))
    for got in (staged, viamlx):
        assert np.abs(got - want).max() / np.abs(want).max() <= tol


def test_plan_and_dry_run_print_per_layer_budgets(src, spread, capsys, tmp_path):
    per = json.loads((spread / "config.json").read_text())["text_config"]["num_experts_per_layer"]
    assert cli_main(["plan", "--model", str(spread), "--macs", "1x64GB"]) in (0, 1)
    out = capsys.readouterr().out
    assert "routed experts per layer (not uniform): " + ", ".join(
        f"{l}: {n}" for l, n in per.items()) in out
    code = write_code_text(tmp_path / "code.txt", n=120)
    assert cli_main(["prune", "--model", str(src), "--calib", str(code), "--seq-len", "96",
                     "--calib-tokens", "1200", "--quiet", "--keep", "0.25", "--budget", "spread",
                     "--dry-run", "--macs", "1x64GB"]) == 0
    out = capsys.readouterr().out
    assert "per-layer budgets (spread): " + ", ".join(f"{l}: {n}" for l, n in per.items()) in out
    assert "prune peak memory (one layer at a time, 1,200 calibration tokens" in out
    assert not (tmp_path / "out").exists()


def test_spread_without_calibration_and_pruning_a_spread_build_are_refused(src, spread, capsys, tmp_path):
    assert cli_main(["prune", "--model", str(src), "--keep", "0.25", "--budget", "spread",
                     "--dry-run"]) == 2
    assert "give --calib" in capsys.readouterr().err
    assert cli_main(["prune", "--model", str(spread), "--method", "random", "--keep", "0.5",
                     "--out", str(tmp_path / "again")]) == 2
    assert "num_experts_per_layer" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_config_with_bad_per_layer_counts_is_refused():
    cfg = moe_text_config(num_experts=E, top_k=K)
    moe = [i for i in range(cfg["num_hidden_layers"]) if i >= cfg.get("first_k_dense_replace", 1)]
    ok = {str(i): 4 for i in moe}
    ok[str(moe[0])] = E
    ModelArgs.from_config(full_config({**cfg, "num_experts_per_layer": ok}))
    for bad, msg in (({str(i): 1 for i in moe}, "num_experts_per_token"),
                     ({str(moe[0]): E}, "one count for each MoE layer"),
                     ({str(i): 4 for i in moe}, "largest")):
        with pytest.raises(ConfigError, match=msg):
            ModelArgs.from_config(full_config({**cfg, "num_experts_per_layer": bad}))


@pytest.mark.e2e  # 2 stage processes of its own on loopback serving the build, a launch and generate (make test-e2e)
def test_spread_build_in_the_cluster_and_generate(spread, tmp_path):
    """Two `kimi-mlx cluster serve` stages on loopback print what `generate` prints."""
    from kimi_mlx.testing.prune import cluster_and_generate, reply_lines

    launch, gen = cluster_and_generate(spread, tmp_path)
    assert launch.returncode == 0 and gen.returncode == 0, launch.stderr[-2000:] + gen.stderr[-2000:]
    assert reply_lines(launch.stdout) == reply_lines(gen.stdout) and reply_lines(gen.stdout)


def test_the_default_budget_is_spread_at_keep_quarter_and_uniform_above(src, spread, tmp_path):
    """`--budget auto` (the command's default, chosen by make bench-domains): at keep 0.25
    the build keeps what an explicit `--budget spread` build keeps, layer by layer; at 0.5
    every layer keeps the same count (uniform); random never spreads."""
    from kimi_mlx.prune.saliency import resolve_budget

    code = write_code_text(tmp_path / "code.txt", n=120)
    args = ["--model", str(src), "--calib", str(code), "--seq-len", "96", "--calib-tokens",
            "1200", "--quiet", "--heldout-tokens", "0"]
    assert cli_main(["prune", *args, "--keep", "0.25", "--out", str(tmp_path / "auto")]) == 0
    assert _kept(tmp_path / "auto") == _kept(spread)
    assert cli_main(["prune", *args, "--keep", "0.5", "--out", str(tmp_path / "half")]) == 0
    assert len({len(k) for k in _kept(tmp_path / "half").values()}) == 1
    assert resolve_budget("auto", 224, 896) == "spread"
    assert resolve_budget("auto", 225, 896) == "uniform"
    assert resolve_budget("auto", 100, 896, method="random") == "uniform"
    assert resolve_budget("auto", 8, 896, top_k=16) == "uniform"  # spread needs top_k each
