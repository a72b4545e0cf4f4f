"""`kimi-mlx cluster`: init | serve | ls | doctor | launch | server: the flags, turned into typed
settings once (`net.nodes.NodeSettings`, `head.cluster.PipelineSettings`,
`node.daemon.ServeSettings`), and the dispatch.

- `init`: make the cluster secret (mode 0600; `--tls` also a cluster certificate) to copy
  to every Mac.
- `serve`: run on every Mac: serves the stage RPCs and advertises the node over zeroconf.
- `ls`: browse and print the nodes found (checked with an authenticated call when this
  machine has the secret).
- `doctor`: check the nodes and the links between them (`cluster.doctor`).
- `launch`: on the head: discover, check versions and fingerprints, plan, load every
  stage with a progress bar per node, then generate with `kimi-mlx generate`'s flags and
  output (`--draft-model` / `--draft ngram`: speculative decoding, the draft on the head, verify steps
  through the stages: `head.speculative`). Exit status: 0 done, 1 a stage was lost / refused or the model does not fit,
  2 bad input.
- `server`: `kimi-mlx server`'s API over the nodes (`cluster.server`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kimi_mlx.cluster.net.auth import DEFAULT_SECRET
from kimi_mlx.cluster.node.daemon import DEFAULT_MODELS
from kimi_mlx.placement.wired import add_allow_paging_argument, allow_paging

if TYPE_CHECKING:
    from kimi_mlx.cluster.head.cluster import PipelineSettings
    from kimi_mlx.cluster.net.nodes import NodeSettings
    from kimi_mlx.cluster.node.daemon import ServeSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `kimi-mlx cluster` subcommands and their flags."""
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")

    q = sub.add_parser("init", help="make the cluster secret to copy to every Mac", description="Make the cluster secret to copy to every Mac.")
    q.add_argument("--secret-file", type=Path, default=DEFAULT_SECRET,
                   help=f"where to write the secret (default {DEFAULT_SECRET})")
    q.add_argument("--force", action="store_true", help="replace an existing secret")
    q.add_argument("--tls", action="store_true", help="also make a cluster TLS certificate")

    q = sub.add_parser("serve", help="serve a pipeline stage and advertise this node", description="Serve a pipeline stage and advertise this node.")
    q.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"folder of checkpoints this node may load (default {DEFAULT_MODELS}); "
                        "the shipped micro model is always offered")
    q.add_argument("--node-id", default=None, help="unique node name (default: host name)")
    q.add_argument("--port", type=int, default=None, help="TCP port (default 52415; 0 = any free)")
    q.add_argument("--interface", default=None,
                   help="interface name or IPv4 address to serve and advertise on (default: "
                        "the Thunderbolt bridge on macOS when present, else all)")
    q.add_argument("--no-advertise", action="store_true", help="do not register with zeroconf")
    q.add_argument("--usable-memory", default=None,
                   help="memory this stage may use, e.g. 480GB (default: detected)")
    q.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth in GB/s for the planner (default: by chip)")
    q.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds a session may wait for its next message (default 120)")
    q.add_argument("--max-sessions", type=int, default=16,
                   help="sessions held at once, of all heads together (default 16); one "
                        "more is refused with RESOURCE_EXHAUSTED naming the limit")
    q.add_argument("--max-message-mb", type=int, default=256, help="largest message (default 256)")
    q.add_argument("--cache-bytes", default=None,
                   help="bytes of prompt-cache snapshots of this stage's layers kept for the "
                        "head, e.g. 8GB (default: a quarter of the usable memory left after "
                        "loading; 0 = none)")
    from kimi_mlx.server.serving import add_disk_cache_arguments

    add_disk_cache_arguments(q)  # this stage's snapshots on disk, a folder per layer range
    q.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar while a stage loads (shown only on a terminal)")
    _common(q)
    add_allow_paging_argument(q)  # this process (a stage, a tensor rank 0) or its ranks

    q = sub.add_parser("ls", help="list the nodes advertising on the network", description="List the nodes advertising on the network.")
    q.add_argument("--interface", default=None, help="interface name or IPv4 address to browse on")
    q.add_argument("--timeout", type=float, default=3.0,
                   help="seconds to browse (default 3; nodes answer within ~0.15 s; at least 0.3)")
    q.add_argument("--json", action="store_true", help="print JSON")
    _common(q)

    q = sub.add_parser("launch", help="plan, load and generate across the nodes", description="Plan, load and generate across the nodes.")
    from kimi_mlx.generation.generate import add_arguments as add_generate_arguments

    add_generate_arguments(q)
    q.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (PNG, JPEG, WebP or GIF; repeatable, in order, "
                        "before the prompt text): this head runs the vision tower and sends "
                        "the rows to stage 0 (--parallel pipeline)")
    _node_arguments(q, context_default="the prompt + --max-tokens")
    q.add_argument("--sequences", type=int, default=1, help="concurrent sequences to plan for")
    _parallel_arguments(q)
    _common(q)
    add_allow_paging_argument(q)  # this process (a stage, a tensor rank 0) or its ranks

    q = sub.add_parser("doctor", help="check the nodes: versions, wired limits, RDMA, cabling, clocks",
                       description="Check the nodes found (zeroconf) or listed: reachable "
                                   "ports, versions equal, macOS, wired limit against each "
                                   "node's planned stage (--model), disk, RDMA, Thunderbolt "
                                   "cabling of every pair, bridge addresses, clock skew, "
                                   "zeroconf visibility. One line per check with the fix; "
                                   "exit status 1 when a check FAILs.")
    q.add_argument("--nodes", default="auto",
                   help="host[:port],host[:port],... or 'auto': the nodes zeroconf finds "
                        "(default: auto)")
    q.add_argument("--interface", default=None, help="interface to browse on")
    q.add_argument("--discover-timeout", type=float, default=3.0,
                   help="seconds to browse for nodes (default 3; at least 0.3)")
    from kimi_mlx.cluster.doctor_run import add_doctor_arguments

    add_doctor_arguments(q)
    _common(q)

    q = sub.add_parser("server", help="OpenAI + Anthropic API server over the nodes",
                       description="`kimi-mlx server`'s API with the pipeline, or one "
                                   "tensor-parallel group (--parallel tensor), behind it.")
    _server_arguments(q)
    _node_arguments(q, context_default="the model's context, or --max-kv-size")
    _parallel_arguments(q)
    _common(q)
    add_allow_paging_argument(q)  # this process (a stage, a tensor rank 0) or its ranks


def _parallel_arguments(q) -> None:
    """--parallel, --backend and the cache format (--kv-bits, --kv-group-size: passed to
    every stage and rank), shared by `launch` and `server`."""
    from kimi_mlx.generation.kv_args import add_kv_arguments

    add_kv_arguments(q)
    q.add_argument("--parallel", default="auto", choices=["auto", "pipeline", "tensor"],
                   help="pipeline stages, or one tensor-parallel group of this head (rank 0) "
                        "and the nodes (default: what `kimi-mlx plan` recommends for them)")
    q.add_argument("--backend", default="auto", choices=["auto", "ring", "jaccl"],
                   help="--parallel tensor: MLX distributed backend (default auto: jaccl "
                        "when every pair of Macs is cabled with RDMA on, else the TCP ring)")


def _node_arguments(q, context_default: str) -> None:
    """Discovery, planning and loading flags shared by `launch` and `server`
    (`context_default`: what --context is when not given, in that command)."""
    q.add_argument("--nodes", default="auto",
                   help="host[:port],host[:port],... in pipeline order, or 'auto': the nodes "
                        "zeroconf finds, ordered by name (default: auto)")
    q.add_argument("--interface", default=None, help="interface to discover on")
    q.add_argument("--discover-timeout", type=float, default=3.0,
                   help="seconds to browse for nodes with --nodes auto (default 3; nodes "
                        "answer within ~0.15 s; at least 0.3)")
    q.add_argument("--context", type=int, default=None,
                   help=f"tokens per sequence to plan caches for (default: {context_default})")
    q.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per message")
    q.add_argument("--activation-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype between layers (auto: float32 if a stage is on a CPU, "
                        "else the checkpoint's)")
    q.add_argument("--wire-dtype", default="same", choices=["same", "float32", "bfloat16", "float16"],
                   help="dtype of activations on the network (same = the compute dtype)")
    q.add_argument("--peer-timeout", type=float, default=5.0,
                   help="seconds of silence before a stage is reported lost (default 5)")
    q.add_argument("--replan", action="store_true",
                   help="when a stage or a tensor rank is lost and its node does not answer, "
                        "continue on the nodes left if the model fits there")
    q.add_argument("--allow-version-mismatch", action="store_true",
                   help="use nodes that run another kimi-mlx version (same stage protocol)")
    q.add_argument("--force-load", action="store_true",
                   help="replace what busy stages hold (frees other heads' sessions)")


def _common(q) -> None:
    q.add_argument("--secret-file", type=Path, default=DEFAULT_SECRET,
                   help=f"cluster secret (default {DEFAULT_SECRET})")
    q.add_argument("--tls", action="store_true", help="use the cluster TLS certificate")
    from kimi_mlx.server.serving import log_level_arg

    q.add_argument("--log-level", type=log_level_arg, default=None,
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default per command)")


def _server_arguments(q) -> None:
    """Flags of `kimi-mlx cluster server`: the model, `cluster launch`'s node flags (added
    by the caller) and the HTTP flags of `kimi-mlx server`."""
    from kimi_mlx.server.serving import add_server_arguments

    q.add_argument("--model", default=None,
                   help="checkpoint folder (default: the shipped micro model); the nodes "
                        "need the same files")
    from kimi_mlx.generation.request import add_draft_arguments, add_mtp_argument

    add_server_arguments(q, log_level=False)
    q.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight through the pipeline at once (default 4, or 1 "
                        "with --draft-model or --draft, the only value allowed there, except "
                        "--draft ngram with --parallel tensor, which batches)")
    q.add_argument("--no-prompt-cache", action="store_true",
                   help="prefill every prompt in full (default: the stages keep snapshots "
                        "of their caches, bounded by each stage's `cluster serve "
                        "--cache-bytes`, and a request restores the longest prefix all hold)")
    q.add_argument("--cache-bytes", default=None,
                   help="--parallel tensor: bytes of prompt-cache snapshots of this head's "
                        "shard (rank 0), e.g. 8GB (default: a quarter of the memory left "
                        "after loading it; the nodes' ranks take their `cluster serve "
                        "--cache-bytes`, with the same default)")
    from kimi_mlx.server.serving import add_disk_cache_arguments

    add_disk_cache_arguments(q)  # --parallel tensor: rank 0's; the stages / ranks take their node's
    q.add_argument("--no-batch", action="store_true",
                   help="one message per request per token (default: the decode steps of the "
                        "requests in flight go through the stages as one batched message)")
    q.add_argument("--prompt-cache-every", type=int, default=1024,
                   help="also snapshot every this many prefill tokens, besides message ends "
                        "(default 1024; 0 = message ends only)")
    add_draft_arguments(q, note=" (loaded on this head, which drafts; the stages verify): "
                        "one request at a time, every request speculatively (requests with "
                        "penalties or logit_bias decode plainly); --draft ngram with "
                        "--parallel tensor batches", mtp=True)
    add_mtp_argument(q)  # --draft ngram: prompt lookup on the head (--draft mtp is refused, named)


def _logging(level: Optional[str], default: str) -> None:
    logging.basicConfig(level=getattr(logging, (level or default).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", stream=sys.stderr)


def node_settings(args) -> "NodeSettings":
    """`--nodes`, `--discover-timeout`, ... of `launch` / `server` as `NodeSettings`."""
    from kimi_mlx.cluster.net.nodes import NodeSettings
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP

    return NodeSettings(secret_file=args.secret_file, nodes=args.nodes,
                        discover_timeout=args.discover_timeout, interface=args.interface,
                        check_version=not args.allow_version_mismatch, replan=args.replan,
                        tls=args.tls, peer_timeout=args.peer_timeout,
                        kv_bits=getattr(args, "kv_bits", None),
                        kv_group_size=getattr(args, "kv_group_size", KV_DEFAULT_GROUP))


def pipeline_settings(args) -> "PipelineSettings":
    """`--sequences`, `--activation-dtype`, ... of `launch` / `server` as `PipelineSettings`."""
    from kimi_mlx.cluster.head.cluster import PipelineSettings

    return PipelineSettings(sequences=getattr(args, "sequences", 1) or 1,
                            activation_dtype=args.activation_dtype, wire_dtype=args.wire_dtype,
                            prefill_chunk=args.prefill_chunk, force_load=args.force_load,
                            quiet=getattr(args, "quiet", False))


def serve_settings(args) -> "ServeSettings":
    """`cluster serve`'s flags as `ServeSettings`."""
    from kimi_mlx.cluster.node.daemon import ServeSettings

    return ServeSettings(secret_file=args.secret_file, models=args.models, node_id=args.node_id,
                         port=args.port, interface=args.interface,
                         advertise=not args.no_advertise, usable_memory=args.usable_memory,
                         bandwidth_gbs=args.bandwidth_gbs, idle_timeout=args.idle_timeout,
                         max_sessions=args.max_sessions, max_message_mb=args.max_message_mb,
                         cache_bytes=args.cache_bytes, prompt_cache_dir=args.prompt_cache_dir,
                         prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
                         quiet=args.quiet, tls=args.tls)


def run(args) -> int:
    """Run the chosen subcommand; returns the exit status."""
    cmd = getattr(args, "cluster_command", None)
    if getattr(args, "allow_paging", False):  # exported: the ranks this process starts page too
        allow_paging(True)
    if cmd is None:
        print("usage: kimi-mlx cluster {init,serve,ls,doctor,launch,server} ... (see --help)", file=sys.stderr)
        return 2
    if cmd == "init":
        from kimi_mlx.cluster.admin import init

        return init(args)
    if cmd == "ls":
        from kimi_mlx.cluster.admin import ls

        _logging(args.log_level, "WARNING")
        return ls(args)
    if cmd == "doctor":
        from kimi_mlx.cluster.admin import doctor

        _logging(args.log_level, "ERROR")
        return doctor(args)
    if cmd == "serve":
        from kimi_mlx.cluster.node.daemon import serve

        _logging(args.log_level, "INFO")
        return serve(serve_settings(args))
    if cmd == "launch":
        from kimi_mlx.cluster.launch import run as launch

        _logging(args.log_level, "WARNING")
        return launch(args, node_settings(args), pipeline_settings(args))
    from kimi_mlx.cluster.server import run as serve_api

    _logging(args.log_level, "WARNING")
    return serve_api(args, node_settings(args), pipeline_settings(args))


def main(argv=None) -> int:
    """`python -m kimi_mlx.cluster.cli ...`"""
    p = argparse.ArgumentParser(prog="kimi-mlx cluster")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
