"""What idle unload gives back and what a reload / swap costs, on `kimi-mlx server`'s
model holder (`server.models`), in this process:

- the process's resident memory (RSS, /proc/self/statm or `ps`) and MLX's active memory
  (`mx.get_active_memory`) before the load, loaded, after a request and after an unload
  (Ollama's keep_alive 0, the path an idle unload takes);
- the reload time of the first model (holder's load, and the request that waited for it,
  wall clock) and the swap time to the second (the same two figures).

    python -m kimi_mlx.bench.models [--model A] [--other B] [--repeats 3]

Defaults: the shipped micro and micro-vision checkpoints. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx


def rss_bytes() -> int:
    """Resident memory of this process, bytes (Linux /proc, else `ps -o rss`)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())],
                             capture_output=True, text=True, check=True).stdout
        return int(out.strip()) * 1024


def _memory() -> dict:
    import mlx.core as mx

    gc.collect()
    return {"rss": rss_bytes(), "mlx_active": int(mx.get_active_memory())}


def _ask(url: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": "class Queue:", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def _unloaded(url: str, name: str, timeout: float = 120.0) -> None:
    """Unload `name` as `ollama stop` does (keep_alive 0, nothing to generate) and wait
    until /api/ps lists nothing."""
    httpx.post(url + "/api/generate", json={"model": name, "keep_alive": 0},
               timeout=30).raise_for_status()
    t0 = time.monotonic()
    while httpx.get(url + "/api/ps", timeout=30).json()["models"]:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError("the model was not unloaded")
        time.sleep(0.02)


def measure(model: str, other: str, repeats: int = 3) -> dict:
    """The figures of the module doc, `repeats` reloads and swaps (medians and all)."""
    import mlx.core as mx

    # the server's code imported first: the RSS figures are the model's, not the imports'
    import kimi_mlx.checkpoint.loader  # noqa: F401
    import kimi_mlx.server.app  # noqa: F401
    import kimi_mlx.server.engine  # noqa: F401
    import mlx_lm.generate  # noqa: F401
    from kimi_mlx.testing.model_servers import model_server

    mx.clear_cache()
    out = {"before_load": _memory()}
    with model_server({"a": model, "b": other}) as (srv, svc):
        out["loaded"] = _memory()
        _ask(srv.url, "a")
        out["after_request"] = _memory()
        _unloaded(srv.url, "a")
        out["after_unload"] = _memory()
        reload_req, reload_load, swap_req, swap_load = [], [], [], []
        for _ in range(repeats):
            reload_req.append(_ask(srv.url, "a"))  # loads a again
            reload_load.append(svc.models.last_load_s)
            swap_req.append(_ask(srv.url, "b"))  # unloads a, loads b
            swap_load.append(svc.models.last_load_s)
            _unloaded(srv.url, "b")
        out["reload_load_s"] = reload_load
        out["reload_request_s"] = reload_req
        out["swap_load_s"] = swap_load
        out["swap_request_s"] = swap_req
        out["medians"] = {k: statistics.median(out[k]) for k in
                          ("reload_load_s", "reload_request_s", "swap_load_s", "swap_request_s")}
    out["models"] = {"a": model, "b": other}
    return out


def main(argv=None) -> int:
    root = Path(__file__).resolve().parents[1] / "assets"
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.bench.models")
    p.add_argument("--model", default=str(root / "micro"))
    p.add_argument("--other", default=str(root / "micro-vision"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.other, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
