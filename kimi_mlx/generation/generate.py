"""The generate library: `kimi-mlx generate`'s flags, the token stream and its printer.

A thin layer over mlx-lm's `stream_generate` (sampling, generation loop, statistics):
we only add the K3.1 chat encoding (`--reasoning-effort`), our loader, input checks and
the speculative paths. `kimi_mlx.commands.generate` and `cluster launch` call it; the
printer ends with prompt / generation tokens-per-second and peak memory, as mlx-lm prints
them.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Iterator, List

from kimi_mlx.sampling import Sampling

from kimi_mlx.generation.request import (  # noqa: F401  (re-exported: the request path lives in request.py)
    DEFAULT_MAX_TOKENS, EFFORTS, InputError, add_draft_arguments, add_model_arguments, add_mtp_argument,
    add_quiet_argument, parse_bool,
    build_prompt, check_context, check_draft_arguments, check_model_arguments, default_model,
    resolve_model_arg, token_budget,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text, or '-' to read stdin")
    p.add_argument("--system-prompt", default=None, help="system message")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as raw text, without the chat encoding")
    p.add_argument("--verbose", type=parse_bool, default=True, metavar="{true,false}",
                   help="print timing and memory at the end (default: true)")
    add_draft_arguments(p, mtp=True)
    add_mtp_argument(p)
    add_quiet_argument(p)


def stream(model, wrapper, prompt_ids: List[int], sampling: Sampling, max_tokens: int,
           speculation=None, input_embeddings=None) -> Iterator:
    """mlx-lm `stream_generate` with `sampling`'s sampler, or speculative decoding with
    `speculation` (`streaming.stream_speculative`); yields GenerationResponse.
    `input_embeddings` [L, hidden]: the prompt's embeddings (images in it), passed to
    mlx-lm's generate_step; not with speculation (InputError). A seed seeds MLX's global
    PRNG first (as `mlx_lm.generate --seed`)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    if speculation is not None:
        from kimi_mlx.generation.streaming import stream_speculative

        if input_embeddings is not None:
            raise InputError("images do not work with speculative decoding yet: drop "
                             "--draft-model / --draft or the images")

        yield from stream_speculative(model, speculation, wrapper, prompt_ids,
                                      max_tokens=max_tokens)
        return
    extra = {} if input_embeddings is None else {"input_embeddings": input_embeddings}
    yield from stream_generate(model, wrapper, prompt_ids, max_tokens=max_tokens,
                               sampler=replace(sampling, seed=None).sampler(), **extra)


def use_color(stream=None) -> bool:
    """Escape codes (dimmed reasoning) only on a terminal and without NO_COLOR set to a
    non-empty value (https://no-color.org)."""
    stream = sys.stdout if stream is None else stream
    return stream.isatty() and not os.environ.get("NO_COLOR")


def print_generation(responses, verbose: bool = True, raw: bool = False) -> int:
    """Stream mlx-lm GenerationResponses to stdout as `kimi-mlx generate` does (reasoning
    dimmed on a terminal unless `raw`: --ignore-chat-template), then mlx_lm.generate's
    timing and peak-memory lines when `verbose`. Shared with `kimi-mlx cluster launch`."""
    from kimi_mlx.text.reply_parse import ReplyStream

    pretty = ReplyStream() if not raw else None
    dim = use_color()
    if verbose:
        print("=" * 10)
    response = None
    for response in responses:
        if pretty is None:
            print(response.text, end="", flush=True)
            continue
        for channel, text in pretty.feed(response.text):
            if channel == "reasoning" and dim:
                text = f"\033[2m{text}\033[0m"
            print(text, end="", flush=True)
    if pretty is not None:
        for channel, text in pretty.finish():
            print(text, end="", flush=True)
    print()
    if verbose and response is not None:
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, "
              f"{response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, "
              f"{response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return 0
