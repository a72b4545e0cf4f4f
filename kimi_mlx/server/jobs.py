"""What the server's workers and handlers exchange: a request (`Job`), its events
(`TokenOut`, `Finished`, `Failed`), the queue admission rule (`enqueue`, `Busy`) and the
thread wrapper every MLX worker runs in. Shared by the one-process engine
(`server.engine`, `server.batch`) and the cluster engines (`cluster.head.engine`, `cluster.tensor.engine`), so none of
them imports another's worker.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from kimi_mlx.sampling import Sampling

__all__ = ["TokenEmitter", "Busy", "Started", "TokenOut", "Finished", "Failed", "Event", "Job", "enqueue", "run_mlx_thread",
           "top_logprobs", "reseed_random"]


class Busy(RuntimeError):
    """The request queue is full (the API answers 503 with Retry-After)."""


@dataclass
class Started:
    """The job was admitted (its first event): `cached_tokens` of its prompt come from
    the prompt cache, the same number its Finished reports."""

    cached_tokens: int = 0


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


Event = Union[Started, TokenOut, Finished, Failed]


@dataclass
class Job:
    """One generation request.

    ids: prompt token ids; max_tokens >= 1; logprobs: None (no logprobs) or the number
    of top alternatives (0..20) to report per token; segment_ends: prompt positions where
    the prompt cache may keep a snapshot (end of each message); images: the prompt's
    preprocessed images (`vision.preprocess.ProcessedImage`), in order, whose tower rows
    replace its `<|media_pad|>` embeddings; key: the prompt-cache key when it differs
    from `ids` (`server.images.cache_key`: the pads tagged with their image's digest).
    score: None, or score the prompt's own tokens too (`/v1/completions` echo with
    logprobs) with this many top alternatives (0..20): the engine fills `prompt_scores`
    (one `TokenOut` per token of ids[1:], `server.scoring`) before the job's first
    token or its Finished, and reads no prompt-cache prefix for it; then max_tokens may
    be 0 (score only). A scored job that ends on an end-of-turn token keeps that token
    and its log-probabilities in `stop_token` (set before its Finished): lm-eval reads
    the token after the prompt from the echo's logprobs, whatever it is.
    logits_processors: default `sampling.logits_processors()` (its penalties and
    logit_bias, mlx-lm's), None when it asks for none.
    """

    ids: List[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    logprobs: Optional[int] = None
    segment_ends: Sequence[int] = ()
    logits_processors: Optional[list] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    images: Sequence = ()
    key: Optional[Sequence] = None
    score: Optional[int] = None
    prompt_scores: Optional[List["TokenOut"]] = None
    stop_token: Optional["TokenOut"] = None

    @property
    def cache_key(self) -> Sequence:
        """What the prompt cache matches: `key`, or the ids when the prompt has no images."""
        return self.ids if self.key is None else self.key

    def __post_init__(self):
        if self.logits_processors is None and self.sampling.has_processors:
            self.logits_processors = self.sampling.logits_processors()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None
        self._sync: Optional[queue.Queue] = None
        self._held: List[Event] = []
        self._on_end: List[Callable[[], None]] = []
        self._end_lock = threading.Lock()
        self._ended = False

    def on_end(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once when the job ends (its Finished or Failed is emitted, or
        `ended()`); at once if it already has. Runs on the thread that ends it."""
        with self._end_lock:
            if not self._ended:
                self._on_end.append(fn)
                return
        fn()

    def ended(self) -> None:
        """The job is over (also for one that was never queued): run `on_end`'s
        callbacks, once."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            todo, self._on_end = self._on_end, []
        for fn in todo:
            fn()

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
        if isinstance(ev, (Finished, Failed)):
            self.ended()

    async def next_event(self, timeout: Optional[float] = None) -> Event:
        if self._held:
            return self._held.pop(0)
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def started(self) -> Optional[Started]:
        """Wait for the job's admission: its Started event, or None when another event
        came first (an engine that sends none; it is kept for `next_event`)."""
        ev = await self.next_event()
        if isinstance(ev, Started):
            return ev
        self._held.insert(0, ev)
        return None

    def events(self, timeout: float = 600.0):
        """Blocking iterator over the events after Started (for threads and tests): the
        tokens, then Finished or Failed."""
        while True:
            ev = self._sync.get(timeout=timeout)
            if isinstance(ev, Started):
                continue
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return

    def cancel(self) -> None:
        self.cancelled.set()


def enqueue(jobs: "queue.Queue", job, max_queue: int, slots: int = 0, active: int = 0):
    """Put `job` on a worker's queue; `Busy` when `max_queue` jobs already wait (the one
    admission rule of the one-process engine and the cluster engine).

    A job the worker has not taken yet waits only if no slot is free for it: of the
    queued jobs, those beyond the worker's free slots (`slots` at once, `active` of them
    generating) are the waiting ones. So a burst on an idle server fills every slot
    before any request is counted against --max-queue."""
    waiting = max(0, jobs.qsize() + active - slots)
    if waiting >= max_queue:
        raise Busy(f"{waiting} requests are waiting for a free slot (--max-queue {max_queue})")
    jobs.put(job)
    return job


def run_mlx_thread(body: Callable[[], None]) -> None:
    """Run `body()` on the calling thread, then release that thread's MLX streams: a
    thread that ran MLX must do so before it ends, or the process may abort at exit
    (ml-explore/mlx#4373; see cluster/node/compute.py). Every engine worker runs through this."""
    import mlx.core as mx

    try:
        body()
    finally:
        mx.clear_streams()


def top_logprobs(logprobs, token: int, k: Optional[int]):
    """(logprob of `token`, [(id, logprob)] of the k most likely, best first) from a
    logprob vector [vocab] (mlx-lm's: logits - logsumexp). A non-finite value (-inf for a
    token a logits processor ruled out, NaN when a penalty overflowed float32) is
    reported as FLOOR_LOGPROB: JSON has no infinities, and a reply must not fail on one."""
    import mlx.core as mx

    chosen = _finite(logprobs[token].item())
    if not k:
        return chosen, []
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    return chosen, [(i, _finite(v)) for i, v in zip(idx[order].tolist(), vals[order].tolist())]


# OpenAI's own stand-in for a log-probability too small to report
FLOOR_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR_LOGPROB


def reseed_random() -> None:
    """Give MLX's global PRNG a fresh key (from os.urandom), after a request's generation
    raised: an exception inside one of mlx-lm's compiled samplers (`apply_top_k`,
    `apply_top_p`, ... are compiled with the global random state as input and output)
    leaves that state as a placeholder without a primitive, and every later unseeded
    sample then fails with "[eval] Attempting to eval an array without a primitive".
    Seeding rebuilds the state, so nothing the failed request touched is reused. Seeded
    requests draw from keys of their own and are unaffected."""
    import mlx.core as mx

    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


def cancelled_in_queue(job: "Job", metrics=None) -> bool:
    """Whether `job` was cancelled while it waited in the queue; if so it gets its
    `Finished("cancelled")` (nothing generated) and is counted in `metrics`. The engines
    (one process, pipeline, tensor group) call this before they start a job."""
    if not job.cancelled.is_set():
        return False
    job.emit(Finished("cancelled", len(job.ids)))
    if metrics is not None:
        metrics.finished_requests.labels("cancelled").inc()
    return True


class TokenEmitter:
    """One job's generated tokens as its events, the same for every loop (the
    one-at-a-time engines through `stream_to_job`, the batched loop
    `server.batch.run_batched` row by row): an EOS id ends the job ("stop", kept as
    `job.stop_token` for a scored request that asked for logprobs), every other token is
    a `TokenOut` (with its top log-probabilities when the job asked for them); `finish`
    emits and counts the `Finished` with its speeds.

    Args:
        job: the `Job`. eos_ids: token ids that end a reply. tic: `time.perf_counter()`
            when the request started (prompt tokens/s runs from it to the first token).
        metrics: the server's `Metrics` (`finished` counted there), or None.
    """

    def __init__(self, job: "Job", eos_ids, tic: float, metrics=None):
        self.job, self.eos_ids, self.tic, self.metrics = job, eos_ids, tic, metrics
        self.n = 0
        self.prompt_tps = 0.0
        self.t_first: Optional[float] = None  # when the first token came

    def first(self, cached: int) -> float:
        """The first token came now (`cached` prompt tokens were restored): returns the
        seconds since `tic` (the prompt's time)."""
        import time

        self.t_first = time.perf_counter()
        dt = self.t_first - self.tic
        self.prompt_tps = (len(self.job.ids) - cached) / max(dt, 1e-9)
        return dt

    def token(self, tok: int, lp) -> Optional[str]:
        """Emit generated token `tok` (logprobs `lp` [vocab]); "stop" (nothing emitted)
        when it is an EOS id, else None."""
        import mlx.core as mx

        job = self.job
        if tok in self.eos_ids:
            if job.score is not None and job.logprobs is not None:
                lp = lp if isinstance(lp, mx.array) else mx.array(lp)
                job.stop_token = TokenOut(tok, *top_logprobs(lp, tok, job.logprobs))
            return "stop"
        self.n += 1
        if job.logprobs is not None:
            lp = lp if isinstance(lp, mx.array) else mx.array(lp)
            chosen, top = top_logprobs(lp, tok, job.logprobs)
            job.emit(TokenOut(tok, chosen, top))
        else:
            job.emit(TokenOut(tok))
        return None

    def finish(self, reason: str, cached: int) -> "Finished":
        """Emit and count the job's `Finished` (generation tokens/s from the first token)."""
        import time

        t = self.t_first if self.t_first is not None else self.tic
        dt = time.perf_counter() - t
        done = Finished(reason, len(self.job.ids), cached, self.n, self.prompt_tps,
                        self.n / dt if dt > 0 else 0.0)
        if self.metrics is not None:
            self.metrics.finished(done)
        self.job.emit(done)
        return done


def stream_to_job(job: "Job", gen, eos_ids, tic: float, metrics=None,
                  cached: Callable[[], int] = lambda: 0,
                  on_first: Optional[Callable[[], None]] = None) -> "Finished":
    """Hand `gen`'s (token id, logprobs [vocab]) to `job` as `TokenOut`s (`TokenEmitter`)
    until an EOS id, the client's cancel or the end of `gen` (then reason "length");
    closes `gen` however it ends (an engine's generator frees its session / group state
    there), then emits and counts the `Finished` with its speeds and returns it.

    Args:
        tic: `time.perf_counter()` when the request started (prompt tokens/s runs from it
            to the first token). cached: the prompt tokens restored from a cache, read at
            the first token (a pipeline knows it only then). on_first: called once at the
            first token (before it is emitted).
    Shared by the one-at-a-time engine, the pipeline's and the tensor group's."""
    out = TokenEmitter(job, eos_ids, tic, metrics)
    reason = "length"
    try:
        for tok, lp in gen:
            if out.t_first is None:
                out.first(cached())
                if on_first is not None:
                    on_first()
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            if out.token(tok, lp) is not None:
                reason = "stop"
                break
    finally:
        gen.close()
    return out.finish(reason, cached())
