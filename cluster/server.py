"""`kimi-mlx cluster server`: `kimi-mlx server`'s API with the pipeline, or one
tensor-parallel group (--parallel tensor), behind it.

The command layer of the cluster, above `head` and `tensor`: it checks the flags, chooses
the parallel mode, and starts `head.engine.ClusterEngine` or `tensor.engine.TensorEngine`
with typed settings (`net.nodes.NodeSettings`, `head.cluster.PipelineSettings`).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from kimi_mlx.cluster.head.cluster import Cluster, PipelineSettings
from kimi_mlx.cluster.head.engine import ClusterEngine
from kimi_mlx.cluster.launch import recommended, tokenizers
from kimi_mlx.cluster.net.nodes import NodeFinder, NodeSettings

log = logging.getLogger(__name__)


def run(args, nodes: NodeSettings, pipeline_settings: PipelineSettings) -> int:
    """`kimi-mlx cluster server`: start HTTP at once, connect and load the pipeline (or form
    the tensor group) in the background (/health answers 503 until then); when that fails
    the command ends with status 1, naming what failed (`kimi_mlx.server.serving.serve`).
    Started by a harness that named itself (`net.lifetime.PARENT_ENV`), it stops (as on
    SIGTERM) once that process is gone."""
    from kimi_mlx.cluster.net.lifetime import watch_parent_from_env

    watch_parent_from_env(grace=60.0)
    chosen: list = []
    code = _run(args, nodes, pipeline_settings, chosen)
    if chosen and chosen[-1] == "tensor":
        # as in launch: once a ring group was joined, interpreter exit can block on the
        # backend's threads; the group is closed (engine.stop), nothing is left to clean up
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args, nodes: NodeSettings, pipeline_settings: PipelineSettings, chosen: list) -> int:
    """`run`'s body; appends the parallel mode it chose to `chosen`."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.request import (InputError, generation_defaults, resolve_model_arg,
                                             serving_context)
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import (check_disk_cache_arguments, check_draft_server_arguments,
                                         check_server_arguments, make_service, resolve_api_key,
                                         schema_limits_of, serve)
    from kimi_mlx.speculative.factory import PIPELINE, TENSOR, build_speculation, check_draft_target

    from kimi_mlx.cluster.net.auth import AuthError, load_secret
    from kimi_mlx.cluster.net.fingerprint import FingerprintError, fingerprint, is_checkpoint

    try:
        # first: it fills in --max-concurrency's default; n-gram drafts and draft models
        # batch in a tensor group
        drafts = check_draft_server_arguments(args, batch_ngram=args.parallel == "tensor",
                                              batch_models=args.parallel == "tensor")
        check_draft_target(drafts, PIPELINE if args.parallel != "tensor" else TENSOR)
        check_server_arguments(args)
        check_disk_cache_arguments(args)
        if args.prompt_cache_every < 0:
            raise InputError(f"--prompt-cache-every must be >= 0, got {args.prompt_cache_every}")
        cache_bytes = None
        if getattr(args, "cache_bytes", None) is not None:
            from kimi_mlx.placement.planner import parse_bytes

            try:
                cache_bytes = parse_bytes(args.cache_bytes, default_unit="B")
            except ValueError as e:
                raise InputError(f"--cache-bytes: {e}") from None
        spec = resolve_model_arg(args.model)
        model_dir = Path(spec).expanduser()
        if not is_checkpoint(model_dir):
            raise InputError(f"{spec}: cluster server needs the checkpoint folder on this machine too")
        key = resolve_api_key(args)
        secret = load_secret(args.secret_file)
        margs = ModelArgs.from_config(read_config(model_dir))
        fp = fingerprint(model_dir)
        wrapper, tok = tokenizers(model_dir)
        defaults = generation_defaults(model_dir)
    except (InputError, FileNotFoundError, ValueError, AuthError, FingerprintError) as e:
        print(f"kimi-mlx cluster server: error: {e}", file=sys.stderr)
        return 2
    context = serving_context(margs.max_position_embeddings, args.max_kv_size)[0]
    args.context = args.context or context
    pipeline_settings = replace(pipeline_settings, sequences=args.max_concurrency)
    svc = make_service(spec, key, args.served_model_name, args.max_body_bytes,
                       args.max_tokens, default_thinking_budget=args.thinking_budget,
                       schema_limits=schema_limits_of(args))
    svc.wrapper, svc.tok, svc.context, svc.defaults = wrapper, tok, context, defaults
    svc.vocab_size = margs.vocab_size
    from kimi_mlx.server.catalog import checkpoint_tensor_bytes

    svc.weights_bytes = checkpoint_tensor_bytes(model_dir)  # /api/ps, /v1/models: on the stages
    from kimi_mlx.server.images import image_settings

    # images: this head runs the tower (from the checkpoint folder here, on first use)
    svc.images = image_settings(model_dir, tok, read_config(model_dir), args.allow_image_urls,
                                args.max_images, metrics=svc.metrics,
                                max_pixels=args.max_image_pixels)
    finder = NodeFinder(nodes, secret, model_dir, fp)
    cluster = Cluster(finder, pipeline_settings, args.context)

    def choose_parallel() -> str:
        chosen.append(args.parallel if args.parallel != "auto"
                      else recommended(finder, args.context, pipeline_settings.sequences,
                                       drafts=drafts is not None, kv_bits=args.kv_bits,
                                       kv_group_size=args.kv_group_size))
        return chosen[-1]

    def load():
        tensor = choose_parallel() == "tensor"
        # before the stages load: a wrong draft fails fast
        speculation = build_speculation(drafts, where=TENSOR if tensor else PIPELINE,
                                        target_wrapper=wrapper, target_name=spec)
        if tensor:
            from kimi_mlx.cluster.tensor.engine import start_tensor_engine

            from kimi_mlx.cluster.net.cache_index import HeadCacheIndex

            svc.engine = start_tensor_engine(
                finder, tok.eos_token_ids, svc.metrics, speculation, max_queue=args.max_queue,
                max_concurrency=args.max_concurrency, backend=args.backend,
                prompt_cache=None if args.no_prompt_cache else HeadCacheIndex(args.prompt_cache_every),
                cache_bytes=cache_bytes, cache_dir=args.prompt_cache_dir,
                cache_disk_bytes=args.prompt_cache_disk_bytes, context=args.context)
            svc.engine.vision, svc.engine.pad_id = svc.images.vision, svc.images.pad_id
            return
        if args.prompt_cache_dir:
            log.warning("--prompt-cache-dir is rank 0's under --parallel tensor; a pipeline's "
                        "snapshots are on its stages: give `cluster serve --prompt-cache-dir`")
        pipeline = cluster.connect()
        keeper = cluster.keeper(pipeline)
        from kimi_mlx.cluster.net.cache_index import HeadCacheIndex

        index = None if args.no_prompt_cache else HeadCacheIndex(args.prompt_cache_every)
        engine = ClusterEngine(pipeline, tok.eos_token_ids, args.max_concurrency,
                               args.max_queue, svc.metrics, keeper, speculation,
                               margs, index, batch=not args.no_batch)
        engine.vision, engine.pad_id = svc.images.vision, svc.images.pad_id
        svc.engine = engine.start()
        log.info("serving %s through the pipeline", svc.model_ids[0])

    def cleanup():
        if svc.engine is not None:
            svc.engine.stop(2.0)
        if cluster.transport is not None:
            cluster.transport.shutdown()

    return serve(svc, create_app(svc), args.host, args.port, args.log_level or "WARNING",
                 f"kimi-mlx cluster server (model {svc.model_ids[0]})",
                 "kimi-mlx cluster server", load, "loading the pipeline", cleanup)
