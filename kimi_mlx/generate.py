"""`kimi-mlx generate`: one-shot generation, streamed, with mlx_lm.generate's flags.

A thin layer over mlx-lm's `stream_generate` (sampling, generation loop, statistics):
we only add the K3.1 chat encoding (`--reasoning-effort`), our loader, and input checks.
Ends with prompt / generation tokens-per-second and peak memory, as mlx-lm prints them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional

DEFAULT_MAX_TOKENS = 256
EFFORTS = ("low", "high", "max")


class InputError(ValueError):
    """Bad user input (empty prompt, prompt longer than the context, ...)."""


def default_model() -> Optional[Path]:
    """The shipped default checkpoint (trained micro model), if this install has one."""
    path = Path(__file__).parent / "assets" / "micro"
    return path if (path / "config.json").exists() else None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared with chat / cluster launch: --model and sampling."""
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hugging Face id (default: the shipped micro model)")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"maximum number of tokens to generate (default {DEFAULT_MAX_TOKENS}; -1 = up to the context)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="cap on prompt + generated tokens (generation stops there, with a "
                        "note; unlike mlx-lm's rotating cache, since KDA state cannot rotate). "
                        "KDA state is constant, DSA caches grow per token")
    p.add_argument("--reasoning-effort", choices=EFFORTS, default="max",
                   help="K3.1 thinking effort in the chat encoding (default max)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text, or '-' to read stdin")
    p.add_argument("--system-prompt", default=None, help="system message")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as raw text, without the chat encoding")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"),
                   default=True, help="print timing and memory at the end (default: True)")
    add_draft_arguments(p)


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """--draft-model / --num-draft-tokens (mlx-lm's names): speculative decoding."""
    p.add_argument("--draft-model", default=None,
                   help="draft checkpoint for speculative decoding: a kimi-mlx checkpoint or "
                        "any mlx-lm model with the same tokenizer (output stays the model's)")
    p.add_argument("--num-draft-tokens", type=int, default=3,
                   help="tokens the draft proposes per verify step (default 3)")


def check_draft_arguments(args) -> None:
    """InputError when --num-draft-tokens < 1 while a --draft-model is given."""
    if getattr(args, "draft_model", None) and args.num_draft_tokens < 1:
        raise InputError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")


def load_speculation(args, wrapper, target_name: str):
    """The `speculative.Speculation` for --draft-model (None without one): the draft
    loaded and its tokenizer checked against the target's (`speculative.load_draft`)."""
    if not getattr(args, "draft_model", None):
        return None
    from .speculative import Sampling, Speculation, load_draft

    draft = load_draft(args.draft_model, wrapper, target_name)
    return Speculation(draft, args.num_draft_tokens,
                       Sampling(args.temp, args.top_p, args.min_p, args.top_k))


def check_model_arguments(args) -> None:
    """Range checks of the flags `add_model_arguments` adds (before any model is loaded).

    Raises:
        InputError: --max-tokens not -1 (no limit) or >= 1, --temp < 0, --top-p outside
            (0, 1], --min-p outside [0, 1], --top-k < 0, or --max-kv-size < 1.
    """
    if args.max_tokens != -1 and args.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, or -1 for no limit (got {args.max_tokens})")
    if args.temp < 0:
        raise InputError(f"--temp must be >= 0 (0 = greedy), got {args.temp}")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if not 0 <= args.min_p <= 1:
        raise InputError(f"--min-p must be in [0, 1] (0 = off), got {args.min_p}")
    if args.top_k < 0:
        raise InputError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise InputError(f"--max-kv-size must be >= 1 token, got {args.max_kv_size}")


def resolve_model_arg(spec: Optional[str]) -> str:
    """--model value, or the shipped default; InputError when neither exists."""
    if spec:
        return spec
    path = default_model()
    if path is None:
        raise InputError("no --model given and this install ships no default checkpoint")
    return str(path)


def build_prompt(tokenizer, prompt: str, system: Optional[str], raw: bool, effort: str) -> List[int]:
    """Token ids for the prompt: K3.1 chat encoding unless `raw`."""
    if not prompt:
        raise InputError("the prompt is empty")
    if raw:
        text = prompt if system is None else f"{system}\n{prompt}"
        return tokenizer.encode(text)
    from .chat_format import encode_chat

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return encode_chat(tokenizer, messages, reasoning_effort=effort, add_generation_prompt=True)


def token_budget(n_prompt: int, max_tokens: int, context: int) -> int:
    """Tokens that may be generated after an n_prompt-token prompt: max_tokens, capped by
    the room left in a context of `context` tokens (max_tokens -1 = all of that room)."""
    room = context - n_prompt
    return room if max_tokens < 0 else min(max_tokens, room)


def check_context(n_prompt: int, max_tokens: int, context: int, source: str) -> int:
    """Number of tokens that may still be generated (max_tokens -1 = up to the context);
    InputError when the prompt does not fit. When the context cuts a --max-tokens request
    short, says so on stderr (generation would otherwise just stop early)."""
    if n_prompt >= context:
        raise InputError(
            f"the prompt is {n_prompt} tokens, longer than the context of {context} tokens "
            f"({source})"
        )
    budget = token_budget(n_prompt, max_tokens, context)
    if 0 <= budget < max_tokens:
        print(f"note: generating at most {budget} tokens: the prompt ({n_prompt}) and the "
              f"generation must fit in {context} tokens ({source})", file=sys.stderr)
    return budget


def load_for_generation(spec: str):
    """(model, mlx-lm TokenizerWrapper, our KimiTokenizer, config) for a checkpoint."""
    from mlx_lm.utils import load_tokenizer

    from .hub import resolve
    from .loader import load_model
    from .tokenizer import KimiTokenizer, register_with_transformers

    model_dir = resolve(spec)
    model, config, _ = load_model(model_dir)
    kimi_tok = KimiTokenizer.from_pretrained(model_dir)
    register_with_transformers()
    wrapper = load_tokenizer(model_dir, eos_token_ids=kimi_tok.eos_token_ids)
    return model, wrapper, kimi_tok, config


def stream(model, wrapper, prompt_ids: List[int], args, speculation=None) -> Iterator:
    """mlx-lm `stream_generate` with our sampler settings, or speculative decoding with
    `speculation` (`speculative.stream_speculative`); yields GenerationResponse."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if args.seed is not None:
        mx.random.seed(args.seed)
    if speculation is not None:
        from .speculative import stream_speculative

        yield from stream_speculative(model, speculation.draft, wrapper, prompt_ids,
                                      max_tokens=args.max_tokens, **speculation.kwargs())
        return
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    yield from stream_generate(
        model, wrapper, prompt_ids, max_tokens=args.max_tokens, sampler=sampler
    )


def run(args) -> int:
    try:
        check_model_arguments(args)
        check_draft_arguments(args)
        spec = resolve_model_arg(args.model)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if prompt is None:
            raise InputError("give a prompt with --prompt TEXT (or --prompt - for stdin)")
        model, wrapper, tok, config = load_for_generation(spec)
        ids = build_prompt(tok, prompt, args.system_prompt, args.ignore_chat_template,
                           args.reasoning_effort)
        context = model.args.max_position_embeddings
        source = "max_position_embeddings in config.json"
        if args.max_kv_size:
            context, source = min(context, args.max_kv_size), "--max-kv-size"
        args.max_tokens = check_context(len(ids), args.max_tokens, context, source)
        speculation = load_speculation(args, wrapper, spec)
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx generate: error: {e}", file=sys.stderr)
        return 2

    rc = print_generation(args, stream(model, wrapper, ids, args, speculation))
    if speculation is not None and args.verbose:
        print(speculation.summary())
    return rc


def print_generation(args, responses) -> int:
    """Stream mlx-lm GenerationResponses to stdout as `kimi-mlx generate` does (reasoning
    dimmed on a terminal unless --ignore-chat-template), then mlx_lm.generate's timing
    and peak-memory lines when --verbose. Shared with `kimi-mlx cluster launch`."""
    from .chat_format import ReplyStream

    pretty = ReplyStream() if not args.ignore_chat_template else None
    dim = sys.stdout.isatty()
    if args.verbose:
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
    if args.verbose and response is not None:
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, "
              f"{response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, "
              f"{response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx generate")
    add_arguments(p)
    return run(p.parse_args(argv))
