"""Drafters of the target's hidden states inside continuous batching
(`speculative.hidden_rows`: `BlockDrafterRows`, `MtpRows`): every batched pass of the
target captured, each row's drafter state its own, rolled back by its own length.

References are independent of the code under test: mlx-lm's `generate_step` on the plain
model one sequence at a time, the plain server one request at a time without drafts
(through the real openai client), and the target's own softmax for the sampled rows.

- micro + micro-dspark in a `BatchGenerator`, rows joining mid-way: every greedy row
  equals its single run; drafts were accepted, partly (rows rolled back by different
  counts); a row's acceptance is that of the one-sequence block loop on the same prompt;
  greedy rows drafted in one drafter pass accept step for step what they accept drafted
  one by one.
- the server, `--draft-model micro-dspark --max-concurrency 4`: four concurrent greedy
  replies equal the plain server's one request at a time.
- the MTP (a tiny checkpoint with one MTP layer, its logits replaced by an oracle that is
  right two in three times) in the one-process engine at max_concurrency 4: every greedy
  reply equals mlx-lm's plain greedy run; drafts accepted and rejected.
- temperature > 0: the first two tokens of many sampled rows drafted by micro-dspark are
  distributed as the target's (chi-square against its softmax), and a planted bug (a
  sampled row's drafts taken as the drafter's argmax) is caught.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import Sampling
from kimi_mlx.speculative.batch import BatchDrafts

from fixtures.batched import greedy, replies, run_batch, start_servers, stop_servers

MICRO = str(default_model())
DSPARK = str(default_model().parent / "micro-dspark")
N = 24
PROMPT = [7, 8, 9, 10, 11, 12] * 2  # the sampled rows' prompt


def _speculation(model, settings, name):
    from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation

    return build_speculation(settings, where=ONE_PROCESS, target_name=name, model=model)


@pytest.fixture(scope="module")
def micro():
    from kimi_mlx.speculative.settings import DraftSettings

    model, _, tok, _ = load_for_generation(MICRO)
    text = open(os.path.join(MICRO, "heldout", "prose.txt")).read()
    code = "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):"
    prompts = [tok.encode(text[:40]), tok.encode(code), tok.encode(text[700:1000]),
               tok.encode("the cat sat on the mat, " * 4), tok.encode(code * 2)]
    singles = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                                  sampler=greedy)] for p in prompts]
    spec = _speculation(model, DraftSettings(model=DSPARK, num_draft_tokens=4), MICRO)
    return model, spec.draft, prompts, singles


def test_batched_block_drafter_greedy_rows_equal_single_runs(micro):
    from kimi_mlx.speculative.block_loop import block_generate_step
    from kimi_mlx.speculative.loop import SpecStats

    model, draft, prompts, singles = micro
    drafts = BatchDrafts(draft, 4, gate=None, vocab=model.args.vocab_size)
    assert drafts.captures
    got, drafts = run_batch(model, drafts, prompts, at_once=3, join_after=2, max_tokens=N)
    assert got == singles
    st = drafts.stats
    assert st.steps > 0 and 0 < st.accepted < st.drafted
    assert any(0 < n < 4 for n in st.per_step)  # partly accepted: rows rolled back
    assert not drafts.rows and not drafts.proposer.rows  # every finished row forgotten
    # the one-sequence block loop on the same prompts accepts as many (the same drafter
    # state per row; k is capped by the tokens left the same way in both)
    one = SpecStats()
    for p in prompts:
        list(block_generate_step(p, model, draft, num_draft_tokens=4, max_tokens=N, stats=one))
    assert abs(st.accepted - one.accepted) <= 0.2 * one.accepted, (st.accepted, one.accepted)



def test_greedy_rows_drafted_together_draft_as_one_by_one(micro, monkeypatch):
    """The block drafter's greedy rows drafted in one pass (contexts left-padded and
    masked, per-row positions) give each row the drafts it gets drafted alone: the same
    accepted counts, step for step."""
    from kimi_mlx.speculative import hidden_rows

    model, draft, prompts, singles = micro

    def run():
        drafts = BatchDrafts(draft, 4, gate=None, vocab=model.args.vocab_size)
        got, drafts = run_batch(model, drafts, prompts, at_once=4, join_after=2, max_tokens=N)
        assert got == singles
        return drafts.stats.per_step

    together = run()
    monkeypatch.setattr(hidden_rows.BlockDrafterRows, "propose", hidden_rows._HiddenRows.propose)
    assert run() == together


def test_server_batches_a_block_drafter_and_equals_the_plain_server():
    """`kimi-mlx server --draft-model micro-dspark --max-concurrency 4` against the plain
    server one request at a time, four concurrent greedy chats through the openai client."""
    from kimi_mlx.speculative.settings import DraftSettings

    made = start_servers(MICRO, [(None, 1), (DraftSettings(model=DSPARK, num_draft_tokens=4), 4)])
    try:
        (_, _, single), (svc, _, spec) = made
        assert svc.engine.batched_drafts and svc.engine.max_concurrency == 4
        assert svc.engine.prompt_cache is None  # it reads every prompt position's hiddens
        want = [t for t, _ in replies(single)]
        assert [t for t, _ in replies(spec)] == want
        st = svc.engine.speculation.stats
        assert st.steps > 0 and st.accepted > 0
        assert svc.metrics.verify_steps._value.get() == st.steps
    finally:
        stop_servers(made)


# ----------------------------------------------------------------------------- MTP


class _Oracle:
    """The MTP's logits replaced by each row's plain greedy sequence two ahead (wrong at
    every third position), its real forward and cache kept: drafts that are accepted and
    rejected, whatever the random MTP predicts. Rows are told apart by their cache."""

    def __init__(self, mtp, vocab):
        self.real, self.vocab, self.seqs = mtp.step, vocab, {}

    def __call__(self, hidden, tokens, cache):
        y, _ = self.real(hidden, tokens, cache)
        seq = self.seqs[id(cache)]
        L = tokens.shape[1]
        want = []
        for j in range(cache.offset - L, cache.offset):
            t = seq[j + 2] if j + 2 < len(seq) else 0
            want.append((t + 1) % 256 if j % 3 == 1 else t)
        return y, 10.0 * mx.eye(self.vocab)[mx.array(want)][None]


def test_the_engine_batches_the_mtp_and_equals_plain_greedy(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.server.engine import Engine
    from kimi_mlx.server.jobs import Finished, Job
    from kimi_mlx.server.prompt_cache import PromptCache
    from kimi_mlx.speculative import hidden_rows
    from kimi_mlx.speculative.settings import DraftSettings
    from kimi_mlx.testing.checkpoints import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "tiny-mtp", seed=0, conditioned=True, mtp_layers=1)
    model, _, _ = load_model(ckpt, verbose=False)
    spec = _speculation(model, DraftSettings(kind="mtp", num_draft_tokens=3), str(ckpt))
    prompts = [[(7 * i + 3) % 250 for i in range(n)] for n in (5, 13, 9, 21, 3)]
    n = 14
    want = {tuple(p): [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n,
                                                         sampler=greedy)] for p in prompts}
    oracle = _Oracle(spec.draft, model.args.vocab_size)
    monkeypatch.setattr(spec.draft, "step", oracle)
    made = hidden_rows._MtpRow.__init__

    def row(self, mtp, hidden, context):  # each row's oracle follows its own reply
        made(self, mtp, hidden, context)
        oracle.seqs[id(self.cache)] = list(context) + want[tuple(context)]

    monkeypatch.setattr(hidden_rows._MtpRow, "__init__", row)
    engine = Engine(model, eos_ids=[], max_concurrency=4, prompt_cache=PromptCache(1 << 20),
                    speculation=spec)
    assert engine.batched_drafts and engine.prompt_cache is None
    engine.start()

    def one(p):
        job = Job(p, n)
        job.attach()
        events = list(engine.submit(job).events(timeout=300))
        assert isinstance(events[-1], Finished), events[-1]
        return [e.token for e in events[:-1]]

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, prompts))
    finally:
        engine.stop()
    assert got == [want[tuple(p)] for p in prompts]
    st = spec.stats
    assert st.accepted > 0 and any(0 < k < 3 for k in st.per_step), st.per_step


# ------------------------------------------------------------------- temperature > 0


class _FirstArgmax(Sampling):
    """Temperature sampling whose first token (the generator's own step, before any
    draft) is the argmax, so that every row's second token has one prefix."""

    def sampler(self):
        return greedy


def _target_next(model, ids, temp):
    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32) / temp
    return np.array(mx.softmax(logits, axis=-1))


def _fit(model, draft, prompt, temp, seed=3, rows=240):
    """Chi-square p-value of the second token of `rows` sampled rows (the first is the
    argmax, `_FirstArgmax`), each drafted by `draft` and verified in the batch, against
    the target's softmax at `temp` after the prompt and that first token."""
    from test_speculative import chi_square_p

    mx.random.seed(seed)
    drafts = BatchDrafts(draft, 3, gate=None, vocab=model.args.vocab_size)
    s = _FirstArgmax(temp=temp)
    got, drafts = run_batch(model, drafts, [prompt] * rows, at_once=16, join_after=1,
                            samplings=[s] * rows, max_tokens=2, batch=(16, 16))
    (t1,) = {g[0] for g in got}
    p = _target_next(model, prompt + [t1], temp)
    counts = np.bincount([g[1] for g in got], minlength=p.shape[0]).astype(np.float64)
    return chi_square_p(counts, p), drafts.stats


def test_sampled_rows_are_distributed_as_the_target(micro):
    """Temperature > 0 through the batch: the first token of each sampled row comes from
    the generator's plain step, the second from the verify step (an accepted draft or a
    draw from the residual); together they are distributed as the target's."""
    model, draft, prompts, _ = micro
    pval, st = _fit(model, draft, PROMPT, temp=1.0)
    # every row verified drafts once (rows that joined while others left kept their state)
    assert st.steps == 240 and 0 < st.accepted < st.drafted
    assert pval > 1e-3, pval


def test_sampled_rows_drafted_by_argmax_are_caught(micro, monkeypatch):
    """Planted bug: a sampled row's drafts taken as the drafter's argmax while q says they
    were drawn from its distribution (the residual rule then over-accepts them)."""
    import kimi_mlx.speculative.loop as loop

    def argmax_draft(logits, sampling, q_lps):
        q_lps.append(sampling.log_probs(logits))
        return mx.argmax(logits, axis=-1)

    monkeypatch.setattr(loop, "draw_draft", argmax_draft)
    model, draft, prompts, _ = micro
    pval, _ = _fit(model, draft, PROMPT, temp=1.0)
    assert pval < 1e-3, pval
