"""`kimi-mlx cluster server`: the OpenAI + Anthropic API of `kimi-mlx server` with the
pipeline behind it.

`ClusterEngine` has the server engine's interface (`submit(job)`, `queue_length`,
`active`, `health()`): each of up to `max_concurrency` worker threads runs one request as
its own pipeline session (`head.Pipeline.generate_step`), so different stages work on
different requests at once (pipeline fill). Past `max_queue` waiting requests the API
answers 503 + Retry-After. A lost stage fails the requests on it, and /health reports it
(503, naming the stage) until the server is restarted.
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
                 max_queue: int = 64, metrics=None):
        self.pipeline = pipeline
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

    def start(self) -> "ClusterEngine":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
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
        """None while every stage serves; else which stage was lost."""
        return self.lost

    def submit(self, job):
        from kimi_mlx.server.jobs import Busy, enqueue

        if self.lost:
            raise Busy(f"the pipeline is down ({self.lost})")
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
                    self.lost = f"stage lost: {e}"
                log.exception("pipeline generation failed")
                job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                reseed_random()  # head-side sampling shares this process's random state
            finally:
                with self._lock:
                    self._active -= 1

    def _run(self, job) -> None:
        import mlx.core as mx

        from kimi_mlx.server.jobs import Finished, Started, TokenOut, top_logprobs

        from kimi_mlx.cluster.runner import Sampling

        if job.cancelled.is_set():
            job.emit(Finished("cancelled", len(job.ids)))
            return
        job.emit(Started(0))
        p = job.sampling
        want_lp = job.logprobs is not None
        choose = head_chooser(job) if job.logits_processors else None
        # with head-side sampling the last stage samples greedily, and its token is unused
        sampling = Sampling() if choose else Sampling(p.temp, p.top_p, p.min_p, p.top_k, p.seed)
        tic = time.perf_counter()
        gen = self.pipeline.generate_step(job.ids, sampling, job.max_tokens,
                                          return_logprobs=want_lp or choose is not None,
                                          choose=choose)
        reason, n, prompt_tps, t_gen = "length", 0, 0.0, tic
        try:
            for tok, lp in gen:
                if n == 0:
                    t_gen = time.perf_counter()
                    prompt_tps = len(job.ids) / max(t_gen - tic, 1e-9)
                if job.cancelled.is_set():
                    reason = "cancelled"
                    break
                if tok in self.eos_ids:
                    reason = "stop"
                    break
                n += 1
                if want_lp:
                    chosen, top = top_logprobs(mx.array(lp), tok, job.logprobs)
                    job.emit(TokenOut(tok, chosen, top))
                else:
                    job.emit(TokenOut(tok))
        finally:
            gen.close()  # ends the session on every stage
        dt = time.perf_counter() - t_gen
        done = Finished(reason, len(job.ids), 0, n, prompt_tps, n / dt if dt > 0 else 0.0)
        if self.metrics is not None:
            self.metrics.finished(done)
        job.emit(done)


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


def add_arguments(q) -> None:
    """Flags of `kimi-mlx cluster server`: the model, `cluster launch`'s node flags (added
    by the caller) and the HTTP flags of `kimi-mlx server`."""
    from kimi_mlx.server.serving import add_server_arguments

    q.add_argument("--model", default=None,
                   help="checkpoint folder (default: the shipped micro model); the nodes "
                        "need the same files")
    add_server_arguments(q, log_level=False)
    q.add_argument("--max-concurrency", type=int, default=4,
                   help="requests in flight through the pipeline at once (default 4)")


def run(args, cluster_factory, tokenizers) -> int:
    """`kimi-mlx cluster server`: start HTTP at once, connect and load the pipeline in the
    background (/health answers 503 until then); when that fails the command ends with
    status 1, naming what failed (`kimi_mlx.server.serving.serve`).

    cluster_factory(args, secret, model_dir, fingerprint, context) -> object with
    `connect()` -> Pipeline and `transport`; tokenizers(model_dir) -> (wrapper, tok)."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.request import InputError, generation_defaults, resolve_model_arg
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import check_server_arguments, make_service, resolve_api_key, serve

    from kimi_mlx.cluster.auth import AuthError, load_secret
    from kimi_mlx.cluster.fingerprint import FingerprintError, fingerprint, is_checkpoint

    try:
        check_server_arguments(args)
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
    context = margs.max_position_embeddings
    if args.max_kv_size:
        context = min(context, args.max_kv_size)
    args.sequences = args.max_concurrency
    args.context = args.context or context
    svc = make_service(spec, key, args.served_model_name, args.max_body_bytes)
    svc.wrapper, svc.tok, svc.context, svc.defaults = wrapper, tok, context, defaults
    svc.vocab_size = margs.vocab_size
    cluster = cluster_factory(args, secret, model_dir, fp, args.context)

    def load():
        pipeline = cluster.connect()
        svc.engine = ClusterEngine(pipeline, tok.eos_token_ids, args.max_concurrency,
                                   args.max_queue, svc.metrics).start()
        log.warning("serving %s through %s", svc.model_ids[0], "the pipeline")

    def cleanup():
        if svc.engine is not None:
            svc.engine.stop(2.0)
        if cluster.transport is not None:
            cluster.transport.shutdown()

    return serve(svc, create_app(svc), args.host, args.port, args.log_level or "WARNING",
                 f"kimi-mlx cluster server (model {svc.model_ids[0]})",
                 "kimi-mlx cluster server", load, "loading the pipeline", cleanup)
