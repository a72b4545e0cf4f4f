"""Rank 0 drives, the other ranks follow: every forward pass of a tensor-parallel group as
a command from rank 0, so that every rank runs the same collectives in the same order.

Rank 0 runs the whole request path (mlx-lm's `generate_step`, the speculative loops of
`kimi_mlx.speculative`, sampling, stop rules, cancellation) over `GroupTarget`, a
stand-in model: each call broadcasts one command, [op, T, keep, flags, up to `INLINE`
token ids] int32 (an all_sum to which only rank 0 contributes; longer inputs, i.e.
prefill chunks, follow in a second broadcast), then runs the sharded model on its own
caches like every other rank (`follow_commands`). So the ranks issue the same collectives
in the same order whatever rank 0 decides, and only rank 0 decides: a request stopped
early (EOS, stop string, client gone) ends with an END command, never with ranks waiting
in different collectives.

Speculative decoding (the draft on rank 0 only): post-prefill forward passes are verify
steps on every rank (`kimi_mlx.speculative.rollback.begin_verify` before the pass). The
loop's own rollback trims the stand-in cache (as `head.pipeline.PipelineTarget`
does for the pipeline); how many positions of the step it keeps rides on the next
command (`keep`), and every rank then rolls its real caches back exactly (KDA states
replayed from the recorded inputs, DSA caches trimmed: `rollback` + `end_verify`), in
lockstep. Greedy output is therefore the plain output token for token; `--draft ngram`
(its own loop, `NgramDraft.generate_step`) runs over the same stand-in.

Block drafters (DFlash / DSpark, `speculative.block_loop`): they read the
target's hidden states at their `target_layer_ids`. After each layer's all_sums every rank
holds the full residual stream, so rank 0 captures them from its own pass
(`GroupTarget.forward_capture`; the server's child sends them back with the logits,
`tensor.relay`); the command's HIDDEN flag only makes every rank evaluate the whole layer
stack in a prefill chunk, so that all run the same all_sums. No cost without a drafter.

Cost: one small extra all_sum per forward pass (the command); the token sampled by rank
0 travels in the next command instead of an all_sum of its own.

Prompt cache (`tensor.prompt_cache`): RESTORE begins a request from the longest
of the offered snapshot keys every rank holds (agreed by all_sums, else a full prefill on
every rank); SNAPSHOT (after a prefill chunk) has every rank keep its shard of the caches
under the key rank 0 names. Images (MEDIA, a prefill chunk holding image pads): rank 0
ran the tower; the chunk's projector rows follow the command in one float32 broadcast,
and every rank embeds them as one process does (`embed_with_media`).

Batched rows (`tensor.rows`): ops 16..29 carry the cache operations and
the [B, L] forward passes of mlx-lm's `BatchGenerator` on rank 0 (`rows.GroupRows`); every
rank applies them to its own caches of the rows (`rows.RowCaches`), beside this module's
one-request caches.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from kimi_mlx.cluster.tensor.wire import (HEADER, HIDDEN, INLINE, LOGITS, MEDIA,  # noqa: F401
                                          OP_BEGIN, OP_END, OP_EXIT, OP_FORWARD, OP_RESTORE,
                                          OP_SNAPSHOT, RECORD, _media, broadcast, command)
from kimi_mlx.cluster.net.session import RemoteSession


class _Runner:
    """One rank's caches for the request in flight and its pending verify step; `store`:
    this rank's prompt-cache snapshots (`KeyedSnapshotCache`, or None)."""

    def __init__(self, model, store=None, rank: int = 0):
        self.model = model
        self.store = store
        self.rank = rank
        self.cache: Optional[List[Any]] = None
        self.verify = None

    def begin(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache, self.verify = make_prompt_cache(self.model), None

    def restore(self, keys: Sequence[str], group) -> int:
        """Begin from the longest of `keys` every rank holds (`prompt_cache.agree_restore`,
        collectives on every rank), else fresh; returns the positions restored."""
        from kimi_mlx.cluster.tensor.prompt_cache import agree_restore

        cache, n = agree_restore(self.store, keys, group)
        if cache is None:
            self.begin()
        else:
            self.cache, self.verify = cache, None
        return n

    def snapshot(self, key: str) -> None:
        """Keep this rank's caches under `key` (its length the positions held; no pending
        verify step: snapshots are taken during prefill). Nothing without a store; a store
        that fails only leaves this rank without it (a later restore is agreed)."""
        import sys

        from kimi_mlx.cluster.net.cache_keys import key_length

        if self.store is not None and self.cache is not None:
            try:
                self.store.store(key, key_length(key), self.cache)
            except Exception as e:  # noqa: BLE001 - a miss later, never a wrong state
                print(f"[tensor] rank {self.rank}: prompt-cache snapshot {key} not kept: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def settle(self, keep: int) -> None:
        """Roll the pending verify step back to its first `keep` positions (-1: none pending)."""
        from kimi_mlx.speculative.rollback import end_verify, rollback

        if self.verify is not None:
            if keep >= 0:
                rollback(self.cache, self.verify, keep)
            end_verify(self.cache)
            self.verify = None

    def forward(self, ids: Sequence[int], keep: int, flags: int, group=None, media=None,
                capture: Optional[Sequence[int]] = None):
        """Settle, then run `ids` through the sharded model; evaluates the caches (and the
        logits [1, T, V] when flags has LOGITS, which it returns; else None). With MEDIA
        in flags the chunk's image rows are broadcast first (`_media`: `group`, and on
        rank 0 `media` = (pad id, rows [pads in ids, hidden])) and embedded in place of
        the pads.

        With HIDDEN in flags (not with MEDIA) every rank evaluates the whole layer stack
        (the same all_sums on every rank); rank 0 passes `capture` (a block drafter's
        `target_layer_ids`) and gets the hidden states those layers output, concatenated
        [1, T, n * hidden] (every rank holds the full residual stream after each layer's
        all_sums, so this adds no collective): returns (logits or None, hiddens),
        evaluated. Without HIDDEN (the default) nothing changes."""
        from kimi_mlx.speculative.rollback import begin_verify

        if self.cache is None:
            self.begin()
        self.settle(keep)
        if flags & RECORD:
            self.verify = begin_verify(self.cache)
        x = mx.array(list(ids), mx.uint32)
        if flags & HIDDEN:
            from kimi_mlx.model.attn_res import Banks

            if flags & MEDIA:
                raise ValueError("hidden-state capture with image rows is not supported")
            text = self.model.text
            cap = {i: None for i in (capture or ())}
            h, banks = text.run_layers(text.embed(x[None]), Banks(self.model.args.rms_norm_eps),
                                       self.cache, capture=cap)
            out = (self.model.language_model.logits(text.finish(h, banks))
                   if flags & LOGITS else None)
            hid = mx.concatenate([cap[i] for i in capture], axis=-1) if capture else None
            mx.eval(h, [a for a in (out, hid) if a is not None], [c.state for c in self.cache])
            return (out, hid) if capture is not None else out
        if flags & MEDIA:
            pad, rows = _media(group, media)
            emb = self.model.embed_with_media(x, rows, pad)
            out = self.model(x[None], cache=self.cache, input_embeddings=emb[None])
        else:
            out = self.model(x[None], cache=self.cache)
        if flags & LOGITS:
            mx.eval(out, [c.state for c in self.cache])
            return out
        mx.eval([c.state for c in self.cache])
        return None

    def end(self, keep: int) -> None:
        self.settle(keep)
        self.cache = None


def follow_commands(model, group, store=None) -> int:
    """The loop of ranks 1..N-1: run rank 0's commands until EXIT; returns the number of
    requests (BEGIN .. END) run. `store`: this rank's prompt-cache snapshots
    (`KeyedSnapshotCache`) or None (it then misses every restore)."""
    from kimi_mlx.cluster.tensor.prompt_cache import decode_keys
    from kimi_mlx.cluster.tensor.rows import ROW_OPS, RowCaches

    runner, done = _Runner(model, store, group.rank()), 0
    rows = RowCaches(model, store, group.rank())  # the batched rows (`tensor.rows`)
    while True:
        op, ids, keep, flags = command(group)
        if op == OP_EXIT:
            return done
        if op in ROW_OPS:
            rows.apply(op, ids, flags, group)
        elif op == OP_BEGIN:
            runner.begin()
        elif op == OP_RESTORE:
            runner.restore(decode_keys(ids), group)
        elif op == OP_SNAPSHOT:
            runner.snapshot(decode_keys(ids)[0])
        elif op == OP_FORWARD:
            runner.forward(ids, keep, flags, group)
        elif op == OP_END:
            runner.end(keep)
            done += 1
        else:
            raise RuntimeError(f"unknown command {op} from rank 0 (another kimi-mlx version?)")


class GroupTarget(RemoteSession):
    """Rank 0's stand-in model for one request (`net.session.RemoteSession`: keep/trim,
    prefill, decode): each call commands the group's forward pass and runs rank 0's own
    share (see the module doc).

    Prefill positions (before `n_prefill`) fill the caches only (prompt chunks through
    `prefill`, with image rows, snapshots and scores; the loops' calls return None in
    place of logits); later calls return logits [1, T, vocab] and, with `record`, are
    verify steps that the loop may trim (`trim`, as a KV cache). `end()` (always call it)
    sends END with the pending keep; after a failed collective (`broken`) it sends
    nothing.

    Args:
        model: rank 0's sharded model. group: the MLX group (this process rank 0).
        n_prefill: prompt tokens that are prefill (len(prompt) - 1).
        record: verify steps with rollback (speculative decoding); False for plain decoding.
        restore: prompt-cache keys (`prefix_key`s of prompt prefixes, longest first) to
            begin from: the longest every rank holds is restored on every rank and
            `offset` starts there (`cached`), else every rank begins fresh.
        store: rank 0's `KeyedSnapshotCache` (its shard's snapshots), or None.
        prefill_chunk: prompt tokens per forward command in `prefill`.
    """

    what = "the tensor group"

    def __init__(self, model, group, n_prefill: int, record: bool = False,
                 restore: Sequence[str] = (), store=None, prefill_chunk: int = 2048):
        super().__init__(n_prefill, prefill_chunk, record)
        self.model, self.group = model, group
        self.args = getattr(model, "args", None)  # vocab_size for the speculative loops
        self.broken = False
        self._runner = (group.make_runner(model) if hasattr(group, "make_runner")
                        else _Runner(model, store))  # rank 0 in a child: it does the work
        if restore:
            from kimi_mlx.cluster.tensor.prompt_cache import encode_keys

            self._send(OP_RESTORE, encode_keys(restore))
            self.offset = self._run(self._runner.restore, restore, group)
        else:
            self._send(OP_BEGIN)
            self._runner.begin()
        self.cached = self.offset  # prompt positions restored from the prompt cache

    def snapshot(self, key: str, at: Optional[int] = None) -> None:
        """Every rank keeps its shard of the caches under `key` (a `prefix_key` of the
        positions run so far, `at` (default `offset`); prefill only)."""
        from kimi_mlx.cluster.net.cache_keys import key_length
        from kimi_mlx.cluster.tensor.prompt_cache import encode_keys

        at = self.offset if at is None else at
        if key_length(key) != at or self._pending is not None:
            raise ValueError(f"snapshot {key} asked at position {at}")
        self._send(OP_SNAPSHOT, encode_keys([key]))
        self._runner.snapshot(key)

    def _send(self, op, tokens=(), keep=-1, flags=0, media=None, capture=None):
        return self._run(command, self.group, op, tokens, keep, flags, media, capture)

    def _run(self, fn, *args, **kwargs):
        """fn(...), marking the group broken when it raises (a failed collective)."""
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    def _prefill_chunk(self, ids, media, snapshot, targets, top_k):
        if self.offset + len(ids) > self.n_prefill:
            raise ValueError(f"prefill of {len(ids)} tokens at {self.offset} passes the "
                             f"prompt's {self.n_prefill} prefill positions")
        flags = (MEDIA if media is not None else 0) | (LOGITS if targets is not None else 0)
        self._send(OP_FORWARD, ids, -1, flags, media)
        out = self._run(self._runner.forward, ids, -1, flags, self.group, media)
        scores = None
        if targets is not None:
            from kimi_mlx.server.scoring import score_logits

            scores = score_logits(out[0], targets, top_k)
        if snapshot:
            self.snapshot(snapshot, self.offset + len(ids))
        return scores

    def _prefill_call(self, ids, capture):
        flags = HIDDEN if capture is not None else 0
        self._send(OP_FORWARD, ids, -1, flags, capture=capture)
        out = (self._run(self._runner.forward, ids, -1, flags) if capture is None else
               self._run(self._runner.forward, ids, -1, flags, capture=capture))
        self.offset += len(ids)
        return out[1] if capture is not None else None

    def _decode(self, ids, keep, capture):
        keep = -1 if keep is None else keep
        flags = LOGITS | (RECORD if self.record else 0) | (HIDDEN if capture is not None else 0)
        self._send(OP_FORWARD, ids, keep, flags, capture=capture)
        if capture is None:
            return self._run(self._runner.forward, ids, keep, flags), None
        return self._run(self._runner.forward, ids, keep, flags, capture=capture)

    def end(self, ok: bool = True) -> None:
        """END the request on every rank (settling the last verify step); nothing after a
        failed collective."""
        if self.broken:
            return
        keep = self.take_keep()
        keep = -1 if keep is None else keep
        self._send(OP_END, keep=keep)
        self._runner.end(keep)


def score_prompt(model, group, ids: Sequence[int], top_k: int, step: Optional[int] = None):
    """Score a prompt's own tokens through the group (`/v1/completions` echo + logprobs).

    Begins a request on every rank and prefills ids[:-1] (`RemoteSession.prefill`, in
    chunks of `step` positions, default `server.scoring.SCORE_STEP`) with each chunk's
    logits kept on rank 0 and scored by `server.scoring.score_logits`, the one-process
    computation.

    Returns:
        (scores, target): one `TokenOut` per token of ids[1:], and the `GroupTarget`
        holding ids[:-1], from which the reply goes on (`net.session.generate` over it)
        or which the caller ends (`target.end()`).
    Raises:
        what the forward pass raises (RuntimeError: a collective failed); the request is
        ended on every rank first unless the group is broken.
    """
    from kimi_mlx.server.scoring import SCORE_STEP

    ids = [int(t) for t in ids]
    target = GroupTarget(model, group, len(ids) - 1, prefill_chunk=step or SCORE_STEP)
    try:
        out = target.prefill(ids, score=top_k)
    except BaseException:
        target.end()
        raise
    return out, target
