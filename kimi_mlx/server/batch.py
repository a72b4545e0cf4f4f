"""Continuous batching for the server engine: mlx-lm's `BatchGenerator` over our
batchable caches (`kimi_mlx.model.cache`).

A new job's prompt goes to the generator as segments split at its prompt-cache snapshot
points (`Engine.snapshot_points`), with the cache the prompt cache restored (or a fresh
one). The generator interleaves: each step decodes every active sequence in one batch,
then runs one prefill chunk (`PREFILL_STEP` tokens at most) of the jobs still being
prefilled, together as one right-padded batch. So a joining request stalls the others by
one chunk, not by its whole prompt, and requests that arrive together share their
prefill. At the end of a segment that is a snapshot point the job's row is extracted as a
single-sequence cache and stored, so snapshots hold what a B = 1 prefill would hold.
A job that finishes, is cancelled or whose client left is removed before the next step.
A prompt with images (whose pads take the tower's rows, which the generator cannot feed)
is prefilled alone by `Engine.prefill` when admitted and joins for its last token.

One request cannot fail or poison the others (`_RowGuard`): its sampler and logits
processors run guarded, row by row; when one raises (building its graph or evaluating
it) that row gets a placeholder token for the step, so the step completes for the other
rows exactly as it would have without it, then the job is removed from the generator
and fails alone with its own message, and MLX's random state is reseeded
(`jobs.reseed_random`). Only a failure outside every row's own computation (the batched
forward pass) fails the whole step.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Dict, List, Optional

import mlx.core as mx

from kimi_mlx.server.jobs import Failed, Finished, Job, Started, TokenOut, reseed_random, top_logprobs

log = logging.getLogger("kimi_mlx.server")

# Prompt tokens per row per prefill chunk between two decode steps: bounds how long a
# joining request holds up the others' next token.
PREFILL_STEP = 512


class _RowGuard:
    """One job's sampler and logits processors, as the generator calls them for its row
    alone (mlx-lm's `GenerationBatch._step` calls per-row samplers on logprobs[e:e+1]
    and per-row processors on logits[e:e+1] whenever the rows' samplers differ).

    The row's input (the batch's forward pass) is evaluated first, outside the guard: a
    failure there is the step's, not this row's. Then the row's own computation is built
    and evaluated inside it; an exception there is recorded in `error`, MLX's random state
    is reseeded at once (so rows sampled after it in the same step draw from a valid
    state) and a placeholder is returned (the argmax token; the unchanged logits), which
    the engine discards when it removes the job after the step. Evaluating the row's
    token here means the step's next forward pass runs before the generator returns, not
    overlapped with the Python that follows it; only jobs that sample (temperature > 0)
    or carry logits processors are guarded at all (greedy rows share mlx-lm's argmax).
    """

    def __init__(self, sampler=None, processors=()):
        self.error: Optional[str] = None
        self._sampler = sampler
        self.sampler = self._sample if sampler is not None else None
        self.processors = [self._processor(p) for p in processors]

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            log.warning("a request's sampling failed: %s: %s", type(e).__name__, e)
            self.error = f"generation failed: {type(e).__name__}: {e}"
        reseed_random()

    def _sample(self, logprobs):
        if self.error is None:
            mx.eval(logprobs)
            try:
                out = self._sampler(logprobs)
                mx.eval(out)
                return out
            except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                self._fail(e)
        return mx.argmax(logprobs, axis=-1)

    def _processor(self, proc):
        def run(tokens, logits):
            if self.error is not None:
                return logits
            mx.eval(tokens, logits)
            try:
                out = proc(tokens, logits)
                mx.eval(out)
                return out
            except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                self._fail(e)
                return logits
        return run


class _Live:
    """A job in the generator: `ends` are its prompt segments' end positions still to
    come (snapshot points, then the end of the prompt but its last token)."""

    def __init__(self, job: Job, cached: int, ends: List[int], snaps: List[int],
                 guard: Optional[_RowGuard] = None):
        self.job, self.cached, self.guard = job, cached, guard
        self.ends, self.snaps = ends, set(snaps)
        self.n = 0
        self.t0 = time.perf_counter()
        self.t_first = None  # when its first token was sampled
        self.prompt_tps = 0.0


def run_batched(engine) -> None:
    """Worker loop of `Engine` with max_concurrency > 1 (runs until engine.stop())."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(engine.model, max_tokens=1 << 30,
                         stop_tokens=[[e] for e in sorted(engine.eos_ids)],
                         completion_batch_size=engine.max_concurrency,
                         prefill_batch_size=engine.max_concurrency,
                         prefill_step_size=PREFILL_STEP)
    live: Dict[int, _Live] = {}
    try:
        while not engine._stopping.is_set():
            if not _admit(engine, gen, live):
                return
            engine.active = len(live)
            gone = [uid for uid, s in live.items() if s.job.cancelled.is_set()]
            if gone:
                gen.remove(gone)
                for uid in gone:
                    _finish(engine, live.pop(uid), "cancelled")
                engine.active = len(live)
            if not live:
                continue
            try:
                prompt_responses, responses = gen.next()
                _drop_failed_rows(gen, live)
                _snapshot(engine, gen, live, prompt_responses)
            except Exception as e:  # noqa: BLE001 - a failed step fails the jobs in it
                log.exception("batched generation step failed")
                gen.remove(list(live))
                for s in live.values():
                    s.job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                live.clear()
                reseed_random()
                continue
            for r in responses:
                s = live.get(r.uid)
                if s is None:
                    continue
                if s.t_first is None:
                    s.t_first = time.perf_counter()
                    s.prompt_tps = (len(s.job.ids) - s.cached) / max(s.t_first - s.t0, 1e-9)
                    if engine.prompt_cache is not None:
                        engine.prompt_cache.note_prompt_speed(len(s.job.ids) - s.cached,
                                                              s.t_first - s.t0)
                if r.finish_reason == "stop" and r.token in engine.eos_ids:
                    if s.job.score is not None and s.job.logprobs is not None:
                        s.job.stop_token = TokenOut(r.token, *top_logprobs(
                            r.logprobs, r.token, s.job.logprobs))
                    live.pop(r.uid)
                    _finish(engine, s, "stop")
                    continue
                s.n += 1
                if s.job.logprobs is not None:
                    chosen, top = top_logprobs(r.logprobs, r.token, s.job.logprobs)
                    s.job.emit(TokenOut(r.token, chosen, top))
                else:
                    s.job.emit(TokenOut(r.token))
                if r.finish_reason is not None:
                    live.pop(r.uid)
                    _finish(engine, s, "length")
            engine.active = len(live)
    finally:
        engine.active = 0
        for s in live.values():
            s.job.emit(Failed("the server is shutting down"))
        gen.close()


def _admit(engine, gen, live: Dict[int, _Live]) -> bool:
    """Hand waiting jobs to the generator while there is room; blocks when idle.
    False when the engine is stopping."""
    while len(live) < engine.max_concurrency:
        try:
            job = engine._jobs.get(block=not live)
        except queue.Empty:
            return True
        if job is None:
            return False
        if job.cancelled.is_set():
            job.emit(Finished("cancelled", len(job.ids)))
            if engine.metrics is not None:  # left while queued: nothing generated
                engine.metrics.finished_requests.labels("cancelled").inc()
            continue
        try:
            cache, cached = engine._start_cache(job)
            start = cached
            embeddings = None if job.score is not None else engine.embeddings(job, cached)
            if job.score is not None:
                # scored alone (its logits kept, `server.scoring`), then joins for its
                # last token like a prompt with images
                from kimi_mlx.server.scoring import finish_scored, score_prefill

                tic = time.perf_counter()
                job.prompt_scores = score_prefill(engine, job.ids, cache, job.score,
                                                  job.segment_ends, job.key)
                start = len(job.ids) - 1
                if job.max_tokens == 0:
                    job.emit(Started(0))
                    finish_scored(job, tic, engine.metrics)
                    continue
            elif embeddings is not None:
                # the generator feeds token ids only: a prompt with images left to run is
                # prefilled here, alone (snapshots included), and joins for its last token
                engine.prefill(job.ids, cache, cached, job.segment_ends,
                               embeddings=embeddings, key=job.key)
                start = len(job.ids) - 1
            snaps = engine.snapshot_points(job.ids, start, job.segment_ends)
            cuts = [start] + snaps + [len(job.ids)]
            segments = [job.ids[a:b] for a, b in zip(cuts, cuts[1:])]
            # the generator runs the last prompt token as the first decode step
            ends = snaps + ([len(job.ids) - 1] if len(segments[-1]) > 1 else [])
            sampler = None if job.sampling.temp == 0 else job.sampling.sampler()
            guard = _RowGuard(sampler, job.logits_processors or ())
            (uid,) = gen.insert_segments([segments], max_tokens=[job.max_tokens],
                                         caches=[cache], samplers=[guard.sampler],
                                         logits_processors=[guard.processors])
        except Exception as e:  # noqa: BLE001 - this job fails, the others go on
            log.exception("admitting a job failed")
            job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            reseed_random()
            continue
        live[uid] = _Live(job, cached, ends, snaps, guard)
        job.emit(Started(cached))
        engine.active = len(live)
    return True


def _drop_failed_rows(gen, live: Dict[int, _Live]) -> None:
    """Remove the jobs whose sampler or logits processors raised in the step just run
    (`_RowGuard`): each fails with its own message; this step's responses for them are
    ignored (they are no longer live)."""
    failed = [uid for uid, s in live.items() if s.guard is not None and s.guard.error]
    if failed:
        gen.remove(failed)
        for uid in failed:
            s = live.pop(uid)
            s.job.emit(Failed(s.guard.error))


def _snapshot(engine, gen, live: Dict[int, _Live], prompt_responses) -> None:
    """Store a prompt-cache snapshot for each job whose prefill just ended a segment at a
    snapshot point (its row, extracted as a single-sequence cache)."""
    for r in prompt_responses:
        s = live.get(r.uid)
        if s is None or not r.end_of_segment or r.end_of_prompt or not s.ends:
            continue
        end = s.ends.pop(0)
        if end in s.snaps and engine.prompt_cache is not None:
            cache, _ = gen.extract_cache([r.uid])[r.uid]
            # evaluated now: the row's own copy, not a lazy slice that keeps the whole
            # batch buffer alive (and that only this thread's stream could evaluate)
            mx.eval([c.state for c in cache])
            engine.prompt_cache.store(s.job.cache_key[:end], cache)


def _finish(engine, s: _Live, reason: str) -> None:
    t = s.t_first if s.t_first is not None else s.t0
    dt = time.perf_counter() - t
    done = Finished(reason, len(s.job.ids), s.cached, s.n, s.prompt_tps,
                    s.n / dt if dt > 0 else 0.0)
    if engine.metrics is not None:
        engine.metrics.finished(done)
    s.job.emit(done)
