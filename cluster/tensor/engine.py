"""`kimi-mlx cluster server --parallel tensor`: the OpenAI + Anthropic API over one
tensor-parallel group.

This head runs the request path (tokenizer, sampling, logits processors, stop rules,
streaming) and rank 0, whose share of the group (its slices, caches and collectives) runs
in a child process of this server (`tensor.relay.Rank0Process`, see "Healing" below); the
nodes' ranks are started through their control plane (`StartRank`,
`tensor.launch.form_group`) and follow rank 0's commands (`tensor.step`). `TensorEngine`
is a `server.engine_base.BaseEngine`.

Prompt cache (`tensor.prompt_cache`): with `prompt_cache` (rank 0's
`net.cache_index.HeadCacheIndex`) every rank keeps its shard of the snapshots rank 0 names
(bounded per rank), a request restores the longest prefix every rank holds (agreed by the
group) and reports it as `cached_tokens`; hits and misses are counted in /metrics.
Rank 0's own shard of the snapshots is kept by its child process (`tensor.relay`: it
runs the agreement and the snapshots; a re-formed group's child starts with an empty
memory store and the same disk folder). Images: the tower runs in this server process,
the projector rows go to rank 0's process over its socket and are broadcast from there
with the prefill chunks that hold their pads (`step.MEDIA`). A draft turns the prompt cache off
(as in the pipeline); a scored prompt runs in full.

Batching: with --max-concurrency N > 1 the one-process server's
continuous batching (`server.batch.run_batched`, mlx-lm's `BatchGenerator`) runs here over
the group's rows (`tensor.batched`, `tensor.rows`): up to N sequences per forward command
(one all_sum per layer for all of them), requests joining between decode steps, a long
prompt prefilled in chunks of `server.batch.PREFILL_STEP` tokens between the others'
steps; the prompt cache per row. N-gram drafts (`--draft ngram`) batch too:
every row's drafts are verified in one batched forward command and each rank
rolls its shard of the rows back by rank 0's accepted counts (`speculative.batch`,
`tensor.rows` ROW_VERIFY / ROW_ROLLBACK). With N = 1, or with a draft model (`--draft-model`:
speculative decoding runs one sequence), one request at a time; further requests
queue (up to --max-queue, then 503 + Retry-After as every engine). Each speculative
request has the draft on this head (requests with penalties or logit_bias decode
plainly, as in one process).

Faults: `TensorGroup` watches every node's rank. A rank that exits, is killed or stopped
(SIGSTOP), or a node that stops answering: /health answers 503 naming the rank and node
(within the node's poll, ~0.5 s, or --peer-timeout), the request in flight fails with
that message (also when rank 0 is blocked in a collective: the failure is sent from the
watch), queued ones fail too, every node kills its rank (lease cancelled) and rank 0's
process is killed.

Healing (`tensor.recovery.GroupKeeper`, as `head.recovery.PipelineKeeper` for a pipeline):
rank 0 runs in a child process, so this server forms the group again by itself once the
lost node answers (or without it, with --replan); /health says what it is doing.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Optional, Sequence

from kimi_mlx.server.engine_base import BaseEngine

log = logging.getLogger(__name__)


class TensorEngine(BaseEngine):
    """Runs server `Job`s through a tensor-parallel group, batched or one at a time (module doc);
    `BaseEngine` owns the queue, admission, isolation, capabilities and stop.

    Args:
        group / model: the MLX group (this process rank 0) and rank 0's shard.
        watch: the `TensorGroup` holding the nodes' leases (its `exit` is set here).
        transport: the control plane (shut down by `stop`).
        eos_ids: ids that end a reply. max_queue: waiting requests before 503.
        metrics: the server's `Metrics` or None. speculation: a `Speculation` or None.
        ranks: [(rank, node name)] of the node ranks, for /health.
        prompt_cache: rank 0's `net.cache_index.HeadCacheIndex` (None: no prompt cache).
        store: rank 0's own `KeyedSnapshotCache` when `group` is an MLX group in this
            process; with a `tensor.relay.Rank0Process` its child keeps it (`store`).
        reform: (excluded node names, epoch, cancelled) -> (transport, group, model, watch,
            ranks), a new group (`start_tensor_engine`), given up (raising) once
            `cancelled()` (the server stops); None: a lost group stays lost.
        probe: ([NodeInfo]) -> (accepted, rejected), `net.nodes.check_nodes` for the
            checkpoint. replan: form the group without a lost node that does not answer.
        retry: seconds between recovery attempts (and between checks of rank 0's process).
        max_concurrency: sequences decoded together (> 1: continuous batching through the
            group; a draft other than n-gram makes it 1).
    """

    # logits processors are applied on rank 0, which samples; images: the tower on rank 0, the rows broadcast (`step.MEDIA`)
    supports_images = True
    supports_scoring = True  # rank 0 holds the logits (`_score`)
    target = "the tensor group"

    def __init__(self, group, model, watch, transport, eos_ids: Sequence[int],
                 max_queue: int = 64, metrics=None, speculation=None, ranks=(),
                 prompt_cache=None, store=None, reform=None, probe=None, replan: bool = False,
                 retry: float = 0.5, max_concurrency: int = 1):
        # n-gram drafts batch (`speculative.batch`: every row's drafts in one verify pass);
        # any other draft decodes one sequence at a time
        batched = speculation is None or _batches(speculation)
        rows = max(1, int(max_concurrency)) if batched else 1
        super().__init__(eos_ids, max_queue, rows, metrics, speculation,
                         name="kimi-mlx-tensor-rank0")
        # several rows per forward command (`tensor.batched`): continuous batching
        self.supports_batching = rows > 1
        self._rows = None  # the batched rows' stand-in model (`tensor.rows.GroupRows`)
        self.group, self.model, self.watch, self.transport = group, model, watch, transport
        self.ranks = list(ranks)
        # prompt cache: rank 0's index of snapshot prefixes and its own shard's snapshots
        # (in rank 0's child process, `store`); a draft that is not batched decodes
        # without it, as in the pipeline
        self.prompt_cache = prompt_cache if speculation is None or rows > 1 else None
        self._store = store if self.prompt_cache is not None else None
        # count_lookup(result): one prompt-cache lookup ("hit", "shorter", "miss", "disk")
        # in /metrics (`tensor.batched.RowPromptCache` counts the batched rows' too)
        self.count_lookup = lambda result: None
        if self.prompt_cache is not None and metrics is not None:
            from kimi_mlx.cluster.net.cache_index import lookup_count

            self.count_lookup = lookup_count(metrics)
        self._current = None  # the job in flight
        self._failed_ids: set = set()  # ids of jobs failed by the watch
        self.epoch = 0  # the group's number: a report from an older group's watch is ignored
        self._bind(watch)
        # forms the group again after a loss (None: a lost group stays lost)
        self.keeper = None
        if reform is not None:
            from kimi_mlx.cluster.tensor.recovery import GroupKeeper

            self.keeper = GroupKeeper(self, reform, probe, replan, retry,
                                      spare=hasattr(group, "relay_command"))

    @property
    def store(self):
        """Rank 0's snapshot store: the current group's child's (`relay.ChildStore`: it
        keeps them; a new group's starts empty) or the `KeyedSnapshotCache` given."""
        if self.prompt_cache is None:
            return None
        return getattr(self.group, "store", None) or self._store

    def _bind(self, watch) -> None:
        """Route `watch`'s teardown to `group_lost` for the current epoch only."""
        epoch = self.epoch
        watch.exit = lambda code: self.group_lost(watch.failed or "the tensor group failed",
                                                  epoch, watch)

    def start(self) -> "TensorEngine":
        super().start()
        if self.keeper is not None:
            self.keeper.start()
        return self

    def health(self) -> Optional[str]:
        """None while serving; else the loss (naming rank and node) and what the recovery
        is doing about it."""
        with self._lock:
            lost = self.lost
        if lost is None:
            return None
        doing = (self.keeper.doing if self.keeper is not None
                 else "restart the server to form it again")
        return f"{lost}; {doing}" if doing else lost

    def group_state(self):
        """(loss or None, group, watch, whether a request runs on it), for the keeper."""
        with self._lock:
            return self.lost, self.group, self.watch, self._current is not None

    def install(self, transport, group, model, watch, ranks) -> Optional[str]:
        """Serve through a group formed again (`recovery.GroupKeeper`): a new epoch, the
        batched rows moved over; returns the loss it replaces, or None (and closes
        `watch`) when the server is stopping."""
        with self._lock:
            if self._stopping.is_set():
                watch.close()
                return None
            self.epoch += 1
            self._bind(watch)
            self.transport, self.group, self.model, self.watch = transport, group, model, watch
            if self._rows is not None:  # the batched rows go on over the new group
                relay = hasattr(group, "relay_command")
                self._rows.bind(None if relay else model, group, None if relay else self._store)
            self.ranks = list(ranks)
            self._failed_ids.clear()
            was, self.lost = self.lost, None
        return was

    def _after_stop(self) -> None:
        """End the group: EXIT to the other ranks (when it is whole, `_worker_done`),
        close the leases, kill rank 0's process (which finished its disk writes on EXIT);
        end the recovery."""
        if self.keeper is not None:
            self.keeper.stop(5)
        with self._lock:
            watch, transport = self.watch, self.transport
        watch.close()
        transport.shutdown()
        if self._store is not None and hasattr(self._store, "attach_disk"):
            self._store.attach_disk(None)  # an in-process rank 0's queued snapshot writes

    def stages(self) -> list:
        """The group's ranks for /health: [{"rank", "node", "ok", "reason"}]."""
        own = self.lost if self.lost and "lost: rank 0 (this head" in self.lost else None
        out = [{"rank": 0, "node": "this head", "ok": self.lost is None, "reason": own}]
        for rank, node in self.ranks:
            bad = self.lost if self.lost and f"node {node}" in self.lost else None
            out.append({"rank": rank, "node": node, "ok": self.lost is None, "reason": bad})
        return out

    def group_lost(self, reason: str, epoch: Optional[int] = None, watch=None) -> None:
        """The watch's end of the group (a rank lost / stopped, a node silent): say so on
        /health, fail the request in flight and the queued ones; the leases are already
        cancelled (the nodes kill their ranks) and rank 0's process killed. A report
        about an older group (`epoch` below the current one) is ignored."""
        from kimi_mlx.server.jobs import Failed

        own = getattr(getattr(watch, "rank0", None), "state", lambda: None)()
        with self._lock:
            if self.lost is not None or (epoch is not None and epoch != self.epoch):
                return
            if own is not None and not reason.startswith("rank 0"):
                # rank 0's process died first: the nodes' ranks then lost their peer
                reason = f"rank 0 (this head's rank process) {own} (then: {reason})"
                node = None
            else:
                node = watch.nodes.get(watch.failed_node) if watch is not None else None
            self.lost = f"tensor group lost: {reason}"
            job = self._current
            if job is not None:
                self._failed_ids.add(id(job))
        log.error("%s", self.lost)
        if self.keeper is not None:
            self.keeper.lost([node] if node is not None else [])
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

    def _name_loss(self, e: Exception) -> None:
        """After `e` from the group: when rank 0's process ended or a collective failed
        (RuntimeError), wait for the watch to name the lost rank (`lost`), else say it."""
        own = getattr(self.group, "state", lambda: None)()
        if own is not None and self.lost is None:  # rank 0's own process ended
            self.watch.fail(f"rank 0 (this head's rank process) {own}")
        if isinstance(e, RuntimeError) and self.lost is None:
            # a collective failed: a peer is gone; its node names it through the watch
            deadline = time.monotonic() + self.watch.peer_timeout + 2
            while self.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.lost is None:
                self.watch.fail(f"rank 0 (this head): {e}")

    def _row_error(self, e: Exception) -> Optional[Exception]:
        """`GroupRows.on_error`: a failed command of the batched rows fails the rows in
        the step with the loss named (the lost rank and node), as one request would."""
        if not isinstance(e, RuntimeError):
            return None
        self._name_loss(e)
        return RuntimeError(self.lost) if self.lost else None

    def _serve(self) -> None:
        """With max_concurrency > 1: the one-process server's continuous batching
        (`server.batch.run_batched`) over the group's rows (`tensor.batched.BatchHost`);
        else one job at a time."""
        if self.max_concurrency == 1:
            super()._serve()
            return
        from kimi_mlx.cluster.tensor.batched import BatchHost
        from kimi_mlx.cluster.tensor.rows import GroupRows
        from kimi_mlx.server.batch import run_batched

        with self._lock:
            relay = hasattr(self.group, "relay_command")
            self._rows = GroupRows(None if relay else self.model, self.group,
                                   None if relay else self._store, on_error=self._row_error)
        run_batched(BatchHost(self, self._rows))
        self._worker_done()

    def _failed(self, job, e: Exception) -> None:
        from kimi_mlx.server.jobs import Failed, reseed_random

        self._name_loss(e)
        with self._lock:
            failed = id(job) in self._failed_ids
        if not failed:
            log.exception("tensor-parallel generation failed")
            job.emit(Failed(f"generation failed: {self.lost or f'{type(e).__name__}: {e}'}"))
        reseed_random()

    def _after_job(self) -> None:
        with self._lock:
            self._current = None
            drop = self.lost is not None and self.keeper is None
            if self.lost is not None and self.keeper is not None:
                self.keeper.wake()  # the request on the old group ended: recover now
        if drop:
            import mlx.core as mx

            self.model = None  # this head's shard: freed with the group
            mx.clear_cache()

    def _worker_done(self) -> None:
        with self._lock:
            lost, group, watch = self.lost, self.group, self.watch
        if lost is None:
            from kimi_mlx.cluster.tensor.step import OP_EXIT, command

            try:
                command(group, OP_EXIT)
                watch.finish()
            except RuntimeError as e:
                log.warning("ending the tensor group: %s", e)

    def _generate(self, job):
        """(token, logprobs [vocab]) of `job` through the group, and the prompt tokens
        restored from the prompt cache: a draft's loop over the group
        (`net.session.speculative_run`), or the session's prefill (`tensor.prefill.open_request`,
        with or without a prompt cache: its chunks end at the policy's points, so a reply from a
        snapshot is bit for bit the cache-free one) and mlx-lm's `generate_step` from the last prompt
        token with the job's sampler and logits processors (`net.session.generate`)."""
        from kimi_mlx.cluster.net.session import generate, speculative_run
        from kimi_mlx.cluster.tensor.step import GroupTarget

        if self.speculates(job):
            return self._speculate(job, lambda spec: generate(
                lambda: GroupTarget(self.model, self.group, len(job.ids) - 1, record=True),
                job.ids, job.max_tokens, run=speculative_run(
                    job.ids, spec.draft, num_draft_tokens=spec.num_draft_tokens,
                    max_tokens=job.max_tokens, sampling=job.sampling, stats=spec.stats))), 0
        target = self._open_request(job)
        return self._decode(job, target), target.cached

    def _decode(self, job, target):
        from kimi_mlx.cluster.net.session import generate

        return generate(target, job.ids, job.max_tokens, sampler=job.sampling.sampler(),
                        logits_processors=job.logits_processors)

    def _open_request(self, job):
        """`tensor.prefill.open_request` for `job` (restore, snapshots, image rows)."""
        from kimi_mlx.cluster.tensor.prefill import open_request

        media = None
        if job.images and self.pad_id in job.ids[:-1]:
            def media():  # the tower, on rank 0, when pads are left after the restore
                import mlx.core as mx

                rows = self.vision.features(job.images)
                mx.eval(rows)
                return rows

            media.pad_id = self.pad_id
        return open_request(self.model, self.group, job.ids, key=job.cache_key,
                            index=self.prompt_cache, store=self.store,
                            segment_ends=job.segment_ends, media=media,
                            count=self.count_lookup)

    def _score(self, job, tic: float):
        """Score the prompt of a job with `score` (`tensor.step.score_prompt`: its logits
        on rank 0, scored as one process scores them); returns the generator of its reply,
        or None when it is score only (finished here). A scored request decodes plainly
        (no draft: the prompt is already in the group's caches)."""
        from kimi_mlx.cluster.tensor.step import score_prompt
        from kimi_mlx.server.scoring import finish_scored

        job.prompt_scores, target = score_prompt(self.model, self.group, job.ids, job.score)
        if job.max_tokens == 0:
            target.end()
            finish_scored(job, tic, self.metrics)
            return None
        return self._decode(job, target)

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
                        cache_bytes=None, cache_dir=None, cache_disk_bytes: int = 0,
                        retry: float = 0.5, context: int = 4096) -> TensorEngine:
    """Form the group (`tensor.launch.form_group` over `cluster`, a `net.nodes.NodeFinder`:
    rank 0 this head's child process (`tensor.relay`), the nodes' ranks started through
    `StartRank`; `backend` "auto", "ring" or "jaccl") and start a `TensorEngine` on it
    (`max_queue` waiting requests; `max_concurrency` sequences decoded together, one
    with a draft) that
    forms it again after a loss (every `retry` s; --replan from `net.nodes.NodeSettings`: over
    fewer nodes only when the model splits and fits there for `context` tokens,
    `tensor.launch.check_fits`). `prompt_cache`: this head's `HeadCacheIndex` (None: no
    prompt cache; a draft turns it off); rank 0's own snapshots are kept by its child
    process, bounded by `cache_bytes` (None: `prompt_cache.default_cache_bytes` there;
    the nodes' ranks take their node's `cluster serve --cache-bytes`), with a disk tier
    in `cache_dir` of at most `cache_disk_bytes` (`cluster server --prompt-cache-dir`; the
    nodes' ranks take their node's). Every rank wires memory (`placement.wired.rank_plan`)
    for `context` tokens x the sequences decoded together. Raises what `form_group` raises (the server then
    ends, naming it)."""
    from kimi_mlx.cluster.tensor.group import TensorGroup
    from kimi_mlx.cluster.tensor.launch import check_fits, form_group

    batched = max_concurrency > 1 and (speculation is None or _batches(speculation))
    cached = prompt_cache is not None and (speculation is None or batched)
    rank0_cache = (dict(cache_bytes=cache_bytes, cache_dir=cache_dir, disk_bytes=cache_disk_bytes)
                   if cached else None)
    # every rank wires memory for the caches it will hold: `context` tokens x the rows
    # decoded together (`TensorEngine`: max_concurrency when batched, else one)
    plan = (context, max(1, int(max_concurrency)) if batched else 1)

    def form(excluded, epoch, cancelled=lambda: False):
        cluster.excluded = set(excluded)
        watch = TensorGroup(cluster.settings.peer_timeout, exit=lambda code: None)
        check = ((lambda accepted: check_fits(cluster.model_dir, accepted, context))
                 if excluded else None)
        transport, group, model = form_group(cluster, watch, backend, relay=True, epoch=epoch,
                                             check=check, cancelled=cancelled, store=rank0_cache,
                                             plan=plan)
        ranks = [(i + 1, name) for i, name in enumerate(watch.names)]
        return transport, group, model, watch, ranks

    def probe(nodes):
        from kimi_mlx.cluster.net.control import ControlClient
        from kimi_mlx.cluster.net.nodes import check_nodes

        t, channels = ControlClient(cluster.secret, cluster.settings.tls_secret_path), []

        def stub_for(address):  # a new channel per probe: no reconnect backoff to wait out
            from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc

            channels.append(t.channel_for(address))
            return pb_grpc.StageStub(channels[-1])

        try:
            return check_nodes(nodes, stub_for, cluster.fp, timeout=1.0,
                               check_version=cluster.settings.check_version,
                               name=cluster.model_dir.name)
        finally:
            for ch in channels:
                ch.close()

    transport, group, model, watch, ranks = form(set(), 0)
    if max_concurrency != 1 and speculation is not None and not batched:
        log.warning("--parallel tensor with a draft serves one request at a time (speculative "
                    "decoding runs one sequence); others queue")
    log.warning("serving through a tensor-parallel group of %d: rank 0 this head's rank "
                "process (pid %d), %s", group.size(), group.proc.pid,
                ", ".join(f"rank {r} node {n}" for r, n in ranks))
    if cached:
        store = group.store
        log.warning("prompt cache on every rank; rank 0 (this head's rank process) keeps up "
                    "to %.1f GB%s", (store.max_bytes if store is not None else 0) / 1e9,
                    " (and a disk tier)" if store is not None and store.disk else "")
        if store is None:
            prompt_cache = None
    return TensorEngine(group, model, watch, transport, eos_ids, max_queue, metrics,
                        speculation, ranks, prompt_cache if cached else None, reform=form, probe=probe,
                        replan=cluster.settings.replan, retry=retry,
                        max_concurrency=max_concurrency).start()


def _batches(speculation) -> bool:
    from kimi_mlx.speculative.batch import batches_drafts

    return batches_drafts(speculation.draft)
