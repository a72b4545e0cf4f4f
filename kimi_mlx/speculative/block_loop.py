"""Speculative decoding with a block drafter (DFlash / DSpark, `block_drafter.py`):
the drafter proposes k tokens in one pass over [anchor, mask, ...], conditioned on the
target's hidden states at its `target_layer_ids`; the target verifies [y, d1..dk] in one
pass, which also captures those hidden states for the next block.

Per step (one process, our `Model`):
  1. the hiddens of the positions the target committed last step (pending) become the
     drafter's context (`BlockDrafter.add_context`: keys / values appended, never rolled
     back: only committed positions are ever added);
  2. the drafter drafts d1..dk after y (the last emitted token, not yet seen by the target);
     DSpark draws them in order, each conditioned on the one before (Markov term);
  3. the target scores [y, d1..dk] (`target_forward`), capturing its hiddens; the
     acceptance rule is `loop.judge_verify`'s: greedy, the longest prefix equal to the
     target's argmax (the output is the target's greedy output); sampling, Leviathan et
     al. 2023 with q_i the drafter's distribution at position i given d_<i (the Markov
     term makes q_i depend on d_{i-1}; each d_i ~ q_i, so the rule still yields p);
  4. the target's caches are put back with `rollback` (exact for KDA and DSA); the
     captured hiddens of the m committed positions become pending.

The front ends run it as an `OwnLoop` (`BlockDraft.generate_step`), like `--draft mtp`.
"""

from __future__ import annotations

from typing import Any, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.speculative.auto_k import draft_policy
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS
from kimi_mlx.speculative.block_drafter import BlockDrafter
from kimi_mlx.speculative.loop import (OwnLoop, Sampling, SpecStats, draw_draft, emit_accepted,
                                       judge_verify)
from kimi_mlx.speculative.rollback import begin_verify, end_verify, rollback

__all__ = ["BlockDraft", "block_generate_step", "target_forward"]


def target_forward(model, tokens: mx.array, cache, layer_ids) -> Tuple[mx.array, mx.array]:
    """Our `Model` (whole, one process) on tokens [B, L]: (logits [B, L, vocab], the
    hiddens of layers `layer_ids` concatenated [B, L, n * d]); the same ops as
    `Model.__call__` plus the capture (`TextModel.run_layers`). A stand-in target with
    `forward_capture(tokens, layer_ids)` (a tensor group's `GroupTarget`, the pipeline's
    `head.speculative.PipelineTarget`) answers it itself (`cache` is then its
    `RemoteCache`, which the call advances); its logits are None for prompt (prefill)
    positions."""
    if hasattr(model, "forward_capture"):
        return model.forward_capture(tokens, layer_ids)
    text = model.text
    cap = {i: None for i in layer_ids}
    h, banks = text.run_layers(text.embed(tokens), Banks(model.args.rms_norm_eps), cache,
                               capture=cap)
    logits = model.language_model.logits(text.finish(h, banks))
    return logits, mx.concatenate([cap[i] for i in layer_ids], axis=-1)


class BlockDraft(OwnLoop):
    """A bound `BlockDrafter` as a draft for the front ends (`Speculation`).

    `make_cache()`: the drafter's context caches plus one `ArraysCache(1)` holding the
    pending target hiddens [1, m, n * d] between calls (a chat's next turn)."""

    prefills_itself = True  # the prompt's hiddens must be captured (OwnLoop)

    def __init__(self, drafter: BlockDrafter):
        self.drafter = drafter

    @property
    def max_block(self) -> int:
        return self.drafter.config.proposals

    def make_cache(self) -> List[Any]:
        return self.drafter.make_cache() + [ArraysCache(size=1)]

    @staticmethod
    def generate_step(prompt, model, draft_model, **kwargs):
        return block_generate_step(prompt, model, draft_model, **kwargs)


def _draft(drafter: BlockDrafter, dcache, y: int, k: int, sampling: Sampling):
    """k drafts after y: (drafts [k] uint32, their log-distributions (sampling only))."""
    anchor = mx.array([y], mx.uint32)
    if sampling.greedy:
        return drafter.greedy_block(anchor, k, dcache)[0], []
    base, _ = drafter.base_logits(anchor, k, dcache)
    q_lps: List[mx.array] = []
    prev, out = anchor, []
    for i in range(k):
        d = draw_draft(drafter.step_logits(base[:, i], prev)[0].astype(mx.float32),
                       sampling, q_lps)
        prev = d.reshape(1).astype(mx.uint32)
        out.append(prev[0])
    return mx.stack(out).astype(mx.uint32), q_lps


def block_generate_step(
    prompt,
    model,
    draft: BlockDraft,
    *,
    num_draft_tokens=4,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: Optional[Sampling] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    stats: Optional[SpecStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with a block drafter; yields (token, logprobs [V], from_draft)
    like `loop.speculative_generate_step` (same arguments, same acceptance rule).

    Args:
        prompt: token ids (list or 1-D mx.array), at least one.
        model: our `Model` (one process). draft: its `BlockDraft` (drafter bound to it).
        num_draft_tokens: k (>= 1), "auto" / "auto:N" or a policy
            (`auto_k.draft_policy`), capped at the drafter's block (`proposals`).
        prompt_cache: the target's caches followed by `draft.make_cache()`, used and
            updated in place (new ones when None). At the end the target holds every
            token but the last one yielded (as `speculative_generate_step` leaves it), the
            drafter's context the hiddens added so far, and the pending cache the rest.
        Others: see `loop.speculative_generate_step`.
    Raises:
        ValueError: an empty prompt, num_draft_tokens < 1.
    """
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    policy = draft_policy(num_draft_tokens)  # raises for k < 1
    drafter = draft.drafter
    ids = drafter.config.target_layer_ids
    sampling = sampling or Sampling()
    stats = stats if stats is not None else SpecStats()
    if prompt_cache is None:
        prompt_cache = model.make_cache() + draft.make_cache()
    n_layers = len(model.layers)
    tcache = prompt_cache[:n_layers]
    dcache, pcache = prompt_cache[n_layers:-1], prompt_cache[-1]
    pend: Optional[mx.array] = pcache[0]
    pcache.cache = [None]
    step = max(1, prefill_step_size)

    body = prompt[:-1]
    for s in range(0, len(body), step):
        _, hid = target_forward(model, mx.array(body[s : s + step])[None], tcache, ids)
        pend = hid if pend is None else mx.concatenate([pend, hid], axis=1)
        drafter.add_context(pend, dcache)
        pend = None
        mx.eval([c.state for c in tcache], [c.state for c in dcache])

    kmax = min(policy.max_k, draft.max_block)
    y = prompt[-1]
    ntoks = 0
    st = None  # (verify handle, captured hiddens, emitted) of the step being emitted
    try:
        while max_tokens < 0 or ntoks < max_tokens:
            left = kmax if max_tokens < 0 else max_tokens - ntoks - 1
            k = min(kmax, policy.choose(min(kmax, left)))
            if pend is not None:
                drafter.add_context(pend, dcache)
                pend = None
            if k:
                d_arr, q_lps = _draft(drafter, dcache, y, k, sampling)
                mx.async_eval(d_arr)
            else:
                d_arr, q_lps = mx.array([], mx.uint32), []
            verify = begin_verify(tcache)
            x = mx.concatenate([mx.array([y], mx.uint32), d_arr])
            logits, hid = target_forward(model, x[None], tcache, ids)
            n, token, d_list, logprobs = judge_verify(logits[0].astype(mx.float32), d_arr,
                                                      q_lps, sampling, stats, also=(hid,))
            if k:
                policy.record(k, n)
            else:
                policy.skip()
            st = (verify, hid, [])
            yield from emit_accepted(n, token, d_list, logprobs, st[2], stats,
                                     max_tokens - ntoks if max_tokens >= 0 else -1)
            ntoks += len(st[2])
            pend = _settle(st, tcache)
            y = st[2][-1]
            st = None
    finally:
        if st is not None and st[2]:
            pend = _settle(st, tcache)
        elif st is not None:
            rollback(tcache, st[0], 0)
        end_verify(tcache)  # also after an error inside a verify step
        pcache.cache = [pend]


def _settle(st, tcache) -> mx.array:
    """The target keeps y and the first m - 1 emitted tokens (m emitted); returns their m
    captured hiddens [1, m, n * d] (the next context)."""
    verify, hid, emitted = st
    m = len(emitted)
    rollback(tcache, verify, m)
    end_verify(tcache)
    return hid[:, :m]
