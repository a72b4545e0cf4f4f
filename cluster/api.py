"""`kimi-mlx cluster server`: the OpenAI + Anthropic API of `kimi-mlx server` with the
pipeline behind it.

`ClusterEngine` has the server engine's interface (`submit(job)`, `queue_length`,
`active`, `health()`): each of up to `max_concurrency` worker threads runs one request as
its own pipeline session (`head.Pipeline.generate_step`), so different stages work on
different requests at once (pipeline fill). With `batch`, the sessions' decode steps
go through the stages together, one message per step (`head.Batcher`), each stage
running them as one batched forward pass (`runner.StageRunner.run_rows`). Past
`max_queue` waiting requests the API answers 503 + Retry-After. A lost stage fails the
requests on it (never retried on another placement), and /health reports it (503,
naming the stage and node) within seconds, even when idle; the
`recovery.PipelineKeeper` then reloads the stage when its node answers again, or
re-plans over the nodes left with `--replan`, and /health says which it is doing until
the pipeline serves again.

With a `prompt_cache.HeadCacheIndex`, each request starts from the longest prompt prefix
every stage still holds a snapshot of (asked with `CacheLookup` just before), and asks
the stages to snapshot at the one-process server's points (message ends, every N
tokens); `cached_tokens` reports the prefix restored (`cluster.prompt_cache`).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("kimi_mlx.cluster.api")


class ClusterEngine:
    """Runs server `Job`s through a loaded `Pipeline` (see module doc)."""

    # presence/frequency penalties and logit_bias are applied at the head (`head_chooser`);
    # repetition_penalty is not: it scales raw logits by their sign, and the last stage
    # returns only log-probabilities (a 400 names this)
    supports_logits_processors = True
    unsupported_penalties = ("repetition_penalty",)

    def __init__(self, pipeline, eos_ids: Sequence[int], max_concurrency: int = 4,
                 max_queue: int = 64, metrics=None, keeper=None, speculation=None,
                 model_args=None, prompt_cache=None, batch: bool = False):
        if speculation is not None and max_concurrency != 1:
            raise ValueError(f"speculative decoding serves one request at a time, not "
                             f"{max_concurrency}")
        self.speculation = speculation  # kimi_mlx.speculative.loop.Speculation (draft on the head)
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
        # cluster.prompt_cache.HeadCacheIndex: snapshots on the stages (None: every request
        # prefills its whole prompt; a draft decodes without it)
        self.prompt_cache = prompt_cache if speculation is None else None
        self._lookups = None
        if self.prompt_cache is not None and metrics is not None:
            from prometheus_client import Counter

            self._lookups = Counter(
                "kimi_mlx_cluster_prompt_cache_lookups", "requests that found remembered "
                "prompt prefixes, by result: hit (the longest restored on every stage), "
                "shorter (a stage had lost it: a shorter prefix all held), miss (none held "
                "by all: full prefill), refused (lost between lookup and open: full prefill)",
                ["result"], registry=metrics.registry)
        self.keeper = keeper  # recovery.PipelineKeeper (None: a loss is final)
        self.eos_ids = set(eos_ids)
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.metrics = metrics
        self.lost: Optional[str] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._active = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, name=f"kimi-mlx-session-{i}",
                                          daemon=True) for i in range(max_concurrency)]
        # images: the head's vision tower (generation.images.Vision, loaded on the first
        # image) and <|media_pad|> id, set by the server for a checkpoint with vision weights
        self.vision = None
        self.pad_id = None
        self._vision_lock = threading.Lock()

    def images_unsupported(self) -> Optional[str]:
        """Why this engine cannot take a request with images, or None when it can."""
        if self.vision is None:
            return "this model has no vision weights, so it cannot take images"
        if self.speculation is not None:
            return ("images do not work with speculative decoding yet (this server runs "
                    "with a draft)")
        return None

    def _media(self, job):
        """`Pipeline.generate_step`'s media for a job with images (the tower runs here,
        on the head), else None."""
        if not job.images:
            return None
        from kimi_mlx.cluster.head import media_rows

        return media_rows(self.vision, job.images, self.pad_id, self._vision_lock)

    @property
    def pipeline(self):
        """The pipeline requests start on now (the keeper's, after a recovery)."""
        return self.keeper.pipeline if self.keeper is not None else self._pipeline

    def start(self) -> "ClusterEngine":
        for t in self._threads:
            t.start()
        if self.keeper is not None:
            self.keeper.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.keeper is not None:
            self.keeper.stop(timeout)
        if self._batcher is not None:
            self._batcher.close()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)

    @property
    def queue_length(self) -> int:
        return self._jobs.qsize()

    @property
    def active(self) -> int:
        return self._active

    def health(self) -> Optional[str]:
        """None while every stage serves; else which stage was lost (and, with a keeper,
        what it is doing about it)."""
        return self.keeper.status() if self.keeper is not None else self.lost

    def stages(self) -> list:
        """The pipeline's stages for /health: [{"index", "node", "address", "layers":
        [start, end], "ok", "reason"}]; a lost stage has ok False and why."""
        t = self.pipeline.transport
        lost = getattr(t, "lost", {}) or {}
        return [{"index": i, "node": a.node.node_id, "address": a.node.address,
                 "layers": [a.start, a.end], "ok": i not in lost, "reason": lost.get(i)}
                for i, a in enumerate(getattr(t, "stages", []))]

    def submit(self, job):
        from kimi_mlx.server.jobs import Busy, enqueue

        down = self.health()
        if down:
            raise Busy(f"the pipeline is down ({down})")
        return enqueue(self._jobs, job, self.max_queue, self.max_concurrency, self._active)

    def _worker(self) -> None:
        from kimi_mlx.server.jobs import run_mlx_thread

        run_mlx_thread(self._serve)

    def _serve(self) -> None:
        from kimi_mlx.server.jobs import Failed, reseed_random

        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._active += 1
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - the error goes to this request only
                from kimi_mlx.cluster.transport import StageFailure

                if isinstance(e, StageFailure) and e.lost:
                    if self.keeper is not None:
                        self.keeper.check()
                    else:
                        self.lost = f"stage lost: {e}"
                log.exception("pipeline generation failed")
                job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                reseed_random()  # head-side sampling shares this process's random state
            finally:
                with self._lock:
                    self._active -= 1

    def _run(self, job) -> None:
        from kimi_mlx.server.jobs import Started, cancelled_in_queue, stream_to_job

        from kimi_mlx.cluster.runner import Sampling

        if cancelled_in_queue(job, self.metrics):
            return
        p = job.sampling
        want_lp = job.logprobs is not None
        choose = head_chooser(job) if job.logits_processors else None
        # with head-side sampling the last stage samples greedily, and its token is unused
        sampling = Sampling() if choose else Sampling(p.temp, p.top_p, p.min_p, p.top_k, p.seed)
        tic = time.perf_counter()
        start = {"cached": 0}
        if self.speculation is not None and not job.logits_processors:
            gen = self._speculate(job)
        elif self.prompt_cache is not None:
            gen = self._cached_generate(job, sampling, want_lp or choose is not None, choose,
                                        start)
        else:
            extra = {"batcher": self.batcher()} if self.batch else {}
            media = self._media(job)
            if media is not None:
                extra["media"] = media
            gen = self.pipeline.generate_step(job.ids, sampling, job.max_tokens,
                                              return_logprobs=want_lp or choose is not None,
                                              choose=choose, **extra)
        # the restored prefix is known once the stages took the session (a refused
        # snapshot means a full prefill): Anthropic's message_start waits for Started, so
        # its usage is the one message_delta repeats; closing `gen` ends the session on
        # every stage
        stream_to_job(job, gen, self.eos_ids, tic, self.metrics, cached=lambda: start["cached"],
                      on_first=lambda: job.emit(Started(start["cached"])))

    def _batched(self):
        b = self._batcher
        return (self._steps_done[0] + (b.steps if b else 0),
                self._steps_done[1] + (b.rows if b else 0))

    def batcher(self):
        """The `head.Batcher` of the current pipeline (None without batching); a new
        pipeline (after a recovery) gets a new one."""
        if not self.batch:
            return None
        from kimi_mlx.cluster.head import Batcher

        with self._lock:
            pipeline = self.pipeline
            if self._batcher_of is not pipeline:
                if self._batcher is not None:
                    self._batcher.close()
                    self._steps_done[0] += self._batcher.steps
                    self._steps_done[1] += self._batcher.rows
                self._batcher, self._batcher_of = Batcher(pipeline.transport), pipeline
            return self._batcher

    def _restore_point(self, ids):
        """((key, n) of the longest remembered prefix of ids that every stage still holds,
        or None; n, 0 without one), counted in /metrics."""
        cands = self.prompt_cache.candidates(ids)
        if not cands:
            return None, 0
        held = set(self.pipeline.transport.cache_lookup([k for _, k in cands]) or ())
        for i, (n, key) in enumerate(cands):
            if key in held:
                self._count("hit" if i == 0 else "shorter")
                return (key, n), n
        self._count("miss")
        return None, 0

    def _count(self, result: str) -> None:
        if self._lookups is not None:
            self._lookups.labels(result).inc()

    def _cached_generate(self, job, sampling, return_logprobs, choose, start):
        """`Pipeline.generate_step` from the longest prefix the stages hold, taking
        snapshots where the policy says (`HeadCacheIndex.plan`); start["cached"] = prompt
        tokens restored. A stage that lost the snapshot since the lookup refuses the
        session before any token: then the prompt is prefilled in full, on the same
        pipeline."""
        from kimi_mlx.cluster.prompt_cache import CACHE_MISS
        from kimi_mlx.cluster.transport import StageFailure

        key = job.cache_key  # the ids, with image pads tagged by their image's digest
        restore, cached = self._restore_point(key)
        media = self._media(job)
        extra = {} if media is None else {"media": media}
        while True:
            start["cached"] = cached
            snaps = self.prompt_cache.plan(key, cached, job.segment_ends)
            gen = self.pipeline.generate_step(job.ids, sampling, job.max_tokens,
                                              return_logprobs=return_logprobs, choose=choose,
                                              restore=restore, snapshots=snaps,
                                              batcher=self.batcher(), **extra)
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
                self._count("refused")
                restore, cached = None, 0
            finally:
                gen.close()

    def _speculate(self, job):
        """(token, logprobs [vocab]) of `job` by speculative decoding through the pipeline
        (`cluster.speculative.speculative_pipeline_step`: the draft on this head, each
        verify step one message through the stages), with the job's sampling; greedy
        output is the plain output token for token. A seeded request seeds MLX's global
        PRNG, which only this one sequence uses (one request at a time)."""
        import mlx.core as mx

        from kimi_mlx.speculative.loop import Sampling

        from kimi_mlx.cluster.speculative import speculative_pipeline_step

        spec, p = self.speculation, job.sampling
        if p.seed is not None:
            mx.random.seed(p.seed)
        st = spec.stats
        before = (st.steps, st.drafted, st.accepted)
        gen = speculative_pipeline_step(
            self.pipeline, job.ids, spec.draft, self.model_args,
            num_draft_tokens=spec.num_draft_tokens, max_tokens=job.max_tokens,
            sampling=Sampling(p.temp, p.top_p, p.min_p, p.top_k), stats=st)
        try:
            for tok, lp, _from_draft in gen:
                yield tok, lp
        finally:
            gen.close()
            if self.metrics is not None:
                self.metrics.speculated(st.steps - before[0], st.drafted - before[1],
                                        st.accepted - before[2])


def head_chooser(job):
    """Head-side sampling for a job with logits processors (`Pipeline.generate_step`'s
    `choose`): logprobs float32 [vocab] from the last stage -> (token, processed logprobs).

    As mlx-lm's `generate_step` (which the one-process server runs from the last prompt
    token): the processors see the last prompt token plus the tokens generated so far,
    then the result is normalised (logits - logsumexp) and the job's sampler draws. Only
    processors that add to the logits may run here (presence / frequency penalties,
    logit_bias): for those, log-probabilities give the same distribution as logits."""
    import mlx.core as mx

    sampler = job.sampling.sampler()
    history = mx.array(job.ids[-1:])

    def choose(logprobs):
        nonlocal history
        x = mx.array(logprobs)[None]
        for proc in job.logits_processors:
            x = proc(history, x)
        x = x - mx.logsumexp(x, keepdims=True)
        token = sampler(x)
        history = mx.concatenate([history, token.astype(history.dtype)])
        return token.item(), x[0]

    return choose


def make_keeper(args, cluster, fp: str, pipeline):
    """A `recovery.PipelineKeeper` for the server's pipeline: it reconnects through
    `cluster.connect()` (the launcher's discovery, checks, plan and load) with the nodes
    it excludes, and asks lost nodes for the checkpoint `fp` with `head.check_nodes`."""
    from kimi_mlx.cluster import stage_pb2_grpc as pb_grpc
    from kimi_mlx.cluster.head import check_nodes
    from kimi_mlx.cluster.recovery import PipelineKeeper

    def reconnect(excluded):
        cluster.excluded = set(excluded)
        return cluster.connect()

    def probe(nodes):
        t, channels = cluster.transport, []

        def stub_for(address):
            channels.append(t.channel_for(address))
            return pb_grpc.StageStub(channels[-1])

        try:
            return check_nodes(nodes, stub_for, fp, check_version=not args.allow_version_mismatch,
                               channel_for=t.channel_for)
        finally:
            for ch in channels:
                ch.close()

    return PipelineKeeper(pipeline, reconnect, probe, replan=args.replan)


def add_arguments(q) -> None:
    """Flags of `kimi-mlx cluster server`: the model, `cluster launch`'s node flags (added
    by the caller) and the HTTP flags of `kimi-mlx server`."""
    from kimi_mlx.server.serving import add_server_arguments

    q.add_argument("--model", default=None,
                   help="checkpoint folder (default: the shipped micro model); the nodes "
                        "need the same files")
    from kimi_mlx.generation.request import add_draft_arguments, add_mtp_argument

    add_server_arguments(q, log_level=False)
    q.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight through the pipeline at once (default 4, or 1 "
                        "with --draft-model or --draft, the only value allowed there)")
    q.add_argument("--no-prompt-cache", action="store_true",
                   help="prefill every prompt in full (default: the stages keep snapshots "
                        "of their caches, bounded by each stage's `cluster serve "
                        "--cache-bytes`, and a request restores the longest prefix all hold)")
    q.add_argument("--no-batch", action="store_true",
                   help="one message per request per token (default: the decode steps of the "
                        "requests in flight go through the stages as one batched message)")
    q.add_argument("--prompt-cache-every", type=int, default=1024,
                   help="also snapshot every this many prefill tokens, besides message ends "
                        "(default 1024; 0 = message ends only)")
    add_draft_arguments(q, note=" (loaded on this head, which drafts; the stages verify): "
                        "one request at a time, every request speculatively (requests with "
                        "penalties or logit_bias decode plainly)", mtp=True)
    add_mtp_argument(q, kinds=("ngram",))  # --draft ngram: prompt lookup on the head


def run(args, cluster_factory, tokenizers, choose_parallel=None) -> int:
    """`kimi-mlx cluster server`: start HTTP at once, connect and load the pipeline in the
    background (/health answers 503 until then); when that fails the command ends with
    status 1, naming what failed (`kimi_mlx.server.serving.serve`).

    cluster_factory(args, secret, model_dir, fingerprint, context) -> object with
    `connect()` -> Pipeline and `transport`; tokenizers(model_dir) -> (wrapper, tok);
    choose_parallel(cluster) -> "pipeline" | "tensor" (None: the pipeline): with "tensor"
    the requests run through one tensor-parallel group (`cluster.tensor_server`)."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.request import (InputError, generation_defaults, resolve_model_arg,
                                             serving_context)
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import (check_draft_server_arguments, check_server_arguments,
                                         make_service, resolve_api_key, serve)

    from kimi_mlx.cluster.auth import AuthError, load_secret
    from kimi_mlx.cluster.fingerprint import FingerprintError, fingerprint, is_checkpoint

    try:
        check_draft_server_arguments(args)  # first: it fills in --max-concurrency's default
        check_server_arguments(args)
        if args.prompt_cache_every < 0:
            raise InputError(f"--prompt-cache-every must be >= 0, got {args.prompt_cache_every}")
        spec = resolve_model_arg(args.model)
        model_dir = Path(spec).expanduser()
        if not is_checkpoint(model_dir):
            raise InputError(f"{spec}: cluster server needs the checkpoint folder on this machine too")
        key = resolve_api_key(args)
        secret = load_secret(args.secret_file)
        margs = ModelArgs.from_config(read_config(model_dir))
        fp = fingerprint(model_dir)
        wrapper, tok = tokenizers(model_dir)
        defaults = generation_defaults(model_dir)
    except (InputError, FileNotFoundError, ValueError, AuthError, FingerprintError) as e:
        print(f"kimi-mlx cluster server: error: {e}", file=sys.stderr)
        return 2
    context = serving_context(margs.max_position_embeddings, args.max_kv_size)[0]
    args.sequences = args.max_concurrency
    args.context = args.context or context
    svc = make_service(spec, key, args.served_model_name, args.max_body_bytes)
    svc.wrapper, svc.tok, svc.context, svc.defaults = wrapper, tok, context, defaults
    svc.vocab_size = margs.vocab_size
    from kimi_mlx.server.images import image_settings

    # images: this head runs the tower (from the checkpoint folder here, on first use)
    svc.images = image_settings(model_dir, tok, read_config(model_dir), args.allow_image_urls,
                                args.max_images)
    cluster = cluster_factory(args, secret, model_dir, fp, args.context)

    def load():
        speculation = None
        if args.draft_model:  # before the stages load: a wrong draft fails fast
            from kimi_mlx.speculative.loop import Speculation, load_draft

            speculation = Speculation(load_draft(args.draft_model, wrapper, spec),
                                      args.num_draft_tokens)
        elif args.draft == "ngram":
            from kimi_mlx.speculative.loop import Speculation
            from kimi_mlx.speculative.ngram import NgramDraft

            speculation = Speculation(NgramDraft(args.ngram_max, args.ngram_min),
                                      args.num_draft_tokens)
        if choose_parallel is not None and choose_parallel(cluster) == "tensor":
            from kimi_mlx.cluster.tensor_server import start_tensor_engine

            svc.engine = start_tensor_engine(args, cluster, tok.eos_token_ids, svc.metrics,
                                             speculation)
            return
        pipeline = cluster.connect()
        keeper = make_keeper(args, cluster, fp, pipeline)
        from kimi_mlx.cluster.prompt_cache import HeadCacheIndex

        index = None if args.no_prompt_cache else HeadCacheIndex(args.prompt_cache_every)
        engine = ClusterEngine(pipeline, tok.eos_token_ids, args.max_concurrency,
                               args.max_queue, svc.metrics, keeper, speculation,
                               margs, index, batch=not args.no_batch)
        engine.vision, engine.pad_id = svc.images.vision, svc.images.pad_id
        svc.engine = engine.start()
        log.info("serving %s through the pipeline", svc.model_ids[0])

    def cleanup():
        if svc.engine is not None:
            svc.engine.stop(2.0)
        if cluster.transport is not None:
            cluster.transport.shutdown()

    return serve(svc, create_app(svc), args.host, args.port, args.log_level or "WARNING",
                 f"kimi-mlx cluster server (model {svc.model_ids[0]})",
                 "kimi-mlx cluster server", load, "loading the pipeline", cleanup)
