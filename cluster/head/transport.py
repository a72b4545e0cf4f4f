"""How the head drives a pipeline of stages: one small interface, and its gRPC version.

`Transport` is all the head (`head.pipeline.Pipeline`, the launcher) knows about the network:
load stages, open a session, send token chunks into the first stage, receive sampled
tokens from the last stage, close or abort sessions. The planner and the model know
nothing of it. An `mx.distributed` transport (ring or RDMA over Thunderbolt 5) would
implement these same methods with each rank running a `node.runner.StageRunner`, and send the
same [K + 1, 1, L, D] activations with `mx.distributed.send/recv` instead of gRPC.

`GrpcTransport` holds a `Watch` lease on every stage: heartbeats (a stage silent for
`peer_timeout` seconds is reported as lost: hung or off the network), the last stage's
tokens, and session errors. A closed connection (a stage that died) is reported at once.
Failures raise `StageFailure`, which names the stage, its node, address and layers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import mlx.core as mx
import numpy as np

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.net.channel import DEFAULT_MAX_MESSAGE, make_channel
from kimi_mlx.cluster.head.leases import StageLeases
from kimi_mlx.cluster.net.control import ControlClient, rpc_reason
from kimi_mlx.cluster.net.wire import from_tensor, sampling_to_pb, to_tensor
from kimi_mlx.model.cache import KV_DEFAULT_GROUP

log = logging.getLogger(__name__)


@dataclass
class StageAssignment:
    """Stage `index` runs layers [start, end) on `node`."""

    node: NodeInfo
    start: int
    end: int

    def describe(self, index: int) -> str:
        """'stage i (node N at host:port, layers [s, e))'."""
        return (f"stage {index} (node {self.node.node_id} at {self.node.address}, "
                f"layers [{self.start}, {self.end}))")


@dataclass
class TokenResult:
    """A token sampled by the last stage for message `seq` of `session`.

    logprobs: float32 [vocab] when the session asked for them, else None.
    logits: the answer to a verify chunk instead: float32 [length, vocab] (token is 0).
    scores: the answer to a scored chunk instead (token is 0): per position of the chunk,
    (its target's log-probability, [(id, log-probability)] of the top alternatives, best
    first). hidden: the answer to a chunk sent with `capture`: the hidden states leaving
    those layers, [len(capture), length, hidden] in the wire dtype (a capturing prefill
    chunk's answer carries only this). stage: the index of the stage that answered."""

    session: str
    seq: int
    token: int
    logprobs: Optional[mx.array] = None
    logits: Optional[mx.array] = None
    scores: Optional[list] = None
    hidden: Optional[mx.array] = None
    stage: int = -1


@dataclass
class LoadResult:
    """A stage's load: tensor bytes its loader read, bytes its process read from files
    (-1 unknown), seconds, and whether it was already loaded."""

    tensor_bytes: int
    disk_read_bytes: int
    seconds: float
    cached: bool


class StageFailure(RuntimeError):
    """A stage was lost or refused. `failed` lists (stage index, node id, reason);
    `lost` is True when a stage is gone (died, hung, off the network) rather than
    refusing a message."""

    def __init__(self, message: str, failed: List[tuple], lost: bool):
        super().__init__(message)
        self.failed = failed
        self.lost = lost

    @property
    def node_ids(self) -> List[str]:
        """Node ids of the failed stages."""
        return [f[1] for f in self.failed]


class Transport(ABC):
    """What the head needs from the network (see the module doc). Thread-safe: several
    sessions may be open at once."""

    stages: List[StageAssignment]

    @abstractmethod
    def load(self, fingerprint: str, stages: List[StageAssignment], compute_dtype: str,
             wire_dtype: str, progress: Optional[Callable[[int, object], None]] = None,
             force: bool = False) -> List[LoadResult]:
        """Load every stage's layers (in parallel); `progress(stage index, LoadProgress)`.
        Implementations also take `max_positions` and `kv` ((kv_bits, kv_group_size) of
        the stages' DSA caches) as keywords."""

    @abstractmethod
    def open(self, session: str, sampling: Sampling, return_logprobs: bool = False,
             restore: Optional[Tuple[str, int]] = None) -> None:
        """Start a session (its first `send` opens it on every stage); `restore` = (prompt
        cache key, positions it holds): every stage starts from that snapshot."""

    @abstractmethod
    def send(self, session: str, seq: int, offset: int, tokens: Sequence[int], sample: bool,
             verify: bool = False, keep: Optional[int] = None, snapshot_key: str = "",
             media=None, score: Optional[Tuple[Sequence[int], int]] = None,
             capture: Optional[Sequence[int]] = None) -> None:
        """Queue token ids for positions [offset, offset + len) into the first stage
        (non-blocking); with `sample`, the last stage returns a token for them. With
        `verify` (speculative decoding) every stage records the chunk for rollback and the
        last stage returns the logits of every position; the next message after it gives
        `keep`, the positions of that chunk to keep. With `snapshot_key`, every stage
        keeps a prompt-cache snapshot after the chunk. `media` (pad id, rows [P, hidden]):
        the image rows of the chunk's P `<|media_pad|>` tokens, in order (stage 0 puts
        them in place of those tokens' embeddings). `score` (targets, top_k), on a prefill
        chunk: targets[i] is the token after position offset + i; the last stage answers
        with their scores (`TokenResult.scores`) instead of nothing. `capture` (a block
        drafter's layer ids, strictly ascending): the stages owning those layers send
        their hidden states at these positions along, and the last stage answers with
        them (`TokenResult.hidden`), a prefill chunk too; None: nothing captured."""

    def open_batch(self, group: str) -> None:
        """Open a stream of batched decode steps (`send_rows`); NotImplementedError where
        the transport has none."""
        raise NotImplementedError("this transport has no batched decode")

    def send_rows(self, group: str, seq: int, rows: Sequence[tuple]) -> None:
        """Queue one batched decode step on batch stream `group` (message `seq`): rows
        (session, its seq, its position, its token); each session's token comes back to
        its own `receive`."""
        raise NotImplementedError("this transport has no batched decode")

    def stream_closed(self, session: str) -> bool:
        """Whether a session's (or batch stream's) stream has ended."""
        return True

    def notify_error(self, session: str, message: str) -> None:
        """Make `session`'s next `receive` raise a StageFailure with `message`."""

    def cache_lookup(self, keys: Sequence[str]) -> Optional[List[str]]:
        """The keys of `keys` that every stage holds in its prompt cache (None: no
        prompt cache on this transport)."""
        return None

    @abstractmethod
    def receive(self, session: str, timeout: Optional[float] = None) -> TokenResult:
        """The next sampled token of `session`. Raises StageFailure (stage lost or refused)
        or TimeoutError."""

    @abstractmethod
    def close(self, session: str) -> None:
        """End a session normally (every stage frees it; bounded wait)."""

    @abstractmethod
    def cancel(self, session: str) -> None:
        """Drop a session at once, without waiting for the stages."""

    @abstractmethod
    def abort(self) -> Dict[str, int]:
        """Free every session of this head on every reachable stage; node id -> sessions
        left there (-1 when unreachable)."""

    def losses(self) -> Dict[int, str]:
        """Stages lost so far, stage index -> why (empty while every stage serves); also
        counts a stage whose heartbeats stopped. Never raises (a health watch calls it
        when no session is running)."""
        return {}

    @abstractmethod
    def peak_memory(self) -> int:
        """Largest peak memory (bytes) any stage reported."""

    @abstractmethod
    def shutdown(self) -> None:
        """Drop the leases and connections (stages free this head's sessions)."""


class _HeadSession:
    def __init__(self, sid: str):
        self.sid = sid
        self.events: "queue.Queue" = queue.Queue()
        self.out: "queue.Queue" = queue.Queue()
        self.call = None
        self.reader: Optional[threading.Thread] = None
        self.closed = threading.Event()
        self.opened = False
        self.open_msg: Optional[pb.SessionOpen] = None

    def requests(self):
        """The messages put on `out`, until the None that ends the stream."""
        return iter(self.out.get, None)


class GrpcTransport(ControlClient, StageLeases, Transport):
    """`Transport` over the gRPC stage service (see the module doc).

    Args:
        secret: cluster secret. tls_secret_path: enable TLS with the cluster certificate.
        peer_timeout: seconds without a heartbeat before a stage is reported lost.
        rpc_timeout: deadline (s) of Health/Reset calls. load_timeout: of a Load call.
        session_deadline: deadline (s) of a session's stream and of the leases.
    """

    def __init__(self, secret: bytes, tls_secret_path: Optional[Path] = None,
                 peer_timeout: float = 5.0, rpc_timeout: float = 2.0,
                 load_timeout: float = 4 * 3600.0, session_deadline: float = 24 * 3600.0,
                 max_message: int = DEFAULT_MAX_MESSAGE):
        ControlClient.__init__(self, secret, tls_secret_path, max_message)
        self.peer_timeout = peer_timeout
        self.rpc_timeout = rpc_timeout
        self.load_timeout = load_timeout
        self.session_deadline = session_deadline
        self.stages: List[StageAssignment] = []
        self._channels: List[grpc.Channel] = []
        self._stubs: List[pb_grpc.StageStub] = []
        self._watches: list = []
        self._last_seen: List[float] = []
        self._peak: List[int] = []
        self.lost: Dict[int, str] = {}
        self._sessions: Dict[str, _HeadSession] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._generation = 0
        self._fingerprint = ""
        self._wire_dtype = "float32"
        self.cache_stats: Dict[int, "pb.CacheLookupReply"] = {}  # stage -> last reply

    # -- connections ---------------------------------------------------------------------
    def _connect(self, stages: List[StageAssignment]) -> None:
        self._drop_watches()
        for ch in self._channels:
            ch.close()
        self.stages = list(stages)
        self._channels = [make_channel(s.node.address, self.secret, self.tls, self.max_message)
                          for s in stages]
        self._stubs = [pb_grpc.StageStub(ch) for ch in self._channels]
        self._last_seen = [time.monotonic()] * len(stages)
        self._peak = [0] * len(stages)
        self.cache_stats = {}
        self.lost = {}

    def describe(self, i: int) -> str:
        """Description of stage i (see StageAssignment.describe)."""
        return self.stages[i].describe(i)

    # -- load ----------------------------------------------------------------------------
    def load(self, fingerprint, stages, compute_dtype, wire_dtype, progress=None, force=False,
             max_positions: int = 0, planned_tokens: int = 0, planned_sequences: int = 0,
             kv=(None, KV_DEFAULT_GROUP)):
        """Load every stage's layers (`LoadRequest`, one thread per stage); returns a
        `LoadResult` per stage. `max_positions`: the head's context when past the model's;
        `planned_tokens` x `planned_sequences`: what the stages size their wired memory
        for (the head's plan; 0: the trained context x one sequence); `kv`: (kv_bits or
        None, group size) of the DSA caches (--kv-bits). Raises
        StageFailure naming each stage that failed."""
        self._connect(stages)
        self._fingerprint = fingerprint
        self._wire_dtype = wire_dtype or compute_dtype or "float32"  # captured hiddens
        n = len(stages)
        results: Dict[int, LoadResult] = {}
        errors: Dict[int, str] = {}

        def one(i: int):
            req = pb.LoadRequest(
                fingerprint=fingerprint, start=stages[i].start, end=stages[i].end, stage=i,
                num_stages=n, next_address=stages[i + 1].node.address if i + 1 < n else "",
                compute_dtype=compute_dtype, wire_dtype=wire_dtype, plan_id=self.head_id,
                force=force, max_positions=max_positions, planned_tokens=planned_tokens,
                planned_sequences=planned_sequences,
                kv_bits=kv[0] or 0, kv_group_size=kv[1] or KV_DEFAULT_GROUP)
            try:
                for p in self._stubs[i].Load(req, timeout=self.load_timeout):
                    if progress is not None:
                        progress(i, p)
                    if p.phase == "error":
                        errors[i] = p.message
                        return
                    if p.phase == "ready":
                        results[i] = LoadResult(p.tensor_bytes, p.disk_read_bytes, p.seconds,
                                                p.message == "already loaded")
                if i not in results:
                    errors[i] = "load ended without finishing"
            except grpc.RpcError as e:
                errors[i] = rpc_reason(e, "Load", self._channels[i], self.rpc_timeout)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            failed = [(i, stages[i].node.node_id, errors[i]) for i in sorted(errors)]
            msg = "; ".join(f"{self.describe(i)} failed to load: {errors[i]}" for i in sorted(errors))
            raise StageFailure(msg, failed, lost=False)
        self._start_watches()
        return [results[i] for i in range(n)]

    # -- sessions ------------------------------------------------------------------------
    def open_batch(self, group):
        self.open(group, Sampling(), False, batch=True)

    def send_rows(self, group, seq, rows):
        s = self._sessions[group]
        ids = np.asarray([[r[3]] for r in rows], dtype=np.int32)
        msg = pb.Activation(session=group, seq=seq, length=1, sample=True)
        msg.rows.extend(pb.Row(session=r[0], seq=r[1], offset=r[2]) for r in rows)
        msg.tensor.data = ids.tobytes()
        msg.tensor.shape[:] = list(ids.shape)
        msg.tensor.dtype = "int32"
        if not s.opened:
            msg.open.CopyFrom(s.open_msg)
            s.opened = True
        s.out.put(msg)

    def notify_error(self, session, message):
        """Make `session`'s next `receive` raise a StageFailure with `message`."""
        s = self._sessions.get(session)
        if s is not None:
            s.events.put(pb.Event(kind=pb.Event.ERROR, session=session, stage=0, message=message))

    def stream_closed(self, session):
        s = self._sessions.get(session)
        return s is None or s.closed.is_set()

    def open(self, session, sampling, return_logprobs=False, restore=None, batch=False):
        if self.lost:
            raise self._failure(None)
        s = _HeadSession(session)
        s.open_msg = pb.SessionOpen(session=session, head=self.head_id,
                                    sampling=sampling_to_pb(sampling),
                                    return_logprobs=return_logprobs,
                                    bounds=([a.start for a in self.stages] + [self.stages[-1].end]
                                            if self.stages else []),
                                    fingerprint=self._fingerprint)
        if restore is not None:
            s.open_msg.restore_key, s.open_msg.restore_length = restore
        s.open_msg.batch = batch
        with self._lock:
            if session in self._sessions:
                raise ValueError(f"session {session} is already open")
            self._sessions[session] = s
        s.call = self._stubs[0].Forward(s.requests(), timeout=self.session_deadline)
        s.reader = threading.Thread(target=self._read_forward, args=(s,), daemon=True,
                                    name=f"fwd-{session}")
        s.reader.start()

    def _read_forward(self, s: _HeadSession) -> None:
        try:
            for ev in s.call:
                if ev.kind in (pb.Event.TOKEN, pb.Event.ERROR):
                    s.events.put(ev)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not s.closed.is_set():
                s.events.put(pb.Event(kind=pb.Event.ERROR, session=s.sid, stage=0,
                                      node_id=self.stages[0].node.node_id,
                                      message=f"{self.describe(0)}: {rpc_reason(e)}"))
        finally:
            s.closed.set()

    def send(self, session, seq, offset, tokens, sample, verify=False, keep=None,
             snapshot_key="", media=None, score=None, capture=None):
        s = self._sessions[session]
        ids = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        msg = pb.Activation(session=session, seq=seq, offset=offset, length=ids.shape[1],
                            sample=sample, verify=verify, keep=keep, snapshot_key=snapshot_key)
        if score is not None:
            msg.score_targets[:] = [int(t) for t in score[0]]
            msg.score_top = int(score[1])
        if capture:
            msg.capture_layers[:] = [int(i) for i in capture]
        msg.tensor.data = ids.tobytes()
        msg.tensor.shape[:] = list(ids.shape)
        msg.tensor.dtype = "int32"
        if media is not None:
            msg.media_pad = int(media[0])
            to_tensor(media[1], "float32", out=msg.media)
        if not s.opened:
            msg.open.CopyFrom(s.open_msg)
            s.opened = True
        s.out.put(msg)

    def receive(self, session, timeout=None):
        s = self._sessions[session]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                ev = s.events.get(timeout=0.25)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"session {session}: no token within {timeout:.0f} s") from None
                continue
            if ev is None:
                continue
            if ev.kind == pb.Event.TOKEN:
                lp = logits = None
                if ev.HasField("logprobs"):
                    lp = from_tensor(ev.logprobs, (None,), "float32", "logprobs")
                if ev.HasField("logits"):
                    logits = from_tensor(ev.logits, (None, None), "float32", "logits")
                scores = _scores(ev) if ev.HasField("scores") else None
                hidden = None
                if ev.HasField("hidden"):
                    who = (self.describe(ev.stage) if 0 <= ev.stage < len(self.stages)
                           else f"stage {ev.stage}")
                    hidden = from_tensor(ev.hidden, (None, None, None), self._wire_dtype,
                                         f"{who}: captured hidden states")
                return TokenResult(session, ev.seq, ev.token, lp, logits, scores, hidden,
                                   ev.stage)
            raise self._failure(ev)

    def _failure(self, ev) -> StageFailure:
        """Name the failed stage(s): those lost (died / hung / unreachable) first, else
        the one that refused `ev`."""
        if ev is not None and not self.lost:
            # A dying stage's neighbours may report first: give its lease a moment to
            # break, then ask every stage directly.
            end = time.monotonic() + 1.0
            while not self.lost and time.monotonic() < end:
                time.sleep(0.05)
            if not self.lost:
                self._probe()
        if self.lost:
            failed = [(i, self.stages[i].node.node_id, r) for i, r in sorted(self.lost.items())]
            msg = "; ".join(f"{self.describe(i)} lost: {r}" for i, _, r in failed)
            if ev is not None and ev.message:
                msg += f" (reported: {ev.message})"
            return StageFailure(msg, failed, lost=True)
        i = ev.stage if 0 <= ev.stage < len(self.stages) else 0
        return StageFailure(ev.message or f"{self.describe(i)} failed", [(i, ev.node_id, ev.message)],
                            lost=False)

    def close(self, session):
        s = self._sessions.get(session)
        if s is None:
            return
        if self.lost:
            return self.cancel(session)
        s.out.put(None)  # ends the stream; every stage finishes and frees the session
        if s.call is not None and not s.closed.wait(self.rpc_timeout + 3):
            s.call.cancel()
        with self._lock:
            self._sessions.pop(session, None)

    def cancel(self, session):
        s = self._sessions.pop(session, None)
        if s is not None:
            s.closed.set()
            if s.call is not None:
                s.call.cancel()

    def abort(self):
        for sid in list(self._sessions):
            self.cancel(sid)
        left: Dict[str, int] = {}

        def one(i):
            node = self.stages[i].node.node_id
            if i in self.lost:
                left[node] = -1
                return
            try:
                r = self._stubs[i].Reset(pb.ResetRequest(head=self.head_id), timeout=self.rpc_timeout)
                left[node] = r.sessions
            except grpc.RpcError:
                left[node] = -1

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(self.stages))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.rpc_timeout + 1)
        return left

    def cache_lookup(self, keys):
        """The keys every stage holds (asked in parallel); a stage that does not answer
        within rpc_timeout holds none. Each stage's reply (its cache's counters, disk
        tier included) is kept in `cache_stats[i]` for /metrics."""
        keys = list(keys)
        if not keys or not self.stages:
            return []
        held: List[Optional[set]] = [None] * len(self.stages)

        def one(i):
            try:
                r = self._stubs[i].CacheLookup(pb.CacheLookupRequest(keys=keys),
                                               timeout=self.rpc_timeout)
                held[i] = set(r.held)
                self.cache_stats[i] = r
            except grpc.RpcError as e:
                log.warning("%s: prompt cache lookup failed: %s", self.describe(i), rpc_reason(e))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(self.stages))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.rpc_timeout + 1)
        common = set(keys)
        for h in held:
            common &= h or set()
        return [k for k in keys if k in common]

    def health(self) -> List[Optional[pb.HealthReply]]:
        """Health of every stage (None where it does not answer within rpc_timeout)."""
        out: List[Optional[pb.HealthReply]] = [None] * len(self.stages)

        def one(i):
            try:
                out[i] = self._stubs[i].Health(pb.HealthRequest(), timeout=self.rpc_timeout)
            except grpc.RpcError:
                pass

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(self.stages))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.rpc_timeout + 1)
        return out

    def peak_memory(self):
        return max(self._peak, default=0)

    def shutdown(self):
        for sid in list(self._sessions):
            self.cancel(sid)
        self._drop_watches()
        self._closing = True
        for ch in self._channels:
            ch.close()
        self._channels, self._stubs = [], []


def _scores(ev) -> list:
    """`TokenResult.scores` of a scored chunk's answer (`Event.scores` float32
    [length, 1 + k], `Event.score_ids` int32 [length, k], absent when k is 0). Raises
    WireError on a malformed answer."""
    vals = from_tensor(ev.scores, (None, None), "float32", "scores").tolist()
    k = len(vals[0]) - 1
    ids = (from_tensor(ev.score_ids, (len(vals), k), "int32", "score_ids").tolist()
           if k else [[] for _ in vals])
    return [(row[0], list(zip(top, row[1:]))) for row, top in zip(vals, ids)]
