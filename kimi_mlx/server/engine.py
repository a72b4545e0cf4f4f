"""Generation for the server: a worker thread that owns the model and runs requests
(`Job`s) through mlx-lm's generate loop, streaming token events back to the asyncio
handlers that wait on them.

One thread touches MLX, so requests never share mutable state; a job that is cancelled
(client gone, stop string matched) stops within one decode step and its cache is dropped.
With `max_concurrency` > 1 the worker runs mlx-lm's `BatchGenerator` (continuous
batching) over our batchable caches (`kimi_mlx.model.cache`); with 1 it runs `generate_step`,
or, given a draft model (`speculation`), `kimi_mlx.speculative.loop.speculative_generate_step`
with the draft's caches kept beside the target's (in the prompt cache too).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from kimi_mlx.generation.request import SamplingParams

log = logging.getLogger("kimi_mlx.server")


class Busy(RuntimeError):
    """The request queue is full (the API answers 503 with Retry-After)."""


@dataclass
class TokenOut:
    """One generated token; logprob / top (token id, logprob) pairs when asked for."""

    token: int
    logprob: Optional[float] = None
    top: Optional[List[Tuple[int, float]]] = None


@dataclass
class Finished:
    """End of a job. reason: "stop" (EOS), "length" (max_tokens), "cancelled"."""

    reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0


@dataclass
class Failed:
    """Generation raised; the message goes to this request only."""

    message: str


Event = Union[TokenOut, Finished, Failed]


@dataclass
class Job:
    """One generation request.

    ids: prompt token ids; max_tokens >= 1; logprobs: None (no logprobs) or the number
    of top alternatives (0..20) to report per token; segment_ends: prompt positions where
    the prompt cache may keep a snapshot (end of each message).
    """

    ids: List[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: Optional[int] = None
    segment_ends: Sequence[int] = ()
    logits_processors: Optional[list] = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None
        self._sync: Optional[queue.Queue] = None

    def attach(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Deliver events to an asyncio queue on `loop` (or, with None, a thread queue)."""
        if loop is None:
            self._sync = queue.Queue()
        else:
            self._loop, self._queue = loop, asyncio.Queue()

    def emit(self, ev: Event) -> None:
        """Called from the worker thread."""
        if self._sync is not None:
            self._sync.put(ev)
        elif self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.cancelled.set()

    async def next_event(self, timeout: Optional[float] = None) -> Event:
        return await asyncio.wait_for(self._queue.get(), timeout)

    def events(self, timeout: float = 600.0):
        """Blocking iterator over events (for threads and tests); ends after Finished/Failed."""
        while True:
            ev = self._sync.get(timeout=timeout)
            yield ev
            if not isinstance(ev, TokenOut):
                return

    def cancel(self) -> None:
        self.cancelled.set()


def enqueue(jobs: "queue.Queue", job, max_queue: int):
    """Put `job` on a worker's queue; `Busy` when `max_queue` jobs already wait (the one
    admission rule of the one-process engine and the cluster engine)."""
    waiting = jobs.qsize()
    if waiting >= max_queue:
        raise Busy(f"{waiting} requests are waiting (--max-queue {max_queue})")
    jobs.put(job)
    return job


def run_mlx_thread(body: Callable[[], None]) -> None:
    """Run `body()` on the calling thread, then release that thread's MLX streams: a
    thread that ran MLX must do so before it ends, or the process may abort at exit
    (ml-explore/mlx#4373; see cluster/compute.py). Every engine worker runs through this."""
    import mlx.core as mx

    try:
        body()
    finally:
        mx.clear_streams()


def top_logprobs(logprobs, token: int, k: Optional[int]):
    """(logprob of `token`, [(id, logprob)] of the k most likely, best first) from a
    logprob vector [vocab] (mlx-lm's: logits - logsumexp)."""
    import mlx.core as mx

    chosen = logprobs[token].item()
    if not k:
        return chosen, []
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    return chosen, list(zip(idx[order].tolist(), vals[order].tolist()))


class Engine:
    """Owns the model on one worker thread; `submit(job)` queues a job.

    Args:
        model: our `Model` (mlx-lm model API).
        eos_ids: token ids that end a reply.
        max_queue: jobs waiting beyond this raise `Busy`.
        max_concurrency: sequences generated at once (continuous batching when > 1).
        prompt_cache: optional `PromptCache` (snapshots across requests).
        speculation: optional `speculative.Speculation` (draft model, drafts per verify
            step): every request decodes speculatively, except those with logits
            processors (penalties, logit_bias), which the verify step does not apply.
            Needs max_concurrency 1. A job's cache is then the target's caches followed
            by the draft's (mlx-lm's convention), prefilled and snapshotted together;
            with a draft whose caches cannot be snapshotted (an mlx-lm KVCache model)
            the prompt cache is turned off.
    Raises:
        ValueError: speculation with max_concurrency > 1.
    """

    def __init__(self, model, eos_ids: Sequence[int], max_queue: int = 64,
                 max_concurrency: int = 1, prompt_cache=None, metrics=None,
                 speculation=None):
        if speculation is not None and max_concurrency != 1:
            raise ValueError(f"speculative decoding serves one request at a time, not "
                             f"max_concurrency {max_concurrency}")
        self.speculation = speculation
        if speculation is not None and prompt_cache is not None:
            if not _snapshots(_draft_cache(speculation.draft)):
                log.warning("the draft's caches cannot be snapshotted: prompt cache off")
                prompt_cache = None
        self.model = model
        self.eos_ids = set(eos_ids)
        self.max_queue = max_queue
        self.max_concurrency = max_concurrency
        self.prompt_cache = prompt_cache
        self.metrics = metrics
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._active = 0
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    # ---------------------------------------------------------------- control

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="kimi-mlx-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_length(self) -> int:
        """Jobs submitted and not yet started."""
        return self._jobs.qsize()

    @property
    def active(self) -> int:
        return self._active

    def submit(self, job: Job) -> Job:
        return enqueue(self._jobs, job, self.max_queue)

    # ---------------------------------------------------------------- worker

    def _loop(self) -> None:
        run_mlx_thread(self._serve)

    def _serve(self) -> None:
        if self.max_concurrency > 1:
            from kimi_mlx.server.batch import run_batched

            run_batched(self)
            return
        while not self._stopping.is_set():
            job = self._jobs.get()
            if job is None:
                return
            self._active = 1
            try:
                self._run_one(job)
            except Exception as e:  # noqa: BLE001 - the error goes to this request only
                log.exception("generation failed")
                job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self._active = 0

    def _start_cache(self, job: Job):
        """(cache, number of prompt tokens it already holds) for a job."""
        if self.prompt_cache is not None:
            cache, n = self.prompt_cache.fetch(job.ids)
            if cache is not None:
                return cache, n
        cache = self.model.make_cache()
        if self.speculation is not None:
            cache += _draft_cache(self.speculation.draft)
        return cache, 0

    def _models(self, cache) -> List[Tuple[object, list]]:
        """(model, its part of `cache`) pairs: the target, then the draft if any."""
        if self.speculation is None:
            return [(self.model, cache)]
        n = len(self.model.layers)
        return [(self.model, cache[:n]), (self.speculation.draft, cache[n:])]

    def snapshot_points(self, ids: Sequence[int], start: int,
                        segment_ends: Sequence[int]) -> List[int]:
        """Sorted prompt positions e (start < e < len(ids)) where the prompt cache keeps a
        snapshot of ids[:e]: the segment ends, and every `prompt_cache.every` tokens short
        of the last one. Empty without a prompt cache."""
        if self.prompt_cache is None:
            return []
        snaps = {e for e in segment_ends if start < e < len(ids)}
        if self.prompt_cache.every:
            k = self.prompt_cache.every
            snaps |= set(range((start // k + 1) * k, len(ids) - 1, k))
        return sorted(snaps)

    def prefill(self, ids: List[int], cache, start: int, segment_ends: Sequence[int],
                step: int = 2048) -> None:
        """Run ids[start:-1] into `cache`, stopping at each segment end to let the prompt
        cache snapshot it (the last prompt token is left for the sampling step)."""
        import mlx.core as mx

        snaps = set(self.snapshot_points(ids, start, segment_ends))
        pos = start
        for end in sorted(snaps | {len(ids) - 1}):
            while pos < end:
                n = min(step, end - pos)
                for model, part in self._models(cache):
                    model(mx.array(ids[pos:pos + n])[None], cache=part)
                mx.eval([c.state for c in cache])
                pos += n
            if self.prompt_cache is not None and end in snaps:
                self.prompt_cache.store(ids[:end], cache)

    def _run_one(self, job: Job) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        if job.cancelled.is_set():
            job.emit(Finished("cancelled", len(job.ids)))
            return
        tic = time.perf_counter()
        cache, cached = self._start_cache(job)
        self.prefill(job.ids, cache, cached, job.segment_ends)
        if self.speculation is not None and not job.logits_processors:
            gen = self._speculate(job, cache)
        else:
            gen = generate_step(mx.array(job.ids[-1:]), self.model, max_tokens=job.max_tokens,
                                sampler=job.sampling.sampler(),
                                logits_processors=job.logits_processors,
                                prompt_cache=self._models(cache)[0][1])
        reason, n, prompt_tps, t_gen = "length", 0, 0.0, tic
        for tok, lp in gen:
            if n == 0:
                t_gen = time.perf_counter()
                prompt_tps = (len(job.ids) - cached) / max(t_gen - tic, 1e-9)
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            if tok in self.eos_ids:
                reason = "stop"
                break
            n += 1
            if job.logprobs is not None:
                chosen, top = top_logprobs(lp, tok, job.logprobs)
                job.emit(TokenOut(tok, chosen, top))
            else:
                job.emit(TokenOut(tok))
        gen.close()
        dt = time.perf_counter() - t_gen
        done = Finished(reason, len(job.ids), cached, n, prompt_tps, n / dt if dt > 0 else 0.0)
        if self.metrics is not None:
            self.metrics.finished(done)
        job.emit(done)

    def _speculate(self, job: Job, cache):
        """(token, logprobs [vocab]) of `job` by speculative decoding from a prefilled
        target + draft `cache` (all prompt tokens but the last). The acceptance rule keeps
        the target's sampling (greedy: token for token the plain output); a seeded
        request seeds MLX's global PRNG, which only this one sequence uses."""
        import mlx.core as mx

        from kimi_mlx.speculative.loop import Sampling, speculative_generate_step

        spec, p = self.speculation, job.sampling
        if p.seed is not None:
            mx.random.seed(p.seed)
        st = spec.stats
        before = (st.steps, st.drafted, st.accepted)
        gen = speculative_generate_step(
            job.ids[-1:], self.model, spec.draft, num_draft_tokens=spec.num_draft_tokens,
            max_tokens=job.max_tokens, sampling=Sampling(p.temp, p.top_p, p.min_p, p.top_k),
            prompt_cache=cache, stats=spec.stats)
        try:
            for tok, lp, _from_draft in gen:
                yield tok, lp
        finally:
            gen.close()
            if self.metrics is not None:
                self.metrics.speculated(st.steps - before[0], st.drafted - before[1],
                                        st.accepted - before[2])


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
