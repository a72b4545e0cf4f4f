"""Building and running an API server: the shared server flags and their checks, the
service (model, engine, prompt cache) and the uvicorn loop. `kimi-mlx server`
(`server.cli`) and `kimi-mlx cluster server` (`cluster.server`) both call these.

The HTTP server starts at once and answers /health with 503 while the model loads; if
loading fails the command ends with status 1, naming the checkpoint and the error. With
`--draft-model` every request is decoded speculatively, one request at a time.
Binding a non-loopback address needs an API key (`--api-key` / `--api-key-file`) or an
explicit `--no-auth`.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

from kimi_mlx.generation.request import (InputError, check_max_kv_size, draft_settings,
                                         serving_context)
from kimi_mlx.speculative.settings import DraftSettings

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_CONCURRENCY = 4
# a reply's tokens when the request sets no budget (--max-tokens): K3.1 at effort max
# may otherwise think to the end of a 256K context on one agent turn
DEFAULT_SERVER_MAX_TOKENS = 32768
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level_arg(text: str) -> str:
    """argparse type for --log-level: a logging level name, any case (uvicorn takes
    these too; an unknown one used to surface as a KeyError from uvicorn after loading)."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"not a logging level: {text!r} (one of {', '.join(LOG_LEVELS)})")
    return level


def add_server_arguments(p: argparse.ArgumentParser, log_level: bool = True) -> None:
    """HTTP flags shared with `kimi-mlx cluster server` (which has its own --log-level)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key)")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    p.add_argument("--no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the checkpoint folder's name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait; past it the server answers 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body (default 8 MiB); larger ones get 413")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="context: prompt + generated tokens (default: the checkpoint's "
                        "max_position_embeddings; a larger value serves a longer context "
                        "than it was trained on, with a warning)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_SERVER_MAX_TOKENS,
                   help="reply budget of a request that sets none (OpenAI max_tokens / "
                        "max_completion_tokens, Responses max_output_tokens; Codex sends "
                        f"none), on every route (default {DEFAULT_SERVER_MAX_TOKENS}, or the "
                        "rest of the context when that is less)")
    p.add_argument("--thinking-budget", type=int, default=None,
                   help="reasoning tokens after which the server closes the model's thinking "
                        "(<|close|>think<|sep|> forced) for a request that sets no budget of "
                        "its own (thinking_budget, Anthropic thinking.budget_tokens); "
                        "default none. Any budget is lowered so that the reply keeps room "
                        "for its answer: at least min(half the reply's max tokens, "
                        "1024) after the thinking")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in requests (at most 20 MiB, 10 s each); "
                        "without it only data URLs / base64 images are taken and a URL is a 400")
    p.add_argument("--max-images", type=int, default=32,
                   help="images per request (default 32); image tokens are also bounded by "
                        "the context")
    p.add_argument("--max-schema-bytes", type=int, default=256 << 10,
                   help="largest JSON schema (response_format, each tool's parameters) a "
                        "request may have enforced, in bytes as compact JSON (default 256 KiB); "
                        "larger is a 400, found from the body's bytes before it is parsed")
    p.add_argument("--schema-timeout", type=float, default=5.0,
                   help="seconds a request's schemas may take to compile into its grammar "
                        "(default 5); past it the request is refused with a 400")
    p.add_argument("--max-image-pixels", type=int, default=20000 * 20000,
                   help="pixels a request's images may have in all, read from their headers "
                        "before any is decoded (default 400000000, one 20000 x 20000 image); "
                        "image tokens against the context are also counted from the headers")
    if log_level:
        p.add_argument("--log-level", type=log_level_arg, default="INFO",
                      help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def resolve_api_key(args) -> Optional[str]:
    """The API key from --api-key or --api-key-file; InputError for an empty or unreadable
    file, or a non-loopback --host with no key and no --no-auth."""
    key = args.api_key
    if args.api_key_file:
        if key:
            raise InputError("give --api-key or --api-key-file, not both")
        try:
            key = Path(args.api_key_file).expanduser().read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise InputError(f"--api-key-file {args.api_key_file}: no key read ({e or 'empty file'})") from None
        if not key:
            raise InputError(f"--api-key-file {args.api_key_file}: the first line is empty")
    if key is not None and not key:
        raise InputError("--api-key is empty")
    if key is None and not is_loopback(args.host):
        if not args.no_auth:
            raise InputError(f"--host {args.host} is reachable from other machines: give "
                             "--api-key / --api-key-file, or --no-auth to serve without one")
        print(f"warning: serving on {args.host} without an API key (--no-auth): anyone who "
              "can reach this port can use the model", file=sys.stderr)
    return key


def schema_limits_of(args):
    """The `SchemaLimits` of --max-schema-bytes / --schema-timeout."""
    from kimi_mlx.generation.constrain import SchemaLimits

    return SchemaLimits(args.max_schema_bytes, args.schema_timeout)


def check_server_arguments(args) -> None:
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise InputError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise InputError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if getattr(args, "max_schema_bytes", 1) < 1:
        raise InputError(f"--max-schema-bytes must be >= 1, got {args.max_schema_bytes}")
    if not getattr(args, "schema_timeout", 1.0) > 0:
        raise InputError(f"--schema-timeout must be > 0, got {args.schema_timeout}")
    if getattr(args, "max_concurrency", 1) < 1:
        raise InputError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if getattr(args, "prompt_cache_bytes", 0) < 0:
        raise InputError(f"--prompt-cache-bytes must be >= 0, got {args.prompt_cache_bytes}")
    check_disk_cache_arguments(args)
    if getattr(args, "max_images", 1) < 0:
        raise InputError(f"--max-images must be >= 0, got {args.max_images}")
    if getattr(args, "max_image_pixels", 1) < 1:
        raise InputError(f"--max-image-pixels must be >= 1, got {args.max_image_pixels}")
    check_max_kv_size(args.max_kv_size)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if getattr(args, "thinking_budget", None) is not None and args.thinking_budget < 0:
        raise InputError(f"--thinking-budget must be >= 0, got {args.thinking_budget}")


DEFAULT_DISK_BYTES = 32 << 30


def add_disk_cache_arguments(p) -> None:
    """--prompt-cache-dir / --prompt-cache-disk-bytes (`kimi-mlx server`, `chat`,
    `cluster serve`): the prompt cache's disk tier (`server.disk_cache`)."""
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="also keep prompt-cache snapshots in this folder, so that they "
                        "survive a restart (written in the background; a folder per "
                        "checkpoint, layer range and format; default: memory only)")
    p.add_argument("--prompt-cache-disk-bytes", default=str(DEFAULT_DISK_BYTES), metavar="N",
                   help="bytes of snapshot files kept in --prompt-cache-dir, least "
                        "recently used dropped first, e.g. 100GB (default 32 GiB)")


def check_disk_cache_arguments(args) -> None:
    """Parse --prompt-cache-disk-bytes in place (an int afterwards); InputError naming the
    flag for a bad size or a --prompt-cache-dir that is a file."""
    from kimi_mlx.placement.planner import parse_bytes

    raw = getattr(args, "prompt_cache_disk_bytes", None)
    if raw is None:
        return
    try:
        n = parse_bytes(str(raw), default_unit="B")
    except ValueError as e:
        raise InputError(f"--prompt-cache-disk-bytes: {e}") from None
    if n < 0:
        raise InputError(f"--prompt-cache-disk-bytes must be >= 0, got {raw}")
    args.prompt_cache_disk_bytes = n
    d = getattr(args, "prompt_cache_dir", None)
    if d is not None and Path(d).expanduser().exists() and not Path(d).expanduser().is_dir():
        raise InputError(f"--prompt-cache-dir {d}: not a folder")


def model_cache_fingerprint(model_dir, model, role: str = "one process") -> dict:
    """The disk tier's fingerprint of a whole model loaded from `model_dir`: the weights'
    identity (`disk_cache.checkpoint_identity`), its layer count, the dtypes of its
    parameters (quantization shows as uint32 weights, and in config.json), `role`, and the
    cache format (`kv_bits`, `kv_group_size`: an 8-bit cache's snapshots are never read
    by a model-dtype server, nor the other way round)."""
    from mlx.utils import tree_flatten

    from kimi_mlx.server.disk_cache import checkpoint_identity

    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    return {"checkpoint": checkpoint_identity(model_dir), "layers": [0, len(model.layers)],
            "dtypes": dtypes, "role": role, **kv_fingerprint(model)}


def kv_fingerprint(model) -> dict:
    """{"kv_bits", "kv_group_size"} of a model's cache format (`Model.set_kv_quant`);
    empty for the model dtype, so a model-dtype cache keeps the folder it had."""
    bits = getattr(model, "kv_bits", None)
    return {"kv_bits": bits, "kv_group_size": model.kv_group_size} if bits else {}


def check_draft_server_arguments(args, batch_ngram: bool = True,
                                 batch_models: bool = True) -> Optional[DraftSettings]:
    """--draft-model / --draft / --num-draft-tokens for `kimi-mlx server` and `cluster
    server`: their `DraftSettings` (None without a draft); sets --max-concurrency's
    default (4; 1 with a draft that speculates one request at a time). `--draft ngram`
    batches where `batch_ngram` (the one-process server, a tensor group: every row's
    drafts verified in one batched pass, `speculative.batch`), a draft model where
    `batch_models` (the one-process server: the draft's caches batched with the rows,
    `speculative.proposers.DraftModelRows`) and the MTP and block drafters too where
    `batch_models` (`speculative.hidden_rows`); elsewhere those run one sequence at a
    time. InputError for --max-concurrency > 1 with a draft that does not batch there:
    batching would silently turn it off."""
    from kimi_mlx.speculative.factory import block_drafter_path

    drafts = draft_settings(args)
    draft = drafts.flag if drafts is not None else None
    batches = drafts is not None and (
        (drafts.kind == "ngram" and batch_ngram)
        or (batch_models and (drafts.model is not None or drafts.kind == "mtp")))
    if args.max_concurrency is None:
        args.max_concurrency = 1 if draft and not batches else DEFAULT_CONCURRENCY
    elif draft and not batches and args.max_concurrency != 1:
        where = ("in one process and with --parallel tensor" if batch_ngram or not batch_models
                 else "in one process")
        also = (f"; --draft ngram batches ({where}), and draft models, the MTP and block "
                "drafters in one process"
                if drafts.kind != "ngram" else
                "; n-gram drafts batch in one process and with --parallel tensor")
        if drafts.model is not None and block_drafter_path(drafts.model) is not None:
            draft = f"{draft} {drafts.model} (a block drafter)"
        raise InputError(f"{draft} serves one request at a time: use it with "
                         f"--max-concurrency 1 (or leave that flag out), not "
                         f"{args.max_concurrency}{also}")
    return drafts


def load_service(svc, spec: str, max_concurrency: int, prompt_cache_bytes: int,
                 max_queue: int, max_kv_size: Optional[int],
                 drafts: Optional[DraftSettings] = None, progress: bool = False,
                 allow_image_urls: bool = False, max_images: int = 32,
                 prompt_cache_dir: Optional[str] = None,
                 prompt_cache_disk_bytes: int = DEFAULT_DISK_BYTES,
                 max_image_pixels: Optional[int] = None,
                 kv: Tuple[Optional[int], Optional[int]] = (None, None)) -> None:
    """Load the checkpoint (and the draft `drafts` asks for, through the speculation
    factory) into `svc` (sets tokenizers, context, defaults, engine); `progress`: a
    loading bar on a terminal; `allow_image_urls` / `max_images`: the image policy
    (`server.images.ImageSettings`; the tower loads on the first image).
    `prompt_cache_dir`: the prompt cache's disk tier; a folder that cannot be written
    (a full disk even after its own temporary files are deleted, a read-only folder) is
    one warning and the gauge kimi_mlx_prompt_cache_disk_enabled 0, and the server runs
    with the memory cache only. `kv`: (kv_bits, kv_group_size) of the DSA caches
    (`Model.set_kv_quant`; (None, None) keeps the model dtype; a group of None is
    `model.cache.KV_DEFAULT_GROUP`), also in the disk fingerprint.

    Raises whatever loading raises (FileNotFoundError, ValueError, ...);
    `speculative.loop.TokenizerMismatch` (naming both models) for a draft whose tokenizer is
    not the target's."""
    from kimi_mlx.checkpoint.hub import resolve
    from kimi_mlx.generation.request import generation_defaults
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.server.engine import Engine
    from kimi_mlx.server.prompt_cache import PromptCache
    from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation

    from kimi_mlx.model.cache import KV_DEFAULT_GROUP
    from kimi_mlx.placement.wired import model_plan, wire

    kv = (kv[0], kv[1] or KV_DEFAULT_GROUP)
    # wired before loading (KIMI_MLX_ALLOW_PAGING, which --allow-paging sets, lets it page)
    wire(lambda: model_plan(resolve(spec), "kimi-mlx server", max_kv_size,
                            max(1, max_concurrency or 1), kv_bits=kv[0],
                            kv_group_size=kv[1], drafts=drafts))
    model, wrapper, tok, config = load_for_generation(spec, progress=progress)
    model.set_kv_quant(*kv)  # `--kv-bits` / `--kv-group-size`: the DSA cache format
    # a hub id: the vision tower's shards too (a few hundred MB at K3.1 size), so that the
    # first image is answered, not a 500 for a shard never downloaded
    model_dir = Path(resolve(spec, vision=True))
    svc.defaults = generation_defaults(model_dir)
    speculation = build_speculation(drafts, where=ONE_PROCESS, target_wrapper=wrapper,
                                    target_name=spec, model=model)
    svc.wrapper, svc.tok = wrapper, tok
    from kimi_mlx.server.structured import warm_grammar_tokenizer

    warm_grammar_tokenizer(tok)  # the first structured request does not wait for it
    svc.vocab_size = model.args.vocab_size
    svc.context = serving_context(model.args.max_position_embeddings, max_kv_size)[0]
    disk = None
    from kimi_mlx.speculative.proposers import batches_drafts

    if prompt_cache_dir is not None and (speculation is None or (
            max_concurrency > 1 and batches_drafts(speculation.draft)
            and not speculation.prefills_itself)):
        from kimi_mlx.server.disk_cache import DiskSnapshotStore

        try:
            disk = DiskSnapshotStore(prompt_cache_dir, prompt_cache_disk_bytes,
                                     model_cache_fingerprint(model_dir, model))
        except OSError as e:  # a full disk, a read-only folder: serve without it
            log.warning("prompt cache on disk off (--prompt-cache-dir %s: %s): serving "
                        "with the memory cache only", prompt_cache_dir, e)
            if svc.metrics is not None:
                svc.metrics.disk_cache_off()
    pc = PromptCache(prompt_cache_bytes, disk=disk) if prompt_cache_bytes or disk else None
    if disk is not None and svc.metrics is not None:
        svc.metrics.watch_disk_cache(disk)
    engine = Engine(model, tok.eos_token_ids, max_queue=max_queue,
                    max_concurrency=max_concurrency, prompt_cache=pc,
                    metrics=svc.metrics, speculation=speculation)
    from kimi_mlx.server.images import image_settings

    svc.images = image_settings(model_dir, tok, config, allow_image_urls, max_images,
                                metrics=svc.metrics,
                                **({} if max_image_pixels is None else
                                   {"max_pixels": max_image_pixels}))
    engine.vision, engine.pad_id = svc.images.vision, svc.images.pad_id
    svc.engine = engine.start()


def make_service(spec: str, api_key: Optional[str], served_name: Optional[str],
                 max_body_bytes: int, default_max_tokens: Optional[int] = None,
                 default_thinking_budget: Optional[int] = None, schema_limits=None):
    """The `Service` of a server: its model id (`served_name` or the checkpoint folder's
    name), key, body limit, metrics, the reply budget of a request that sets none
    (`default_max_tokens`, --max-tokens; None: the rest of the context), the thinking
    budget of a request that sets none (`default_thinking_budget`, --thinking-budget;
    None: unlimited) and the bounds on a request's schemas (`schema_limits`, a
    `generation.constrain.SchemaLimits`; None: its defaults)."""
    from kimi_mlx.server.common import Service
    from kimi_mlx.server.metrics import Metrics

    svc = Service(api_key=api_key, max_body_bytes=max_body_bytes, created=int(time.time()),
                  default_max_tokens=default_max_tokens,
                  default_thinking_budget=default_thinking_budget, schema_limits=schema_limits)
    # the id only: the checkpoint's path is neither accepted as a model id nor told to
    # clients (a 404 lists the served ids)
    svc.model_ids = [served_name or Path(spec.rstrip("/")).name or "model"]
    svc.metrics = Metrics(lambda: svc.engine.queue_length if svc.engine else 0,
                          lambda: svc.engine.active if svc.engine else 0)
    return svc


class BackgroundServer:
    """uvicorn on a thread (tests, benchmarks): `start()` returns once it listens;
    `port` is the bound port (port 0 = a free one); `stop()` shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = listen(host, port)  # connections queue until uvicorn accepts
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def tcp_socket(host: str) -> socket.socket:
    """A listening socket for `host` whose accepted connections get TCP_NODELAY.

    asyncio sets TCP_NODELAY on an accepted connection only when the socket says
    proto=IPPROTO_TCP (base_events._set_nodelay); `socket.socket(family)` says 0. Without
    it, Nagle's algorithm holds each small streamed chunk until the client's delayed ACK
    (~40 ms on Linux): every streamed reply's first token, and tokens that follow each
    other faster than that, arrived late."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one) and already listening, so a
    client that read the printed URL is queued in the backlog, not refused, during the
    moments before uvicorn accepts. InputError when the address cannot be bound."""
    sock = tcp_socket(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


class _Terminated(Exception):
    """SIGTERM, raised again by uvicorn once it has shut down (see `serve`)."""


def _terminated(signum, frame):
    raise _Terminated()


def serve(svc, app, host: str, port: int, log_level: str, banner: str, prog: str,
          load: Callable[[], None], what: str, cleanup: Callable[[], None] = lambda: None) -> int:
    """Run a server command: bind host:port, print the URL on stderr, call `load()` on a
    thread while uvicorn already answers (/health: 503 "loading"), and serve until
    interrupted (Ctrl-C / SIGTERM shut it down gracefully). Shared by `kimi-mlx server`
    and `kimi-mlx cluster server`.

    When `load()` raises, the server does not linger answering 503: it stops and the
    command fails, with "`prog`: error: `what` failed: <type>: <message>" on stderr.

    Returns the exit status: 0 after a normal stop, 1 when loading failed, 2 when the
    address cannot be bound. `cleanup()` runs in every case once uvicorn has stopped."""
    import uvicorn

    try:
        try:
            sock = listen(host, port)
        except InputError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        where = f"[{host}]" if ":" in host else host
        print(f"{banner}: listening on http://{where}:{sock.getsockname()[1]} (GET /health "
              "says when the model is loaded)", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(),
                                               timeout_graceful_shutdown=5))
        failed: list = []

        def loader():
            try:
                load()
            except Exception as e:  # noqa: BLE001 - ends the command, naming the error
                svc.loading_error = f"{what} failed: {type(e).__name__}: {e}"
                log.debug("load failed", exc_info=True)
                failed.append(svc.loading_error)
                server.should_exit = True
            finally:
                import mlx.core as mx

                mx.clear_streams()  # this thread ran MLX (see engine.run_mlx_thread)

        threading.Thread(target=loader, name="kimi-mlx-load", daemon=True).start()
        # uvicorn shuts down on SIGINT / SIGTERM, then raises the signal again with the
        # handler it found: SIGTERM's default would end the process before `cleanup()`
        # (the engine's stop, the prompt cache's queued disk writes). Ours makes it a
        # normal stop, as Ctrl-C's KeyboardInterrupt is.
        # SIGHUP (the terminal gone), which uvicorn does not handle, is a normal stop too.
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []):
                previous[sig] = signal.signal(sig, _terminated)
        try:
            server.run(sockets=[sock])
        except (KeyboardInterrupt, _Terminated):  # the signal uvicorn shut down on: a normal stop
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if failed:
            print(f"{prog}: error: {failed[0]}", file=sys.stderr)
            return 1
        return 0
    finally:
        cleanup()
