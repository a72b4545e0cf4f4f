"""`kimi-mlx generate`: one-shot generation, streamed, with mlx_lm.generate's flags.

Checks the arguments, loads the checkpoint, builds the prompt through the one request
path (`generation.request`) and prints the stream (`generation.generate`).
"""

from __future__ import annotations

import argparse
import sys

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.generate import add_arguments, load_speculation, print_generation, stream
from kimi_mlx.generation.request import (InputError, build_prompt, check_context, check_draft_arguments,
                                         check_model_arguments, micro_note, resolve_model_arg)

__all__ = ["add_arguments", "run", "main"]


def run(args) -> int:
    try:
        check_model_arguments(args)
        check_draft_arguments(args)
        spec = resolve_model_arg(args.model)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if prompt is None:
            raise InputError("give a prompt with --prompt TEXT (or --prompt - for stdin)")
        model, wrapper, tok, config = load_for_generation(spec, progress=not args.quiet)
        ids = build_prompt(tok, prompt, args.system_prompt, args.ignore_chat_template,
                           args.reasoning_effort)
        context = model.args.max_position_embeddings
        source = "max_position_embeddings in config.json"
        if args.max_kv_size:
            context, source = min(context, args.max_kv_size), "--max-kv-size"
        args.max_tokens = check_context(len(ids), args.max_tokens, context, source)
        note = micro_note(spec, args.ignore_chat_template)
        speculation = load_speculation(args, wrapper, spec, model)
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx generate: error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)

    rc = print_generation(args, stream(model, wrapper, ids, args, speculation))
    if speculation is not None and args.verbose:
        print(speculation.summary())
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx generate")
    add_arguments(p)
    return run(p.parse_args(argv))
