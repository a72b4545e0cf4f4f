"""`prune --merge`: dropped experts folded into kept ones (kimi_mlx.prune.merge), against
NumPy references: the SwiGLU (SiTU) expert, neuron alignment, MXFP4 decoding, the merge of
the micro-moe test bed's experts and the model that routes to them."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kimi_mlx
from kimi_mlx.prune.merge import (align, assign, memory_estimate, merge_group, permute,
                                  quantize_mxfp4)
from kimi_mlx.prune.refit import target_gates

MICRO_MOE = Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro-moe"
BETA, LINEAR_BETA = 4.0, 25.0  # micro-moe's activation_situ_beta / _linear_beta
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def situ_expert(z, w1, w3, w2, beta=BETA, lb=LINEAR_BETA):
    """NumPy SwiGLU expert with K3's SiTU: w2 (beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb))."""
    z = np.asarray(z, np.float64)
    g, u = z @ np.asarray(w1, np.float64).T, z @ np.asarray(w3, np.float64).T
    a = beta * np.tanh(g / beta) / (1 + np.exp(-g)) * lb * np.tanh(u / lb)
    return a @ np.asarray(w2, np.float64).T


def mxfp4_decode(packed, scale):
    """NumPy MXFP4: U8 [out, in/2] (element 2i in the low nibble) x E8M0 [out, in/32]."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    exp = np.asarray(scale, np.float64) - 127.0
    return vals * np.repeat(2.0 ** exp, 32, axis=1)


def expert(rng, i=64, d=32, out=32):
    return (rng.standard_normal((i, d)) * 0.3, rng.standard_normal((i, d)) * 0.3,
            rng.standard_normal((out, i)) * 0.3)


def test_identical_experts_merge_to_the_same_layer_output():
    """Two copies of one expert, routed with weights g0, g1: the merged expert with g0 + g1
    gives the pair's summed output (NumPy), whatever the frequencies."""
    rng = np.random.default_rng(0)
    a = expert(rng)
    merged = merge_group([a, tuple(x.copy() for x in a)], [3.0, 11.0])
    z = rng.standard_normal((20, 32))
    g0, g1 = 0.3, 0.45
    want = g0 * situ_expert(z, *a) + g1 * situ_expert(z, *a)
    got = (g0 + g1) * situ_expert(z, *merged)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["hungarian", "greedy"])
def test_permuted_copy_is_aligned_back(method):
    """A copy of expert A with its intermediate neurons shuffled (and 1% noise): the
    alignment finds the shuffle, so averaging A with it gives A back (plain averaging of
    the unaligned copy does not)."""
    rng = np.random.default_rng(1)
    a = expert(rng)
    shuffle = rng.permutation(64)
    b = tuple(x + 0.01 * rng.standard_normal(x.shape) * np.abs(x).mean() for x in
              (a[0][shuffle], a[1][shuffle], a[2][:, shuffle]))
    perm = align(a, b, method)
    np.testing.assert_array_equal(shuffle[perm], np.arange(64))  # b[perm[i]] is a[i]
    merged = merge_group([a, b], [1.0, 3.0], method)
    z = rng.standard_normal((16, 32))
    want = situ_expert(z, *a)
    err = np.abs(situ_expert(z, *merged) - want).max() / np.abs(want).max()
    assert err < 0.02
    naive = [(x + y) / 2 for x, y in zip(a, b)]
    assert np.abs(situ_expert(z, *naive) - want).max() / np.abs(want).max() > 10 * err
    np.testing.assert_array_equal(permute(b, perm)[2], b[2][:, perm])


def test_merge_weights_are_the_routed_token_frequencies():
    rng = np.random.default_rng(2)
    a, b = expert(rng), expert(rng)
    perm = align(a, b)
    bp = permute(b, perm)
    merged = merge_group([a, b], [1.0, 3.0])
    for m, x, y in zip(merged, a, bp):
        np.testing.assert_allclose(m, (x + 3 * y) / 4, rtol=1e-5, atol=1e-6)
    kept_only = merge_group([a, b], [0.0, 0.0])  # nothing routed: the kept expert as is
    for m, x in zip(kept_only, a):
        np.testing.assert_allclose(m, x, rtol=1e-6)
    with pytest.raises(ValueError, match="negative"):
        merge_group([a, b], [1.0, -1.0])
    with pytest.raises(ValueError, match="shapes differ"):
        align(a, expert(rng, i=32))


def test_assign_and_merge_aware_refit_target():
    sim = np.array([[1, .2, .9, .1], [.2, 1, .3, .8], [.9, .3, 1, 0], [.1, .8, 0, 1]])
    assert assign(sim, [0, 1]) == {2: 0, 3: 1}
    with pytest.raises(ValueError, match="kept experts"):
        assign(sim, [5])
    # the refit target with `into`: the full gate, each dropped expert's weight added to
    # its merge target's (NumPy), every token then has a target
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((50, 8)), rng.standard_normal((4, 8)), np.zeros(4)
    s = 1 / (1 + np.exp(-(x @ w.T)))
    top = np.argsort(-s, axis=1)[:, :2]
    g = np.zeros_like(s)
    np.put_along_axis(g, top, np.take_along_axis(s, top, 1), 1)
    g /= g.sum(1, keepdims=True)
    want = np.stack([g[:, 0] + g[:, 2], g[:, 1] + g[:, 3]], 1)
    q, valid = target_gates(mx.array(x, mx.float32), mx.array(w, mx.float32),
                            mx.array(b, mx.float32), [0, 1], 2, {2: 0, 3: 1})
    assert np.array(valid).all()
    np.testing.assert_allclose(np.array(q), want, rtol=1e-5, atol=1e-6)


def test_mxfp4_requantization_error_is_reported():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    packed, scale, err = quantize_mxfp4(w)
    back = mxfp4_decode(packed, scale)
    want = np.linalg.norm(w - back) / np.linalg.norm(w)
    assert err == pytest.approx(want, rel=1e-6) and 0.01 < err < 0.3
    q, s = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
    np.testing.assert_array_equal(  # the NumPy decoder reads MLX's MXFP4 layout
        back, np.array(mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)))


def test_memory_estimate_at_k31_size():
    m = memory_estimate(896, 7168, 3584, 3072, tokens=16384, moe_layers=92)
    assert m["inputs_one_layer"] == 16384 * 7168 * 4  # 470 MB
    assert m["outputs_all"] == 16384 * 896 * 3584 * 4  # what is not held: 210 GB
    assert m["outputs_chunk"] <= 1 << 30 and m["similarity"] == 896 * 896 * 4 * 92


# --- end to end on the micro-moe test bed ---------------------------------------------

def _source_tensors(src):
    out = {}
    for f in sorted(src.glob("model-*.safetensors")):
        out.update({n: np.array(a) for n, a in mx.load(str(f)).items() if ".experts." in n})
    return out


def _features(w1, w3, w2):
    parts = [m / np.linalg.norm(m) for m in (w1, w3, w2.T)]
    f = np.concatenate(parts, 1)
    return f / np.linalg.norm(f, axis=1, keepdims=True)


def reference_merge(tensors, layer, group):
    """NumPy: the group's MXFP4 experts decoded, each other expert's neurons matched to the
    kept one's by scipy's Hungarian assignment, averaged with the group's weights."""
    from scipy.optimize import linear_sum_assignment

    pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
    load = lambda e: [mxfp4_decode(tensors[f"{pre}.{e}.{w}.weight_packed"],
                                   tensors[f"{pre}.{e}.{w}.weight_scale"]) for w in ("w1", "w3", "w2")]
    ref = load(group[0][0])
    total = sum(wt for _, wt in group)
    acc = [m * group[0][1] for m in ref]
    for e, wt in group[1:]:
        o = load(e)
        _, cols = linear_sum_assignment(-(_features(*ref) @ _features(*o).T))
        o = [o[0][cols], o[1][cols], o[2][:, cols]]
        acc = [a + wt * m for a, m in zip(acc, o)]
    return [a / total for a in acc]


@pytest.fixture(scope="module")
def merged_build(tmp_path_factory):
    from kimi_mlx.commands.main import main as cli_main

    out = tmp_path_factory.mktemp("merge") / "m25"
    assert cli_main(["prune", "--model", str(MICRO_MOE), "--calib",
                     str(MICRO_MOE / "calib" / "code.txt"), str(MICRO_MOE / "calib" / "data.txt"),
                     "--keep", "0.25", "--merge", "--calib-tokens", "2048", "--seq-len", "256",
                     "--merge-tokens", "512", "--out", str(out), "--quiet"]) == 0
    return out


def _kept(build):
    """{layer (str): kept source expert ids} from the build's saliency.json."""
    rows = json.loads((build / "saliency.json").read_text())["layers"]
    return {str(r["layer"]): sorted(r["kept"]) for r in rows}


def test_merge_build_equals_a_numpy_merge_and_reports_its_error(merged_build):
    info = json.loads((merged_build / "saliency.json").read_text())["merge"]
    src, got = _source_tensors(MICRO_MOE), _source_tensors(merged_build)
    kept = _kept(merged_build)
    assert info["dropped"] == 5 * 24 and info["merged"] > 0
    checked = 0
    for layer, entry in info["layers"].items():
        ids = kept[layer]
        into = {int(d): int(k) for k, g in entry["groups"].items() for d, _ in g[1:]}
        assert sorted(into) == sorted(set(range(32)) - set(ids))  # every dropped expert goes somewhere
        for k, group in list(entry["groups"].items())[:2]:
            want = reference_merge(src, int(layer), [(int(e), w) for e, w in group])
            new = ids.index(int(k))
            pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{new}"
            for w, ref in zip(("w1", "w3", "w2"), want):
                back = mxfp4_decode(got[f"{pre}.{w}.weight_packed"], got[f"{pre}.{w}.weight_scale"])
                err = np.linalg.norm(back - ref) / np.linalg.norm(ref)
                assert err == pytest.approx(info["requant_error"]["per_projection"][f"{layer}.{k}.{w}"],
                                            rel=1e-3, abs=1e-4)
                assert err < 0.2
                checked += 1
    assert checked >= 10
    assert "## Merging" in (merged_build / "README.md").read_text()


def test_merge_build_generates_as_a_reference_model_of_the_merged_weights(merged_build):
    """Greedy tokens and logits of the build loaded by mlx-lm against our loader's
    unpruned source with the dropped experts never selected (correction bias -1e4) and the
    kept ones' weights set to the NumPy merge (MXFP4 by MLX's quantizer)."""
    import mlx_lm

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.testing.checkpoints import reduction_length, tolerance

    info = json.loads((merged_build / "saliency.json").read_text())
    src = _source_tensors(MICRO_MOE)
    ref, _, _ = load_model(MICRO_MOE, verbose=False)
    for layer in ref.layers:
        if "block_sparse_moe" not in layer:
            continue
        moe, l = layer.block_sparse_moe, str(layer.idx)
        mask = np.full(32, -1e4, np.float32)
        mask[_kept(merged_build)[l]] = 0.0
        moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias + mx.array(mask)
        for k, group in info["merge"]["layers"][l]["groups"].items():
            merged = reference_merge(src, layer.idx, [(int(e), w) for e, w in group])
            for proj, m in zip(("gate_proj", "up_proj", "down_proj"), merged):
                lin = getattr(moe.switch_mlp, proj)
                q, s = mx.quantize(mx.array(m.astype(np.float32)), group_size=32, bits=4, mode="mxfp4")
                w, sc = np.array(lin.weight), np.array(lin.scales)
                w[int(k)], sc[int(k)] = np.array(q), np.array(s)
                lin.weight, lin.scales = mx.array(w), mx.array(sc)
    m, tok = mlx_lm.load(str(merged_build))
    m.activation_dtype = mx.float32
    ids = tok.encode("def parse(line):\n    return")
    x = mx.array([ids])
    want, got = np.array(ref(x)), np.array(m(x).astype(mx.float32))
    tol = tolerance(ref.args.num_hidden_layers, reduction_length(ref.args, x.shape[1]))
    assert np.abs(got - want).max() / np.abs(want).max() <= 10 * tol
    seq_ref, seq_got = list(ids), list(ids)
    for _ in range(8):
        seq_ref.append(int(np.argmax(np.array(ref(mx.array([seq_ref])))[0, -1])))
        seq_got.append(int(np.argmax(np.array(m(mx.array([seq_got])).astype(mx.float32))[0, -1])))
    assert seq_got == seq_ref


def test_merge_needs_calibration_and_a_token_count(tmp_path, capsys):
    from kimi_mlx.commands.main import main as cli_main

    base = ["prune", "--model", str(MICRO_MOE), "--keep", "0.5", "--out", str(tmp_path / "o")]
    assert cli_main(base + ["--method", "random", "--merge"]) == 2
    assert "with --merge needs calibration data" in capsys.readouterr().err
    assert cli_main(base + ["--merge", "--merge-tokens", "0", "--calib",
                            str(MICRO_MOE / "calib" / "code.txt")]) == 2
    assert "--merge-tokens must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_dry_run_states_the_peak_memory_at_k31_size(capsys):
    """What `prune --dry-run` prints for the shipped K3.1 config (sizes from a stand-in
    for the planner's ModelBytes, whose sizing takes ~15 s): the merge's addition is the
    E x E similarities of 92 MoE layers, one layer's sums and the largest output chunk
    (arithmetic here), far below holding the sampled outputs (210 GB a layer)."""
    from types import SimpleNamespace

    from kimi_mlx.prune.cli import print_peak_memory

    before = SimpleNamespace(layers=[SimpleNamespace(weight_bytes=10**9),
                                     SimpleNamespace(weight_bytes=17 * 10**9)],
                             embed_bytes=2 * 10**9)
    print_peak_memory("moonshotai/Kimi-K3.1-Pro", before, 131072, 16384, 16384)
    out = capsys.readouterr().out
    assert "largest layer 17.00 GB" in out
    e, lat, chunk = 896, 3584, (1 << 30) // (896 * 3584 * 4)
    add = e * e * 4 * 92 + 3 * e * e * 8 + chunk * e * lat * 4
    assert f"during the pass +{add / 1e9:,.2f} GB" in out
    act = 131072 * 7168 * 2 * (1 + -(-93 // 12))  # h + AttnRes banks, BF16
    assert f"calibration activations {act / 1e9:,.2f} GB" in out
    refit = (16384 * 7168 * 4 + 896 * 7168 * 4 + 896 * 4) * 92
    assert f"+{refit / 1e9:,.2f} GB)" in out


def test_plan_groups_by_similarity_with_a_floor():
    """plan_merges on hand-made similarities: each dropped expert goes to its most similar
    kept one with its routed-token count as weight; below the floor it is not merged."""
    from kimi_mlx.prune.merge import SimilarityAccumulator, plan_merges

    acc = SimilarityAccumulator(4)
    acc._sim = np.array([[1, .2, .9, .1], [.2, 1, .3, .4], [.9, .3, 1, 0], [.1, .4, 0, 1]])
    counts = np.array([10, 20, 5, 7])
    all_ = plan_merges({1: acc}, {1: counts}, {1: [0, 1]})[1]
    assert all_.into == {2: 0, 3: 1}
    assert all_.groups == {0: [(0, 10.0), (2, 5.0)], 1: [(1, 20.0), (3, 7.0)]}
    floor = plan_merges({1: acc}, {1: counts}, {1: [0, 1]}, min_similarity=0.5)[1]
    assert floor.into == {2: 0} and floor.groups == {0: [(0, 10.0), (2, 5.0)]}
    with pytest.raises(ValueError, match="no expert similarity"):
        plan_merges({}, {1: counts}, {1: [0, 1]})


def test_similarity_sums_equal_a_numpy_computation():
    """SimilarityAccumulator on a micro-moe MoE layer against NumPy: router-logit
    correlation and output cosine of every expert pair over the same tokens."""
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.prune.merge import SimilarityAccumulator

    model, _, _ = load_model(MICRO_MOE, 1, 2, verbose=False)
    moe = model.layers[0].block_sparse_moe
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 128)).astype(np.float32)
    acc = SimilarityAccumulator(32)
    acc.add(moe, moe.switch_mlp, mx.array(x))
    mx.eval(*acc.pending())
    acc.flush()
    f64 = lambda a: np.array(a.astype(mx.float32), np.float64)
    logits = x @ f64(moe.gate.weight).T
    z = x @ f64(moe.routed_expert_down_proj.weight).T
    sw = moe.switch_mlp
    w = {p: [mxfp4_decode(np.array(getattr(sw, p).weight[e]).view(np.uint8),
                          np.array(getattr(sw, p).scales[e])) for e in range(32)]
         for p in ("gate_proj", "up_proj", "down_proj")}
    outs = np.stack([situ_expert(z, w["gate_proj"][e], w["up_proj"][e], w["down_proj"][e])
                     for e in range(32)])  # [E, n, latent]
    corr = np.corrcoef(logits.T)
    flat = outs.reshape(32, -1)
    cos = flat @ flat.T / np.outer(np.linalg.norm(flat, axis=1), np.linalg.norm(flat, axis=1))
    np.testing.assert_allclose(acc.similarity(), (corr + cos) / 2, atol=2e-3)
