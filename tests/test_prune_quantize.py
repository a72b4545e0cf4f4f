"""Trunk / expert quantization (`kimi-mlx convert`, `prune --q-bits`) against mlx-lm's own
quantization of the same weights, loading everywhere, bad input, and planned sizes."""

import errno
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.model.model import Model
from kimi_mlx.prune import writer
from kimi_mlx.testing.prune import moe_text_config, write_code_text
from kimi_mlx.checkpoint.shards import read_header, weight_map
from kimi_mlx.model.tensor_map import quantizable
from kimi_mlx.testing.checkpoints import build_checkpoint, full_config

E, K, G = 16, 2, 32  # experts, top-k, group size (the tiny model's widths are 16..64)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("q") / "src",
                            moe_text_config(num_layers=4, num_experts=E, top_k=K))


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir()) if p.is_file()}


def convert(src, out, *flags):
    return cli_main(["convert", "--model", str(src), "--out", str(out), "--quiet", *flags])


@pytest.fixture(scope="module")
def q4(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "q4"
    before = digest(src)
    assert convert(src, out, "--q-bits", "4", "--q-group-size", str(G)) == 0
    assert digest(src) == before, "the source must never be modified"
    return out


def mlx_lm_reference(src, bits, group, expert_bits=None):
    """The source loaded, then quantized by mlx-lm's `quantize_model` (what mlx_lm.convert
    runs) with kimi_k3's predicate (all linears but `*res_proj`) less kv_b_proj, which the
    model reads as a matrix; experts requantized by dequantize -> mx.quantize."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import quantize_model

    model, config, _ = load_model(src, verbose=False)
    skip = ("res_proj", "kv_b_proj")
    if bits is not None:
        quantize_model(model, config, group, bits,
                       quant_predicate=lambda p, m: "switch_mlp" not in p and not p.endswith(skip))
    if expert_bits is not None:
        for layer in model.layers:
            if "block_sparse_moe" not in layer:
                continue
            sw = layer.block_sparse_moe.switch_mlp
            for name in ("gate_proj", "up_proj", "down_proj"):
                m = sw[name]
                dense = mx.dequantize(m.weight, m.scales, group_size=32, bits=4, mode="mxfp4",
                                      dtype=mx.bfloat16)
                new = QuantizedSwitchLinear(dense.shape[-1], dense.shape[-2], dense.shape[0],
                                            False, G, expert_bits, "affine")
                new.weight, new.scales, new.biases = mx.quantize(dense, G, expert_bits, mode="affine")
                sw[name] = new
    return model


def assert_same_parameters(got, want):
    a, b = dict(tree_flatten(got.parameters())), dict(tree_flatten(want.parameters()))
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:10]
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k], b[k]).item(), k


def test_quantizable_table_names_the_models_linear_layers():
    """`tensor_map.quantizable` (a name table, used by the writer and the planner) covers
    exactly the model's Linear / Embedding modules outside the routed experts, less the
    AttnRes mixing projections and kv_b_proj."""
    args = ModelArgs.from_config(full_config(moe_text_config(num_layers=6)))
    model = Model(args)
    linears = {p for p, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)) and "switch_mlp" not in p}
    want = {p for p in linears if not p.endswith(("res_proj", "kv_b_proj"))}
    assert len(want) > 20
    assert {p for p in linears if quantizable(p + ".weight")} == want
    assert not quantizable("language_model.model.layers.1.block_sparse_moe.gate.weight")
    assert not quantizable("language_model.model.layers.1.self_attn.q_conv1d.weight")


def test_convert_equals_mlx_lm_quantization_and_keeps_the_rest(src, q4):
    got, config, _ = load_model(q4, verbose=False)
    assert_same_parameters(got, mlx_lm_reference(src, 4, G))
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": G, "bits": 4, "mode": "affine"}
    # Stored bytes: quantized trunk tensors are new; everything else is the source's.
    swm, qwm = weight_map(src), weight_map(q4)
    quantized = [n for n in swm if quantizable(n) and read_header(src / swm[n])[n].shape[-1] % G == 0]
    assert len(quantized) > 20
    for n in quantized:
        base = n[: -len(".weight")]
        h = read_header(q4 / qwm[n])
        assert h[n].dtype == "U32" and h[f"{base}.scales"].dtype == "BF16" and f"{base}.biases" in h
    for n in set(swm) - set(quantized):
        assert _bytes(src, swm, n) == _bytes(q4, qwm, n), n
    x = mx.array([[5, 6, 7, 8, 9]])
    ref = mlx_lm_reference(src, 4, G)
    np.testing.assert_array_equal(np.array(got(x)), np.array(ref(x)))


def _bytes(folder, wm, name):
    info = read_header(folder / wm[name])[name]
    with open(folder / wm[name], "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def test_expert_requantization_equals_a_reference(src, tmp_path):
    out = tmp_path / "e3"
    assert convert(src, out, "--expert-bits", "3", "--expert-group-size", str(G)) == 0
    got, _, _ = load_model(out, verbose=False)
    sw = got.layers[1].block_sparse_moe.switch_mlp.gate_proj
    assert (sw.mode, sw.bits, sw.group_size) == ("affine", 3, G)
    assert_same_parameters(got, mlx_lm_reference(src, None, G, expert_bits=3))
    assert not any(n.endswith("weight_packed") for n in weight_map(out))


def test_quantized_build_loads_in_stages_mlx_lm_and_generate(q4, capsys):
    from kimi_mlx.model.attn_res import Banks

    full, _, _ = load_model(q4, verbose=False)
    x = mx.array([[7, 8, 9, 10, 11, 12]])
    want = full(x)
    a, _, _ = load_model(q4, 0, 2, verbose=False)
    b, _, _ = load_model(q4, 2, 4, verbose=False)
    assert isinstance(a.text.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(b.language_model.lm_head, nn.QuantizedLinear)
    h, banks = a.text.run_layers(a.text.embed(x), Banks(a.args.rms_norm_eps))
    h, banks = b.text.run_layers(h, Banks.from_stacked(banks.stack(), b.args.rms_norm_eps))
    got = b.language_model.logits(b.text.finish(h, banks))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)

    assert cli_main(["generate", "--model", str(q4), "--prompt", "def f", "--max-tokens", "4",
                     "--ignore-chat-template"]) == 0
    capsys.readouterr()
    script = (f"import mlx.core as mx, mlx_lm, numpy as np\nm, t = mlx_lm.load({str(q4)!r})\n"
              "m.activation_dtype = mx.float32\n"  # as our loader picks on CPU
              "print(np.array(m(mx.array([[7, 8, 9, 10, 11, 12]]), None).astype(mx.float32)).tobytes().hex())\n"
              "print(mlx_lm.generate(m, t, prompt='def f', max_tokens=3) is not None)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    logits_hex, ok = res.stdout.split()
    mlx_lm_logits = np.frombuffer(bytes.fromhex(logits_hex), np.float32).reshape(want.shape)
    np.testing.assert_allclose(mlx_lm_logits, np.array(want), rtol=1e-5, atol=1e-5)
    assert ok == "True"


def test_prune_with_q_bits_is_prune_then_convert(src, tmp_path, capsys):
    code = write_code_text(tmp_path / "code.txt", n=40)
    common = ["--calib", str(code), "--keep", "0.5", "--quiet", "--seq-len", "64",
              "--calib-tokens", "300"]
    assert cli_main(["prune", "--model", str(src), "--out", str(tmp_path / "p"), *common]) == 0
    assert cli_main(["prune", "--model", str(src), "--out", str(tmp_path / "pq"), *common,
                     "--q-bits", "6", "--q-group-size", str(G)]) == 0
    assert convert(tmp_path / "p", tmp_path / "p_then_q", "--q-bits", "6", "--q-group-size", str(G)) == 0
    capsys.readouterr()
    one, _, _ = load_model(tmp_path / "pq", verbose=False)
    two, _, _ = load_model(tmp_path / "p_then_q", verbose=False)
    assert_same_parameters(one, two)
    card = (tmp_path / "pq" / "README.md").read_text()
    assert "affine 6-bit, group size 32" in card
    assert json.loads((tmp_path / "pq" / "saliency.json").read_text())["quantization"]["bits"] == 6


def assert_nothing_left(parent):
    assert list(parent.iterdir()) == [], [p.name for p in parent.iterdir()]


def test_bad_input_is_refused_and_nothing_is_written(src, q4, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "outs"
    parent.mkdir()
    with pytest.raises(SystemExit) as e:  # argparse: no such mode
        convert(src, parent / "o", "--q-bits", "7")
    assert e.value.code == 2 and "invalid choice: 7" in capsys.readouterr().err
    assert convert(q4, parent / "o", "--q-bits", "4") == 2
    assert "the trunk is already quantized" in capsys.readouterr().err
    assert convert(src, src / "inside", "--q-bits", "4") == 2
    assert "must not be, contain or sit inside the source" in capsys.readouterr().err
    assert not (src / "inside").exists()
    assert convert(src, parent / "o") == 2 and "--q-bits" in capsys.readouterr().err
    assert_nothing_left(parent)

    # A full disk in the middle of the write: the first shard lands, the second fails.
    real, calls = writer.write_shard, []

    def write_shard(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "simulated")
        return real(path, *a, **k)

    monkeypatch.setattr(writer, "write_shard", write_shard)
    assert convert(src, parent / "o", "--q-bits", "4") == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and str(parent / "o") in err
    assert len(calls) == 2
    assert_nothing_left(parent)


def _files(folder):
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _printed_bytes(text, prefix):
    line = next(l for l in text.splitlines() if l.startswith(prefix))
    return int(line.split("(")[-1].split(" bytes")[0].replace(",", ""))


def test_planned_build_size_equals_the_files_written(src, q4, tmp_path, capsys):
    """`plan` and `prune --dry-run` print the build's size before anything is read; it
    must be what the writer then writes (tensors + headers), to 0.5%."""
    e3 = tmp_path / "e3"
    assert convert(src, e3, "--expert-bits", "3", "--expert-group-size", str(G)) == 0
    code = write_code_text(tmp_path / "code.txt", n=40)
    pq = tmp_path / "pq"
    assert cli_main(["prune", "--model", str(src), "--out", str(pq), "--calib", str(code),
                     "--keep", "0.5", "--quiet", "--seq-len", "64", "--calib-tokens", "300",
                     "--q-bits", "6", "--q-group-size", str(G)]) == 0
    capsys.readouterr()
    cases = [(q4, ["--q-bits", "4", "--q-group-size", str(G)]),
             (e3, ["--expert-bits", "3", "--expert-group-size", str(G)]),
             (pq, ["--keep", "0.5", "--q-bits", "6", "--q-group-size", str(G)])]
    for built, flags in cases:
        assert cli_main(["plan", "--model", str(src), *flags]) == 0
        planned = _printed_bytes(capsys.readouterr().out, "build:")
        assert abs(planned / _files(built) - 1) < 0.005, (built.name, planned, _files(built))
    assert cli_main(["prune", "--model", str(src), "--dry-run", "--keep", "0.5", "--q-bits", "6",
                     "--q-group-size", str(G)]) == 0
    dry = _printed_bytes(capsys.readouterr().out, "build size:")
    assert abs(dry / _files(pq) - 1) < 0.005
    # Quantization must show in the size: q4 is well under the BF16 source.
    assert _files(q4) < 0.8 * _files(src)


def test_release_build_sizes_offline(capsys):
    """The official model at keep 0.2 with a q6 trunk fits one 512 GB Mac (sizes from the
    shipped config, nothing read); q8 / q6 / q4 steps save 2 bits x trunk parameters."""
    from kimi_mlx.placement.layer_bytes import BuildSpec, model_bytes

    assert cli_main(["plan", "--model", "moonshotai/Kimi-K3.1-Pro", "--keep", "0.2",
                     "--q-bits", "6"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("fits") and "512GB m3-ultra" in out  # one 512 GB Mac
    sizes = {6: _printed_bytes(out, "build:")}
    for bits in (4, 8):
        sizes[bits] = model_bytes("moonshotai/Kimi-K3.1-Pro", BuildSpec(179, bits)).file_bytes
    assert sizes[8] > sizes[6] > sizes[4]
    # Equal steps (the scales / biases are the same; only the digits of packed widths in
    # the headers differ).
    assert abs((sizes[8] - sizes[6]) - (sizes[6] - sizes[4])) < 10_000
    assert 300e9 < sizes[4] < 340e9 and sizes[8] < 512e9


@pytest.mark.e2e  # 2 stage processes of its own on loopback serving the build, a launch and generate (make test-e2e)
def test_quantized_build_in_the_cluster(q4, tmp_path):
    """Two `kimi-mlx cluster serve` stages on loopback print what `generate` prints, and
    the planner sizes the stages from the quantized tensors."""
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.testing.prune import cluster_and_generate, reply_lines

    assert model_bytes(str(q4)).file_bytes == _files(q4)  # real headers: exact
    launch, gen = cluster_and_generate(q4, tmp_path)
    assert launch.returncode == 0 and gen.returncode == 0, launch.stderr[-2000:] + gen.stderr[-2000:]
    assert reply_lines(launch.stdout) == reply_lines(gen.stdout) and reply_lines(gen.stdout)
