"""The one-process deployment of the engine contract (`engine_base.BaseEngine`): a
worker thread that owns the model and runs requests (`Job`s) through mlx-lm's generate
loop, streaming token events back to the asyncio handlers that wait on them.

One thread touches MLX, so requests never share mutable state; a job that is cancelled
(client gone, stop string matched) stops within one decode step and its cache is dropped.
With `max_concurrency` > 1 the worker runs mlx-lm's `BatchGenerator` (continuous
batching) over our batchable caches (`kimi_mlx.model.cache`); with 1 it runs `generate_step`,
or, given a draft (`speculation`), the loop `Speculation.step` picks, with the draft's
caches kept beside the target's (in the prompt cache too).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Tuple

from kimi_mlx.server.engine_base import BaseEngine, _batches
from kimi_mlx.server.jobs import Job, Started, stream_to_job

log = logging.getLogger(__name__)


class Engine(BaseEngine):
    """The one-process deployment: the model on one worker thread (`BaseEngine` owns the
    queue, admission, isolation, capabilities and stop).

    Args:
        model: our `Model` (mlx-lm model API).
        eos_ids / max_queue / metrics: as `BaseEngine`.
        max_concurrency: sequences generated at once (continuous batching when > 1).
        prompt_cache: optional `PromptCache` (snapshots across requests).
        speculation: optional `speculative.loop.Speculation` (a draft model, `--draft ngram`'s
            `NgramDraft` or `--draft mtp`'s `MTP`, drafts per verify step): every request
            decodes speculatively, except those with logits processors (penalties,
            logit_bias), which the verify step does not apply. With max_concurrency > 1
            the batch verifies every row's drafts at once (`speculative.batch`; the
            prompt cache then keeps the target's caches only, the context comes from each
            request's ids; off for the MTP and block drafters, which read every prompt
            position's hiddens).
            A job's cache is then the target's caches followed by the draft's (mlx-lm's
            convention), prefilled and snapshotted together; with a draft whose caches
            cannot be snapshotted (an mlx-lm KVCache model), or one that prefills itself
            (the MTP), the prompt cache is turned off.
    Raises:
        ValueError: speculation with max_concurrency > 1 whose draft does not batch.
    """

    feeds_media_by_id = True
    captures_hiddens = True  # the MTP and block drafters batch (`speculative.hidden_rows`)

    # scores a prompt's own tokens (`Job.score`, `server.scoring`)
    supports_scoring = True
    supports_batching = True
    grammar_drafts = True  # the draft-model and n-gram loops check drafts against a grammar

    def __init__(self, model, eos_ids: Sequence[int], max_queue: int = 64,
                 max_concurrency: int = 1, prompt_cache=None, metrics=None,
                 speculation=None):
        super().__init__(eos_ids, max_queue, max_concurrency, metrics, speculation)
        if speculation is not None and prompt_cache is not None and (
                speculation.prefills_itself  # its drafter reads every prompt position's hiddens
                or not (max_concurrency > 1 and _batches(speculation, True))):
            if speculation.prefills_itself or not _snapshots(_draft_cache(speculation.draft)):
                log.warning("the draft's caches cannot be snapshotted: prompt cache off")
                prompt_cache = None
        self.model = model
        self.prompt_cache = prompt_cache

    def _after_stop(self) -> None:
        super()._after_stop()
        disk = getattr(self.prompt_cache, "disk", None)
        if disk is not None:  # the queued snapshot writes finish, the folder is released
            disk.close()

    def _serve(self) -> None:
        if self.max_concurrency > 1:
            from kimi_mlx.server.batch import run_batched

            run_batched(self)
            return
        super()._serve()

    def start_cache(self, job: Job):
        """(cache, number of prompt tokens it already holds) for a job."""
        if self.prompt_cache is not None and job.score is None:  # a scored prompt needs every logit
            cache, n = self.prompt_cache.fetch(job.cache_key)
            if cache is not None:
                return cache, n
        cache = self.model.make_cache()
        if self.speculation is not None and not self.batched_drafts:
            cache += _draft_cache(self.speculation.draft)
        return cache, 0

    def cache_models(self, cache) -> List[Tuple[object, list]]:
        """(model, its part of `cache`) pairs: the target, then the draft if any."""
        if self.speculation is None or self.batched_drafts:
            return [(self.model, cache)]
        n = len(self.model.layers)
        return [(self.model, cache[:n]), (self.speculation.draft, cache[n:])]

    def snapshot_points(self, ids: Sequence[int], start: int,
                        segment_ends: Sequence[int]) -> List[int]:
        """Sorted prompt positions e (start < e < len(ids)) where a prefill stops and the
        prompt cache, if any, keeps a snapshot of ids[:e]: the segment ends, and every
        `prompt_cache.every` tokens (`prompt_cache.DEFAULT_EVERY` without a prompt cache)
        short of the last one. The same points with or without a prompt cache: a reply
        continued from a snapshot then runs the float operations of a cache-free one in
        the same chunks, so their logits are bit for bit equal (a prefill split
        elsewhere rounds differently, and a greedy reply can flip at a near-tie)."""
        from kimi_mlx.server.prompt_cache import DEFAULT_EVERY, snapshot_points

        every = self.prompt_cache.every if self.prompt_cache is not None else DEFAULT_EVERY
        return snapshot_points(len(ids), start, segment_ends, every)

    def prefill(self, ids: List[int], cache, start: int, segment_ends: Sequence[int],
                step: int = 2048, embeddings=None, key: Optional[Sequence] = None) -> None:
        """Run ids[start:-1] into `cache`, stopping at each of `snapshot_points` (the
        prompt cache snapshots it there; without one the chunks stay the same) (the last
        prompt token is left for the sampling step).
        `embeddings` [len(ids), hidden]: the prompt's input embeddings (images in them,
        `Engine.embeddings`) fed instead of the ids; `key`: the prompt-cache key of the ids
        (default the ids)."""
        import mlx.core as mx

        key = ids if key is None else key
        snaps = set(self.snapshot_points(ids, start, segment_ends))
        pos = start
        for end in sorted(snaps | {len(ids) - 1}):
            while pos < end:
                n = min(step, end - pos)
                for model, part in self.cache_models(cache):
                    if embeddings is None:
                        model(mx.array(ids[pos:pos + n])[None], cache=part)
                    else:
                        model(mx.array(ids[pos:pos + n])[None], cache=part,
                              input_embeddings=embeddings[pos:pos + n][None])
                mx.eval([c.state for c in cache])
                pos += n
            if self.prompt_cache is not None and end in snaps:
                self.prompt_cache.store(key[:end], cache)

    def embeddings(self, job: Job, start: int):
        """The input embeddings [len(ids), hidden] of a job with images whose pads are not
        all in the first `start` (cached) tokens: the tower runs here, on the engine's
        thread (loaded on the first image), only on images with pads at or after `start`
        and not in the tower's cache (`Vision.rows_from`); positions before `start`
        (never read) get their token embeddings. None when no image is left to prefill."""
        import mlx.core as mx

        if not job.images or self.pad_id not in job.ids[start:-1]:
            return None
        rows = self.vision.rows_from(job.ids, job.images, self.pad_id, start)
        tail = self.model.embed_with_media(mx.array(job.ids[start:]), rows, self.pad_id)
        if not start:
            return tail
        return mx.concatenate([self.model.text.embed(mx.array(job.ids[:start])), tail])

    def _run(self, job: Job) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        tic = time.perf_counter()
        cache, cached = self.start_cache(job)
        job.emit(Started(cached))
        speculate = self.speculates(job)
        if job.score is not None:
            from kimi_mlx.server.scoring import finish_scored, score_prefill

            job.prompt_scores = score_prefill(self, job.ids, cache, job.score,
                                              job.segment_ends, job.key)
            if job.max_tokens == 0:
                finish_scored(job, tic, self.metrics)
                return
            # the prompt is now in the cache: a draft that prefills itself (the MTP)
            # cannot continue from it, so a scored request decodes plainly there
            speculate = speculate and not self.speculation.prefills_itself
        elif not (speculate and self.speculation.prefills_itself):
            self.prefill(job.ids, cache, cached, job.segment_ends,
                         embeddings=self.embeddings(job, cached), key=job.key)
        if speculate:
            # a draft that prefills itself (the MTP) gets the whole prompt and fresh
            # caches; the others the last prompt token after the prefill above
            ids = job.ids if self.speculation.prefills_itself else job.ids[-1:]
            gen = self._speculate(job, lambda spec: spec.step(
                ids, self.model, spec.draft, num_draft_tokens=spec.num_draft_tokens,
                max_tokens=job.max_tokens, sampling=job.sampling, prompt_cache=cache,
                stats=spec.stats))
        else:
            gen = generate_step(mx.array(job.ids[-1:]), self.model, max_tokens=job.max_tokens,
                                sampler=job.sampling.sampler(),
                                logits_processors=job.logits_processors,
                                prompt_cache=self.cache_models(cache)[0][1])
        stream_to_job(job, gen, self.eos_ids, tic, self.metrics, cached=lambda: cached)


def _draft_cache(draft) -> list:
    """Fresh caches of a draft model (ours or mlx-lm's)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(draft)


def _snapshots(cache) -> bool:
    """True when the prompt cache can snapshot these caches (`kimi_mlx.model.cache.snapshot`)."""
    from kimi_mlx.model.cache import snapshot

    try:
        snapshot(cache)
    except TypeError:
        return False
    return True
