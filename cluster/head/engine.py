"""`kimi-mlx cluster server`: the OpenAI + Anthropic API of `kimi-mlx server` with the
pipeline behind it.

`ClusterEngine` is a `server.engine_base.BaseEngine` (queue, admission, isolation,
capabilities, health): each of up to `max_concurrency` worker threads runs one request as
its own pipeline session (`head.pipeline.Pipeline.generate`), so different stages work on
different requests at once (pipeline fill). With `batch`, the sessions' decode steps
go through the stages together, one message per step (`head.batcher.Batcher`), each stage
running them as one batched forward pass (`runner.StageRunner.run_rows`). Past
`max_queue` waiting requests the API answers 503 + Retry-After. A lost stage fails the
requests on it (never retried on another placement), and /health reports it (503,
naming the stage and node) within seconds, even when idle; the
`recovery.PipelineKeeper` then reloads the stage when its node answers again, or
re-plans over the nodes left with `--replan`, and /health says which it is doing until
the pipeline serves again.

With a `net.cache_index.HeadCacheIndex`, each request starts from the longest prompt prefix
every stage still holds a snapshot of (asked with `CacheLookup` just before), and asks
the stages to snapshot at the one-process server's points (message ends, every N
tokens); `cached_tokens` reports the prefix restored (`net.cache_index`, `node.stage_cache`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Sequence

from kimi_mlx.server.engine_base import BaseEngine

from kimi_mlx.cluster.head.speculative import speculative_pipeline_step

log = logging.getLogger(__name__)


class ClusterEngine(BaseEngine):
    """Runs server `Job`s through a loaded `Pipeline` (see module doc); `BaseEngine` owns
    the queue, admission, isolation, capabilities and stop."""

    # presence/frequency penalties and logit_bias are applied at the head (mlx-lm's
    # processors over the last stage's log-probabilities, `head.pipeline.Pipeline.open`);
    # repetition_penalty is not: it scales raw logits by their sign, and the last stage
    # returns only log-probabilities (a 400 names this)
    unsupported_penalties = ("repetition_penalty",)
    supports_batching = True
    # the last stage scores a prompt's positions (`net.session.RemoteSession.prefill`)
    supports_scoring = True
    target = "the pipeline"

    def __init__(self, pipeline, eos_ids: Sequence[int], max_concurrency: int = 4,
                 max_queue: int = 64, metrics=None, keeper=None, speculation=None,
                 model_args=None, prompt_cache=None, batch: bool = False):
        super().__init__(eos_ids, max_queue, max_concurrency, metrics, speculation,
                         workers=max_concurrency, name="kimi-mlx-session")
        self.model_args = model_args  # the target's ModelArgs (vocab_size for the verify)
        self._pipeline = pipeline
        # batched decode (head.Batcher, one per pipeline): the decode steps of the requests
        # in flight go through the stages as one message per step
        self.batch = batch and speculation is None and max_concurrency > 1
        self._batcher = None
        self._batcher_of = None
        self._steps_done = [0, 0]  # of batchers replaced since (a recovery)
        if self.batch and metrics is not None:
            from prometheus_client import Gauge

            Gauge("kimi_mlx_cluster_batched_steps", "batched decode messages sent through "
                  "the pipeline", registry=metrics.registry).set_function(lambda: self._batched()[0])
            Gauge("kimi_mlx_cluster_batched_rows", "decode positions those messages carried "
                  "(rows / steps = mean batch)", registry=metrics.registry).set_function(
                lambda: self._batched()[1])
        # net.cache_index.HeadCacheIndex: snapshots on the stages (None: every request
        # prefills its whole prompt; a draft decodes without it)
        self.prompt_cache = prompt_cache if speculation is None else None
        # count_lookup(result): one prompt-cache lookup ("hit", "shorter", "miss", "disk",
        # "refused") in /metrics
        self.count_lookup = lambda result: None
        if self.prompt_cache is not None and metrics is not None:
            from kimi_mlx.cluster.net.cache_index import lookup_count

            self.count_lookup = lookup_count(metrics)
            metrics.registry.register(_StageDiskCollector(self))
        self.keeper = keeper  # recovery.PipelineKeeper (None: a loss is final)
        self._vision_lock = threading.Lock()

    def _media(self, job):
        """The prefill's media for a job with images (the tower runs here, on the head),
        else None."""
        if not job.images:
            return None
        from kimi_mlx.cluster.net.session import media_rows

        return media_rows(self.vision, job.images, self.pad_id, self._vision_lock)

    @property
    def pipeline(self):
        """The pipeline requests start on now (the keeper's, after a recovery)."""
        return self.keeper.pipeline if self.keeper is not None else self._pipeline

    def start(self) -> "ClusterEngine":
        super().start()
        if self.keeper is not None:
            self.keeper.start()
        return self

    def _before_stop(self, timeout: float) -> None:
        if self.keeper is not None:
            self.keeper.stop(timeout)
        if self._batcher is not None:
            self._batcher.close()

    def health(self) -> Optional[str]:
        """None while every stage serves; else which stage was lost (and, with a keeper,
        what it is doing about it)."""
        return self.keeper.status() if self.keeper is not None else self.lost

    def stages(self) -> list:
        """The pipeline's stages for /health: [{"index", "node", "address", "layers":
        [start, end], "ok", "reason"}]; a lost stage has ok False and why."""
        t = self.pipeline.transport
        lost = t.lost or {}
        return [{"index": i, "node": a.node.node_id, "address": a.node.address,
                 "layers": [a.start, a.end], "ok": i not in lost, "reason": lost.get(i)}
                for i, a in enumerate(t.stages)]

    def _failed(self, job, e: Exception) -> None:
        from kimi_mlx.cluster.head.transport import StageFailure

        if isinstance(e, StageFailure) and e.lost:
            if self.keeper is not None:
                self.keeper.check()
            else:
                self.lost = f"stage lost: {e}"
        super()._failed(job, e)  # head-side sampling shares this process's random state

    def _run(self, job) -> None:
        from kimi_mlx.server.jobs import Started, stream_to_job
        from kimi_mlx.server.prompt_cache import DEFAULT_EVERY, snapshot_points

        # logits processors: mlx-lm's, on the head, over the last stage's log-probabilities
        kw = dict(return_logprobs=job.logprobs is not None,
                  logits_processors=job.logits_processors or None)
        tic = time.perf_counter()
        start = {"cached": 0}
        if job.score is not None:
            gen = self._scored(job, kw, tic)
            if gen is None:
                return
        elif self.speculates(job):
            gen = self._speculate(job, lambda spec: speculative_pipeline_step(
                self.pipeline, job.ids, spec.draft, self.model_args,
                num_draft_tokens=spec.num_draft_tokens, max_tokens=job.max_tokens,
                sampling=job.sampling, stats=spec.stats))
        elif self.prompt_cache is not None:
            gen = self._cached_generate(job, kw, start)
        else:
            # no prompt cache: chunks end at the policy's points all the same, so a reply
            # is computed as a snapshot-restored one would be (one process does the same)
            gen = self.pipeline.generate(
                job.ids, job.sampling, job.max_tokens, batcher=self.batcher(),
                media=self._media(job), **kw,
                stops=snapshot_points(len(job.ids), 0, job.segment_ends, DEFAULT_EVERY))
        # the restored prefix is known once the stages took the session (a refused
        # snapshot means a full prefill): Anthropic's message_start waits for Started, so
        # its usage is the one message_delta repeats; closing `gen` ends the session on
        # every stage
        stream_to_job(job, gen, self.eos_ids, tic, self.metrics, cached=lambda: start["cached"],
                      on_first=lambda: job.emit(Started(start["cached"])))

    def _scored(self, job, kw, tic):
        """A job with `score` (echo + logprobs): its prompt scored by the last stage, in
        full (no prompt-cache prefix: a restored prefix has no logits; no draft: it
        decodes plainly). Returns the generator of its reply, after which
        `job.prompt_scores` is filled before the first token; or None when it is score
        only (max_tokens 0: scored and finished here)."""
        from kimi_mlx.server.jobs import Started
        from kimi_mlx.server.scoring import finish_scored

        scores: list = []
        gen = self.pipeline.generate(job.ids, job.sampling, job.max_tokens, score=job.score,
                                     scores=scores, **kw,
                                     batcher=self.batcher() if job.max_tokens else None)
        job.prompt_scores = scores
        if job.max_tokens:
            return gen
        for _ in gen:  # max_tokens 0: scores the prompt, yields nothing
            pass
        job.emit(Started(0))
        finish_scored(job, tic, self.metrics)
        return None

    def _batched(self):
        b = self._batcher
        return (self._steps_done[0] + (b.steps if b else 0),
                self._steps_done[1] + (b.rows if b else 0))

    def batcher(self):
        """The `head.batcher.Batcher` of the current pipeline (None without batching); a new
        pipeline (after a recovery) gets a new one."""
        if not self.batch:
            return None
        from kimi_mlx.cluster.head.batcher import Batcher

        with self._lock:
            pipeline = self.pipeline
            if self._batcher_of is not pipeline:
                if self._batcher is not None:
                    self._batcher.close()
                    self._steps_done[0] += self._batcher.steps
                    self._steps_done[1] += self._batcher.rows
                self._batcher, self._batcher_of = Batcher(pipeline.transport), pipeline
            return self._batcher

    def _restore_point(self, ids, segment_ends=()):
        """((key, n) of the longest remembered prefix of ids that every stage still holds,
        or None; n, 0 without one), counted in /metrics. When the head remembers none of
        the prompt's prefixes (it restarted, or forgot them), the points where the policy
        would have snapshotted them are asked for instead: stages with
        `--prompt-cache-dir` may hold them from before (counted as "disk" when found,
        not counted otherwise: a new prompt is no miss)."""
        cands, guessed = self.prompt_cache.candidates(ids), False
        if not cands:
            cands, guessed = self.prompt_cache.policy_candidates(ids, segment_ends), True
        if not cands:
            return None, 0
        held = set(self.pipeline.transport.cache_lookup([k for _, k in cands]) or ())
        for i, (n, key) in enumerate(cands):
            if key in held:
                self.count_lookup("disk" if guessed else "hit" if i == 0 else "shorter")
                return (key, n), n
        if not guessed:
            self.count_lookup("miss")
        return None, 0

    def _cached_generate(self, job, kw, start):
        """`Pipeline.generate` from the longest prefix the stages hold, taking snapshots
        where the policy says (`HeadCacheIndex.plan`); start["cached"] = prompt tokens
        restored. A stage that lost the snapshot since the lookup refuses the session
        before any token: then the prompt is prefilled in full, on the same pipeline."""
        from kimi_mlx.cluster.net.cache_keys import CACHE_MISS
        from kimi_mlx.cluster.head.transport import StageFailure

        key = job.cache_key  # the ids, with image pads tagged by their image's digest
        restore, cached = self._restore_point(key, job.segment_ends)
        media = self._media(job)
        while True:
            start["cached"] = cached
            snaps = self.prompt_cache.plan(key, cached, job.segment_ends)
            gen = self.pipeline.generate(job.ids, job.sampling, job.max_tokens, **kw,
                                         restore=restore, snapshots=snaps,
                                         batcher=self.batcher(), media=media)
            first = True
            try:
                for item in gen:
                    first = False
                    yield item
                return
            except StageFailure as e:
                if restore is None or not first or e.lost or CACHE_MISS not in str(e):
                    raise
                log.warning("prompt cache: %s; prefilling in full", e)
                self.count_lookup("refused")
                restore, cached = None, 0
            finally:
                gen.close()


class _StageDiskCollector:
    """/metrics of the stages' prompt-cache disk tiers (`cluster serve
    --prompt-cache-dir`), as each stage reported them in its last `CacheLookup` reply:
    kimi_mlx_cluster_stage_prompt_cache_disk_{hits,misses,read_seconds,write_seconds,
    ignored}_total and _bytes, by stage."""

    FIELDS = (("hits", "snapshots a stage read back from its disk", True),
              ("misses", "restores that found no usable file on a stage's disk", True),
              ("read_seconds", "seconds a stage spent reading snapshot files", True),
              ("write_seconds", "seconds a stage's background writer spent writing", True),
              ("ignored", "files a stage did not use (another checkpoint, split or "
                          "version, or a failed checksum)", True),
              ("bytes", "bytes of snapshot files on a stage's disk", False))

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pipeline = getattr(self.engine, "pipeline", None)
        stats = dict(getattr(getattr(pipeline, "transport", None), "cache_stats", None) or {})
        for name, doc, counter in self.FIELDS:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            m = kind(f"kimi_mlx_cluster_stage_prompt_cache_disk_{name}", doc, labels=["stage"])
            for i, r in sorted(stats.items()):
                m.add_metric([str(i)], getattr(r, f"disk_{name}"))
            yield m
