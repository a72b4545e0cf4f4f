"""The gRPC stage service (`kimi-mlx cluster serve`): one layer range, many sessions.

RPCs (stage.proto):

- `Health`: what the node is and holds (versions, memory, fingerprints, loaded range,
  live sessions).
- `Load`: load a layer range of the local checkpoint with the head's fingerprint, found
  in this node's own models folder; streams progress. Measures the bytes this process
  read from files while loading (Linux `/proc/self/io` rchar). One load at a time: a
  Load during another waits for it (heads starting together all succeed; those asking
  for the range just loaded are answered "already loaded").
- `Watch`: the head's lease: heartbeats every `heartbeat_s`, tokens from the last stage,
  session errors. When it ends (head gone, network down) every session of that head is
  freed.
- `Forward`: one session's chunks, in order. The stage checks each message (session,
  sequence number, position, dtype, shape, byte count: `runner.Refused`), runs its
  layers, and sends the result straight to the next stage on its own `Forward` stream
  (or, on the last stage, the sampled token to the head's `Watch`; for a speculative
  verify chunk, the logits of every position, see `runner`). A refused message
  ends that session with INVALID_ARGUMENT and a message naming this stage; other
  sessions and the service carry on. A session beyond `max_sessions` is refused with
  RESOURCE_EXHAUSTED naming the limit.
- `Forward` on a *batch* stream (`SessionOpen.batch`): each message carries `rows`, one
  decode position of each of several sessions of the same head (opened and prefilled on
  their own streams); the stage runs them as one batched forward pass
  (`runner.StageRunner.run_rows`) and the last stage sends each session its token.
- `Reset`: free sessions by id or by head.
- `CacheLookup`: which prompt-cache snapshots this stage holds (`prompt_cache`): a
  session may open from one (`SessionOpen.restore_key`; refused with "prompt cache
  miss" when it is gone), and a chunk may ask for one after it (`snapshot_key`). The
  LRU is bounded by `cache_bytes` and emptied by every new load.

Sessions of any number of heads run at once: each has its own caches, stream and
downstream call; their chunks are computed one at a time, in arrival order, on the
stage's one MLX thread (`compute`: no MLX on gRPC's threads, so a stage exits cleanly).
The service also serves gRPC reflection, so a head of another stage protocol can name
the protocol this node speaks.

No receive waits forever: a session idle for `idle_timeout` seconds is freed, gRPC
keepalive pings (every 2 s, 3 s timeout) drop connections to dead or frozen peers, a send
to a next stage that accepts nothing for `idle_timeout` seconds fails the session, and
every call has a deadline.
"""

from __future__ import annotations

import gc
import logging
import queue
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import grpc
import mlx.core as mx

from kimi_mlx.cluster import stage_pb2 as pb
from kimi_mlx.cluster import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.auth import ClientAuth, ServerAuth, channel_credentials, key_id, server_credentials, TLS_NAME
from kimi_mlx.cluster.compute import ComputeStopped, ComputeThread
from kimi_mlx.cluster.fingerprint import fingerprint, folder_state, named, scan
from kimi_mlx.cluster.prompt_cache import CACHE_MISS, StageCache, key_length
from kimi_mlx.cluster.runner import Refused, Sampling, Session, StageRunner, StageSpec, default_compute_dtype, load_stage
from kimi_mlx.cluster.jaccl import local_report_json
from kimi_mlx.cluster.tensor import RankProcess, TensorSetupError, available_backends, check_rank_request
from kimi_mlx.cluster.wire import (ACTIVATION_DTYPES, PROTOCOL_VERSION, WireError, build_id, check_session_id,
                   from_tensor, package_versions, to_tensor)

log = logging.getLogger("kimi_mlx.cluster.service")

DEFAULT_MAX_MESSAGE = 256 << 20
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
STAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name  # "kimimlx.stage.v1.Stage"
ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


def channel_options(max_message: int = DEFAULT_MAX_MESSAGE):
    """gRPC channel options shared by the head and stages: message bounds, keepalive."""
    return [("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.enable_retries", 0)] + KEEPALIVE_OPTIONS


def make_channel(address: str, secret: bytes, tls_secret_path: Optional[Path] = None,
                 max_message: int = DEFAULT_MAX_MESSAGE) -> grpc.Channel:
    """An authenticated channel to a stage (TLS when `tls_secret_path` is given)."""
    options = channel_options(max_message)
    if tls_secret_path is not None:
        options.append(("grpc.ssl_target_name_override", TLS_NAME))
        ch = grpc.secure_channel(address, channel_credentials(tls_secret_path), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, ClientAuth(secret))


def rchar() -> int:
    """Bytes this process has read through read()/pread() so far (-1 when unknown)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class DownstreamLost(RuntimeError):
    """The next stage failed, refused, or stopped accepting messages."""


class SessionLimit(Refused):
    """The session table is full (answered with RESOURCE_EXHAUSTED)."""


@dataclass
class _Watcher:
    head: str
    q: "queue.Queue" = field(default_factory=queue.Queue)
    closed: bool = False


class _Live:
    """A session being served: runner state + its RPC context + its downstream link."""

    def __init__(self, session: Session, context, peer: str):
        self.session = session
        self.context = context
        self.peer = peer
        self.down: Optional[_Downstream] = None
        self.freed = False
        self.last_active = time.monotonic()
        self.batch = False  # a stream of batched decode steps (no state of its own)

    @property
    def id(self) -> str:
        return self.session.session


class _Downstream:
    """This session's `Forward` call to the next stage (a bounded send queue, a reader)."""

    def __init__(self, service: "StageService", live: _Live, address: str):
        self.service, self.live, self.address = service, live, address
        self.q: "queue.Queue" = queue.Queue(maxsize=8)
        self.error: Optional[str] = None
        self.cancelled = False
        self.done = threading.Event()
        self.call = service.stub(address).Forward(self._requests(), timeout=service.stream_deadline)
        self.thread = threading.Thread(target=self._read, daemon=True,
                                       name=f"down-{live.id}")
        self.thread.start()

    def _requests(self):
        while True:
            m = self.q.get()
            if m is None:
                return
            yield m

    def _read(self):
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as e:
            if not self.cancelled:
                self.error = f"next stage at {self.address}: {e.code().name}: {e.details()}"
                self.service._downstream_failed(self.live, self.error)
        finally:
            self.done.set()

    def send(self, msg, timeout: float) -> None:
        """Queue `msg` for the next stage; waits (bounded) while the queue is full, and
        gives up at once when the call fails or the session ends."""
        end = time.monotonic() + timeout
        while True:
            if self.error:
                raise DownstreamLost(self.error)
            if self.cancelled or self.live.freed:
                raise DownstreamLost("session ended")
            try:
                self.q.put(msg, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() > end:
                    raise DownstreamLost(f"next stage at {self.address} accepted nothing for "
                                         f"{timeout:.0f} s") from None

    def finish(self, timeout: float) -> None:
        """End the stream normally and wait (bounded) for the next stage to close it."""
        try:
            self.q.put(None, timeout=timeout)
        except queue.Full:
            self.cancel()
            return
        if not self.done.wait(timeout):
            self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self.call.cancel()


class StageService(pb_grpc.StageServicer):
    """The servicer; see the module doc. Construct via `StageServer`.

    `stage_loader` (class attribute, default None = `runner.load_stage`): what `Load`
    calls, `(path, spec, progress) -> (runner, report, tensor bytes)`; the hop bench's
    null stages (`cluster.hop_bench`) set it in a subclass. `load_bar` (None, or
    `(description) -> progress callback`, e.g. `checkpoint.loader.byte_bar`): a bar on the
    node's own terminal while a stage loads (`cluster serve` sets it unless --quiet).

    Args:
        node_id: this node's name. models_dir: where checkpoints may be loaded from.
        secret: cluster secret (for calls to the next stage).
        tls_secret_path: secret path whose .crt/.tls.key enable TLS, or None.
        idle_timeout: seconds a session may wait for its next message.
        heartbeat_s: Watch heartbeat interval. max_sessions: concurrent sessions.
        stream_deadline: deadline (s) of a Forward call to the next stage.
        usable_memory/bandwidth: overrides of the detected figures (bytes, bytes/s).
        cache_bytes: bound of the prompt-cache LRU (None: a quarter of the usable memory
            left after each load; 0: no prompt cache).
    """

    stage_loader = None
    load_bar = None

    def __init__(self, node_id: str, models_dir: Optional[Path], secret: bytes,
                 tls_secret_path: Optional[Path] = None, idle_timeout: float = 120.0,
                 heartbeat_s: float = 1.0, max_sessions: int = 16,
                 stream_deadline: float = 24 * 3600.0, max_message: int = DEFAULT_MAX_MESSAGE,
                 usable_memory: Optional[int] = None, bandwidth: Optional[int] = None,
                 cache_bytes: Optional[int] = None):
        from kimi_mlx.cluster.discovery import local_chip, local_memory

        self.node_id = node_id
        self.models_dir = Path(models_dir).expanduser() if models_dir else None
        self.secret = secret
        self.tls_secret_path = tls_secret_path
        self.idle_timeout = idle_timeout
        self.heartbeat_s = heartbeat_s
        self.max_sessions = max_sessions
        self.stream_deadline = stream_deadline
        self.max_message = max_message
        total, usable, self.wired_mb = local_memory()
        self.total_memory = total
        self.usable_memory = usable_memory if usable_memory is not None else usable
        self.chip, bw = local_chip()
        self.bandwidth = bandwidth if bandwidth is not None else bw
        # Import what a load uses now, so the bytes a load reads are checkpoint bytes only.
        import kimi_mlx.checkpoint.loader  # noqa: F401
        import kimi_mlx.model.model  # noqa: F401
        import mlx_lm.sample_utils  # noqa: F401

        self._folder_state = folder_state(self.models_dir)
        self.catalog: Dict[str, Path] = scan(self.models_dir)
        self.runner: Optional[StageRunner] = None
        self.spec: Optional[StageSpec] = None
        self.next_address = ""
        self.state = "idle"
        self.load_stats = (0, -1, 0.0)
        self.sessions: Dict[str, _Live] = {}
        self.cache_bytes = cache_bytes
        self.prompt_cache = StageCache(cache_bytes or 0)
        self.watchers: Dict[str, _Watcher] = {}
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()  # one load at a time; later Loads wait for it
        self.compute = ComputeThread(f"mlx-{node_id}"[:15])
        self._channels: Dict[str, grpc.Channel] = {}
        self._stop = threading.Event()
        self._janitor = threading.Thread(target=self._janitor_loop, daemon=True, name="janitor")
        self._janitor.start()

    # -- helpers -------------------------------------------------------------------------
    @property
    def who(self) -> str:
        """'stage i (node, layers [s, e))' for messages."""
        if self.spec is None:
            return f"node {self.node_id}"
        s = self.spec
        return f"stage {s.index} ({self.node_id}, layers [{s.start}, {s.end}))"

    def stub(self, address: str) -> pb_grpc.StageStub:
        """A stub to another stage on a cached authenticated channel."""
        with self.lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = make_channel(address, self.secret, self.tls_secret_path, self.max_message)
                self._channels[address] = ch
        return pb_grpc.StageStub(ch)

    def _event(self, kind, session="", seq=0, **kw) -> pb.Event:
        return pb.Event(kind=kind, session=session, seq=seq, node_id=self.node_id,
                        stage=self.spec.index if self.spec else -1, **kw)

    def _emit(self, head: str, ev: pb.Event) -> bool:
        w = self.watchers.get(head)
        if w is None or w.closed:
            return False
        w.q.put(ev)
        return True

    def _free(self, live: Optional[_Live], reason: str = "", cancel: bool = True) -> None:
        """Forget a session (idempotent). With a `reason`, also cancel its downstream call
        and, unless `cancel` is false (its own handler ends the RPC), its RPC."""
        if live is None:
            return
        with self.lock:
            if live.freed:
                return
            live.freed = True
            if self.sessions.get(live.id) is live:
                del self.sessions[live.id]
        if live.down is not None and reason:
            live.down.cancel()
        live.session.cache = []
        if reason:
            log.info("%s: freed session %s (%s)", self.who, live.id, reason)
        if reason and cancel:
            try:
                live.context.cancel()
            except Exception:  # already finished
                pass

    def _downstream_failed(self, live: _Live, error: str) -> None:
        if live.freed:
            return
        msg = f"{self.who}: {error}"
        log.warning("session %s: %s", live.id, msg)
        self._emit(live.session.head, self._event(pb.Event.ERROR, live.id, message=msg))
        self._free(live, "next stage failed")

    def _janitor_loop(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            for live in list(self.sessions.values()):
                idle = now - live.last_active
                if idle > self.idle_timeout:
                    msg = f"{self.who}: session {live.id} idle for {idle:.0f} s (upstream lost?)"
                    self._emit(live.session.head, self._event(pb.Event.ERROR, live.id, message=msg))
                    self._free(live, f"idle {idle:.0f} s")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the janitor, free every session, close channels, and end the MLX thread
        (its streams cleared, see `compute`; waits up to `timeout` s for a running chunk)."""
        self._stop.set()
        for live in list(self.sessions.values()):
            self._free(live, "service stopping")
        for w in list(self.watchers.values()):
            w.closed = True
        for ch in self._channels.values():
            ch.close()
        self.compute.stop(timeout)

    # -- RPCs ----------------------------------------------------------------------------
    def refresh_catalog(self) -> Dict[str, Path]:
        """Rescan the models folder when anything in it changed since the last scan
        (`folder_state`): checkpoints copied in after start are offered without a restart."""
        state = folder_state(self.models_dir)
        if state != self._folder_state:
            self._folder_state = state
            self.catalog = scan(self.models_dir)
        return self.catalog

    def Health(self, request, context):
        """HealthReply: versions, memory, the checkpoints in the models folder (rescanned
        when it changed), what is loaded, live sessions."""
        ours, mlx_version = package_versions()
        s = self.spec
        catalog = self.refresh_catalog()
        return pb.HealthReply(
            node_id=self.node_id, protocol=PROTOCOL_VERSION, version=ours,
            mlx_version=mlx_version, total_memory=self.total_memory,
            usable_memory=self.usable_memory, chip=self.chip, bandwidth=self.bandwidth,
            fingerprints=sorted(catalog), checkpoint_names=[catalog[fp].name for fp in sorted(catalog)],
            state=self.state,
            fingerprint=s.fingerprint if s else "", start=s.start if s else 0,
            end=s.end if s else 0, sessions=len(self.sessions),
            peak_memory=mx.get_peak_memory(), default_dtype=default_compute_dtype(),
            device="cpu" if mx.default_device() == mx.cpu else "gpu", key_id=key_id(self.secret),
            build=build_id(), backends=available_backends(),
            rdma_report=local_report_json(f"node {self.node_id}"),
        )

    def _resolve(self, fp: str) -> Path:
        path = self.catalog.get(fp)
        if path is None:  # checkpoints copied in since start
            self.catalog = scan(self.models_dir)
            path = self.catalog.get(fp)
        if path is None:
            have = ", ".join(named(f, self.catalog) for f in sorted(self.catalog))
            raise Refused(f"{self.who}: no checkpoint with fingerprint {fp} in "
                          f"{self.models_dir or '(no --models folder)'} (it has: {have or 'none'}); "
                          "copy it there: it is picked up without a restart")
        return path

    def _check_load(self, r) -> StageSpec:
        for name in (r.compute_dtype, r.wire_dtype or r.compute_dtype):
            if name not in ACTIVATION_DTYPES:
                raise Refused(f"dtype {name!r} is not one of {', '.join(ACTIVATION_DTYPES)}")
        if not 0 <= r.stage < r.num_stages:
            raise Refused(f"stage {r.stage} of {r.num_stages} is not a pipeline position")
        last = r.stage == r.num_stages - 1
        if last != (r.next_address == ""):
            raise Refused("the last stage has no next address, every other stage needs one")
        if r.next_address and not ADDRESS_RE.match(r.next_address):
            raise Refused(f"next address {r.next_address[:80]!r} is not host:port")
        return StageSpec(r.fingerprint, r.start, r.end, r.stage, r.num_stages,
                         r.compute_dtype, r.wire_dtype or r.compute_dtype)

    def Load(self, request, context):
        """Stream LoadProgress while loading the requested range of a local checkpoint
        (found by fingerprint in the models folder); INVALID_ARGUMENT for a bad request,
        FAILED_PRECONDITION when busy with another head's sessions (unless `force`).

        One load runs at a time: a Load that arrives while another is in progress says
        so (phase "waiting") and waits for it, then answers "already loaded" when that
        load was of the same range (several heads starting at once), or loads its own."""
        try:
            spec = self._check_load(request)
            path = self._resolve(request.fingerprint)
            from kimi_mlx.model.config import ModelArgs, read_config

            n = ModelArgs.from_config(read_config(path)).num_hidden_layers
            if not 0 <= spec.start < spec.end <= n:
                raise Refused(f"layers [{spec.start}, {spec.end}) are not inside [0, {n})")
        except Refused as e:
            log.warning("refused Load from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        waiting = False
        while not self.load_lock.acquire(timeout=0.2):
            if self._stop.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.who}: stopping")
            if not context.is_active():
                return
            if not waiting:
                waiting = True
                yield pb.LoadProgress(phase="waiting",
                                      message=f"{self.who}: waiting for a load in progress")
        try:
            heads = {l.session.head for l in self.sessions.values()}
            if self.sessions and (self.spec != spec or self.next_address != request.next_address):
                if not request.force:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{self.who}: busy with {len(self.sessions)} session(s) of "
                                  f"head(s) {', '.join(sorted(heads))}")
                for live in list(self.sessions.values()):
                    self._free(live, "replaced by a new load")
            if self.runner is not None and self.spec == spec:
                self.next_address = request.next_address
                self._set_positions(request.max_positions)
                tensor_bytes, disk, secs = self.load_stats
                yield pb.LoadProgress(bytes_done=1, bytes_total=1, phase="ready",
                                      message="already loaded", tensor_bytes=tensor_bytes,
                                      disk_read_bytes=disk, seconds=secs)
                return
            yield from self._load(spec, path, request.next_address, request.max_positions)
        finally:
            self.load_lock.release()

    def _set_positions(self, head_context: int) -> None:
        """The loaded runner's position limit: the model's max_position_embeddings, or a
        head's longer context (`kimi-mlx cluster server --max-kv-size` past it)."""
        if self.runner is not None:
            self.runner.max_positions = max(self.runner.args.max_position_embeddings,
                                            int(head_context))

    def _load(self, spec: StageSpec, path: Path, next_address: str, head_context: int = 0):
        self.state, self.runner, self.spec = "loading", None, None
        self.prompt_cache.clear()  # snapshots of the layers held before
        yield pb.LoadProgress(phase="resolving", message=str(path.name))
        if fingerprint(path) != spec.fingerprint:
            self.catalog = scan(self.models_dir)
            self.state = "idle"
            changed = f"{path}: files changed since they were advertised (fingerprint differs)"
            log.warning(changed)
            yield pb.LoadProgress(phase="error", message=changed)
            return
        events: "queue.Queue" = queue.Queue()
        t0, r0 = time.monotonic(), rchar()

        def work():  # on the MLX thread
            try:
                gc.collect()  # the previous layers' memory goes back before the new load
                mx.clear_cache()
                loader = self.stage_loader or load_stage
                bar = self.load_bar(f"loading {path.name} [{spec.start},{spec.end})") if self.load_bar else None

                def report(d, t):
                    events.put(("progress", d, t))
                    if bar:
                        bar(d, t)

                res = loader(path, spec, report)
                events.put(("done", res, rchar()))
            except Exception as e:  # CheckpointError, ConfigError, MLX errors
                events.put(("error", f"{type(e).__name__}: {e}", None))

        try:
            done = self.compute.submit(work)
        except ComputeStopped as e:
            self.state = "idle"
            yield pb.LoadProgress(phase="error", message=f"{self.who}: {e}")
            return
        while True:
            try:
                kind, a, b = events.get(timeout=0.5)
            except queue.Empty:
                if not done.cancelled():
                    continue
                kind, a, b = "error", "the stage is stopping", None  # never ran
            if kind == "progress":
                yield pb.LoadProgress(bytes_done=a, bytes_total=b, phase="reading",
                                      seconds=time.monotonic() - t0)
            elif kind == "error":
                self.state = "idle"
                log.error("%s: load failed: %s", self.who, a)
                yield pb.LoadProgress(phase="error", message=a)
                return
            else:
                runner, report, total = a
                disk = b - r0 if r0 >= 0 and b >= 0 else -1
                secs = time.monotonic() - t0
                self.runner, self.spec, self.next_address = runner, spec, next_address
                self._set_positions(head_context)  # before "ready": sessions may follow at once
                if self.cache_bytes is None:
                    self.prompt_cache.max_bytes = max(self.usable_memory - mx.get_active_memory(), 0) // 4
                self.load_stats = (report.bytes_loaded, disk, secs)
                self.state = "ready"
                log.info("%s: loaded %s in %.1f s (%d tensor bytes, %d bytes read from files)",
                         self.who, path, secs, report.bytes_loaded, disk)
                yield pb.LoadProgress(bytes_done=total, bytes_total=total, phase="ready",
                                      tensor_bytes=report.bytes_loaded, disk_read_bytes=disk,
                                      seconds=secs)
                return

    def Watch(self, request, context):
        """The head's lease: stream heartbeats, tokens and errors; frees the head's
        sessions when it ends."""
        head = request.head
        try:
            check_session_id(head)
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"head id: {e}")
        w = _Watcher(head)
        with self.lock:
            old = self.watchers.get(head)
            if old is not None:
                old.closed = True
            self.watchers[head] = w

        def ended():
            w.closed = True
            with self.lock:
                current = self.watchers.get(head) is w
                if current:
                    del self.watchers[head]
            if not current:  # replaced by a newer lease of the same head: it owns them
                return
            for live in list(self.sessions.values()):
                if live.session.head == head:
                    self._free(live, f"head {head} left")

        context.add_callback(ended)
        yield self._event(pb.Event.HEARTBEAT, peak_memory=mx.get_peak_memory())
        while context.is_active() and not w.closed and not self._stop.is_set():
            try:
                ev = w.q.get(timeout=self.heartbeat_s)
            except queue.Empty:
                ev = self._event(pb.Event.HEARTBEAT, peak_memory=mx.get_peak_memory())
            yield ev

    def StartRank(self, request, context):
        """Run this node's rank of a tensor-parallel group (`kimi_mlx.cluster.tensor`) for
        as long as the stream lasts: HEARTBEATs while it runs, one ERROR naming node and
        rank when it exits or is stopped; the rank is killed when the stream ends.
        FAILED_PRECONDITION (naming the node) when this node cannot run it."""
        try:
            path = self._resolve(request.fingerprint)
            check_rank_request(request, self.node_id)
        except (Refused, TensorSetupError) as e:
            log.warning("refused StartRank from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        rank = RankProcess(path, request.rank, request.size, request.backend, request.hosts,
                           self.node_id)
        context.add_callback(lambda: rank.kill("the head's lease ended: stream cancelled or "
                                               "its connection lost"))
        log.info("tensor rank %d of %d (%s) for head %s: started, pid %d", request.rank,
                 request.size, request.backend, request.head, rank.proc.pid)
        try:
            yield self._event(pb.Event.HEARTBEAT)
            beat = time.monotonic()
            while context.is_active() and not self._stop.is_set():
                why = rank.state()
                if why == "finished":  # after rank 0's last request: the group is done
                    yield self._event(pb.Event.CLOSED)
                    return
                if why is not None and rank.killed_by_node is not None:
                    return  # the lease ended first (this node killed it): nobody to tell
                if why is not None:
                    msg = f"rank {request.rank} on node {self.node_id} {why}"
                    log.warning("%s", msg)
                    yield self._event(pb.Event.ERROR, message=msg)
                    return
                if time.monotonic() - beat > 1.0:
                    beat = time.monotonic()
                    yield self._event(pb.Event.HEARTBEAT)
                time.sleep(0.2)
        finally:
            rank.kill("its StartRank stream ended")
            log.info("tensor rank %d: ended (%s)", request.rank,
                     rank.state() or "still running")

    def Reset(self, request, context):
        """Free sessions by id or by head; replies how many were freed and are left."""
        targets = [l for l in list(self.sessions.values())
                   if l.id in set(request.sessions) or (request.head and l.session.head == request.head)]
        for live in targets:
            self._free(live, "reset")
        return pb.ResetReply(freed=len(targets), sessions=len(self.sessions))

    def CacheLookup(self, request, context):
        """Which of the asked prompt-cache keys this stage holds (marks them used)."""
        if len(request.keys) > 65536:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.who}: {len(request.keys)} keys in one CacheLookup (at most 65536)")
        c = self.prompt_cache
        return pb.CacheLookupReply(held=c.held(request.keys), bytes=c.nbytes,
                                   max_bytes=c.max_bytes, entries=len(c), evictions=c.evictions)

    def _new_session(self, runner: StageRunner, o, sampling: Sampling) -> Session:
        """A session's state (on the MLX thread): fresh caches, or restored from the
        prompt-cache snapshot `o.restore_key` (CacheMiss when it is not held)."""
        session = runner.new_session(o.session, o.head, sampling, o.return_logprobs)
        if o.restore_key:
            cache = self.prompt_cache.restore(o.restore_key, o.restore_length)
            if cache is None:
                raise Refused(f"{self.who}: {CACHE_MISS}: no snapshot {o.restore_key} here "
                              "(evicted, or this stage restarted)")
            session.cache, session.offset = cache, o.restore_length
        return session

    def _open(self, first, context, runner: StageRunner) -> _Live:
        if not first.HasField("open") or first.seq != 0:
            raise Refused("the first message of a stream must open a session (seq 0 with open)")
        o = first.open
        try:
            check_session_id(o.session)
            check_session_id(o.head)
        except WireError as e:
            raise Refused(str(e)) from None
        if first.session != o.session:
            raise Refused(f"message for session {first.session!r} opens session {o.session!r}")
        self._check_plan(o, runner.spec)
        if o.batch and o.restore_key:
            raise Refused("a batch stream restores no prompt-cache snapshot")
        sp = o.sampling
        sampling = Sampling(sp.temp, sp.top_p if sp.top_p else 1.0, sp.min_p, sp.top_k,
                            sp.seed if sp.has_seed else None)
        if len(self.sessions) >= self.max_sessions:  # checked again below, under the lock
            raise self._full()
        if o.restore_key:
            try:
                n = key_length(o.restore_key)
            except ValueError as e:
                raise Refused(str(e)) from None
            if n != o.restore_length or not 0 < n < runner.max_positions:
                raise Refused(f"restore key {o.restore_key!r} holds {n} positions, the session "
                              f"says {o.restore_length}")
        if o.batch:  # its rows' sessions hold the state
            session = Session(o.session, o.head, sampling, False, [])
        else:
            session = self.compute.call(self._new_session, runner, o, sampling)
        with self.lock:
            if o.session in self.sessions:
                raise Refused(f"session {o.session} is already open here")
            if len(self.sessions) >= self.max_sessions:
                raise self._full()
            live = _Live(session, context, context.peer())
            live.batch = o.batch
            self.sessions[o.session] = live
        context.add_callback(lambda: self._free(live, "stream ended"))
        if not runner.is_last:
            live.down = _Downstream(self, live, self.next_address)
        return live

    def _check_plan(self, o, spec: StageSpec) -> None:
        """Refused unless the plan the session was opened for (`SessionOpen.bounds` and
        `fingerprint`, when sent) puts exactly this stage's layers here."""
        if not o.bounds and not o.fingerprint:
            return
        b = list(o.bounds)
        planned = (f"layers [{b[spec.index]}, {b[spec.index + 1]})"
                   if len(b) == spec.num_stages + 1 else f"a {max(len(b) - 1, 0)}-stage pipeline")
        if (planned != f"layers [{spec.start}, {spec.end})"
                or (o.fingerprint and o.fingerprint != spec.fingerprint)):
            raise Refused(f"session {o.session} was planned with {planned} of checkpoint "
                          f"{o.fingerprint or '?'} here, but this stage now holds layers "
                          f"[{spec.start}, {spec.end}) of {spec.fingerprint} as stage {spec.index} "
                          f"of {spec.num_stages} (another head loaded it since): load again")

    def _full(self) -> SessionLimit:
        return SessionLimit(f"{self.who}: session table full: {len(self.sessions)} sessions "
                            f"open, the limit is {self.max_sessions} (cluster serve "
                            "--max-sessions); try again when one ends")

    def _next(self, it):
        try:
            return next(it)
        except StopIteration:
            return None

    def Forward(self, request_iterator, context):
        """Serve one session's chunks in order (see the module doc); ends with a CLOSED
        event, or INVALID_ARGUMENT / UNAVAILABLE naming this stage and the reason."""
        runner = self.runner
        if runner is None or self.state != "ready":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.who}: no layers loaded")
        first = self._next(request_iterator)
        if first is None:
            return
        live, msg, code = None, first, grpc.StatusCode.INVALID_ARGUMENT
        try:
            live = self._open(first, context, runner)
            while msg is not None:
                if live.freed:
                    return
                live.last_active = time.monotonic()
                out = self.compute.call(self._process_and_pass, live, msg, runner)
                live.last_active = time.monotonic()
                if isinstance(out, pb.Activation):  # the queue was full: the MLX thread never waits
                    live.down.send(out, self.idle_timeout)
                elif isinstance(out, list):  # a batched step's tokens without a Watch
                    yield from out
                elif out is not None:
                    yield out  # no Watch from this head: answer on the stream itself
                msg = self._next(request_iterator)
            if live.down is not None:
                live.down.finish(self.idle_timeout)
            yield self._event(pb.Event.CLOSED, live.id)
        except (Refused, DownstreamLost, ComputeStopped) as e:
            if isinstance(e, SessionLimit):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            elif not isinstance(e, Refused):
                code = grpc.StatusCode.UNAVAILABLE
            if isinstance(e, SessionLimit):
                text = str(e)
            elif isinstance(e, Refused):
                text = f"{self.who} refused message seq {msg.seq} of session {msg.session!r}: {e}"
            else:
                text = f"{self.who}: {e}"
            log.warning("%s (from %s)", text, context.peer())
            head = live.session.head if live else (first.open.head if first.HasField("open") else "")
            self._emit(head, self._event(pb.Event.ERROR, msg.session, msg.seq, message=text))
            for r in msg.rows:  # a batched step: every row's session hears of it
                self._emit(head, self._event(pb.Event.ERROR, r.session, r.seq, message=text))
            self._free(live, "refused" if isinstance(e, Refused) else "next stage lost", cancel=False)
            context.abort(code, text)
        except grpc.RpcError:
            pass  # the upstream call ended (cancelled, reset, network): freed below
        finally:
            if live is not None and not live.freed:
                self._free(live, "" if context.is_active() else "stream ended", cancel=False)

    def _process_and_pass(self, live: _Live, msg, runner: StageRunner):
        """`_process`, then hand its result on from the MLX thread when that cannot wait:
        an Activation into the next stage's send queue if it has room, a TOKEN event to
        the head's Watch. Returns what is left for the stream's handler thread to send
        (a full queue: its bounded wait; no Watch: the stream's own answer), else None.
        Saves the handler thread's wake-up on the way to the next stage."""
        out = self._process(live, msg, runner)
        if isinstance(out, list):  # a batched step's tokens, one event per row session
            left = [ev for ev in out if not self._emit(live.session.head, ev)]
            return left or None
        down = live.down
        if isinstance(out, pb.Activation) and down is not None and not (down.error or down.cancelled):
            try:
                down.q.put_nowait(out)
                return None
            except queue.Full:
                return out
        if isinstance(out, pb.Event) and self._emit(live.session.head, out):
            return None
        return out

    def _process(self, live: _Live, msg, runner: StageRunner):
        """Check and run one chunk (on the MLX thread). Returns the Activation for the
        next stage, a TOKEN event (last stage, sampled chunk), or None."""
        s = live.session
        if live.freed:  # freed while queued: its caches are gone
            return None
        if live.batch or msg.rows:
            return self._process_rows(live, msg, runner)
        if msg.session != s.session:
            raise Refused(f"message for session {msg.session!r} on the stream of session {s.session!r}")
        if msg.seq != 0 and msg.HasField("open"):
            raise Refused("only seq 0 may open a session")
        keep = msg.keep if msg.HasField("keep") else None
        # Speculative fields go to the runner only when set: a runner that cannot verify
        # (the hop bench's null stages) keeps the plain signature.
        spec = dict(verify=True) if msg.verify else {}
        if keep is not None:
            spec["keep"] = keep
        runner.check(s, msg.seq, msg.offset, msg.length, msg.sample, **spec)
        shape, dtype = runner.input_spec(msg.length)
        try:
            x = from_tensor(msg.tensor, shape, dtype, "activation" if not runner.is_first else "tokens")
        except WireError as e:
            raise Refused(str(e)) from None
        if msg.snapshot_key:
            try:
                n = key_length(msg.snapshot_key)
            except ValueError as e:
                raise Refused(str(e)) from None
            if n != msg.offset + msg.length or msg.verify:
                raise Refused(f"snapshot key {msg.snapshot_key!r} holds {n} positions, but the "
                              f"chunk ends at {msg.offset + msg.length}"
                              + (" (and is a verify chunk)" if msg.verify else ""))
        if msg.HasField("media"):
            spec["media"] = self._media(msg, runner, x)
        out = runner.run(s, msg.seq, msg.offset, x, msg.sample, **spec)
        if msg.snapshot_key:
            self.prompt_cache.store(msg.snapshot_key, s.offset, s.cache)
        if out.hidden is not None:
            nxt = pb.Activation(session=msg.session, seq=msg.seq, offset=msg.offset,
                                length=msg.length, sample=msg.sample, verify=msg.verify,
                                keep=keep, snapshot_key=msg.snapshot_key)
            to_tensor(out.hidden, out=nxt.tensor)
            if msg.seq == 0:
                nxt.open.CopyFrom(msg.open)
            return nxt
        if out.logits is not None:  # a verify chunk's answer: every position's logits
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq,
                             peak_memory=mx.get_peak_memory())
            to_tensor(out.logits, out=ev.logits)
            return ev
        if out.token is not None:
            ev = self._event(pb.Event.TOKEN, msg.session, msg.seq, token=out.token,
                             peak_memory=mx.get_peak_memory())
            if out.logprobs is not None:
                to_tensor(out.logprobs, out=ev.logprobs)
            return ev
        return None


    def _process_rows_check(self, live: _Live, msg) -> list:
        if not live.batch:
            raise Refused(f"rows on session {live.id}'s stream: batched steps go on a batch stream")
        if not msg.rows:
            raise Refused(f"a message on batch stream {live.id} without rows")
        if msg.session != live.id or msg.seq != live.session.next_seq:
            raise Refused(f"batch stream {live.id}: message {msg.session!r} seq {msg.seq}, "
                          f"expected seq {live.session.next_seq}")
        if msg.verify or msg.HasField("keep") or msg.snapshot_key or not msg.sample:
            raise Refused("a batched step is a plain sampled decode step")
        lives = []
        for r in msg.rows:
            l = self.sessions.get(r.session)
            if l is None or l.freed or l.batch or l.session.head != live.session.head:
                raise Refused(f"batched step: no session {r.session!r} of head "
                              f"{live.session.head} here")
            lives.append(l)
        return lives

    @staticmethod
    def _media(msg, runner, x):
        """(pad id, rows mx.array [P, hidden]) of a chunk with image rows, checked: stage 0
        only, P = the chunk's pad tokens, float32 [P, hidden_size]. Refused otherwise."""
        if not runner.is_first:
            raise Refused(f"session {msg.session}: image rows (media) go to stage 0 only, "
                          f"this is stage {runner.spec.index}")
        pad = msg.media_pad
        if not 0 <= pad < runner.args.vocab_size:
            raise Refused(f"session {msg.session}: media_pad {pad} is not a token id in "
                          f"[0, {runner.args.vocab_size})")
        n_pad = int((x == pad).sum().item())
        if n_pad == 0:
            raise Refused(f"session {msg.session}: image rows for a chunk without "
                          f"<|media_pad|> (id {pad}) tokens")
        try:
            rows = from_tensor(msg.media, (n_pad, runner.args.hidden_size), "float32", "media")
        except WireError as e:
            raise Refused(str(e)) from None
        return pad, rows

    def _process_rows(self, live: _Live, msg, runner: StageRunner):
        """A batched decode step (on the MLX thread): every row's session advances one
        position in one forward pass (`runner.run_rows`). Returns the Activation for the
        next stage, or (last stage) one TOKEN event per row."""
        lives = self._process_rows_check(live, msg)
        shape, dtype = runner.rows_input_spec(len(lives))
        try:
            x = from_tensor(msg.tensor, shape, dtype, "activation" if not runner.is_first else "tokens")
        except WireError as e:
            raise Refused(str(e)) from None
        outs = runner.run_rows([l.session for l in lives], [r.seq for r in msg.rows],
                               [r.offset for r in msg.rows], x)
        live.session.next_seq += 1
        now = time.monotonic()
        for l in lives:
            l.last_active = now
        if outs[0].hidden is not None:
            nxt = pb.Activation(session=msg.session, seq=msg.seq, length=1, sample=True)
            nxt.rows.extend(msg.rows)
            to_tensor(outs[0].hidden, out=nxt.tensor)
            if msg.seq == 0:
                nxt.open.CopyFrom(msg.open)
            return nxt
        peak = mx.get_peak_memory()
        events = []
        for r, o in zip(msg.rows, outs):
            ev = self._event(pb.Event.TOKEN, r.session, r.seq, token=o.token, peak_memory=peak)
            if o.logprobs is not None:
                to_tensor(o.logprobs, out=ev.logprobs)
            events.append(ev)
        return events


class StageServer:
    """A running stage service: gRPC server (+ optional zeroconf advertisement).

    Args:
        service: the StageService.
        addresses: IPv4 addresses to listen on ("0.0.0.0" for all).
        port: TCP port (0 = any free one; then only one address is allowed).
        secret: cluster secret (server interceptor). tls: use the cluster certificate.
    """

    def __init__(self, service: StageService, addresses, port: int, secret: bytes,
                 tls_secret_path: Optional[Path] = None, workers: Optional[int] = None):
        self.service = service
        workers = workers or 3 * service.max_sessions + 8
        options = [("grpc.max_receive_message_length", service.max_message),
                   ("grpc.max_send_message_length", service.max_message),
                   ("grpc.so_reuseport", 0),
                   ("grpc.http2.min_ping_interval_without_data_ms", 1000)] + KEEPALIVE_OPTIONS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                             thread_name_prefix="rpc"),
                                  interceptors=[ServerAuth(secret)], options=options,
                                  maximum_concurrent_rpcs=workers)
        pb_grpc.add_StageServicer_to_server(service, self.server)
        # gRPC server reflection lists the services served, so a head speaking another
        # stage protocol (another service name) can name both versions.
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection((STAGE_SERVICE, reflection.SERVICE_NAME), self.server)
        creds = server_credentials(tls_secret_path) if tls_secret_path else None
        addresses = list(addresses)
        if port == 0 and len(addresses) > 1:
            raise ValueError("port 0 (any free port) needs a single listen address")
        self.port = port
        for a in addresses:
            target = f"{a}:{self.port}"
            bound = (self.server.add_secure_port(target, creds) if creds
                     else self.server.add_insecure_port(target))
            if not bound:
                raise OSError(f"cannot listen on {target}")
            self.port = bound
        self.addresses = addresses
        self.advertiser = None

    def start(self) -> "StageServer":
        """Start serving (returns self)."""
        self.server.start()
        return self

    def advertise(self, addresses, tls: bool = False, ttl: int = 120) -> None:
        """Register the zeroconf record on `addresses` (IPv4)."""
        from kimi_mlx.cluster.discovery import Advertiser, NodeInfo

        s = self.service
        ours, mlx_version = package_versions()
        info = NodeInfo(node_id=s.node_id, host=addresses[0], port=self.port,
                        protocol=PROTOCOL_VERSION, version=ours, mlx_version=mlx_version,
                        total_memory=s.total_memory, usable_memory=s.usable_memory,
                        chip=s.chip, bandwidth=s.bandwidth, fingerprints=sorted(s.catalog),
                        key_id=key_id(s.secret), tls=tls, wired_mb=s.wired_mb)
        self.advertiser = Advertiser(info, list(addresses), ttl=ttl)

    def stop(self, grace: float = 1.0) -> None:
        """Unadvertise (mDNS goodbye), free sessions, stop serving."""
        if self.advertiser is not None:
            try:
                self.advertiser.close()
            except Exception as e:  # best effort on shutdown
                log.warning("unadvertise failed: %s", e)
            self.advertiser = None
        self.service.close()
        self.server.stop(grace).wait(grace + 1)
