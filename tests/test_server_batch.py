"""The batching engine's prefill (kimi_mlx/server/batch.py): requests that arrive together
are prefilled as one batch, a long prompt joining a running batch is prefilled in chunks
between the others' decode steps, and the prompt-cache snapshots taken during a batched
prefill hold what a single B = 1 run of the same prefix holds.

On a conditioned tiny model (index_topk 8, so prompts cross the sparse path) within the
float32 tolerance rule, with its top-k choices' margins checked; references are the model
run on each prompt alone with no cache (tokens) or in one call (snapshots).
"""

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.model.cache import snapshot
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.server import batch as batch_mod
from kimi_mlx.server.engine import Engine
from kimi_mlx.server.jobs import Job, TokenOut
from kimi_mlx.server.prompt_cache import PromptCache
from kimi_mlx.testing.checkpoints import (
    argmax_margin, full_config, margins, model_tolerance, random_model, rel_err,
    tiny_text_config)


class Recorder:
    """The model, recording the [B, L] of every forward call."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, tokens, cache=None):
        self.calls.append(tuple(tokens.shape))
        return self.model(tokens, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def model():
    args = ModelArgs.from_config(full_config(tiny_text_config()))
    return random_model(args, seed=1, conditioned=True)


def _reference(model, ids, n):
    """n greedy tokens, recomputing the whole sequence each step (no cache, B = 1), and
    the smallest argmax margin met."""
    out, margin = list(ids), np.inf
    for _ in range(n):
        logits = model(mx.array(out)[None])[0, -1]
        margin = min(margin, argmax_margin(logits))
        out.append(int(mx.argmax(logits).item()))
    return out[len(ids):], margin


def _job(ids, n, ends=()):
    job = Job(list(ids), n, segment_ends=ends)
    job.attach(None)
    return job


def _tokens(job):
    return [e.token for e in job.events(timeout=120) if isinstance(e, TokenOut)]


def test_requests_arriving_together_share_one_prefill_and_snapshots_match(model):
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 256, n).tolist() for n in (29, 17, 11)]
    ends = [(5, 20), (), (9,)]
    pc = PromptCache(64 << 20, every=16)
    rec = Recorder(model)
    eng = Engine(rec, eos_ids=[], max_concurrency=4, prompt_cache=pc)
    jobs = [eng.submit(_job(p, 4, e)) for p, e in zip(prompts, ends)]  # queued before start
    tol = model_tolerance(model.args, 33)
    eng.start()
    try:
        got = [_tokens(j) for j in jobs]
    finally:
        eng.stop()
    with margins() as m:  # the choices the engine crossed, made by the reference run
        refs = [_reference(model, p, 4) for p in prompts]
    m.check(tol, need_indexer=True)
    for g, (want, margin) in zip(got, refs):
        assert margin > tol and g == want
    # the three prompts ran through the model together (one right-padded batch)
    assert any(b == 3 and L > 1 for b, L in rec.calls), rec.calls
    # snapshots at exactly the engine's snapshot points, each equal to a B = 1 prefill
    want_keys = {tuple(p[:e]) for p, en in zip(prompts, ends)
                 for e in eng.snapshot_points(p, 0, en)}
    assert set(pc._entries) == want_keys and len(want_keys) == 4  # 5, 16, 20; 9
    for key, (snap, _) in pc._entries.items():
        cache = model.make_cache()
        model(mx.array(key)[None], cache)
        for (kind, got_state), (_, want_state) in zip(snap, snapshot(cache)):
            if kind == "dsa":
                assert got_state[3] == want_state[3] == len(key)
                got_state, want_state = got_state[:3], want_state[:3]
            for a, b in zip(got_state, want_state):
                assert a.shape == b.shape and rel_err(a, b) < tol, (len(key), kind)


def test_a_long_prompt_joins_in_chunks_between_decode_steps(model, monkeypatch):
    monkeypatch.setattr(batch_mod, "PREFILL_STEP", 8)
    rng = np.random.default_rng(10)
    short, long = rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 25).tolist()
    rec = Recorder(model)
    eng = Engine(rec, eos_ids=[], max_concurrency=4).start()
    tol = model_tolerance(model.args, 25 + 6)
    try:
        a = eng.submit(_job(short, 6))
        events = a.events(timeout=120)
        first = next(events)  # the short request is decoding
        n0 = len(rec.calls)
        b = eng.submit(_job(long, 2))
        got_a = [first.token] + [e.token for e in events if isinstance(e, TokenOut)]
        got_b = _tokens(b)
    finally:
        eng.stop()
    with margins() as m:
        refs = [_reference(model, short, 6), _reference(model, long, 2)]
    m.check(tol, need_indexer=True)
    for g, (want, margin) in zip((got_a, got_b), refs):
        assert margin > tol and g == want
    later = rec.calls[n0:]
    chunks = [i for i, (_, L) in enumerate(later) if L > 1]
    assert len(chunks) == 3 and all(later[i][1] <= 8 for i in chunks), later  # 24 = 3 x 8
    for i, j in zip(chunks, chunks[1:]):  # the running request decodes between chunks
        assert any(later[k] == (1, 1) for k in range(i + 1, j)), later
