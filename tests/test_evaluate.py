"""`kimi-mlx eval`: its perplexity equals one computed here from the model's logits."""

import math
import re

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.commands import main as cli
from kimi_mlx.generation.evaluate import expert_usage, perplexity, windows
from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.text.tokenizer import KimiTokenizer
from kimi_mlx.testing.checkpoints import margins, model_tolerance

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "The quick brown fox jumps over the lazy dog. " * 3
    + "\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
)


def _run_eval(capsys, *argv):
    rc = cli.main(["eval", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _field(out, name):
    m = re.search(rf"^{re.escape(name)}: ([0-9.]+)", out, re.M)
    assert m, f"no '{name}:' line in:\n{out}"
    return float(m.group(1))


def _reference_ppl(model, ids, seq_len):
    """NLL from raw logits, window by window, in float64 NumPy."""
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, seq_len):
        w = ids[start : start + seq_len + 1]
        logits = np.array(model(mx.array([w[:-1]])).astype(mx.float32), dtype=np.float64)[0]
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll -= logp[np.arange(len(w) - 1), w[1:]].sum()
        n += len(w) - 1
    return math.exp(nll / n), n


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    model, _, _ = load_model(tiny_ckpt, verbose=False)
    return model, KimiTokenizer.from_pretrained(tiny_ckpt)


def test_eval_prints_the_perplexity_of_the_logits(tiny_ckpt, loaded, tmp_path, capsys):
    model, tok = loaded
    data = tmp_path / "small.txt"
    data.write_text(TEXT, encoding="utf-8")
    ids = tok.encode(TEXT)
    assert len(ids) > 3 * 16  # several windows, the last one partial
    rc, out, err = _run_eval(capsys, "--model", tiny_ckpt, "--data", data, "--seq-len", 16)
    assert rc == 0, err
    want, n = _reference_ppl(model, ids, 16)
    assert _field(out, "perplexity") == pytest.approx(want, rel=1e-4)
    assert _field(out, "tokens") == n == len(ids) - 1
    assert _field(out, "tokens/s") > 0


def test_max_tokens_limits_the_predicted_tokens(tiny_ckpt, loaded, tmp_path, capsys):
    model, tok = loaded
    data = tmp_path / "small.txt"
    data.write_text(TEXT, encoding="utf-8")
    rc, out, _ = _run_eval(capsys, "--model", tiny_ckpt, "--data", data,
                           "--seq-len", 8, "--max-tokens", 20)
    assert rc == 0
    want, n = _reference_ppl(model, tok.encode(TEXT)[:21], 8)
    assert _field(out, "tokens") == n == 20
    assert _field(out, "perplexity") == pytest.approx(want, rel=1e-4)


def test_windows_predict_every_token_once():
    ids = list(range(23))
    ws = windows(ids, 5)
    assert [len(w) for w in ws] == [6, 6, 6, 6, 3]
    targets = [t for w in ws for t in w[1:]]
    assert targets == ids[1:]
    assert windows([7], 5) == []
    with pytest.raises(ValueError):
        windows(ids, 0)


def test_batched_equals_unbatched(loaded):
    model, tok = loaded
    ids = tok.encode(TEXT)
    with margins() as m:
        a = perplexity(model, ids, 8, batch_size=1)
        b = perplexity(model, ids, 8, batch_size=4)
    m.check(model_tolerance(model.args, 8))
    assert a.tokens == b.tokens == len(ids) - 1
    assert a.perplexity == pytest.approx(b.perplexity, rel=1e-5)


def test_expert_usage_rows_are_shares(loaded):
    model, tok = loaded
    usage = expert_usage(model, tok.encode(TEXT), 16)
    n_moe = sum(1 for l in model.layers if "block_sparse_moe" in l)
    assert usage.shape == (n_moe, model.args.num_experts)
    assert np.allclose(usage.sum(axis=1), 1.0)
    assert (usage >= 0).all()
    # the recording hook is removed afterwards
    assert all("route" not in vars(l.block_sparse_moe) for l in model.layers if "block_sparse_moe" in l)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/nonexistent/file.txt"], "--data /nonexistent/file.txt: no such file"),
        (["--data", "/"], "--data /: not a file"),
        (["--seq-len", "0"], "--seq-len"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_ckpt, tmp_path, capsys, extra, message):
    data = tmp_path / "small.txt"
    data.write_text(TEXT, encoding="utf-8")
    argv = ["--model", tiny_ckpt, "--data", data] + extra
    rc, _, err = _run_eval(capsys, *argv)
    assert rc == 2
    assert "kimi-mlx eval: error:" in err and message in err


def test_too_short_and_non_utf8_files(tiny_ckpt, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("", encoding="utf-8")
    rc, _, err = _run_eval(capsys, "--model", tiny_ckpt, "--data", short)
    assert rc == 2 and "fewer than 2 tokens" in err
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc\xc3")
    rc, _, err = _run_eval(capsys, "--model", tiny_ckpt, "--data", binary)
    assert rc == 2 and "not UTF-8" in err
