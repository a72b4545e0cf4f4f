"""The shipped micro checkpoint (`kimi_mlx/assets/micro`) has learned real text.

Figures the training run stored in `eval.json` (see MODEL_CARD.md) are checked against
what the shipped files give now, through the same code paths users run: the loader, the
tokenizer, mlx-lm's generation loop and `kimi_mlx.generation.evaluate`.
"""

import json

import numpy as np
import pytest

from kimi_mlx.model.config import ARCHITECTURE, ModelArgs
from kimi_mlx.generation.evaluate import expert_usage, perplexity, read_tokens
from kimi_mlx.generation.generate import default_model, resolve_model_arg, stream
from kimi_mlx.sampling import Sampling
from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.checkpoint.loader import load_model, read_header
from kimi_mlx.micro.corpus import build_corpus
from kimi_mlx.testing.checkpoints import F32_SUFFIXES
from kimi_mlx.text.tokenizer import KimiTokenizer, kimi_special_tokens

ASSET = default_model()
pytestmark = pytest.mark.skipif(ASSET is None, reason="no shipped micro checkpoint")
INFO = json.loads((ASSET / "eval.json").read_text()) if ASSET else {}
DOMAINS = ("code", "prose")

# A passage of the training text (prose domain: the stdlib LICENSE.txt, which training
# shows more often on purpose, see MODEL_CARD.md) that greedy decoding reproduces: the
# prompt is its first PROMPT_TOKENS tokens, the rest must follow token for token. At
# training time the smallest top-1 / top-2 logit gap along it was 1.4 nats (float32 and
# bfloat16 activations alike), so it does not hinge on rounding.
PASSAGE = (
    "Permission to use, copy, modify, and distribute this software and its\n"
    "documentation for any purpose and without fee is hereby granted,\n"
    "provided that the above copyright notice appear in all copies and that"
)
PASSAGE_DOMAIN = "prose"
PROMPT_TOKENS = 24
CONTINUATION_TOKENS = 32


@pytest.fixture(scope="module")
def shipped():
    model, config, _ = load_model(ASSET, verbose=False)
    return model, KimiTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def heldout(shipped):
    """The first `test_subset` held-out tokens of each domain (as measured at training)."""
    _, tok = shipped
    n = INFO["eval"]["test_subset"]["tokens"]
    return {d: read_tokens(tok, ASSET / "heldout" / f"{d}.txt", n) for d in DOMAINS}


def test_checkpoint_is_in_the_official_layout_and_small():
    names = {p.name for p in ASSET.iterdir()}
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 2
    for required in ("config.json", "model.safetensors.index.json", "tiktoken.model",
                     "tokenizer_config.json", "MODEL_CARD.md", "heldout", "calib"):
        assert required in names
    total = sum(p.stat().st_size for p in ASSET.rglob("*") if p.is_file())
    assert total < 25e6

    index = json.loads((ASSET / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == shards
    n_packed = 0
    for shard in shards:
        for name, info in read_header(ASSET / shard).items():
            assert index[name] == shard
            if ".experts." in name:
                assert name.endswith((".weight_packed", ".weight_scale")) and info.dtype == "U8"
                n_packed += 1
            elif name.endswith(F32_SUFFIXES):
                assert info.dtype == "F32", name
            else:
                assert info.dtype == "BF16", name
    assert n_packed > 0


def test_config_is_a_micro_k31():
    config = json.loads((ASSET / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    args = ModelArgs.from_config(config)
    n = args.num_hidden_layers
    assert not args.is_moe(0) and all(args.is_moe(i) for i in range(1, n))
    assert sum(args.is_dsa(i) for i in range(n)) >= 2
    assert sum(args.is_kda(i) for i in range(n)) >= 2
    assert args.attn_res_block_size and args.attn_res_block_size < n
    assert args.num_experts >= 32 and args.num_experts_per_token >= 4
    assert args.num_shared_experts == 1 and args.routed_expert_hidden_size
    assert args.hidden_act == "situ"
    assert 2000 <= args.vocab_size <= 10000
    assert args.index_topk * 2 <= INFO["training"]["seq_len"]  # trained on the sparse path
    assert args.quantization == {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def test_tokenizer_is_kimi_tiktoken_with_kimi_special_tokens(shipped):
    model, tok = shipped
    n = INFO["tokenizer"]["ranks"]
    assert tok.vocab_size == model.args.vocab_size == n + 256
    for name, tid in kimi_special_tokens(n).items():
        if not name.startswith("<|reserved"):
            assert tok.token_to_id(name) == tid
    text = "def f(x):\n    return x  # the licence grants you\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < n
    assert len(ids) < len(text) / 2  # the BPE ranks compress text


def test_generate_defaults_to_the_shipped_checkpoint():
    assert resolve_model_arg(None) == str(ASSET)
    assert (ASSET / "config.json").exists()


def _greedy(model_dir, prompt_ids, n):
    model, wrapper, _, _ = load_for_generation(str(model_dir))
    return [r.token for r in stream(model, wrapper, prompt_ids, Sampling(), n)]


def test_greedy_generation_continues_training_text(shipped):
    _, tok = shipped
    corpus = build_corpus()
    if corpus.fingerprint == INFO["corpus"]["fingerprint"]:  # same stdlib as at training
        assert PASSAGE in corpus.text("train", PASSAGE_DOMAIN)
        assert PASSAGE not in corpus.text("heldout", PASSAGE_DOMAIN)
    ids = tok.encode(PASSAGE)
    prompt, want = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : PROMPT_TOKENS + CONTINUATION_TOKENS]
    assert len(want) == CONTINUATION_TOKENS
    got = _greedy(ASSET, prompt, CONTINUATION_TOKENS)
    assert tok.decode(got) == tok.decode(want)
    assert got == want


def test_heldout_perplexity_is_far_below_uniform_and_mxfp4_matches_bf16(shipped, heldout):
    model, _ = shipped
    stored = INFO["eval"]["test_subset"]
    uniform = model.args.vocab_size
    for d in DOMAINS:
        ppl = perplexity(model, heldout[d], stored["seq_len"]).perplexity
        assert ppl < uniform / 20, (d, ppl)
        # what training measured on these files, and within 5% of the BF16 model
        assert ppl == pytest.approx(stored["mxfp4"][d], rel=1e-3)
        assert abs(ppl / stored["bf16"][d] - 1) < 0.05, (d, ppl, stored["bf16"][d])


def test_prompts_longer_than_index_topk_keep_their_perplexity(shipped, heldout):
    """Windows of 4 x index_topk (sparse attention past index_topk) vs windows of
    index_topk (always dense): no more than 10% worse."""
    model, _ = shipped
    topk = model.args.index_topk
    for d in DOMAINS:
        short = perplexity(model, heldout[d], topk).perplexity
        long = perplexity(model, heldout[d], 4 * topk).perplexity
        assert long < 1.10 * short, (d, short, long)


def test_eval_command_on_the_default_model(capsys):
    """`kimi-mlx eval` without --model measures the shipped checkpoint."""
    from kimi_mlx.commands import main as cli

    stored = INFO["eval"]["test_subset"]
    data = ASSET / "heldout" / "prose.txt"
    rc = cli.main(["eval", "--data", str(data), "--max-tokens", str(stored["tokens"]),
                   "--seq-len", str(stored["seq_len"])])
    out = capsys.readouterr().out
    assert rc == 0
    ppl = float(out.split("perplexity:")[1].split()[0])
    assert ppl == pytest.approx(stored["mxfp4"]["prose"], rel=1e-3)
    assert "tokens/s:" in out


def _tv(a, b):
    """Total variation distance per layer between expert-share rows [layers, E]."""
    return 0.5 * np.abs(a - b).sum(axis=1)


def test_experts_specialise_by_domain(shipped, heldout):
    """Routed-expert usage (share of routing mass per expert) differs between code and
    prose: the pruner's calibration depends on it.

    Baseline: the distance between the first and second half of the same domain, which
    holds sampling noise plus topic drift (held-out prose runs from the language reference
    to IDLE's release notes). Code vs prose must be clearly further apart than that, in
    the mean over MoE layers (> 1.5x, and > 0.1: at least a tenth of the routing mass goes
    to other experts) and most of all in the first MoE layer, nearest the tokens (> 2.5x).
    Trained experts are balanced by the router bias, so this is specialisation, not
    collapse. For scale: after 4 training steps (random router) the same figures are
    0.07, 1.2x and 1.2x; after 150 steps 0.12, 1.6x and 1.7x.
    """
    model, _ = shipped
    halves = {}
    for d in DOMAINS:
        ids = heldout[d]
        n = len(ids) // 2
        halves[d] = [expert_usage(model, ids[:n], 256), expert_usage(model, ids[n:], 256)]
    usage = {d: (h[0] + h[1]) / 2 for d, h in halves.items()}
    across = _tv(usage["code"], usage["prose"])
    within = np.maximum(*[_tv(*halves[d]) for d in DOMAINS])  # per layer, worst domain
    assert across.mean() > 0.1, (across, within)
    assert across.mean() > 1.5 * within.mean(), (across, within)
    assert across[0] > 2.5 * within[0], (across, within)
    # balanced: no expert takes more than 3x its fair share of a domain's routing mass
    assert max(u.max() for u in usage.values()) < 3 / model.args.num_experts


# ---------------------------------------------------------------- training machinery
# Fast checks on toy sizes that what `make micro` trains is what inference runs.


def test_corpus_is_deterministic_and_its_splits_are_disjoint():
    a, b = build_corpus(), build_corpus()
    assert a.fingerprint == b.fingerprint
    train_code = {d.source for d in a.train["code"]}
    assert train_code.isdisjoint(d.source for d in a.heldout["code"])
    train_prose = {d.text for d in a.train["prose"]}
    assert train_prose.isdisjoint(d.text for d in a.heldout["prose"])
    for split in ("train", "heldout"):
        for d in DOMAINS:
            assert getattr(a, split)[d], (split, d)
    assert "def " in a.text("train", "code") and " the " in a.text("train", "prose")


@pytest.fixture(scope="module")
def toy():
    import mlx.core as mx

    from kimi_mlx.micro.train import build_model
    from kimi_mlx.testing.checkpoints import full_config, tiny_text_config

    args = ModelArgs.from_config(full_config(tiny_text_config()))  # index_topk 8
    model = build_model(args, seed=1)
    x = mx.random.normal((2, 24, args.hidden_size), key=mx.random.key(0))
    return args, model, x


def test_dsa_training_forward_is_the_inference_forward(toy):
    import mlx.core as mx

    from kimi_mlx.model.dsa import GatedDSA
    from kimi_mlx.micro.train import TrainGatedDSA, dsa_train_forward

    args, model, x = toy
    attn = next(m for _, m in model.named_modules() if isinstance(m, TrainGatedDSA))
    sparse, kl = dsa_train_forward(attn, x, sparse=True)
    assert kl.item() >= 0
    want = GatedDSA.__call__(attn, x, None)  # 24 > index_topk 8: the sparse path
    assert mx.allclose(sparse, want, atol=1e-5).item()
    dense, _ = dsa_train_forward(attn, x, sparse=False)
    attn.index_topk = 1 << 20
    try:
        want = GatedDSA.__call__(attn, x, None)
    finally:
        attn.index_topk = args.index_topk
    assert mx.allclose(dense, want, atol=1e-5).item()
    assert not mx.allclose(dense, sparse, atol=1e-3).item()


def test_indexer_learns_from_the_kl_loss_only(toy):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kimi_mlx.micro.train import TrainGatedDSA, dsa_train_forward

    _, model, x = toy
    attn = next(m for _, m in model.named_modules() if isinstance(m, TrainGatedDSA))
    params = attn.trainable_parameters()

    def grads_of(which):
        def f(p):
            attn.update(p)
            out, kl = dsa_train_forward(attn, x, sparse=True)
            return kl if which == "kl" else (out * out).sum()

        g = mx.grad(f)(params)
        attn.update(params)
        return {k for k, v in tree_flatten(g) if mx.abs(v).max().item() > 0}

    kl_names, lm_names = grads_of("kl"), grads_of("lm")
    assert kl_names and all(k.startswith("indexer.") for k in kl_names)
    assert lm_names and not any(k.startswith("indexer.") for k in lm_names)


def test_qat_weights_are_the_exported_mxfp4_weights(toy):
    import mlx.core as mx

    from kimi_mlx.micro.train import FakeQuantSwitchLinear, mxfp4_roundtrip

    _, model, _ = toy
    lin = next(m for _, m in model.named_modules() if isinstance(m, FakeQuantSwitchLinear))
    w = lin.weight
    q, s = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")  # what the export writes
    shipped = mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4")
    assert mx.array_equal(mxfp4_roundtrip(w), shipped).item()
    x = mx.random.normal((3, 1, w.shape[-1]), key=mx.random.key(1))
    idx = mx.array([[0], [1], [0]], dtype=mx.uint32)
    lin.qat = True
    try:
        got = lin(x, idx)
        def loss(w_):
            lin.update({"weight": w_})
            return lin(x, idx).sum()

        g = mx.grad(loss)(w)
    finally:
        lin.qat = False
        lin.update({"weight": w})
    want = mx.gather_mm(x, shipped.swapaxes(-1, -2), rhs_indices=idx)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert mx.abs(g).max().item() > 0  # straight-through: the float weight gets a gradient
