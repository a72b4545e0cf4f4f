"""`make bench-server`: aggregate generation tokens/s and time to first token for 1, 4
and 8 concurrent clients against the same requests run one at a time, in one run, on one
process (`kimi-mlx server` engine, continuous batching) and on a 3-stage loopback cluster
(`kimi-mlx cluster server` engine). Ratios, not absolute times, are the result: the
machine's load changes absolute figures.

Clients are real HTTP clients (httpx, streamed responses) in a process of their own,
against uvicorn on loopback. The 1-, 4- and 8-client runs are interleaved over several
rounds and each ratio is taken within a round, so a drift in the machine's load between
rounds does not show up as a speed-up.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Tuple

import httpx

PROMPT_CHARS = 120


def _prompts(model_dir: Path, n: int) -> List[str]:
    text = (model_dir / "heldout" / "prose.txt").read_text()
    return [text[i * 311 : i * 311 + PROMPT_CHARS] for i in range(n)]


_local = threading.local()


def _client() -> httpx.Client:
    """This client thread's HTTP client, kept as an SDK client is: connections are
    reused, and no request pays for building a client (httpx makes an SSL context for
    each, ~0.1 s on a loaded machine, which padded the one-at-a-time baseline)."""
    if getattr(_local, "client", None) is None:
        _local.client = httpx.Client(timeout=600)
    return _local.client


def _one(url: str, model: str, prompt: str, max_tokens: int) -> Tuple[int, float]:
    """(generated tokens, seconds to the first token) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with _client().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            elif ttft is None and d["choices"] and d["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
    return n, ttft if ttft is not None else time.perf_counter() - t0


def measure(url: str, model: str, prompts: List[str], clients: int, max_tokens: int):
    """(aggregate tokens/s, mean TTFT s) with `clients` concurrent clients, each sending
    its share of `prompts` back to back."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        results = list(ex.map(lambda p: _one(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    return sum(n for n, _ in results) / wall, statistics.mean(t for _, t in results)


CLIENTS = (1, 4, 8)


def bench(url: str, model: str, prompts: List[str], max_tokens: int, label: str,
          rounds: int = 3) -> List[str]:
    """The table for one server: `rounds` interleaved rounds of 1, 4 and 8 clients (the
    machine's load drifts between rounds, not within one); medians over rounds, and the
    ratio to one at a time taken within each round, then its median (and range).

    Clients run in a process of their own, as real clients do, so their HTTP parsing
    does not compete with the server for this process's interpreter lock. CPU seconds
    of this process per generated token (the one-process server: engine, HTTP and asyncio
    threads; for the cluster, its head only) are reported beside wall-clock figures: they
    move less with other processes' load."""
    lines = [f"{label}: {len(prompts)} requests x {max_tokens} tokens, median of {rounds} "
             f"interleaved rounds (load average {os.getloadavg()[0]:.1f} at start)"]
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as clients_proc:
        clients_proc.submit(_one, url, model, prompts[0], 4).result()  # warm-up
        runs = {c: [] for c in CLIENTS}
        for _ in range(rounds):
            for c in CLIENTS:
                cpu = time.process_time()
                tps, ttft = clients_proc.submit(measure, url, model, prompts, c,
                                                max_tokens).result()
                cpu = (time.process_time() - cpu) / (len(prompts) * max_tokens)
                runs[c].append((tps, ttft, cpu))
    base = runs[1]
    for c in CLIENTS:
        tps = statistics.median(r[0] for r in runs[c])
        ttft = statistics.median(r[1] for r in runs[c])
        cpu = statistics.median(r[2] for r in runs[c])
        line = (f"  {c} client{'s' if c > 1 else ' '}{' (one at a time)' if c == 1 else ' ' * 16}"
                f" {tps:8.1f} tok/s aggregate, TTFT {ttft * 1e3:7.0f} ms,"
                f" {cpu * 1e3:6.1f} CPU ms/token here")
        if c > 1:
            ratios = sorted(r[0] / b[0] for r, b in zip(runs[c], base))
            line += (f"   ({statistics.median(ratios):.2f}x the one-at-a-time tokens/s,"
                     f" rounds {ratios[0]:.2f}-{ratios[-1]:.2f})")
        lines.append(line)
    return lines


@contextlib.contextmanager
def _serving(svc, stop_timeout: float = 10.0):
    """uvicorn on loopback for `svc`; on exit the server and then its engine stop."""
    from kimi_mlx.server.app import create_app
    from kimi_mlx.server.serving import BackgroundServer

    srv = BackgroundServer(create_app(svc)).start()
    try:
        yield srv.url
    finally:
        srv.stop()
        svc.engine.stop(stop_timeout)


def single_process(model_dir: Path, prompts, max_tokens, concurrency, rounds) -> List[str]:
    from kimi_mlx.server.serving import load_service, make_service

    svc = make_service(str(model_dir), None, "bench", 1 << 20)
    load_service(svc, str(model_dir), concurrency, 0, 64, None)
    with _serving(svc) as url:
        return bench(url, "bench", prompts, max_tokens,
                     f"one process (continuous batching, --max-concurrency {concurrency})",
                     rounds)


def cluster(model_dir: Path, prompts, max_tokens, concurrency, rounds) -> List[str]:
    from kimi_mlx.cluster.api import ClusterEngine
    from kimi_mlx.cluster.head import Pipeline, check_nodes, plan_stages
    from kimi_mlx.testing.cluster import LocalCluster
    from kimi_mlx.cluster.transport import GrpcTransport
    from kimi_mlx.checkpoint.loader import load_for_generation

    from kimi_mlx.server.serving import make_service

    with tempfile.TemporaryDirectory() as tmp:
        lc = LocalCluster(Path(tmp), n=3, prefix="bench", ckpt=model_dir)
        t = GrpcTransport(lc.secret, peer_timeout=10.0)
        try:
            accepted, _ = check_nodes(lc.nodes(), t.stub_for, lc.fp)
            stages = plan_stages(model_dir, [n for n, _ in accepted], 4096, concurrency)[1]
            t.load(lc.fp, stages, "float32", "float32")
            _, wrapper, tok, _ = load_for_generation(str(model_dir))
            svc = make_service(str(model_dir), None, "bench", 1 << 20)
            svc.wrapper, svc.tok, svc.context = wrapper, tok, 4096
            svc.engine = ClusterEngine(Pipeline(t, 128), tok.eos_token_ids, concurrency).start()
            with _serving(svc, 2.0) as url:
                return bench(url, "bench", prompts, max_tokens,
                             f"3-stage loopback cluster ({concurrency} sessions in flight)",
                             rounds)
        finally:
            t.shutdown()
            lc.stop()


def main(argv=None) -> int:
    from kimi_mlx.generation.request import default_model

    p = argparse.ArgumentParser(prog="python -m kimi_mlx.bench.server")
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped micro model)")
    p.add_argument("--requests", type=int, default=8, help="requests per measurement (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="--max-concurrency (default 8)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of 1/4/8 clients, medians reported (default 3)")
    p.add_argument("--skip-cluster", action="store_true", help="only the single process")
    a = p.parse_args(argv)
    model_dir = Path(a.model or default_model())
    prompts = _prompts(model_dir, a.requests)
    for line in single_process(model_dir, prompts, a.max_tokens, a.concurrency, a.rounds):
        print(line, flush=True)
    if not a.skip_cluster:
        for line in cluster(model_dir, prompts, a.max_tokens, a.concurrency, a.rounds):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
