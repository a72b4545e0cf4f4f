"""The one engine contract every deployment serves through: `BaseEngine`.

It owns what the one-process engine (`server.engine.Engine`, batched or not), the
pipeline's (`cluster.head.engine.ClusterEngine`) and the tensor group's
(`cluster.tensor.engine.TensorEngine`) share: admission and the queue (`--max-queue`,
`Busy` -> 503 + Retry-After), the worker threads (each runs MLX through
`jobs.run_mlx_thread`), failure isolation (an exception fails its own request only, and
MLX's random state is reseeded), the capability flags the HTTP layer reads (logits
processors, images, drafts, batching), health, metrics, speculative decoding's
bookkeeping and stop. A deployment implements `_run(job)`: how one request's steps run
on its target; it may refine `_failed`, `health` and the start/stop hooks.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence, Tuple

from kimi_mlx.server.jobs import (Busy, Failed, Job, cancelled_in_queue, enqueue, reseed_random,
                                  run_mlx_thread)

__all__ = ["BaseEngine"]

log = logging.getLogger(__name__)


class BaseEngine:
    """Runs server `Job`s on worker threads (module doc). Subclasses implement `_run`.

    Args:
        eos_ids: token ids that end a reply.
        max_queue: jobs that may wait for a free slot; past it `submit` raises `Busy`.
        max_concurrency: requests generated at once (the free slots).
        metrics: the server's `Metrics` or None.
        speculation: a `speculative.loop.Speculation` or None: requests without logits
            processors decode speculatively (`_speculate`), one at a time; n-gram drafts
            also in a batch (max_concurrency > 1, `batch_drafts`).
        workers: worker threads (each runs one job at a time).
        name: the threads' name.
    Raises:
        ValueError: a speculation with max_concurrency > 1 whose draft does not batch.
    """

    # What this deployment can do; the HTTP layer reads these, never probes.
    supports_logits_processors = True  # penalties / logit_bias
    unsupported_penalties: Tuple[str, ...] = ()  # of those, the ones it cannot apply
    supports_images = True  # when the checkpoint has vision weights (`vision`)
    supports_drafts = True
    supports_batching = False  # several requests' decode steps in one forward pass
    supports_scoring = False  # scores a prompt's own tokens (`Job.score`, `server.scoring`)
    # its batched model takes image rows by token id (`server.batch._MediaFeed`); when
    # False a prompt with images is prefilled alone (`prefill`) and joins for its last token
    feeds_media_by_id = False
    images_refusal = "this server does not take images"  # said when supports_images is False
    target = "the model"  # what `health` is about, in messages ("the pipeline", ...)

    # set by the server for a checkpoint with vision weights: the tower
    # (`generation.images.Vision`, loaded on the first image) and <|media_pad|> id
    vision = None
    pad_id = None
    lost: Optional[str] = None  # why the target is gone for good (None: serving)
    speculation = None
    active = 0
    # whether this deployment's batched target passes can keep their hidden states, so
    # the MTP and block drafters draft inside the batch (the one-process engine)
    captures_hiddens = False

    def __init__(self, eos_ids: Sequence[int] = (), max_queue: int = 64,
                 max_concurrency: int = 1, metrics=None, speculation=None, workers: int = 1,
                 name: str = "kimi-mlx-engine"):
        if (speculation is not None and max_concurrency != 1
                and not _batches(speculation, self.captures_hiddens)):
            raise ValueError(f"speculative decoding with {speculation.draft!r} serves one "
                             f"request at a time, not max_concurrency {max_concurrency} "
                             "(n-gram drafts, --draft ngram, batch)")
        self.eos_ids = set(eos_ids)
        self.max_queue, self.max_concurrency = max_queue, max_concurrency
        self.metrics, self.speculation = metrics, speculation
        self.active = 0
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._worker, daemon=True,
                                          name=name if workers == 1 else f"{name}-{i}")
                         for i in range(workers)]

    # ---------------------------------------------------------------- capabilities

    def images_unsupported(self) -> Optional[str]:
        """Why this engine cannot take a request with images, or None when it can."""
        if not self.supports_images:
            return self.images_refusal
        if self.vision is None:
            return "this model has no vision weights, so it cannot take images"
        if self.speculation is not None and not self.batched_drafts:
            return ("images do not work with speculative decoding one request at a time "
                    "(this server runs with --draft-model / --draft; n-gram drafts with "
                    "--max-concurrency > 1 take them)")
        return None

    def refusal(self, job: Job) -> Optional[Tuple[str, str]]:
        """(API field, why) when this engine cannot run `job`'s sampling, else None."""
        s = job.sampling
        if s.constraint is not None and not self.supports_logits_processors:
            return (s.constraint.field, "structured output (response_format json / a forced "
                    "tool) is enforced by a logits processor, which this server does not "
                    "apply; send the request without it")
        if s.has_processors and not self.supports_logits_processors:
            return ("logit_bias" if s.logit_bias else "presence_penalty",
                    "presence_penalty, frequency_penalty, repetition_penalty and logit_bias "
                    "are not supported by this server")
        for name in self.unsupported_penalties:
            if getattr(s, name):
                return (name, f"{name} is not supported by this server (the pipeline's last "
                        "stage returns log-probabilities, and this penalty scales raw logits "
                        "by their sign); presence_penalty, frequency_penalty and logit_bias are")
        return None

    def health(self) -> Optional[str]:
        """None while serving; else why not (e.g. a lost stage or rank)."""
        return self.lost

    def stages(self) -> Optional[list]:
        """What /health lists about the target's parts (stages, ranks), or None."""
        return None

    # ---------------------------------------------------------------- admission

    @property
    def queue_length(self) -> int:
        """Jobs submitted and not yet started."""
        return self._jobs.qsize()

    def stopping(self) -> bool:
        """Whether `stop` was called (a worker loop ends at its next check)."""
        return self._stopping.is_set()

    def next_job(self, block: bool = True) -> Optional[Job]:
        """The next queued job; None when the engine is stopping (`stop` queues one None
        per worker). Raises queue.Empty when `block` is False and none waits."""
        return self._jobs.get(block=block)

    def submit(self, job: Job) -> Job:
        """Queue `job`; `Busy` when the target is down or max_queue jobs wait beyond the
        free slots (`jobs.enqueue`)."""
        down = self.health()
        if down:
            raise Busy(f"{self.target} is down ({down})")
        return enqueue(self._jobs, job, self.max_queue, self.max_concurrency, self.active)

    # ---------------------------------------------------------------- control

    def start(self) -> "BaseEngine":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, end the workers (the job in flight finishes or fails first)."""
        self._stopping.set()
        self._before_stop(timeout)
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            if t.ident is not None:
                t.join(timeout)
        self._after_stop()

    def _before_stop(self, timeout: float) -> None:
        """Hook: before the workers are told to end."""

    def _after_stop(self) -> None:
        """Hook: after the workers ended."""

    # ---------------------------------------------------------------- worker

    def _worker(self) -> None:
        run_mlx_thread(self._serve)

    def _serve(self) -> None:
        """A worker's loop: one job at a time until stop()."""
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self.lost:
                job.emit(Failed(f"generation failed: {self.lost}"))
                continue
            with self._lock:
                self.active += 1
            try:
                if not cancelled_in_queue(job, self.metrics):
                    self._run(job)
            except Exception as e:  # noqa: BLE001 - the error goes to this request only
                self._failed(job, e)
            finally:
                with self._lock:
                    self.active -= 1
                self._after_job()
        self._worker_done()

    def _run(self, job: Job) -> None:
        """Run one admitted job on the target: emit its Started, tokens and Finished
        (`jobs.stream_to_job`). An exception fails this job only (`_failed`)."""
        raise NotImplementedError

    def _failed(self, job: Job, e: Exception) -> None:
        """`job` raised `e`: it fails with the error's message; MLX's random state is
        reseeded, so nothing the failed request touched is reused."""
        log.exception("generation failed")
        job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
        reseed_random()

    def _after_job(self) -> None:
        """Hook: after each job, on its worker."""

    def _worker_done(self) -> None:
        """Hook: a worker's loop ended (stop)."""

    # ---------------------------------------------------------------- drafts

    # whether this deployment's speculative loops run the draft loop's own verify on this
    # process (the one-process engine), so a loop that checks drafts against a request's
    # grammar (`Speculation.checks_grammar`) can; the cluster's loops do not
    grammar_drafts = False

    @property
    def batched_drafts(self) -> bool:
        """Whether drafts are verified inside the continuous batch (max_concurrency > 1:
        n-gram drafts and draft models; the MTP and block drafters where the deployment
        `captures_hiddens`; `speculative.batch`) rather than one request at a time."""
        return (self.speculation is not None and self.max_concurrency > 1
                and _batches(self.speculation, self.captures_hiddens))

    def batch_drafts(self):
        """A fresh `speculative.batch.BatchDrafts` for a batched generator (sharing the
        speculation's statistics), or None when drafts are not batched."""
        if not self.batched_drafts:
            return None
        from kimi_mlx.speculative.batch import BatchDrafts

        from kimi_mlx.speculative.loop import model_vocab

        spec = self.speculation
        return BatchDrafts(spec.draft, spec.num_draft_tokens, spec.stats,
                           vocab=model_vocab(getattr(self, "model", None)))

    def speculates(self, job: Job) -> bool:
        """Whether `job` decodes speculatively: with a draft and no logits processors
        (the verify step does not apply them; those requests decode plainly), except a
        structured-output constraint alone where the loop checks drafts against it."""
        if self.speculation is None:
            return False
        s = job.sampling
        if s.constraint is not None and not replace(s, constraint=None).has_processors:
            return self.grammar_drafts and self.speculation.checks_grammar
        return not job.logits_processors

    def _speculate(self, job: Job, start: Callable[..., Iterator]) -> Iterator:
        """(token, logprobs) of `job` from `start(speculation)`, the speculative loop's
        (token, logprobs, from_draft) generator on this target; the acceptance figures go
        to the metrics. A seeded request seeds MLX's global PRNG, which only this one
        sequence uses (one request at a time)."""
        import mlx.core as mx

        spec = self.speculation
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        st = spec.stats
        before = (st.steps, st.drafted, st.accepted)
        gen = start(spec)
        try:
            for tok, lp, _from_draft in gen:
                yield tok, lp
        finally:
            gen.close()
            if self.metrics is not None:
                self.metrics.speculated(st.steps - before[0], st.drafted - before[1],
                                        st.accepted - before[2])


def _batches(speculation, captures: bool = False) -> bool:
    from kimi_mlx.speculative.proposers import batches_drafts

    return batches_drafts(speculation.draft, captures)
