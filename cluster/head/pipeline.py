"""The head: generate through the pipeline (nodes are found and checked in `net.nodes`,
planned in `head.plan`, loaded by `head.cluster`; batched decode in `head.batcher`).

A request is a `PipelineTarget`, the pipeline's `net.session.RemoteSession`: the prompt
but its last token is prefilled in chunks (`prefill_chunk` tokens, also ending at the
prompt-cache snapshot points; they stream into stage 0 back to back, so stage i works on
chunk c while stage i + 1 works on chunk c - 1), then mlx-lm's `generate_step` decodes
from the last prompt token over the session, as one process does (`net.session.generate`).
Each decode message asks the last stage to sample (`Activation.sample`): with no logits
processors the session takes the last stage's token (`stage_samples`: no logits travel);
with them (penalties, logit_bias, constraints) the last stage returns log-probabilities
and mlx-lm's processors and sampler choose on the head. Several sessions may run at once
(one per thread). Speculative decoding runs over the same session (`head.speculative`).
"""

from __future__ import annotations

import logging
import uuid
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.cluster.head.transport import StageFailure, Transport
from kimi_mlx.cluster.net.session import RemoteSession, generate
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS, Sampling

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 128


class PipelineTarget(RemoteSession):
    """One session through the pipeline's stages, as a model the head's loops call
    (`net.session.RemoteSession`: keep/trim, prefill, decode).

    Prefill chunks are sent back to back without waiting (a chunk asked for its scores or
    captured hidden states is answered after all are sent). A decode position is one
    message: with `record` (speculative decoding) a verify step that every stage records
    and the last stage answers with the logits float32 [T, vocab], carrying the previous
    step's `keep`; else a 1-token step the last stage samples (its token, and its
    log-probabilities when the session was opened with `return_logprobs`), through
    `batcher` when given (one batched message per step for the sessions decoding).

    Args:
        transport: a loaded `Transport`; session: its open session id.
        args: the checkpoint's `ModelArgs` (vocab_size and hidden_size for the checks;
            None for plain decoding).
        n_prefill: prompt tokens that are prefill (len(prompt) - 1).
        prefill_chunk: prompt tokens per message. step_timeout: seconds per answer (None:
            as long as every stage is alive).
        record: decode positions are verify steps. stage_samples: take the last stage's
            token. return_logprobs: the session asked the last stage for log-probabilities.
        batcher: a `head.batcher.Batcher` for the plain decode steps, or None.
    Raises (from calls): StageFailure / TimeoutError from the transport; ValueError for an
        answer of the wrong kind or shape (naming the stage that sent it).
    """

    what = "the pipeline"

    def __init__(self, transport, session: str, args, n_prefill: int, prefill_chunk: int,
                 step_timeout: Optional[float] = None, *, record: bool = True,
                 stage_samples: bool = False, return_logprobs: bool = False, batcher=None):
        super().__init__(n_prefill, prefill_chunk, record, stage_samples)
        self.transport, self.session, self.args = transport, session, args
        self.step_timeout, self.return_logprobs, self.batcher = step_timeout, return_logprobs, batcher
        self.seq = 0
        self._joined = False

    def _send(self, tokens: Sequence[int], sample: bool, **extra) -> int:
        seq = self.seq
        self.transport.send(self.session, seq, self.offset, list(tokens), sample, **extra)
        self.seq += 1
        return seq

    pipelined = True  # False: wait for each prefill chunk to clear the last stage (benches)

    def _prefill_chunk(self, ids, media, snapshot, targets, top_k):
        extra = {}
        if snapshot:
            extra["snapshot_key"] = snapshot
        if media is not None:
            extra["media"] = media
        if targets is not None:
            extra["score"] = (targets, top_k)
        wait = not self.pipelined
        seq = self._send(ids, wait and targets is None, **extra)
        if targets is None:
            if wait:
                self._receive(seq)
            return None
        if wait:
            return _score_outs(self._receive(seq), targets)
        return lambda: _score_outs(self._receive(seq), targets)

    def _prefill_call(self, ids, capture):
        wire = sorted(capture) if capture else None  # the stages capture in layer order
        extra = {"capture": wire} if wire else {}  # plain sends keep the plain call
        sent = []
        for s in range(0, len(ids), self.prefill_chunk):
            part = ids[s:s + self.prefill_chunk]
            sent.append((self._send(part, False, verify=False, keep=None, **extra), len(part)))
            self.offset += len(part)
        if not capture:
            return None
        return mx.concatenate([self._hidden(self._receive(seq), seq, n, wire, capture)
                               for seq, n in sent], axis=1)

    def _decode(self, ids, keep, capture):
        if not self.record:
            if len(ids) != 1 or capture:
                raise ValueError(f"plain decoding through the pipeline sends one token a step "
                                 f"(got {len(ids)}{' with capture' if capture else ''})")
            return self._sampled(ids[0]), None
        T = len(ids)
        wire = sorted(capture) if capture else None
        extra = {"capture": wire} if wire else {}
        seq = self._send(ids, False, verify=True, keep=keep, **extra)  # answered with logits
        r = self._receive(seq)
        V = self.args.vocab_size
        if r.logits is None or tuple(r.logits.shape) != (T, V):
            got = "none" if r.logits is None else list(r.logits.shape)
            raise ValueError(f"{self._who(r)} answered verify step seq {r.seq} with logits "
                             f"{got}, expected [{T}, {V}] (a stage of another protocol?)")
        return r.logits[None], (self._hidden(r, seq, T, wire, capture) if capture else None)

    def _sampled(self, token: int) -> mx.array:
        """One decode step the last stage samples: its log-probabilities [1, 1, vocab] as
        the logits (zeros [1, 1, 1] without them); its token for `stage_samples`."""
        if self.batcher is not None and self._joined:
            self.batcher.step(self.session, self.seq, self.offset, token)
            self.seq += 1
        else:  # the first decode step goes on the session's own stream
            self._send([token], True)
            if self.batcher is not None:
                self.batcher.join(self.session)
                self._joined = True
        r = self.transport.receive(self.session, self.step_timeout)
        self._stage_token = int(r.token)
        if r.logprobs is not None:
            return mx.array(r.logprobs).reshape(1, 1, -1)
        if not self.stage_samples:
            raise ValueError(f"{self._who(r)} sent no log-probabilities for head-side sampling")
        return mx.zeros((1, 1, 1), mx.float32)

    def end(self, ok: bool = True) -> None:
        if self.batcher is not None:
            self.batcher.leave(self.session)
        try:
            self.transport.close(self.session) if ok else self.transport.cancel(self.session)
        except Exception as e:  # noqa: BLE001 - never wait on a failed pipeline
            log.debug("close %s: %s", self.session, e)

    def _receive(self, seq: int):
        r = self.transport.receive(self.session, self.step_timeout)
        if r.seq != seq:
            raise ValueError(f"{self._who(r)} answered message seq {r.seq}, expected the "
                             f"answer to seq {seq}")
        return r

    def _who(self, r) -> str:
        """The stage that sent answer `r`, as the transport describes it."""
        stage = getattr(r, "stage", -1)
        describe = getattr(self.transport, "describe", None)
        if describe is not None and 0 <= stage < len(getattr(self.transport, "stages", [])):
            return describe(stage)
        return "the last stage" if stage < 0 else f"stage {stage}"

    def _hidden(self, r, seq: int, T: int, wire: List[int], order: List[int]) -> mx.array:
        """Answer `r`'s captured rows [len(wire), T, D] (layer ids `wire`, ascending)
        as [1, T, n * D] in the order `order`; ValueError naming the stage when they are
        missing or misshapen."""
        want = (len(wire), T, self.args.hidden_size)
        h = getattr(r, "hidden", None)
        if h is None or tuple(h.shape) != want:
            got = "none" if h is None else list(h.shape)
            raise ValueError(f"{self._who(r)} answered message seq {seq} with captured hidden "
                             f"states {got}, expected {list(want)} (layers {wire})")
        return mx.concatenate([h[wire.index(i)] for i in order], axis=-1)[None]


class Pipeline:
    """Generation through a loaded `Transport`.

    Args:
        transport: loaded transport (stages ready).
        prefill_chunk: prompt tokens per message.
        step_timeout: seconds to wait for one answer (None: as long as every stage is
            alive; lost stages are reported within the transport's peer timeout).
    """

    def __init__(self, transport: Transport, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 step_timeout: Optional[float] = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {prefill_chunk}")
        self.transport = transport
        self.prefill_chunk = prefill_chunk
        self.step_timeout = step_timeout

    def open(self, n_prompt: int, sampling: Optional[Sampling] = None, *,
             return_logprobs: bool = False, head_samples: bool = False,
             restore: Optional[Tuple[str, int]] = None, batcher=None, args=None,
             record: bool = False, session: Optional[str] = None) -> PipelineTarget:
        """Open a session on every stage for a prompt of `n_prompt` tokens and return its
        `PipelineTarget`. `head_samples`: the head chooses every token (logits
        processors): the last stage returns log-probabilities and samples greedily,
        unused. `restore` (prompt-cache key, n): every stage starts from its snapshot of
        the first n prompt tokens (a stage that lost it refuses the session: a
        `StageFailure` naming `net.cache_keys.CACHE_MISS` at the first answer); the
        prefill starts at n. `record`: speculative decoding (verify steps, `args` the
        target's ModelArgs). ValueError: a restored prefix outside the prompt."""
        start = restore[1] if restore else 0
        if not 0 <= start < n_prompt:
            raise ValueError(f"restored prefix of {start} tokens for a prompt of {n_prompt}")
        sid = session or f"s-{uuid.uuid4().hex[:16]}"
        stage_sampling = Sampling() if head_samples or record else (sampling or Sampling())
        lp = (return_logprobs or head_samples) and not record
        if restore:
            self.transport.open(sid, stage_sampling, lp, restore=restore)
        else:
            self.transport.open(sid, stage_sampling, lp)
        s = PipelineTarget(self.transport, sid, args, n_prompt - 1, self.prefill_chunk,
                           self.step_timeout, record=record, stage_samples=not (head_samples or record),
                           return_logprobs=lp, batcher=batcher)
        s.offset = s.cached = start
        return s

    def generate(self, prompt: Sequence[int], sampling: Optional[Sampling] = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, *, return_logprobs: bool = False,
                 logits_processors=None, restore: Optional[Tuple[str, int]] = None,
                 batcher=None, session: Optional[str] = None, pipelined: bool = True,
                 **prefill):
        """Yield (token, logprobs float32 [vocab] or None) for `prompt`, like mlx-lm's
        `generate_step`: `net.session.generate` over a session opened here (`open`;
        `logits_processors`: mlx-lm's, applied on the head, which then samples with
        `sampling`); `prefill`: `snapshots`, `stops`, `media`, `score` / `scores` of
        `RemoteSession.prefill` (scoring needs a full prefill, no `restore`).
        `pipelined` False: each prefill chunk waits to clear the last stage (measuring).
        Raises StageFailure (a stage lost or refused; the session is freed everywhere
        reachable) and ValueError (empty prompt, max_tokens 0 without a score)."""
        sampling = sampling or Sampling()
        if prefill.get("score") is not None and restore:
            raise ValueError("scoring needs a full prefill (no restore)")
        head = bool(logits_processors)

        def open_session():
            s = self.open(len(prompt), sampling, return_logprobs=return_logprobs,
                          head_samples=head, restore=restore, batcher=batcher, session=session)
            s.pipelined = pipelined
            return s

        return generate(open_session, prompt, max_tokens,
                        sampler=sampling.sampler() if head else None,
                        logits_processors=logits_processors, **prefill)


def _score_outs(r, targets: Sequence[int]) -> list:
    """The `server.jobs.TokenOut`s of a scored chunk's answer `r` (a `TokenResult`) for its
    `targets`. Raises StageFailure when the last stage answered something else."""
    from kimi_mlx.server.jobs import TokenOut

    if r.scores is None or len(r.scores) != len(targets):
        got = "nothing" if r.scores is None else f"{len(r.scores)} positions"
        raise StageFailure(f"the last stage answered a scored chunk of {len(targets)} "
                           f"positions with {got} (an older kimi-mlx on that node?)", [], False)
    return [TokenOut(int(t), lp, top) for t, (lp, top) in zip(targets, r.scores)]


__all__ = ["Pipeline", "PipelineTarget", "StageFailure"]
