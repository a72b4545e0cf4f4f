"""Speculative decoding inside continuous batching: drafts for every row of mlx-lm's
`BatchGenerator` (from a proposer: n-gram lookup, a draft model, the MTP, a block
drafter; `proposers`, `hidden_rows`), verified together in one batched pass.

Every MLX server turns batching off to speculate (mlx-lm, LM Studio, exo, ours before
this); here a batch of B sequences keeps decoding together and each decode step may
verify drafts for all of them at once:

  * each row proposes up to k tokens (`proposers.Proposer`: e.g. `NgramIndex` over its
    prompt and what it generated, `--draft ngram`'s index and proposal rule);
  * when no row has a draft, the step is mlx-lm's own decode step (`GenerationBatch.next`);
  * else the target scores [y_b, d_b1..d_bK] for every row in one [B, K+1] forward pass
    (K the longest proposal; a shorter row's tail is filler its acceptance never reads),
    with the KDA verify record on (`rollback.begin_verify`); each row accepts its own
    prefix (`loop.accept_drafts`'s rule, the draft one-hot: at temperature 0 accept while
    the draft equals the argmax, so greedy output is token for token the row's plain
    output; above it the emitted tokens are distributed as the target's), and the
    batch caches are rolled back row by row (`rollback.rollback_rows`: KDA replayed per
    row, the batched DSA cache's rejected tails turned into left padding);
  * a row with logits processors (penalties, logit_bias, a grammar) or no draft is
    verified with k = 0 in that pass: its position-0 logits go through its processors
    and sampler exactly as in mlx-lm's step.

Whether a step verifies at all is a cost decision (`VerifyGate`): a verify step of B rows
x (K+1) tokens costs T_v(B, K), a plain step T_p(B); with a drafted rows whose mean
accepted drafts per verify is `acc`, verifying gives B + a x acc tokens in T_v instead
of B in T_p, so the step verifies when (B + a x acc) / T_v > B / T_p, from the measured
step times (medians of the recent steps) and acceptance (an exponential average); every
`EXPLORE`-th step that could verify does so anyway, so the figures stay current. On a
Mac a MoE verify step of a few tokens costs little more than a plain one (the weights
are read once), so it verifies almost always; on the CPU backend, where the micro model
pays per operation, a verify step costs 2-3 plain ones and drafts pay only where many
are accepted (copy-heavy prompts). Greedy output is the plain output either way.

Tokens come out as mlx-lm's `GenerationBatch.Response`s, several per row per step, in
order, with the stop rules (max_tokens, stop tokens) applied token by token; so the
server's batched loop (`server.batch.run_batched`) is unchanged. A tensor group's rows
(`cluster.tensor.rows.RowCache`) take the same verify through two group commands
(`begin_verify_rows`, `rollback_rows`); any cache that offers those methods does.

Cost: a verify step reads the weights once for B x (K+1) tokens instead of B; a row's
DSA rollback moves its cache buffer when it keeps fewer tokens than the batch's best
row (K3.1's 24 DSA layers: 704 bytes per token each, bf16).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from kimi_mlx.speculative.auto_k import draft_policy
from kimi_mlx.speculative.loop import SpecStats, accept_drafts
from kimi_mlx.speculative.settings import DEFAULT_NUM_DRAFT_TOKENS
from kimi_mlx.speculative.proposers import Proposer, batches_drafts, proposer_for
from kimi_mlx.speculative.rollback import begin_verify, end_verify, rollback_rows

__all__ = ["BatchDrafts", "SpeculativeBatch", "VerifyGate", "batches_drafts", "install"]

EXPLORE = 8  # every this many gated-off steps with drafts, one verifies anyway
RECENT = 9  # step times kept per (kind, B, K): their median is the estimate


class VerifyGate:
    """Whether a batched step should verify its rows' drafts (module doc): measured step
    times per (B) for plain steps and per (B, K) for verify steps, and the mean accepted
    drafts per drafted row (exponential average, `decay`).

    Args:
        clock: seconds (default `time.perf_counter`; tests pass their own).
        decay: weight of the past in the acceptance average, 0 <= decay < 1.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, decay: float = 0.9):
        self.clock, self.decay = clock, decay
        self.acc: Optional[float] = None  # mean accepted per drafted row per verify
        self._times: Dict[Tuple, deque] = {}
        self._skipped = 0
        self.verified = self.gated = 0  # steps that verified / were gated off

    def _t(self, key) -> Optional[float]:
        d = self._times.get(key)
        return statistics.median(d) if d else None

    def record(self, key: Tuple, seconds: float) -> None:
        """A step's time: key ("plain", B) or ("verify", B, K)."""
        self._times.setdefault(key, deque(maxlen=RECENT)).append(seconds)

    _mark: Optional[float] = None
    _key: Optional[Tuple] = None
    _explore = False  # `closed` let this step through to measure: it verifies

    def mark(self) -> None:
        """A step starts: the previous one's time is the interval since the mark before
        it, the wall time per step as the server sees it (mlx-lm's plain step returns
        while its forward pass still runs, overlapped with the next step's graph
        building; a verify step is synchronous)."""
        now = self.clock()
        if self._key is not None and self._mark is not None:
            self.record(self._key, now - self._mark)
        self._mark, self._key = now, None

    def idle(self) -> None:
        """The batch emptied: the time until the next step is not a step's."""
        self._mark = self._key = None

    def step(self, key: Tuple) -> None:
        """The step starting now is of kind `key` (timed at the next `mark`)."""
        self._key = key

    def accepted(self, counts: Sequence[int]) -> None:
        """The accepted drafts of each drafted row of a verify step."""
        for n in counts:
            self.acc = n if self.acc is None else self.decay * self.acc + (1 - self.decay) * n

    def closed(self, B: int) -> bool:
        """True when even with every row drafted a verify step of B rows would not pay at
        the cheapest measured verify time for B: the step then stays mlx-lm's plain step,
        without reading its inputs first (no proposal), so it keeps mlx-lm's overlap of
        graph building and compute. Every EXPLORE-th such step is let through (and then
        verifies, `should_verify`), so the figures stay current."""
        tp = self._t(("plain", B))
        tvs = [self._t(k) for k in self._times if k[0] == "verify" and k[1] == B]
        if tp is None or not tvs or self.acc is None:
            return False
        if (B + B * self.acc) / min(tvs) > B / tp:
            return False
        self._skipped += 1
        if self._skipped >= EXPLORE:
            self._skipped, self._explore = 0, True
            return False
        self.gated += 1
        return True

    def should_verify(self, B: int, K: int, drafted_rows: int) -> bool:
        """True when the expected tokens per second of a verify step of B rows (K drafts
        at most, `drafted_rows` of them with drafts) beat a plain step's, or when either
        time or the acceptance is not measured yet, or every EXPLORE-th refusal."""
        tp, tv = self._t(("plain", B)), self._t(("verify", B, K))
        if self._explore or tp is None or tv is None or self.acc is None:
            self._explore = False
            go = True
        else:
            go = (B + drafted_rows * self.acc) / tv > B / tp
            if not go:
                self._skipped += 1
                if self._skipped >= EXPLORE:
                    go = True
        if go:
            self._skipped = 0
            self.verified += 1
        else:
            self.gated += 1
        return go


@dataclass
class _Row:
    """One row's drafting state: its sampling, whether it may speculate, and `drafted`,
    the draft tokens it was given to verify so far (0 for a row with logits processors,
    which is never drafted). Its drafter's state is the proposer's
    (`proposers.Proposer`, by uid)."""

    greedy: bool
    sampling: Any
    speculates: bool
    drafted: int = 0


@dataclass
class BatchDrafts:
    """The drafts of one batched generator: the drafter, k, the shared statistics and
    each row's state (by the generator's uid).

    Args:
        draft: the `NgramDraft` or a draft model (`proposers.batches_drafts`).
        num_draft_tokens: k, drafts per row per verify step at most (>= 1), or "auto" /
            an `AutoK` (`auto_k.draft_policy`: one k per batched step, from every row's
            outcomes and the batched step's time).
        stats: `SpecStats` updated with every row's verify steps (`steps` counts rows
            verified, so `mean_accepted` is per row as in the one-sequence loop).
        gate: the `VerifyGate` that skips verify steps that would cost more than they
            give (None: verify whenever a row has a draft).
        vocab: the target's vocabulary size (a draft model's logits are cut or padded to
            it), or None.
    Raises:
        ValueError: a draft that does not batch (`proposers.proposer_for`).
    """

    draft: Any
    num_draft_tokens: Any = DEFAULT_NUM_DRAFT_TOKENS
    stats: SpecStats = field(default_factory=SpecStats)
    rows: Dict[int, _Row] = field(default_factory=dict)
    gate: Optional[VerifyGate] = field(default_factory=VerifyGate)
    vocab: Optional[int] = None

    def __post_init__(self):
        self.policy = draft_policy(self.num_draft_tokens)
        self.proposer: Proposer = proposer_for(self.draft, self.vocab)

    @property
    def captures(self) -> bool:
        """Whether the proposer drafts from the target's hidden states (`hidden_rows`):
        every step then verifies through its `forward`, and prompts are prefilled alone
        (`prefill`)."""
        return getattr(self.proposer, "captures", False)

    def add(self, uid: int, context: Sequence[int], sampling, speculates: bool = True,
            hidden: Optional[mx.array] = None) -> None:
        """Row `uid` starts from prompt `context` (all its ids: the generator feeds the
        last one when the row moves to decoding, before this batch's first step on it,
        whose input is the first sampled token). `hidden`: for a proposer that
        `captures`, the hiddens of the prompt positions `prefill` ran (or None)."""
        self.rows[uid] = _Row(sampling.greedy, sampling, speculates)
        if self.captures:
            self.proposer.add(uid, context, hidden)
        else:
            self.proposer.add(uid, context)

    def prefill(self, model, ids: Sequence[int], cache, start: int, step: int):
        """A joining row's prompt ids[start:-1] run alone into `cache` with the hiddens
        the proposer drafts from (`hidden_rows._HiddenRows.prefill`); None for a proposer
        that does not capture (nothing is run then)."""
        if not self.captures:
            return None
        return self.proposer.prefill(model, ids, cache, start, step)

    def drop(self, uid: int) -> None:
        self.rows.pop(uid, None)
        self.proposer.drop(uid)


def install(gen, drafts: BatchDrafts) -> None:
    """Make mlx-lm `BatchGenerator` `gen` decode speculatively with `drafts` (before any
    insert: the generation batch it starts from is empty)."""
    if drafts.captures:  # every pass of the target keeps the hiddens the drafter reads
        from kimi_mlx.speculative.hidden_rows import Capture

        gen.model = Capture(gen.model, drafts.proposer)
        gen._prompt_batch.model = gen.model  # made with the model it was built with
    batch = SpeculativeBatch.empty(gen.model, gen.sampler)
    batch.drafts = drafts
    gen._generation_batch = batch


def _verifier(cache: List[Any]):
    """(begin, rollback, end) for a batch's caches: the caches' own methods when they offer
    them (a tensor group's `RowCache`), else `rollback`'s functions on local caches."""
    if len(cache) == 1 and hasattr(cache[0], "begin_verify_rows"):
        c = cache[0]
        return (c.begin_verify_rows, lambda _v, n_keep, tokens: c.rollback_rows(n_keep),
                c.end_verify_rows)
    return (lambda: begin_verify(cache),
            lambda v, n_keep, tokens: rollback_rows(cache, v, n_keep, tokens),
            lambda: end_verify(cache))


class SpeculativeBatch(GenerationBatch):
    """mlx-lm's `GenerationBatch` whose `next` verifies every row's drafts in one batched
    pass (module doc); `drafts` is set by `install`. With a proposer of hidden states
    (`BatchDrafts.captures`) every step is a verify step (k = 0 where nothing is
    drafted), so every position's hiddens reach it."""

    drafts: Optional[BatchDrafts] = None

    def extend(self, batch):
        super().extend(batch)
        if self.drafts is not None and self.drafts.captures and batch.uids:
            # the new rows' first step (their last prompt token) ran in the captured model
            self.drafts.proposer.joined(list(batch.uids), batch._next_tokens)

    def filter(self, keep: List[int]):
        left = [u for i, u in enumerate(self.uids) if i not in set(keep)]
        super().filter(keep)
        if self.drafts is not None and self.drafts.gate is not None and not keep:
            self.drafts.gate.idle()  # no step is running: the wait for new rows is no step's
        if self.drafts is not None:
            # only the rows that left this batch: a row added while its prompt is still
            # being prefilled (not in the batch yet) keeps its drafting state
            for uid in left:
                self.drafts.drop(uid)

    def next(self) -> List[GenerationBatch.Response]:
        if not self.uids or self.drafts is None:
            return super().next()
        d, B = self.drafts, len(self.uids)
        closed = False
        if d.gate is not None:
            d.gate.mark()
            closed = d.gate.closed(B)
            if closed and not d.captures:  # drafts would not pay: mlx-lm's step as it is
                d.gate.step(("plain", B))
                d.stats.plain += B
                d.proposer.plain(list(self.uids), self._next_tokens)
                return super().next()
        y = self._next_tokens
        mx.eval(y)  # the previous step's forward pass is done here (mlx-lm overlaps it)
        ys = y.tolist()
        rows = [d.rows.get(uid) for uid in self.uids]
        rooms = [self.max_tokens[i] - self._num_tokens[i] - 1 for i in range(len(rows))]
        k = d.policy.choose(max(rooms))
        want = [0 if (r is None or not r.speculates or self.logits_processors[i]
                      or rooms[i] < 1 or k < 1 or closed) else min(k, rooms[i])
                for i, r in enumerate(rows)]
        samplings = [r.sampling if r is not None else None for r in rows]
        gate, B = d.gate, len(self.uids)
        if (d.proposer.drafts_every_row and max(want) and gate is not None
                and not gate.should_verify(B, max(want), sum(1 for w in want if w))):
            # a draft model's proposal costs K + 1 draft passes: asked before they run
            # (it proposes exactly `want` for every row, so the gate knows the step)
            want = [0] * B
        props, qs = d.proposer.propose(list(self.uids), ys, want, samplings)
        K = max(len(p) for p in props)
        if (K and gate is not None and not d.proposer.drafts_every_row
                and not gate.should_verify(B, K, sum(1 for p in props if p))):
            props = [[] for _ in props]
        if gate is not None:
            gate.step(("plain", B) if not any(props) else ("verify", B, K))
        if not any(props) and not d.captures:
            d.proposer.settle([0] * B)  # the step feeds y alone
            d.policy.skip()
            d.stats.plain += B
            return super().next()
        if not any(props):  # a drafter of hiddens: a one-token verify step keeps them
            d.policy.skip()
        return self._verify(ys, rows, props, qs)

    def _verify(self, ys: List[int], rows: List[Optional[_Row]], props: List[List[int]],
                qs: List[Optional[mx.array]]) -> List[GenerationBatch.Response]:
        d, B = self.drafts, len(self.uids)
        K = max(len(p) for p in props)
        x = mx.array([[ys[i]] + p + [ys[i]] * (K - len(p)) for i, p in enumerate(props)],
                     mx.uint32)
        begin, roll, end = _verifier(self.prompt_cache)
        verify = begin()
        try:
            logits = self.model(x, cache=self.prompt_cache).astype(mx.float32)  # [B, K+1, V]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            target = mx.argmax(logits, axis=-1)  # [B, K+1]
            lazy: Dict[int, tuple] = {}
            for i, (r, p) in enumerate(zip(rows, props)):
                procs = self.logits_processors[i]
                if procs:  # k = 0, as mlx-lm's step: processors, then the row's sampler
                    ctx = self._token_context[i].update_and_fetch(x[i : i + 1, 0])
                    row = logits[i : i + 1, 0]
                    for proc in procs:
                        row = proc(ctx, row)
                    lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
                    lazy[i] = (mx.array(0, mx.int32), self.samplers[i](lp).reshape(()), lp[0])
                elif not p and not (r is not None and r.greedy):
                    lp = logprobs[i : i + 1, 0]
                    lazy[i] = (mx.array(0, mx.int32), self.samplers[i](lp).reshape(()), lp[0])
                elif p and not r.greedy:
                    m = len(p)
                    q = qs[i]
                    if q is None:  # deterministic drafts (n-gram): q one-hot
                        q = mx.where(mx.arange(logits.shape[-1])[None] == mx.array(p)[:, None],
                                     0.0, -mx.inf)
                    n, tok = accept_drafts(r.sampling.log_probs(logits[i, : m + 1]), q,
                                           mx.array(p, mx.int32))
                    lazy[i] = (n, tok, None)
            mx.eval(target, [v[:2] for v in lazy.values()])
            t_rows = target.tolist()
            accepted, nxt, next_lp = [], [], []
            for i, p in enumerate(props):
                if i in lazy:
                    n, tok, lp = lazy[i]
                    n, tok = int(n.item()), int(tok.item())
                else:  # greedy: accept while the draft is the argmax
                    n = 0
                    while n < len(p) and t_rows[i][n] == p[n]:
                        n += 1
                    tok, lp = t_rows[i][n], None
                accepted.append(n)
                nxt.append(tok)
                next_lp.append(lp if lp is not None else logprobs[i, n])
            roll(verify, [n + 1 for n in accepted], K + 1)
            if d.captures:
                d.proposer.settle(accepted, nxt)
            else:
                d.proposer.settle(accepted)
        finally:
            end()
        st = d.stats
        if d.gate is not None:
            d.gate.accepted([n for p, n in zip(props, accepted) if p])
        # the longest proposal first: the policy times the step with the first record
        for p, n in sorted(zip(props, accepted), key=lambda pn: -len(pn[0])):
            if p:
                d.policy.record(len(p), n)
        for r, p, n in zip(rows, props, accepted):
            if p:
                r.drafted += len(p)
                st.steps += 1
                st.drafted += len(p)
                st.accepted += n
                st.per_step.append(n)
            else:
                st.plain += 1
        return self._emit(ys, props, accepted, nxt, next_lp, logprobs)

    def _emit(self, ys, props, accepted, nxt, next_lp, logprobs):
        """The step's responses: per row y, then its accepted drafts, stopping at the
        first token that ends it; the next step's inputs are the rows' next tokens."""
        d = self.drafts
        prev_lp = self._next_logprobs
        keep, responses = [], []
        for i in range(len(self.uids)):
            toks = [ys[i]] + props[i][: accepted[i]]
            lps = [prev_lp[i]] + [logprobs[i, j] for j in range(accepted[i])]
            self.tokens[i].extend(toks)
            finish = None
            for tok, lp in zip(toks, lps):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(tok):
                    finish = "stop"
                d.stats.emitted += 1
                responses.append(self.Response(
                    uid=self.uids[i], token=tok, logprobs=lp, finish_reason=finish,
                    prompt_cache=self.extract_cache(i) if finish else None,
                    all_tokens=self.tokens[i] if finish else None))
                if finish:
                    break
            if finish is None:
                keep.append(i)
        self._current_tokens = mx.array(ys, mx.uint32)
        self._current_logprobs = prev_lp
        self._next_tokens = mx.array(nxt, mx.uint32)
        self._next_logprobs = next_lp
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
