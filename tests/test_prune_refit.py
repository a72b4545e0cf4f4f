"""`prune --refit-router`: the kept router rows re-fitted to the full model's gate.

References are independent: the gates are recomputed in NumPy (sigmoid, top-k by
score + correction bias, renormalisation) from the weights alone, and the pruned build is
loaded by mlx-lm itself.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from kimi_mlx.checkpoint.shards import weight_map
from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.prune.refit import refit_layer
from kimi_mlx.testing.checkpoints import build_checkpoint, full_config, random_model
from kimi_mlx.testing.prune import moe_text_config, write_code_text


def np_gate(x, w, b, k):
    """Dense [N, E] renormalised top-k sigmoid gate, NumPy."""
    s = 1.0 / (1.0 + np.exp(-(x @ w.T)))
    idx = np.argsort(-(s + b), axis=1, kind="stable")[:, :k]
    g = np.zeros_like(s)
    rows = np.arange(len(x))[:, None]
    g[rows, idx] = s[rows, idx]
    return g / g.sum(axis=1, keepdims=True)


def np_kl(x, w, b, kept, wk, bk, k, eps=1e-4):
    """Mean KL(q || pruned gate) over tokens where the full gate picks a kept expert."""
    g = np_gate(x, w, b, k)[:, kept]
    valid = g.sum(1) > 0
    q = g[valid] / g[valid].sum(1, keepdims=True)
    p = np_gate(x[valid], wk, bk, k)
    p = (p + eps) / (1 + eps * p.shape[1])
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(q > 0, q * (np.log(q) - np.log(p)), 0.0)
    return float(terms.sum(1).mean()), int(valid.sum())


def synthetic_layer(seed=0, n=4000, d=32, E=16):
    """Tokens from a few clusters (like domains) and a router with a random bias."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (4, d))
    x = centres[rng.integers(0, 4, n)] + 0.7 * rng.normal(0, 1, (n, d))
    w = rng.normal(0, 0.4, (E, d))
    b = rng.normal(0, 0.05, E)
    return x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)


@pytest.mark.parametrize("keep,k", [(4, 2), (6, 4), (8, 4)])
def test_refit_reduces_the_gate_kl_to_the_full_router(keep, k):
    x, w, b = synthetic_layer()
    kept = sorted(np.random.default_rng(1).permutation(len(w))[:keep].tolist())
    res = refit_layer(x, w, b, kept, k, steps=300)
    before, n = np_kl(x, w, b, kept, w[kept], b[kept], k)
    after, n2 = np_kl(x, w, b, kept, res.weight, res.bias, k)
    assert n == n2 == res.tokens and res.skipped == len(x) - n
    assert np.isclose(res.kl_before, before, rtol=1e-3, atol=1e-5)
    assert np.isclose(res.kl_after, after, rtol=1e-3, atol=1e-5)
    assert after < 0.8 * before, (before, after)
    g = np_gate(x, w, b, k)[:, kept]
    v = g.sum(1) > 0
    q = g[v] / g[v].sum(1, keepdims=True)
    tv = lambda wk: 0.5 * np.abs(np_gate(x[v], wk, b[kept], k) - q).sum(1).mean()
    assert tv(res.weight) < 0.7 * tv(w[kept]), (tv(w[kept]), tv(res.weight))
    np.testing.assert_array_equal(res.bias, b[kept])  # selection-only bias kept


def test_all_experts_kept_changes_nothing_that_matters():
    x, w, b = synthetic_layer(seed=2)
    res = refit_layer(x, w, b, list(range(len(w))), 4, steps=50)
    # the full gate is the target: KL 0 before, and the refit never returns worse rows
    assert res.tv_before < 1e-6 and res.kl_before < 3e-3 and res.kl_after <= res.kl_before + 1e-9


def test_bad_shapes_and_too_few_experts_are_refused():
    x, w, b = synthetic_layer()
    with pytest.raises(ValueError, match="do not agree"):
        refit_layer(x[:, :5], w, b, [0, 1, 2, 3], 2)
    with pytest.raises(ValueError, match="fewer than top_k"):
        refit_layer(x, w, b, [0], 2)


E, K = 16, 2


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("refit")
    cfg = moe_text_config(num_experts=E, top_k=K)
    model = random_model(ModelArgs.from_config(full_config(cfg)), seed=1)
    src = build_checkpoint(base / "src", cfg, model=model)
    code = write_code_text(base / "code.txt", n=120)
    outs = {}
    for name, extra in (("plain", []), ("refit", ["--refit-router", "--refit-steps", "100"])):
        outs[name] = base / name
        argv = ["prune", "--model", str(src), "--calib", str(code), "--out", str(outs[name]),
                "--seq-len", "96", "--calib-tokens", "1200", "--quiet", "--keep", "0.25",
                "--heldout-tokens", "0", *extra]
        assert cli_main(argv) == 0
    return src, outs


def _tensors(folder):
    import mlx.core as mx

    out = {}
    for shard in sorted(set(weight_map(folder).values())):
        out.update(mx.load(str(folder / shard)))
    return out


def test_refit_build_changes_only_the_router_rows(builds):
    import mlx.core as mx

    src, outs = builds
    a, b = _tensors(outs["plain"]), _tensors(outs["refit"])
    assert a.keys() == b.keys()
    changed = {n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
               or not mx.array_equal(a[n], b[n]).item()}
    assert changed and all(n.endswith("block_sparse_moe.gate.weight") for n in changed), changed
    for n in changed:
        assert a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
    report = json.loads((outs["refit"] / "saliency.json").read_text())
    refit = report["router_refit"]
    assert refit and all(v["gate_kl_after"] <= v["gate_kl_before"] for v in refit.values())
    assert sum(v["gate_kl_after"] for v in refit.values()) < sum(
        v["gate_kl_before"] for v in refit.values())
    assert "Router refit" in (outs["refit"] / "README.md").read_text()


def test_refit_build_loads_in_generate_and_mlx_lm(builds, capsys):
    _, outs = builds
    path = outs["refit"]
    assert cli_main(["generate", "--model", str(path), "--prompt", "def f", "--max-tokens", "4",
                     "--ignore-chat-template"]) == 0
    capsys.readouterr()
    script = (f"import mlx_lm\nm, t = mlx_lm.load({str(path)!r})\n"
              "print(mlx_lm.generate(m, t, prompt='def f', max_tokens=3) is not None)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]


def test_recorded_router_inputs_reproduce_the_calibration_routing(tmp_path):
    """Every token kept (router_inputs >= tokens): top-k of the recorded inputs through the
    recorded router, in NumPy, gives the expert counts the calibration pass counted."""
    from kimi_mlx.prune.calib import load_calibration
    from kimi_mlx.prune.observe import observe
    from kimi_mlx.text.tokenizer import KimiTokenizer

    cfg = moe_text_config(num_experts=E, top_k=K)
    model = random_model(ModelArgs.from_config(full_config(cfg)), seed=3)
    src = build_checkpoint(tmp_path / "src", cfg, model=model)
    code = write_code_text(tmp_path / "code.txt", n=40)
    calib = load_calibration([code], lambda: KimiTokenizer.from_pretrained(src), seq_len=64,
                             max_tokens=400)
    res = observe(src, calib, chunk=32, progress=False, router_inputs=10_000)
    assert set(res.router_inputs) == set(res.stats) and res.stats
    for layer, st in res.stats.items():
        x = res.router_inputs[layer].astype(np.float64)
        w, b = (a.astype(np.float64) for a in res.routers[layer])
        assert x.shape == (calib.num_tokens, w.shape[1]) and w.shape[0] == E
        counts = (np_gate(x, w, b, K) > 0).sum(axis=0)
        # float32 vs float64 scores may flip a near-tie: allow a token or two per layer
        assert np.abs(counts - st.count).sum() <= 4, (layer, counts, st.count)
    few = observe(src, calib, chunk=32, progress=False, router_inputs=100)
    n = next(iter(few.router_inputs.values())).shape[0]
    assert 80 <= n <= 120  # strided to about the number asked for
