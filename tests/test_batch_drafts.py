"""N-gram drafts verified inside continuous batching (issue 33, part 3:
`kimi_mlx.speculative.batch`, `rollback.rollback_rows`).

References are independent of the code under test: mlx-lm's `generate_step` on the plain
micro model, one sequence at a time (the greedy tokens, and the logits after a rollback),
and the plain server without drafts.

- `rollback_rows`: a batch of three rows (one past index_topk: the DSA sparse path)
  verifies T tokens, each row keeps its own count (0, some, all); the next token's logits
  of every row equal a single-sequence run of its prompt plus the kept tokens, with the
  KDA states picked from the verify's per-token states and replayed (K3.1's path).
- mlx-lm's `BatchGenerator` with the speculative batch: rows of different lengths, one
  joining mid-way, copy-heavy and ordinary prompts: every row's greedy tokens equal its
  single run, drafts were accepted, partly (so rows were rolled back by different counts).
- a row with a logits processor (logit_bias) decodes with k = 0 beside speculating rows
  and equals its single run with the same processor; a sampled row runs beside greedy
  rows without changing them.
- the server: `--draft ngram --max-concurrency 4`: four concurrent replies equal the plain
  server's, the metrics count the verify steps, a prompt-cache hit still equals it.
- a tensor group: the same through the group's rows in one process and 2 loopback ranks.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import Sampling
from kimi_mlx.speculative.batch import BatchDrafts
from kimi_mlx.speculative.ngram import NgramDraft

from fixtures.batched import greedy, replies, run_batch, start_servers, stop_servers

MICRO = str(default_model())
LOOP = [7, 8, 9, 10, 11, 12]
N = 24


@pytest.fixture(scope="module")
def micro():
    model, _, tok, _ = load_for_generation(MICRO)
    text = open(os.path.join(MICRO, "heldout", "prose.txt")).read()
    code = "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):"
    prompts = [tok.encode(text[:40]), tok.encode(code), list(range(100, 170)) + LOOP * 3,
               tok.encode(text[700:1000]), LOOP * 6 + [300, 301]]
    assert min(map(len, prompts)) < model.args.index_topk < max(map(len, prompts))
    singles = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                                  sampler=greedy)] for p in prompts]
    return model, prompts, singles


def _run(model, prompts, k, at_once, join_after, samplings=None, processors=None):
    """Tokens per prompt from a speculative BatchGenerator (the first `at_once` inserted
    together, one more every `join_after` steps); returns (tokens, drafts)."""
    drafts = BatchDrafts(NgramDraft(), k, gate=None)  # verify whenever a row has a draft
    return run_batch(model, drafts, prompts, at_once, join_after, samplings, processors,
                     max_tokens=N)


def test_the_verify_gate_follows_the_measured_costs():
    """(B + drafted rows x accepted) / T_verify against B / T_plain, with a clock the test
    sets: verify steps 3x a plain one pay only when more than 2 tokens per row come back;
    unmeasured costs verify; a refused step verifies every EXPLORE-th time anyway."""
    from kimi_mlx.speculative.batch import EXPLORE, VerifyGate

    now = [0.0]
    g = VerifyGate(clock=lambda: now[0])
    assert g.should_verify(4, 3, 4)  # nothing measured yet

    def steps(key, seconds, n=3):  # as `SpeculativeBatch.next` calls it
        for _ in range(n):
            g.mark()
            g.step(key)
            now[0] += seconds
        g.mark()

    steps(("plain", 4), 0.010)
    steps(("verify", 4, 3), 0.030)
    g.accepted([1, 1, 1, 1])  # ~1 accepted per row: 4 + 4 tokens in 30 ms < 4 in 10 ms
    g.acc = 1.0
    assert not g.should_verify(4, 3, 4)
    g.acc = 2.5  # 4 + 10 tokens in 30 ms > 4 in 10 ms
    assert g.should_verify(4, 3, 4)
    assert not g.should_verify(4, 3, 1)  # one drafted row: 6.5 tokens in 30 ms
    g.acc = 0.0
    said = [g.should_verify(4, 3, 4) for _ in range(2 * EXPLORE)]
    at = [i for i, go in enumerate(said) if go]
    assert len(at) == 2 and at[1] - at[0] == EXPLORE
    assert g.should_verify(2, 3, 2)  # another batch size: not measured yet
    # closed: not even every row drafted would pay, so the step does not look at its
    # inputs; every EXPLORE-th one is let through and then verifies
    assert not g.closed(2)  # nothing measured for B = 2
    closed = [g.closed(4) for _ in range(EXPLORE)]
    assert closed[:-1] == [True] * (EXPLORE - 1) and closed[-1] is False
    assert g.should_verify(4, 3, 1)  # the explored step verifies
    g.acc = 2.5
    assert not g.closed(4)


@pytest.mark.parametrize("k", [2, 5])
def test_batched_greedy_drafts_equal_single_runs(micro, k):
    model, prompts, singles = micro
    got, drafts = _run(model, prompts, k, at_once=3, join_after=3)
    assert got == singles
    st = drafts.stats
    assert st.steps > 0 and 0 < st.accepted < st.drafted  # accepted, and rolled back
    assert any(0 < n < k for n in st.per_step)  # partly accepted rows
    assert not drafts.rows  # every finished row forgotten


@pytest.mark.parametrize("step_states", [True, False], ids=["pick", "replay"])
def test_rollback_rows_leaves_each_row_as_its_single_run(micro, monkeypatch, step_states):
    """Both KDA rollbacks: a pick of the kept per-token states (micro's small states) and
    the replay K3.1's states take (step states off)."""
    from mlx_lm.models.cache import make_prompt_cache

    import kimi_mlx.model.kda as kda

    if not step_states:
        monkeypatch.setattr(kda, "STEP_STATES_MAX_BYTES", 0)

    from kimi_mlx.speculative.rollback import begin_verify, end_verify, rollback_rows

    model, prompts, _ = micro
    rows = [prompts[0], prompts[2], prompts[3]]  # 12, 88 and ~70 tokens (one past topk)
    T, n_keep = 4, [0, 2, 4]
    verify_toks = [[21, 22, 23, 24], [31, 7, 8, 9], [41, 42, 43, 44]]
    singles = []
    for p in rows:
        c = make_prompt_cache(model)
        model(mx.array(p)[None], cache=c)
        mx.eval([x.state for x in c])
        singles.append(c)
    # the batch: single caches merged (left padding), as the generator holds them
    batch = [type(col[0]).merge(list(col)) if hasattr(type(col[0]), "merge") else None
             for col in zip(*singles)]
    assert all(b is not None for b in batch)
    verify = begin_verify(batch)
    model(mx.array(verify_toks), cache=batch)
    rollback_rows(batch, verify, n_keep)
    end_verify(batch)
    nxt = mx.array([[5], [6], [7]])
    got = model(nxt, cache=batch)[:, -1]
    for b, p in enumerate(rows):
        ref = model(mx.array(p + verify_toks[b][:n_keep[b]] + [int(nxt[b, 0])])[None])[0, -1]
        diff = mx.abs(got[b] - ref).max().item()
        assert diff <= 1e-3 * max(1.0, mx.abs(ref).max().item()), (b, diff)
        assert mx.argmax(got[b]).item() == mx.argmax(ref).item()


def test_a_row_with_a_processor_and_a_sampled_row_beside_speculating_rows(micro):
    from mlx_lm.sample_utils import make_logits_processors

    model, prompts, singles = micro
    bias = {int(singles[1][0]): -100.0}  # forbid the code row's first greedy token
    procs = make_logits_processors(bias)
    want = [int(t) for t, _ in generate_step(mx.array(prompts[1]), model, max_tokens=N,
                                              sampler=greedy, logits_processors=procs)]
    assert want != singles[1]
    samplings = [Sampling(), Sampling(), Sampling(temp=1.0), Sampling(), Sampling()]
    got, drafts = _run(model, prompts, 3, at_once=5, join_after=1, samplings=samplings,
                       processors=[None, make_logits_processors(bias), None, None, None])
    assert got[1] == want  # decoded with k = 0, its processor applied
    assert [got[i] for i in (0, 3, 4)] == [singles[i] for i in (0, 3, 4)]
    assert len(got[2]) == N and all(0 <= t < model.args.vocab_size for t in got[2])
    assert drafts.stats.accepted > 0


def test_server_batches_ngram_drafts_and_equals_the_plain_server():
    from kimi_mlx.speculative.settings import DraftSettings

    made = start_servers(MICRO, [(None, 4), (DraftSettings(kind="ngram", num_draft_tokens=3), 4)])
    try:
        (_, _, plain), (svc, _, spec) = made
        assert svc.engine.batched_drafts and svc.engine.max_concurrency == 4
        want = [t for t, _ in replies(plain)]
        assert [t for t, _ in replies(spec)] == want
        st = svc.engine.speculation.stats
        assert st.steps > 0 and st.accepted > 0
        assert svc.metrics.verify_steps._value.get() == st.steps
        assert svc.metrics.accepted._value.get() == st.accepted
        again = replies(spec)  # the same prompts: prompt-cache hits, the same replies
        assert [t for t, _ in again] == want
        assert all(u.prompt_tokens_details.cached_tokens > 0 for _, u in again)
    finally:
        stop_servers(made)


@pytest.mark.parametrize("flags,message", [
    (dict(draft="mtp"), "--draft mtp serves one request"),
    (dict(draft_model=str(default_model().parent / "micro-dspark")),
     "(a block drafter) serves one request"),
])
def test_hidden_state_drafters_batch_in_one_process_not_through_a_pipeline(flags, message):
    """The MTP and block drafters batch in one process (`speculative.hidden_rows`); where
    the target's hiddens are not kept per batched pass (a pipeline) they serve one request
    at a time, and --max-concurrency > 1 is refused, naming the draft."""
    import argparse

    from kimi_mlx.sampling import InputError
    from kimi_mlx.server.serving import DEFAULT_CONCURRENCY, check_draft_server_arguments

    def args(conc):
        base = dict(draft=None, draft_model=None, num_draft_tokens=3, ngram_max=None,
                    ngram_min=None, max_concurrency=conc)
        return argparse.Namespace(**{**base, **flags})

    one = args(None)
    check_draft_server_arguments(one)
    assert one.max_concurrency == DEFAULT_CONCURRENCY > 1
    piped = args(None)
    check_draft_server_arguments(piped, batch_ngram=False, batch_models=False)
    assert piped.max_concurrency == 1
    with pytest.raises(InputError) as e:
        check_draft_server_arguments(args(4), batch_ngram=False, batch_models=False)
    assert message in str(e.value)


def test_ngram_drafts_default_to_batching():
    import argparse

    from kimi_mlx.server.serving import DEFAULT_CONCURRENCY, check_draft_server_arguments

    args = argparse.Namespace(draft="ngram", draft_model=None, num_draft_tokens=3,
                              ngram_max=4, ngram_min=1, max_concurrency=None)
    assert check_draft_server_arguments(args).kind == "ngram"
    assert args.max_concurrency == DEFAULT_CONCURRENCY > 1
    args.max_concurrency = None  # through a pipeline they do not batch
    check_draft_server_arguments(args, batch_ngram=False)
    assert args.max_concurrency == 1


TENSOR_PROMPTS = [list(range(100, 105)) + LOOP * 4, list(range(200, 237)), LOOP * 6 + [300, 301],
                  list(range(100, 170)) + LOOP * 3]


@pytest.fixture(scope="module")
def tensor_refs(micro):
    model = micro[0]
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N, sampler=greedy)]
            for p in TENSOR_PROMPTS]


def test_tensor_group_rows_verify_drafts_in_one_process(micro, tensor_refs):
    from kimi_mlx.cluster.tensor.rows import GroupRows
    from kimi_mlx.testing.tensor_rows import batched_greedy

    rows = GroupRows(micro[0], mx.distributed.init())
    drafts = BatchDrafts(NgramDraft(), 4, gate=None)
    got = batched_greedy(rows, TENSOR_PROMPTS, N, at_once=3, join_after=3, prefill_step=16,
                         drafts=drafts)
    assert got == tensor_refs
    assert drafts.stats.accepted > 0
    rows.new_row()  # flushes the frees
    assert len(rows._local.caches) == 1 and not rows._local.verifying


def test_tensor_group_rows_verify_drafts_through_two_ranks(tensor_refs, tmp_path):
    from kimi_mlx.testing.tensor_parallel import free_ports, run_ranks

    out = tmp_path / "rows.json"
    run_ranks(free_ports(2), ["--model", MICRO, "--prompts", json.dumps(TENSOR_PROMPTS),
                              "--max-tokens", str(N), "--at-once", "3", "--join-after", "2",
                              "--ngram", "4", "--out", str(out)],
              tmp_path, timeout=180, module="kimi_mlx.testing.tensor_rows")
    res = json.loads(out.read_text())
    assert res["batched"] == tensor_refs
    assert res["single"] == tensor_refs
    assert res["accepted"] > 0 and res["live_handles"] == 0
