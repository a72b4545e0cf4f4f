"""One request on a remote target, written once for the pipeline and the tensor group.

A remote session is the stand-in model that the head's loops drive for one request
(mlx-lm's `generate_step` and the speculative loops of `kimi_mlx.speculative`), whose
layers run elsewhere: a pipeline's stages (`head.pipeline.PipelineTarget`) or a tensor
group's ranks (`tensor.step.GroupTarget`). What both targets do the same way lives here:

* keep/trim: a verify step (speculative decoding) is recorded by every stage / rank; the
  loop's rollback trims the stand-in cache (`speculative.remote_cache.RemoteCache`), and
  the positions kept ride on the next message (`take_keep`), after which every stage /
  rank rolls its own caches back exactly;
* the split between prefill positions (the prompt but its last token) and decode /
  verify positions, for plain calls and for block drafters' `forward_capture`;
* the prefill (`prefill`): chunks of at most `prefill_chunk` tokens that also end at
  the prompt-cache snapshot points (`prefill_chunks`), a snapshot kept after the chunks
  that end at one, each chunk carrying the image rows of its own `<|media_pad|>` tokens
  (`chunk_media`), and, for a scored prompt (`/v1/completions` echo + logprobs), the
  scores of every prompt position;
* decoding (`decode`, `generate`): mlx-lm's `generate_step` from the last prompt token,
  with the request's sampler and logits processors, as one process runs it
  (`server.engine`), so processors and sampling happen in mlx-lm's order on the head.
  Where a target can sample at its far end (a pipeline's last stage) the session may do
  so (`stage_samples`) to save sending the logits: each step is then one message whose
  token comes back, with no look-ahead step (mlx-lm's loop asks for step n + 1 before it
  yields token n, which through a pipeline would cost a round trip before the first
  token).

A target implements `_prefill_chunk` (one prompt chunk, with its media, snapshot key and
score targets), `_prefill_call` (prompt positions the loops send through `__call__`),
`_decode` (one decode / verify message) and `end`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

__all__ = ["RemoteSession", "prefill_chunks", "chunk_media", "media_rows", "generate",
           "speculative_run"]


def prefill_chunks(n_prompt: int, chunk: int, start: int = 0,
                   stops: Sequence[int] = ()) -> List[Tuple[int, int]]:
    """(offset, length) of the prefill chunks for a prompt of `n_prompt` tokens: tokens
    [start, n_prompt - 1) in chunks of at most `chunk` (as mlx-lm's generate_step with
    prefill_step_size=chunk), also ending at each position of `stops` (prompt-cache
    snapshot points); the last token is left to decoding."""
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
    pad = media[0]
    k = sum(1 for t in prompt[offset:offset + length] if t == pad)
    if not k:
        return None
    before = sum(1 for t in prompt[:offset] if t == pad)
    return pad, media[1][before:before + k]


def media_rows(vision, images: Sequence[object], pad: int, lock: Optional[threading.Lock] = None):
    """(pad id, rows [sum of the images' tokens, hidden]) for a session's `prefill`: the
    head runs the vision tower and projector (`generation.images.Vision`), under `lock`
    (one tower run at a time; requests run on several threads)."""
    if lock is None:
        rows = vision.features(images)
        mx.eval(rows)
        return pad, rows
    with lock:
        rows = vision.features(images)
        mx.eval(rows)
    return pad, rows


class RemoteSession:
    """A remote target for one request, called like a model on ids [1, T] (module doc).

    Positions before `n_prefill` are prefill: `__call__` runs them and returns None in
    place of logits (the loops ignore prefill output). Later positions are decode steps
    returning logits float32 [1, T, vocab]; with `record` they are verify steps that the
    loop may trim (`trim`, as a KV cache) until the next message.

    Attributes:
        offset: positions the target holds (after the pending keep).
        cached: prompt positions restored from a prompt-cache snapshot.
        prefill_chunk: prompt tokens per prefill message.
        what: the target's name in errors ("the pipeline", "the tensor group").
    """

    what = "the remote target"
    return_logprobs = False  # a far end that samples (stage_samples) also sends them

    def __init__(self, n_prefill: int, prefill_chunk: int, record: bool = False,
                 stage_samples: bool = False):
        if prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {prefill_chunk}")
        self.n_prefill, self.prefill_chunk = int(n_prefill), int(prefill_chunk)
        self.record, self.stage_samples = record, stage_samples
        self.layers = [None]  # one stand-in cache (mlx-lm's target/draft cache split)
        self.offset = 0
        self.cached = 0
        self._pending: Optional[int] = None  # start of the last verify step, while trimmable
        self._stage_token: Optional[int] = None  # the far end's token (stage_samples)

    # -- keep / trim --------------------------------------------------------------------
    def make_cache(self) -> List[Any]:
        from kimi_mlx.speculative.remote_cache import RemoteCache

        return [RemoteCache(self)]

    def trim(self, n: int) -> int:
        """Drop the last n positions of the pending verify step (sent as the next message's
        keep). ValueError for anything else (a prefill cannot be taken back)."""
        if n < 0 or self._pending is None or self.offset - n < self._pending:
            raise ValueError(f"{self.what} can only drop positions of the last verify step "
                             f"(asked to drop {n} at position {self.offset})")
        self.offset -= n
        return n

    def take_keep(self) -> Optional[int]:
        """The positions of the pending verify step to keep (None when none is pending),
        for the next message; the step is settled from then on."""
        if self._pending is None:
            return None
        keep, self._pending = self.offset - self._pending, None
        return keep

    # -- the model the loops call ---------------------------------------------------------
    def __call__(self, inputs: mx.array, cache=None, **kwargs):
        return self._forward(inputs, None)[0]

    def forward_capture(self, inputs: mx.array, layer_ids: Sequence[int]):
        """As a call on ids [1, T], also returning the hidden states leaving layers
        `layer_ids` (a block drafter's `target_layer_ids`, any order, no repeats) at these
        T positions: (logits float32 [1, T, vocab], or None for prefill positions;
        hiddens [1, T, n * hidden], layer j's rows at [..., j * hidden : (j + 1) * hidden],
        as `speculative.block_loop.target_forward` concatenates them in one process).
        Raises ValueError for repeated layer ids, and what the target raises."""
        ids = [int(i) for i in layer_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"capture layer ids {ids} repeat a layer")
        return self._forward(inputs, ids)

    def _forward(self, inputs: mx.array, capture: Optional[List[int]]):
        ids = [int(t) for t in inputs.reshape(-1).tolist()]
        T = len(ids)
        if self.offset + T <= self.n_prefill:
            hidden = self._prefill_call(ids, capture)
            return None, hidden
        if self.offset < self.n_prefill:
            raise ValueError(f"a forward call of {T} tokens at position {self.offset} mixes "
                             f"prompt (before {self.n_prefill}) and decode positions")
        start = self.offset
        out = self._decode(ids, self.take_keep(), capture)
        if self.record:
            self._pending = start
        self.offset += T
        return out

    # -- prefill ------------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int], *, snapshots: Optional[Dict[int, str]] = None,
                stops: Sequence[int] = (), media=None, score: Optional[int] = None) -> list:
        """Run prompt[offset:-1] through the target in chunks of `prefill_chunk` that also
        end at `snapshots` and `stops` (`prefill_chunks`).

        Args:
            prompt: the prompt's token ids (offset: its positions already held).
            snapshots: {position e: prompt-cache key}: the target keeps a snapshot of the
                first e positions under the key after the chunk that ends there.
            stops: more chunk ends, with no snapshot (a cache-free prefill ends its chunks
                at the policy's points, so its float operations are those of a restored one).
            media: (pad id, rows [pads in prompt, hidden], or a callable returning them,
                called only when a chunk left to prefill holds a pad): each chunk carries
                the rows of its own pads.
            score: top alternatives (0..20) to score every prompt position with: returns
                one `server.jobs.TokenOut` per token of prompt[offset + 1:], in order.
        Returns:
            the scores (empty without `score`).
        """
        prompt = [int(t) for t in prompt]
        snapshots = snapshots or {}
        if media is not None and callable(media[1]):
            media = _LazyRows(media)
        answers = []
        for off, n in prefill_chunks(len(prompt), self.prefill_chunk, self.offset,
                                     list(snapshots) + list(stops)):
            rows = chunk_media(media, prompt, off, n)
            targets = prompt[off + 1:off + n + 1] if score is not None else None
            answers.append(self._prefill_chunk(prompt[off:off + n], rows, snapshots.get(off + n),
                                               targets, score))
            self.offset += n
        out: list = []
        for a in answers:  # a target that streams its chunks answers them in order here
            if a is not None:
                out.extend(a() if callable(a) else a)
        return out

    # -- decoding -----------------------------------------------------------------------
    def decode(self, prompt: Sequence[int], max_tokens: int, sampler=None,
               logits_processors=None) -> Iterator[Tuple[int, Optional[mx.array]]]:
        """Yield (token, logprobs float32 [vocab] or None) from the prompt's last token on
        (the rest held: `offset` = len(prompt) - 1).

        On the head: mlx-lm's `generate_step` over this session with `sampler` and
        `logits_processors` (mlx-lm's; they see the last prompt token and the tokens
        generated, as in one process). With `stage_samples` the target's far end samples
        with the request's own settings: each step is one message whose token comes
        back (logprobs only with `return_logprobs`); nothing is chosen here.
        Raises ValueError: the prefill does not hold the prompt but its last token;
        logits processors on a session whose far end samples."""
        from mlx_lm.generate import generate_step

        if self.offset != len(prompt) - 1:
            raise ValueError(f"decoding from position {self.offset} of a {len(prompt)}-token "
                             f"prompt (the prefill must hold all but its last token)")
        if self.stage_samples:
            if logits_processors:
                raise ValueError("logits processors need the logits on the head "
                                 "(a session whose far end samples has none)")
            return self._stage_decode(int(prompt[-1]), max_tokens)
        return generate_step(mx.array(list(prompt[-1:])), self, max_tokens=max_tokens,
                             sampler=sampler, logits_processors=logits_processors)

    def _stage_decode(self, token: int, max_tokens: int):
        n = 0
        while n != max_tokens:
            logits = self._forward(mx.array([token]), None)[0]
            token, self._stage_token = self._stage_token, None
            if token is None:
                raise ValueError(f"{self.what} returned no sampled token")
            yield token, (logits[0, -1] if self.return_logprobs else None)
            n += 1

    # -- what a target implements ---------------------------------------------------------
    def _prefill_chunk(self, ids: List[int], media, snapshot: Optional[str],
                       targets: Optional[List[int]], top_k: Optional[int]):
        """Run prompt chunk `ids` at `offset` (media: (pad id, rows) of its pads or None;
        snapshot: a key to keep a snapshot under after it, or None; targets: the tokens
        each position predicts, to be scored with `top_k` alternatives, or None). Returns
        None, the chunk's scores, or a callable returning them (awaited after all the
        chunks are sent)."""
        raise NotImplementedError

    def _prefill_call(self, ids: List[int], capture: Optional[List[int]]):
        """Run prefill positions `ids` from the loops (advancing `offset`); returns the
        captured hiddens [1, T, n * hidden] with `capture`, else None."""
        raise NotImplementedError

    def _decode(self, ids: List[int], keep: Optional[int], capture: Optional[List[int]]):
        """One decode / verify message for `ids` at `offset` carrying the previous verify
        step's `keep`: returns (logits float32 [1, T, vocab], hiddens or None). With
        `stage_samples` a 1-token step also sets `_stage_token`."""
        raise NotImplementedError

    def end(self, ok: bool = True) -> None:
        """End the request on the target (settling the pending verify step); `ok` False:
        it failed, do not wait on the target."""
        raise NotImplementedError


class _LazyRows:
    """(pad id, rows) whose rows come from a callable, called once on first use."""

    def __init__(self, media):
        self.pad, self._make, self._rows = media[0], media[1], None

    def __getitem__(self, i: int):
        if i == 0:
            return self.pad
        if self._rows is None:
            self._rows = self._make()
        return self._rows


def generate(session, prompt: Sequence[int], max_tokens: int, *, sampler=None,
             logits_processors=None, snapshots: Optional[Dict[int, str]] = None,
             stops: Sequence[int] = (), media=None, score: Optional[int] = None,
             scores: Optional[list] = None,
             run: Optional[Callable[[RemoteSession], Iterator]] = None) -> Iterator[tuple]:
    """One request through a remote session: prefill (`RemoteSession.prefill`), then
    decode (`RemoteSession.decode`, or `run(session)`: a speculative loop over it, which
    prefills the prompt itself); the session is ended however this ends (closed early,
    raised), as failed when it raised.

    Args:
        session: a `RemoteSession`, or a callable returning one (opened on first use, so a
            generator never started opens nothing).
        prompt: token ids (at least one). max_tokens: tokens to yield (-1: no limit; 0:
            only the prompt, with `score`).
        sampler / logits_processors: mlx-lm's (`kimi_mlx.sampling.Sampling.sampler()`,
            `.logits_processors()`).
        snapshots / stops / media / score: as `RemoteSession.prefill`; the scores are
            appended to `scores` before the first token is yielded.
    Yields:
        what `decode` (or `run`) yields: (token, logprobs or None[, from_draft]).
    Raises:
        ValueError: empty prompt, max_tokens 0 without `score`; what the target raises.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    if max_tokens == 0 and score is None:
        raise ValueError("max_tokens 0 generates nothing; it needs `score`")
    if score is not None and scores is None:
        raise ValueError("scoring needs a `scores` list")
    s = session() if callable(session) and not isinstance(session, RemoteSession) else session
    ok = False
    try:
        if run is not None:
            gen = run(s)
        else:
            got = s.prefill(prompt, snapshots=snapshots, stops=stops, media=media, score=score)
            if scores is not None:
                scores.extend(got)
            if max_tokens == 0:
                ok = True
                return
            gen = s.decode(prompt, max_tokens, sampler, logits_processors)
        try:
            yield from gen
        finally:
            gen.close()
        ok = True
    except GeneratorExit:  # the caller stopped early (end of message): a clean end
        ok = True
        raise
    finally:
        s.end(ok)


def speculative_run(prompt: Sequence[int], draft, *, num_draft_tokens, max_tokens: int,
                    sampling=None, stats=None, prefill_step: int = 2048):
    """`run` for `generate` over a session opened with `record`: the one-process
    speculative loop for `draft` (`kimi_mlx.speculative.loop.loop_for`: a draft model, or
    `NgramDraft` whose own loop runs) with the draft on the head, the session as its
    target (its one stand-in cache, then the draft's); yields (token, logprobs [vocab],
    from_draft) as `speculative_generate_step`. `num_draft_tokens`: k >= 1, or "auto" /
    an `AutoK` (ValueError for k < 1, `speculative.auto_k.draft_policy`)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kimi_mlx.speculative.auto_k import draft_policy
    from kimi_mlx.speculative.loop import loop_for

    k = draft_policy(num_draft_tokens)

    def run(session):
        caches = session.make_cache() + make_prompt_cache(draft)
        return loop_for(draft)(list(prompt), session, draft, num_draft_tokens=k,
                               max_tokens=max_tokens, sampling=sampling, prompt_cache=caches,
                               prefill_step_size=prefill_step, stats=stats)

    return run
