"""The one request path shared by every front end (`kimi-mlx generate`, `chat`, the
cluster head and `kimi-mlx server`): model resolution and loading, the prompt built from
a prompt string or chat messages, the check against the context, sampling parameters
(mlx-lm's `make_sampler`) and stop strings.

Nothing here prints except `check_context`'s note for the CLIs; nothing here knows HTTP.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from kimi_mlx.sampling import DEFAULT_MAX_TOKENS, InputError, Sampling  # noqa: F401  (re-exported)
from kimi_mlx.speculative.settings import (DEFAULT_NGRAM_MAX as NGRAM_MAX, DEFAULT_NGRAM_MIN as NGRAM_MIN,
                                           DEFAULT_NUM_DRAFT_TOKENS, DRAFT_KINDS, DraftSettings)
from kimi_mlx.speculative.auto_k import DEFAULT_AUTO_MAX

EFFORTS = ("low", "high", "max")
# The smallest usable cap on prompt + generated tokens: a prompt holds at least one token
# and a request generates at least one, so a cap of 1 could never serve anything
MIN_KV_SIZE = 2


def default_model() -> Optional[Path]:
    """The shipped default checkpoint (trained micro model), if this install has one."""
    path = Path(__file__).resolve().parents[1] / "assets" / "micro"
    return path if (path / "config.json").exists() else None


MICRO_NOTE = (
    "note: this is the shipped micro model (kimi_mlx/assets/micro, 5.1M parameters of the "
    "Kimi K3.1 architecture), trained on Python standard-library code and documentation "
    "prose and not chat-tuned: chat prompts get noise. It continues raw text, e.g. "
    "--ignore-chat-template --prompt 'PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2' or "
    "'class Queue:'. Give --model PATH_OR_HF_ID for a real model; "
    "kimi_mlx/assets/micro/MODEL_CARD.md says more about this one."
)


def micro_note(spec: str, raw: bool = False) -> Optional[str]:
    """`MICRO_NOTE` when `spec` is the shipped micro checkpoint and the prompt goes through
    the chat encoding (`raw` False), which it was never trained on; otherwise None."""
    path = default_model()
    if raw or path is None:
        return None
    try:
        same = Path(spec).expanduser().resolve() == path
    except OSError:
        return None
    return MICRO_NOTE if same else None


def parse_bool(text: str) -> bool:
    """A boolean flag's value: true/false, t/f, yes/no, y/n, 1/0 (any case); anything
    else is an argparse error naming the value (mlx-lm's `str2bool` reads 'maybe' as
    True, and a lenient reader as False: neither is what was meant)."""
    value = text.strip().lower()
    if value in ("1", "true", "t", "yes", "y"):
        return True
    if value in ("0", "false", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_quiet_argument(p: argparse.ArgumentParser) -> None:
    """`--quiet`: no progress bar while the checkpoint loads (there is none in a pipe)."""
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar while loading (shown only on a terminal)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared with chat / cluster launch / server: --model and sampling."""
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
                   help="context: prompt + generated tokens (generation stops there, with a "
                        "note; unlike mlx-lm's rotating cache, since KDA state cannot rotate). "
                        "KDA state is constant, DSA caches grow per token. Past the checkpoint's "
                        "max_position_embeddings it serves a longer context, with a warning")
    p.add_argument("--reasoning-effort", choices=EFFORTS, default="max",
                   help="K3.1 thinking effort in the chat encoding (default max)")


def check_model_arguments(args) -> None:
    """Range checks of the flags `add_model_arguments` adds (before any model is loaded).

    Raises:
        InputError: --max-tokens not -1 (no limit) or >= 1, --temp < 0, --top-p outside
            (0, 1], --min-p outside [0, 1], --top-k < 0, or --max-kv-size < 2.
    """
    if args.max_tokens != -1 and args.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, or -1 for no limit (got {args.max_tokens})")
    sampling_from_args(args).check(flags=True)
    check_max_kv_size(args.max_kv_size)


def check_max_kv_size(value: Optional[int]) -> None:
    """InputError unless --max-kv-size is None (no cap) or >= MIN_KV_SIZE (2): the cap
    must leave room for one prompt token and one generated token. The same floor for
    generate, chat, cluster launch and both servers."""
    if value is not None and value < MIN_KV_SIZE:
        raise InputError(f"--max-kv-size must be >= {MIN_KV_SIZE} tokens (one prompt token "
                         f"and one generated token), got {value}")


def serving_context(trained: int, max_kv_size: Optional[int]) -> Tuple[int, str]:
    """(context in tokens, where it comes from) for a checkpoint trained on `trained`
    tokens (config max_position_embeddings) and a --max-kv-size (None: not given).

    --max-kv-size sets the context either way: below `trained` it caps it; above, it
    serves a longer context than the checkpoint declares (agent CLIs' first prompts are
    9k-40k tokens, longer than the micro model's 4096), with one warning naming both
    lengths: positions past `trained` were never seen in training, so quality there is
    not known (nothing runs out: K3.1 has no rotary embedding, dsa.py, and KDA state is
    position-free)."""
    if not max_kv_size:
        return trained, "max_position_embeddings in config.json"
    if max_kv_size > trained:
        logging.getLogger(__name__).warning(
            "--max-kv-size %d is past the checkpoint's trained context of %d tokens "
            "(max_position_embeddings): serving %d tokens; output past %d positions is "
            "out of what the model was trained on", max_kv_size, trained, max_kv_size, trained)
    return max_kv_size, "--max-kv-size"


def add_draft_arguments(p: argparse.ArgumentParser, note: str = "", mtp: bool = False) -> None:
    """--draft-model / --num-draft-tokens (mlx-lm's names): speculative decoding.
    `note` is appended to --draft-model's help (e.g. the server's concurrency rule);
    `mtp`: the command also has --draft mtp (`add_mtp_argument`), which the help names."""
    p.add_argument("--draft-model", default=None,
                   help="draft checkpoint for speculative decoding: a kimi-mlx checkpoint, "
                        "any mlx-lm model with the same tokenizer, or a DFlash / DSpark "
                        "block drafter folder (config.json with dflash_config; in one process, "
                        "a tensor group or the pipeline, whose stages send it the target's "
                        "hidden states) (output stays the model's)"
                        + note)
    p.add_argument("--num-draft-tokens", type=_num_draft_tokens, default=None,
                   help=f"tokens the draft proposes per verify step (default "
                        f"{DEFAULT_NUM_DRAFT_TOKENS}), or auto (auto:N: at most N, default "
                        f"{DEFAULT_AUTO_MAX}) to choose k as it runs from the measured "
                        f"acceptance per position and step time per k; needs --draft-model"
                        + (" or --draft)" if mtp else ")"))


def _num_draft_tokens(text: str):
    """argparse type of --num-draft-tokens: an int, "auto" or "auto:N" (values < 1 are
    refused later, by check_draft_arguments, with the flag's name)."""
    from kimi_mlx.speculative.auto_k import auto_cap, parse_num_draft_tokens

    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = parse_num_draft_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if auto_cap(value) is None:  # pragma: no cover - ints returned above
        raise argparse.ArgumentTypeError(f"not a number of draft tokens: {text!r}")
    return value


def add_mtp_argument(p: argparse.ArgumentParser) -> None:
    """--draft KIND: a draft without a separate draft model, and the n-gram sizes.

    mtp: the checkpoint's own MTP layers (generate, chat, server; the cluster commands
    refuse it by name, `speculative.factory.check_draft_target`); ngram: prompt-lookup
    drafts from the context (`kimi_mlx.speculative.ngram`; every command)."""
    helps = {"mtp": "mtp: the checkpoint's own multi-token-prediction layers as the draft "
                    "(config num_nextn_predict_layers > 0)",
             "ngram": "ngram: prompt lookup, the tokens that followed the longest earlier "
                      "match of the context's last --ngram-max..--ngram-min tokens (no "
                      "draft model; a step without a match is a plain step)"}
    p.add_argument("--draft", choices=DRAFT_KINDS, default=None,
                   help="speculative decoding without --draft-model; "
                        + "; ".join(helps[k] for k in DRAFT_KINDS) + ". Output stays the model's")
    p.add_argument("--ngram-max", type=int, default=None,
                   help=f"--draft ngram: longest n-gram matched (default {NGRAM_MAX})")
    p.add_argument("--ngram-min", type=int, default=None,
                   help=f"--draft ngram: shortest n-gram matched (default {NGRAM_MIN})")


def check_draft_arguments(args) -> None:
    """Checks --draft-model / --num-draft-tokens and fills in the default k.

    Raises:
        InputError: --num-draft-tokens without --draft-model or --draft (it would be
            silently ignored), --draft with --draft-model, or --num-draft-tokens < 1."""
    k = getattr(args, "num_draft_tokens", None)
    draft_model, draft = getattr(args, "draft_model", None), getattr(args, "draft", None)
    check_ngram_arguments(args)
    if draft_model and draft:
        raise InputError(f"give --draft {draft} or --draft-model, not both")
    if not draft_model and not draft:
        if k is not None:
            raise InputError("--num-draft-tokens needs --draft-model or --draft (without "
                             "a draft there is no speculative decoding to configure)")
        return
    if k is None:
        args.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
    elif isinstance(k, int) and k < 1:
        raise InputError(f"--num-draft-tokens must be >= 1, got {k}")


def draft_settings(args) -> Optional[DraftSettings]:
    """The `DraftSettings` of --draft-model / --draft / --num-draft-tokens / --ngram-*
    (None without a draft), checked (`check_draft_arguments`; InputError naming the
    flag). The one place flags become the speculation factory's settings."""
    check_draft_arguments(args)
    model, kind = getattr(args, "draft_model", None), getattr(args, "draft", None)
    if not model and not kind:
        return None
    extra = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min} if kind == "ngram" else {}
    try:
        return DraftSettings(model or None, kind, args.num_draft_tokens, **extra)
    except ValueError as e:
        raise InputError(str(e)) from None


def check_ngram_arguments(args) -> None:
    """Checks --ngram-max / --ngram-min and fills in their defaults under --draft ngram.

    Raises:
        InputError: either without --draft ngram, or sizes outside
            1 <= --ngram-min <= --ngram-max."""
    hi, lo = getattr(args, "ngram_max", None), getattr(args, "ngram_min", None)
    if getattr(args, "draft", None) != "ngram":
        if hi is not None or lo is not None:
            raise InputError("--ngram-max / --ngram-min need --draft ngram")
        return
    args.ngram_max = NGRAM_MAX if hi is None else hi
    args.ngram_min = NGRAM_MIN if lo is None else lo
    if not 1 <= args.ngram_min <= args.ngram_max:
        raise InputError(f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got "
                         f"--ngram-min {args.ngram_min} and --ngram-max {args.ngram_max}")


def sampling_from_args(args) -> Sampling:
    """The `Sampling` of the sampling flags `add_model_arguments` adds (not checked)."""
    return Sampling(args.temp, args.top_p, args.min_p, args.top_k, args.seed)


def resolve_model_arg(spec: Optional[str]) -> str:
    """--model value, or the shipped default; InputError when neither exists."""
    if spec:
        return spec
    path = default_model()
    if path is None:
        raise InputError("no --model given and this install ships no default checkpoint")
    return str(path)


def build_prompt(tokenizer, prompt: str, system: Optional[str], raw: bool, effort: str,
                 images: Sequence[Any] = ()) -> List[int]:
    """Token ids for the prompt: K3.1 chat encoding unless `raw`. `images`: preprocessed
    images (`vision.preprocess.ProcessedImage`) put before the prompt text in the user
    message, each as its media block with its pads expanded. InputError for an empty
    prompt, or images with `raw` (a raw prompt has no place for them)."""
    if not prompt:
        raise InputError("the prompt is empty")
    if raw:
        if images:
            raise InputError("images need the chat encoding: drop --ignore-chat-template")
        text = prompt if system is None else f"{system}\n{prompt}"
        return tokenizer.encode(text)
    content: Any = prompt
    if images:
        content = [{"type": "image", "media": im} for im in images] + [{"type": "text", "text": prompt}]
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return build_chat_prompt(tokenizer, messages, effort)


def build_chat_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], effort: str,
                      tools: Optional[Sequence[Mapping[str, Any]]] = None,
                      **options: Any) -> List[int]:
    """Token ids of a conversation in the K3.1 chat encoding, ending in the generation
    prompt (`chat_format.encode_chat`; options: tool_choice "required" / "none",
    response_format json_object / json_schema). Raises InputError for an empty
    conversation or anything `encode_chat` rejects (unknown role or effort, non-text
    parts, bad calls)."""
    return build_chat_prompt_with_ends(tokenizer, messages, effort, tools, **options)[0]


def build_chat_prompt_with_ends(tokenizer, messages: Sequence[Mapping[str, Any]], effort: str,
                                tools: Optional[Sequence[Mapping[str, Any]]] = None,
                                **options: Any) -> Tuple[List[int], List[int]]:
    """(ids as `build_chat_prompt`, message ends): the prompt positions (token counts)
    after each `<|end_of_msg|>`: the tool and effort system blocks, the system prompt,
    every earlier turn. Where a prompt cache takes its snapshots: a later request that
    shares the first k messages shares these prefixes. One pass over the segments
    (`chat_format.encode_segments` tokenizes each segment on its own, so encoding the
    pieces between message ends gives exactly `encode_chat`'s ids)."""
    from kimi_mlx.text.chat_format import END_OF_MSG, chat_segments, encode_segments

    if not messages:
        raise InputError("messages is empty: give at least one message")
    try:
        segments = chat_segments(messages, effort, True, tools, **options)
        ids: List[int] = []
        ends: List[int] = []
        piece: list = []
        for seg in segments:
            piece.append(seg)
            if seg == (True, END_OF_MSG):
                ids += encode_segments(tokenizer, piece)
                ends.append(len(ids))
                piece = []
        ids += encode_segments(tokenizer, piece)
    except InputError:
        raise
    except ValueError as e:
        raise InputError(str(e)) from None
    return ids, ends


def token_budget(n_prompt: int, max_tokens: int, context: int) -> int:
    """Tokens that may be generated after an n_prompt-token prompt: max_tokens, capped by
    the room left in a context of `context` tokens (max_tokens -1 = all of that room)."""
    room = context - n_prompt
    return room if max_tokens < 0 else min(max_tokens, room)


def check_context(n_prompt: int, max_tokens: int, context: int, source: str) -> int:
    """Number of tokens that may still be generated (max_tokens -1 = up to the context);
    InputError when the prompt does not fit. When the context cuts a --max-tokens request
    short, or decides it (-1), says so on stderr (generation would otherwise just stop
    early)."""
    if n_prompt >= context:
        raise InputError(
            f"the prompt is {n_prompt} tokens, longer than the context of {context} tokens "
            f"({source})"
        )
    budget = token_budget(n_prompt, max_tokens, context)
    if 0 <= budget and (max_tokens < 0 or budget < max_tokens):
        print(f"note: generating at most {budget} tokens: the prompt ({n_prompt}) and the "
              f"generation must fit in {context} tokens ({source})", file=sys.stderr)
    return budget


def check_context_strict(n_prompt: int, max_tokens: int, context: int) -> None:
    """For an API request: InputError unless prompt + max_tokens fits in the context,
    naming both numbers (an API client asked for max_tokens and must not get fewer
    silently)."""
    if n_prompt + max_tokens > context:
        raise InputError(
            f"this model's context is {context} tokens; the request needs "
            f"{n_prompt + max_tokens} ({n_prompt} in the prompt + {max_tokens} max_tokens)"
        )


# ------------------------------------------------------------------ sampling


def generation_defaults(model_dir: Path) -> Sampling:
    """Sampling defaults from the checkpoint's generation_config.json (temperature,
    top_p, top_k, min_p); greedy where a key is absent. ValueError for a file that is
    not a JSON object or a value of the wrong type, naming the file and key."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return Sampling()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    params: dict = {}
    for key, attr, kind in (("temperature", "temp", float), ("top_p", "top_p", float),
                            ("top_k", "top_k", int), ("min_p", "min_p", float)):
        if key in data and data[key] is not None:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{path}: {key} must be a number, got {v!r}")
            params[attr] = kind(v)
    if data.get("do_sample") is False:
        params["temp"] = 0.0
    try:
        return Sampling(**params).check()
    except InputError as e:
        raise ValueError(f"{path}: {e}") from None


# ------------------------------------------------------------------ stop strings


@dataclass
class StopMatcher:
    """Stop strings matched on decoded text across token boundaries.

    `feed(text)` returns (text safe to emit now, stopped): text that might be the start
    of a stop string is held back until it is decided; on a match, the text before the
    stop string is returned and `stopped` is True. `flush()` returns what is held back
    at the end of generation.
    """

    stops: Sequence[str] = ()
    matched: Optional[str] = field(default=None, init=False)  # the stop string that ended it
    _held: str = field(default="", init=False)

    def feed(self, text: str) -> Tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self.stops if s and buf.find(s) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._held = ""
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
