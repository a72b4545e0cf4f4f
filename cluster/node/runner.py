"""One pipeline stage's compute, apart from any transport: sessions, caches, checks.

A stage holds layers [start, end) of one checkpoint (`load_model(path, start, end)`). Per
session it keeps its own caches (`Model.make_cache()`), the next expected sequence number
and the next position. A chunk of positions [offset, offset + L) arrives as

- token ids int32 [1, L] on the first stage (which embeds them), or
- [K + 1, 1, L, D] in the wire dtype on the others: the K AttnRes banked states taken so
  far (K = ceil(start / attn_res_block_size)) and then the partial sum h,

and leaves as the same layout with K' = ceil(end / block) banks, or, on the last stage,
as a sampled token (output AttnRes mix + norm + lm_head + mlx-lm's sampler, exactly as
mlx-lm's `generate_step` does it) when the chunk asks for one.

Speculative decoding (`head.speculative`): a *verify* chunk [y, d1..dk] runs after
`kimi_mlx.speculative.rollback.begin_verify` on the session's caches, and the last stage returns the
float32 logits of every position. The session then holds what it needs to roll the
chunk back until the next message says how many of its positions to keep (`keep`,
piggybacked on that message): `rollback` + `end_verify` run first, so every cache holds
exactly what a plain decode of the kept tokens would have left.

Block drafters (`node.capture`): a chunk may also ask for the hidden states leaving some
layers (`capture`); the stage adds the rows of its own layers to those the stages before
it captured (`Output.captured`), which the last stage returns to the head.

Every field is checked before any compute (`Refused` names what and why); one session's
bad message never touches another session's state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.model.cache import KV_DEFAULT_GROUP
from kimi_mlx.sampling import Sampling

from kimi_mlx.cluster.net.wire import mx_dtype

MAX_CHUNK = 16384  # positions per message


class Refused(ValueError):
    """A message this stage will not process (wrong shape/dtype/bytes/session/order)."""


@dataclass(frozen=True)
class StageSpec:
    """What a stage holds and how it talks.

    Attributes:
        fingerprint: checkpoint fingerprint. start/end: layer range [start, end).
        index/num_stages: position in the pipeline. compute_dtype/wire_dtype: dtype names.
        kv_bits/kv_group_size: the DSA caches' format (`Model.set_kv_quant`).
    """

    fingerprint: str
    start: int
    end: int
    index: int
    num_stages: int
    compute_dtype: str
    wire_dtype: str
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_DEFAULT_GROUP


@dataclass
class Session:
    """One sequence's state on this stage."""

    session: str
    head: str
    sampling: Sampling
    return_logprobs: bool
    cache: List[Any]
    sampler: Any = None
    next_seq: int = 0
    offset: int = 0
    last_active: float = field(default_factory=time.monotonic)
    verify: Any = None  # kimi_mlx.speculative.rollback.Verify of the last chunk, until a keep settles it
    verify_offset: int = 0  # where that verify chunk started
    verify_length: int = 0


@dataclass
class Output:
    """What a processed chunk produced: `hidden` for the next stage, or (last stage,
    sampled chunk) `token` with optional `logprobs` float32 [vocab], or (last stage,
    verify chunk) `logits` float32 [length, vocab], or (last stage, scored chunk) `scores`:
    one `server.jobs.TokenOut` per position (`server.scoring.score_logits`)."""

    hidden: Optional[mx.array] = None
    token: Optional[int] = None
    logprobs: Optional[mx.array] = None
    logits: Optional[mx.array] = None
    scores: Optional[list] = None
    captured: Optional[mx.array] = None  # [n, length, hidden] wire dtype (capturing chunk)


class StageRunner:
    """Runs chunks of sessions through this stage's layers (thread-safe; one at a time).

    Args:
        model: `Model(args, start, end)` with weights loaded.
        spec: the stage's `StageSpec` (its dtypes are applied to the model).
    """

    def __init__(self, model, spec: StageSpec):
        self.model = model
        self.spec = spec
        self.args = model.args
        # positions a session may reach: the checkpoint's trained context, or the head's
        # longer one (LoadRequest.max_positions, from --max-kv-size)
        self.max_positions = self.args.max_position_embeddings
        self.compute = mx_dtype(spec.compute_dtype)
        self.wire = mx_dtype(spec.wire_dtype)
        model.activation_dtype = self.compute
        if hasattr(model, "set_kv_quant"):
            model.set_kv_quant(spec.kv_bits, spec.kv_group_size)
        self.is_first = model.text.is_first
        self.is_last = model.text.is_last
        self.lock = threading.Lock()
        bs = self.args.attn_res_block_size
        self.in_banks = -(-spec.start // bs) if bs else 0
        self.out_banks = -(-spec.end // bs) if bs else 0

    # -- what messages must look like ----------------------------------------------------
    def input_spec(self, length: int) -> Tuple[Tuple[int, ...], str]:
        """(shape, dtype name) a chunk of `length` positions must have on arrival."""
        if self.is_first:
            return (1, length), "int32"
        return (self.in_banks + 1, 1, length, self.args.hidden_size), self.spec.wire_dtype

    def output_spec(self, length: int) -> Tuple[Tuple[int, ...], str]:
        """(shape, dtype name) of what this stage sends on (not for the last stage)."""
        return (self.out_banks + 1, 1, length, self.args.hidden_size), self.spec.wire_dtype

    # -- sessions ------------------------------------------------------------------------
    def new_session(self, session: str, head: str, sampling: Sampling,
                    return_logprobs: bool = False) -> Session:
        """Fresh caches for a session; the last stage also builds its sampler.

        A seeded session draws from its own PRNG key, starting where `mx.random.seed(seed)`
        starts (as `kimi-mlx generate --seed` does): the same tokens as one process
        however many other sessions sample on this stage meanwhile."""
        s = Session(session, head, sampling, return_logprobs, self.model.make_cache())
        if self.is_last:
            s.sampler = sampling.sampler()  # seeded: its own key (`Sampling.sampler`)
        return s

    def check(self, s: Session, seq: int, offset: int, length: int, sample: bool,
              verify: bool = False, keep: Optional[int] = None) -> None:
        """Refused unless the chunk is the session's next one, in order and in range; the
        message right after a verify chunk must say how many of its positions to keep
        (0..length), and no other message may."""
        if seq != s.next_seq:
            raise Refused(f"session {s.session}: sequence number {seq}, expected {s.next_seq} "
                          "(lost or reordered message)")
        expected = s.offset
        if s.verify is not None:
            if keep is None:
                raise Refused(f"session {s.session}: the message after a verify chunk must say "
                              "how many of its positions to keep")
            if not 0 <= keep <= s.verify_length:
                raise Refused(f"session {s.session}: keep {keep} of a verify chunk of "
                              f"{s.verify_length} positions")
            expected = s.verify_offset + keep
        elif keep is not None:
            raise Refused(f"session {s.session}: keep {keep} without a verify chunk before it")
        if offset != expected:
            raise Refused(f"session {s.session}: chunk starts at position {offset}, expected "
                          f"{expected}")
        if not 1 <= length <= MAX_CHUNK:
            raise Refused(f"session {s.session}: chunk of {length} positions (allowed 1..{MAX_CHUNK})")
        limit = self.max_positions
        if offset + length > limit:
            raise Refused(f"session {s.session}: positions up to {offset + length} exceed the "
                          f"model's context of {limit}")

    def run(self, s: Session, seq: int, offset: int, x: mx.array, sample: bool,
            verify: bool = False, keep: Optional[int] = None,
            media: Optional[Tuple[int, mx.array]] = None,
            score: Optional[Tuple[Sequence[int], int]] = None,
            capture: Optional[Tuple[Sequence[int], Optional[mx.array]]] = None) -> Output:
        """Process one checked chunk; advances the session.

        Args:
            x: as `input_spec(L)` says (already decoded from the wire).
            sample: on the last stage, sample a token from the chunk's last position.
            verify: a speculative verify chunk: record for rollback (`begin_verify`) and,
                on the last stage, return the logits of every position.
            keep: after a verify chunk: how many of its positions stay (the rest are
                rolled back before this chunk runs).
            media: first stage only: (pad id, rows [P, hidden]) of the chunk's P
                `<|media_pad|>` tokens (images; the head ran the tower), which replace
                those tokens' embeddings (`TextModel.embed_with_media`).
            score: (targets, top_k): a scored prefill chunk (`/v1/completions` echo +
                logprobs): targets[i] is the token after position i (one per position);
                the last stage scores them from every position's logits
                (`server.scoring.score_logits`, as one process does).
            capture: (layer ids, prior): a block drafter's capture (`node.capture`): the
                hidden states leaving these layers (global ids, ascending) at every
                position; prior [n_before, L, D] (or None when no id is below this stage)
                the rows earlier stages captured. `Output.captured` is prior plus this
                stage's rows, [n_before + n_own, L, D] in the wire dtype. None: nothing
                captured (no cost).
        Raises:
            Refused: out-of-order chunk, bad token ids, a missing/extra keep, a bad
                score (sampled or verify chunk, targets not one per position, top_k out
                of 0..20), or a bad capture (ids not ascending / out of range, prior of
                the wrong shape, or on a scored chunk) (the session is unchanged).
        """
        length = x.shape[-1] if self.is_first else x.shape[2]
        self.check(s, seq, offset, length, sample, verify, keep)
        plan = None if capture is None else self.capture_plan(capture[0], f"session {s.session}")
        if plan is not None:
            want = plan.prior_shape(length, self.args.hidden_size)
            prior = capture[1]
            got = None if prior is None else tuple(prior.shape)
            if got != want or score is not None:
                raise Refused(f"session {s.session}: captured hidden states from the stages "
                              f"before stage {self.spec.index}: "
                              + ("a scored chunk captures nothing" if score is not None else
                                 f"shape {list(got) if got else 'none'}, expected "
                                 f"{list(want) if want else 'none'} (capture_layers "
                                 f"{plan.ids[:16]})"))
        if score is not None:
            targets, top = score
            if sample or verify:
                raise Refused(f"session {s.session}: a scored chunk is a prefill chunk (not "
                              "sampled, not a verify chunk)")
            if len(targets) != length or not 0 <= top <= 20:
                raise Refused(f"session {s.session}: a scored chunk of {length} positions needs "
                              f"{length} score targets and score_top in 0..20, got "
                              f"{len(targets)} and {top}")
            vocab = self.args.vocab_size
            if any(not 0 <= t < vocab for t in targets):
                raise Refused(f"session {s.session}: score targets must be token ids in "
                              f"[0, {vocab})")
        with self.lock:
            text = self.model.text
            eps = self.args.rms_norm_eps
            h, banks = self._stage_input(x, f"session {s.session}", media)
            if keep is not None:
                self._settle(s, keep)
            if verify:
                from kimi_mlx.speculative.rollback import begin_verify

                s.verify = begin_verify(s.cache)
                s.verify_offset, s.verify_length = offset, length
            slots = plan.slots() if plan is not None else None
            h, banks = text.run_layers(h, banks, s.cache, eval_each=length == 1,
                                       capture=slots)
            out = Output()
            states = [c.state for c in s.cache]
            if plan is not None:
                out.captured = plan.collect(capture[1], slots, self.wire)
                if out.captured is not None:
                    states.append(out.captured)  # evaluated with the chunk's own outputs
            if not self.is_last:
                out.hidden = mx.stack(banks.raw + [h]).astype(self.wire)
                mx.eval(out.hidden, states)
            elif verify:
                logits = self.model.language_model.logits(text.finish(h, banks))[0]
                out.logits = logits.astype(mx.float32)
                mx.eval(out.logits, states)
            elif score is not None:
                from kimi_mlx.server.scoring import score_logits

                logits = self.model.language_model.logits(text.finish(h, banks))[0]
                mx.eval(logits, states)
                out.scores = score_logits(logits, score[0], score[1])
            elif sample:
                if h.shape[1] > 1:  # only the last position's logits are needed
                    h = h[:, -1:]
                    banks = Banks.from_stacked(banks.stack()[:, :, -1:] if len(banks) else None, eps)
                logits = self.model.language_model.logits(text.finish(h, banks))[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, keepdims=True)
                token = self._sample(s, logprobs)
                mx.eval(token, logprobs, states)
                out.token = int(token.item())
                if s.return_logprobs:
                    out.logprobs = logprobs.squeeze(0).astype(mx.float32)
            else:
                mx.eval(states)
        s.next_seq += 1
        s.offset += length
        s.last_active = time.monotonic()
        return out

    def _stage_input(self, x: mx.array, who: str,
                     media: Optional[Tuple[int, mx.array]] = None) -> Tuple[mx.array, Banks]:
        """(h [B, L, D] compute dtype, attention-residual banks) entering this stage's layers.

        First stage: `x` are token ids [B, L], checked against the vocabulary and embedded
        (with `media`'s image rows in place of the pad tokens). Later stages: `x` is the
        previous stage's stack [K' + 1, B, L, D] (the banks, then h), cast to the compute
        dtype. Raises Refused naming `who` for an id out of range, bad image rows, or
        image rows sent past the first stage."""
        eps = self.args.rms_norm_eps
        text = self.model.text
        if not self.is_first:
            if media is not None:
                raise Refused(f"{who}: image rows go to the first stage only")
            x = x.astype(self.compute) if x.dtype != self.compute else x
            return x[-1], Banks.from_stacked(x[:-1] if self.in_banks else None, eps)
        lo, hi = mx.min(x).item(), mx.max(x).item()
        if lo < 0 or hi >= self.args.vocab_size:
            raise Refused(f"{who}: token id out of range [0, {self.args.vocab_size}) "
                          f"(got {lo}..{hi})")
        if media is None:
            return text.embed(x), Banks(eps)
        try:
            return text.embed_with_media(x, media[1], media[0]), Banks(eps)
        except ValueError as e:
            raise Refused(f"{who}: {e}") from None

    def capture_plan(self, ids: Sequence[int], who: str):
        """The `node.capture.CapturePlan` of capture_layers `ids` on this stage; Refused
        (naming `who`) for ids not strictly ascending or out of the model's layers."""
        from kimi_mlx.cluster.node.capture import plan_capture

        try:
            return plan_capture(ids, self.spec.start, self.spec.end,
                                self.args.num_hidden_layers, who)
        except ValueError as e:
            raise Refused(str(e)) from None

    def rows_input_spec(self, rows: int) -> Tuple[Tuple[int, ...], str]:
        """(shape, dtype name) of a batched decode step of `rows` sessions on arrival."""
        if self.is_first:
            return (rows, 1), "int32"
        return (self.in_banks + 1, rows, 1, self.args.hidden_size), self.spec.wire_dtype

    def run_rows(self, sessions: List[Session], seqs: List[int], offsets: List[int],
                 x: mx.array) -> List[Output]:
        """One decode position of each of several sessions as one batched forward pass.

        The sessions' caches are merged into batch caches (`DSACache.merge`: left-padded
        rows; mlx-lm's `ArraysCache.merge` for KDA state), the layers run once on B rows,
        and each session gets its rows back (`extract`), so a session's state is what a
        single step would have left (the one-process batch path's caches and masks).
        The last stage samples each row with its session's own sampler (and PRNG key).

        Args:
            sessions: B distinct sessions, each past its prefill (no pending verify).
            seqs / offsets: each session's next sequence number and position.
            x: as `rows_input_spec(B)` says.
        Returns one `Output` per row (hidden [K' + 1, B, 1, D] in the first, on a
        middle stage; token and optional logprobs on the last).
        Raises:
            Refused: a row out of order, a session twice, a pending verify, a bad token id.
        """
        if len({id(s) for s in sessions}) != len(sessions):
            raise Refused("a batched step names a session twice")
        for s, seq, off in zip(sessions, seqs, offsets):
            if s.verify is not None:
                raise Refused(f"session {s.session}: a batched decode step after a verify chunk")
            self.check(s, seq, off, 1, True)
        with self.lock:
            text = self.model.text
            h, banks = self._stage_input(x, "batched step")
            batch = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in sessions))]
            h, banks = text.run_layers(h, banks, batch, eval_each=True)
            outs = [Output() for _ in sessions]
            for i, s in enumerate(sessions):
                s.cache = [c.extract(i) for c in batch]
            states = [c.state for s in sessions for c in s.cache]
            if not self.is_last:
                hidden = mx.stack(banks.raw + [h]).astype(self.wire)
                mx.eval(hidden, states)
                outs[0].hidden = hidden
            else:
                logits = self.model.language_model.logits(text.finish(h, banks))[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                tokens = [self._sample(s, logprobs[i:i + 1]) for i, s in enumerate(sessions)]
                mx.eval(tokens, logprobs, states)
                for i, (s, t) in enumerate(zip(sessions, tokens)):
                    outs[i].token = int(t.item())
                    if s.return_logprobs:
                        outs[i].logprobs = logprobs[i].astype(mx.float32)
        now = time.monotonic()
        for s in sessions:
            s.next_seq += 1
            s.offset += 1
            s.last_active = now
        return outs

    def _settle(self, s: Session, keep: int) -> None:
        """Roll the pending verify chunk back to its first `keep` positions (exact for
        KDA state: `kimi_mlx.speculative.rollback`) and stop recording."""
        from kimi_mlx.speculative.rollback import RollbackError, end_verify, rollback

        try:
            rollback(s.cache, s.verify, keep)
        except RollbackError as e:
            raise Refused(f"session {s.session}: cannot roll back the verify chunk: {e}") from None
        finally:
            end_verify(s.cache)
        s.verify = None
        s.offset = s.verify_offset + keep

    def _sample(self, s: Session, logprobs: mx.array) -> mx.array:
        return s.sampler(logprobs)


def load_stage(path, spec: StageSpec, progress=None):
    """Load layers [spec.start, spec.end) of the checkpoint at `path` and return
    (StageRunner, LoadReport, tensor bytes evaluated).

    Reads only the shards and tensors of those layers (plus embedding / head at the
    ends). `progress(done_bytes, total_bytes)` is called after each part is read.

    Raises:
        CheckpointError / ConfigError: as `kimi_mlx.checkpoint.loader.load_model`.
    """
    from kimi_mlx.checkpoint.loader import eval_parameters, load_model

    model, _, report = load_model(path, spec.start, spec.end, lazy=True, verbose=False,
                                  activation_dtype=mx_dtype(spec.compute_dtype))
    total = eval_parameters(model, progress)
    return StageRunner(model, spec), report, total


def default_compute_dtype() -> str:
    """The activation dtype this machine asks for: "float32" on the CPU backend (bf16
    matmuls are slow there, see the loader), "" on a GPU (= the checkpoint's embedding
    dtype, as the loader does)."""
    return "float32" if mx.default_device() == mx.cpu else ""


__all__ = ["StageRunner", "StageSpec", "Session", "Output", "Refused",
           "load_stage", "default_compute_dtype"]
