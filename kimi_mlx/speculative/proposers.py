"""Proposers for speculative decoding inside continuous batching: what a drafter must do
for the batched verify loop (`kimi_mlx.speculative.batch.SpeculativeBatch`) to draft for
every row of a batch, one row's state per generator uid.

The loop keeps one invariant per row: before a step, the target's caches hold every
token of the row but `y`, the token the step feeds (sampled last step). A proposer's
state follows the target's:

  * `propose(uids, ys, want, samplings)`: the step's rows (in batch order), their y, and
    how many drafts each may have (0: none, the row still feeds y); returns each row's
    drafts and, for a sampled row, the drafter's log-distributions q they were drawn from
    ([m, V] float32; None: the drafts are deterministic, q one-hot);
  * `settle(accepted)`: after the verify, row b committed y and its first accepted[b]
    drafts (also called with zeros when the step is a plain one after all): the proposer
    keeps exactly those;
  * `plain(uids, ys)`: a plain decode step is about to feed `ys` ([B] uint32, possibly not
    evaluated yet) without any proposal;
  * `add(uid, context)` / `drop(uid)`: a row joins with its prompt ids (all of them: the
    generator has fed the last one when the row reaches decoding) / leaves.

Proposers: `NgramRows` (`--draft ngram`: each row's own `NgramIndex`),
`DraftModelRows` (a draft model: its caches batched row for row with the target's,
rows restored each to its own accepted length), and in `hidden_rows` the drafters of
the target's hidden states (`BlockDrafterRows`, `MtpRows`: `captures`, every batched
pass of the target keeps its hiddens for them). The acceptance rule stays the loop's
(`loop.accept_drafts`, greedy: the longest prefix equal to the target's argmax).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

__all__ = ["Proposer", "NgramRows", "DraftModelRows", "proposer_for", "batches_drafts"]


class Proposer(Protocol):
    """What the batched loop asks of a drafter (module doc). `drafts_every_row`: the
    proposer gives every row exactly the drafts it may have (a draft model), so the loop
    can decide whether to verify before paying for the proposal."""

    drafts_every_row: bool

    def add(self, uid: int, context: Sequence[int]) -> None: ...

    def drop(self, uid: int) -> None: ...

    def propose(self, uids: List[int], ys: List[int], want: List[int], samplings: List[Any]
                ) -> Tuple[List[List[int]], List[Optional[mx.array]]]: ...

    def settle(self, accepted: List[int]) -> None: ...

    def plain(self, uids: List[int], ys: mx.array) -> None: ...


class NgramRows:
    """`--draft ngram` for a batch: each row's `NgramIndex` over its prompt and output.

    Args:
        draft: the `ngram.NgramDraft` (its n-gram sizes).
    """

    drafts_every_row = False  # a row without a match gets none

    def __init__(self, draft):
        self.draft = draft
        self.index: Dict[int, Any] = {}
        self._props: List[List[int]] = []
        self._uids: List[int] = []
        self._pending: Optional[Tuple[List[int], mx.array]] = None  # a plain step's feed

    def add(self, uid: int, context: Sequence[int]) -> None:
        self.index[uid] = self.draft.index(list(context))

    def drop(self, uid: int) -> None:
        self.index.pop(uid, None)

    def _catch_up(self) -> None:
        """Append what the last plain step fed (read only now: the step ran since)."""
        if self._pending is not None:
            uids, ys = self._pending
            self._pending = None
            for uid, y in zip(uids, ys.tolist()):
                if uid in self.index:
                    self.index[uid].append(y)

    def plain(self, uids: List[int], ys: mx.array) -> None:
        self._catch_up()
        self._pending = (list(uids), ys)

    def propose(self, uids, ys, want, samplings):
        self._catch_up()
        props = []
        for uid, y, w in zip(uids, ys, want):
            idx = self.index.get(uid)
            if idx is not None:
                idx.append(y)
            props.append(idx.propose(w) if idx is not None and w > 0 else [])
        self._uids, self._props = list(uids), props
        return props, [None] * len(props)

    def settle(self, accepted: List[int]) -> None:
        for uid, p, n in zip(self._uids, self._props, accepted):
            if n and uid in self.index:
                self.index[uid].extend(p[:n])
        self._props = []


def _vocab_align(logits: mx.array, vocab: Optional[int]) -> mx.array:
    from kimi_mlx.speculative.loop import _vocab_align as align

    return align(logits, vocab)


class DraftModelRows:
    """A draft model for a batch: its caches hold the batch's rows in the generator's
    order (one batched cache per draft layer: `ArraysCache` rows for KDA layers, mlx-lm's
    `BatchKVCache` / our `BatchDSACache` for attention layers, each made by the single
    cache's `merge`), filtered and extended as rows leave and join.

    A row joins with its whole prompt prefilled alone (B = 1, `prefill_step` tokens per
    pass) the first time it is in a step. Per step the draft runs K + 1 batched one-token
    passes (K the most drafts any row may have): y, d1, .., dK, the last only so that a
    row that accepts all K holds dK; `settle` puts each row back to the pass after its
    accepted count: KDA rows picked from the per-pass states (references, no copy), KV
    rows trimmed per row (`rollback._trim_rows`: the rejected tail becomes left padding).
    Drafts are the draft's argmax for greedy rows, else drawn from the row's own sampling
    of the draft's logits (`Sampling.log_probs`, returned as q for `accept_drafts`).
    Plain steps (the verify gate closed, nothing to draft) run no draft pass: their
    tokens are fed in one multi-token pass before the next proposal (`_catch_up`).

    Args:
        model: the draft (kimi-mlx or mlx-lm model, the target's tokenizer).
        vocab: the target's vocabulary size (draft logits cut or padded to it), or None.
        prefill_step: prompt tokens per prefill pass of a joining row.
    Raises (from `propose` / `plain`): whatever the draft's forward pass raises; a
    `rollback.RollbackError` for a draft cache type that has no per-row trim.
    """

    drafts_every_row = True

    def __init__(self, model, vocab: Optional[int] = None, prefill_step: int = 512):
        self.model, self.vocab, self.prefill_step = model, vocab, prefill_step
        self.cache: Optional[List[Any]] = None  # batched caches of rows `self.uids`
        self.uids: List[int] = []
        self.contexts: Dict[int, List[int]] = {}  # rows added, not prefilled yet
        self._snaps: Optional[List[List[Any]]] = None  # per pass of the last propose
        self._pending: List[Tuple[List[int], mx.array]] = []  # plain steps' feeds (`plain`)

    def add(self, uid: int, context: Sequence[int]) -> None:
        self.contexts[uid] = list(context)

    def drop(self, uid: int) -> None:
        self.contexts.pop(uid, None)
        if uid in self.uids:  # its cache row goes now (memory back as the row leaves)
            self._sync([u for u in self.uids if u != uid])

    def _prefill(self, ids: List[int]) -> List[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        cache = (self.model.make_cache() if hasattr(self.model, "make_cache")
                 else make_prompt_cache(self.model))
        for s in range(0, len(ids), self.prefill_step):
            self.model(mx.array(ids[s : s + self.prefill_step], mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    def _sync(self, uids: List[int]) -> None:
        """Make the batched caches hold rows `uids` in that order."""
        uids = list(uids)
        if uids == self.uids:
            return
        want = set(uids)
        keep = [i for i, u in enumerate(self.uids) if u in want]
        if len(keep) < len(self.uids):
            if keep:
                for c in self.cache:
                    c.filter(keep)
            else:
                self.cache = None
            self.uids = [self.uids[i] for i in keep]
        have = set(self.uids)
        new = [u for u in uids if u not in have]
        if new:
            # a row never added (not registered by the caller) starts empty: it is never
            # drafted (its `_Row` is missing), the draft only keeps the batch's shape
            singles = [self._prefill(self.contexts.pop(u, [])) for u in new]
            merged = [type(col[0]).merge(list(col)) for col in zip(*singles)]
            if self.cache is None:
                self.cache = merged
            else:
                for a, b in zip(self.cache, merged):
                    a.extend(b)
            self.uids += new
        if self.uids != uids:
            order = [self.uids.index(u) for u in uids]
            for c in self.cache:
                c.filter(order)
            self.uids = uids

    def _step(self, tokens: mx.array) -> mx.array:
        """One batched pass: tokens [B] -> draft logits [B, vocab]."""
        logits = self.model(tokens.astype(mx.uint32)[:, None], cache=self.cache)[:, -1]
        return _vocab_align(logits.astype(mx.float32), self.vocab)

    def plain(self, uids: List[int], ys: mx.array) -> None:
        """Noted, not run: the draft catches up on every plain step's tokens in one
        multi-token pass when it next drafts (`_catch_up`), so steps that the verify
        gate keeps plain cost the draft nothing."""
        self._pending.append((list(uids), ys))
        self._snaps = None

    def _catch_up(self, uids: List[int]) -> None:
        """Feed the rows already in the draft's batch the tokens the plain steps since
        its last pass fed (the same count for each: a row in the batch was in every one
        of those steps), in one [B, P] pass; a row not in it yet takes them into the
        context it is prefilled with."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        fed: Dict[int, List[int]] = {}
        for step_uids, ys in pending:
            for u, y in zip(step_uids, ys.tolist()):
                fed.setdefault(u, []).append(int(y))
        want = set(uids)
        self._sync([u for u in self.uids if u in want])  # rows that left: gone first
        for u, toks in fed.items():
            if u not in self.uids and u in self.contexts:
                self.contexts[u].extend(toks)
        if self.uids:
            rows = [fed.get(u, []) for u in self.uids]
            if len({len(r) for r in rows}) != 1:
                raise RuntimeError(f"draft rows {self.uids} missed different numbers of "
                                   f"plain steps {[len(r) for r in rows]}")
            if rows[0]:
                self.model(mx.array(rows, mx.uint32), cache=self.cache)

    def propose(self, uids, ys, want, samplings):
        from kimi_mlx.speculative.rollback import snapshot

        B, K = len(uids), max(want) if want else 0
        if not K:  # nothing to draft: as a plain step
            self.plain(uids, mx.array(ys, mx.uint32))
            return [[] for _ in range(B)], [None] * B
        self._catch_up(uids)
        self._sync(uids)
        feed = mx.array(ys, mx.uint32)
        sampled = [w > 0 and not s.greedy for w, s in zip(want, samplings)]
        drafts, qs, snaps = [], [[] for _ in range(B)], []
        for j in range(K + 1):
            logits = self._step(feed)
            snaps.append(snapshot(self.cache))
            if j == K:
                break
            d = mx.argmax(logits, axis=-1)
            if any(sampled):
                picks = []
                for b in range(B):
                    if sampled[b]:
                        lq = samplings[b].log_probs(logits[b])
                        qs[b].append(lq)
                        picks.append(mx.random.categorical(lq).astype(d.dtype))
                    else:
                        picks.append(d[b])
                d = mx.stack(picks)
            drafts.append(d)
            feed = d
        self._snaps = snaps
        d_all = mx.stack(drafts, axis=1)  # [B, K]
        mx.eval(d_all)
        rows = d_all.tolist()
        props = [rows[b][: want[b]] for b in range(B)]
        q = [mx.stack(qs[b][: want[b]]) if sampled[b] else None for b in range(B)]
        return props, q

    def settle(self, accepted: List[int]) -> None:
        from kimi_mlx.speculative.rollback import _trim_rows

        snaps, self._snaps = self._snaps, None
        if snaps is None:
            return
        K = len(snaps) - 1
        if all(n == K for n in accepted):
            return  # every row keeps all K + 1 passes: the caches as they are
        B = len(accepted)
        at = mx.array(accepted, mx.int32)
        for i, c in enumerate(self.cache):
            if isinstance(c, ArraysCache):
                c.cache = [None if snaps[0][i][e] is None else
                           mx.stack([s[i][e] for s in snaps])[at, mx.arange(B)]
                           for e in range(len(c.cache))]
            else:
                _trim_rows(c, [K - n for n in accepted], i)


def batches_drafts(draft, captures: bool = False) -> bool:
    """Whether `draft` can speculate inside a batch: n-gram drafts, and draft models
    (their caches batched with the target's rows, `DraftModelRows`); the MTP and block
    drafters where the deployment's target passes can keep their hidden states
    (`captures`: the one-process server, `hidden_rows`)."""
    from kimi_mlx.speculative.loop import OwnLoop
    from kimi_mlx.speculative.ngram import NgramDraft

    if isinstance(draft, NgramDraft) or not isinstance(draft, OwnLoop):
        return True
    return captures and _hidden_proposer(draft) is not None


def _hidden_proposer(draft):
    """The `hidden_rows` class for an MTP or a block drafter, else None."""
    from kimi_mlx.speculative.block_loop import BlockDraft
    from kimi_mlx.speculative.hidden_rows import BlockDrafterRows, MtpRows
    from kimi_mlx.speculative.mtp import MTP

    if isinstance(draft, BlockDraft):
        return BlockDrafterRows
    if isinstance(draft, MTP):
        return MtpRows
    return None


def proposer_for(draft, vocab: Optional[int] = None) -> Proposer:
    """The batched proposer of a draft (`batches_drafts`).

    Raises:
        ValueError: a draft that brings its own one-sequence loop and has no batched
        proposer.
    """
    from kimi_mlx.speculative.ngram import NgramDraft

    if isinstance(draft, NgramDraft):
        return NgramRows(draft)
    hidden = _hidden_proposer(draft)
    if hidden is not None:
        return hidden(draft)
    if not batches_drafts(draft):
        raise ValueError(f"{type(draft).__name__} does not draft inside a batch")
    return DraftModelRows(draft, vocab)
