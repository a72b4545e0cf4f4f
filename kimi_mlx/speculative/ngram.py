"""Prompt-lookup (n-gram) drafts: the context proposes its own continuation (`--draft ngram`).

No draft model: the tokens that followed an earlier occurrence of the context's last
n-gram are proposed as the draft (prompt-lookup decoding, Saxena 2023; vLLM's `ngram`
speculative method; llama.cpp's n-gram lookup). Coding agents and chat front ends make
a model repeat what is in its context (edited files, quoted code, tool output), and a
small model falls into loops of its own, so such drafts are often right.

Index (`NgramIndex`, host side, updated as tokens arrive, O(n_max) per token): for every
n in [n_min, n_max], a dict from each n-gram of the context to the positions that
followed it. A proposal reads the dict for the context's last n-gram, longest n first,
instead of scanning the context.

Proposal (`NgramIndex.propose`): of the earlier occurrences of the longest matching
suffix n-gram (n_max down to n_min), the one whose preceding tokens agree with the
context's for longest (ties: the most recent) is continued for k tokens: the longest
suffix match, found from the n-gram table instead of a suffix tree. A continuation may
run into the tokens being drafted (LZ77-style self-reference), so a loop of period p is
extended as far as k asks. Work per proposal is bounded (at most `CANDIDATES`
occurrences compared over at most `CONTEXT` tokens each), whatever the context length.
Replayed offline on the micro model's greedy output for `kimi-mlx bench spec`'s copy
prompts (4 x 128 tokens), with this loop's plain steps run ahead, it accepts 1.44 drafts
per verify step at k = 4 and 1.87 at k = 8, against 1.25 and 1.58 for the most recent
1-4-gram's continuation in a loop without run-ahead (a majority vote over all
occurrences did better on ordinary prompts and worse on copy ones).

Loop (`ngram_generate_step`, mlx-lm's (token, logprobs, from_draft) triples, like
`kimi_mlx.speculative.loop.speculative_generate_step`):
  * no match: a plain decode step, exactly what mlx-lm's `generate_step` runs (one token
    through the model, no verify record, no rollback); counted in `SpecStats.plain`. As
    in mlx-lm, while nothing matches the next plain step is started before the current
    token is read (the graph is built while the last one computes); the caches'
    references before it (a list of array references, no copy) undo it if generation
    stops before its input token is yielded;
  * a match of m <= k tokens: the target scores [y, d1..dm] in one pass with the KDA
    verify record (`rollback.begin_verify`), `loop.judge_verify` accepts a prefix, and
    the caches are rolled back exactly (`rollback.rollback`), as for a draft model.

Acceptance rule with a deterministic draft. The draft is a function of the context, so
its distribution q is one-hot on the drafted token d. Speculative sampling (Leviathan,
Kalman, Matias 2023, Algorithm 1; Chen et al. 2023) accepts d with probability
min(1, p(d) / q(d)) = p(d), and on rejection draws from norm(max(0, p - q)) = p with d
removed, renormalised; the emitted token is then distributed exactly as p. This is
`loop.accept_drafts` with q one-hot (the code passes exactly that q); at temperature 0
it is mlx-lm's greedy rule (accept while d equals the argmax).

Caches: the target's, then one `ArraysCache(1)` (`NgramDraft.make_cache`) holding the
token ids the target has seen (int32 [n]), so a reused prompt cache (chat, the server)
brings its context with it and the index is rebuilt from it when a generation starts.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kimi_mlx.sampling import DEFAULT_MAX_TOKENS
from kimi_mlx.speculative.settings import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_NUM_DRAFT_TOKENS
from kimi_mlx.speculative.loop import (OwnLoop, Sampling, SpecStats, emit_accepted, grammar_guide,
                                       judge_verify, prefill_chunks)
from kimi_mlx.speculative.rollback import begin_verify, end_verify, restore, rollback, snapshot
from kimi_mlx.speculative.auto_k import draft_policy

__all__ = ["NgramDraft", "NgramIndex", "ngram_generate_step", "DEFAULT_NGRAM_MAX",
           "DEFAULT_NGRAM_MIN"]

CANDIDATES = 64  # earlier occurrences compared per proposal (the most recent ones)
CONTEXT = 64  # tokens of agreement before an occurrence that are counted, at most


class NgramIndex:
    """The n-grams of a growing token sequence, n in [n_min, n_max], each mapped to the
    positions of the token that followed it.

    Args:
        tokens: the context so far (ints).
        n_max, n_min: n-gram sizes, 1 <= n_min <= n_max.
    Raises:
        ValueError: sizes outside 1 <= n_min <= n_max.
    """

    def __init__(self, tokens: Sequence[int] = (), n_max: int = DEFAULT_NGRAM_MAX,
                 n_min: int = DEFAULT_NGRAM_MIN):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min {n_min}, ngram_max {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: List[int] = []
        self._next: Dict[Tuple[int, ...], List[int]] = {}  # n-gram -> positions after it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add one token: the n-grams that end just before it now have a continuation."""
        toks, i = self.tokens, len(self.tokens)
        toks.append(int(token))
        for n in range(self.n_min, min(self.n_max, i) + 1):
            self._next.setdefault(tuple(toks[i - n : i]), []).append(i)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def occurrences(self) -> List[int]:
        """Positions that followed earlier occurrences of the longest suffix n-gram with
        any (oldest first); [] when no suffix of n_min..n_max tokens occurred before."""
        toks = self.tokens
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            pos = self._next.get(tuple(toks[len(toks) - n :]))
            if pos:
                return pos
        return []

    def propose(self, k: int) -> List[int]:
        """Up to k draft tokens continuing the sequence ([] when nothing matches).

        Of the (at most `CANDIDATES` most recent) earlier occurrences of the longest
        matching suffix n-gram, the one whose preceding tokens agree with the context for
        longest (up to `CONTEXT` tokens; ties: the most recent) is continued; a
        continuation that reaches the end of the sequence reads on into the draft itself.
        """
        cands = self.occurrences()
        if k < 1 or not cands:
            return []
        toks, L = self.tokens, len(self.tokens)
        best, best_len = cands[-1], -1
        for p in reversed(cands[-CANDIDATES:]):
            n = 0
            while n < CONTEXT and n < p and toks[p - 1 - n] == toks[L - 1 - n]:
                n += 1
            if n > best_len:
                best, best_len = p, n
        draft: List[int] = []
        while len(draft) < k:
            i = best + len(draft)
            draft.append(toks[i] if i < L else draft[i - L])
        return draft


class NgramDraft(OwnLoop):
    """The `--draft ngram` draft: settings, and the loop `stream_speculative` runs for it.

    Args:
        n_max, n_min: n-gram sizes (default 4 and 1): the longest suffix of n_max..n_min
            tokens that occurred before is matched.
    Raises:
        ValueError: sizes outside 1 <= n_min <= n_max.
    """

    checks_grammar = True  # its loop masks the verify rows with a request's grammar

    def __init__(self, n_max: int = DEFAULT_NGRAM_MAX, n_min: int = DEFAULT_NGRAM_MIN):
        NgramIndex((), n_max, n_min)  # checks the sizes
        self.n_max, self.n_min = n_max, n_min

    def __repr__(self) -> str:
        return f"ngram({self.n_min}..{self.n_max})"

    def make_cache(self) -> List[Any]:
        """[ArraysCache(1)]: the token ids the target holds (int32 [n], None when empty)."""
        return [ArraysCache(size=1)]

    def __call__(self, inputs: mx.array, cache: List[Any]) -> None:
        """Record token ids [1, T] fed to the target beside it (a front end that prefills
        the draft with the target, as the server's engine does): appended to `cache`, the
        list `make_cache` gave."""
        held, new = cache[0], inputs.reshape(-1).astype(mx.int32)
        held.cache = [new if held[0] is None else mx.concatenate([held[0], new])]

    def index(self, tokens: Sequence[int]) -> NgramIndex:
        return NgramIndex(tokens, self.n_max, self.n_min)

    def generate_step(self, prompt, model, draft_model=None, **kwargs):
        return ngram_generate_step(prompt, model, self, **kwargs)


def _one_hot_log(drafts: List[int], vocab: int) -> List[mx.array]:
    """log q for a deterministic draft: 0 at the drafted token, -inf elsewhere ([V] each)."""
    if not drafts:
        return []
    q = mx.where(mx.arange(vocab)[None] == mx.array(drafts)[:, None], 0.0, -mx.inf)
    return list(q)


def ngram_generate_step(
    prompt,
    model,
    draft: Optional[NgramDraft] = None,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: Optional[Sampling] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    stats: Optional[SpecStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with n-gram drafts; yields (token, logprobs [V], from_draft)
    like `kimi_mlx.speculative.loop.speculative_generate_step` (same arguments).

    Args:
        prompt: token ids (list or 1-D mx.array), at least one.
        model: the target (any model whose caches `kimi_mlx.speculative.rollback` handles,
            or `cluster.head.speculative.PipelineTarget`).
        draft: the `NgramDraft` (n-gram sizes; default 4..1).
        num_draft_tokens: k, drafts per verify step at most (>= 1), or "auto" / an
            `AutoK` (`kimi_mlx.speculative.auto_k`).
        max_tokens: tokens to yield at most (-1: no limit).
        sampling: target sampling settings (default greedy); the rule is in the module
            docstring.
        prompt_cache: the target's caches followed by `draft.make_cache()` (new ones when
            None), used and updated in place: when generation ends (or the generator is
            closed) the target holds every token but the last one yielded, as after
            mlx-lm's `generate_step`, and the draft cache those same token ids.
        prefill_step_size: prompt tokens per prefill forward pass.
        stats: updated with the verify steps (`steps`, `drafted`, `accepted`), the plain
            steps taken without a match (`plain`) and `emitted`.
    Raises:
        ValueError: an empty prompt, num_draft_tokens < 1, or a prompt_cache without the
            n-gram cache at its end.
    """
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    policy = draft_policy(num_draft_tokens)
    draft = draft or NgramDraft()
    sampling = sampling or Sampling()
    stats = stats if stats is not None else SpecStats()
    if prompt_cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        prompt_cache = make_prompt_cache(model) + draft.make_cache()
    n_layers = len(model.layers)
    if len(prompt_cache) != n_layers + 1 or not isinstance(prompt_cache[-1], ArraysCache):
        raise ValueError(f"prompt_cache: expected the target's {n_layers} caches followed by "
                         f"the n-gram draft's one (NgramDraft.make_cache), got "
                         f"{len(prompt_cache)} caches")
    cache, held = prompt_cache[:n_layers], prompt_cache[-1]
    seen = held[0].tolist() if held[0] is not None else []
    prefill_chunks(model, cache, prompt[:-1], prefill_step_size)
    index = draft.index(seen + prompt)  # the context, y (not yet fed) included
    guide = grammar_guide(sampling)  # structured output: masks every row the target scores

    y = prompt[-1]
    ntoks = 0
    pending = None  # (verify, emitted) of a verify step whose rollback is pending

    def settle(verify, m: int) -> None:
        rollback(cache, verify, m)
        end_verify(cache)

    def plain_step(tok):
        """Feed `tok` (int, or a lazy scalar) to the target: (its next token and logprobs
        [V], both lazy and started; the caches' references before the feed)."""
        before = snapshot(cache)
        x = tok.reshape(1, 1) if isinstance(tok, mx.array) else mx.array([[tok]], mx.uint32)
        logits = model(x, cache=cache)[0, -1]
        if guide is not None:
            logits = guide.verify_logits(logits[None], [])[0]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if sampling.greedy:
            nxt = mx.argmax(logprobs)  # as mlx-lm's sampler: ties break alike
        else:
            nxt = mx.random.categorical(sampling.log_probs(logits))
        mx.async_eval(nxt, logprobs)
        return nxt, logprobs, before

    inflight = None  # a plain step started and not yet yielded (it has fed y)
    try:
        while max_tokens < 0 or ntoks < max_tokens:
            if inflight is None:
                left = policy.max_k if max_tokens < 0 else max_tokens - ntoks - 1
                drafts = index.propose(policy.choose(left))
                if not drafts:
                    policy.skip()
                    inflight = plain_step(y)
            if inflight is not None:
                # A plain decode step: mlx-lm's `generate_step` work and nothing more. As
                # there, while nothing matches the next step is started before this one's
                # token is read (undone at the end if its token is never yielded).
                tok, logprobs, _ = inflight
                last = max_tokens >= 0 and ntoks + 1 >= max_tokens
                # (with a grammar the next step's mask needs this token first: no overlap)
                inflight = (plain_step(tok) if guide is None and not last
                            and not index.occurrences() else None)
                y = tok.item()
                if guide is not None:
                    guide.feed(y)
                stats.plain += 1
                ntoks += 1
                stats.emitted += 1
                index.append(y)
                yield y, logprobs, False
                continue

            verify = begin_verify(cache)
            x = mx.array([y] + drafts, mx.uint32)
            logits = model(x[None], cache=cache)[0].astype(mx.float32)  # [m+1, V]
            if guide is not None:
                logits = guide.verify_logits(logits, drafts)
            q_lps = [] if sampling.greedy else _one_hot_log(drafts, logits.shape[-1])
            n, token, d_list, logprobs = judge_verify(
                logits, mx.array(drafts, mx.uint32), q_lps, sampling, stats)
            policy.record(len(drafts), n)
            emitted: List[int] = []
            pending = (verify, emitted)
            yield from emit_accepted(n, token, d_list, logprobs, emitted, stats,
                                     max_tokens - ntoks if max_tokens >= 0 else -1, guide)
            ntoks += len(emitted)
            settle(verify, len(emitted))
            pending = None
            index.extend(emitted)
            y = emitted[-1]
    finally:
        if inflight is not None:  # started ahead, its input (the last token) never yielded
            restore(cache, inflight[2])
        if pending is not None:
            verify, emitted = pending
            settle(verify, len(emitted))
            index.extend(emitted)
        end_verify(cache)  # also after an error inside a verify step
        # The target holds every token of the index but the last one (not yet fed).
        held.cache = [mx.array(index.tokens[:-1], mx.int32) if len(index) > 1 else None]
