"""Token iterator -> mlx-lm `GenerationResponse`s: the one place that turns generated
tokens into streamed text, tokens/s and finish reasons.

mlx-lm's `stream_generate` does this for its own `generate_step` / speculative step only;
our other token sources (speculative decoding with an untrimmable cache, the cluster
pipeline, both together) yield the same (token, logprobs[, from_draft]) tuples and go
through `stream_responses`, so `kimi-mlx generate`, `chat` and `cluster launch` print
the same thing from any of them.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

from kimi_mlx.sampling import DEFAULT_MAX_TOKENS

__all__ = ["stream_responses", "stream_speculative"]


def stream_responses(
    tokens: Iterable[Tuple],
    tokenizer,
    n_prompt: int,
    max_tokens: int,
    peak_memory: Callable[[], int],
    before_final: Optional[Callable[[], None]] = None,
) -> Iterator:
    """Yield mlx-lm `GenerationResponse`s for `tokens`, as mlx-lm's `stream_generate` does.

    Args:
        tokens: (token id, logprobs or None) or (token id, logprobs, from_draft) tuples.
        tokenizer: an mlx-lm `TokenizerWrapper` (its detokenizer and EOS ids are used).
        n_prompt: prompt tokens, for prompt tokens/s (timed up to the first token).
        max_tokens: stop after this many tokens (-1: no limit).
        peak_memory: bytes of peak memory to report (e.g. `mx.get_peak_memory`).
        before_final: called before the final response (e.g. closing the token
            generator, so caches are settled when the caller sees the end).
    Stops at an EOS token (not printed) or at `max_tokens`; the last response carries
    finish_reason "stop" or "length". Nothing is yielded when `tokens` is empty.
    """
    from mlx_lm.generate import GenerationResponse

    detok = tokenizer.detokenizer
    detok.reset()
    tic = time.perf_counter()
    prompt_tps = 0.0
    token, logprobs, from_draft, n = None, None, False, 0
    for n, item in enumerate(tokens):
        token, logprobs = item[0], item[1]
        from_draft = bool(item[2]) if len(item) > 2 else False
        if n == 0:
            prompt_tps = n_prompt / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        detok.add_token(token)
        if (n + 1) == max_tokens:
            break
        yield GenerationResponse(
            text=detok.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=peak_memory() / 1e9, finish_reason=None)
    if before_final is not None:
        before_final()
    if token is None:
        return
    detok.finalize()
    yield GenerationResponse(
        text=detok.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
        prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
        generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
        peak_memory=peak_memory() / 1e9,
        finish_reason="stop" if token in tokenizer.eos_token_ids else "length")


def stream_speculative(
    model,
    speculation,
    tokenizer,
    prompt: List[int],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompt_cache=None,
) -> Iterator:
    """mlx-lm `stream_generate` for speculative decoding with `speculation`
    (`speculative.loop.Speculation`: its draft, k, sampling and stats; its `step` picks
    the loop): yields mlx-lm `GenerationResponse`s (from_draft marks accepted drafts),
    stops at an EOS token like mlx-lm, and closes the generator so the caches are settled
    before returning. `prompt_cache`: the target's caches followed by the draft's, kept
    across calls (a chat's turns)."""
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    gen = speculation.step(prompt, model, speculation.draft, max_tokens=max_tokens,
                           prompt_cache=prompt_cache, **speculation.kwargs())
    try:
        yield from stream_responses(gen, tokenizer, len(prompt), max_tokens,
                                    mx.get_peak_memory, before_final=gen.close)
    finally:
        gen.close()
