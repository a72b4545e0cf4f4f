"""Speculative decoding: exact cache rollback, greedy equality, the sampling rule's
output distribution, and the draft tokenizer check.

References are independent of the code under test: a plain token-by-token decode of the
accepted tokens (for the caches), mlx-lm's `generate_step` (for greedy output), and the
target's exact two-token distribution from full forward passes (for sampling).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

import kimi_mlx.speculative.loop as spec
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.speculative.rollback import begin_verify, end_verify, restore, rollback, snapshot
from kimi_mlx.speculative.loop import Sampling, SpecStats, speculative_generate_step
from kimi_mlx.testing.checkpoints import full_config, random_model, tiny_text_config

F32_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def target():
    """Tiny K3.1 (6 layers: KDA 0,1,3,4; DSA 2,5; index_topk 8), float32."""
    return random_model(ModelArgs.from_config(full_config(tiny_text_config())), seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """The target with every matrix perturbed by 2% of its mean magnitude: it agrees with
    the target often but not always, so verify steps both accept and reject."""
    d = random_model(target.args, seed=0)
    mx.random.seed(7)
    d.update(tree_map(
        lambda p: p + 0.02 * mx.abs(p).mean() * mx.random.normal(p.shape) if p.ndim >= 2 else p,
        d.parameters()))
    return d


# ------------------------------------------------------------------------- rollback


def cache_tensors(caches):
    """Every cached tensor up to the live offset, by (layer, name), as float64 numpy."""
    out = {}
    for i, c in enumerate(caches):
        if isinstance(c, ArraysCache):
            out[(i, "conv")] = np.array(c[0].astype(mx.float32), np.float64)
            out[(i, "state")] = np.array(c[1], np.float64)
        else:
            n = c.offset
            out[(i, "offset")] = np.array(n)
            out[(i, "latent")] = np.array(c.keys[..., :n, :], np.float64)
            out[(i, "k_pe")] = np.array(c.values[..., :n, :], np.float64)
            out[(i, "index_keys")] = np.array(c.index_keys[..., :n, :], np.float64)
    return out


def worst_mismatch(got, want):
    """Largest |got - want| / (max |want| * eps32) over all tensors (inf: shape/offset)."""
    worst = 0.0
    assert got.keys() == want.keys()
    for key in want:
        a, b = got[key], want[key]
        if a.shape != b.shape or (key[1] == "offset" and a != b):
            return math.inf
        if a.size:
            worst = max(worst, float(np.abs(a - b).max() / (np.abs(b).max() * F32_EPS)))
    return worst


# Batched verify (chunked KDA, expanded / sparse-prefill DSA) vs one token at a time
# differ by float32 rounding: measured 2-7 eps of each tensor's scale in layers 0-1,
# growing ~2.5x per layer through this random model to <= 160 eps in layer 5. 1024 eps
# (1.2e-4 relative) keeps margin; keeping one token too many is off by > 1e5 eps.
ROUNDING = 1024


def verify_then_rollback(model, prompt, verify_tokens, n_keep):
    cache = model.make_cache()
    model(mx.array(prompt)[None], cache)
    v = begin_verify(cache)
    logits = model(mx.array(verify_tokens)[None], cache)
    mx.eval(logits)
    rollback(cache, v, n_keep)
    end_verify(cache)
    return cache


def plain_decode(model, prompt, tokens):
    cache = model.make_cache()
    model(mx.array(prompt)[None], cache)
    for t in tokens:
        model(mx.array([[t]]), cache)
    return cache


@pytest.mark.parametrize("prompt_len", [5, 11])  # verify inside / past index_topk = 8
def test_rollback_equals_plain_decode_of_accepted_tokens(target, prompt_len):
    prompt = [(7 * i + 3) % 250 for i in range(prompt_len)]
    verify = [41, 99, 250, 7, 180]  # [y, d1..d4]
    for n_keep in (0, 1, 2, 4, 5):
        got = cache_tensors(verify_then_rollback(target, prompt, verify, n_keep))
        want = cache_tensors(plain_decode(target, prompt, verify[:n_keep]))
        assert worst_mismatch(got, want) < ROUNDING, n_keep


def test_rollback_check_catches_an_off_by_one(target):
    """The comparison above can fail: keeping one token too many is caught."""
    prompt = [(7 * i + 3) % 250 for i in range(11)]
    verify = [41, 99, 250, 7, 180]
    got = cache_tensors(verify_then_rollback(target, prompt, verify, 3))
    want = cache_tensors(plain_decode(target, prompt, verify[:2]))
    assert worst_mismatch(got, want) == math.inf  # DSA offsets differ
    kda_only = {k: v for k, v in got.items() if k[1] in ("conv", "state")}
    kda_want = {k: v for k, v in want.items() if k[1] in ("conv", "state")}
    assert worst_mismatch(kda_only, kda_want) > 100 * ROUNDING


def test_next_token_logits_after_rollback_match(target):
    prompt = [(5 * i + 1) % 250 for i in range(11)]
    verify = [12, 13, 14, 15]
    a = verify_then_rollback(target, prompt, verify, 2)
    b = plain_decode(target, prompt, verify[:2])
    la = target(mx.array([[77]]), a)
    lb = target(mx.array([[77]]), b)
    np.testing.assert_allclose(np.array(la), np.array(lb), rtol=0,
                               atol=ROUNDING * F32_EPS * float(mx.abs(lb).max()))


def test_snapshot_restore_is_exact(target):
    cache = target.make_cache()
    target(mx.array([[1, 2, 3, 4, 5]]), cache)
    before = cache_tensors(cache)
    s = snapshot(cache)
    target(mx.array([[6]]), cache)
    target(mx.array([[7, 8]]), cache)
    restore(cache, s)
    assert worst_mismatch(cache_tensors(cache), before) == 0.0


# ------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("prompt_len,ks", [(3, (1, 4)), (11, (2,)), (17, (3, 5))])
def test_greedy_speculative_equals_plain_greedy(target, draft, prompt_len, ks):
    """Prompts inside and past index_topk (8), so verify steps run the dense and sparse
    DSA paths, and a short prompt whose generation crosses index_topk mid-verify."""
    prompt = [(11 * i + 5) % 256 for i in range(prompt_len)]
    n = 14
    plain = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n)]
    for k in ks:
        stats = SpecStats()
        got = [t for t, _, _ in speculative_generate_step(
            prompt, target, draft, num_draft_tokens=k, max_tokens=n, stats=stats)]
        assert got == plain, k
        assert stats.accepted > 0 and stats.accepted < stats.drafted  # both paths ran


def test_caches_after_generation_hold_all_but_the_last_token(target, draft):
    """As mlx-lm's generate_step leaves them: the prompt cache can be reused (chat)."""
    prompt = [(3 * i + 2) % 256 for i in range(6)]
    caches = target.make_cache() + draft.make_cache()
    out = [t for t, _, _ in speculative_generate_step(
        prompt, target, draft, num_draft_tokens=3, max_tokens=9, prompt_cache=caches)]
    nt = len(target.layers)
    want_t = cache_tensors(plain_decode(target, prompt, out[:-1]))
    want_d = cache_tensors(plain_decode(draft, prompt, out[:-1]))
    assert worst_mismatch(cache_tensors(caches[:nt]), want_t) < ROUNDING
    assert worst_mismatch(cache_tensors(caches[nt:]), want_d) < ROUNDING


def test_closing_the_generator_mid_step_settles_the_caches(target, draft):
    prompt = [(3 * i + 2) % 256 for i in range(6)]
    caches = target.make_cache() + draft.make_cache()
    gen = speculative_generate_step(prompt, target, draft, num_draft_tokens=4,
                                    max_tokens=20, prompt_cache=caches)
    out = []
    for t, _, from_draft in gen:
        out.append(t)
        if from_draft:  # stop on an accepted draft: the rest of its step is dropped
            break
    gen.close()
    nt = len(target.layers)
    want = cache_tensors(plain_decode(target, prompt, out[:-1]))
    assert worst_mismatch(cache_tensors(caches[:nt]), want) < ROUNDING


# ------------------------------------------------------------- sampling distribution


def two_layer_args(vocab):
    cfg = tiny_text_config(
        num_hidden_layers=2, vocab_size=vocab,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                            "full_attn_layers": [2], "kda_layers": [1]},
        dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8})
    return ModelArgs.from_config(full_config(cfg))


def llama_draft(vocab, seed):
    """A 1-layer mlx-lm llama (a KVCache draft: the generic, trimmable path)."""
    from mlx_lm.models import llama

    a = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1,
                        intermediate_size=32, num_attention_heads=2, rms_norm_eps=1e-5,
                        vocab_size=vocab, num_key_value_heads=2)
    mx.random.seed(seed)
    m = llama.Model(a)
    m.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, m.parameters()))
    return m


def exact_two_token_distribution(model, prompt, vocab):
    """P(t1, t2) at temperature 1 from full forward passes without a cache."""
    p1 = mx.softmax(model(mx.array(prompt)[None])[0, -1].astype(mx.float32))
    rows = [p1[t] * mx.softmax(model(mx.array(prompt + [t])[None])[0, -1].astype(mx.float32))
            for t in range(vocab)]
    return np.array(mx.stack(rows), np.float64)


def sample_two_tokens(model, draft_model, prompt, n, seed, k=2):
    """Counts [V, V] of the first two tokens over n speculative runs at temperature 1."""
    vocab = model.args.vocab_size
    mc, dc = model.make_cache(), make_prompt_cache(draft_model)
    model(mx.array(prompt[:-1])[None], mc)
    draft_model(mx.array(prompt[:-1])[None], dc)
    mx.eval([c.state for c in mc + dc])
    sm, sd = snapshot(mc), snapshot(dc)
    mx.random.seed(seed)
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        restore(mc, sm)
        restore(dc, sd)
        toks = [t for t, _, _ in speculative_generate_step(
            [prompt[-1]], model, draft_model, num_draft_tokens=k, max_tokens=2,
            sampling=Sampling(temp=1.0), prompt_cache=mc + dc)]
        counts[toks[0], toks[1]] += 1
    return counts


def chi_square_p(counts, probs, min_expected=5.0):
    """Pearson chi-square goodness of fit p-value; cells with expected < min_expected are
    pooled into one."""
    n = counts.sum()
    e, c = (probs * n).ravel(), counts.ravel()
    small = e < min_expected
    if small.any():
        e = np.append(e[~small], e[small].sum())
        c = np.append(c[~small], c[small].sum())
    stat = float(((c - e) ** 2 / e).sum())
    return chi2_sf(stat, len(e) - 1)


def chi2_sf(x, dof):
    """P(X > x) for X ~ chi-square(dof): 1 - P(dof/2, x/2), the regularised lower
    incomplete gamma by its power series (Numerical Recipes 6.2); exact enough here."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    for i in range(1, 10000):
        term *= z / (a + i)
        total += term
        if term < total * 1e-15:
            break
    lower = total * math.exp(-z + a * math.log(z) - math.lgamma(a))
    return max(0.0, 1.0 - lower)


VOCAB, N_SAMPLES = 6, 700
PROMPT = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]  # longer than index_topk (8)


@pytest.fixture(scope="module")
def sampling_models():
    model = random_model(two_layer_args(VOCAB), seed=0)
    d = llama_draft(VOCAB, seed=3)
    return model, d, exact_two_token_distribution(model, PROMPT, VOCAB)


def test_sampling_distribution_of_first_two_tokens_is_the_targets(sampling_models):
    model, d, probs = sampling_models
    counts = sample_two_tokens(model, d, PROMPT, N_SAMPLES, seed=2)
    assert chi_square_p(counts, probs) > 1e-3


def test_chi_square_rejects_a_wrong_acceptance_rule(sampling_models, monkeypatch):
    """Planted bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    model, d, probs = sampling_models

    def wrong(p_lp, q_lp, drafts):
        k = drafts.shape[0]
        if k == 0:
            return mx.array(0), mx.random.categorical(p_lp[0])
        p, q = mx.exp(p_lp), mx.exp(q_lp)
        rows = mx.arange(k)
        ok = mx.random.uniform(shape=(k,)) * q[rows, drafts] < p[rows, drafts]
        n = mx.where(mx.all(ok), k, mx.argmin(ok.astype(mx.int32)))
        return n, mx.random.categorical(p_lp)[n]

    monkeypatch.setattr(spec, "accept_drafts", wrong)
    counts = sample_two_tokens(model, d, PROMPT, N_SAMPLES, seed=2)
    assert chi_square_p(counts, probs) < 1e-6


def test_accept_drafts_marginal_is_p_on_many_draws():
    """The rule alone, vectorised over many draws of one position: the emitted token is
    distributed as p whatever q is (Leviathan et al. 2023, Theorem 1)."""
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    mx.random.seed(5)
    counts = np.zeros(4)
    lp, lq = mx.log(mx.array(p, mx.float32)), mx.log(mx.array(q, mx.float32))
    for _ in range(1500):
        d = mx.random.categorical(lq)
        n, tok = spec.accept_drafts(mx.stack([lp, lp]), lq[None], d.reshape(1))
        counts[d.item() if n.item() == 1 else tok.item()] += 1
    assert chi_square_p(counts, p) > 1e-3


# ------------------------------------------------------------------ CLI and tokenizer


@pytest.fixture(scope="module")
def other_tokenizer_ckpt(tmp_path_factory):
    """A tiny checkpoint whose 256 byte tokens have reversed ids."""
    from kimi_mlx.testing.checkpoints import build_checkpoint, byte_level_ranks

    ranks = {b: 255 - i for b, i in byte_level_ranks().items()}
    return build_checkpoint(tmp_path_factory.mktemp("other") / "other", seed=1, ranks=ranks)


def test_draft_with_another_tokenizer_is_refused_naming_both(tiny_ckpt, other_tokenizer_ckpt,
                                                             capsys):
    from kimi_mlx.commands.generate import main

    rc = main(["--model", str(tiny_ckpt), "--draft-model", str(other_tokenizer_ckpt),
               "--prompt", "hi", "--ignore-chat-template", "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert rc == 2
    assert str(tiny_ckpt) in err and str(other_tokenizer_ckpt) in err
    assert "tokenizer" in err


def test_special_tokens_are_compared_too(tiny_ckpt):
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.speculative.loop import TokenizerMismatch, check_tokenizers

    _, wrapper, _, _ = load_for_generation(str(tiny_ckpt))
    check_tokenizers(wrapper, wrapper, "a", "b")  # the same tokenizer passes

    class Renamed:
        """The same vocabulary with one special token renamed."""

        def __init__(self, tok):
            self.tok = tok

        def get_vocab(self):
            return self.tok.get_vocab()

        @property
        def all_special_tokens(self):
            return ["<|not_the_eos|>"] + list(self.tok.all_special_tokens)[1:]

        def convert_tokens_to_ids(self, t):
            return 10**6 if t == "<|not_the_eos|>" else self.tok.convert_tokens_to_ids(t)

    with pytest.raises(TokenizerMismatch, match="special token"):
        check_tokenizers(wrapper, Renamed(wrapper), "target-x", "draft-y")


def test_generate_with_a_draft_prints_the_plain_greedy_text(tiny_ckpt, capsys):
    from kimi_mlx.commands.generate import main

    base = ["--model", str(tiny_ckpt), "--prompt", "the cat sat on", "--ignore-chat-template",
            "--max-tokens", "10", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out.split("==========")[1]
    assert main(base + ["--draft-model", str(tiny_ckpt), "--num-draft-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.split("==========")[1] == plain
    assert "Speculative:" in out and "accepted per step" in out


def test_chat_turns_with_a_draft_equal_plain_chat_and_reuse_the_caches(tiny_ckpt, draft):
    """Greedy chat turns give the same replies with and without speculation, also when the
    speculative turn is served from target + draft caches that already hold the prefix."""
    from mlx_lm.sample_utils import make_sampler

    from kimi_mlx.commands.chat import Conversation, chat_turn
    from kimi_mlx.text.chat_format import encode_chat
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.speculative.loop import Speculation

    model, wrapper, tok, _ = load_for_generation(str(tiny_ckpt))
    greedy = make_sampler(0.0)
    plain, fast = Conversation(), Conversation()
    sp = Speculation(draft, 3)  # the module's perturbed tiny model: same vocab and layout
    a = chat_turn(model, wrapper, tok, plain, "hi", "low", greedy, 8, 4096)
    b = chat_turn(model, wrapper, tok, fast, "hi", "low", greedy, 8, 4096, speculation=sp)
    assert a == b and sp.stats.steps > 0

    prefix = encode_chat(tok, fast.messages, reasoning_effort="low", add_generation_prompt=False)
    fast.cache = model.make_cache() + draft.make_cache()
    model(mx.array([prefix]), fast.cache[: len(model.layers)])
    draft(mx.array([prefix]), fast.cache[len(model.layers):])
    fast.processed = prefix
    a = chat_turn(model, wrapper, tok, plain, "and then?", "low", greedy, 8, 4096,
                  reuse_cache=False)
    b = chat_turn(model, wrapper, tok, fast, "and then?", "low", greedy, 8, 4096, speculation=sp)
    assert fast.reused_tokens == len(prefix) > 10
    assert a == b


# ------------------------------------------------------------------ the shipped draft


def test_shipped_micro_draft_matches_micro_and_keeps_its_greedy_output():
    """kimi_mlx/assets/micro-draft: same tokenizer as micro (checked by the loader), and
    speculative greedy text from micro equals its plain greedy text on real code."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.bench.spec import default_draft
    from kimi_mlx.speculative.loop import load_draft

    path = default_draft()
    assert path is not None, "kimi_mlx/assets/micro-draft is missing (make micro-draft)"
    micro = path.parent / "micro"
    model, wrapper, tok, _ = load_for_generation(str(micro))
    d = load_draft(str(path), wrapper, str(micro))
    assert len(d.layers) == 2
    prompt = tok.encode('class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self')
    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]
    stats = SpecStats()
    got = [t for t, _, _ in speculative_generate_step(prompt, model, d, num_draft_tokens=3,
                                                      max_tokens=24, stats=stats)]
    assert got == plain
    assert stats.mean_accepted > 0.5  # distilled: far above a random 2-layer model (~0)


def test_bench_rows_have_the_figures(target, draft):
    from kimi_mlx.bench.spec import bench

    rows = bench(target, draft, [[1, 2, 3, 4, 5]], tokens=6, ks=[1, 2], repeats=1)
    assert [r["k"] for r in rows] == [1, 2]
    for r in rows:
        assert r["plain_tps"] > 0 and r["spec_tps"] > 0 and 0 <= r["mean_accepted"] <= r["k"]
        assert r["speedup"] == pytest.approx(r["spec_tps"] / r["plain_tps"])


def test_cluster_launch_refuses_a_draft_with_another_tokenizer_before_contacting_nodes(
        tiny_ckpt, other_tokenizer_ckpt, tmp_path, capsys):
    from kimi_mlx.commands import main as cli
    from kimi_mlx.cluster.net.auth import init_secret

    secret = init_secret(tmp_path / "cluster.key")
    rc = cli.main(["cluster", "launch", "--model", str(tiny_ckpt), "--draft-model",
                   str(other_tokenizer_ckpt), "--prompt", "hi", "--nodes", "127.0.0.1:1",
                   "--secret-file", str(secret)])
    err = capsys.readouterr().err
    assert rc == 2  # 1 would mean it went on to the (absent) node
    assert str(tiny_ckpt) in err and str(other_tokenizer_ckpt) in err and "tokenizer" in err
