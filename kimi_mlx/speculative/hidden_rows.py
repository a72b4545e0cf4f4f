"""Proposers that draft from the target's hidden states, for the batched verify loop
(`kimi_mlx.speculative.batch.SpeculativeBatch`): a block drafter (DFlash / DSpark,
`BlockDrafterRows`) and the checkpoint's MTP layer (`MtpRows`).

Both follow `proposers.Proposer` and add what a drafter of hiddens needs (`captures`):

  * the batch's target runs through `forward(model, x, cache)` on every step (the
    generator's model is wrapped, `Capture`), which returns the logits and keeps the
    hiddens [B, L, ...] of that pass; so a batch with such a proposer never takes mlx-lm's
    plain step: a step without drafts is a one-token verify step, its hiddens kept too;
  * `prefill(model, ids, cache, start, step)`: a joining row's prompt (all but its last
    token) run alone with capture, its hiddens handed to `add(uid, context, hidden)`;
  * `joined(uids, ys)`: the generator's first step of new rows ran their last prompt
    token (hiddens kept by `forward`), `ys` the first sampled tokens;
  * `settle(accepted, nxt)`: row b committed y and its first accepted[b] drafts; their
    accepted[b] + 1 hiddens (the verify pass's first positions) become the row's context,
    paired (MTP) with the tokens that followed them: its accepted drafts, then nxt[b].

Each row keeps its own drafter state (the block drafter's context caches, the MTP
layer's cache and pending pairs), so rows at different lengths never share a cursor; the
drafter runs once per drafted row per step (the block drafter: one pass for k drafts).
The acceptance rule stays the loop's (greedy: the longest prefix equal to the target's
argmax; sampled rows: `loop.accept_drafts` with the q returned here). The rules for what
a row's drafter sees are the one-sequence loops' (`block_loop.block_generate_step`,
`mtp.mtp_generate_step`), so a row's drafts equal that loop's for the same context.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

__all__ = ["Capture", "BlockDrafterRows", "MtpRows"]


class Capture:
    """The batch generator's model with a capturing proposer: every call runs
    `proposer.forward` (logits [B, L, V]; the proposer keeps the hiddens), every other
    attribute is the model's."""

    def __init__(self, model, proposer):
        self.model, self.proposer = model, proposer

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if kwargs.get("input_embeddings") is not None:
            raise ValueError("a drafter of hidden states does not take input embeddings "
                             "in the batch (prompts are prefilled alone)")
        return self.proposer.forward(self.model, inputs, cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


class _HiddenRows:
    """The per-row bookkeeping shared by `BlockDrafterRows` and `MtpRows` (module doc);
    `_row(hidden, context)` makes a row's state, which has `propose(y, k, sampling)` ->
    (drafts [m] lazy uint32 or None, q [m, V] or None) and `commit(hidden [1, n, ...],
    tokens [n])`."""

    drafts_every_row = True
    captures = True

    def __init__(self):
        self.rows: Dict[int, Any] = {}
        self._hidden: Optional[mx.array] = None  # [B, L, ...] of the last forward
        self._uids: List[int] = []
        self._props: List[List[int]] = []

    def _capture(self, model, x, cache) -> Tuple[mx.array, mx.array]:
        raise NotImplementedError

    def forward(self, model, x: mx.array, cache) -> mx.array:
        """The target on tokens x [B, L]: logits [B, L, V]; the hiddens are kept."""
        logits, self._hidden = self._capture(model, x, cache)
        return logits

    def prefill(self, model, ids: Sequence[int], cache, start: int, step: int
                ) -> Optional[mx.array]:
        """Run ids[start:-1] through `model` into `cache` (B = 1), `step` at a time:
        their hiddens [1, n, ...] (None when there is nothing to run)."""
        body = list(ids[start:-1])
        parts = []
        for s in range(0, len(body), max(1, step)):
            _, h = self._capture(model, mx.array(body[s : s + step], mx.uint32)[None], cache)
            mx.eval(h, [c.state for c in cache])
            parts.append(h)
        return mx.concatenate(parts, axis=1) if parts else None

    def add(self, uid: int, context: Sequence[int], hidden: Optional[mx.array] = None) -> None:
        """Row `uid` joins: its prompt ids and the hiddens of its first positions (those
        `prefill` ran; None: it starts without context and gains it as it decodes)."""
        self.rows[uid] = self._row(hidden, list(context))

    def drop(self, uid: int) -> None:
        self.rows.pop(uid, None)

    def plain(self, uids, ys) -> None:
        raise RuntimeError("a drafter of hidden states needs every step's hiddens: the "
                           "batch verifies every step (SpeculativeBatch)")

    def joined(self, uids: Sequence[int], ys: mx.array) -> None:
        """New rows ran their last prompt token (the last `forward`); ys [B] their first
        sampled tokens."""
        if self._hidden is None:
            return
        toks = ys.tolist()
        for b, uid in enumerate(uids):
            row = self.rows.get(uid)
            if row is not None:
                row.commit(self._hidden[b : b + 1, -1:], [int(toks[b])])
        self._hidden = None

    def propose(self, uids, ys, want, samplings):
        self._uids = list(uids)
        lazy = []
        for uid, y, w, s in zip(uids, ys, want, samplings):
            row = self.rows.get(uid)
            lazy.append(row.propose(int(y), w, s) if row is not None and w > 0 else (None, None))
        mx.eval([d for d, _ in lazy if d is not None])
        self._props = [d.tolist() if d is not None else [] for d, _ in lazy]
        return self._props, [q for _, q in lazy]

    def settle(self, accepted: List[int], nxt: Optional[List[int]] = None) -> None:
        hid, self._hidden = self._hidden, None
        if hid is None or nxt is None:
            return
        props = self._props or [[] for _ in accepted]
        for b, (uid, n) in enumerate(zip(self._uids, accepted)):
            row = self.rows.get(uid)
            if row is not None:
                row.commit(hid[b : b + 1, : n + 1], props[b][:n] + [int(nxt[b])])
        self._props = []


def _draw(logits_fn, k: int, sampling, first_prev: mx.array):
    """k drafts from per-position logits `logits_fn(i, prev [1])` -> [1, V]: argmax when
    greedy, else drawn from the row's sampling (`loop.draw_draft`); (drafts [k] uint32,
    q [k, V] or None)."""
    from kimi_mlx.speculative.loop import draw_draft

    q_lps: List[mx.array] = []
    prev, out = first_prev, []
    for i in range(k):
        d = draw_draft(logits_fn(i, prev)[0].astype(mx.float32), sampling, q_lps)
        prev = d.reshape(1).astype(mx.uint32)
        out.append(prev[0])
    return mx.stack(out), (mx.stack(q_lps) if q_lps else None)


class _BlockRow:
    """One row of a block drafter: its context caches (committed positions only)."""

    def __init__(self, drafter, hidden: Optional[mx.array]):
        self.drafter = drafter
        self.cache = drafter.make_cache()
        if hidden is not None:
            drafter.add_context(hidden, self.cache)

    def propose(self, y: int, k: int, sampling):
        dr = self.drafter
        k = min(k, dr.config.proposals)
        anchor = mx.array([y], mx.uint32)
        if sampling.greedy:
            return dr.greedy_block(anchor, k, self.cache)[0].astype(mx.uint32), None
        base, _ = dr.base_logits(anchor, k, self.cache)
        return _draw(lambda i, prev: dr.step_logits(base[:, i], prev), k, sampling, anchor)

    def commit(self, hidden: mx.array, tokens: List[int]) -> None:
        self.drafter.add_context(hidden, self.cache)


class BlockDrafterRows(_HiddenRows):
    """A block drafter (`block_loop.BlockDraft`) for a batch: per row, its context caches
    fed the target's hiddens at the drafter's `target_layer_ids` for every committed
    position; k drafts (at most the drafter's block, `proposals`) from one drafter pass
    after the row's y (DSpark: each conditioned on the one before)."""

    def __init__(self, draft):
        super().__init__()
        self.drafter = draft.drafter
        self.layer_ids = self.drafter.config.target_layer_ids

    def _capture(self, model, x, cache):
        from kimi_mlx.speculative.block_loop import target_forward

        return target_forward(model, x, cache, self.layer_ids)

    def _row(self, hidden, context):
        return _BlockRow(self.drafter, hidden)

    def propose(self, uids, ys, want, samplings):
        """As `_HiddenRows.propose`; greedy rows drafted together in one drafter pass
        (each row's context left-padded to the longest and masked, its block at its own
        positions: `BlockDrafter.block_hidden`'s per-row offsets and context mask), where
        every drafter layer is full attention (the mask's condition); the others (sampled
        rows) one by one."""
        dr = self.drafter
        idx = [i for i, u in enumerate(uids)
               if u in self.rows and want[i] > 0 and samplings[i].greedy]
        if len(idx) < 2 or any(t != "full_attention" for t in dr.config.layer_types):
            return super().propose(uids, ys, want, samplings)
        props, qs = super().propose(uids, ys, [0 if i in idx else w
                                               for i, w in enumerate(want)], samplings)
        k = min(max(want[i] for i in idx), dr.config.proposals)
        caches = [self.rows[uids[i]].cache for i in idx]
        lens = [c[0].offset for c in caches]
        S = max(lens)
        kv = []
        for j, layer in enumerate(dr.layers):
            a = layer.self_attn
            parts = []
            for c, n in zip(caches, lens):
                ck = c[j]
                pad = mx.zeros((1, a.Hk, S - n, a.D), ck.keys.dtype if n else mx.float32)
                parts.append((mx.concatenate([pad, ck.keys[..., :n, :]], axis=2) if n else pad,
                              mx.concatenate([pad, ck.values[..., :n, :]], axis=2) if n else pad))
            kv.append((mx.concatenate([p[0] for p in parts]),
                       mx.concatenate([p[1] for p in parts])))
        mask = mx.arange(S)[None] >= (S - mx.array(lens))[:, None]  # [B, S]: own context
        anchor = mx.array([ys[i] for i in idx], mx.uint32)
        h = dr.block_hidden(dr.block_inputs(anchor, k), kv, mx.array(lens, mx.int32), mask)
        base = dr.logits(h if dr.config.sample_from_anchor else h[:, 1:])
        prev, out = anchor, []
        for j in range(k):
            prev = mx.argmax(dr.step_logits(base[:, j], prev), axis=-1).astype(mx.uint32)
            out.append(prev)
        drafted = mx.stack(out, axis=1).tolist()
        for b, i in enumerate(idx):
            props[i] = drafted[b][: want[i]]
        self._props = props
        return props, qs


class _MtpRow:
    """One row of the MTP: its layer cache, the pairs (target hidden h_j, next token
    t_{j+1}) not yet fed to it, and the cache after the last proposal's first call (the
    chained drafts' entries are not kept)."""

    STEP = 512  # pairs per MTP call when catching up on a long prompt

    def __init__(self, mtp, hidden: Optional[mx.array], context: List[int]):
        self.mtp = mtp
        self.cache = mtp.mtp_layers[0].make_cache()
        self.hidden: Optional[mx.array] = None
        self.tokens: List[int] = []
        self.after = None
        if hidden is not None:  # prompt positions 0..n-1, each followed by the next id
            n = hidden.shape[1]
            self.commit(hidden, context[1 : n + 1])

    def _feed(self, keep: int) -> None:
        """Feed all but the last `keep` pending pairs, STEP at a time."""
        m = len(self.tokens) - keep
        for s in range(0, m, self.STEP):
            e = min(s + self.STEP, m)
            y, _ = self.mtp.step(self.hidden[:, s:e], mx.array(self.tokens[s:e])[None],
                                 self.cache)
            mx.eval(y, self.cache.state)
        if m > 0:
            self.hidden, self.tokens = self.hidden[:, m:], self.tokens[m:]

    def propose(self, y: int, k: int, sampling):
        from kimi_mlx.speculative.rollback import snapshot

        if not self.tokens:
            return None, None
        self._feed(min(len(self.tokens), self.STEP))
        g, logits = self.mtp.step(self.hidden, mx.array(self.tokens)[None], self.cache)
        self.hidden, self.tokens = None, []
        self.after = snapshot([self.cache])
        state = {"g": g, "logits": logits}

        def step_logits(i, prev):
            if i:
                state["g"], state["logits"] = self.mtp.step(state["g"][:, -1:],
                                                            prev.reshape(1, 1), self.cache)
            return state["logits"][:, -1]

        return _draw(step_logits, k, sampling, mx.array([y], mx.uint32))

    def commit(self, hidden: mx.array, tokens: List[int]) -> None:
        from kimi_mlx.speculative.rollback import restore

        if self.after is not None:
            restore([self.cache], self.after)
            self.after = None
        self.hidden = hidden if self.hidden is None else mx.concatenate([self.hidden, hidden], 1)
        self.tokens = self.tokens + list(tokens)
        if len(self.tokens) > self.STEP:
            self._feed(1)


class MtpRows(_HiddenRows):
    """The checkpoint's MTP (`mtp.MTP`, bound to the target) for a batch: per row, its
    depth-1 layer cache over the pairs (h_j, t_{j+1}) of committed positions (h the
    target's final-normed hidden); a proposal feeds the row's pending pairs, drafts from
    the last, and chains drafts 2..k on its own output (`mtp.mtp_generate_step`'s rule)."""

    def __init__(self, mtp):
        super().__init__()
        if mtp._trunk is None:
            raise ValueError("the MTP draft is not bound to a target (MTP.bind)")
        self.mtp = mtp

    def _capture(self, model, x, cache):
        from kimi_mlx.speculative.mtp import target_forward

        h, logits = target_forward(model, x, cache)
        return logits, h

    def _row(self, hidden, context):
        return _MtpRow(self.mtp, hidden, context)
