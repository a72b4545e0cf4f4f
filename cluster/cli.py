"""`kimi-mlx cluster`: init | serve | ls | launch.

- `init`: make the cluster secret (mode 0600; `--tls` also a cluster certificate) to copy
  to every Mac.
- `serve`: run on every Mac: serves the stage RPCs and advertises the node over zeroconf.
- `ls`: browse and print the nodes found (checked with an authenticated call when this
  machine has the secret).
- `launch`: on the head: discover, check versions and fingerprints, plan, load every
  stage with a progress bar per node, then generate with `kimi-mlx generate`'s flags and
  output (`--draft-model` / `--draft ngram`: speculative decoding, the draft on the head, verify steps
  through the stages: `cluster.speculative`). Exit status: 0 done, 1 a stage was lost / refused or the model does not fit,
  2 bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, List, NamedTuple, Optional

from kimi_mlx.cluster.auth import DEFAULT_SECRET

DEFAULT_MODELS = "~/.kimi-mlx/models"


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
    q.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar while a stage loads (shown only on a terminal)")
    _common(q)

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

    q = sub.add_parser("server", help="OpenAI + Anthropic API server over the nodes",
                       description="`kimi-mlx server`'s API with the pipeline, or one "
                                   "tensor-parallel group (--parallel tensor), behind it.")
    from kimi_mlx.cluster.api import add_arguments as add_api_arguments

    add_api_arguments(q)
    _node_arguments(q, context_default="the model's context, or --max-kv-size")
    _parallel_arguments(q)
    _common(q)


def _parallel_arguments(q) -> None:
    """--parallel and --backend, shared by `launch` and `server`."""
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
                   help="when a stage is lost, continue on the nodes left if the model fits")
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


def _logging(level: Optional[str], default: str) -> None:
    logging.basicConfig(level=getattr(logging, (level or default).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", stream=sys.stderr)


def run(args) -> int:
    """Run the chosen subcommand; returns the exit status."""
    cmd = getattr(args, "cluster_command", None)
    if cmd is None:
        print("usage: kimi-mlx cluster {init,serve,ls,launch,server} ... (see --help)", file=sys.stderr)
        return 2
    return {"init": _init, "serve": _serve, "ls": _ls, "launch": _launch,
            "server": _server}[cmd](args)


def _server(args) -> int:
    _logging(args.log_level, "WARNING")
    from kimi_mlx.cluster.api import run as run_api

    chosen: list = []

    def choose(cluster) -> str:
        chosen.append(args.parallel if args.parallel != "auto" else _recommended(cluster))
        return chosen[-1]

    code = run_api(args, _Cluster, _tokenizers, choose)
    if chosen and chosen[-1] == "tensor":
        # as in launch: once a ring group was joined, interpreter exit can block on the
        # backend's threads; the group is closed (engine.stop), nothing is left to clean up
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_browse_time(flag: str, seconds: float) -> None:
    """ValueError (a one-line reason) for a browse too short to hear any node."""
    from kimi_mlx.cluster.discovery import MIN_BROWSE_S

    if not seconds >= MIN_BROWSE_S:
        raise ValueError(f"{flag} {seconds:g} is too short to hear any node: mDNS queries go "
                         "out after a random 20-120 ms and answers take up to 120 ms more "
                         f"(RFC 6762); give at least {MIN_BROWSE_S:g} s")


def _err(cmd: str, e) -> None:
    print(f"kimi-mlx cluster {cmd}: error: {e}", file=sys.stderr)


def failure_text(e, replan: bool) -> str:
    """A StageFailure as one line: the stage and node (named once, by the transport) and
    what to do next: restart the lost node's `cluster serve`, or --replan when not given."""
    nodes = ", ".join(dict.fromkeys(e.node_ids)) or "the node"
    if not e.lost:
        return f"{e}; the node's `kimi-mlx cluster serve` log says more"
    step = f"restart `kimi-mlx cluster serve` on {nodes}"
    return f"{e}; {step}" + ("" if replan else ", or pass --replan to carry on over the nodes left")


# -- init --------------------------------------------------------------------------------

def _init(args) -> int:
    from kimi_mlx.cluster.auth import AuthError, init_secret, init_tls

    path = Path(args.secret_file).expanduser()
    try:
        if args.tls and path.exists() and not args.force:
            files = []  # keep the secret every node already has; add the certificate
        else:
            files = [init_secret(path, force=args.force)]
        if args.tls:
            files += list(init_tls(path, force=args.force))
    except (FileExistsError, AuthError, OSError) as e:
        _err("init", e)
        return 1
    print(f"wrote {', '.join(str(f) for f in files)} (mode 0600 for keys)")
    home = Path.home()
    shown = [f"~/{f.relative_to(home)}" if f.is_relative_to(home) else str(f) for f in files]
    folder = str(Path(shown[0]).parent)
    print("copy to the same place on every Mac, keeping the mode, e.g.:")
    print(f"  ssh OTHER-MAC mkdir -m700 -p {folder} && scp -p {' '.join(str(f) for f in files)} "
          f"OTHER-MAC:{folder}/")
    return 0


# -- serve -------------------------------------------------------------------------------

def _serve(args) -> int:
    _logging(args.log_level, "INFO")
    from kimi_mlx.cluster.auth import AuthError, load_secret
    from kimi_mlx.cluster.discovery import DEFAULT_PORT, interface_addresses
    from kimi_mlx.placement.planner import parse_bytes
    from kimi_mlx.cluster.service import StageServer, StageService

    try:
        if args.port is not None and not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (0 = any free port), got {args.port}")
        if args.max_sessions < 1 or args.idle_timeout <= 0 or args.max_message_mb < 1:
            raise ValueError("--max-sessions and --max-message-mb must be >= 1 and "
                             "--idle-timeout > 0")
        models = Path(args.models).expanduser()
        if models.exists() and not models.is_dir():
            raise ValueError(f"--models {models}: not a folder")
        if not models.exists() and args.models != DEFAULT_MODELS:
            raise ValueError(f"--models {models}: no such folder")
        secret = load_secret(args.secret_file)
        addresses = interface_addresses(args.interface)
        usable = parse_bytes(args.usable_memory) if args.usable_memory else None
        cache_bytes = (parse_bytes(args.cache_bytes, default_unit="B") if args.cache_bytes is not None
                       else None)
        if args.tls:  # fail before scanning the models folder, with auth's own message
            from kimi_mlx.cluster.auth import server_credentials

            server_credentials(args.secret_file)
    except (AuthError, ValueError) as e:
        _err("serve", e)
        return 2
    node_id = args.node_id or socket.gethostname().split(".")[0]
    listen = addresses if (args.interface or sys.platform == "darwin") else ["0.0.0.0"]
    port = DEFAULT_PORT if args.port is None else args.port
    tls = args.secret_file if args.tls else None
    service = StageService(
        node_id, Path(args.models).expanduser(), secret, tls_secret_path=tls,
        idle_timeout=args.idle_timeout, max_sessions=args.max_sessions,
        max_message=args.max_message_mb << 20, usable_memory=usable,
        bandwidth=int(args.bandwidth_gbs * 1e9) if args.bandwidth_gbs else None,
        cache_bytes=cache_bytes)
    if not args.quiet:
        import tqdm  # noqa: F401  (now: a load should read checkpoint bytes only)

        from kimi_mlx.checkpoint.loader import byte_bar

        service.load_bar = byte_bar
    try:
        server = StageServer(service, listen, port, secret, tls_secret_path=tls).start()
    except (OSError, RuntimeError, AuthError) as e:
        service.close()
        _err("serve", f"cannot listen on port {port} ({e})")
        return 1
    try:
        if not args.no_advertise:
            server.advertise(addresses, tls=bool(tls))
    except Exception as e:  # zeroconf: name conflict, no multicast route
        server.stop(0)
        _err("serve", f"cannot advertise on {', '.join(addresses)}: {e}")
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` writes every thread's stack to the log
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    from kimi_mlx.cluster.fingerprint import named

    fps = sorted(service.catalog)
    print(f"kimi-mlx cluster serve: node {node_id} listening on "
          f"{', '.join(f'{a}:{server.port}' for a in addresses)} "
          f"({len(fps)} checkpoint(s): {', '.join(named(f, service.catalog) for f in fps) or 'none'}; "
          f"{'advertised' if not args.no_advertise else 'not advertised'})", flush=True)
    stop.wait()
    server.stop(1.0)
    return 0


# -- ls ----------------------------------------------------------------------------------

def _ls(args) -> int:
    _logging(args.log_level, "WARNING")
    from kimi_mlx.cluster.auth import AuthError, load_secret
    from kimi_mlx.cluster.discovery import browse, interface_addresses
    from kimi_mlx.cluster.transport import GrpcTransport

    try:
        _check_browse_time("--timeout", args.timeout)
        interfaces = interface_addresses(args.interface)
        nodes = browse(args.timeout, interfaces)
    except ValueError as e:
        _err("ls", e)
        return 2
    except OSError as e:  # e.g. an IPv4 address that is on no interface of this host
        _err("ls", f"cannot browse on {args.interface or 'all interfaces'}: {e.strerror or e}")
        return 2
    status, checkpoints = {}, {}
    try:
        secret = load_secret(args.secret_file)
    except AuthError as e:
        secret = None
        print(f"note: not checking nodes ({e})", file=sys.stderr)
    if secret is not None and nodes:
        from kimi_mlx.cluster.head import check_nodes, held_checkpoints

        t = GrpcTransport(secret, args.secret_file if args.tls else None)
        ok, bad = check_nodes(nodes, t.stub_for, fp=None, check_version=True,
                              channel_for=t.channel_for)
        for info, reply in ok:
            held = f", layers [{reply.start}, {reply.end})" if reply.state == "ready" else ""
            status[info.node_id] = f"ok ({reply.state}{held}, {reply.sessions} sessions)"
            checkpoints[info.node_id] = held_checkpoints(reply)
        for r in bad:
            status[r.node_id] = r.reason.replace("not answering: ", "advertised but not answering: ")
    if args.json:
        print(json.dumps([dict(vars(n), status=status.get(n.node_id, "unchecked")) for n in nodes],
                         indent=2))
        return 0 if nodes else 1
    if not nodes:
        print(f"no kimi-mlx nodes found in {args.timeout:g} s on {', '.join(interfaces)}")
        return 1
    head = ("node", "address", "proto", "kimi-mlx", "chip", "RAM GB", "usable GB", "GB/s",
            "checkpoints", "status")
    rows = [(n.node_id, n.address, str(n.protocol), n.version, n.chip or "-",
             f"{n.total_memory / 1e9:.0f}", f"{n.usable_memory / 1e9:.0f}",
             f"{n.bandwidth / 1e9:.0f}" if n.bandwidth else "-",
             checkpoints.get(n.node_id, ",".join(n.fingerprints) or "-"),
             status.get(n.node_id, "unchecked")) for n in nodes]
    widths = [max(len(r[j]) for r in rows + [head]) for j in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


# -- launch ------------------------------------------------------------------------------

class _Bars:
    """One tqdm progress bar per stage (stderr; on a terminal and without --quiet)."""

    def __init__(self, assignments, quiet: bool = False):
        from tqdm import tqdm

        self.lock = threading.Lock()
        self.assignments = assignments
        self.tty = sys.stderr.isatty()  # no bars in logs: one line per stage when ready
        self.bars = [tqdm(total=1, desc=f"{a.node.node_id} [{a.start},{a.end})", position=i,
                          unit="B", unit_scale=True, file=sys.stderr, leave=True,
                          dynamic_ncols=True, disable=quiet or not self.tty)
                     for i, a in enumerate(assignments)]

    def update(self, i: int, p) -> None:
        if p.phase == "ready" and not self.tty:
            disk = f", {p.disk_read_bytes / 1e6:.1f} MB read from files" if p.disk_read_bytes >= 0 else ""
            print(f"[cluster]   {self.assignments[i].describe(i)}: "
                  f"{'already loaded' if p.message == 'already loaded' else 'loaded'} "
                  f"{p.tensor_bytes / 1e6:.1f} MB of tensors in {p.seconds:.1f} s{disk}",
                  file=sys.stderr)
        with self.lock:
            b = self.bars[i]
            if p.bytes_total:
                b.total = p.bytes_total
                b.n = p.bytes_done
            if p.phase == "waiting":
                b.set_postfix_str("waiting for a load in progress")
            elif p.phase == "ready":
                b.set_postfix_str("already loaded" if p.message == "already loaded" else "ready")
            elif p.phase == "error":
                b.set_postfix_str("failed")
            b.refresh()

    def close(self) -> None:
        for b in self.bars:
            b.close()


class _Cluster:
    """Discovery -> checks -> plan -> load, repeatable for --replan."""

    def __init__(self, args, secret: bytes, model_dir: Path, fp: str, context: int):
        self.args, self.secret, self.model_dir, self.fp, self.context = args, secret, model_dir, fp, context
        self.excluded: set = set()
        self.transport = None
        self.checked = None  # `accepted()`'s answer, kept for its next call (see _recommended)

    def candidates(self):
        from kimi_mlx.cluster.discovery import DEFAULT_PORT, NodeInfo, browse, interface_addresses
        from kimi_mlx.cluster.head import parse_address

        a = self.args
        if a.nodes == "auto":
            nodes = browse(a.discover_timeout, interface_addresses(a.interface))
            if not nodes:
                raise RuntimeError(f"no kimi-mlx nodes found in {a.discover_timeout:g} s "
                                   "(is `kimi-mlx cluster serve` running on each Mac, on this network?)")
            return nodes
        out = []
        for spec in a.nodes.split(","):
            if spec.strip():
                host, port = parse_address(spec, DEFAULT_PORT)
                out.append(NodeInfo(node_id=spec.strip(), host=host, port=port))
        return out

    def accepted(self, transport):
        """[(NodeInfo, HealthReply)] of the usable nodes (RuntimeError when --nodes names
        one that is not usable, or none is)."""
        from kimi_mlx.cluster.head import check_nodes

        if self.checked is not None:
            accepted, self.checked = self.checked, None
            return accepted
        a = self.args
        accepted, rejected = check_nodes(self.candidates(), transport.stub_for, self.fp,
                                         name=self.model_dir.name,
                                         check_version=not a.allow_version_mismatch,
                                         channel_for=transport.channel_for)
        named = a.nodes != "auto"
        if named and rejected and not a.replan and not self.excluded:
            # --nodes fixes the stages' order: run on exactly those, or say which one is not usable
            down = sum(r.unreachable for r in rejected)  # "start it" helps only these
            fix = ("start it" if down == len(rejected) else "fix it as said" if not down
                   else "start or fix them as said")
            raise RuntimeError("; ".join(f"node {r.address} (named in --nodes) is not usable: "
                                         f"{r.reason}" for r in rejected)
                               + f"; {fix}, leave it out of --nodes, or pass --replan to "
                                 "continue on the others")
        for r in rejected:
            where = r.address if r.node_id == r.address else f"{r.node_id} at {r.address}"
            print(f"[cluster] skipping node {where}: {r.reason}", file=sys.stderr)
        accepted = [(n, r) for n, r in accepted if n.node_id not in self.excluded]
        if not accepted:
            raise RuntimeError("no usable nodes")
        if a.nodes == "auto":
            accepted.sort(key=lambda x: x[0].node_id)
        return accepted

    def connect(self):
        from kimi_mlx.cluster.head import Pipeline, choose_compute_dtype, plan_stages
        from kimi_mlx.cluster.transport import GrpcTransport

        a = self.args
        tls = a.secret_file if a.tls else None
        transport = GrpcTransport(self.secret, tls, peer_timeout=a.peer_timeout)
        try:
            accepted = self.accepted(transport)
        except Exception:
            transport.shutdown()
            raise
        nodes = [n for n, _ in accepted]
        plan, assignments = plan_stages(self.model_dir, nodes, self.context, a.sequences)
        replies = {n.node_id: r for n, r in accepted}
        compute = choose_compute_dtype([replies[s.node.node_id] for s in assignments],
                                       self.model_dir, a.activation_dtype)
        wire = compute if a.wire_dtype == "same" else a.wire_dtype
        print(f"[cluster] plan for {self.context} tokens x {a.sequences} sequence(s), "
              f"activations {compute} (wire {wire}):", file=sys.stderr)
        for i, s in enumerate(assignments):
            st = plan.used_stages[i]
            print(f"[cluster]   {s.describe(i)}: {st.total_bytes / 1e9:.2f} GB of "
                  f"{s.node.usable_memory / 1e9:.1f} GB usable", file=sys.stderr)
        for n in plan.unused_nodes:
            print(f"[cluster]   node {n.name}: not needed", file=sys.stderr)
        bars = _Bars(assignments, quiet=getattr(a, "quiet", False))
        try:
            transport.load(self.fp, assignments, compute, wire, progress=bars.update,
                           force=a.force_load, max_positions=self.context)
        except Exception:
            transport.shutdown()
            raise
        finally:
            bars.close()
        self.transport = transport
        return Pipeline(transport, a.prefill_chunk)


class _LaunchInputs(NamedTuple):
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
    media: Any = None  # (pad id, image rows) for Pipeline.generate_step, or None


def _launch_inputs(args) -> _LaunchInputs:
    """Check the flags, the checkpoint and the prompt; load the secret, the tokenizer and
    the draft (which runs on this head). Raises InputError, FileNotFoundError, ValueError,
    AuthError or FingerprintError, each naming the flag or file."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.generation.generate import check_draft_arguments, load_speculation
    from kimi_mlx.generation.request import (InputError, build_prompt, check_context, check_model_arguments,
                                             resolve_model_arg, serving_context)

    from kimi_mlx.cluster.auth import load_secret
    from kimi_mlx.cluster.fingerprint import fingerprint, is_checkpoint

    check_model_arguments(args)
    check_draft_arguments(args)
    if getattr(args, "draft", None) == "mtp":
        raise InputError("--draft mtp: the MTP draft runs in one process only (kimi-mlx "
                         "generate or chat); through the pipeline use --draft-model or "
                         "--draft ngram")
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
        _check_browse_time("--discover-timeout", args.discover_timeout)
    secret = load_secret(args.secret_file)
    margs = ModelArgs.from_config(read_config(model_dir))
    wrapper, tok = _tokenizers(model_dir)
    images, vision = _launch_images(args, model_dir)
    ids = build_prompt(tok, prompt, args.system_prompt, args.ignore_chat_template,
                       args.reasoning_effort, images)
    context, source = serving_context(margs.max_position_embeddings, args.max_kv_size)
    if images:
        source += (f"; {len(images)} image(s) take {sum(im.num_tokens for im in images)} of "
                   "the prompt's tokens")
    args.max_tokens = check_context(len(ids), args.max_tokens, context, source)
    fp = fingerprint(model_dir)
    speculation = load_speculation(args, wrapper, spec)
    media = None
    if images:
        from kimi_mlx.cluster.head import media_rows
        from kimi_mlx.generation.images import media_pad_id

        media = media_rows(vision, images, media_pad_id(tok, read_config(model_dir)))
    return _LaunchInputs(spec, model_dir, secret, margs, wrapper, ids, context, fp, speculation,
                         media)


def _launch_images(args, model_dir: Path):
    """(preprocessed images, `generation.images.Vision`) of `cluster launch --image`, or
    ([], None). InputError for a draft, a raw prompt, --parallel tensor, a checkpoint
    without vision weights, or an unreadable image (naming it)."""
    from kimi_mlx.generation.request import InputError

    if not args.image:
        return [], None
    if args.draft_model or getattr(args, "draft", None):
        raise InputError("--image does not work with speculative decoding yet: drop "
                         "--draft-model / --draft")
    if args.ignore_chat_template:
        raise InputError("--image needs the chat encoding: drop --ignore-chat-template")
    if args.parallel == "tensor":
        raise InputError("--image runs through the pipeline only: use --parallel pipeline")
    args.parallel = "pipeline"  # the tower's rows go to stage 0 of a pipeline
    from kimi_mlx.generation.images import Vision

    vision = Vision(model_dir)
    if not vision.available:
        raise InputError(f"{model_dir}: this checkpoint has no vision weights (no "
                         "vision_config or no vision_tower.* / mm_projector.* tensors), so "
                         "it cannot take --image")
    return [vision.load_image(path) for path in args.image], vision


def _launch_failure(e: BaseException, replan: bool):
    """The one error line for a failed launch: a plan's reasons one per line, a lost stage
    with what to do next (`failure_text`), anything else as it says."""
    from kimi_mlx.placement.planner import PlanError
    from kimi_mlx.cluster.transport import StageFailure

    if isinstance(e, PlanError):
        return str(e).replace("; ", "\n  ")
    return failure_text(e, replan) if isinstance(e, StageFailure) else e


class _LaunchRun:
    """The tokens of one `cluster launch` generation through the pipeline: plain or
    speculative steps, and with --replan a new placement (from the tokens generated so
    far) when a stage is lost. `failure` holds the error that ended it early."""

    def __init__(self, args, cluster: "_Cluster", pipeline, inputs: _LaunchInputs):
        from kimi_mlx.cluster.runner import Sampling

        self.args, self.cluster, self.pipeline, self.inputs = args, cluster, pipeline, inputs
        self.sampling = Sampling(args.temp, args.top_p, args.min_p, args.top_k, args.seed)
        self.failure: Optional[BaseException] = None

    def step(self, prompt_ids: List[int], max_tokens: int):
        """(token, logprobs, from_draft) from the pipeline, plain or speculative."""
        speculation = self.inputs.speculation
        if speculation is None:
            extra = {} if self.inputs.media is None else {"media": self.inputs.media}
            return ((t, lp, False) for t, lp in
                    self.pipeline.generate_step(prompt_ids, self.sampling, max_tokens, **extra))
        from kimi_mlx.cluster.speculative import speculative_pipeline_step

        if self.args.seed is not None:  # the head draws every random number (draft, acceptance)
            import mlx.core as mx

            mx.random.seed(self.args.seed)
        return speculative_pipeline_step(self.pipeline, prompt_ids, speculation.draft,
                                         self.inputs.margs, **speculation.kwargs(),
                                         max_tokens=max_tokens)

    def tokens(self):
        """Yields (token, logprobs, from_draft) until done, or until a stage is lost
        (without --replan, or when no placement is left: `failure` says why)."""
        from kimi_mlx.cluster.transport import StageFailure

        args, ids = self.args, self.inputs.ids
        generated: List[int] = []
        while True:
            try:
                for tok_id, lp, from_draft in self.step(ids + generated,
                                                        args.max_tokens - len(generated)):
                    generated.append(tok_id)
                    yield tok_id, lp, from_draft
                return
            except StageFailure as e:
                if not self._replan(e):
                    return

    def _replan(self, e) -> bool:
        """After a lost stage: free the sessions, and with --replan place the model again
        over the nodes left. False when the generation ends here."""
        from kimi_mlx.placement.planner import PlanError
        from kimi_mlx.cluster.transport import StageFailure

        cluster = self.cluster
        left = cluster.transport.abort()
        print(file=sys.stderr)  # ends the streamed text's line
        if self.args.replan:  # otherwise the final error says it, once
            print(f"[cluster] {e}", file=sys.stderr)
        print("[cluster] freed the session on: " + ", ".join(
            f"{n} ({'unreachable' if k < 0 else f'{k} sessions left'})"
            for n, k in sorted(left.items())), file=sys.stderr)
        if not self.args.replan:
            self.failure = e
            return False
        cluster.excluded |= set(e.node_ids)
        cluster.transport.shutdown()
        print(f"[cluster] replanning without {', '.join(sorted(cluster.excluded))}",
              file=sys.stderr)
        try:
            self.pipeline = cluster.connect()
        except (PlanError, StageFailure, RuntimeError, ValueError) as e2:
            self.failure = e2
            return False
        return True


def _launch(args) -> int:
    """`kimi-mlx cluster launch`: check the inputs, place and load the stages, stream the
    generation as `generate` prints it. 2 for bad input, 1 when the cluster fails."""
    _logging(args.log_level, "WARNING")
    from kimi_mlx.generation.generate import print_generation
    from kimi_mlx.generation.request import InputError

    from kimi_mlx.cluster.auth import AuthError
    from kimi_mlx.cluster.fingerprint import FingerprintError
    from kimi_mlx.cluster.head import stream_generate
    from kimi_mlx.placement.planner import PlanError
    from kimi_mlx.cluster.transport import StageFailure

    try:
        inputs = _launch_inputs(args)
    except (InputError, FileNotFoundError, ValueError, AuthError, FingerprintError) as e:
        _err("launch", e)
        return 2

    plan_context = args.context or min(inputs.context, len(inputs.ids) + args.max_tokens)
    cluster = _Cluster(args, inputs.secret, inputs.model_dir, inputs.fingerprint, plan_context)
    parallel = args.parallel
    if parallel == "auto":
        try:
            parallel = _recommended(cluster)
        except (PlanError, StageFailure, RuntimeError, ValueError) as e:
            _err("launch", e)
            return 1
    if parallel == "tensor":
        from kimi_mlx.cluster.tensor_launch import launch_tensor

        code = launch_tensor(args, cluster, inputs.ids, inputs.wrapper, inputs.speculation)
        # Once a ring group was joined, interpreter exit can block on the backend's
        # threads (seen once in tests after the last token); nothing is left to clean up.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        pipeline = cluster.connect()
    except (PlanError, StageFailure, RuntimeError, ValueError) as e:
        _err("launch", _launch_failure(e, args.replan))
        return 1

    run = _LaunchRun(args, cluster, pipeline, inputs)
    code = 0
    try:
        code = print_generation(args, stream_generate(
            run.tokens(), inputs.wrapper, len(inputs.ids), args.max_tokens,
            lambda: cluster.transport.peak_memory()))
    finally:
        if cluster.transport is not None:
            cluster.transport.shutdown()
    if inputs.speculation is not None and args.verbose:
        print(inputs.speculation.summary())
    if run.failure is not None:
        _err("launch", _launch_failure(run.failure, args.replan))
        return 1
    return code


def _recommended(cluster: _Cluster) -> str:
    """`kimi_mlx.placement.tensor_parallel.recommend` for these nodes: the pipeline over
    the nodes vs a tensor group of this head and the nodes (the slowest node's bandwidth,
    the TCP ring's latency: the group runs over the ring). Says so when it is tensor."""
    from kimi_mlx.cluster.head import plan_stages
    from kimi_mlx.cluster.transport import GrpcTransport
    from kimi_mlx.model.shard import ShardError
    from kimi_mlx.placement.planner import PlanError
    from kimi_mlx.placement.tensor_parallel import (TCP_LATENCY_S, recommend,
                                                   tensor_plan_for, tensors_of)

    a = cluster.args
    transport = GrpcTransport(cluster.secret, a.secret_file if a.tls else None,
                              peer_timeout=a.peer_timeout)
    try:
        accepted = cluster.checked = cluster.accepted(transport)
    finally:
        transport.shutdown()
    nodes = [n.planner_node() for n, _ in accepted]
    try:
        pipeline = plan_stages(cluster.model_dir, [n for n, _ in accepted], cluster.context,
                               a.sequences)[0].tokens_per_s
    except PlanError:
        pipeline = 0.0
    tp, fits = None, False
    if a.sequences == 1:
        try:
            targs, tensors = tensors_of(str(cluster.model_dir))
            bw = [n.bandwidth_bytes_per_s for n in nodes]
            tp = tensor_plan_for(tensors, targs, bw + [min(bw)], cluster.context)
            fits = all(max(tp.load_bytes) + tp.cache_bytes <= n.usable_bytes for n in nodes)
        except (ShardError, ValueError):  # heads or experts that do not split so
            pass
    choice = recommend(pipeline, tp, TCP_LATENCY_S, fits)
    if choice == "tensor":  # pipeline stays today's default, said nowhere
        print(f"[cluster] --parallel {choice} (the planner's recommendation for {len(nodes)} "
              f"node(s); --parallel pipeline|tensor to choose)", file=sys.stderr)
    return choice


def _tokenizers(model_dir: Path):
    from mlx_lm.utils import load_tokenizer

    from kimi_mlx.text.hf_register import register_with_transformers
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(model_dir)
    register_with_transformers()
    return load_tokenizer(model_dir, eos_token_ids=tok.eos_token_ids), tok


def main(argv=None) -> int:
    """`python -m kimi_mlx.cluster.cli ...`"""
    p = argparse.ArgumentParser(prog="kimi-mlx cluster")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
