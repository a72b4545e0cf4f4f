"""The head: find and check nodes, plan, load, and generate through the pipeline.

Generation mirrors mlx-lm's `generate_step` / `stream_generate` so `kimi-mlx cluster
launch` prints what `kimi-mlx generate` prints: the prompt except its last token is
prefilled in chunks (`prefill_chunk` tokens; they stream into stage 0 back to back, so
stage i works on chunk c while stage i + 1 works on chunk c - 1), then the last prompt
token is sent alone and the last stage samples it (logprobs = logits - logsumexp, then
mlx-lm's sampler, as `generate_step` does); each sampled token comes back to the head and
goes into stage 0 as the next step. Several sessions may run at once (one per thread).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.cluster.node.runner import Sampling
from kimi_mlx.cluster.head.transport import StageAssignment, StageFailure, Transport
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, build_id, package_versions

log = logging.getLogger("kimi_mlx.cluster.head")

DEFAULT_PREFILL_CHUNK = 128


def prefill_chunks(n_prompt: int, chunk: int, start: int = 0,
                   stops: Sequence[int] = ()) -> List[Tuple[int, int]]:
    """(offset, length) of the prefill chunks for a prompt of `n_prompt` tokens: tokens
    [start, n_prompt - 1) in chunks of at most `chunk` (as mlx-lm's generate_step with
    prefill_step_size=chunk), also ending at each position of `stops` (prompt-cache
    snapshot points); the last token is sent on its own to be sampled."""
    out, off = [], start
    ends = sorted(e for e in set(stops) if start < e < n_prompt - 1) + [n_prompt - 1]
    for end in ends:
        while end - off > 0:
            n = min(chunk, end - off)
            out.append((off, n))
            off += n
    return out


def chunk_media(media: Optional[Tuple[int, object]], prompt: Sequence[int], offset: int,
                length: int) -> Optional[Tuple[int, object]]:
    """(pad id, rows [P, hidden]) of the `<|media_pad|>` tokens among prompt[offset:
    offset + length], from a prompt's `media` (pad id, all its rows in order); None when
    the chunk has none."""
    if media is None:
        return None
    pad, rows = media
    before = sum(1 for t in prompt[:offset] if t == pad)
    k = sum(1 for t in prompt[offset:offset + length] if t == pad)
    return (pad, rows[before:before + k]) if k else None


def media_rows(vision, images: Sequence[object], pad: int, lock: Optional[threading.Lock] = None):
    """(pad id, rows [sum of the images' tokens, hidden]) for `Pipeline.generate_step`:
    the head runs the vision tower and projector (`generation.images.Vision`, loaded
    from the checkpoint folder on the head on first use), under `lock` (one tower run at
    a time; sessions run on several threads)."""
    import mlx.core as mx

    if lock is None:
        rows = vision.features(images)
        mx.eval(rows)
        return pad, rows
    with lock:
        rows = vision.features(images)
        mx.eval(rows)
    return pad, rows


class Pipeline:
    """Generation through a loaded `Transport`.

    Args:
        transport: loaded transport (stages ready).
        prefill_chunk: prompt tokens per message.
        step_timeout: seconds to wait for one token (None: as long as every stage is
            alive; lost stages are reported within the transport's peer timeout).
    """

    def __init__(self, transport: Transport, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 step_timeout: Optional[float] = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {prefill_chunk}")
        self.transport = transport
        self.prefill_chunk = prefill_chunk
        self.step_timeout = step_timeout

    def generate_step(self, prompt: Sequence[int], sampling: Optional[Sampling] = None,
                      max_tokens: int = 256, return_logprobs: bool = False,
                      pipelined: bool = True, session: Optional[str] = None,
                      choose: Optional[Callable[[object], Tuple[int, object]]] = None,
                      restore: Optional[Tuple[str, int]] = None,
                      snapshots: Optional[Dict[int, str]] = None,
                      batcher: Optional["Batcher"] = None,
                      media: Optional[Tuple[int, object]] = None,
                      ) -> Iterator[Tuple[int, Optional[object]]]:
        """Yield (token, logprobs or None), like mlx-lm's `generate_step`.

        Args:
            prompt: token ids (at least one).
            max_tokens: tokens to yield (-1: until the caller stops).
            return_logprobs: also return float32 [vocab] log-probabilities (bytes on the
                wire: vocab x 4 per token).
            pipelined: stream prefill chunks back to back (False: wait for each chunk to
                clear the last stage before sending the next; for measuring).
            choose: head-side sampling (needs return_logprobs): called with the last
                stage's logprobs float32 [vocab] for each position, returns (token,
                logprobs) to yield; that token, not the last stage's, is fed back (the
                server applies logits processors this way).
            restore: (prompt-cache key, n): every stage starts from its snapshot of the
                first n prompt tokens (the head checked they all hold it); the prefill
                starts at n. A stage that has lost it refuses the session (a
                `StageFailure` whose message says `prompt_cache.CACHE_MISS`).
            snapshots: {position e: key}: every stage keeps a snapshot of the first e
                prompt tokens (n < e < len(prompt)) under key; chunks end there.
            batcher: decode through this `Batcher` (one batched message per step for
                all the sessions decoding at once) instead of one message per token.
            media: (pad id, rows mx.array [P, hidden]): the prompt's images, the vision
                projector's rows for its P `<|media_pad|>` tokens in order (`media_rows`);
                each prefill chunk carries the rows of its own pads to stage 0.
        Raises:
            StageFailure: a stage was lost or refused (the session is freed everywhere
                reachable before this propagates out of the caller's `abort`).
            ValueError: empty prompt.
        """
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if choose is not None and not return_logprobs:
            raise ValueError("head-side sampling (choose) needs return_logprobs")
        t = self.transport
        sampling = sampling or Sampling()
        sid = session or f"s-{uuid.uuid4().hex[:16]}"
        start = restore[1] if restore else 0
        if not 0 <= start < len(prompt):
            raise ValueError(f"restored prefix of {start} tokens for a prompt of {len(prompt)}")
        snapshots = snapshots or {}
        t.open(sid, sampling, return_logprobs, restore=restore) if restore else \
            t.open(sid, sampling, return_logprobs)
        ok = False
        try:
            seq = 0
            for off, n in prefill_chunks(len(prompt), self.prefill_chunk, start, list(snapshots)):
                extra = {}
                key = snapshots.get(off + n)
                if key:
                    extra["snapshot_key"] = key
                rows = chunk_media(media, prompt, off, n)
                if rows is not None:
                    extra["media"] = rows
                t.send(sid, seq, off, prompt[off:off + n], sample=not pipelined, **extra)
                seq += 1
                if not pipelined:
                    t.receive(sid, self.step_timeout)
            offset = len(prompt) - 1
            t.send(sid, seq, offset, prompt[-1:], sample=True)
            n = 0
            if batcher is not None:
                batcher.join(sid)
            while True:
                r = t.receive(sid, self.step_timeout)
                token, logprobs = (r.token, r.logprobs) if choose is None else choose(r.logprobs)
                yield token, logprobs
                n += 1
                if n == max_tokens:
                    break
                seq, offset = seq + 1, offset + 1
                if batcher is not None:
                    batcher.step(sid, seq, offset, token)
                else:
                    t.send(sid, seq, offset, [token], sample=True)
            ok = True
        except GeneratorExit:  # the caller stopped early (end of message): a clean end
            ok = True
            raise
        finally:
            if batcher is not None:
                batcher.leave(sid)
            try:
                t.close(sid) if ok else t.cancel(sid)  # never wait on a failed pipeline
            except Exception as e:
                log.debug("close %s: %s", sid, e)


class Batcher:
    """Batched decode through the pipeline: the decode steps of the sessions in flight
    (`Pipeline.generate_step(batcher=...)`) go through the stages as one message per
    step (`Transport.send_rows`), which every stage runs as one batched forward pass
    (`runner.StageRunner.run_rows`); each session still receives its own token.

    A sender thread flushes the steps waiting once every session decoding has posted
    its step, or `wait_s` after the first one did (a session that joins, or one slower
    than the rest, then rides in the next message). Prefill stays on each session's
    own stream, so a joining request's chunks pass between decode steps.
    """

    def __init__(self, transport: Transport, wait_s: float = 0.003):
        self.t = transport
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: Dict[str, tuple] = {}
        self._members: set = set()
        self._group: Optional[str] = None
        self._seq = 0
        self._stopped = False
        self.steps = 0  # messages sent
        self.rows = 0  # decode positions they carried
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batcher")
        self._thread.start()

    def join(self, sid: str) -> None:
        with self._cond:
            self._members.add(sid)

    def leave(self, sid: str) -> None:
        with self._cond:
            self._members.discard(sid)
            self._pending.pop(sid, None)
            self._cond.notify_all()

    def step(self, sid: str, seq: int, offset: int, token: int) -> None:
        """Queue session `sid`'s next decode step (message `seq`, position `offset`)."""
        with self._cond:
            self._pending[sid] = (sid, seq, offset, int(token))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(2.0)
        if self._group is not None:
            try:
                self.t.cancel(self._group)
            except Exception as e:  # noqa: BLE001 - best effort
                log.debug("batch stream: %s", e)

    def _loop(self) -> None:
        import time

        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait(0.5)
                if self._stopped:
                    return
                end = time.monotonic() + self.wait_s
                while len(self._pending) < len(self._members) and not self._stopped:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                rows = list(self._pending.values())
                self._pending.clear()
            if rows:
                self._send(rows)

    def _send(self, rows) -> None:
        try:
            if self._group is None or self.t.stream_closed(self._group):
                if self._group is not None:
                    self.t.cancel(self._group)
                self._group, self._seq = f"b-{uuid.uuid4().hex[:16]}", 0
                self.t.open_batch(self._group)
            self.t.send_rows(self._group, self._seq, rows)
            self._seq += 1
            self.steps += 1
            self.rows += len(rows)
        except Exception as e:  # noqa: BLE001 - each waiting session hears of it
            log.warning("batched decode step failed: %s", e)
            for r in rows:
                self.t.notify_error(r[0], f"batched decode step failed: {type(e).__name__}: {e}")


def stream_generate(tokens: Iterator[Tuple], tokenizer, n_prompt: int,
                    max_tokens: int, peak_memory: Callable[[], int]):
    """mlx-lm's `stream_generate` over a token iterator of (token, logprobs[, from_draft])
    (`kimi_mlx.generation.streaming.stream_responses`): yields GenerationResponse with text segments,
    tokens/s and peak memory (GB, the largest of any stage)."""
    from kimi_mlx.generation.streaming import stream_responses

    yield from stream_responses(tokens, tokenizer, n_prompt, max_tokens, peak_memory)


# -- nodes -------------------------------------------------------------------------------

@dataclass
class Rejected:
    """A node not used, and why.

    kind: "unreachable" (no answer: down, hung, off the network; starting it helps),
    "secret" (another cluster secret or clock), "protocol" (another stage protocol or
    not a stage), "version", "checkpoint", "duplicate" (node id), "error" (other).
    """

    node_id: str
    address: str
    reason: str
    kind: str = "error"

    @property
    def unreachable(self) -> bool:
        """Whether the node did not answer at all (so `start it` is the fix)."""
        return self.kind == "unreachable"


def health_info(reply: pb.HealthReply, host: str, port: int) -> NodeInfo:
    """NodeInfo from a Health reply (what the node says over an authenticated call)."""
    return NodeInfo(node_id=reply.node_id, host=host, port=port, protocol=reply.protocol,
                    version=reply.version, mlx_version=reply.mlx_version,
                    total_memory=reply.total_memory, usable_memory=reply.usable_memory,
                    chip=reply.chip, bandwidth=reply.bandwidth,
                    fingerprints=list(reply.fingerprints), key_id=reply.key_id)


def parse_address(spec: str, default_port: int) -> Tuple[str, int]:
    """'host', 'host:port' or '[v6]:port' -> (host, port). ValueError when malformed."""
    spec = spec.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif spec.count(":") == 1:
        host, port = spec.split(":")
    else:
        host, port = spec, ""
    if not host:
        raise ValueError(f"--nodes: {spec!r} has no host")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise ValueError(f"--nodes: {spec!r}: port {port!r} is not a number") from None


_KINDS = {grpc.StatusCode.UNAVAILABLE: "unreachable", grpc.StatusCode.DEADLINE_EXCEEDED: "unreachable",
          grpc.StatusCode.UNAUTHENTICATED: "secret", grpc.StatusCode.UNIMPLEMENTED: "protocol"}


def check_nodes(candidates: List[NodeInfo], stub_for: Callable[[str], object], fp: Optional[str],
                timeout: float = 2.0, check_version: bool = True,
                channel_for: Optional[Callable[[str], grpc.Channel]] = None,
                name: str = "",
                ) -> Tuple[List[Tuple[NodeInfo, pb.HealthReply]], List[Rejected]]:
    """Confirm each candidate with an authenticated Health call (in parallel) and keep
    those with our protocol, package version and the checkpoint's fingerprint (not
    checked when `fp` is None; `name`, the checkpoint's folder name, for messages).

    Returns (accepted [(NodeInfo from Health, reply)], rejected with reasons and kinds).
    A candidate that does not answer (a stale advertisement, a node that is down) is
    rejected as "not answering" (kind "unreachable"); one that refuses our secret as
    "secret"; one without our stage service as "protocol", naming the protocol it
    speaks (asked with `channel_for(address)`'s gRPC reflection, or as advertised).
    """
    ours, our_mlx = package_versions()
    results: List[Optional[Tuple]] = [None] * len(candidates)

    def one(k: int):
        n = candidates[k]
        try:
            results[k] = ("ok", stub_for(n.address).Health(pb.HealthRequest(), timeout=timeout))
        except grpc.RpcError as e:
            from kimi_mlx.cluster.head.transport import _rpc_reason

            code = e.code() if hasattr(e, "code") else None
            channel = channel_for(n.address) if channel_for and code == grpc.StatusCode.UNIMPLEMENTED else None
            results[k] = ("err", _rpc_reason(e, "Health", channel, timeout, n.protocol),
                          _KINDS.get(code, "error"))

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(candidates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 2)
    accepted, rejected, seen = [], [], set()
    for n, res in zip(candidates, results):
        if res is None:
            rejected.append(Rejected(n.node_id, n.address, "not answering: no answer", "unreachable"))
            continue
        if res[0] == "err":
            why, kind = res[1], res[2]
            rejected.append(Rejected(n.node_id, n.address,
                                     f"not answering: {why}" if kind == "unreachable" else why, kind))
            continue
        reply = res[1]
        info = health_info(reply, n.host, n.port)
        reason, kind = None, "error"
        if reply.protocol != PROTOCOL_VERSION:
            reason, kind = (f"speaks stage protocol {reply.protocol}, this head {PROTOCOL_VERSION}: "
                            f"install the same kimi-mlx on both (node {reply.version}, head {ours})",
                            "protocol")
        elif check_version and reply.version != ours:
            reason, kind = (f"runs kimi-mlx {reply.version}, this head {ours}: install the same "
                            "version everywhere (or pass --allow-version-mismatch)", "version")
        elif fp is not None and fp not in reply.fingerprints:
            ours_named = f"{name} (fingerprint {fp})" if name else f"(fingerprint {fp})"
            reason, kind = (f"does not have the checkpoint {ours_named} in its models folder; "
                            f"it has: {held_checkpoints(reply)}; copy it there (no restart "
                            "needed: the node rescans its folder)", "checkpoint")
        elif info.node_id in seen:
            reason, kind = (f"a second node calls itself {info.node_id}: give each a unique "
                            "--node-id", "duplicate")
        if reason:
            rejected.append(Rejected(info.node_id or n.node_id, n.address, reason, kind))
            continue
        if reply.mlx_version != our_mlx:
            log.warning("node %s runs MLX %s, this head %s", info.node_id, reply.mlx_version, our_mlx)
        if reply.build and reply.build != build_id():
            log.warning("node %s runs other kimi-mlx sources than this head (build %s, head %s): "
                        "outputs may differ slightly from one process here", info.node_id,
                        reply.build, build_id())
        seen.add(info.node_id)
        accepted.append((info, reply))
    return accepted, rejected


def held_checkpoints(reply: pb.HealthReply) -> str:
    """The checkpoints a node's Health reply lists, as 'folder (fingerprint), ...' ('none'
    when empty; bare fingerprints from a node that does not send names)."""
    names = list(reply.checkpoint_names)
    if len(names) != len(reply.fingerprints):
        names = [""] * len(reply.fingerprints)
    return ", ".join(f"{n} ({fp})" if n else fp
                     for n, fp in zip(names, reply.fingerprints)) or "none"


def checkpoint_dtype(model_dir: Path) -> str:
    """Wire name of the embedding's dtype in a checkpoint ("bfloat16" for the release)."""
    from kimi_mlx.checkpoint.loader import read_header, weight_map

    wm = weight_map(Path(model_dir))
    for name in ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight"):
        if name in wm:
            dt = read_header(Path(model_dir) / wm[name])[name].dtype
            return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dt, "bfloat16")
    return "bfloat16"


def choose_compute_dtype(replies: Sequence[pb.HealthReply], model_dir: Path, requested: str) -> str:
    """The one activation dtype of the pipeline: `requested` unless "auto"; auto is
    float32 when any stage computes on a CPU (as the loader chooses there), else the
    checkpoint's embedding dtype."""
    if requested != "auto":
        return requested
    if any(r.default_dtype == "float32" for r in replies):
        return "float32"
    return checkpoint_dtype(model_dir)


def plan_stages(model_dir: Path, nodes: List[NodeInfo], context: int, sequences: int = 1):
    """Plan with the stage planner; returns (Plan, [StageAssignment]) for the used nodes.

    Raises:
        PlanError: the model does not fit these nodes (message says by how much).
    """
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.placement.planner import StagePlanner

    plan = StagePlanner().plan(model_bytes(str(model_dir)), [n.planner_node() for n in nodes],
                               context, sequences)
    by_id = {n.node_id: n for n in nodes}
    return plan, [StageAssignment(by_id[name], s, e) for name, s, e in plan.ranges()]


def describe_plan(assignments: List[StageAssignment]) -> List[str]:
    """One line per stage for the launcher's log."""
    return [a.describe(i) for i, a in enumerate(assignments)]


__all__ = ["Pipeline", "stream_generate", "prefill_chunks", "check_nodes", "plan_stages",
           "choose_compute_dtype", "checkpoint_dtype", "parse_address", "Rejected",
           "StageFailure"]
