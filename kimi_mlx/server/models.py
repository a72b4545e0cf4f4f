"""Which checkpoint the one-process server holds: the catalog of models it may serve
(`--model NAME=PATH`, `--models-dir`, `--allow-models`), loading, idle unload
(`--idle-unload`, Ollama's `keep_alive`), reload on the next request and the swap to
another checkpoint a request names. One checkpoint is loaded at a time.

`ModelHolder` owns that state; one thread of its own ("kimi-mlx-models") does every
load and unload, so a request handler only waits. A generating request takes a lease
(`ModelHolder.acquire`) before its prompt is encoded (the tokenizer, context and images
are the loaded checkpoint's) and holds it until its last job ends (`Lease`, bound to the
request's jobs by `common.submit`). While a lease is held nothing unloads; a request for
another checkpoint waits until the leases of the loaded one end (new requests for the
loaded one wait behind it, first come first served, so neither starves), then the holder
unloads it and loads the other. A request that waits longer than `--model-wait`
seconds gets a 503 naming the model it waits for, with Retry-After.

Unloading frees what the checkpoint held, as mlx-lm frees a model it swaps
(ml-explore/mlx-lm#1757): the engine stops (its worker threads end, the prompt cache's
disk writes finish and its folder is released), every reference to the weights, the
draft, the vision tower and the prompt caches is dropped, `mx.clear_cache()` returns
MLX's buffer cache, and the wired limit goes back to what the process had before
(`placement.wired.restore`). The tokenizer stays (kilobytes, no MLX memory), so token
counting keeps answering. The disk tier of the prompt cache keys its folders by the
checkpoint's identity (`disk_cache.checkpoint_identity`), so A's snapshots come back
when A is loaded again and are never read by B.

Ollama's keep_alive (read by `catalog.parse_keep_alive`): the last request admitted
sets how long the model stays after the last lease ends; a request that sends none uses
the server's `--idle-unload` (default: stay loaded). What may be served, the flags and
the /v1/models listing are in `server.catalog`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger(__name__)

from kimi_mlx.server.catalog import DEFAULT, DEFAULT_WAIT_S, check_allowed

__all__ = ["ModelHolder", "Lease", "model_lease"]

# ------------------------------------------------------------------ leases


class Lease:
    """A request's hold on the loaded model: nothing unloads or swaps until it is
    released. Counted once for the handler (`done`) and once per job bound to it
    (`bind`, ended by the job's Finished / Failed); released when all have ended.
    Thread-safe (jobs end on the engine's worker thread)."""

    def __init__(self, holder: "ModelHolder", name: str, waited_s: float = 0.0):
        self.holder, self.name = holder, name
        self.waited_s = waited_s  # seconds the request waited for its model (a load, a swap)
        self._count = 1
        self._lock = threading.Lock()

    def bind(self, job) -> None:
        """Hold the model until `job` ends."""
        with self._lock:
            if self._count <= 0:  # a job queued after its handler returned: a caller's bug
                log.warning("a job was queued after its request let go of the model; "
                            "the model may unload under it")
                return
            self._count += 1
        job.on_end(self._drop)

    def done(self) -> None:
        """The handler is done submitting (its jobs, if any, still hold the model)."""
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self.holder._released()


@dataclass
class _Waiter:
    name: str
    since: float
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    failed: Optional[str] = None


@dataclass
class _Loaded:
    """What the holder knows of the loaded checkpoint."""

    name: str
    loaded_at: float  # time.time()
    weights_bytes: int = 0  # MLX memory the load added (mx.get_active_memory)
    extra: Dict[str, Any] = field(default_factory=dict)


class ModelHolder:
    """Loads, unloads and swaps the one checkpoint a `Service` serves (module doc).

    Args:
        svc: the `common.Service` whose engine, tokenizer, context and images a load
            fills in (through `load`) and an unload empties.
        checkpoints: name -> checkpoint folder / hub id (`catalog`), the first loaded at
            start.
        load: `load(svc, name, spec)`: loads checkpoint `spec` into `svc` (blocking, on
            the holder's thread); raises what loading raises.
        idle_unload: seconds without a request after which the model is unloaded (None:
            never), a request's keep_alive aside.
        wait_s: seconds a request waits for its model before a 503.
        allowed: names requests may use (None: all of `checkpoints`).
        metrics: the server's `Metrics` (its registry gets the load / unload figures).
        max_kv_size: --max-kv-size (the context a model not loaded is listed with).
    Raises:
        ValueError naming --allow-models for an allowed name not in `checkpoints`.
    """

    def __init__(self, svc, checkpoints: Dict[str, str], load: Callable[[Any, str, str], None],
                 idle_unload: Optional[float] = None, wait_s: float = DEFAULT_WAIT_S,
                 allowed: Optional[List[str]] = None, metrics=None,
                 max_kv_size: Optional[int] = None):
        if not checkpoints:
            raise ValueError("no model to serve")
        check_allowed(checkpoints, allowed)
        self.svc, self.checkpoints, self._load_fn = svc, dict(checkpoints), load
        self.allowed = list(allowed) if allowed else list(checkpoints)
        self.idle_unload = idle_unload
        self.wait_s = wait_s
        self.max_kv_size = max_kv_size
        self.current: Optional[_Loaded] = None
        self.busy: Optional[str] = None  # "loading NAME" / "unloading NAME"
        self.leases = 0
        self.keep: Optional[float] = idle_unload  # seconds after the last lease (None: forever)
        self.expires: Optional[float] = None  # time.time() of the next unload (None: none)
        self.ever_loaded: set = set()
        self._waiters: List[_Waiter] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._metrics(metrics)
        svc.models = self

    # ---------------------------------------------------------------- names

    @property
    def default(self) -> str:
        """The model loaded at start (the first allowed one)."""
        return self.allowed[0]

    def resolve(self, name: Optional[str]) -> str:
        """The allowed model `name` names (`name` itself, or without Ollama's ":latest";
        None: the loaded model, else the default). KeyError (message: the names served)
        when it names none."""
        if name is None:
            cur = self.current
            return cur.name if cur is not None else self.default
        for n in (name, name[:-len(":latest")] if name.endswith(":latest") else name):
            if n in self.allowed:
                return n
        raise KeyError(", ".join(repr(m) for m in self.allowed))

    @property
    def loaded_name(self) -> Optional[str]:
        """The model loaded and serving (None while nothing is, or during a load / unload)."""
        cur = self.current
        return cur.name if cur is not None and self.busy is None else None

    @property
    def held_name(self) -> Optional[str]:
        """The model whose weights are in memory (loaded, or being unloaded), or None."""
        cur = self.current
        return cur.name if cur is not None else None

    # ---------------------------------------------------------------- lifecycle

    def load_first(self) -> None:
        """Load the default model on the calling thread (the server's loader: a failure
        ends the command) and start the holder's thread."""
        self._do_load(self.default, "start")
        self._thread = threading.Thread(target=self._manage, name="kimi-mlx-models", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the holder's thread and the engine (server shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(30)
        if self.svc.engine is not None:
            self.svc.engine.stop()

    # ---------------------------------------------------------------- requests

    async def acquire(self, name: str, keep_alive: Any = DEFAULT) -> Lease:
        """Wait until `name` (an allowed name, `resolve`d) is loaded and take a lease on
        it; `keep_alive` (seconds, `FOREVER`, or `DEFAULT`: --idle-unload) sets how long
        it stays after the last lease ends.

        Raises `common.APIError`: 503 (overloaded, Retry-After) naming the model when it
        is not loaded within `wait_s`; 500 naming the model and the error when its load
        failed while this request waited."""
        from kimi_mlx.server.common import APIError

        w = _Waiter(name, time.monotonic(), asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._waiters.append(w)
            self._cond.notify_all()
        try:
            while True:
                w.event.clear()
                with self._cond:
                    if w.failed:
                        raise APIError(500, w.failed, "server_error", param="model")
                    if self._admits(w):
                        self._waiters.remove(w)
                        self.leases += 1
                        self.expires = None
                        self.keep = self.idle_unload if keep_alive is DEFAULT else keep_alive
                        return Lease(self, name, time.monotonic() - w.since)
                    doing = self.busy or (f"{self.current.name} finishing its requests"
                                          if self.current else "nothing loaded")
                left = w.since + self.wait_s - time.monotonic()
                if left <= 0:
                    retry = max(1, int(self.last_load_s or 5) + 1)
                    raise APIError(503, f"model {name!r} is not loaded yet after "
                                   f"{self.wait_s:g}s (--model-wait; now: {doing}); retry "
                                   "later", "overloaded_error", param="model",
                                   headers={"Retry-After": str(retry)})
                try:
                    await asyncio.wait_for(w.event.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._cond:
                if w in self._waiters:
                    self._waiters.remove(w)
                    self._cond.notify_all()

    def _admits(self, w: _Waiter) -> bool:
        """Under the lock: `w`'s model is loaded and no request for another one came
        before it."""
        if self.busy is not None or self.current is None or self.current.name != w.name:
            return False
        return not any(o.name != w.name and o.since < w.since for o in self._waiters)

    def _released(self) -> None:
        with self._cond:
            self.leases -= 1
            if self.leases == 0:
                self.expires = None if self.keep is None else time.time() + self.keep
            self._cond.notify_all()

    def unload_now(self, name: str) -> None:
        """Ollama's request with nothing to generate and keep_alive 0 (`ollama stop`):
        unload `name` once its leases end, if it is loaded."""
        with self._cond:
            if self.current is not None and self.current.name == name:
                self.keep = 0.0
                if self.leases == 0:
                    self.expires = time.time()
                self._cond.notify_all()

    # ---------------------------------------------------------------- the holder's thread

    def _wake_waiters(self) -> None:
        """Under the lock: let every waiting request look at the state again."""
        for w in self._waiters:
            try:
                w.loop.call_soon_threadsafe(w.event.set)
            except RuntimeError:  # its loop is closed: nobody waits on it any more
                pass

    def _manage(self) -> None:
        from kimi_mlx.server.jobs import run_mlx_thread

        run_mlx_thread(self._manage_loop)

    def _manage_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    step = self._next_step()
                    if step is not None:
                        break
                    timeout = None
                    if self.current is not None and self.leases == 0 and self.expires is not None:
                        timeout = max(0.0, self.expires - time.time())
                    self._cond.wait(timeout)
            kind, name = step
            try:
                if kind in ("idle", "swap") and self.current is not None:
                    self._do_unload(kind)
                if kind == "swap":
                    self._do_load(name, "reload" if name in self.ever_loaded else "swap")
            except Exception as e:  # noqa: BLE001 - the waiting requests get the error
                msg = f"loading model {name!r} failed: {type(e).__name__}: {e}"
                log.exception("loading model %r failed", name)
                with self._cond:
                    for w in self._waiters:
                        if w.name == name:
                            w.failed = msg
                    self._wake_waiters()

    def _next_step(self):
        """Under the lock: ("swap", name) to load `name` (unloading the current model
        first), ("idle", None) to unload, or None to wait."""
        if self.busy is not None or self.leases:
            return None
        cur = self.current.name if self.current is not None else None
        waiting = [w for w in self._waiters if not w.failed]
        if waiting:
            first = min(waiting, key=lambda w: w.since)
            if first.name != cur:
                return "swap", first.name
            self._wake_waiters()  # its model is loaded: it may go
            return None
        if cur is not None and self.expires is not None and time.time() >= self.expires:
            return "idle", None
        return None

    # ---------------------------------------------------------------- load / unload

    def _do_load(self, name: str, reason: str) -> None:
        import mlx.core as mx

        spec = self.checkpoints[name]
        with self._cond:
            self.busy = f"loading {name}"
        log.info("loading model %s (%s) from %s", name, reason, spec)
        before = mx.get_active_memory()
        t0 = time.perf_counter()
        try:
            self._load_fn(self.svc, name, spec)
        except BaseException:
            self._drop_references()
            with self._cond:
                self.busy = None
                self.current = None
            raise
        dt = time.perf_counter() - t0
        self.last_load_s = dt
        loaded = _Loaded(name, time.time(), max(0, mx.get_active_memory() - before))
        with self._cond:
            self.current, self.busy = loaded, None
            self.ever_loaded.add(name)
            self.expires = None if self.keep is None else time.time() + self.keep
            self._wake_waiters()
            self._cond.notify_all()
        if self._load_seconds is not None:
            self._load_seconds.labels(reason).observe(dt)
            self._last_load.set(dt)
            self._loaded_gauge.set(1)
        log.info("model %s loaded in %.2fs (%s of MLX memory)", name, dt,
                 _size(loaded.weights_bytes))

    def _do_unload(self, reason: str) -> None:
        import mlx.core as mx

        name = self.current.name
        with self._cond:
            self.busy = f"unloading {name}"
        t0 = time.perf_counter()
        before = mx.get_active_memory()
        log.info("unloading model %s (%s)", name, "idle" if reason == "idle" else
                 "another model was asked for")
        engine = self.svc.engine
        self.svc.engine = None
        try:
            if engine is not None:
                engine.stop()
        finally:  # whatever stop raised, the model is let go of and the holder goes on
            del engine
            self._drop_references()
            with self._cond:
                self.current, self.busy, self.expires = None, None, None
                self._cond.notify_all()
        if self._unloads is not None:
            self._unloads.labels(reason).inc()
            self._loaded_gauge.set(0)
        log.info("model %s unloaded in %.2fs: MLX active memory %s -> %s", name,
                 time.perf_counter() - t0, _size(before), _size(mx.get_active_memory()))

    def _drop_references(self) -> None:
        """Drop what the checkpoint held (engine, vision tower, their metrics), give MLX's
        buffer cache back and restore the wired limit."""
        import mlx.core as mx

        from kimi_mlx.placement.wired import restore

        svc = self.svc
        svc.engine = None
        svc.images = None
        if svc.metrics is not None and hasattr(svc.metrics, "forget_model"):
            svc.metrics.forget_model()
        gc.collect()
        mx.clear_cache()
        restore()

    # ---------------------------------------------------------------- what it reports

    last_load_s: Optional[float] = None

    def status(self, name: Optional[str]) -> Dict[str, Any]:
        """What /v1/models and /api/ps say of `name`: "state" (loaded, loading,
        unloading, unloaded), and while it holds memory (loaded, unloading) "size" (MLX active memory now,
        bytes: weights and caches), "weights_bytes" (what its load added), "loaded_at"
        and "expires_at" (time.time() of the next unload; None: not planned: in use
        with keep-alive forever, or no idle unload)."""
        import mlx.core as mx

        with self._cond:
            cur, busy, leases = self.current, self.busy, self.leases
            keep, expires = self.keep, self.expires
        if busy == f"loading {name}":
            return {"state": "loading"}
        if cur is None or cur.name != name:
            return {"state": "unloaded"}
        state = "unloading" if busy is not None else "loaded"
        if state == "unloading":
            expires = time.time()
        elif leases and keep is not None:
            expires = time.time() + keep  # as Ollama shows a model in use
        return {"state": state, "size": int(mx.get_active_memory()),
                "weights_bytes": cur.weights_bytes, "loaded_at": cur.loaded_at,
                "expires_at": expires}

    def context_of(self, name: str, max_kv_size: Optional[int] = None) -> Optional[int]:
        """The context (tokens) `name` serves: the loaded model's, else its config.json's
        max_position_embeddings (capped / raised by `max_kv_size`); None when it cannot
        be read (a hub id not downloaded)."""
        from kimi_mlx.generation.request import serving_context

        if self.loaded_name == name and self.svc.context:
            return self.svc.context
        cfg = _config(self.checkpoints[name])
        trained = (cfg.get("text_config") or cfg).get("max_position_embeddings")
        return serving_context(int(trained), max_kv_size)[0] if trained else None

    def has_vision(self, name: str) -> bool:
        """Whether checkpoint `name` has vision weights (read from its folder)."""
        from kimi_mlx.checkpoint.loader import has_vision

        p = Path(self.checkpoints[name])
        try:
            return p.is_dir() and has_vision(p)
        except (OSError, ValueError):
            return False

    def disk_bytes(self, name: str) -> int:
        """Bytes of `name`'s .safetensors files (0 for a hub id not in a folder)."""
        p = Path(self.checkpoints[name])
        return sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0

    # ---------------------------------------------------------------- metrics

    def _metrics(self, metrics) -> None:
        self._load_seconds = self._last_load = self._unloads = self._loaded_gauge = None
        if metrics is None:
            return
        from prometheus_client import Counter, Gauge, Histogram

        r = metrics.registry
        self._load_seconds = Histogram(
            "kimi_mlx_model_load_seconds", "seconds a model load took, by reason (start; "
            "reload: after an idle unload or a swap away; swap: a model not loaded before)",
            ["reason"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self._last_load = Gauge("kimi_mlx_model_last_load_seconds", "seconds the last "
                                "model load took", registry=r)
        self._unloads = Counter("kimi_mlx_model_unloads", "models unloaded, by reason (idle: "
                                "--idle-unload / keep_alive; swap: a request named another)",
                                ["reason"], registry=r)
        self._loaded_gauge = Gauge("kimi_mlx_model_loaded", "1 while a model is loaded",
                                   registry=r)


def _config(spec: str) -> dict:
    try:
        return json.loads((Path(spec) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class model_lease:
    """`async with model_lease(svc, name, keep_alive):` around a generating request:
    with a `ModelHolder` (`svc.models`), 404 for a name not served (`common.APIError`,
    in the route's error dialect), then `ModelHolder.acquire` (the wait, a 503 past
    --model-wait), the lease set for `common.submit` to bind the request's jobs to, and
    released for the handler on the way out. Without a holder (the cluster server) it
    does nothing: the route's own model check answers. `lease` is the held `Lease`."""

    def __init__(self, svc, name: Optional[str], keep_alive: Any = DEFAULT):
        self.svc, self.name, self.keep_alive = svc, name, keep_alive
        self.lease: Optional[Lease] = None
        self._token = None

    async def __aenter__(self) -> "model_lease":
        from kimi_mlx.server.common import LEASE, APIError

        holder = self.svc.models
        if holder is None:
            return self
        try:
            name = holder.resolve(self.name)
        except KeyError as e:
            raise APIError(404, f"model {self.name!r} not found; this server serves "
                           f"{e.args[0]} (GET /v1/models)", "not_found_error", "model") from None
        self.lease = await holder.acquire(name, self.keep_alive)
        self._token = LEASE.set(self.lease)
        return self

    async def __aexit__(self, *exc) -> None:
        from kimi_mlx.server.common import LEASE

        if self.lease is not None:
            LEASE.reset(self._token)
            self.lease.done()
