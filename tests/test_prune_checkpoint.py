"""`kimi-mlx prune` end to end on small official-layout checkpoints."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.prune.calib import load_calibration
from kimi_mlx.prune.observe import ExpertRecorder, LayerStats, observe
from kimi_mlx.prune.saliency import DEFAULT_GATE, DEFAULT_METHOD, select
from kimi_mlx.testing.prune import moe_text_config, set_router_bias, write_code_text
from kimi_mlx.checkpoint.shards import read_header, weight_map
from kimi_mlx.testing.checkpoints import build_checkpoint, full_config, random_model
from kimi_mlx.text.tokenizer import KimiTokenizer

E, K, DEAD = 16, 2, 3  # experts, top-k, the expert the router can never pick


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """6 layers (5 MoE, KDA + DSA, AttnRes blocks of 2), 16 experts top-2; expert 3's
    correction bias is -100 in every layer, so calibration never routes to it."""
    cfg = moe_text_config(num_experts=E, top_k=K)
    model = random_model(ModelArgs.from_config(full_config(cfg)), seed=1)
    set_router_bias(model, DEAD, -100.0)
    return build_checkpoint(tmp_path_factory.mktemp("prune") / "src", cfg, model=model)


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    return write_code_text(tmp_path_factory.mktemp("data") / "code.txt", n=120)


def calib_set(src, code, seq_len=96, tokens=1200):
    return load_calibration([code], lambda: KimiTokenizer.from_pretrained(src), seq_len=seq_len,
                            max_tokens=tokens)


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())}


def run(argv, capsys):
    code = cli_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def prune_args(src, code, out, *extra):
    return ["prune", "--model", str(src), "--calib", str(code), "--out", str(out),
            "--seq-len", "96", "--calib-tokens", "1200", "--quiet", *extra]


@pytest.fixture(scope="module")
def pruned(src, code, tmp_path_factory):
    """REAP, keep 0.5, run once through the command line."""
    out = tmp_path_factory.mktemp("out") / "half"
    before = digest(src)
    assert cli_main(prune_args(src, code, out, "--keep", "0.5")) == 0
    assert digest(src) == before, "the source must never be modified"
    return out


def test_keep_one_gives_the_same_logits_exactly(src, code, tmp_path, capsys):
    out = tmp_path / "full"
    code_, _, err = run(prune_args(src, code, out, "--keep", "1.0", "--heldout-tokens", "0"), capsys)
    assert code_ == 0, err
    x = mx.array([list(range(5, 70, 3))])
    a, _, _ = load_model(src, verbose=False)
    b, _, _ = load_model(out, verbose=False)
    assert mx.array_equal(a(x), b(x)).item()
    # Every tensor byte-identical, under the same name, in the same shard file.
    wa, wb = weight_map(src), weight_map(out)
    assert wa == wb
    for shard in set(wa.values()):
        ha, hb = read_header(src / shard), read_header(out / shard)
        assert ha.keys() == hb.keys()
        with open(src / shard, "rb") as fa, open(out / shard, "rb") as fb:
            for name, ia in ha.items():
                ib = hb[name]
                fa.seek(ia.start)
                fb.seek(ib.start)
                assert fa.read(ia.nbytes) == fb.read(ib.nbytes), name


def test_pruned_checkpoint_layout(src, pruned):
    cfg = json.loads((pruned / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    assert cfg["text_config"]["num_experts"] == E // 2
    assert cfg["text_config"]["num_experts_per_token"] == K
    assert cfg["quantization_config"] == src_cfg["quantization_config"]
    report = json.loads((pruned / "saliency.json").read_text())
    assert report["method"] == DEFAULT_METHOD and report["experts_kept_per_layer"] == E // 2
    assert report["gate"] == "softmax"
    assert [l["layer"] for l in report["layers"]] == [1, 2, 3, 4, 5]
    wm_src, wm = weight_map(src), weight_map(pruned)
    for entry in report["layers"]:
        layer, kept = entry["layer"], entry["kept"]
        assert len(kept) == E // 2 and DEAD in entry["dropped"]
        moe = f"language_model.model.layers.{layer}.block_sparse_moe"
        for new, old in enumerate(kept):  # expert bytes copied unchanged, renumbered
            for w in ("w1", "w2", "w3"):
                for f in ("weight_packed", "weight_scale"):
                    a = f"{moe}.experts.{old}.{w}.{f}"
                    b = f"{moe}.experts.{new}.{w}.{f}"
                    assert _bytes(src, wm_src, a) == _bytes(pruned, wm, b)
        assert f"{moe}.experts.{E // 2}.w1.weight_packed" not in wm
        # Router rows and correction bias: the kept experts' entries, in order.
        for t in ("gate.weight", "gate.e_score_correction_bias"):
            a = np.array(mx.load(str(src / wm_src[f"{moe}.{t}"]))[f"{moe}.{t}"].astype(mx.float32))
            b = np.array(mx.load(str(pruned / wm[f"{moe}.{t}"]))[f"{moe}.{t}"].astype(mx.float32))
            np.testing.assert_array_equal(a[kept], b)
    # Everything that is not an expert or router tensor is carried over unchanged.
    for name, shard in wm_src.items():
        if ".experts." not in name and ".gate." not in name:
            assert _bytes(src, wm_src, name) == _bytes(pruned, wm, name), name
    for f in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        assert (pruned / f).read_bytes() == (src / f).read_bytes()
    png = (pruned / "saliency.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    card = (pruned / "README.md").read_text()
    assert "8 of 16 kept" in card and "code.txt" in card and "REAP" in card and "MB" in card
    assert not [p for p in pruned.parent.iterdir() if p.name.startswith(".")]


def _bytes(folder, wm, name):
    info = read_header(folder / wm[name])[name]
    with open(folder / wm[name], "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def test_pruned_checkpoint_loads_in_stages_and_the_planner(pruned):
    full, _, _ = load_model(pruned, verbose=False)
    x = mx.array([[7, 8, 9, 10, 11, 12]])
    want = full(x)
    # What a pipeline stage does: two layer ranges, banks and partial sum across the hop.
    a, _, _ = load_model(pruned, 0, 3, verbose=False)
    b, _, _ = load_model(pruned, 3, 6, verbose=False)
    from kimi_mlx.model.attn_res import Banks

    h, banks = a.text.run_layers(a.text.embed(x), Banks(a.args.rms_norm_eps))
    h, banks = b.text.run_layers(h, Banks.from_stacked(banks.stack(), b.args.rms_norm_eps))
    got = b.language_model.logits(b.text.finish(h, banks))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    from kimi_mlx.placement.layer_bytes import model_bytes

    mb = model_bytes(str(pruned))
    assert mb.num_experts == E // 2


def test_pruned_checkpoint_in_generate_and_mlx_lm(pruned, capsys):
    code, out, err = run(["generate", "--model", str(pruned), "--prompt", "def f",
                          "--max-tokens", "4", "--ignore-chat-template"], capsys)
    assert code == 0, err
    script = (f"import mlx_lm\nm, t = mlx_lm.load({str(pruned)!r})\n"
              "print(mlx_lm.generate(m, t, prompt='def f', max_tokens=3) is not None)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]


def test_never_routed_expert_is_counted_zero_and_dropped_first(src, code, tmp_path, capsys):
    calib = calib_set(src, code)
    res = observe(src, calib, progress=False)
    assert sorted(res.stats) == [1, 2, 3, 4, 5]
    for st in res.stats.values():
        assert st.count[DEAD] == 0 and st.tokens == calib.num_tokens
        assert st.count.sum() == K * calib.num_tokens
        assert (np.delete(st.count, DEAD) > 0).any()
    # Some layer may leave another expert unrouted by chance: keep E - 2, so every
    # never-routed expert must be among the dropped ones, the forced one included, by
    # every method (the selection `prune` makes from these statistics, the command's
    # default gate and budget) ...
    unrouted = {l: {j for j, c in enumerate(st.count) if c == 0} for l, st in res.stats.items()}
    for l, u in unrouted.items():
        assert DEAD in u and len(u) <= 2, (l, u)
    for method in ("reap", "reap-sum", "frequency", "ean"):
        sel = select(res.stats, method, E - 2, gate=DEFAULT_GATE, budget="auto")
        for l, u in unrouted.items():
            assert u.isdisjoint(sel.kept[l]), (method, l, sel.kept[l])
    # ... and through the command line (no held-out text, so it calibrates on the same
    # tokens): the same counts in saliency.json, the unrouted experts dropped.
    out = tmp_path / "cli"
    code_, _, err = run(prune_args(src, code, out, "--experts", str(E - 2), "--method", "ean",
                                   "--heldout-tokens", "0"), capsys)
    assert code_ == 0, err
    for l in json.loads((out / "saliency.json").read_text())["layers"]:
        assert l["count"] == res.stats[l["layer"]].count.tolist()
        assert unrouted[l["layer"]] <= set(l["dropped"]), l["layer"]


def test_streamed_statistics_equal_a_whole_model_forward(src, code):
    """Layer-by-layer streaming (h + AttnRes banks across layers, one layer's cache) gives
    the statistics of recording on the whole model in one forward pass."""
    calib = calib_set(src, code)
    streamed = observe(src, calib, progress=False).stats
    model, _, _ = load_model(src, verbose=False)
    whole = {}
    recs = []
    for layer in model.layers:
        if "block_sparse_moe" in layer:
            whole[layer.idx] = LayerStats(layer.idx, E, K)
            recs.append(ExpertRecorder(layer.block_sparse_moe, whole[layer.idx]).install())
    for ids in calib.sequences:
        logits = model(mx.array([ids]), cache=model.make_cache())
        mx.eval(logits, *[a for r in recs for a in r.pending()])
        for r in recs:
            r.flush()
    for l, st in streamed.items():
        np.testing.assert_array_equal(st.count, whole[l].count)
        for f in ("gate_sum", "norm_sum", "gate_norm_sum", "max_abs"):
            np.testing.assert_allclose(getattr(st, f), getattr(whole[l], f), rtol=1e-6, err_msg=f)


def test_activations_on_disk_give_the_same_statistics(src, code, tmp_path):
    calib = calib_set(src, code)
    mem = observe(src, calib, progress=False)
    disk = observe(src, calib, progress=False, spill_dir=tmp_path / "spill", activation_budget=0)
    assert disk.spilled and not mem.spilled and not (tmp_path / "spill").exists()
    for l in mem.stats:
        for f in ("count", "gate_sum", "norm_sum", "gate_norm_sum", "max_abs"):
            np.testing.assert_array_equal(getattr(mem.stats[l], f), getattr(disk.stats[l], f))


def test_chunked_prefill_with_the_layer_cache(src, code):
    calib = calib_set(src, code)
    whole = observe(src, calib, progress=False).stats
    chunked = observe(src, calib, progress=False, chunk=32).stats
    for l in whole:
        assert np.abs(whole[l].count - chunked[l].count).sum() <= 0.02 * whole[l].count.sum()
        np.testing.assert_allclose(chunked[l].norm_sum, whole[l].norm_sum, rtol=0.05)


def test_chat_records_go_through_the_chat_encoding(src, tmp_path):
    from kimi_mlx.text.chat_format import encode_chat

    tok = KimiTokenizer.from_pretrained(src)
    msgs = [{"role": "user", "content": "sum two numbers"},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"}]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n\n" + json.dumps({"prompt": "x =", "completion": " 1"}) + "\n")
    cs = load_calibration([f], lambda: tok, seq_len=4096, max_tokens=None)
    assert sorted(map(tuple, cs.sequences)) == sorted([
        tuple(encode_chat(tok, msgs, add_generation_prompt=False)), tuple(tok.encode("x = 1"))])
    assert cs.kinds == {"chat": 1, "text": 1}


def test_dry_run_prints_sizes_and_fits_without_writing(src, tmp_path, capsys):
    out = tmp_path / "never"
    code_, text, err = run(["prune", "--model", str(src), "--keep", "0.5", "--out", str(out),
                            "--dry-run", "--macs", "1x64GB"], capsys)
    assert code_ == 0, err
    assert "16->8" in text and "total" in text and "1x64GB: yes" in text
    assert not out.exists()


def test_dry_run_of_the_release_from_its_shipped_config(capsys):
    code_, text, err = run(["prune", "--model", "moonshotai/Kimi-K3.1-Pro", "--keep", "0.2",
                            "--dry-run"], capsys)
    assert code_ == 0, err
    assert "896->179" in text and "1,560.323" in text
    assert "1x512GB: yes" in text and "1x256GB: no" in text


@pytest.mark.e2e  # 2 stage processes of its own on loopback serving the build, a launch and generate (make test-e2e)
def test_pruned_checkpoint_in_the_cluster(pruned, tmp_path):
    """Two `kimi-mlx cluster serve` stages on loopback print what `generate` prints."""
    from kimi_mlx.testing.prune import cluster_and_generate, reply_lines

    launch, gen = cluster_and_generate(pruned, tmp_path)
    assert launch.returncode == 0 and gen.returncode == 0, launch.stderr[-2000:] + gen.stderr[-2000:]
    assert reply_lines(launch.stdout) == reply_lines(gen.stdout) and reply_lines(gen.stdout)
