"""Prompt-lookup (n-gram) drafts, `--draft ngram`: the index against a brute-force scan,
greedy output against mlx-lm's plain `generate_step`, the sampled distribution against
the target's exact one, and what a step without a match costs (counted, not timed).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import kimi_mlx.speculative.loop as spec
import kimi_mlx.speculative.ngram as ngram
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.speculative.loop import Sampling, SpecStats
from kimi_mlx.speculative.ngram import NgramDraft, NgramIndex, ngram_generate_step
from kimi_mlx.testing.checkpoints import full_config, random_model, tiny_text_config
from test_speculative import (PROMPT, ROUNDING, VOCAB, cache_tensors, chi_square_p,
                              exact_two_token_distribution, plain_decode, two_layer_args,
                              worst_mismatch)


@pytest.fixture(scope="module")
def target():
    """Tiny K3.1 (6 layers: KDA 0,1,3,4; DSA 2,5; index_topk 8), float32."""
    return random_model(ModelArgs.from_config(full_config(tiny_text_config())), seed=0)


# ---------------------------------------------------------------------------- index


def scan_proposal(tokens, k, n_max, n_min):
    """Reference by brute force: every earlier position whose preceding n_max..n_min tokens
    equal the context's last ones (longest n that has any); of those, the one agreeing
    longest before (up to 64, ties: the latest) is continued, reading on into the draft."""
    L = len(tokens)
    for n in range(min(n_max, L), n_min - 1, -1):
        pos = [p for p in range(n, L) if tokens[p - n : p] == tokens[L - n :]]
        if pos:
            break
    else:
        return []

    def agree(p):
        m = 0
        while m < 64 and m < p and tokens[p - 1 - m] == tokens[L - 1 - m]:
            m += 1
        return m

    best = max(pos[-64:], key=lambda p: (agree(p), p))
    ext = list(tokens)
    for i in range(k):
        ext.append(ext[best + i])
    return ext[L:]


def test_index_proposals_equal_a_scan_of_the_context():
    rng = np.random.default_rng(0)
    for trial in range(60):
        vocab = int(rng.integers(2, 9))
        seq = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 80)))]
        n_min = int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 4))
        idx = NgramIndex(seq[:1], n_max, n_min)
        for i in range(1, len(seq) + 1):  # built one token at a time, checked at each
            assert idx.propose(5) == scan_proposal(seq[:i], 5, n_max, n_min), (trial, i)
            if i < len(seq):
                idx.append(seq[i])


def test_a_loop_is_drafted_past_its_end_and_nothing_without_a_match():
    idx = NgramIndex([7, 8, 9, 7, 8])
    assert idx.propose(6) == [9, 7, 8, 9, 7, 8]  # period 3 read on into the draft
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([1, 2, 3, 1, 2], n_max=4, n_min=3).propose(2) == []
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex([], n_max=2, n_min=3)


# ------------------------------------------------------------------- greedy equality


def repeating(n, period):
    return [(11 * (i % period) + 5) % 256 for i in range(n)]


@pytest.mark.parametrize("prompt,ks", [
    (repeating(3, 3), (1, 4)),            # no repeat in the prompt
    (repeating(11, 4), (2,)),             # repeats, past index_topk (8)
    (repeating(17, 17), (3, 5)),          # distinct, past index_topk
    (repeating(24, 5), (4, 8)),           # a loop the drafts can follow
])
def test_greedy_ngram_equals_plain_greedy(target, prompt, ks):
    n = 20
    plain = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n)]
    for k in ks:
        stats = SpecStats()
        got = [t for t, _, _ in ngram_generate_step(
            prompt, target, NgramDraft(), num_draft_tokens=k, max_tokens=n, stats=stats)]
        assert got == plain, k
        assert stats.steps + stats.plain > 0 and stats.emitted == n


@pytest.fixture(scope="module")
def micro():
    """The shipped micro model and a real-code prompt past its index_topk (64)."""
    from pathlib import Path

    from kimi_mlx.checkpoint.loader import load_for_generation

    path = Path(ngram.__file__).resolve().parents[1] / "assets" / "micro"
    model, _, tok, _ = load_for_generation(str(path))
    prompt = tok.encode((path / "heldout" / "code.txt").read_text()[:400])
    assert len(prompt) > 64
    return model, prompt


def test_micro_greedy_ngram_equals_plain_and_accepts_and_rejects(micro):
    """Micro falls into loops of its own, so verify steps accept and reject drafts, and
    plain steps run where nothing matches; the output is the plain greedy output."""
    model, prompt = micro
    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=48)]
    for k in (2, 5):
        stats = SpecStats()
        got = [t for t, _, _ in ngram_generate_step(prompt, model, NgramDraft(),
                                                    num_draft_tokens=k, max_tokens=48,
                                                    stats=stats)]
        assert got == plain, k
        assert stats.steps > 0 and 0 < stats.accepted < stats.drafted, k


def test_caches_after_generation_hold_all_but_the_last_token(target):
    prompt = repeating(10, 3)
    d = NgramDraft()
    caches = target.make_cache() + d.make_cache()
    out = [t for t, _, _ in ngram_generate_step(prompt, target, d, num_draft_tokens=3,
                                                max_tokens=9, prompt_cache=caches)]
    nt = len(target.layers)
    want = cache_tensors(plain_decode(target, prompt, out[:-1]))
    assert worst_mismatch(cache_tensors(caches[:nt]), want) < ROUNDING
    assert caches[nt][0].tolist() == prompt + out[:-1]


@pytest.mark.parametrize("stop_on_draft", [True, False])
def test_closing_the_generator_settles_the_caches(micro, stop_on_draft):
    """Stopped on an accepted draft (the rest of its step dropped) or on a plain token
    (the plain step already started after it undone), the caches continue as plain
    decoding would: the next call from them gives the plain greedy tokens."""
    model, prompt = micro
    d = NgramDraft()
    caches = model.make_cache() + d.make_cache()
    stats = SpecStats()
    gen = ngram_generate_step(prompt, model, d, num_draft_tokens=4, max_tokens=48,
                              prompt_cache=caches, stats=stats)
    out = []
    for t, _, from_draft in gen:
        out.append(t)
        if from_draft == stop_on_draft and len(out) > 8:
            break
    gen.close()
    assert from_draft == stop_on_draft
    assert caches[-1][0].tolist() == prompt + out[:-1]
    more = [t for t, _, _ in ngram_generate_step(out[-1:], model, d, num_draft_tokens=4,
                                                 max_tokens=12, prompt_cache=caches)]
    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=len(out) + 12)]
    assert out + more == plain


# ------------------------------------------------------------- no match: plain cost


class CountingModel:
    """The target, counting forward calls by token count and whether a verify step was
    recording (the KDA hook's `verify_record` on a cache)."""

    def __init__(self, model):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.make_cache = model.make_cache
        self.calls = []

    def __call__(self, x, cache=None):
        recording = any(hasattr(c, "verify_record") for c in cache)
        self.calls.append((x.shape[1], recording))
        return self.model(x, cache=cache)


def test_a_step_without_a_match_is_one_plain_decode_and_no_verify(target, monkeypatch):
    """Distinct prompt tokens and n-grams of 3..4: most steps find no match. Each such
    step is one forward pass of one token without a verify record, and begin_verify,
    rollback and the acceptance rule run only on steps with a draft."""
    counts = {"begin": 0, "rollback": 0, "judge": 0}
    for name, key in (("begin_verify", "begin"), ("rollback", "rollback"),
                      ("judge_verify", "judge")):
        real = getattr(ngram, name)

        def counted(*a, _real=real, _key=key, **kw):
            counts[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(ngram, name, counted)
    model = CountingModel(target)
    prompt = list(range(40, 52))
    stats = SpecStats()
    out = [t for t, _, _ in ngram_generate_step(prompt, model, NgramDraft(4, 3),
                                                num_draft_tokens=4, max_tokens=30,
                                                stats=stats)]
    decode = model.calls[1:]  # after the one prefill call
    assert model.calls[0] == (len(prompt) - 1, False)
    plain_calls = [c for c in decode if not c[1]]
    assert stats.plain > 0
    assert plain_calls == [(1, False)] * stats.plain
    assert len(decode) == stats.plain + stats.steps
    assert counts == {"begin": stats.steps, "rollback": stats.steps, "judge": stats.steps}
    assert out == [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=30)]


# ------------------------------------------------------------- sampling distribution


@pytest.fixture(scope="module")
def sampling_target():
    model = random_model(two_layer_args(VOCAB), seed=0)
    return model, exact_two_token_distribution(model, PROMPT, VOCAB)


def sample_two_tokens(model, n, seed, k=3):
    """Counts [V, V] of the first two tokens over n n-gram runs at temperature 1. PROMPT
    ends with 1 2 3 4, seen before followed by 5: the first step verifies a draft (accepted
    with p(5), else a token from p without 5), the second is plain or the bonus token."""
    from kimi_mlx.speculative.rollback import restore, snapshot

    d = NgramDraft()
    caches = model.make_cache() + d.make_cache()
    model(mx.array(PROMPT[:-1])[None], caches[:-1])
    mx.eval([c.state for c in caches[:-1]])
    start = snapshot(caches[:-1])
    counts = np.zeros((VOCAB, VOCAB))
    mx.random.seed(seed)
    stats = SpecStats()
    for _ in range(n):
        restore(caches[:-1], start)
        caches[-1].cache = [mx.array(PROMPT[:-1], mx.int32)]  # the context the index reads
        toks = [t for t, _, _ in ngram_generate_step(
            PROMPT[-1:], model, d, num_draft_tokens=k, max_tokens=2,
            sampling=Sampling(temp=1.0), prompt_cache=caches, stats=stats)]
        counts[toks[0], toks[1]] += 1
    return counts, stats


def test_sampling_distribution_of_first_two_tokens_is_the_targets(sampling_target):
    model, probs = sampling_target
    counts, stats = sample_two_tokens(model, 700, seed=2)
    assert chi_square_p(counts, probs) > 1e-3
    assert stats.steps == 700 and 0 < stats.accepted < 700 and stats.plain > 0


def test_chi_square_rejects_a_wrong_acceptance_rule(sampling_target, monkeypatch):
    """Planted bug: on rejection, resample from p instead of p with the draft removed."""
    model, probs = sampling_target

    def wrong(p_lp, q_lp, drafts):
        k = drafts.shape[0]
        p = mx.exp(p_lp)
        rows = mx.arange(k)
        ok = mx.random.uniform(shape=(k,)) < p[rows, drafts]
        n = mx.where(mx.all(ok), k, mx.argmin(ok.astype(mx.int32)))
        return n, mx.random.categorical(p_lp)[n]

    monkeypatch.setattr(spec, "accept_drafts", wrong)
    counts, _ = sample_two_tokens(model, 700, seed=2)
    assert chi_square_p(counts, probs) < 1e-6


# ------------------------------------------------------------------------------- CLI


def test_generate_with_ngram_prints_the_plain_greedy_text(tiny_ckpt, capsys):
    from kimi_mlx.commands.generate import main

    base = ["--model", str(tiny_ckpt), "--prompt", "the cat sat on the mat, the cat sat on",
            "--ignore-chat-template", "--max-tokens", "12", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out.split("==========")[1]
    assert main(base + ["--draft", "ngram", "--num-draft-tokens", "4", "--ngram-max", "3"]) == 0
    out = capsys.readouterr().out
    assert out.split("==========")[1] == plain
    assert "Speculative:" in out


@pytest.mark.parametrize("flags,message", [
    (["--ngram-max", "3"], "need --draft ngram"),
    (["--draft", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min"),
    (["--draft", "ngram", "--ngram-min", "0"], "--ngram-min"),
    (["--draft", "ngram", "--draft-model", "x"], "not both"),
])
def test_bad_ngram_flags_are_refused_by_name(tiny_ckpt, capsys, flags, message):
    from kimi_mlx.commands.generate import main

    rc = main(["--model", str(tiny_ckpt), "--prompt", "hi", "--max-tokens", "3"] + flags)
    assert rc == 2 and message in capsys.readouterr().err


def test_chat_turns_with_ngram_equal_plain_chat(tiny_ckpt):
    from mlx_lm.sample_utils import make_sampler

    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.commands.chat import Conversation, chat_turn
    from kimi_mlx.speculative.loop import Speculation
    from kimi_mlx.text.chat_format import encode_chat

    model, wrapper, tok, _ = load_for_generation(str(tiny_ckpt))
    greedy = make_sampler(0.0)
    plain, fast = Conversation(), Conversation()
    sp = Speculation(NgramDraft(), 3)
    a = chat_turn(model, wrapper, tok, plain, "say it again and again", "low", greedy, 10, 4096)
    b = chat_turn(model, wrapper, tok, fast, "say it again and again", "low", greedy, 10, 4096,
                  speculation=sp)
    assert a == b and sp.stats.steps + sp.stats.plain > 0
    assert fast.cache[-1][0].tolist() == fast.processed  # the n-gram cache: the context

    # a turn served from caches that already hold the conversation so far
    prefix = encode_chat(tok, fast.messages, reasoning_effort="low", add_generation_prompt=False)
    fast.cache = model.make_cache() + NgramDraft().make_cache()
    model(mx.array([prefix]), fast.cache[: len(model.layers)])
    fast.cache[-1].cache = [mx.array(prefix, mx.int32)]
    fast.processed = prefix
    a = chat_turn(model, wrapper, tok, plain, "and again", "low", greedy, 10, 4096,
                  reuse_cache=False)
    b = chat_turn(model, wrapper, tok, fast, "and again", "low", greedy, 10, 4096, speculation=sp)
    assert fast.reused_tokens == len(prefix) > 10
    assert a == b
    assert fast.cache[-1][0].tolist() == fast.processed


def test_request_defaults_are_the_modules():
    from kimi_mlx.generation.request import NGRAM_MAX, NGRAM_MIN

    assert (NGRAM_MAX, NGRAM_MIN) == (ngram.DEFAULT_NGRAM_MAX, ngram.DEFAULT_NGRAM_MIN)


def test_bench_rows_for_the_ngram_draft(target):
    from kimi_mlx.bench.spec import bench

    rows = bench(target, NgramDraft(), [repeating(12, 4)], tokens=8, ks=[2, 4], repeats=1)
    assert [r["k"] for r in rows] == [2, 4]
    for r in rows:
        assert r["plain_tps"] > 0 and r["spec_tps"] > 0 and 0 <= r["mean_accepted"] <= r["k"]
        assert r["plain_steps"] + r["verify_steps"] > 0


def test_copy_prompts_hold_a_block_then_its_first_half():
    from pathlib import Path

    from kimi_mlx.bench.spec import copy_prompts
    from kimi_mlx.checkpoint.loader import load_for_generation

    path = Path(ngram.__file__).resolve().parents[1] / "assets" / "micro"
    _, _, tok, _ = load_for_generation(str(path))
    for p in copy_prompts(path, tok, 2, lines=10):
        text = tok.decode(p)
        lines = text.splitlines(keepends=True)
        assert "".join(lines[11:]) == "".join(lines[:5])  # 10 lines, a blank one, 5 again
