"""`kimi-mlx server`: load a checkpoint and serve the OpenAI + Anthropic + Ollama API with
uvicorn (the pieces are in `server.serving`, shared with `kimi-mlx cluster server`); with
several (`--model NAME=PATH`, `--models-dir`) one is loaded at a time and a request
swaps in the one it names, and `--idle-unload` / Ollama's keep_alive free the loaded one
when idle (`server.models`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kimi_mlx.generation.request import (InputError, add_draft_arguments, add_mtp_argument,
                                         add_quiet_argument, micro_note, resolve_model_arg)
from kimi_mlx.placement.wired import add_allow_paging_argument, allow_paging
from kimi_mlx.generation.kv_args import kv_quant
from kimi_mlx.server.catalog import add_model_arguments, catalog, check_allowed
from kimi_mlx.server.models import ModelHolder
from kimi_mlx.server.serving import (DEFAULT_CONCURRENCY, add_disk_cache_arguments, add_server_arguments, check_draft_server_arguments,
                                     check_server_arguments, load_service, make_service, resolve_api_key,
                                     schema_limits_of, serve)

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "run", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="checkpoint folder or Hugging Face id (default: the shipped micro "
                        "model); repeat as NAME=PATH to serve several, one loaded at a time "
                        "(the first at start)")
    add_model_arguments(p)
    add_server_arguments(p)
    from kimi_mlx.generation.kv_args import add_kv_arguments

    add_kv_arguments(p)
    add_allow_paging_argument(p)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help=f"sequences generated at once by continuous batching (default "
                        f"{DEFAULT_CONCURRENCY}; 1 with --draft mtp or a block drafter, the only "
                        "value allowed there; --draft ngram and draft models batch; 1 = one "
                        "request at a time)")
    p.add_argument("--prompt-cache-bytes", type=int, default=1 << 30,
                   help="bytes of cache snapshots kept across requests (default 1 GiB; 0 = off)")
    add_disk_cache_arguments(p)
    add_draft_arguments(p, note=": every request speculatively (requests with penalties "
                        "or logit_bias decode plainly); the MTP or a block drafter one request "
                        "at a time (--max-concurrency 1), n-gram drafts (--draft ngram) "
                        "and draft models in the batch, every row's drafts verified in "
                        "one pass", mtp=True)
    add_mtp_argument(p)  # --draft ngram / mtp: the same one-at-a-time rule
    add_quiet_argument(p)


def run(args) -> int:
    """`kimi-mlx server`; returns the exit status. Started by a process that named itself
    (`lifetime.PARENT_ENV`, `lifetime.child_env`: a harness, a bench), it stops as on
    SIGTERM (its memory freed, the wired limit restored) once that process is gone."""
    from kimi_mlx.lifetime import watch_parent_from_env

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_parent_from_env(grace=60.0)
    try:
        allow_paging(args.allow_paging)  # read by load_service's `wire`
        drafts = check_draft_server_arguments(args)  # first: it fills in --max-concurrency's default
        check_server_arguments(args)
        kv_quant(args)
        check_model_arguments(args)
        models = catalog(args.model, args.models_dir, args.served_model_name,
                         lambda: resolve_model_arg(None))
        allowed = [n.strip() for n in args.allow_models.split(",") if n.strip()] \
            if args.allow_models else None
        check_allowed(models, allowed)
        spec = models[allowed[0]] if allowed else next(iter(models.values()))
        key = resolve_api_key(args)
    except (InputError, ValueError) as e:
        print(f"kimi-mlx server: error: {e}", file=sys.stderr)
        return 2
    from kimi_mlx.server.app import create_app

    svc = make_service(spec, key, args.served_model_name, args.max_body_bytes,
                       args.max_tokens, default_thinking_budget=args.thinking_budget,
                       schema_limits=schema_limits_of(args))

    def load_one(svc, name, path):
        svc.model_ids = [name]
        load_service(svc, path, args.max_concurrency, args.prompt_cache_bytes,
                     args.max_queue, args.max_kv_size, drafts=drafts, progress=not args.quiet,
                     allow_image_urls=args.allow_image_urls, max_images=args.max_images,
                     max_image_pixels=args.max_image_pixels,
                     prompt_cache_dir=args.prompt_cache_dir,
                     prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
                     kv=kv_quant(args))

    try:
        holder = ModelHolder(svc, models, load_one, idle_unload=args.idle_unload,
                             wait_s=args.model_wait, allowed=allowed, metrics=svc.metrics,
                             max_kv_size=args.max_kv_size)
    except ValueError as e:
        print(f"kimi-mlx server: error: {e}", file=sys.stderr)
        return 2

    def load():
        holder.load_first()
        log.info("serving %s (context %d tokens)%s", svc.model_ids[0], svc.context,
                 f"; also {', '.join(n for n in holder.allowed if n != holder.default)}"
                 if len(holder.allowed) > 1 else "")
        if micro_note(spec):
            log.info(micro_note(spec))

    def cleanup():
        holder.stop()

    return serve(svc, create_app(svc), args.host, args.port, args.log_level,
                 f"kimi-mlx server (model {svc.model_ids[0]})", "kimi-mlx server", load,
                 f"loading {spec}", cleanup)


def check_model_arguments(args) -> None:
    """InputError for a bad --idle-unload / --model-wait."""
    if args.idle_unload is not None and args.idle_unload < 0:
        raise InputError(f"--idle-unload must be >= 0 seconds, got {args.idle_unload:g}")
    if not args.model_wait > 0:
        raise InputError(f"--model-wait must be > 0 seconds, got {args.model_wait:g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx server")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    os._exit(main())
