"""Speculative decoding through the pipeline: the head drafts, the stages verify.

The head runs the draft model; each verify step sends [y, d1..dk] through the stages as
ONE message per hop (`Activation.verify`). Every stage snapshots its caches and records
its KDA inputs before that forward (`kimi_mlx.speculative.rollback.begin_verify`) and keeps them
until the head says how many of the k + 1 positions were accepted; that count rides on
the next step's message (`Activation.keep`: no extra round trip), and each stage rolls
back exactly (`rollback` + `end_verify`) before running it. The last stage returns the
k + 1 rows of logits (float32), from which the head applies the acceptance rule.

The loop itself is the one-process one, `kimi_mlx.speculative.loop.speculative_generate_step`
(draft, acceptance rule `accept_drafts` at temperature > 0, mlx-lm's greedy rule at 0,
draft snapshots): here the target it drives is `PipelineTarget`, a stand-in model whose
forward pass is a message through the stages and whose one "cache" is the pipeline's
position, trimmed (= the next message's `keep`) by the loop's own `rollback` call. So
greedy output is token for token the plain pipeline's (and one process's), and sampled
output keeps the target's distribution, by the same code in both places.

Block drafters (DFlash / DSpark, `kimi_mlx.speculative.block_loop`) run the same
way over `PipelineTarget.forward_capture`: prefill chunks and verify steps carry the
drafter's `target_layer_ids` (`Activation.capture_layers`); the stages that own those
layers add their hidden states to the message as it passes (`node.capture`), and the last
stage returns them with its answer (`Event.hidden`), for a prefill chunk too. Without a
block drafter no message asks, and nothing is captured or sent.

A stage lost mid-verify raises the transport's `StageFailure` out of the forward pass,
as for any other message (the launcher's existing stage-loss path reports it).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.speculative.remote_cache import RemoteCache
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS, Sampling
from kimi_mlx.speculative.loop import loop_for
from kimi_mlx.speculative.settings import DEFAULT_NUM_DRAFT_TOKENS

log = logging.getLogger(__name__)

__all__ = ["PipelineTarget", "speculative_pipeline_step"]


class PipelineTarget:
    """A target model whose layers run in the pipeline's stages, for one session.

    Called like a model on token ids [1, T]:
      * positions before `n_prefill` (the prompt but its last token) are prefill: sent in
        chunks of `prefill_chunk`, back to back, without waiting (returns an empty
        [1, T, 0] array: the loop ignores prefill output);
      * any later call is a verify step: one message with `verify`, carrying the pending
        `keep` of the previous verify step; waits for and returns the logits
        float32 [1, T, vocab] (a `StageFailure` / `TimeoutError` from the transport).

    Args:
        transport: a loaded `Transport`; session: its open session id.
        args: the checkpoint's `ModelArgs` (vocab_size for the checks and the draft).
        n_prefill: prompt tokens that are prefill (len(prompt) - 1).
        prefill_chunk: prompt tokens per message. step_timeout: seconds per verify step
            (None: as long as every stage is alive).
    """

    def __init__(self, transport, session: str, args, n_prefill: int, prefill_chunk: int,
                 step_timeout: Optional[float] = None):
        self.transport, self.session, self.args = transport, session, args
        self.n_prefill, self.prefill_chunk, self.step_timeout = n_prefill, prefill_chunk, step_timeout
        self.layers = [None]  # one stand-in cache for all stages (mlx-lm's cache split)
        self.offset = 0  # positions the stages hold (after the pending keep)
        self.seq = 0
        self._verify: Optional[Tuple[int, int]] = None  # (offset, length) awaiting a keep

    def make_cache(self) -> List[Any]:
        return [RemoteCache(self)]

    def trim(self, n: int) -> int:
        """Drop the last n positions of the pending verify step (sent as the next
        message's keep). Raises ValueError for anything else (a prefill cannot be
        taken back)."""
        if n < 0 or self._verify is None or self.offset - n < self._verify[0]:
            raise ValueError(f"the pipeline can only drop positions of the last verify step "
                             f"(asked to drop {n} at position {self.offset})")
        self.offset -= n
        return n

    def _send(self, tokens: Sequence[int], sample: bool, verify: bool, capture=None) -> None:
        keep = None
        if self._verify is not None:
            keep = self.offset - self._verify[0]
            self._verify = None
        extra = {"capture": capture} if capture else {}  # plain sends keep the plain call
        self.transport.send(self.session, self.seq, self.offset, list(tokens), sample,
                            verify=verify, keep=keep, **extra)
        self.seq += 1

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self._forward(inputs, None)[0]

    def forward_capture(self, inputs: mx.array, layer_ids: Sequence[int]):
        """As a call on ids [1, T], also returning the hidden states leaving layers
        `layer_ids` (a block drafter's `target_layer_ids`, any order, no repeats) at these
        T positions: (logits float32 [1, T, vocab], or None for prefill positions;
        hiddens [1, T, n * hidden] in the wire dtype, layer j's rows at [..., j * hidden :
        (j + 1) * hidden], as `block_loop.target_forward` concatenates them in one
        process). The same contract as `tensor.step.GroupTarget.forward_capture`.

        Prefill positions go in chunks of `prefill_chunk`, sent back to back, and each
        chunk's answer (its hiddens) is awaited after all are sent.
        Raises:
            ValueError: repeated layer ids; an answer without the hiddens or of the
                wrong shape (naming the stage that sent it); as `__call__`.
            StageFailure / TimeoutError: from the transport.
        """
        ids = [int(i) for i in layer_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"capture layer ids {ids} repeat a layer")
        return self._forward(inputs, ids)

    def _forward(self, inputs: mx.array, capture: Optional[List[int]]):
        """(logits [1, T, vocab] or, for prefill, [1, T, 0] without capture / None with
        it; hiddens or None) of ids `inputs` (see `__call__` / `forward_capture`)."""
        ids = [int(t) for t in inputs.reshape(-1).tolist()]
        T = len(ids)
        wire = sorted(capture) if capture else None  # the stages capture in layer order
        if self.offset + T <= self.n_prefill:
            sent = []
            for s in range(0, T, self.prefill_chunk):
                part = ids[s:s + self.prefill_chunk]
                sent.append((self.seq, len(part)))
                self._send(part, sample=False, verify=False, capture=wire)
                self.offset += len(part)
            if not capture:
                return mx.zeros((1, T, 0), mx.float32), None
            rows = [self._hidden(self._receive(seq), seq, n, wire, capture) for seq, n in sent]
            return None, mx.concatenate(rows, axis=1)
        if self.offset < self.n_prefill:
            raise ValueError(f"a forward call of {T} tokens at position {self.offset} mixes "
                             f"prompt (before {self.n_prefill}) and verify positions")
        start, seq = self.offset, self.seq
        self._send(ids, sample=False, verify=True, capture=wire)  # answered with logits
        self._verify = (start, T)
        self.offset += T
        r = self._receive(seq)
        V = self.args.vocab_size
        if r.logits is None or tuple(r.logits.shape) != (T, V):
            got = "none" if r.logits is None else list(r.logits.shape)
            raise ValueError(f"{self._who(r)} answered verify step seq {r.seq} with logits "
                             f"{got}, expected [{T}, {V}] (a stage of another protocol?)")
        return r.logits[None], (self._hidden(r, seq, T, wire, capture) if capture else None)

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


def speculative_pipeline_step(
    pipeline: Pipeline,
    prompt: Sequence[int],
    draft_model,
    model_args,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling=None,
    stats=None,
    session: Optional[str] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding through `pipeline`; yields (token, logprobs [V], from_draft)
    like `kimi_mlx.speculative.loop.speculative_generate_step`.

    Args:
        pipeline: a `Pipeline` over loaded stages (its prefill_chunk and step_timeout).
        prompt: token ids (at least one).
        draft_model: the draft, run here on the head (same tokenizer as the target), or
            an `NgramDraft` (prompt lookup on the head, `kimi_mlx.speculative.ngram`).
        model_args: the target checkpoint's `ModelArgs` (its vocab_size).
        num_draft_tokens: k (>= 1), or "auto" / an `AutoK` (k chosen as it runs,
            `kimi_mlx.speculative.auto_k`). max_tokens: tokens to yield (-1: no limit).
        sampling: `kimi_mlx.sampling.Sampling` (default greedy).
        stats: `SpecStats` to update.
        session: session id (default: a new one).
    Raises:
        StageFailure: a stage was lost or refused (also mid-verify); the session is
            cancelled here, as `Pipeline.generate_step` does.
        ValueError: empty prompt, k < 1.
    """
    from mlx_lm.models.cache import make_prompt_cache

    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    from kimi_mlx.speculative.auto_k import draft_policy

    num_draft_tokens = draft_policy(num_draft_tokens)  # ValueError for k < 1
    t = pipeline.transport
    sid = session or f"s-{uuid.uuid4().hex[:16]}"
    # The stages' own sampler is not used: every token comes from a verify step here.
    t.open(sid, Sampling(), False)
    target = PipelineTarget(t, sid, model_args, len(prompt) - 1, pipeline.prefill_chunk,
                            pipeline.step_timeout)
    caches = target.make_cache() + make_prompt_cache(draft_model)
    # A draft with its own loop (`--draft ngram`: `NgramDraft.generate_step`) runs it over
    # the same stand-in target; its plain steps (no match) are 1-token verify messages.
    step = loop_for(draft_model)
    ok = False
    try:
        yield from step(
            list(prompt), target, draft_model, num_draft_tokens=num_draft_tokens,
            max_tokens=max_tokens, sampling=sampling, prompt_cache=caches,
            prefill_step_size=pipeline.prefill_chunk, stats=stats)
        ok = True
    except GeneratorExit:  # the caller stopped early: a clean end
        ok = True
        raise
    finally:
        try:
            t.close(sid) if ok else t.cancel(sid)
        except Exception as e:
            log.debug("close %s: %s", sid, e)
