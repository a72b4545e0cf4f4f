"""`kimi-mlx cluster launch`: check the inputs, choose pipeline or tensor parallel, place
and load, and print the generation as `kimi-mlx generate` does.

The command layer of the cluster: it may hold the parsed flags; the libraries below
(`head`, `tensor`, `net`) take typed settings (`net.nodes.NodeSettings`,
`head.cluster.PipelineSettings`) made once by `cli.py`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, List, NamedTuple, Optional

from kimi_mlx.cluster.head.cluster import Cluster, PipelineSettings
from kimi_mlx.cluster.net.nodes import NodeFinder, NodeSettings
from kimi_mlx.model.cache import KV_DEFAULT_GROUP


def _err(e) -> None:
    print(f"kimi-mlx cluster launch: error: {e}", file=sys.stderr)


class LaunchInputs(NamedTuple):
    """What `cluster launch` checked before any node is contacted."""

    spec: str
    model_dir: Path
    secret: bytes
    margs: Any  # ModelArgs
    wrapper: Any  # mlx-lm TokenizerWrapper
    ids: List[int]
    context: int
    fingerprint: str
    speculation: Any  # Speculation or None
    media: Any = None  # (pad id, image rows) for the session's prefill, or None


def launch_inputs(args) -> LaunchInputs:
    """Check the flags, the checkpoint and the prompt; load the secret, the tokenizer and
    the draft (which runs on this head). Raises InputError, FileNotFoundError, ValueError,
    AuthError or FingerprintError, each naming the flag or file."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.request import (InputError, build_prompt, check_context, check_model_arguments,
                                             draft_settings, resolve_model_arg, sampling_from_args,
                                             serving_context)
    from kimi_mlx.speculative.factory import PIPELINE, TENSOR, build_speculation, check_draft_target

    from kimi_mlx.cluster.net.auth import load_secret
    from kimi_mlx.cluster.net.fingerprint import fingerprint, is_checkpoint
    from kimi_mlx.cluster.net.nodes import check_browse_time

    check_model_arguments(args)
    drafts = draft_settings(args)
    where = TENSOR if args.parallel == "tensor" else PIPELINE
    check_draft_target(drafts, where)
    spec = resolve_model_arg(args.model)
    model_dir = Path(spec).expanduser()
    if not is_checkpoint(model_dir):
        raise InputError(f"{spec}: cluster launch needs the checkpoint folder on this "
                         "machine too (the same files as in each node's models folder)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt is None:
        raise InputError("give a prompt with --prompt TEXT (or --prompt - for stdin)")
    if args.prefill_chunk < 1:
        raise InputError("--prefill-chunk must be >= 1")
    if args.nodes == "auto":
        check_browse_time("--discover-timeout", args.discover_timeout)
    secret = load_secret(args.secret_file)
    margs = ModelArgs.from_config(read_config(model_dir))
    wrapper, tok = tokenizers(model_dir)
    images, vision = launch_images(args, model_dir)
    ids = build_prompt(tok, prompt, args.system_prompt, args.ignore_chat_template,
                       args.reasoning_effort, images)
    context, source = serving_context(margs.max_position_embeddings, args.max_kv_size)
    if images:
        source += (f"; {len(images)} image(s) take {sum(im.num_tokens for im in images)} of "
                   "the prompt's tokens")
    args.max_tokens = check_context(len(ids), args.max_tokens, context, source)
    fp = fingerprint(model_dir)
    speculation = build_speculation(drafts, where=where, target_wrapper=wrapper, target_name=spec,
                                    sampling=sampling_from_args(args))
    media = None
    if images:
        from kimi_mlx.cluster.net.session import media_rows
        from kimi_mlx.generation.images import media_pad_id

        media = media_rows(vision, images, media_pad_id(tok, read_config(model_dir)))
    return LaunchInputs(spec, model_dir, secret, margs, wrapper, ids, context, fp, speculation,
                         media)


def launch_images(args, model_dir: Path):
    """(preprocessed images, `generation.images.Vision`) of `cluster launch --image`, or
    ([], None). InputError for a draft, a raw prompt, a checkpoint without vision
    weights, or an unreadable image (naming it). The tower runs on this head, for a
    pipeline's stage 0 or a tensor group's ranks (`launch_tensor`)."""
    from kimi_mlx.generation.request import InputError

    if not args.image:
        return [], None
    if args.draft_model or args.draft:
        raise InputError("--image does not work with speculative decoding yet: drop "
                         "--draft-model / --draft")
    if args.ignore_chat_template:
        raise InputError("--image needs the chat encoding: drop --ignore-chat-template")
    from kimi_mlx.generation.images import Vision

    vision = Vision(model_dir)
    if not vision.available:
        raise InputError(f"{model_dir}: this checkpoint has no vision weights (no "
                         "vision_config or no vision_tower.* / mm_projector.* tensors), so "
                         "it cannot take --image")
    return [vision.load_image(path) for path in args.image], vision


def run(args, nodes: NodeSettings, pipeline: PipelineSettings) -> int:
    """`kimi-mlx cluster launch`: check the inputs, place and load the stages, stream the
    generation as `generate` prints it. 2 for bad input, 1 when the cluster fails."""
    from kimi_mlx.generation.generate import print_generation
    from kimi_mlx.generation.request import InputError
    from kimi_mlx.generation.streaming import stream_responses

    from kimi_mlx.cluster.head.launch import LaunchRun, launch_failure
    from kimi_mlx.cluster.head.transport import StageFailure
    from kimi_mlx.cluster.net.auth import AuthError
    from kimi_mlx.cluster.net.fingerprint import FingerprintError
    from kimi_mlx.generation.request import sampling_from_args
    from kimi_mlx.placement.planner import PlanError

    try:
        inputs = launch_inputs(args)
    except (InputError, FileNotFoundError, ValueError, AuthError, FingerprintError) as e:
        _err(e)
        return 2

    plan_context = args.context or min(inputs.context, len(inputs.ids) + args.max_tokens)
    finder = NodeFinder(nodes, inputs.secret, inputs.model_dir, inputs.fingerprint)
    parallel = args.parallel
    if parallel == "auto":
        try:
            parallel = recommended(finder, plan_context, pipeline.sequences,
                                   drafts=inputs.speculation is not None,
                                   kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
        except (PlanError, StageFailure, RuntimeError, ValueError) as e:
            _err(e)
            return 1
    if parallel == "tensor":
        code = launch_tensor(args, finder, inputs.ids, inputs.wrapper, inputs.speculation,
                             inputs.media, context=plan_context)
        # Once a ring group was joined, interpreter exit can block on the backend's
        # threads (seen once in tests after the last token); nothing is left to clean up.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    cluster = Cluster(finder, pipeline, plan_context)
    try:
        connected = cluster.connect()
    except (PlanError, StageFailure, RuntimeError, ValueError) as e:
        _err(launch_failure(e, nodes.replan))
        return 1

    run = LaunchRun(cluster, connected, inputs.ids,
                    sampling_from_args(args),
                    args.max_tokens, inputs.speculation, inputs.margs, inputs.media, args.seed)
    code = 0
    try:
        code = print_generation(stream_responses(
            run.tokens(), inputs.wrapper, len(inputs.ids), args.max_tokens,
            lambda: cluster.transport.peak_memory()), args.verbose, args.ignore_chat_template)
    finally:
        if cluster.transport is not None:
            cluster.transport.shutdown()
    if inputs.speculation is not None and args.verbose:
        print(inputs.speculation.summary())
    if run.failure is not None:
        _err(launch_failure(run.failure, nodes.replan))
        return 1
    return code


def recommended(finder: NodeFinder, context: int, sequences: int, drafts: bool = False,
                kv_bits: Optional[int] = None, kv_group_size: int = KV_DEFAULT_GROUP) -> str:
    """`kimi_mlx.placement.parallel_choice.choose_parallel` for these nodes: the pipeline
    over the nodes at `sequences` requests at once vs a tensor group of this head and the
    nodes (the slowest node's bandwidth, the TCP ring's latency: the group runs over the
    ring), both holding `sequences` sequences' caches in the `--kv-bits` format
    (`kv_bits`, `kv_group_size`), by predicted aggregate decode, with drafts (`drafts`:
    each mode's best k) or plain; says which and why in one line. The nodes it checked
    are kept for the launch that follows (`finder.checked`)."""
    from kimi_mlx.cluster.net.control import ControlClient
    from kimi_mlx.placement.parallel_choice import choose_parallel
    from kimi_mlx.placement.tensor_parallel import TCP_LATENCY_S

    transport = ControlClient(finder.secret, finder.settings.tls_secret_path)
    try:
        accepted = finder.checked = finder.accepted(transport)
    finally:
        transport.shutdown()
    nodes = [n.planner_node() for n, _ in accepted]
    # the head is a rank too: counted as the slowest node
    group = nodes + [min(nodes, key=lambda n: n.bandwidth_bytes_per_s)] if nodes else []
    choice = choose_parallel(str(finder.model_dir), nodes, context, sequences, TCP_LATENCY_S,
                             drafts=drafts, tensor_nodes=group, kv_bits=kv_bits,
                             kv_group_size=kv_group_size)
    print(f"[cluster] --parallel auto chose {choice.mode}: {choice.why} ({len(nodes)} node(s); "
          "--parallel pipeline|tensor to choose)", file=sys.stderr)
    return choice.mode


def launch_tensor(args, finder: NodeFinder, ids: List[int], wrapper, speculation=None,
                  media=None, context: int = 0) -> int:
    """`cluster launch --parallel tensor`: form the group (`form_group`), generate `ids`'
    continuation on rank 0 (plain, or speculatively with `speculation`'s draft on this
    head: `tensor.step`) and print it as `kimi-mlx generate` does. `media`: (pad id,
    image rows) of `--image` (the tower ran on this head): the rows go to every rank with
    the prefill chunks holding their pads (`tensor.prefill.open_request`).

    Returns the exit status; a rank lost mid-generation ends the process through
    `TensorGroup.fail`.
    """
    from kimi_mlx.cluster.net.session import generate, speculative_run
    from kimi_mlx.cluster.tensor.step import OP_EXIT, GroupTarget, command
    from kimi_mlx.generation.generate import print_generation
    from kimi_mlx.generation.streaming import stream_responses
    from dataclasses import replace

    import mlx.core as mx

    from kimi_mlx.generation.request import sampling_from_args

    from kimi_mlx.cluster.tensor.group import TensorGroup, TensorSetupError
    from kimi_mlx.cluster.tensor.launch import form_group

    watch = TensorGroup(finder.settings.peer_timeout)
    try:
        # every rank wires memory for this one request's `context` tokens (0: the trained)
        transport, group, model = form_group(finder, watch, args.backend, plan=(context, 1))
    except (TensorSetupError, RuntimeError, ValueError, OSError) as e:
        print(f"kimi-mlx cluster launch: error: {e}", file=sys.stderr)
        return 1
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = replace(sampling_from_args(args), seed=None).sampler()  # seeded globally above

    def tokens():
        if speculation is not None:
            yield from generate(
                lambda: GroupTarget(model, group, len(ids) - 1, record=True), ids,
                args.max_tokens, run=speculative_run(ids, speculation.draft,
                                                     max_tokens=args.max_tokens,
                                                     **speculation.kwargs()))
            return
        if media is not None:
            from kimi_mlx.cluster.tensor.prefill import open_request

            session = open_request(model, group, ids, media=media)
        else:
            session = lambda: GroupTarget(model, group, len(ids) - 1)  # noqa: E731
        for tok, lp in generate(session, ids, args.max_tokens, sampler=sampler):
            yield tok, lp, False

    try:
        code = print_generation(stream_responses(tokens(), wrapper, len(ids), args.max_tokens,
                                                 mx.get_peak_memory),
                                args.verbose, args.ignore_chat_template)
        command(group, OP_EXIT)  # the other ranks exit
        watch.finish()
        if speculation is not None and args.verbose:
            print(speculation.summary())
    except RuntimeError as e:  # a peer lost: its node names it through the watch
        deadline = time.monotonic() + finder.settings.peer_timeout + 2
        while watch.failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.fail(f"rank 0 (this head): {e}")
        return 1
    finally:
        watch.close()
        transport.shutdown()
    return code


def tokenizers(model_dir: Path):
    """(mlx-lm TokenizerWrapper, KimiTokenizer) of a checkpoint folder (this head's copy)."""
    from mlx_lm.utils import load_tokenizer

    from kimi_mlx.text.hf_register import register_with_transformers
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(model_dir)
    register_with_transformers()
    return load_tokenizer(model_dir, eos_token_ids=tok.eos_token_ids), tok
