"""The remote session (`cluster.net.session.RemoteSession`) behaves the same on both remote
targets: a pipeline of three loopback stages (`head.pipeline.PipelineTarget`) and a tensor
group's rank 0 (`tensor.step.GroupTarget`, here over a one-process MLX group, so every
command and the rank's own rollback run, without the ring).

The reference is independent of the session code: one process's full forward pass over
the tokens the target should hold (no cache, no keep/trim), on the same micro checkpoint.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.cluster.net.session import RemoteSession, generate
from kimi_mlx.sampling import Sampling

# Verify rows (one batched pass) against a full forward differ by rounding only; a wrong
# keep (a rejected draft left in the caches, or an accepted one dropped) moves the logits
# by orders of magnitude more (checked below: the unsettled run must fail this bound).
TOL = 2e-3


@pytest.fixture(scope="module")
def model(micro_pipeline):
    from kimi_mlx.checkpoint.loader import load_for_generation

    m, _, _, _ = load_for_generation(str(micro_pipeline.ckpt))
    return m


@pytest.fixture(scope="module")
def transport(micro_pipeline):
    t, _ = micro_pipeline.load_transport()
    try:
        yield t
    finally:
        t.shutdown()


def _prompt(n):
    return [(41 * i + 7) % 3000 + 200 for i in range(n)]


def _full(model, ids):
    """One process's logits float32 [len(ids), vocab] for ids, no cache."""
    return model(mx.array([ids])).astype(mx.float32)[0]


def _close(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9))


def _session(kind, transport, model, n_prompt) -> RemoteSession:
    if kind == "pipeline":
        return Pipeline(transport, prefill_chunk=8).open(n_prompt, record=True, args=model.args)
    from kimi_mlx.cluster.tensor.step import GroupTarget

    return GroupTarget(model, mx.distributed.init(), n_prompt - 1, record=True, prefill_chunk=8)


@pytest.mark.parametrize("kind", ["pipeline", "tensor"])
def test_a_rejected_draft_trimmed_leaves_the_target_as_a_fresh_prefill(kind, transport, model):
    """Prefill (shared chunking), a verify step [y, d1, d2, d3] of which the loop keeps
    two positions (`trim(2)`, as the speculative loops' rollback does), then the next
    step: its logits, and the verify step's kept rows, are one process's over the prompt
    and the kept tokens only."""
    prompt = _prompt(21)
    s = _session(kind, transport, model, len(prompt))
    ok = False
    try:
        assert s.prefill(prompt) == [] and s.offset == len(prompt) - 1
        y, d = prompt[-1], [901, 902, 903]
        rows = s(mx.array([[y] + d]))[0]
        ref = _full(model, prompt + d)
        assert _close(rows, ref[len(prompt) - 1:]) < TOL
        s.make_cache()[0].trim(2)  # d2, d3 rejected
        assert s.offset == len(prompt) + 1
        with pytest.raises(ValueError, match="can only drop positions of the last verify"):
            s.trim(3)  # past the verify step: a prefill cannot be taken back
        nxt = s(mx.array([[555]]))[0, -1]
        want = _full(model, prompt + d[:1] + [555])[-1]
        unsettled = _full(model, prompt + d + [555])[-1]
        assert _close(nxt, want) < TOL
        assert _close(unsettled, want) > 10 * TOL  # the bound tells a wrong keep apart
        ok = True
    finally:
        s.end(ok)


@pytest.mark.parametrize("kind", ["pipeline", "tensor"])
def test_greedy_decode_and_scores_equal_one_process(kind, transport, model):
    """`net.session.generate` on either target: a scored prefill (every prompt position's
    log-probability, as one process's log-softmax) then greedy tokens equal to one
    process's argmax decode (on the pipeline the last stage samples; on the tensor group
    mlx-lm's sampler runs on rank 0)."""
    from mlx_lm.generate import generate_step

    prompt = _prompt(19)
    n = 6
    want = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]
    if kind == "pipeline":
        s = Pipeline(transport, prefill_chunk=8).open(len(prompt), Sampling())
    else:
        from kimi_mlx.cluster.tensor.step import GroupTarget

        s = GroupTarget(model, mx.distributed.init(), len(prompt) - 1, prefill_chunk=8)
    scores: list = []
    got = [t for t, _ in generate(s, prompt, n, score=0, scores=scores)]
    assert got == want
    lp = _full(model, prompt)[:-1]
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    ref = [float(lp[i, t]) for i, t in enumerate(prompt[1:])]
    assert [o.token for o in scores] == prompt[1:]
    assert np.allclose([o.logprob for o in scores], ref, atol=2e-2)
