"""The pieces of `make check-real` (kimi_mlx/testing/check_real.py), cheaply:

- the real-width slice config is the shipped official config with only the expert counts
  changed, and its widths are K3.1 Pro's (K31_SPEC.md s.1);
- the slice builder writes exactly the official tensors (names, dtypes, shapes as
  `cluster.layer_bytes.expected_tensors` lists them) of its layer range, one shard per
  layer, and the loader takes that range strictly (on a toy config: the real one is 2.4 GB);
- random MXFP4 experts have an RMS near 1/sqrt(fan_in);
- the float64 oracles agree with hand computations, and each judgement fails on a planted
  error (a wrong selection, an output off by more than the bound).

The real-width run itself is `make check-real` (minutes, ~6 GB), not part of the suite.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.testing import real_oracles as ora
from kimi_mlx.placement.layer_bytes import expected_tensors
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.checkpoint.shards import read_header
from kimi_mlx.testing.checkpoints import full_config, tiny_text_config
from kimi_mlx.testing.real_slice import (OFFICIAL_CONFIG, build_real_slice, random_mxfp4,
                                   real_slice_config, real_value)


def test_real_slice_config_is_the_official_one_with_few_experts():
    cfg = real_slice_config(num_experts=8, experts_per_token=2)
    official = json.loads(OFFICIAL_CONFIG.read_text())
    text, ref = cfg["text_config"], official["text_config"]
    assert (text["num_experts"], text["num_experts_per_token"]) == (8, 2)
    for key in set(ref) - {"num_experts", "num_experts_per_token"}:
        assert text[key] == ref[key], key
    args = ModelArgs.from_config(cfg)
    # K31_SPEC.md section 1
    assert (args.hidden_size, args.vocab_size, args.q_lora_rank, args.kv_lora_rank) == (
        7168, 163840, 1536, 512)
    lin = args.linear_attn_config
    assert (lin["num_heads"], lin["head_dim"]) == (96, 128)
    assert (args.index_n_heads, args.index_head_dim, args.index_topk) == (32, 128, 2048)
    assert (args.moe_intermediate_size, args.routed_expert_hidden_size) == (3072, 3584)
    assert args.is_kda(2) and args.is_dsa(3)  # the default slice: layers [2, 4)
    with pytest.raises(ValueError, match="experts_per_token"):
        real_slice_config(num_experts=2, experts_per_token=3)


def test_slice_has_exactly_the_official_tensors_of_its_range(tmp_path):
    config = full_config(tiny_text_config())
    path = build_real_slice(tmp_path / "s", start=1, end=3, config=config)
    args = ModelArgs.from_config(config)
    want = {n: v for n, v in expected_tensors(args).items()
            if re.search(r"\.layers\.(1|2)\.", n)}
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(want)
    assert sorted(set(index.values())) == ["model-00002-of-00006.safetensors",
                                           "model-00003-of-00006.safetensors"]
    got = {}
    for shard in set(index.values()):
        got.update(read_header(path / shard))
    for name, (dtype, shape) in want.items():
        assert (got[name].dtype, tuple(got[name].shape)) == (dtype, tuple(shape)), name
    model, _, report = load_model(path, 1, 3, verbose=False)
    assert [l.idx for l in model.layers] == [1, 2]
    assert report.bytes_loaded == sum(t.nbytes for t in got.values())
    with pytest.raises(FileExistsError):
        build_real_slice(path, start=1, end=3, config=config)
    with pytest.raises(ValueError, match="layer range"):
        build_real_slice(tmp_path / "bad", start=3, end=3, config=config)


def test_random_mxfp4_rms_and_values_are_deterministic():
    out_dim, in_dim = 64, 3584
    packed, scale = random_mxfp4("x.w1", out_dim, in_dim, seed=0)
    assert packed.dtype == mx.uint8 and packed.shape == (out_dim, in_dim // 2)
    assert scale.shape == (out_dim, in_dim // 32)
    w = mx.dequantize(packed.view(mx.uint32), scale, group_size=32, bits=4, mode="mxfp4")
    rms = float(mx.sqrt((w * w).mean()))
    assert 0.6 * in_dim**-0.5 < rms < 1.6 * in_dim**-0.5
    a = real_value("layers.2.self_attn.q_proj.weight", (8, 64), mx.bfloat16, seed=0)
    b = real_value("layers.2.self_attn.q_proj.weight", (8, 64), mx.bfloat16, seed=0)
    c = real_value("layers.2.self_attn.k_proj.weight", (8, 64), mx.bfloat16, seed=0)
    assert a.dtype == mx.bfloat16 and mx.array_equal(a, b) and not mx.array_equal(a, c)


def test_kda_oracle_by_hand():
    # One head, Dk = Dv = 1: S1 = a S0 + b k (v - a S0 k); o = S1 q.
    q, k, v = np.array([0.5]), np.array([1.0]), np.array([2.0])
    g, beta, s0 = np.log(0.5), 0.25, 3.0
    r = ora.kda_recurrence64(q.reshape(1, 1, 1, 1), k.reshape(1, 1, 1, 1),
                             v.reshape(1, 1, 1, 1), np.full((1, 1, 1, 1), g),
                             np.full((1, 1, 1), beta), np.full((1, 1, 1, 1), s0))
    s1 = 0.5 * 3.0 + 0.25 * 1.0 * (2.0 - 0.5 * 3.0 * 1.0)
    assert r["state"].item() == pytest.approx(s1)
    assert r["o"].item() == pytest.approx(s1 * 0.5)
    assert 0 < r["o_tol"].item() < 1e-5
    # Gate with the lower bound (K31_SPEC.md s.6): A_log = ln 4, raw = 1 -> g = -4.910069.
    _, _, g, _ = ora.kda_prepare64(np.ones((1, 1, 1, 1)), np.ones((1, 1, 1, 1)),
                                   np.ones((1, 1, 1, 1)), np.zeros((1, 1, 1)),
                                   np.array([np.log(4.0)]), np.zeros(1), -5.0, 1.0)
    assert g.item() == pytest.approx(-4.910069, abs=1e-6)


def test_index_oracle_and_selection_judgement():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 3, 4))
    w = rng.standard_normal((1, 2, 3))
    k = rng.standard_normal((1, 6, 4))
    scores, tol = ora.index_scores64(q, w, k, offset=4)
    for t in range(2):
        for s in range(6):
            want = sum(w[0, t, h] * max(q[0, t, h] @ k[0, s], 0) for h in range(3))
            assert scores[0, t, s] == (pytest.approx(want) if s <= 4 + t else -np.inf)
    assert np.all(tol[np.isfinite(scores)] >= 0)
    best = np.argsort(-scores, axis=-1)[..., :3]
    assert ora.selection_report(best, scores, tol, 3)["worst"] == 0.0
    planted = best.copy()
    planted[0, 0, 0] = np.argsort(scores[0, 0])[np.isfinite(np.sort(scores[0, 0]))][0]
    rep = ora.selection_report(planted, scores, tol, 3)
    assert rep["worst"] > 1.0 or rep["bad_rows"] == 1
    masked = best.copy()
    masked[0, 0, 0] = 5  # a future key for query 0 (offset 4)
    assert ora.selection_report(masked, scores, tol, 3)["bad_rows"] == 1


def test_sparse_mla_oracle_by_hand_and_bound_catches_an_error():
    rng = np.random.default_rng(1)
    ql, qp = rng.standard_normal((1, 2, 1, 4)), rng.standard_normal((1, 2, 1, 2))
    lat, kp = rng.standard_normal((1, 5, 4)), rng.standard_normal((1, 5, 2))
    idx = np.array([[4, 1, -1]])
    r = ora.sparse_mla_decode64(ql, qp, lat, kp, idx, 0.5)
    for h in range(2):
        s = np.array([0.5 * (ql[0, h, 0] @ lat[0, j] + qp[0, h, 0] @ kp[0, j]) for j in (4, 1)])
        p = np.exp(s) / np.exp(s).sum()
        assert np.allclose(r["o"][0, h, 0], p[0] * lat[0, 4] + p[1] * lat[0, 1])
    err, tol, ratio = ora.max_excess(r["o"] + 0.5 * r["tol"], r["o"], r["tol"])
    assert ratio == pytest.approx(0.5)
    assert ora.max_excess(r["o"] + 3 * r["tol"], r["o"], r["tol"])[2] > 1.0
    bad = r["o"].copy()
    bad[0, 0, 0, 0] = np.nan
    assert ora.max_excess(bad, r["o"], r["tol"])[2] == float("inf")


def test_tap_names_a_missing_dispatch_function():
    from kimi_mlx.model import dsa
    from kimi_mlx.testing.check_real import tap

    with pytest.raises(AttributeError, match="dsa_gone"):
        with tap(dsa, "dsa_gone", lambda a, o: None):
            pass
    seen = []
    with tap(ora, "f64", lambda a, o: seen.append((a["a"], o.item()))):
        ora.f64(np.float32(2.0))
    assert seen == [(np.float32(2.0), 2.0)]


# At toy widths a decode step's activations are a third of the 0.2 MB of weights, hence a
# looser planner tolerance than the real run's 10% (where they are ~1%).
TOY_RUN = ["--layers", "1:3", "--prompt-tokens", "12", "--chunk", "4", "--decode-tokens", "2",
           "--kda-prefill-heads", "2", "--kda-prefill-tokens", "4", "--tolerance", "0.6"]


@pytest.fixture(scope="module")
def toy_slice(tmp_path_factory):
    """Layers [1, 3) of the tiny config (KDA 1, DSA 2; index_topk 8) as a slice."""
    return build_real_slice(tmp_path_factory.mktemp("slice") / "s", start=1, end=3,
                            config=full_config(tiny_text_config()))


def test_check_real_passes_end_to_end_on_a_toy_slice(toy_slice):
    """In a process of its own, as `make check-real` runs it: MLX's peak memory is the
    process's, and a model that generated in this process before (any earlier test that
    ran mlx-lm's generate loop) left the decode's peak at 13.9 MB against the toy's 0.2."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kimi_mlx.testing.check_real", "--slice",
                        str(toy_slice), *TOY_RUN], capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-3000:]
    for line in ("kda_decode kernel", "kda_prefill kernel", "dsa_index_topk kernel",
                 "sparse_mla_decode kernel", "decode step (float32)", "peak memory while decoding",
                 "bytes read by one decode step at 13", "cache bytes at 14 tokens"):
        assert re.search(rf"^{re.escape(line)}.*\bok$", out, re.M), line


def test_check_real_fails_on_a_wrong_kernel(toy_slice, capsys, monkeypatch):
    from kimi_mlx.testing import check_real
    from kimi_mlx.metal import kernels

    real = kernels.kda_decode

    def off(*args, **kwargs):  # a kernel whose output is off by 1e-3
        y, s = real(*args, **kwargs)
        return y + 1e-3, s

    monkeypatch.setattr(kernels, "kda_decode", off)
    rc = check_real.main(["--slice", str(toy_slice), *TOY_RUN])
    out = capsys.readouterr().out
    assert rc == 1
    assert re.search(r"^kda_decode kernel .*: output.*FAIL$", out, re.M), out
    assert re.search(r"^decode step \(float32\).*FAIL$", out, re.M), out
