"""Speculative decoding with a draft model, for targets whose caches cannot be trimmed.

The loop follows mlx-lm's `speculative_generate_step` (mlx_lm/generate.py): prefill
both models with the prompt but its last token; then, per step, the draft proposes up to
k tokens one at a time, the target scores [y, d1..dk] in one forward pass (its trunk is
read once for k + 1 tokens), some prefix of the drafts is accepted and one more token
comes from the target. Instead of mlx-lm's `trim` the caches are put back with
`kimi_mlx.speculative.rollback` (exact for KDA's recurrent state). Yields mlx-lm's
(token, logprobs, from_draft) triples, so `generation.streaming.stream_speculative` can give
`GenerationResponse`s that `kimi-mlx generate`'s printer shows unchanged.

Cost (MLX on a CPU or a small model: per graph node, not per FLOP): at temperature 0 a
draft whose caches are all fixed-size (a KDA-only kimi-mlx draft, like the shipped
micro-draft) proposes its k tokens as one compiled graph (`_GreedyChain`, with the fused
step of `kimi_mlx/speculative/draft_step.py`), left lazy so that it computes while the verify graph is
built (on Metal; on the CPU backend `async_eval` was measured doing most of the work
before it returns, so there the two simply run back to back); the only
host sync per step is the verify's argmax, and a rejection costs a pick of the kept
per-token KDA states (`kimi_mlx/speculative/rollback.py`), not a replay.

Acceptance rule (sampling stays the target's):
  * temperature 0: accept draft d_i while it equals the target's argmax at its position;
    the first mismatch is replaced by the target's argmax (mlx-lm's rule). The output is
    token for token the target's greedy output.
  * temperature > 0: speculative sampling (Leviathan, Kalman, Matias 2023, "Fast Inference
    from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023,
    "Accelerating LLM Decoding with Speculative Sampling"). With p_i the target's and q_i
    the draft's sampling distribution at position i (both after the same temperature,
    top-p, min-p and top-k filters as mlx-lm's `make_sampler`), d_i ~ q_i is accepted
    with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
    drawn from norm(max(0, p_i - q_i)) and the step ends; if all k are accepted a bonus
    token is drawn from p_k. Each emitted token is then distributed exactly as p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.sampling import DEFAULT_MAX_TOKENS, Sampling
from kimi_mlx.speculative.auto_k import AutoK, draft_policy
from kimi_mlx.speculative.rollback import begin_verify, end_verify, restore, rollback, snapshot
from kimi_mlx.speculative.settings import DEFAULT_NUM_DRAFT_TOKENS

__all__ = ["Sampling", "SpecStats", "Speculation", "OwnLoop", "loop_for", "DEFAULT_NUM_DRAFT_TOKENS", "accept_drafts", "draw_draft", "judge_verify",
           "speculative_generate_step", "TokenizerMismatch", "check_tokenizers", "load_draft"]


def accept_drafts(
    p_logprobs: mx.array, q_logprobs: mx.array, drafts: mx.array
) -> Tuple[mx.array, mx.array]:
    """Speculative-sampling acceptance (Leviathan et al. 2023, Algorithm 1).

    Args:
        p_logprobs: [k+1, V] float32 target sampling log-distributions at the k+1 verify
            positions.
        q_logprobs: [k, V] float32 draft sampling log-distributions the drafts came from.
        drafts: [k] int drafted tokens, d_i ~ q_i.
    Returns:
        (n, token): n int32 scalar, the number of accepted drafts (0..k); token int32
        scalar, drawn from norm(max(0, p_n - q_n)) when n < k, else from p_k. Uses the
        global `mx.random` state (k uniforms and k + 1 categorical draws).
    """
    k = drafts.shape[0]
    p = mx.exp(p_logprobs)
    if k == 0:
        return mx.array(0, mx.int32), mx.random.categorical(p_logprobs[0]).astype(mx.int32)
    q = mx.exp(q_logprobs)
    rows = mx.arange(k)
    pd, qd = p[rows, drafts], q[rows, drafts]
    u = mx.random.uniform(shape=(k,))
    ok = u * qd < pd  # u < p/q without dividing by a q that underflowed
    n = mx.where(mx.all(ok), k, mx.argmin(ok.astype(mx.int32))).astype(mx.int32)
    resid = mx.maximum(p[:k] - q, 0.0)
    mass = resid.sum(axis=-1, keepdims=True)
    # p == q to rounding: a rejection is then (almost) impossible; fall back to p.
    resid = mx.where(mass > 0, resid, p[:k])
    cands = mx.random.categorical(mx.log(resid))  # [k]
    bonus = mx.random.categorical(p_logprobs[k])
    token = mx.concatenate([cands, bonus[None]])[n].astype(mx.int32)
    return n, token


# ------------------------------------------------------------------------------- loop


@dataclass
class SpecStats:
    """Acceptance figures of a speculative run (updated as it goes)."""

    steps: int = 0  # verify steps
    plain: int = 0  # plain decode steps (an n-gram draft without a match: no verify)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens yielded
    per_step: List[int] = field(default_factory=list)  # accepted drafts per step

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per verify step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class OwnLoop:
    """A draft that brings its own speculative loop (`--draft ngram`'s `NgramDraft`,
    `--draft mtp`'s `MTP`): `generate_step` takes `speculative_generate_step`'s arguments
    and yields its triples. `prefills_itself`: the loop must see the whole prompt with
    fresh caches (the MTP pairs each prompt token with the target's hidden state, which
    a plain prefill of the target does not keep), so a server cannot prefill for it or
    restore its caches from a prompt cache."""

    prefills_itself = False
    # whether its loop checks drafts against a request's grammar (`grammar_guide`)
    checks_grammar = False

    def generate_step(self, prompt, model, draft_model, **kwargs):
        raise NotImplementedError


def loop_for(draft):
    """The one place that picks the speculative loop for a draft: its own (`OwnLoop`:
    n-gram lookup, MTP) or `speculative_generate_step`; called as step(prompt, target,
    draft, num_draft_tokens=, max_tokens=, sampling=, prompt_cache=, prefill_step_size=,
    stats=) and yielding (token, logprobs, from_draft)."""
    if isinstance(draft, OwnLoop):
        return draft.generate_step
    return speculative_generate_step


@dataclass
class Speculation:
    """A draft and the settings every front end (generate, chat, the servers, cluster
    launch) speculates with; `step` is the one place that picks the loop."""

    draft: Any
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    sampling: Sampling = field(default_factory=Sampling)
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def step(self):
        """The loop for this draft (`loop_for`)."""
        return loop_for(self.draft)

    @property
    def prefills_itself(self) -> bool:
        return isinstance(self.draft, OwnLoop) and self.draft.prefills_itself

    @property
    def checks_grammar(self) -> bool:
        """Whether the loop masks its verify steps with a request's structured-output
        grammar (`speculative_generate_step` and the n-gram loop do; the MTP's does not)."""
        return not isinstance(self.draft, OwnLoop) or self.draft.checks_grammar

    def kwargs(self) -> dict:
        """Keyword arguments for `stream_speculative` / `speculative_generate_step`."""
        return dict(num_draft_tokens=self.num_draft_tokens, sampling=self.sampling,
                    stats=self.stats)

    def summary(self) -> str:
        """One line of acceptance figures, e.g. for the end of `kimi-mlx generate` (and,
        with `--num-draft-tokens auto`, the k it chose)."""
        s = self.stats
        auto = (f"\n{self.num_draft_tokens.describe()}"
                if isinstance(self.num_draft_tokens, AutoK) else "")
        up_to = (f"1..{self.num_draft_tokens.max_k} (auto)"
                 if isinstance(self.num_draft_tokens, AutoK) else f"up to {self.num_draft_tokens}")
        return (f"Speculative: {s.steps} verify steps of {up_to} "
                f"drafts, {s.mean_accepted:.2f} accepted per step "
                f"({100 * s.acceptance_rate:.0f}% of drafted), "
                f"{s.emitted / max(s.steps + s.plain, 1):.2f} tokens per target pass"
                + (f"; {s.plain} plain steps without a draft" if s.plain else "") + auto)


def _vocab_align(logits: mx.array, vocab: Optional[int]) -> mx.array:
    """Draft logits [..., Vd] -> [..., vocab]: extra rows cut, missing ones -inf (a
    checkpoint may pad its vocabulary differently from the tokenizer's)."""
    vd = logits.shape[-1]
    if vocab is None or vd == vocab:
        return logits
    if vd > vocab:
        return logits[..., :vocab]
    pad = mx.full((*logits.shape[:-1], vocab - vd), -mx.inf, logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)


class _GreedyChain:
    """k greedy draft steps as one compiled graph (`mx.compile`), for a draft whose caches
    are all fixed-size arrays (mlx-lm `ArraysCache`: a KDA-only kimi-mlx draft such as the
    shipped micro-draft).

    On MLX the cost of a small model is per op and per Python call, not per FLOP: run
    eagerly, k draft steps build k graphs of a few hundred ops each. Compiled, the k steps
    (embedding, layers, head, argmax, the argmax fed to the next step) are one fused graph
    built by one call, and it stays lazy: the verify pass is built on top of the drafts and
    both are evaluated together, with no host sync between draft steps. One trace per
    (k, fed-token count, cache shapes); the draft's weights are captured as constants.

    Call: (tokens [m] int, caches) -> (drafts [k] uint32 lazy, snaps), where snaps[i] is
    `rollback.snapshot`'s form of the caches after step i + 1 (for `restore`); the caches
    are left as after step k (as k eager steps leave them).
    """

    def __init__(self, draft_model, vocab: Optional[int]):
        from kimi_mlx.speculative.draft_step import fused_step_for

        self.model, self.vocab = draft_model, vocab
        self._fns = {}
        # A KDA-only kimi-mlx draft steps with fused weights (kimi_mlx/speculative/draft_step.py): ~4x
        # fewer graph nodes than the model's own forward.
        self.fused = fused_step_for(draft_model)

    @classmethod
    def of(cls, draft_model, vocab: Optional[int]) -> "_GreedyChain":
        """The chain of this draft model, kept on the model (as a plain attribute, not a
        parameter) so that its traces serve every generation and die with the model."""
        chains = getattr(draft_model, CHAIN_ATTR, None)
        if chains is None:
            chains = {}
            object.__setattr__(draft_model, CHAIN_ATTR, chains)
        if vocab not in chains:
            chains[vocab] = cls(draft_model, vocab)
        return chains[vocab]

    @staticmethod
    def usable(sampling: "Sampling", caches: List[Any]) -> bool:
        """Greedy, every cache an `ArraysCache` holding arrays (not a batch's), and not
        under the Metal emulator (its kernels read their inputs, which a trace cannot)."""
        from mlx_lm.models.cache import ArraysCache

        from kimi_mlx.metal.dispatch import kernel_mode

        return (sampling.greedy and kernel_mode() != "sim" and bool(caches)
                and all(isinstance(c, ArraysCache) and getattr(c, "lengths", None) is None
                        and all(a is not None for a in c.cache) for c in caches))

    def _fn(self, k: int, sizes: Tuple[int, ...]):
        key = (k, sizes)
        if key not in self._fns:
            from mlx_lm.models.cache import ArraysCache

            def fused_chain(tokens, *flat):
                states = [tuple(flat[i : i + 2]) for i in range(0, len(flat), 2)]
                for t in range(tokens.shape[0]):
                    logits, states = self.fused(tokens[t : t + 1], states)
                drafts, out = [], []
                for i in range(k):
                    d = mx.argmax(_vocab_align(logits, self.vocab), axis=-1)
                    drafts.append(d)
                    out.extend(a for st in states for a in st)
                    if i + 1 < k:
                        logits, states = self.fused(d.reshape(1), states)
                return (mx.stack(drafts), *out)

            def chain(tokens, *flat):
                caches, i = [], 0
                for n in sizes:
                    c = ArraysCache(n)
                    c.cache = list(flat[i : i + n])
                    caches.append(c)
                    i += n
                feed, drafts, states = tokens, [], []
                for _ in range(k):
                    logits = self.model(feed[None], cache=caches)[0, -1]
                    d = mx.argmax(_vocab_align(logits, self.vocab), axis=-1)
                    drafts.append(d)
                    for c in caches:
                        states.extend(c.cache)
                    feed = d.reshape(1)
                return (mx.stack(drafts), *states)

            fused = self.fused is not None and all(n == 2 for n in sizes)
            self._fns[key] = mx.compile(fused_chain if fused else chain)
        return self._fns[key]

    def __call__(self, tokens: List[int], caches: List[Any], k: int):
        sizes = tuple(len(c.cache) for c in caches)
        out = self._fn(k, sizes)(mx.array(tokens, mx.uint32),
                                 *[a for c in caches for a in c.cache])
        drafts, flat, per = out[0], out[1:], sum(sizes)
        snaps = []
        for i in range(k):
            step, j = [], i * per
            for n in sizes:
                step.append(tuple(flat[j : j + n]))
                j += n
            snaps.append(step)
        for c, s in zip(caches, snaps[-1]):
            c.cache = list(s)
        return drafts, snaps


CHAIN_ATTR = "_kimi_mlx_greedy_chains"  # vocab -> _GreedyChain, on the draft model


def draw_draft(logits: mx.array, sampling: Sampling, q_lps: List[mx.array]) -> mx.array:
    """One draft token from the draft's logits row [V]: its argmax when greedy, else a
    sample from `sampling.log_probs(logits)`, whose log-distribution is appended to q_lps
    (the q of `accept_drafts`). Evaluation is started (`mx.async_eval`), not awaited."""
    if sampling.greedy:
        d = mx.argmax(logits, axis=-1)
    else:
        lq = sampling.log_probs(logits)
        d = mx.random.categorical(lq)
        q_lps.append(lq)
    mx.async_eval(d)
    return d


def judge_verify(logits: mx.array, drafts: mx.array, q_lps: List[mx.array],
                 sampling: Sampling, stats: SpecStats, also: Sequence[mx.array] = ()
                 ) -> Tuple[int, int, List[int], mx.array]:
    """How many drafts a verify pass accepts, and the token that follows them.

    Args:
        logits: [k+1, V] float32 target logits at [y, d1..dk].
        drafts: [k] uint32 drafted tokens. q_lps: their k draft log-distributions
            (sampled drafts only). sampling: the target's settings (see the module
            docstring for both rules). stats: updated with this step.
        also: arrays to evaluate in the same host sync (e.g. the MTP's hidden states).
    Returns:
        (n accepted, next token, drafts as a list, log-probs [k+1, V] of the logits).
    """
    k = drafts.shape[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if sampling.greedy:
        target = mx.argmax(logits, axis=-1)
        mx.eval(target, drafts, *also)
        t_list, d_list = target.tolist(), drafts.tolist()
        n = 0
        while n < k and t_list[n] == d_list[n]:
            n += 1
        token = t_list[n]
    else:
        p_lps = sampling.log_probs(logits)
        q_arr = mx.stack(q_lps) if q_lps else mx.zeros((0, logits.shape[-1]))
        n_arr, t_arr = accept_drafts(p_lps, q_arr, drafts.astype(mx.int32))
        mx.eval(n_arr, t_arr, drafts, *also)
        n, token, d_list = n_arr.item(), t_arr.item(), drafts.tolist()
    stats.steps += 1
    stats.drafted += k
    stats.accepted += n
    stats.per_step.append(n)
    return n, token, d_list, logprobs


def grammar_guide(sampling: Sampling):
    """The structured-output processor a speculative loop checks its drafts with
    (`generation.constrain.GrammarProcessor`: `verify_logits` masks the verify step's
    rows, `feed` takes each emitted token), or None for a request without a constraint."""
    c = getattr(sampling, "constraint", None)
    return None if c is None else c.processor()


def emit_accepted(n: int, token: int, d_list: List[int], logprobs: mx.array, emitted: List[int],
                  stats: SpecStats, left: int, guide=None) -> Iterator[Tuple[int, mx.array, bool]]:
    """Yield one verify step's tokens, (token, logprobs [V] float32, from_draft): the n
    accepted drafts `d_list[:n]`, then the target's own `token`; `judge_verify`'s outputs.

    Each token is appended to `emitted` before it is yielded, so a caller that settles its
    caches in a `finally` (the consumer stopped the generator mid-step) rolls back to
    exactly what was handed out. Stops after `left` tokens (negative: no limit), the rest
    of `max_tokens`. `guide`: the request's grammar processor (`grammar_guide`), fed each
    token as it is emitted. Shared by the draft-model, MTP and n-gram loops."""
    for i in range(n + 1):
        tok = d_list[i] if i < n else token
        emitted.append(tok)
        if guide is not None:
            guide.feed(tok)
        stats.emitted += 1
        yield tok, logprobs[i], i < n
        if 0 <= left <= len(emitted):
            break


def prefill_chunks(model, cache, tokens: List[int], step: int) -> None:
    """Run `tokens` through `model` into `cache` in chunks of `step` (evaluating the
    caches after each, as mlx-lm's generate_step does)."""
    for s in range(0, len(tokens), step):
        model(mx.array(tokens[s : s + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def _split_caches(model, draft_model, prompt_cache):
    """(target caches, draft caches): new ones, or mlx-lm's one list, target's first."""
    if prompt_cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model), make_prompt_cache(draft_model)
    return prompt_cache[: len(model.layers)], prompt_cache[len(model.layers) :]


def _draft(draft_model, draft_cache, draft_in: List[int], k: int, sampling: Sampling,
           chain, vocab: Optional[int]):
    """Run the draft for k tokens after feeding `draft_in`; a cache snapshot (references)
    after each. Returns (drafts uint32 [k], snapshots, draft logprobs per token (empty for
    greedy)). At temperature 0 with a fixed-size draft cache the k steps are one compiled
    graph (`_GreedyChain`), started here and finished while the verify graph is built."""
    snaps, drafts, q_lps = [], [], []
    if k and chain is not None and _GreedyChain.usable(sampling, draft_cache):
        d_arr, snaps = chain(draft_in, draft_cache, k)
        mx.async_eval(d_arr)  # the drafts compute while the verify graph is built
        return d_arr, snaps, q_lps
    feed = mx.array(draft_in)
    for _ in range(k):
        logits = _vocab_align(draft_model(feed[None], cache=draft_cache)[0, -1], vocab)
        snaps.append(snapshot(draft_cache))
        d = draw_draft(logits, sampling, q_lps)
        drafts.append(d)
        feed = d.reshape(1).astype(mx.uint32)
    d_arr = mx.stack(drafts).astype(mx.uint32) if drafts else mx.array([], mx.uint32)
    return d_arr, snaps, q_lps


def speculative_generate_step(
    prompt,
    model,
    draft_model,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: Optional[Sampling] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    stats: Optional[SpecStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Generate with speculative decoding; yields (token, logprobs [V], from_draft).

    Args:
        prompt: token ids (list or 1-D mx.array), at least one.
        model: the target (any model whose caches `kimi_mlx.speculative.rollback` handles: our Kimi
            model, or an mlx-lm model with trimmable caches).
        draft_model: the draft (same tokenizer; kimi-mlx or mlx-lm model).
        num_draft_tokens: k, drafts per verify step (>= 1), or "auto" / an `AutoK` (k
            chosen per step from measured acceptance and step times,
            `kimi_mlx.speculative.auto_k`).
        max_tokens: tokens to yield at most (-1: no limit).
        sampling: target sampling settings (default greedy); see the module docstring for
            the acceptance rule.
        prompt_cache: target caches followed by draft caches (mlx-lm's convention), used
            and updated in place; new caches when None. When generation ends (or the
            generator is closed) both hold every token but the last one yielded, as after
            mlx-lm's `generate_step`.
        prefill_step_size: prompt tokens per prefill forward pass.
        stats: updated with the acceptance figures when given.
    Raises:
        ValueError: an empty prompt or num_draft_tokens < 1.
    """
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    policy = draft_policy(num_draft_tokens)
    sampling = sampling or Sampling()
    stats = stats if stats is not None else SpecStats()
    model_cache, draft_cache = _split_caches(model, draft_model, prompt_cache)
    prefill_chunks(draft_model, draft_cache, prompt[:-1], prefill_step_size)
    prefill_chunks(model, model_cache, prompt[:-1], prefill_step_size)

    vocab = model_vocab(model)
    chain = _GreedyChain.of(draft_model, vocab) if sampling.greedy else None
    guide = grammar_guide(sampling)
    y = prompt[-1]  # last token, not yet fed to the target
    draft_in: List[int] = [y]  # tokens not yet fed to the draft (ends with y)
    ntoks = 0
    step = None  # the verify step whose rollback is pending

    def settle(st, m: int) -> List[int]:
        """Caches hold everything but the m-th (last) emitted token of this step; returns
        the tokens the draft has yet to be fed."""
        verify, snaps, drafts, emitted = st
        rollback(model_cache, verify, m)
        end_verify(model_cache)
        if not snaps:  # no draft step ran: the draft is fed nothing yet
            return draft_in + emitted[m - 1 : m]
        if m - 1 < len(snaps):
            restore(draft_cache, snaps[m - 1])
            return [emitted[m - 1]]
        return [drafts[-1], emitted[m - 1]]  # all accepted: the draft never saw d_k

    try:
        while max_tokens < 0 or ntoks < max_tokens:
            left = policy.max_k if max_tokens < 0 else max_tokens - ntoks - 1
            k = policy.choose(left)
            d_arr, snaps, q_lps = _draft(draft_model, draft_cache, draft_in, k, sampling, chain, vocab)

            # Verify: the target scores [y, d1..dk] in one pass, recording for rollback.
            verify = begin_verify(model_cache)
            x = mx.concatenate([mx.array([y], mx.uint32), d_arr])
            logits = model(x[None], cache=model_cache)[0].astype(mx.float32)  # [k+1, V]
            if guide is not None:
                logits = guide.verify_logits(logits, d_arr.tolist())
            n, token, d_list, logprobs = judge_verify(logits, d_arr, q_lps, sampling, stats)
            policy.record(k, n)

            emitted: List[int] = []
            step = (verify, snaps, d_list, emitted)
            yield from emit_accepted(n, token, d_list, logprobs, emitted, stats,
                                     max_tokens - ntoks if max_tokens >= 0 else -1, guide)
            ntoks += len(emitted)
            draft_in = settle(step, len(emitted))
            step = None
            y = emitted[-1]
    finally:
        if step is not None and step[3]:
            draft_in = settle(step, len(step[3]))
        elif step is not None:
            rollback(model_cache, step[0], 0)
            end_verify(model_cache)
        end_verify(model_cache)  # also after an error inside a verify step
        if len(draft_in) > 1:  # leave the draft with every token but the last, too
            draft_model(mx.array(draft_in[:-1])[None], cache=draft_cache)
            mx.eval([c.state for c in draft_cache])


def model_vocab(model) -> Optional[int]:
    """Output vocabulary size of a kimi-mlx or mlx-lm model (its args' vocab_size), or
    None when the model does not say (draft logits are then used as they are)."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


# ---------------------------------------------------------------------- draft loading


class TokenizerMismatch(ValueError):
    """The draft's tokenizer differs from the target's (the message names both)."""


def _vocab(tok) -> dict:
    return dict(tok.get_vocab())


def _specials(tok) -> dict:
    """Special tokens by name -> id (added tokens marked special, and the named ones)."""
    out = {}
    dec = getattr(tok, "added_tokens_decoder", None) or {}
    for i, t in dec.items():
        if getattr(t, "special", True):
            out[str(t)] = int(i)
    for name in getattr(tok, "all_special_tokens", []) or []:
        out[name] = tok.convert_tokens_to_ids(name)
    return out


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose tokenizer is not the target's: same vocabulary (token -> id)
    and same special tokens (name -> id).

    Args:
        target_tok, draft_tok: Hugging Face tokenizers or mlx-lm TokenizerWrappers.
        target_name, draft_name: paths or ids, for the message.
    Raises:
        TokenizerMismatch: naming both models and the first difference found.
    """
    tv, dv = _vocab(target_tok), _vocab(draft_tok)
    head = (f"draft model {draft_name} does not share the tokenizer of target model "
            f"{target_name}")
    if tv != dv:
        if len(tv) != len(dv):
            raise TokenizerMismatch(f"{head}: vocabulary of {len(dv)} tokens vs {len(tv)}")
        diff = next(t for t in sorted(set(tv) | set(dv), key=str) if tv.get(t) != dv.get(t))
        raise TokenizerMismatch(f"{head}: token {diff!r} has id {dv.get(diff)} in the draft "
                                f"and {tv.get(diff)} in the target")
    ts, ds = _specials(target_tok), _specials(draft_tok)
    if ts != ds:
        diff = next(t for t in sorted(set(ts) | set(ds)) if ts.get(t) != ds.get(t))
        raise TokenizerMismatch(f"{head}: special token {diff!r} is {ds.get(diff)} in the "
                                f"draft and {ts.get(diff)} in the target")


def _is_kimi_checkpoint(path) -> bool:
    import json
    from pathlib import Path

    from kimi_mlx.model.config import ACCEPTED_MODEL_TYPES

    cfg = Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") in ACCEPTED_MODEL_TYPES
    except (OSError, ValueError):
        return False


def load_draft(spec: str, target_wrapper, target_name: str):
    """Load a draft model: a kimi-mlx checkpoint (our loader) or any mlx-lm-loadable
    model; its tokenizer must match the target's (`check_tokenizers`).

    Returns:
        the draft model.
    Raises:
        TokenizerMismatch, FileNotFoundError, ValueError (from the loaders).
    """
    from kimi_mlx.checkpoint.hub import resolve

    path = resolve(spec)
    if _is_kimi_checkpoint(path):
        from kimi_mlx.checkpoint.loader import load_for_generation

        draft, wrapper, _, _ = load_for_generation(str(path))
    else:
        from mlx_lm.utils import load

        draft, wrapper = load(str(path))
    check_tokenizers(target_wrapper, wrapper, target_name, spec)
    return draft
