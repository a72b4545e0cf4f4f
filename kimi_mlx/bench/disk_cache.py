"""Time to first token of a long conversation's next turn on the one-process server:
cold (no prompt cache) against restored from `--prompt-cache-dir` after a restart (the
memory cache empty), and the disk tier's write / read speeds.

    python -m kimi_mlx.bench.disk_cache [--model PATH] [--tokens 3000] [--rounds 3]

Each round: a server with a fresh folder answers turn 1 (its snapshots are written in
the background and flushed when it stops); a new server on the same folder answers
turn 2 (the TTFT measured: a max_tokens=1 request's latency); a server without any
prompt cache answers turn 2 cold. Prints the medians and the ratio. Then the stall
check: the largest gap between small MLX steps on this thread (a stand-in for decode
steps) alone and while the background writer writes a 512 MB snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _ask(url: str, messages, n: int = 1):
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": "micro", "messages": messages, "max_tokens": n, "temperature": 0})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    return dt, body["usage"], body["choices"][0]["message"]


def _gaps(n: int = 300):
    """(median, 99th percentile, max) seconds between n small MLX steps on this thread."""
    import mlx.core as mx

    x, gaps, t = mx.ones((256, 256)), [], time.perf_counter()
    for _ in range(n):
        x = mx.tanh(x @ x * 1e-3)
        mx.eval(x)
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    gaps.sort()
    return statistics.median(gaps), gaps[int(0.99 * (n - 1))], gaps[-1]


def stall_check(mb: int = 512) -> str:
    """The step gaps alone and while `mb` MB of snapshot are written in the background."""
    import mlx.core as mx

    from kimi_mlx.server.disk_cache import DiskSnapshotStore

    arrays = [mx.random.normal((mb // 8, 1024, 1024)).astype(mx.bfloat16) for _ in range(4)]
    mx.eval(arrays)
    with tempfile.TemporaryDirectory() as d:
        store = DiskSnapshotStore(d, 8 << 30, {"bench": 1})
        alone = _gaps(1000)
        store.put("k", 1, [("arrays", arrays)], mb << 20)
        busy = _gaps(1000)
        store.close()
        st = store.stats()
    fmt = lambda g: "median {:.2f}, p99 {:.1f}, max {:.1f} ms".format(*(x * 1e3 for x in g))
    return (f"step gaps alone: {fmt(alone)}; while writing {mb} MB: {fmt(busy)} "
            f"(the write took {st['write_seconds']:.2f} s, "
            f"{st['written_bytes'] / max(st['write_seconds'], 1e-9) / 1e6:.0f} MB/s)")


def main(argv=None) -> int:
    from kimi_mlx.generation.request import default_model
    from kimi_mlx.testing.servers import served

    p = argparse.ArgumentParser(prog="python -m kimi_mlx.bench.disk_cache")
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=3000, help="about this many prompt tokens")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    model = args.model or str(default_model())
    words = ("The standard library's modules are documented with examples; "
             "each function lists its arguments and what it returns. ")
    system = {"role": "system", "content": words * max(args.tokens // 22, 1)}
    first = [system, {"role": "user", "content": "What is functools.partial?"}]
    cold, warm, reads, writes = [], [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            kw = dict(prompt_cache_dir=d, prompt_cache_disk_bytes=8 << 30, max_concurrency=1)
            with served(model, **kw) as (srv, svc):
                _, usage, msg = _ask(srv.url, first, 4)
                disk = svc.engine.prompt_cache.disk
            st = disk.stats()  # after stop: every write done
            writes.append((st["written_bytes"], st["write_seconds"]))
            second = first + [{"role": "assistant", "content": msg.get("content") or "",
                               "reasoning_content": msg.get("reasoning_content") or ""},
                              {"role": "user", "content": "And functools.reduce?"}]
            with served(model, **kw) as (srv, svc):
                dt, u2, _ = _ask(srv.url, second)
                st = svc.engine.prompt_cache.disk.stats()
            warm.append(dt)
            reads.append((st["read_bytes"], st["read_seconds"]))
        with served(model, prompt_cache_bytes=0, max_concurrency=1) as (srv, _):
            dt, u3, _ = _ask(srv.url, second)
        cold.append(dt)
    mc, mw = statistics.median(cold), statistics.median(warm)
    wb = sum(b for b, _ in writes) / max(sum(s for _, s in writes), 1e-9)
    rb = sum(b for b, _ in reads) / max(sum(s for _, s in reads), 1e-9)
    print(f"turn 2: {u2['prompt_tokens']} prompt tokens, "
          f"{u2['prompt_tokens_details']['cached_tokens']} restored from disk")
    print(f"TTFT cold {mc * 1e3:.0f} ms, from disk after a restart {mw * 1e3:.0f} ms: "
          f"{mw / mc:.2f}x (median of {args.rounds}; cold {', '.join(f'{c * 1e3:.0f}' for c in cold)}"
          f"; disk {', '.join(f'{w * 1e3:.0f}' for w in warm)} ms)")
    print(f"disk: {writes[0][0] / 1e6:.1f} MB written per turn 1 ({wb / 1e6:.0f} MB/s in the "
          f"background writer), {reads[0][0] / 1e6:.1f} MB read per restore "
          f"({rb / 1e6:.0f} MB/s, checksum and load included)")
    print(stall_check())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
