"""Log-probabilities of a prompt's own tokens (`/v1/completions` with `echo` and
`logprobs`: what lm-evaluation-harness's loglikelihood tasks read).

Scoring is a prefill that keeps its logits: `score_prefill` runs ids[:-1] through the
model into a fresh cache in chunks, and the logits at position i give the log-probability
of ids[i + 1]. The cache it leaves holds ids[:-1], exactly what `Engine.prefill` leaves,
so generation after the prompt (max_tokens > 0) goes on from it at no extra cost. The
prompt cache is not read for a scored prompt (a restored prefix has no logits), but the
snapshot points are stored as a plain prefill stores them.

Runs on the engine's worker thread, the one thread that touches MLX.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from kimi_mlx.server.jobs import FLOOR_LOGPROB, Finished, Job, TokenOut

__all__ = ["score_prefill", "score_logits", "finish_scored", "SCORE_STEP"]

# Prompt tokens per forward pass while scoring: bounds the float32 logits held at once
# ([SCORE_STEP, vocab]: 1 GiB for K3.1's 163840-token vocabulary at 1536).
SCORE_STEP = 512


def score_prefill(engine, ids: Sequence[int], cache, top_k: int, segment_ends: Sequence[int] = (),
                  key: Optional[Sequence] = None, step: int = SCORE_STEP) -> List[TokenOut]:
    """Prefill ids[:-1] into a fresh `cache` and score ids[1:].

    Args:
        engine: the `server.engine.Engine` (its `cache_models(cache)`: the target, then a
            draft whose caches are prefilled alongside; its prompt cache for snapshots).
        ids: prompt token ids (at least 1).
        cache: fresh caches for `engine.cache_models`, holding nothing yet.
        top_k: alternatives to report per token (0..20).
        segment_ends, key: the job's snapshot points and prompt-cache key (as
            `Engine.prefill`).
        step: prompt tokens per forward pass.
    Returns:
        One `TokenOut` per token of ids[1:]: its id, log-probability (natural log,
        float32 log-softmax of the logits, as `generation.evaluate.perplexity`) and the
        `top_k` most likely (id, log-probability) pairs at its position.
    """
    import mlx.core as mx

    ids = list(ids)
    key = ids if key is None else key
    snaps = set(engine.snapshot_points(ids, 0, segment_ends))
    out: List[TokenOut] = []
    pos = 0
    for end in sorted(snaps | {len(ids) - 1}):
        while pos < end:
            n = min(step, end - pos)
            x = mx.array(ids[pos:pos + n])[None]
            logits = None
            for i, (model, part) in enumerate(engine.cache_models(cache)):
                y = model(x, cache=part)
                if i == 0:
                    logits = y
            mx.eval(logits, [c.state for c in cache])
            out.extend(score_logits(logits[0], ids[pos + 1:pos + n + 1], top_k))
            pos += n
        if engine.prompt_cache is not None and end in snaps:
            engine.prompt_cache.store(key[:end], cache)
    return out


def score_logits(logits, targets: Sequence[int], top_k: int) -> List[TokenOut]:
    """The scores of `targets` from the logits that predict them.

    Args:
        logits: [len(targets), vocab] (any float dtype): row i predicts targets[i].
        targets: the token ids scored.
        top_k: alternatives to report per token (0..20).
    Returns:
        One `TokenOut` per target: its id, log-probability (natural log, float32
        log-softmax of its row) and the `top_k` most likely (id, log-probability) pairs,
        best first (infinities as `FLOOR_LOGPROB`). The one computation of a score: the
        one-process engine, the tensor group's rank 0 and a pipeline's last stage use it.
    """
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return _rows(logp, list(targets), top_k)


def finish_scored(job: Job, tic: float, metrics=None) -> Finished:
    """End a score-only job (max_tokens 0) after `score_prefill`: its Finished
    ("length", nothing generated; prompt tokens/s since `tic`, a `time.perf_counter()`),
    counted in `metrics`."""
    import time

    dt = time.perf_counter() - tic
    done = Finished("length", len(job.ids), 0, 0, len(job.ids) / dt if dt > 0 else 0.0, 0.0)
    if metrics is not None:
        metrics.finished(done)
    job.emit(done)
    return done


def _rows(logp, targets: Sequence[int], top_k: int) -> List[TokenOut]:
    """TokenOuts of `targets` from their rows of logp [len(targets), vocab] float32."""
    import mlx.core as mx

    picked = mx.take_along_axis(logp, mx.array(targets)[:, None], axis=-1)[:, 0].tolist()
    if not top_k:
        return [TokenOut(t, _finite(v), []) for t, v in zip(targets, picked)]
    idx = mx.argpartition(-logp, top_k - 1, axis=-1)[:, :top_k]
    vals = mx.take_along_axis(logp, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    idx = mx.take_along_axis(idx, order, axis=-1).tolist()
    vals = mx.take_along_axis(vals, order, axis=-1).tolist()
    return [TokenOut(t, _finite(v), [(i, _finite(x)) for i, x in zip(ri, rv)])
            for t, v, ri, rv in zip(targets, picked, idx, vals)]


def _finite(x: float) -> float:
    # JSON has no infinities (as jobs.top_logprobs reports them)
    return x if math.isfinite(x) else FLOOR_LOGPROB
