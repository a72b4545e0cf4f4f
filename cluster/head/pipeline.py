"""The head: generate through the pipeline (nodes are found and checked in `net.nodes`,
planned in `head.plan`, loaded by `head.cluster`; batched decode in `head.batcher`).

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
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from kimi_mlx.cluster.head.batcher import Batcher
from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS, Sampling
from kimi_mlx.cluster.head.transport import StageFailure, Transport

log = logging.getLogger(__name__)

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
                      max_tokens: int = DEFAULT_MAX_TOKENS, return_logprobs: bool = False,
                      pipelined: bool = True, session: Optional[str] = None,
                      choose: Optional[Callable[[object], Tuple[int, object]]] = None,
                      restore: Optional[Tuple[str, int]] = None,
                      snapshots: Optional[Dict[int, str]] = None,
                      stops: Sequence[int] = (),
                      batcher: Optional["Batcher"] = None,
                      media: Optional[Tuple[int, object]] = None,
                      score: Optional[int] = None, scores: Optional[list] = None,
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
                `StageFailure` whose message says `net.cache_keys.CACHE_MISS`).
            snapshots: {position e: key}: every stage keeps a snapshot of the first e
                prompt tokens (n < e < len(prompt)) under key; chunks end there.
            stops: more positions where chunks end, with no snapshot (a cache-free
                prefill ends its chunks at the snapshot policy's points, so that its
                float operations are those of a reply restored from a snapshot).
            batcher: decode through this `Batcher` (one batched message per step for
                all the sessions decoding at once) instead of one message per token.
            media: (pad id, rows mx.array [P, hidden]): the prompt's images, the vision
                projector's rows for its P `<|media_pad|>` tokens in order (`media_rows`);
                each prefill chunk carries the rows of its own pads to stage 0.
            score: score the prompt's own tokens too (`/v1/completions` echo + logprobs)
                with this many top alternatives (0..20): every prefill chunk asks the last
                stage for its positions' scores (their next prompt token's log-probability
                and the top alternatives, not the logits), which are appended to `scores`
                (one `server.jobs.TokenOut` per token of prompt[1:]) before the first token
                is yielded. Then max_tokens may be 0: the prompt is scored, nothing is
                generated (the last prompt token is not sent). Not with `restore`.
        Raises:
            StageFailure: a stage was lost or refused (the session is freed everywhere
                reachable before this propagates out of the caller's `abort`).
            ValueError: empty prompt.
        """
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if choose is not None and not return_logprobs:
            raise ValueError("head-side sampling (choose) needs return_logprobs")
        if score is not None and (restore or scores is None):
            raise ValueError("scoring needs a `scores` list and a full prefill (no restore)")
        if max_tokens == 0 and score is None:
            raise ValueError("max_tokens 0 generates nothing; it needs `score`")
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
            chunks = prefill_chunks(len(prompt), self.prefill_chunk, start,
                                    list(snapshots) + list(stops))
            for off, n in chunks:
                extra = {}
                key = snapshots.get(off + n)
                if key:
                    extra["snapshot_key"] = key
                rows = chunk_media(media, prompt, off, n)
                if rows is not None:
                    extra["media"] = rows
                if score is not None:
                    extra["score"] = (prompt[off + 1:off + n + 1], score)
                t.send(sid, seq, off, prompt[off:off + n],
                       sample=not pipelined and score is None, **extra)
                seq += 1
                if not pipelined:
                    r = t.receive(sid, self.step_timeout)
                    if score is not None:
                        scores.extend(_score_outs(r, prompt[off + 1:off + n + 1]))
            if score is not None and pipelined:
                for off, n in chunks:  # the chunks' answers, in order
                    r = t.receive(sid, self.step_timeout)
                    scores.extend(_score_outs(r, prompt[off + 1:off + n + 1]))
            if max_tokens == 0:
                ok = True
                return
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


def _score_outs(r, targets: Sequence[int]) -> list:
    """The `server.jobs.TokenOut`s of a scored chunk's answer `r` (a `TokenResult`) for its
    `targets`. Raises StageFailure when the last stage answered something else."""
    from kimi_mlx.server.jobs import TokenOut

    if r.scores is None or len(r.scores) != len(targets):
        got = "nothing" if r.scores is None else f"{len(r.scores)} positions"
        raise StageFailure(f"the last stage answered a scored chunk of {len(targets)} "
                           f"positions with {got} (an older kimi-mlx on that node?)", [], False)
    return [TokenOut(int(t), lp, top) for t, (lp, top) in zip(targets, r.scores)]


def stream_generate(tokens: Iterator[Tuple], tokenizer, n_prompt: int,
                    max_tokens: int, peak_memory: Callable[[], int]):
    """mlx-lm's `stream_generate` over a token iterator of (token, logprobs[, from_draft])
    (`kimi_mlx.generation.streaming.stream_responses`): yields GenerationResponse with text segments,
    tokens/s and peak memory (GB, the largest of any stage)."""
    from kimi_mlx.generation.streaming import stream_responses

    yield from stream_responses(tokens, tokenizer, n_prompt, max_tokens, peak_memory)


__all__ = ["Pipeline", "stream_generate", "prefill_chunks", "chunk_media", "media_rows",
           "StageFailure"]
