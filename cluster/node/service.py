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
- `CacheLookup`: which prompt-cache snapshots this stage holds (`node.stage_cache`): a
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

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import grpc
import mlx.core as mx

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.net.auth import key_id
from kimi_mlx.cluster.net.channel import DEFAULT_MAX_MESSAGE, make_channel
from kimi_mlx.cluster.net.fingerprint import folder_state, scan
from kimi_mlx.cluster.net.hostfacts import cached_facts_json
from kimi_mlx.cluster.net.jaccl import local_report_json
from kimi_mlx.cluster.net.ranks import TensorSetupError, available_backends
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, WireError, build_id, check_session_id, package_versions
from kimi_mlx.cluster.node.compute import ComputeThread
from kimi_mlx.cluster.node.forward import ForwardRPC
from kimi_mlx.cluster.node.loading import LoadRPC
from kimi_mlx.cluster.node.rank import RankProcess, check_rank_request
from kimi_mlx.cluster.node.runner import Refused, StageRunner, StageSpec, default_compute_dtype
from kimi_mlx.cluster.node.sessions import Live, Watcher
from kimi_mlx.cluster.node.stage_cache import StageCache
from kimi_mlx.model.cache import KV_DEFAULT_GROUP

log = logging.getLogger(__name__)

class StageService(LoadRPC, ForwardRPC, pb_grpc.StageServicer):
    """The servicer; see the module doc. Construct via `StageServer`. `Load` is in
    `node.loading`, `Forward` in `node.forward`; the lease, ranks, resets and lookups here.

    `stage_loader` (class attribute, default None = `runner.load_stage`): what `Load`
    calls, `(path, spec, progress) -> (runner, report, tensor bytes)`; the hop bench's
    null stages (`cluster.bench.hop`) set it in a subclass. `load_bar` (None, or
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
        cache_dir / cache_disk_bytes: the prompt cache's disk tier (`server.disk_cache`,
            None: memory only), a folder per loaded checkpoint, layer range and dtype
            (`stage_cache.stage_fingerprint`), attached at each load.
    """

    stage_loader = None
    load_bar = None

    def __init__(self, node_id: str, models_dir: Optional[Path], secret: bytes,
                 tls_secret_path: Optional[Path] = None, idle_timeout: float = 120.0,
                 heartbeat_s: float = 1.0, max_sessions: int = 16,
                 stream_deadline: float = 24 * 3600.0, max_message: int = DEFAULT_MAX_MESSAGE,
                 usable_memory: Optional[int] = None, bandwidth: Optional[int] = None,
                 cache_bytes: Optional[int] = None, cache_dir: Optional[Path] = None,
                 cache_disk_bytes: int = 0):
        from kimi_mlx.cluster.net.discovery import local_chip, local_memory

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
        self.sessions: Dict[str, Live] = {}
        self.cache_bytes = cache_bytes
        self.prompt_cache = StageCache(cache_bytes or 0)
        self.cache_dir, self.cache_disk_bytes = cache_dir, cache_disk_bytes
        self.watchers: Dict[str, Watcher] = {}
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()  # one load at a time; later Loads wait for it
        self.compute = ComputeThread(f"mlx-{node_id}"[:15])
        self._channels: Dict[str, grpc.Channel] = {}
        self._stop = threading.Event()
        self._ranks: set = set()  # the `RankProcess`es of running StartRank streams
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

    def _free(self, live: Optional[Live], reason: str = "", cancel: bool = True) -> None:
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

    def _downstream_failed(self, live: Live, error: str) -> None:
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
        """Stop the janitor, free every session, close channels, stop this node's tensor
        ranks, and end the MLX thread
        (its streams cleared, see `compute`; waits up to `timeout` s for a running chunk)."""
        self._stop.set()
        for live in list(self.sessions.values()):
            self._free(live, "service stopping")
        for w in list(self.watchers.values()):
            w.closed = True
        for ch in self._channels.values():
            ch.close()
        for rank in list(self._ranks):  # SIGTERM first (`node.rank.RankProcess.kill`)
            rank.kill("the node is stopping")
        self.compute.stop(timeout)
        self.prompt_cache.attach_disk(None)  # queued snapshot writes finish first

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
        when it changed), what is loaded, live sessions, and this host's facts for
        `kimi-mlx cluster doctor` (`hostfacts.cached_facts_json`: gathered in the
        background, never holding the reply up past a second)."""
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
            host_facts=cached_facts_json({"models folder": self.models_dir}),
        )

    def Watch(self, request, context):
        """The head's lease: stream heartbeats, tokens and errors; frees the head's
        sessions when it ends."""
        head = request.head
        try:
            check_session_id(head)
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"head id: {e}")
        w = Watcher(head)
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
        """Run this node's rank of a tensor-parallel group (`kimi_mlx.cluster.tensor.rank`,
        see `node.rank`) for as long as the stream lasts: HEARTBEATs while it runs, one ERROR naming node and
        rank when it exits or is stopped; the rank is killed when the stream ends.
        FAILED_PRECONDITION (naming the node) when this node cannot run it."""
        try:
            path = self._resolve(request.fingerprint)
            check_rank_request(request, self.node_id)
        except (Refused, TensorSetupError) as e:
            log.warning("refused StartRank from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        rank = RankProcess(path, request.rank, request.size, request.backend, request.hosts,
                           self.node_id, cache_bytes=self.cache_bytes,
                           cache_dir=self.cache_dir, cache_disk_bytes=self.cache_disk_bytes,
                           plan=(request.planned_tokens, request.planned_sequences),
                           kv=(request.kv_bits or None, request.kv_group_size or KV_DEFAULT_GROUP))
        context.add_callback(lambda: rank.kill("the head's lease ended: stream cancelled or "
                                               "its connection lost"))
        self._ranks.add(rank)
        log.info("tensor rank %d of %d (%s) for head %s: started, pid %d", request.rank,
                 request.size, request.backend, request.head, rank.proc.pid)
        try:
            yield self._event(pb.Event.HEARTBEAT)
            beat = time.monotonic()
            while context.is_active() and not self._stop.is_set():
                why = rank.state()
                if why is not None and rank.killed_by_node is not None:
                    return  # the lease ended first (this node stopped it): nobody to tell
                if why == "finished":  # after rank 0's last request: the group is done
                    yield self._event(pb.Event.CLOSED)
                    return
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
            self._ranks.discard(rank)
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
        disk = {}
        if c.disk is not None:
            st = c.disk.stats()
            disk = dict(disk_hits=st["hits"], disk_misses=st["misses"], disk_bytes=st["bytes"],
                        disk_read_seconds=st["read_seconds"],
                        disk_write_seconds=st["write_seconds"],
                        disk_ignored=st["ignored_foreign"] + st["ignored_corrupt"])
        return pb.CacheLookupReply(held=c.held(request.keys), bytes=c.nbytes,
                                   max_bytes=c.max_bytes, entries=len(c), evictions=c.evictions,
                                   **disk)

