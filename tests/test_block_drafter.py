"""Block drafters (DFlash / DSpark): loading the released format, the forward against
mlx-vlm 0.7.10's (an independent implementation), and the speculative loop on micro
(greedy output equal to plain greedy; at temperature 1 the target's distribution)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from kimi_mlx.checkpoint.shards import CheckpointError
from kimi_mlx.speculative.block_drafter import (BlockDrafter, load_block_drafter,
                                                read_block_config)
from kimi_mlx.speculative.block_loop import BlockDraft, block_generate_step
from kimi_mlx.speculative.loop import SpecStats


def published_config(kind, *, vocab=4352, hidden=128, n_target=6, ids=(1, 3, 5), block=8,
                     layers=1, sliding=None, confidence=False):
    """A config.json in the released layout (the Qwen3 backbone keys at the top level,
    the drafter's under `dflash_config`)."""
    c = {"architectures": ["DSparkModel" if kind == "dspark" else "DFlashDraftModel"],
         "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": 2 * hidden,
         "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": True, "hidden_act": "silu",
         "dflash_config": {"block_size": block, "mask_token_id": 5,
                           "target_layer_ids": list(ids), "num_target_layers": n_target}}
    if sliding:
        c["layer_types"] = ["full_attention"] * (layers - 1) + ["sliding_attention"]
        c["sliding_window"] = sliding
    if kind == "dspark":
        c["dflash_config"].update(projector_type="dspark", markov_rank=16,
                                  enable_confidence_head=confidence)
    return c


def random_drafter(config, seed=0, scale=3.0):
    mx.random.seed(seed)
    d = BlockDrafter(read_block_config(config))
    # larger weights than the init, so that proposals depend on the context
    d.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, d.parameters()))
    mx.eval(d.parameters())
    return d


def save_drafter(d, config, path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"),
                        {f"model.{k}": v for k, v in tree_flatten(d.parameters())})
    return path


# ------------------------------------------------------------------------- loading


def test_released_block_widths_and_fields_are_read_as_mlx_vlm_reads_them():
    from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

    ds = published_config("dspark", confidence=True)
    ours, theirs = read_block_config(ds), DSparkConfig.from_dict(ds)
    assert ours.kind == "dspark" and ours.proposals == theirs.proposal_length == 8
    assert (ours.mask_token_id, ours.target_layer_ids, ours.markov_rank,
            ours.enable_confidence_head) == (theirs.mask_token_id, theirs.target_layer_ids,
                                             theirs.markov_rank, theirs.enable_confidence_head)
    df = published_config("dflash")
    df["block_size"] = 8  # DFlash configs keep block_size at the top level (anchor included)
    ours, theirs = read_block_config(df), DFlashConfig.from_dict(df)
    assert ours.kind == "dflash" and ours.proposals == theirs.block_size - 1 == 7


def test_a_drafter_for_another_target_is_refused_naming_the_field(tmp_path):
    from kimi_mlx.model.config import ModelArgs
    from kimi_mlx.checkpoint.loader import read_config

    args = ModelArgs.from_config(read_config("kimi_mlx/assets/micro"))
    cases = {"hidden_size": dict(hidden=64), "vocab_size": dict(vocab=4000),
             "num_target_layers": dict(n_target=8, ids=(1, 7))}
    from kimi_mlx.speculative.block_drafter import check_target

    for field_, kw in cases.items():
        cfg = read_block_config(published_config("dspark", **kw))
        with pytest.raises(CheckpointError, match=field_):
            check_target(cfg, args, "some/drafter")
    cfg = read_block_config(published_config("dspark", ids=(1, 6), n_target=6))
    with pytest.raises(CheckpointError, match=r"target_layer_ids .* layers \[6\]"):
        check_target(cfg, args, "some/drafter")
    bad = published_config("dspark")
    bad["dflash_config"]["mask_token_id"] = 99999
    with pytest.raises(CheckpointError, match="mask_token_id"):
        read_block_config(bad, "x/config.json")


def test_load_round_trip_quantized_and_a_missing_tensor_named(tmp_path):
    cfg = published_config("dspark", confidence=True)
    d = random_drafter(cfg)
    got = load_block_drafter(save_drafter(d, cfg, tmp_path / "bf"))
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in
               zip(tree_flatten(got.parameters()), tree_flatten(d.parameters())))
    # quantized as mlx-lm writes it: `quantization` in the config, scales / biases tensors
    nn.quantize(d, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % 32 == 0)
    qcfg = dict(cfg, quantization={"group_size": 32, "bits": 4})
    q = load_block_drafter(save_drafter(d, qcfg, tmp_path / "q4"))
    assert isinstance(q.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    w = dict(tree_flatten(d.parameters()))
    w.pop("fc.weight")
    mx.save_safetensors(str(tmp_path / "q4" / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match="missing.*fc.weight"):
        load_block_drafter(tmp_path / "q4")


# ------------------------------------------------------------- forward vs mlx-vlm


def _theirs(kind, config, ours, embed, head):
    if kind == "dspark":
        from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel as M
        from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig as C
    else:
        from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel as M
        from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig as C
        config = dict(config, block_size=config["dflash_config"]["block_size"])
    m = M(C.from_dict(config))
    m.load_weights(list(m.sanitize(dict(tree_flatten(ours.parameters()))).items()))
    m.embed_tokens, m.lm_head = embed, head
    return m


@pytest.mark.parametrize("kind,sliding", [("dspark", None), ("dspark", 5), ("dflash", None),
                                          ("dflash", 5)])
def test_forward_and_proposals_equal_mlx_vlm_on_random_weights(kind, sliding):
    """Same random weights; two context chunks (offsets), or one longer than a sliding
    layer's window: block logits agree to float32 rounding, greedy proposals are equal.

    (A sliding layer sees the last window - 1 context rows. mlx-vlm's RotatingKVCache
    keeps more than that when a later chunk of several rows arrives, so later chunks
    are compared with full-attention layers only.)"""
    V, d = 512, 64
    cfg = published_config(kind, vocab=V, hidden=d, n_target=10, ids=(1, 4, 8), block=6,
                           layers=2, sliding=sliding)
    ours = random_drafter(cfg, seed=1, scale=1.0)
    mx.random.seed(2)
    embed = nn.Embedding(V, d)
    head = nn.Linear(d, V, bias=False)
    head.update(tree_map(lambda p: p * 4.0, head.parameters()))
    ours.bind(embed, head)
    theirs = _theirs(kind, cfg, ours, embed, head)
    oc, tc = ours.make_cache(), theirs.make_cache()
    k = ours.config.proposals
    worst = 0.0
    # 9 context rows then 4 more: offsets, and the sliding layer's window (5) cut
    chunks = [(mx.random.normal((1, 9, 3 * d)), 17), (mx.random.normal((1, 4, 3 * d)), 301)]
    for h, anchor in chunks[: 1 if sliding else 2]:
        ours.add_context(h, oc)
        a = mx.array([anchor], mx.uint32)
        base, _ = ours.base_logits(a, k, oc)
        th = theirs._hidden(ours.block_inputs(a, k).astype(mx.int32), h, tc)
        want = theirs._logits(th if ours.config.sample_from_anchor else th[:, 1:])
        worst = max(worst, float(mx.abs(base - want).max()) / float(mx.abs(want).max()))
        argmax = lambda x: mx.argmax(x, -1)  # noqa: E731
        if kind == "dspark":
            props = theirs.markov_head.sample_block(want, first_prev_tokens=a.astype(mx.int32),
                                                    sampler=argmax)
        else:
            props = argmax(want)
        assert worst < 1e-5, worst
        assert ours.greedy_block(a, k, oc).tolist() == props.tolist()
    assert worst < 1e-5, worst
    print(f"{kind} sliding={sliding}: max |ours - mlx-vlm| / max |logit| = {worst:.2e}")


# ------------------------------------------------------------------ loop on micro


@pytest.fixture(scope="module")
def micro():
    from kimi_mlx.checkpoint.loader import load_model

    model, _, _ = load_model("kimi_mlx/assets/micro")
    return model


def plain_greedy(model, prompt, n):
    gen = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(t) for t, _ in gen]


class Oracle:
    """Replaces the drafter's greedy block with a known sequence's next tokens, wrong at
    every third position: accepted and rejected drafts whatever the random weights say
    (the drafter's real forward still runs)."""

    def __init__(self, drafter, seq):
        self.real, self.seq, self.pos = drafter.greedy_block, seq, None

    def __call__(self, anchor, k, cache):
        self.real(anchor, k, cache)
        j = cache[0].offset + 1  # the anchor sits at position offset
        out = [(self.seq[j + i] + (1 if (j + i) % 3 == 1 else 0)) % 4000
               if j + i < len(self.seq) else 0 for i in range(k)]
        return mx.array([out], mx.uint32)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_greedy_equals_plain_past_index_topk_with_rollbacks(micro, kind, monkeypatch):
    prompt = [(7 * i + 3) % 250 + 10 for i in range(70)]  # past micro's index_topk (64)
    want = plain_greedy(micro, prompt, 24)
    d = random_drafter(published_config(kind)).bind_target(micro)
    assert [t for t, _, _ in block_generate_step(prompt, micro, BlockDraft(d),
                                                 num_draft_tokens=4, max_tokens=10)] == want[:10]
    monkeypatch.setattr(d, "greedy_block", Oracle(d, prompt + want))
    steps = []
    for k in (2, 5, "auto:6"):  # auto: k moves from step to step (`auto_k.AutoK`)
        stats = SpecStats()
        got = [t for t, _, _ in block_generate_step(prompt, micro, BlockDraft(d),
                                                    num_draft_tokens=k, max_tokens=24,
                                                    stats=stats)]
        assert got == want, k
        if isinstance(k, int):
            steps += [(k, n) for n in stats.per_step]
    assert any(0 < n < k for k, n in steps) and any(n == k for k, n in steps), steps


# --------------------------------------------------------- sampling distribution


def _two_token_counts():
    """(counts [V, V] of the first two tokens over N_SAMPLES runs at temperature 1 with
    k = 2 from a random DSpark drafter, the target's exact distribution, stats)."""
    from mlx_lm.models.cache import KVCache

    from kimi_mlx.sampling import Sampling
    from kimi_mlx.speculative.rollback import restore, snapshot
    from kimi_mlx.testing.checkpoints import random_model
    from test_speculative import (N_SAMPLES, PROMPT, VOCAB, exact_two_token_distribution,
                                  two_layer_args)

    args = two_layer_args(VOCAB)
    model = random_model(args, seed=0)
    cfg = published_config("dspark", vocab=VOCAB, hidden=args.hidden_size, n_target=2,
                           ids=(0, 1), block=3)
    cfg["dflash_config"].update(mask_token_id=VOCAB - 1, markov_rank=4)
    draft = BlockDraft(random_drafter(cfg, seed=3).bind_target(model))
    probs = exact_two_token_distribution(model, PROMPT, VOCAB)
    caches = model.make_cache() + draft.make_cache()
    list(block_generate_step(PROMPT, model, draft, max_tokens=0, prompt_cache=caches))
    nt = len(model.layers)
    tsnap = snapshot(caches[:nt])
    dstate = [c.state for c in caches[nt:-1]]
    pend = caches[-1].cache[0]
    mx.random.seed(2)
    counts = np.zeros((VOCAB, VOCAB))
    stats = SpecStats()
    for _ in range(N_SAMPLES):
        restore(caches[:nt], tsnap)
        for c, st in zip(caches[nt:-1], dstate):
            KVCache.__init__(c)
            c.state = st
        caches[-1].cache = [pend]
        toks = [t for t, _, _ in block_generate_step(
            [PROMPT[-1]], model, draft, num_draft_tokens=2, max_tokens=2,
            sampling=Sampling(temp=1.0), prompt_cache=caches, stats=stats)]
        counts[toks[0], toks[1]] += 1
    return counts, probs, stats


def test_sampled_first_two_tokens_are_distributed_as_the_targets():
    """Temperature 1, k = 2 (the Markov term makes q_2 depend on d_1): the first two
    tokens over many runs fit the target's exact two-token distribution (chi-square, as
    test_speculative does for draft models)."""
    from test_speculative import chi_square_p

    counts, probs, stats = _two_token_counts()
    assert 0 < stats.accepted < stats.drafted  # both branches of the rule ran
    assert chi_square_p(counts, probs) > 1e-3


def test_chi_square_rejects_drafts_judged_against_the_wrong_q(monkeypatch):
    """Planted bug: the acceptance rule is given a wrong q (a fixed skewed distribution),
    not the one the drafts were drawn from: the test must see it."""
    import kimi_mlx.speculative.block_loop as bl
    from test_speculative import chi_square_p

    real = bl.draw_draft

    def wrong_q(logits, sampling, q_lps):
        d = real(logits, sampling, q_lps)
        q_lps[-1] = mx.log(mx.softmax(logits * 0.0 + mx.arange(logits.shape[-1]) * 0.7))
        return d

    monkeypatch.setattr(bl, "draw_draft", wrong_q)
    counts, probs, _ = _two_token_counts()
    assert chi_square_p(counts, probs) < 1e-6


# ------------------------------------------------------------------ front ends


@pytest.fixture(scope="module")
def micro_drafter_dir(tmp_path_factory):
    cfg = published_config("dspark")
    return save_drafter(random_drafter(cfg), cfg, tmp_path_factory.mktemp("dspark"))


def test_generate_with_a_block_drafter_prints_the_plain_greedy_text(micro_drafter_dir, capsys):
    from kimi_mlx.commands import main as cli

    base = ["generate", "--model", "kimi_mlx/assets/micro", "--prompt", "def f(x):", "-m",
            "12", "--ignore-chat-template", "--temp", "0"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out.split("=" * 10)[1]
    assert cli.main(base + ["--draft-model", str(micro_drafter_dir),
                            "--num-draft-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.split("=" * 10)[1] == plain and "Speculative:" in out


def test_block_drafter_errors_name_the_field_and_the_mode(micro_drafter_dir, tmp_path, capsys):
    from kimi_mlx.commands import main as cli

    cfg = published_config("dspark", n_target=8, ids=(1, 7))
    bad = save_drafter(random_drafter(cfg), cfg, tmp_path / "other")
    assert cli.main(["generate", "--model", "kimi_mlx/assets/micro", "--prompt", "hi",
                     "--draft-model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_target_layers is 8 but the target's is 6" in err and str(bad) in err
    # every mode runs a block drafter now (the pipeline's stages send the hiddens:
    # tests/test_cluster_block_draft.py); a drafter for another target is still refused
    # before anything loads, in the pipeline's factory too
    from kimi_mlx.speculative.factory import (ONE_PROCESS, PIPELINE, TENSOR, build_speculation,
                                              check_draft_target)
    from kimi_mlx.speculative.settings import DraftSettings

    for where in (ONE_PROCESS, PIPELINE, TENSOR):
        check_draft_target(DraftSettings(model=str(micro_drafter_dir)), where)
    with pytest.raises(ValueError, match="num_target_layers is 8 but the target's is 6"):
        build_speculation(DraftSettings(model=str(bad)), where=PIPELINE,
                          target_name="kimi_mlx/assets/micro")


def test_target_embed_head_read_alone_equal_the_loaded_model(micro):
    """What a tensor group's drafter binds to (the embedding and lm_head read alone from
    the checkpoint) gives the loaded model's embedding rows and logits exactly."""
    from kimi_mlx.speculative.block_drafter import load_target_embed_head

    args, embed, head = load_target_embed_head("kimi_mlx/assets/micro")
    assert args.vocab_size == micro.args.vocab_size
    lm = micro.language_model
    tok = mx.array([[1, 50, 4000]])
    assert mx.array_equal(embed(tok), lm.model.embed_tokens(tok))
    h = mx.random.normal((1, 3, args.hidden_size), key=mx.random.key(0))
    assert mx.array_equal(head(h), lm.logits(h))


def test_the_server_engine_decodes_with_a_block_drafter(micro, micro_drafter_dir):
    """`kimi-mlx server --draft-model DSPARK`: the one-process engine runs the block loop
    (which prefills itself) and gives plain greedy tokens, request after request."""
    from kimi_mlx.server.engine import Engine
    from kimi_mlx.server.jobs import Finished, Job
    from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation
    from kimi_mlx.speculative.settings import DraftSettings

    spec = build_speculation(DraftSettings(model=str(micro_drafter_dir), num_draft_tokens=3),
                             where=ONE_PROCESS, model=micro)
    engine = Engine(micro, eos_ids=[], speculation=spec)
    engine.start()
    try:
        for prompt in ([50, 90, 20, 70, 70, 10], [30, 30, 80]):
            job = Job(prompt, 8)
            job.attach()
            events = list(engine.submit(job).events(timeout=120))
            assert isinstance(events[-1], Finished), events[-1]
            assert [e.token for e in events[:-1]] == plain_greedy(micro, prompt, 8)
    finally:
        engine.stop()
    assert spec.stats.steps > 0


def test_chat_turns_with_a_block_drafter_equal_plain_chat(micro_drafter_dir):
    """Greedy chat turns give the same replies with a block drafter, the second turn also
    from target + drafter caches that hold the conversation (the pending hiddens carried
    over from the call that filled them)."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.commands.chat import Conversation, chat_turn
    from kimi_mlx.speculative.loop import Speculation

    model, wrapper, tok, _ = load_for_generation("kimi_mlx/assets/micro")
    sp = Speculation(BlockDraft(load_block_drafter(micro_drafter_dir, model)), 3)
    greedy = make_sampler(0.0)
    plain, fast = Conversation(), Conversation()
    for text in ("hi", "and then?"):
        a = chat_turn(model, wrapper, tok, plain, text, "low", greedy, 8, 4096)
        b = chat_turn(model, wrapper, tok, fast, text, "low", greedy, 8, 4096, speculation=sp)
        assert a == b
    assert sp.stats.steps > 0 and fast.reused_tokens > 10


def test_shipped_micro_dspark_keeps_micros_greedy_output_and_benches(micro):
    """kimi_mlx/assets/micro-dspark (`make micro-dspark`): loads against micro, greedy
    speculative text equals plain greedy text on real code with drafts accepted (a
    trained drafter: a random one accepts ~0), and `bench spec` loads it as "block"."""
    from kimi_mlx.bench.spec import bench, default_block_draft, load_drafts

    path = default_block_draft()
    assert path is not None, "kimi_mlx/assets/micro-dspark is missing (make micro-dspark)"
    d = load_drafts(["block"], None, None, "kimi_mlx/assets/micro", target=micro)
    (name, draft), = d.items()
    assert name == f"block {path}"
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained("kimi_mlx/assets/micro")
    prompt = tok.encode('class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self')
    stats = SpecStats()
    got = [t for t, _, _ in block_generate_step(prompt, micro, draft, num_draft_tokens=4,
                                                max_tokens=32, stats=stats)]
    assert got == plain_greedy(micro, prompt, 32)
    assert stats.mean_accepted > 0.5
    rows = bench(micro, draft, [prompt], tokens=6, ks=[2], repeats=1)
    assert rows[0]["k"] == 2 and rows[0]["spec_tps"] > 0


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_training_blocks_in_one_pass_equal_the_inference_path(kind):
    """`micro.dspark_train.block_logits` (every anchor of a batch in one masked forward,
    per-row rope offsets) gives, per block, the logits `base_logits` gives after
    `add_context` of the positions before its anchor (the path verification uses)."""
    from kimi_mlx.micro.dspark_train import block_logits

    config = published_config(kind, layers=2)
    d = random_drafter(config, seed=3)
    V, dd = 4352, 128
    mx.random.seed(4)
    embed = nn.Embedding(V, dd)
    head = nn.Linear(dd, V, bias=False)
    d.bind(embed, head)
    B, T, k = 2, 20, 5
    hidden = mx.random.normal((B, T, 3 * dd))
    tokens = mx.random.randint(0, V, (B, T)).astype(mx.int32)
    anchors = mx.array([[3, 11, 14], [1, 7, 9]], mx.int32)
    got, rows = block_logits(d, hidden, tokens, anchors, k)
    assert got.shape == (B * 3, k, V) and rows.tolist() == [0, 0, 0, 1, 1, 1]
    for r in range(B * 3):
        b, a = r // 3, anchors.reshape(-1)[r].item()
        cache = d.make_cache()
        d.add_context(hidden[b : b + 1, :a], cache)
        want, _ = d.base_logits(tokens[b : b + 1, a], k, cache)
        want = np.array(want[0].astype(mx.float32))
        err = np.abs(np.array(got[r]) - want).max()
        assert err <= 1e-4 * max(1.0, np.abs(want).max()), (r, err)
        # blocks differ from one another (the equality above is not met by one repeated row)
        assert np.abs(np.array(got[r]) - np.array(got[(r + 1) % (B * 3)])).max() > 1e-2
