"""`kimi-mlx cluster serve`: check the node's settings, start the stage service and its
gRPC server, advertise the node over zeroconf, and serve until SIGINT / SIGTERM / SIGHUP
(or until the process that started it is gone, when it named itself in
`net.lifetime.PARENT_ENV`: a bench's or a test's stages never outlive it)."""

from __future__ import annotations

import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_MODELS = "~/.kimi-mlx/models"


@dataclass(frozen=True)
class ServeSettings:
    """`cluster serve`'s flags, typed once by the command line (each field is the flag of
    the same name; sizes as text such as "480GB", parsed by `serve`)."""

    secret_file: Path
    models: str = DEFAULT_MODELS
    node_id: Optional[str] = None
    port: Optional[int] = None
    interface: Optional[str] = None
    advertise: bool = True
    usable_memory: Optional[str] = None
    bandwidth_gbs: Optional[float] = None
    idle_timeout: float = 120.0
    max_sessions: int = 16
    max_message_mb: int = 256
    cache_bytes: Optional[str] = None
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: Optional[str] = None
    quiet: bool = False
    tls: bool = False


def _err(e) -> None:
    print(f"kimi-mlx cluster serve: error: {e}", file=sys.stderr)


def listen_addresses(addresses, interface, platform: Optional[str] = None):
    """Where the stage service listens: the advertised `addresses` when an --interface was
    given or on macOS (its Thunderbolt bridge, `discovery.interface_addresses`), else every
    interface (0.0.0.0). `platform`: sys.platform unless given."""
    platform = sys.platform if platform is None else platform
    return list(addresses) if (interface or platform == "darwin") else ["0.0.0.0"]


def serve(settings: ServeSettings) -> int:
    """Run the node until SIGINT / SIGTERM / SIGHUP. 2 for bad settings (naming the flag), 1 when
    it cannot listen or advertise, 0 when stopped."""
    from kimi_mlx.cluster.net.auth import AuthError, load_secret
    from kimi_mlx.cluster.net.discovery import DEFAULT_PORT, interface_addresses
    from kimi_mlx.placement.planner import parse_bytes
    from kimi_mlx.cluster.node.server import StageServer
    from kimi_mlx.cluster.node.service import StageService

    try:
        if settings.port is not None and not 0 <= settings.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (0 = any free port), got {settings.port}")
        if settings.max_sessions < 1 or settings.idle_timeout <= 0 or settings.max_message_mb < 1:
            raise ValueError("--max-sessions and --max-message-mb must be >= 1 and "
                             "--idle-timeout > 0")
        models = Path(settings.models).expanduser()
        if models.exists() and not models.is_dir():
            raise ValueError(f"--models {models}: not a folder")
        if not models.exists() and settings.models != DEFAULT_MODELS:
            raise ValueError(f"--models {models}: no such folder")
        secret = load_secret(settings.secret_file)
        addresses = interface_addresses(settings.interface)
        usable = parse_bytes(settings.usable_memory) if settings.usable_memory else None
        cache_bytes = (parse_bytes(settings.cache_bytes, default_unit="B") if settings.cache_bytes is not None
                       else None)
        from kimi_mlx.server.serving import DEFAULT_DISK_BYTES

        disk_bytes = (parse_bytes(settings.prompt_cache_disk_bytes, default_unit="B")
                      if settings.prompt_cache_disk_bytes is not None else DEFAULT_DISK_BYTES)
        cache_dir = Path(settings.prompt_cache_dir).expanduser() if settings.prompt_cache_dir else None
        if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
            raise ValueError(f"--prompt-cache-dir {cache_dir}: not a folder")
        if settings.tls:  # fail before scanning the models folder, with auth's own message
            from kimi_mlx.cluster.net.auth import server_credentials

            server_credentials(settings.secret_file)
    except (AuthError, ValueError) as e:
        _err(e)
        return 2
    node_id = settings.node_id or socket.gethostname().split(".")[0]
    listen = listen_addresses(addresses, settings.interface)
    port = DEFAULT_PORT if settings.port is None else settings.port
    tls = settings.secret_file if settings.tls else None
    service = StageService(
        node_id, Path(settings.models).expanduser(), secret, tls_secret_path=tls,
        idle_timeout=settings.idle_timeout, max_sessions=settings.max_sessions,
        max_message=settings.max_message_mb << 20, usable_memory=usable,
        bandwidth=int(settings.bandwidth_gbs * 1e9) if settings.bandwidth_gbs else None,
        cache_bytes=cache_bytes, cache_dir=cache_dir, cache_disk_bytes=disk_bytes)
    if not settings.quiet:
        import tqdm  # noqa: F401  (now: a load should read checkpoint bytes only)

        from kimi_mlx.checkpoint.loader import byte_bar

        service.load_bar = byte_bar
    try:
        server = StageServer(service, listen, port, secret, tls_secret_path=tls).start()
    except (OSError, RuntimeError, AuthError) as e:
        service.close()
        _err(f"cannot listen on port {port} ({e})")
        return 1
    try:
        if settings.advertise:
            server.advertise(addresses, tls=bool(tls))
    except Exception as e:  # zeroconf: name conflict, no multicast route
        server.stop(0)
        _err(f"cannot advertise on {', '.join(addresses)}: {e}")
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP")
                                                  else ()):
        signal.signal(sig, lambda *_: stop.set())
    from kimi_mlx.cluster.net.lifetime import watch_parent_from_env

    watch_parent_from_env(grace=60.0)  # its SIGTERM to this process sets `stop`
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` writes every thread's stack to the log
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    from kimi_mlx.cluster.net.fingerprint import named

    fps = sorted(service.catalog)
    print(f"kimi-mlx cluster serve: node {node_id} listening on "
          f"{', '.join(f'{a}:{server.port}' for a in addresses)} "
          f"({len(fps)} checkpoint(s): {', '.join(named(f, service.catalog) for f in fps) or 'none'}; "
          f"{'advertised' if settings.advertise else 'not advertised'})", flush=True)
    stop.wait()
    server.stop(1.0)
    return 0
