"""Speculative decoding through the pipeline (`cluster.head.speculative`): three stage processes
on loopback serving the shipped micro checkpoint, drafted by the shipped micro-draft.

References are independent of the code under test: mlx-lm's `generate_step` in one
process (greedy tokens), a plain token-by-token decode of the accepted tokens in one
process (every stage's caches after a rolled-back verify step), `kimi-mlx generate`
(the launcher's output), and the transport's ordinary stage-loss error.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.node.runner import Refused, StageSpec, load_stage
from kimi_mlx.cluster.head.speculative import speculative_pipeline_step
from kimi_mlx.testing.cluster import LocalCluster
from kimi_mlx.cluster.head.transport import StageFailure
from kimi_mlx.speculative.auto_k import AutoK
from kimi_mlx.speculative.loop import SpecStats, load_draft

from test_speculative import ROUNDING, cache_tensors, plain_decode, worst_mismatch

# Greedy verify (batched) vs token-by-token decode differ by ~5 eps of each tensor's scale
# here (measured); ROUNDING is test_speculative's bound for a random model (1024 eps).
DRAFT = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-draft"


@pytest.fixture(scope="module")
def cluster(micro_pipeline):
    """The session's 3 loopback stages (tests/fixtures/shared.py): read only here; the
    stage-loss test at the end kills a stage of a cluster of its own."""
    return micro_pipeline


@pytest.fixture
def own_cluster(tmp_path):
    c = LocalCluster(tmp_path, 3, prefix="spec")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def loaded(cluster):
    t, stages = cluster.load_transport()
    try:
        yield t, stages
    finally:
        t.shutdown()


@pytest.fixture(scope="module")
def models(cluster):
    """(one-process target, its tokenizer wrapper, the shipped draft)."""
    from kimi_mlx.checkpoint.loader import load_for_generation

    model, wrapper, _, _ = load_for_generation(str(cluster.ckpt))
    return model, wrapper, load_draft(str(DRAFT), wrapper, str(cluster.ckpt))


def _prompt(n):
    return [(37 * i + 11) % 4000 + 100 for i in range(n)]


def _wait_no_sessions(cluster, idx, timeout=5.0):
    end = time.monotonic() + timeout
    while True:
        left = [cluster.sessions(i) for i in idx]
        if not any(left) or time.monotonic() > end:
            return left
        time.sleep(0.05)


# Prompt lengths: short; one whose 24 generated tokens cross index_topk (64) mid-verify;
# one past it, so every verify step runs the sparse DSA path.
@pytest.mark.parametrize("prompt_len", [5, 58, 80])
def test_greedy_through_three_stages_equals_plain_greedy(cluster, loaded, models, prompt_len):
    t, stages = loaded
    model, _, draft = models
    assert len(stages) == 3
    assert model.args.index_topk == 64  # the prompt lengths below are chosen around it
    prompt = _prompt(prompt_len)
    n = 24
    want = [tok for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n),
                                       range(n))]
    stats = SpecStats()
    # and --num-draft-tokens auto past index_topk: k changes step to step through the stages
    auto = AutoK(4, explore_every=2) if prompt_len == 80 else None
    for k in (2, 4) + ((auto,) if auto else ()):
        got = [tok for tok, _, _ in speculative_pipeline_step(
            Pipeline(t, prefill_chunk=32), prompt, draft, model.args, num_draft_tokens=k,
            max_tokens=n, stats=stats)]
        assert got == want, k
    assert 0 < stats.accepted < stats.drafted  # verify steps both accepted and rejected
    assert auto is None or len({k for k in auto.ks if k}) >= 2, auto.ks
    assert _wait_no_sessions(cluster, [0, 1, 2]) == [0, 0, 0]


# ----------------------------------------------------------------- stage state directly


@pytest.fixture(scope="module")
def runners(cluster, loaded):
    """The same three layer ranges as StageRunners in this process: their sessions'
    caches can be read directly."""
    _, stages = loaded
    return [load_stage(cluster.ckpt, StageSpec(cluster.fp, s.start, s.end, i, 3, "float32",
                                                "float32"))[0]
            for i, s in enumerate(stages)]


def _through(runners, sessions, seq, offset, tokens, verify=False, keep=None):
    """One message through every stage, as the service passes it on."""
    x = mx.array([tokens], mx.int32)
    for r, s in zip(runners, sessions):
        out = r.run(s, seq, offset, x, False, verify, keep)
        x = out.hidden
    return out


def _stage_tensors(runners, sessions):
    """cache_tensors of every stage, keyed by global layer index."""
    out = {}
    for r, s in zip(runners, sessions):
        for (i, name), v in cache_tensors(s.cache).items():
            out[(r.spec.start + i, name)] = v
    return out


@pytest.mark.parametrize("keep", [0, 2, 5])
def test_every_stage_after_a_rejected_verify_equals_a_plain_decode(runners, models, keep):
    """Prefill 69 tokens (past index_topk), verify [y, d1..d4] with the logits of every
    position back, then a next message that keeps `keep` of them: each stage's caches
    (every layer, every tensor) are a one-process plain decode of what was kept, plus
    that next token."""
    model = models[0]
    prompt = _prompt(70)
    verify = [prompt[-1], 812, 1303, 77, 2900]
    nxt = 451
    sessions = [r.new_session(f"v{keep}", "head", Sampling()) for r in runners]
    _through(runners, sessions, 0, 0, prompt[:-1])
    out = _through(runners, sessions, 1, len(prompt) - 1, verify, verify=True)
    assert out.logits.shape == (5, model.args.vocab_size) and out.logits.dtype == mx.float32
    _through(runners, sessions, 2, len(prompt) - 1 + keep, [nxt], keep=keep)
    got = _stage_tensors(runners, sessions)
    want = cache_tensors(plain_decode(model, prompt[:-1], verify[:keep] + [nxt]))
    assert worst_mismatch(got, want) < ROUNDING
    if keep:  # the comparison can fail: keeping one position too few is caught
        wrong = cache_tensors(plain_decode(model, prompt[:-1], verify[:keep - 1] + [nxt]))
        assert worst_mismatch(got, wrong) > 100 * ROUNDING


def test_verify_logits_equal_one_process(runners, models):
    model = models[0]
    prompt = _prompt(70)
    verify = [prompt[-1], 812, 1303, 77]
    sessions = [r.new_session("logits", "head", Sampling()) for r in runners]
    _through(runners, sessions, 0, 0, prompt[:-1])
    got = _through(runners, sessions, 1, len(prompt) - 1, verify, verify=True).logits
    want = model(mx.array([prompt + verify[1:]]))[0, -4:].astype(mx.float32)
    assert mx.array_equal(got, want) or float(mx.abs(got - want).max()) <= (
        ROUNDING * 1.2e-7 * float(mx.abs(want).max()))


def test_keep_is_required_after_a_verify_and_refused_elsewhere(runners):
    r0 = runners[:1]
    s = [r0[0].new_session("keep", "head", Sampling())]
    _through(r0, s, 0, 0, [5, 6, 7])
    with pytest.raises(Refused, match="without a verify chunk"):
        _through(r0, s, 1, 3, [8], keep=1)
    _through(r0, s, 1, 3, [8, 9, 10], verify=True)
    with pytest.raises(Refused, match="must say how many"):
        _through(r0, s, 2, 6, [11])
    with pytest.raises(Refused, match="keep 4 of a verify chunk of 3"):
        _through(r0, s, 2, 7, [11], keep=4)
    with pytest.raises(Refused, match="starts at position 6, expected 4"):
        _through(r0, s, 2, 6, [11], keep=1)  # keep 1 of [8, 9, 10]: the next is position 4
    _through(r0, s, 2, 4, [11], keep=1)
    assert s[0].offset == 5 and s[0].verify is None


class _Recorder:
    """A transport that records what the head sends and answers verify steps with
    logits whose argmax is a fixed token sequence (the 'target')."""

    def __init__(self, vocab, answers):
        self.vocab, self.answers, self.sent = vocab, list(answers), []

    def open(self, *a):
        pass

    def send(self, session, seq, offset, tokens, sample, verify=False, keep=None):
        self.sent.append(dict(seq=seq, offset=offset, tokens=list(tokens), verify=verify,
                              keep=keep))

    def receive(self, session, timeout=None):
        from kimi_mlx.cluster.head.transport import TokenResult

        m = self.sent[-1]
        rows = [self.answers[m["offset"] + i] for i in range(len(m["tokens"]))]
        logits = mx.zeros((len(rows), self.vocab)) + mx.eye(self.vocab)[mx.array(rows)] * 9
        return TokenResult(session, m["seq"], 0, None, logits)

    def close(self, session):
        pass


def test_the_accepted_count_rides_on_the_next_message(models):
    """No extra round trip: after each verify step the next message (the next verify
    step) carries `keep`, positions continue from the kept ones, and the greedy tokens
    are the 'target's (the recorder's argmax per position)."""
    model, _, draft = models
    prompt = _prompt(9)
    # The 'target': the draft's own greedy choice (full forward, no cache), changed at
    # every third position, so drafts are accepted up to the next change.
    answers, seq = [0] * 8, list(prompt)
    for pos in range(8, 8 + 14):
        tok = int(mx.argmax(draft(mx.array([seq]))[0, -1]).item())
        tok = (tok + 1) % model.args.vocab_size if pos % 3 == 0 else tok
        answers.append(tok)
        seq.append(tok)
    rec = _Recorder(model.args.vocab_size, answers)
    pipe = Pipeline.__new__(Pipeline)
    pipe.transport, pipe.prefill_chunk, pipe.step_timeout = rec, 4, None
    got = [tok for tok, _, _ in speculative_pipeline_step(pipe, prompt, draft, model.args,
                                                          num_draft_tokens=3, max_tokens=12)]
    assert got == answers[8:20]
    prefill, steps = rec.sent[:2], rec.sent[2:]
    assert [m["tokens"] for m in prefill] == [prompt[:4], prompt[4:8]]
    assert not any(m["verify"] or m["keep"] is not None for m in prefill)
    assert all(m["verify"] for m in steps) and steps[0]["keep"] is None
    assert steps[0]["offset"] == 8 and steps[0]["tokens"][0] == prompt[-1]
    counts = []
    for a, b in zip(steps, steps[1:]):
        accepted = 0  # drafts of a equal to the target's tokens at their positions
        while accepted + 1 < len(a["tokens"]) and \
                a["tokens"][accepted + 1] == answers[a["offset"] + accepted]:
            accepted += 1
        counts.append(accepted)
        assert b["keep"] == accepted + 1  # y and the accepted drafts
        assert b["offset"] == a["offset"] + b["keep"]
        assert b["tokens"][0] == answers[a["offset"] + accepted]  # the target's token
    assert [m["seq"] for m in rec.sent] == list(range(len(rec.sent)))
    assert max(counts) > 0 and min(counts) < 3  # steps with acceptances and rejections


# ------------------------------------------------------------------------------ CLI


def _run(cmd, timeout=180):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main"] + cmd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _text(stdout):
    """The generated text: between the two '==========' lines."""
    return stdout.split("==========")[1]


# greedy in make test; the seeded sampling launch (a whole launch + generate run) in make test-e2e
@pytest.mark.parametrize("mode", ["greedy", pytest.param("seeded sampling", marks=pytest.mark.e2e)])
def test_launch_with_a_draft_prints_what_generate_prints(cluster, mode):
    """Greedy: the plain `kimi-mlx generate` text. Seeded sampling: `kimi-mlx generate
    --draft-model` with the same seed (the head draws the same random numbers, and the
    stages' float32 logits equal one process's), whose output distribution
    test_speculative checks."""
    flags = ["--model", str(cluster.ckpt), "--prompt", "The licence grants you the right to",
             "--max-tokens", "24", "--ignore-chat-template"]
    draft = ["--draft-model", str(DRAFT), "--num-draft-tokens", "3"]
    if mode == "greedy":
        flags += ["--temp", "0"]
        ref = _run(["generate"] + flags)
    else:
        flags += ["--temp", "0.9", "--top-p", "0.95", "--seed", "7"]
        ref = _run(["generate"] + flags + draft)
    nodes = ",".join(p.address for p in cluster.procs)
    launch = _run(["cluster", "launch", "--nodes", nodes, "--secret-file",
                   str(cluster.secret_file)] + flags + draft)
    assert launch.returncode == 0, launch.stderr
    assert ref.returncode == 0, ref.stderr
    assert _text(launch.stdout) == _text(ref.stdout)
    assert "Speculative:" in launch.stdout and "accepted per step" in launch.stdout
    assert _wait_no_sessions(cluster, [0, 1, 2]) == [0, 0, 0]


def test_bench_rows_through_the_stages(loaded, models):
    from kimi_mlx.cluster.bench.spec import bench_rows

    t, _ = loaded
    model, _, draft = models
    rows = bench_rows(Pipeline(t), draft, model.args, [_prompt(6)], tokens=6, ks=[1, 2],
                      repeats=1)
    assert [r["k"] for r in rows] == [1, 2]
    for r in rows:
        assert r["plain_tps"] > 0 and r["spec_tps"] > 0 and 0 <= r["mean_accepted"] <= r["k"]
        assert r["speedup"] == pytest.approx(r["spec_tps"] / r["plain_tps"])


# ----------------------------------------------------------------------- stage loss
# It kills a stage: of a cluster of its own, not the shared one; a fault run, so after the
# suite (make test-e2e).


@pytest.mark.e2e
def test_a_stage_lost_mid_verify_is_reported_as_any_stage_loss(own_cluster, models):
    cluster = own_cluster
    t, _ = cluster.load_transport()
    model, _, draft = models
    gen = speculative_pipeline_step(Pipeline(t, prefill_chunk=32), _prompt(20), draft,
                                    model.args, num_draft_tokens=4, max_tokens=200)
    try:
        next(gen)  # a verify step ran: every stage holds its rollback record
        cluster.procs[1].signal(signal.SIGKILL)
        with pytest.raises(StageFailure) as e:
            for _ in gen:
                pass
        assert e.value.lost and "stage 1 (node spec1" in str(e.value) and "lost" in str(e.value)
        assert e.value.node_ids == ["spec1"]
        left = t.abort()  # what the launcher does next
        assert left["spec1"] == -1
        assert _wait_no_sessions(cluster, [0, 2]) == [0, 0]
    finally:
        gen.close()
        t.shutdown()
