"""In-process `kimi-mlx server`s with a `server.models.ModelHolder` (several checkpoints,
idle unload), for the tests and the memory / reload measurements: what `server.cli`
builds from --model NAME=PATH / --idle-unload / --allow-models, on a free port."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple


def start_model_server(checkpoints: Dict[str, str], *, idle_unload: Optional[float] = None,
                       wait_s: float = 120.0, allowed: Optional[List[str]] = None,
                       api_key: Optional[str] = None, max_body_bytes: int = 1 << 20,
                       max_concurrency: int = 1, prompt_cache_bytes: int = 0,
                       max_queue: int = 8, before_load: Optional[Callable[[str], None]] = None,
                       **load_kw) -> Tuple[object, object]:
    """Load the first (allowed) of `checkpoints` (name -> folder) and serve them all:
    (BackgroundServer, Service), `svc.models` the holder. `load_kw` goes to
    `serving.load_service` (drafts, prompt_cache_dir, ...); `before_load(name)` runs
    before each load (a test slows loads down with it). Stop with `stop_model_server`."""
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.models import ModelHolder
    from kimi_mlx.server.serving import BackgroundServer, load_service, make_service

    first = (allowed or list(checkpoints))[0]
    svc = make_service(checkpoints[first], api_key, first, max_body_bytes)

    def load_one(svc, name, path):
        if before_load is not None:
            before_load(name)
        svc.model_ids = [name]
        load_service(svc, path, max_concurrency=max_concurrency,
                     prompt_cache_bytes=prompt_cache_bytes, max_queue=max_queue,
                     max_kv_size=None, **load_kw)

    holder = ModelHolder(svc, checkpoints, load_one, idle_unload=idle_unload, wait_s=wait_s,
                         allowed=allowed, metrics=svc.metrics)
    holder.load_first()
    try:
        return BackgroundServer(create_app(svc)).start(), svc
    except BaseException:
        holder.stop()
        raise


def stop_model_server(srv, svc) -> None:
    """Stop what `start_model_server` started (HTTP, then the holder and its engine)."""
    srv.stop()
    svc.models.stop()


@contextmanager
def model_server(checkpoints: Dict[str, str], **kw) -> Iterator[Tuple[object, object]]:
    """`start_model_server` as a context manager."""
    srv, svc = start_model_server(checkpoints, **kw)
    try:
        yield srv, svc
    finally:
        stop_model_server(srv, svc)
