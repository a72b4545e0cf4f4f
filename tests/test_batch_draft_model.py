"""A draft model inside continuous batching (`speculative.proposers.DraftModelRows`): the
draft's caches batched row for row with the target's, each row rolled back to its own
accepted length.

References are independent of the code under test: mlx-lm's `generate_step` on the plain
micro model, one sequence at a time, a plain forward of the draft over a row's kept
tokens, and the plain server one request at a time without drafts.

- mlx-lm's `BatchGenerator` with micro-draft proposing for every row: rows of different
  lengths, one joining mid-way, copy-heavy and ordinary prompts: every row's greedy tokens
  equal its single run; drafts were accepted, partly (rows rolled back by different
  counts); a row with a logits processor decodes with k = 0 and equals its single run
  with that processor.
- draft caches with attention rows (a tiny K3.1 draft: KDA and DSA layers; an mlx-lm
  llama: KVCache rows): each row trimmed to its own kept length, left padding and all.
- temperature > 0: a sampled row's drafts and their q are the draft's own distribution
  (a plain single-sequence forward of the draft), and after `settle` every row's draft
  cache equals a single run over the tokens it kept.
- the server: `--draft-model micro-draft --max-concurrency 4`: four concurrent greedy
  replies equal the plain server's one request at a time, and drafts were verified.
- a tensor group's rows (a group of one, in this process): the same proposer, every row
  equal to its single run.
"""

import os

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import Sampling
from kimi_mlx.speculative.batch import BatchDrafts

from fixtures.batched import greedy, replies, run_batch, start_servers, stop_servers

MICRO = str(default_model())
DRAFT = str(default_model().parent / "micro-draft")
LOOP = [7, 8, 9, 10, 11, 12]
N = 24


@pytest.fixture(scope="module")
def micro():
    model, _, tok, _ = load_for_generation(MICRO)
    draft, _, _, _ = load_for_generation(DRAFT)
    text = open(os.path.join(MICRO, "heldout", "prose.txt")).read()
    code = "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):"
    prompts = [tok.encode(text[:40]), tok.encode(code), list(range(100, 170)) + LOOP * 3,
               tok.encode(text[700:1000]), LOOP * 6 + [300, 301]]
    singles = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                                  sampler=greedy)] for p in prompts]
    return model, draft, prompts, singles


def _run(model, draft, prompts, k, at_once, join_after, samplings=None, processors=None,
         max_tokens=N, batch=(2, 8)):
    drafts = BatchDrafts(draft, k, gate=None, vocab=model.args.vocab_size)
    return run_batch(model, drafts, prompts, at_once, join_after, samplings, processors,
                     max_tokens, batch)


@pytest.mark.parametrize("k", [2, 4])
def test_batched_draft_model_greedy_equals_single_runs(micro, k):
    model, draft, prompts, singles = micro
    got, drafts = _run(model, draft, prompts, k, at_once=3, join_after=3)
    assert got == singles
    st = drafts.stats
    assert st.steps > 0 and 0 < st.accepted < st.drafted
    assert any(0 < n < k for n in st.per_step)  # partly accepted: rows rolled back
    assert not drafts.rows and not drafts.proposer.uids  # every finished row forgotten


def test_a_processor_row_beside_draft_model_rows(micro):
    from mlx_lm.sample_utils import make_logits_processors

    model, draft, prompts, singles = micro
    bias = {int(singles[1][0]): -100.0}
    procs = make_logits_processors(bias)
    want = [int(t) for t, _ in generate_step(mx.array(prompts[1]), model, max_tokens=N,
                                              sampler=greedy, logits_processors=procs)]
    got, drafts = _run(model, draft, prompts, 3, at_once=5, join_after=1,
                       processors=[None, make_logits_processors(bias), None, None, None])
    assert got[1] == want
    assert [got[i] for i in (0, 2, 3, 4)] == [singles[i] for i in (0, 2, 3, 4)]
    assert drafts.stats.accepted > 0


def test_sampled_rows_draw_from_the_draft_and_return_its_q(micro):
    """Temperature > 0: a sampled row's drafts are drawn from the draft's own distribution
    and returned as q for the residual rule (`loop.accept_drafts`, whose statistics
    tests/test_speculative.py holds): q at each position equals the row's sampling of the
    draft's logits from a plain single-sequence forward of prompt + y + the drafts before
    it; a greedy row beside it drafts the draft's argmax; after `settle` each row's draft
    cache equals a single run of its kept tokens."""
    from kimi_mlx.speculative.proposers import DraftModelRows

    model, draft, prompts, _ = micro
    rows = DraftModelRows(draft, model.args.vocab_size)
    ps = [prompts[1], prompts[0]]
    for uid, p in enumerate(ps):
        rows.add(uid, p)
    s = Sampling(temp=0.7)
    ys = [5, 6]
    mx.random.seed(0)
    props, qs = rows.propose([0, 1], ys, [3, 3], [s, Sampling()])
    assert qs[1] is None and len(props[0]) == len(props[1]) == 3
    for b, smp in ((0, s), (1, None)):
        ctx = ps[b] + [ys[b]]
        for j in range(3):
            ref = draft(mx.array(ctx)[None])[0, -1].astype(mx.float32)
            if smp is None:
                assert props[b][j] == mx.argmax(ref).item()
            else:
                want = smp.log_probs(ref)
                assert mx.allclose(qs[b][j], want, atol=1e-4).item()
            ctx.append(props[b][j])
    rows.settle([1, 3])
    nxt = mx.array([7, 8], mx.uint32)
    got = rows._step(nxt)
    for b, n in enumerate([1, 3]):
        ref = draft(mx.array(ps[b] + [ys[b]] + props[b][:n] + [int(nxt[b])])[None])[0, -1]
        assert mx.allclose(got[b], ref.astype(mx.float32), atol=1e-3).item(), b


def test_server_batches_a_draft_model_and_equals_single_runs():
    """`kimi-mlx server --draft-model micro-draft --max-concurrency 4`: four concurrent
    greedy replies equal the plain server's one request at a time (no draft, no batch),
    drafts were verified and accepted, /metrics counts them; the same prompts again
    (prompt-cache hits of the target's rows) give the same replies."""
    from kimi_mlx.speculative.settings import DraftSettings

    made = start_servers(MICRO, [(None, 1), (DraftSettings(model=DRAFT, num_draft_tokens=3), 4)])
    try:
        (_, _, single), (svc, _, spec) = made
        assert svc.engine.batched_drafts and svc.engine.max_concurrency == 4
        want = [t for t, _ in replies(single)]
        assert [t for t, _ in replies(spec)] == want
        st = svc.engine.speculation.stats
        assert st.steps > 0 and st.accepted > 0
        assert svc.metrics.verify_steps._value.get() == st.steps
        again = replies(spec)
        assert [t for t, _ in again] == want
        assert all(u.prompt_tokens_details.cached_tokens > 0 for _, u in again)
    finally:
        stop_servers(made)


def test_tensor_group_rows_verify_draft_model_drafts_in_one_process(micro):
    """The same proposer through a tensor group's rows (`cluster.tensor.rows.GroupRows`, a
    group of one): the draft runs beside the group, its rows follow the group's."""
    from kimi_mlx.cluster.tensor.rows import GroupRows
    from kimi_mlx.testing.tensor_rows import batched_greedy

    model, draft, _, _ = micro
    prompts = [list(range(100, 105)) + LOOP * 4, list(range(200, 237)), LOOP * 6 + [300, 301],
               list(range(100, 170)) + LOOP * 3]
    refs = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                               sampler=greedy)] for p in prompts]
    rows = GroupRows(model, mx.distributed.init())
    drafts = BatchDrafts(draft, 4, gate=None, vocab=model.args.vocab_size)
    got = batched_greedy(rows, prompts, N, at_once=3, join_after=3, prefill_step=16,
                         drafts=drafts)
    assert got == refs
    assert drafts.stats.accepted > 0


def _kimi_draft():
    """A tiny K3.1 (KDA and DSA layers: `ArraysCache` and `DSACache` rows), float32."""
    from kimi_mlx.model.config import ModelArgs
    from kimi_mlx.testing.checkpoints import full_config, random_model, tiny_text_config

    return random_model(ModelArgs.from_config(full_config(tiny_text_config(vocab_size=4352))),
                        seed=1)


def _llama_draft():
    """A 1-layer mlx-lm llama (`KVCache` rows, merged into mlx-lm's `BatchKVCache`)."""
    from mlx_lm.models import llama

    a = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1,
                        intermediate_size=32, num_attention_heads=2, rms_norm_eps=1e-5,
                        vocab_size=4352, num_key_value_heads=2)
    mx.random.seed(2)
    return llama.Model(a)


@pytest.mark.parametrize("make", [_kimi_draft, _llama_draft], ids=["kimi-kda-dsa", "llama-kv"])
def test_draft_caches_with_attention_rows_settle_per_row(micro, make):
    """Draft caches other than micro-draft's KDA-only ones: attention rows of different
    prompt lengths (left padding) trimmed per row by `settle`; after it, each row's next
    draft logits equal a plain single-sequence forward of the tokens it kept; and the
    batched generator with this draft still gives every row its single greedy run."""
    from kimi_mlx.speculative.proposers import DraftModelRows

    model, _, prompts, singles = micro
    draft = make()
    rows = DraftModelRows(draft, model.args.vocab_size)
    ps = [prompts[0], prompts[2], prompts[3]]
    for uid, p in enumerate(ps):
        rows.add(uid, p)
    ys = [5, 6, 7]
    props, _ = rows.propose([0, 1, 2], ys, [3, 3, 2], [Sampling()] * 3)
    keep = [0, 3, 2]
    rows.settle(keep)
    nxt = mx.array([9, 10, 11], mx.uint32)
    got = rows._step(nxt)
    for b, n in enumerate(keep):
        ref = draft(mx.array(ps[b] + [ys[b]] + props[b][:n] + [int(nxt[b])])[None])[0, -1]
        ref = ref.astype(mx.float32)
        assert mx.allclose(got[b], ref, atol=1e-3 * max(1.0, mx.abs(ref).max().item())).item(), b
    out, drafts = _run(model, draft, prompts, 3, at_once=3, join_after=2)
    assert out == singles and drafts.stats.steps > 0


def test_plain_steps_are_caught_up_in_one_pass(micro):
    """Steps the verify gate keeps plain do not run the draft (`DraftModelRows.plain`
    notes their tokens); the next proposal feeds them first, and a row that joined
    during those steps is prefilled with them: every row's greedy drafts then equal the
    draft's own greedy continuation of its whole sequence, one sequence at a time."""
    from kimi_mlx.speculative.proposers import DraftModelRows

    model, draft, prompts, _ = micro
    rows = DraftModelRows(draft, model.args.vocab_size)
    ctx = {0: list(prompts[1]), 1: list(prompts[0]), 2: list(prompts[4])}
    rows.add(0, ctx[0])
    rows.add(1, ctx[1])
    props, _ = rows.propose([0, 1], [5, 6], [2, 2], [Sampling()] * 2)
    rows.settle([1, 0])
    ctx[0] += [5] + props[0][:1]
    ctx[1] += [6]
    calls = []

    class Counting:  # the draft, its forward calls counted
        def __call__(self, x, **kw):
            calls.append(x.shape)
            return draft(x, **kw)

        def __getattr__(self, name):
            return getattr(draft, name)

    rows.model = Counting()
    rows.plain([0, 1], mx.array([7, 8], mx.uint32))
    ctx[0].append(7)
    ctx[1].append(8)
    rows.add(2, ctx[2])  # joins: in the next two plain steps
    for a, b, c in ((9, 10, 11), (12, 13, 14)):
        rows.plain([0, 1, 2], mx.array([a, b, c], mx.uint32))
        for u, t in zip((0, 1, 2), (a, b, c)):
            ctx[u].append(t)
    assert not calls  # plain steps run nothing
    ys = [15, 16, 17]
    props, _ = rows.propose([0, 1, 2], ys, [3, 3, 3], [Sampling()] * 3)
    # one catch-up pass of the two old rows (3 tokens each), the new row's prefill, and
    # the K + 1 draft passes
    assert calls[0] == (2, 3)
    for u, y in zip((0, 1, 2), ys):
        seq, want = ctx[u] + [y], []
        for _ in range(3):
            want.append(mx.argmax(draft(mx.array(seq)[None])[0, -1]).item())
            seq.append(want[-1])
        assert props[u] == want, u
