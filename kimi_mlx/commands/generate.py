"""`kimi-mlx generate`: one-shot generation, streamed, with mlx_lm.generate's flags.

Checks the arguments, loads the checkpoint, builds the prompt through the one request
path (`generation.request`) and prints the stream (`generation.generate`).
"""

from __future__ import annotations

import argparse
import sys

from kimi_mlx.checkpoint.hub import resolve
from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.kv_args import add_kv_arguments, apply_kv_quant, kv_quant
from kimi_mlx.generation.images import Vision, media_pad_id, prompt_embeddings
from kimi_mlx.generation.generate import add_arguments as add_generate_arguments
from kimi_mlx.generation.generate import print_generation, stream
from kimi_mlx.generation.request import (InputError, build_prompt, check_context, check_model_arguments,
                                         draft_settings, micro_note, resolve_model_arg,
                                         sampling_from_args, serving_context)
from kimi_mlx.placement.wired import add_allow_paging_argument, allow_paging, model_plan, wire
from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation

__all__ = ["add_arguments", "run", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_generate_arguments(p)
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (PNG, JPEG, WebP or GIF; repeatable, in order, "
                        "before the prompt text); needs a checkpoint with vision weights")
    add_allow_paging_argument(p)
    add_kv_arguments(p)


def run(args) -> int:
    try:
        check_model_arguments(args)
        drafts = draft_settings(args)
        spec = resolve_model_arg(args.model)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if prompt is None:
            raise InputError("give a prompt with --prompt TEXT (or --prompt - for stdin)")
        images, vision = [], None
        if args.image:
            if args.draft_model or args.draft:
                raise InputError("--image does not work with speculative decoding yet: drop "
                                 "--draft-model / --draft")
            if args.ignore_chat_template:
                raise InputError("--image needs the chat encoding: drop --ignore-chat-template")
            vision = Vision(resolve(spec, vision=True))
            if not vision.available:
                raise InputError(f"{vision.model_dir}: this checkpoint has no vision weights "
                                 "(no vision_config or no vision_tower.* / mm_projector.* "
                                 "tensors), so it cannot take --image")
            images = [vision.load_image(path) for path in args.image]
        kv = kv_quant(args)  # a bad --kv-group-size before the load
        # the caches planned in the format they will have (`--kv-bits`)
        wire(lambda: model_plan(resolve(spec), "kimi-mlx generate", args.max_kv_size,
                                kv_bits=kv[0], kv_group_size=kv[1], drafts=drafts),
             allow_paging(args.allow_paging))
        model, wrapper, tok, config = load_for_generation(spec, progress=not args.quiet)
        apply_kv_quant(model, args)
        ids = build_prompt(tok, prompt, args.system_prompt, args.ignore_chat_template,
                           args.reasoning_effort, images)
        context, source = serving_context(model.args.max_position_embeddings, args.max_kv_size)
        if images:
            n_img = sum(im.num_tokens for im in images)
            source += f"; {len(images)} image(s) take {n_img} of the prompt's tokens"
        args.max_tokens = check_context(len(ids), args.max_tokens, context, source)
        note = micro_note(spec, args.ignore_chat_template)
        embeddings = None
        if images:
            embeddings = prompt_embeddings(model, vision, ids, images, media_pad_id(tok, config))
        speculation = build_speculation(drafts, where=ONE_PROCESS, target_wrapper=wrapper,
                                        target_name=spec, model=model,
                                        sampling=sampling_from_args(args))
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx generate: error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)

    rc = print_generation(stream(model, wrapper, ids, sampling_from_args(args), args.max_tokens,
                                 speculation, embeddings), args.verbose, args.ignore_chat_template)
    if speculation is not None and args.verbose:
        print(speculation.summary())
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx generate")
    add_arguments(p)
    return run(p.parse_args(argv))
