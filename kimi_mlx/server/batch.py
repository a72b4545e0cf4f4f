"""Continuous batching for the server engine: mlx-lm's `BatchGenerator` over our
batchable caches (`kimi_mlx.cache`).

Each new job is prefilled on its own (B = 1, so the prompt cache can snapshot it at
segment ends and no prompt is padded), then inserted into the generator with its last
prompt token; decode steps run every active sequence in one batch. A job that finishes,
is cancelled or whose client left is removed from the batch before the next step.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Dict

from .engine import Failed, Finished, Job, TokenOut, top_logprobs

log = logging.getLogger("kimi_mlx.server")


class _Live:
    def __init__(self, job: Job, cached: int, prompt_tps: float):
        self.job, self.cached, self.prompt_tps = job, cached, prompt_tps
        self.n = 0
        self.t0 = time.perf_counter()


def run_batched(engine) -> None:
    """Worker loop of `Engine` with max_concurrency > 1 (runs until engine.stop())."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(engine.model, max_tokens=1 << 30,
                         stop_tokens=[[e] for e in sorted(engine.eos_ids)],
                         completion_batch_size=engine.max_concurrency, prefill_batch_size=1)
    live: Dict[int, _Live] = {}
    try:
        while not engine._stopping.is_set():
            if not _admit(engine, gen, live):
                return
            engine._active = len(live)
            gone = [uid for uid, s in live.items() if s.job.cancelled.is_set()]
            if gone:
                gen.remove(gone)
                for uid in gone:
                    _finish(engine, live.pop(uid), "cancelled")
                engine._active = len(live)
            if not live:
                continue
            try:
                responses = gen.next_generated()
            except Exception as e:  # noqa: BLE001 - a failed step fails the jobs in it
                log.exception("batched generation step failed")
                gen.remove(list(live))
                for s in live.values():
                    s.job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                live.clear()
                continue
            for r in responses:
                s = live.get(r.uid)
                if s is None:
                    continue
                if r.finish_reason == "stop" and r.token in engine.eos_ids:
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
            engine._active = len(live)
    finally:
        engine._active = 0
        for s in live.values():
            s.job.emit(Failed("the server is shutting down"))
        gen.close()


def _admit(engine, gen, live: Dict[int, _Live]) -> bool:
    """Prefill and insert waiting jobs while there is room; blocks when idle.
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
            continue
        try:
            tic = time.perf_counter()
            cache, cached = engine._start_cache(job)
            engine.prefill(job.ids, cache, cached, job.segment_ends)
            tps = (len(job.ids) - cached) / max(time.perf_counter() - tic, 1e-9)
            sampler = None if job.sampling.temp == 0 else job.sampling.sampler()
            (uid,) = gen.insert([job.ids[-1:]], max_tokens=[job.max_tokens], caches=[cache],
                                samplers=[sampler],
                                logits_processors=[job.logits_processors or []])
        except Exception as e:  # noqa: BLE001 - this job fails, the others go on
            log.exception("prefill failed")
            job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            continue
        live[uid] = _Live(job, cached, tps)
        engine._active = len(live)
    return True


def _finish(engine, s: _Live, reason: str) -> None:
    dt = time.perf_counter() - s.t0
    done = Finished(reason, len(s.job.ids), s.cached, s.n, s.prompt_tps,
                    s.n / dt if dt > 0 else 0.0)
    if engine.metrics is not None:
        engine.metrics.finished(done)
    s.job.emit(done)
