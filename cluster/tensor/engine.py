"""`kimi-mlx cluster server --parallel tensor`: the OpenAI + Anthropic API over one
tensor-parallel group (issue 21).

This head is rank 0 and runs the request path (tokenizer, sampling, logits processors,
stop rules, streaming); the nodes' ranks are started through their control plane
(`StartRank`, `tensor_launch.form_group`) and follow rank 0's commands
(`cluster.tensor_step`). `TensorEngine` is a `server.engine_base.BaseEngine`.

Prompt cache (issue 33, `tensor.prompt_cache`): with `prompt_cache` (rank 0's
`net.cache_index.HeadCacheIndex`) every rank keeps its shard of the snapshots rank 0 names
(bounded per rank), a request restores the longest prefix every rank holds (agreed by the
group) and reports it as `cached_tokens`; hits and misses are counted in /metrics.
Images: the tower runs on rank 0 (this head), the projector rows are broadcast with the
prefill chunks that hold their pads (`step.MEDIA`). A draft turns the prompt cache off
(as in the pipeline); a scored prompt runs in full.

One request at a time: the group runs one sequence (no batching through it); further
requests queue (up to --max-queue, then 503 + Retry-After as every engine). With a draft
(`--draft-model`, `--draft ngram`) each request decodes speculatively, the draft on this
head (requests with penalties or logit_bias decode plainly, as in one process).

Faults: `TensorGroup` watches every node's rank. A rank that exits, is killed or stopped
(SIGSTOP), or a node that stops answering: /health answers 503 naming the rank and node
(within the node's poll, ~0.5 s, or --peer-timeout), the request in flight fails with
that message (also when rank 0 is blocked in a collective: the failure is sent from the
watch), queued ones fail too, every node kills its rank (lease cancelled) and this head
drops its shard. The server keeps answering (503) until restarted.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Sequence

from kimi_mlx.server.engine_base import BaseEngine

log = logging.getLogger("kimi_mlx.cluster.tensor_server")


class TensorEngine(BaseEngine):
    """Runs server `Job`s through a tensor-parallel group, one at a time (module doc);
    `BaseEngine` owns the queue, admission, isolation, capabilities and stop.

    Args:
        group / model: the MLX group (this process rank 0) and rank 0's shard.
        watch: the `TensorGroup` holding the nodes' leases (its `exit` is set here).
        transport: the control plane (shut down by `stop`).
        eos_ids: ids that end a reply. max_queue: waiting requests before 503.
        metrics: the server's `Metrics` or None. speculation: a `Speculation` or None.
        ranks: [(rank, node name)] of the node ranks, for /health.
    """

    # logits processors are applied on rank 0, which samples; the group runs one
    # sequence; images: the tower on rank 0, the rows broadcast (`step.MEDIA`)
    supports_images = True
    supports_scoring = True  # rank 0 holds the logits (`_score`)
    target = "the tensor group"

    def __init__(self, group, model, watch, transport, eos_ids: Sequence[int],
                 max_queue: int = 64, metrics=None, speculation=None, ranks=(),
                 prompt_cache=None, store=None):
        super().__init__(eos_ids, max_queue, 1, metrics, speculation, name="kimi-mlx-tensor-rank0")
        self.group, self.model, self.watch, self.transport = group, model, watch, transport
        self.ranks = list(ranks)
        # prompt cache: rank 0's index of snapshot prefixes and its own shard's snapshots
        # (`KeyedSnapshotCache`); a draft decodes without it, as in the pipeline
        self.prompt_cache = prompt_cache if speculation is None else None
        self.store = store if self.prompt_cache is not None else None
        self._lookups = None
        if self.prompt_cache is not None and metrics is not None:
            from kimi_mlx.cluster.net.cache_index import lookup_counter

            self._lookups = lookup_counter(metrics.registry)
        self._current = None  # the job in flight
        self._failed_ids: set = set()  # ids of jobs failed by the watch
        watch.exit = lambda code: self.group_lost(watch.failed or "the tensor group failed")

    def _after_stop(self) -> None:
        """End the group: EXIT to the other ranks (when it is whole, `_worker_done`),
        close the leases."""
        self.watch.close()
        self.transport.shutdown()
        if self.store is not None:
            self.store.attach_disk(None)  # rank 0's queued snapshot writes finish

    def stages(self) -> list:
        """The group's ranks for /health: [{"rank", "node", "ok", "reason"}]."""
        out = [{"rank": 0, "node": "this head", "ok": self.lost is None, "reason": None}]
        for rank, node in self.ranks:
            bad = self.lost if self.lost and f"node {node}" in self.lost else None
            out.append({"rank": rank, "node": node, "ok": self.lost is None, "reason": bad})
        return out

    def group_lost(self, reason: str) -> None:
        """The watch's end of the group (a rank lost / stopped, a node silent): say so on
        /health, fail the request in flight and the queued ones; the leases are already
        cancelled (the nodes kill their ranks)."""
        from kimi_mlx.server.jobs import Failed

        with self._lock:
            if self.lost is not None:
                return
            self.lost = f"tensor group lost: {reason}"
            job = self._current
            if job is not None:
                self._failed_ids.add(id(job))
        log.error("%s", self.lost)
        if job is not None:
            job.emit(Failed(f"generation failed: {self.lost}"))
        self._drain()

    def _drain(self) -> None:
        from kimi_mlx.server.jobs import Failed

        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._jobs.put(None)
                return
            job.emit(Failed(f"generation failed: {self.lost}"))

    def _failed(self, job, e: Exception) -> None:
        from kimi_mlx.server.jobs import Failed, reseed_random

        if isinstance(e, RuntimeError) and self.lost is None:
            # a collective failed: a peer is gone; its node names it through the watch
            deadline = time.monotonic() + self.watch.peer_timeout + 2
            while self.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.lost is None:
                self.watch.fail(f"rank 0 (this head): {e}")
        with self._lock:
            failed = id(job) in self._failed_ids
        if not failed:
            log.exception("tensor-parallel generation failed")
            job.emit(Failed(f"generation failed: {self.lost or f'{type(e).__name__}: {e}'}"))
        reseed_random()

    def _after_job(self) -> None:
        with self._lock:
            self._current = None
        if self.lost:
            import mlx.core as mx

            self.model = None  # this head's shard: freed with the group
            mx.clear_cache()

    def _worker_done(self) -> None:
        if self.lost is None:
            from kimi_mlx.cluster.tensor.step import OP_EXIT, command

            try:
                command(self.group, OP_EXIT)
                self.watch.finish()
            except RuntimeError as e:
                log.warning("ending the tensor group: %s", e)

    def _generate(self, job):
        """(token, logprobs [vocab]) of `job` through the group, and the prompt tokens
        restored from the prompt cache."""
        if not self.speculates(job) and (self.prompt_cache is not None or job.images):
            return self._cached_generate(job)
        return self._plain_generate(job), 0

    def _cached_generate(self, job):
        """`_generate` through `prompt_cache.open_request` (restore, snapshots, image
        rows), then plain decoding from the last prompt token."""
        from kimi_mlx.cluster.tensor.prefill import open_request
        from kimi_mlx.cluster.tensor.step import group_stream, plain_run

        media = None
        if job.images and self.pad_id in job.ids[:-1]:
            def media():  # the tower, on rank 0, when pads are left after the restore
                import mlx.core as mx

                rows = self.vision.features(job.images)
                mx.eval(rows)
                return rows

            media.pad_id = self.pad_id
        count = self._lookups.labels if self._lookups is not None else None
        target = open_request(self.model, self.group, job.ids, key=job.cache_key,
                              index=self.prompt_cache, store=self.store,
                              segment_ends=job.segment_ends, media=media,
                              count=(lambda r: count(r).inc()) if count else None)
        return group_stream(self.model, self.group, job.ids[-1:], plain_run(
            job.ids[-1:], job.max_tokens, job.sampling.sampler(), job.logits_processors),
            target=target), target.cached

    def _plain_generate(self, job):
        from kimi_mlx.cluster.tensor.step import group_stream, plain_run, speculative_run

        if self.speculates(job):
            return self._speculate(job, lambda spec: group_stream(
                self.model, self.group, job.ids, speculative_run(
                    job.ids, spec.draft, num_draft_tokens=spec.num_draft_tokens,
                    max_tokens=job.max_tokens, sampling=job.sampling, stats=spec.stats),
                record=True))
        return group_stream(self.model, self.group, job.ids, plain_run(
            job.ids, job.max_tokens, job.sampling.sampler(), job.logits_processors))

    def _score(self, job, tic: float):
        """Score the prompt of a job with `score` (`tensor.step.score_prompt`: its logits
        on rank 0, scored as one process scores them); returns the generator of its reply,
        or None when it is score only (finished here). A scored request decodes plainly
        (no draft: the prompt is already in the group's caches)."""
        from kimi_mlx.cluster.tensor.step import group_stream, plain_run, score_prompt
        from kimi_mlx.server.scoring import finish_scored

        job.prompt_scores, target = score_prompt(self.model, self.group, job.ids, job.score)
        if job.max_tokens == 0:
            target.end()
            finish_scored(job, tic, self.metrics)
            return None
        return group_stream(self.model, self.group, job.ids[-1:], plain_run(
            job.ids[-1:], job.max_tokens, job.sampling.sampler(), job.logits_processors),
            target=target)

    def _run(self, job) -> None:
        from kimi_mlx.server.jobs import Started, stream_to_job

        with self._lock:
            self._current = job
        tic = time.perf_counter()
        cached = 0
        if job.score is not None:
            job.emit(Started(0))
            gen = self._score(job, tic)
            if gen is None:
                return
        else:
            gen, cached = self._generate(job)
            job.emit(Started(cached))
        # closing gen: END on every rank
        stream_to_job(job, gen, self.eos_ids, tic, self.metrics, cached=lambda: cached)


def start_tensor_engine(cluster, eos_ids, metrics, speculation, *, max_queue: int,
                        max_concurrency: int = 1, backend: str = "auto", prompt_cache=None,
                        cache_bytes=None, cache_dir=None, cache_disk_bytes: int = 0) -> TensorEngine:
    """Form the group (`tensor.launch.form_group` over `cluster`, a `net.nodes.NodeFinder`:
    this head rank 0, the nodes' ranks started through `StartRank`; `backend` "auto",
    "ring" or "jaccl") and start a `TensorEngine` on it (`max_queue` waiting requests;
    `max_concurrency` above 1 is only warned about). `prompt_cache`: rank 0's
    `HeadCacheIndex` (None: no prompt cache); `cache_bytes`: the bound of rank 0's own
    snapshots (None: `prompt_cache.default_cache_bytes`; the nodes' ranks take their
    node's `cluster serve --cache-bytes`); `cache_dir` / `cache_disk_bytes`: rank 0's disk
    tier (`cluster server --prompt-cache-dir`; the nodes' ranks take their node's).
    Raises what `form_group` raises (the server then ends, naming it)."""
    from kimi_mlx.cluster.tensor.group import TensorGroup
    from kimi_mlx.cluster.tensor.launch import form_group

    watch = TensorGroup(cluster.settings.peer_timeout, exit=lambda code: None)
    transport, group, model = form_group(cluster, watch, backend)
    ranks = [(i + 1, name) for i, name in enumerate(watch.names)]
    if max_concurrency != 1:
        log.warning("--parallel tensor serves one request at a time (the group runs one "
                    "sequence); others queue")
    log.warning("serving through a tensor-parallel group of %d: rank 0 this head, %s",
                group.size(), ", ".join(f"rank {r} node {n}" for r, n in ranks))
    store = None
    if prompt_cache is not None and speculation is None:
        from kimi_mlx.cluster.tensor.prompt_cache import make_store, rank_fingerprint

        fp = (rank_fingerprint(cluster.model_dir, model, 0, group.size())
              if cache_dir is not None else None)
        store = make_store(cache_bytes, cache_dir, cache_disk_bytes, fp, "rank 0 (this head)")
        if store is not None and store.disk is not None and metrics is not None:
            metrics.watch_disk_cache(store.disk)
        log.warning("prompt cache on every rank; rank 0 (this head) keeps up to %.1f GB",
                    (store.max_bytes if store is not None else 0) / 1e9)
    if store is None:
        prompt_cache = None
    return TensorEngine(group, model, watch, transport, eos_ids, max_queue, metrics,
                        speculation, ranks, prompt_cache, store).start()
