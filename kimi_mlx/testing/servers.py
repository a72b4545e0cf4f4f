"""In-process API servers for the tests: the one-process server on a checkpoint, and
siblings of it that share its tokenizer but answer through another engine or key."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple


def start_server(model: str, api_key: Optional[str] = None, served_name: Optional[str] = "micro",
                 max_body_bytes: int = 64 << 10, *, max_concurrency: int = 2,
                 prompt_cache_bytes: int = 64 << 20, max_queue: int = 8,
                 max_kv_size: Optional[int] = None, **load_kw) -> Tuple[object, object]:
    """`kimi-mlx server` on `model` in this process, on a free port: returns
    (BackgroundServer, Service), both running. `load_kw` goes to `load_service`
    (drafts: a `DraftSettings`, ...). Stop with `stop_server`."""
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import BackgroundServer, load_service, make_service

    svc = make_service(model, api_key, served_name, max_body_bytes)
    load_service(svc, model, max_concurrency=max_concurrency, prompt_cache_bytes=prompt_cache_bytes,
                 max_queue=max_queue, max_kv_size=max_kv_size, **load_kw)
    return BackgroundServer(create_app(svc)).start(), svc


def stop_server(srv, svc) -> None:
    """Stop what `start_server` started (the HTTP server, then the engine)."""
    srv.stop()
    svc.engine.stop()


@contextmanager
def served(model: str, *args, **kw) -> Iterator[Tuple[object, object]]:
    """`start_server` as a context manager: yields (BackgroundServer, Service)."""
    srv, svc = start_server(model, *args, **kw)
    try:
        yield srv, svc
    finally:
        stop_server(srv, svc)


def sibling_server(real, engine=None, api_key: Optional[str] = None,
                   served_name: Optional[str] = "micro", max_body_bytes: int = 64 << 10):
    """Another app over `real`'s loaded model (its tokenizer, wrapper and context), on its
    own port, answering through `engine` (default: `real`'s) with `api_key`. Returns the
    running BackgroundServer; the caller stops it (and `engine`, if it needs stopping)."""
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import BackgroundServer, make_service

    svc = make_service("model", api_key, served_name or real.model_ids[0], max_body_bytes)
    svc.wrapper, svc.tok, svc.context = real.wrapper, real.tok, real.context
    svc.engine = engine or real.engine
    return BackgroundServer(create_app(svc)).start()
