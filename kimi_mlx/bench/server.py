"""`make bench-server`: aggregate generation tokens/s and time to first token for 1, 4
and 8 concurrent clients against the same requests run one at a time, in one run, on one
process (`kimi-mlx server` engine, continuous batching) and on a 3-stage loopback cluster
(`kimi-mlx cluster server` engine); with --only-tensor, through a 2-rank tensor group
batching its rows. Ratios, not absolute times, are the result: the
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


def _prompts(model_dir: Path, n: int, workload: str = "ordinary") -> List[str]:
    """n prompt texts: held-out prose ("ordinary") or `bench.spec.copy_texts` ("copy":
    code the continuation repeats, where n-gram drafts are accepted)."""
    if workload == "copy":
        from kimi_mlx.bench.spec import copy_texts

        return copy_texts(model_dir, n, lines=12)
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


def _stream(url: str, body: dict):
    """The parsed server-sent events of one streamed POST of `body` to `url` (without the
    closing [DONE]); raises httpx.HTTPStatusError on an error status."""
    with _client().stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _one(url: str, model: str, prompt: str, max_tokens: int) -> Tuple[int, float]:
    """(generated tokens, seconds to the first token) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    for d in _stream(url + "/v1/completions", body):
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
    from kimi_mlx.lifetime import watch_parent

    # the clients' process ends with this one, even when this one is killed
    with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=watch_parent,
                                initargs=(os.getpid(),)) as clients_proc:
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


def single_process(model_dir: Path, prompts, max_tokens, concurrency, rounds,
                   draft: str = "none") -> List[str]:
    from kimi_mlx.server.serving import load_service, make_service
    from kimi_mlx.speculative.settings import DraftSettings

    svc = make_service(str(model_dir), None, "bench", 1 << 20)
    drafts = DraftSettings(kind="ngram") if draft == "ngram" else None
    load_service(svc, str(model_dir), concurrency, 0, 64, None, drafts=drafts)
    with _serving(svc) as url:
        lines = bench(url, "bench", prompts, max_tokens,
                      f"one process (continuous batching, --max-concurrency {concurrency}"
                      f"{', --draft ngram' if drafts else ''})", rounds)
    if drafts is not None:
        st = svc.engine.speculation.stats
        lines.append(f"  n-gram drafts: {st.steps} rows verified, {st.mean_accepted:.2f} "
                     f"accepted per verified row, {st.plain} row steps without a draft")
    return lines


def cluster(model_dir: Path, prompts, max_tokens, concurrency, rounds,
            batch: bool = True, draft: str = "none") -> List[str]:
    from kimi_mlx.cluster.head.engine import ClusterEngine
    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.cluster.net.nodes import check_nodes
    from kimi_mlx.cluster.head.plan import plan_stages
    from kimi_mlx.testing.cluster import LocalCluster
    from kimi_mlx.cluster.head.transport import GrpcTransport
    from kimi_mlx.checkpoint.loader import load_for_generation

    from kimi_mlx.server.serving import make_service

    with tempfile.TemporaryDirectory() as tmp:
        lc = LocalCluster(Path(tmp), n=3, prefix="bench", ckpt=model_dir)
        t = GrpcTransport(lc.secret, peer_timeout=10.0)
        try:
            accepted, _ = check_nodes(lc.nodes(), t.stub_for, lc.fp)
            stages = plan_stages(model_dir, [n for n, _ in accepted], 4096, concurrency)[1]
            t.load(lc.fp, stages, "float32", "float32")
            model, wrapper, tok, _ = load_for_generation(str(model_dir))
            svc = make_service(str(model_dir), None, "bench", 1 << 20)
            svc.wrapper, svc.tok, svc.context = wrapper, tok, 4096
            spec = None
            if draft == "ngram":  # each session drafts and verifies on its own stream
                from kimi_mlx.speculative.factory import PIPELINE, build_speculation
                from kimi_mlx.speculative.settings import DraftSettings

                spec = build_speculation(DraftSettings(kind="ngram"), where=PIPELINE,
                                         target_wrapper=wrapper)
            svc.engine = ClusterEngine(Pipeline(t, 128), tok.eos_token_ids, concurrency,
                                       metrics=svc.metrics, batch=batch, speculation=spec,
                                       model_args=model.args).start()
            how = ("--draft ngram, a verify message per session per step" if spec else
                   "decode steps batched" if batch else "one message per session per token")
            with _serving(svc, 2.0) as url:
                return bench(url, "bench", prompts, max_tokens,
                             f"3-stage loopback cluster ({concurrency} sessions in flight, {how})",
                             rounds)
        finally:
            t.shutdown()
            lc.stop()


def _chat_ttft(url: str, model: str, messages, max_tokens: int = 4):
    """(seconds to the first streamed token, cached_tokens, the reply as a message, prompt
    tokens) of a streamed chat completion."""
    t0 = time.perf_counter()
    ttft, cached, content, reasoning, n = None, 0, [], [], 0
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    for d in _stream(url + "/v1/chat/completions", body):
        if d.get("usage"):
            cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            n = d["usage"]["prompt_tokens"]
        for c in d.get("choices") or []:
            delta = c.get("delta") or {}
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            if ttft is None and text:
                ttft = time.perf_counter() - t0
    reply = {"role": "assistant", "content": "".join(content),
             "reasoning_content": "".join(reasoning)}
    return (ttft if ttft is not None else time.perf_counter() - t0), cached, reply, n


def _conversation(text: str, round_: int, tok, history_tokens: int):
    """Two user turns of prose (about `history_tokens` tokens together), then a short third
    question; returns the three user messages."""
    per = history_tokens // 2
    out, pos = [], 5000 * round_
    for _ in range(2):
        end = pos + 200
        while len(tok.encode(text[pos:end])) < per and end < len(text):
            end += 200
        out.append({"role": "user", "content": text[pos:end]})
        pos = end
    return out + [{"role": "user", "content": "Summarise both in one line."}]


def cluster_prompt_cache(model_dir: Path, rounds: int, history_tokens: int = 2048) -> List[str]:
    """Time to first token of turn 3 of a conversation with a `history_tokens`-token
    history, through 3 loopback stages: with the stages' prompt cache (turns 1 and 2 ran
    first, as an agent's would) against the same request on a server without it (the same
    pipeline, another engine). Interleaved rounds, a fresh conversation each; the ratio
    is taken within a round."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.cluster.head.engine import ClusterEngine
    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.cluster.net.nodes import check_nodes
    from kimi_mlx.cluster.head.plan import plan_stages
    from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
    from kimi_mlx.cluster.head.transport import GrpcTransport
    from kimi_mlx.server.serving import make_service
    from kimi_mlx.testing.cluster import LocalCluster

    text = (model_dir / "heldout" / "prose.txt").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        lc = LocalCluster(Path(tmp), n=3, prefix="cache", ckpt=model_dir)
        t = GrpcTransport(lc.secret, peer_timeout=10.0)
        try:
            accepted, _ = check_nodes(lc.nodes(), t.stub_for, lc.fp)
            stages = plan_stages(model_dir, [n for n, _ in accepted], 8192, 1)[1]
            t.load(lc.fp, stages, "float32", "float32")
            _, wrapper, tok, _ = load_for_generation(str(model_dir))
            svcs = []
            for index in (HeadCacheIndex(), None):
                svc = make_service(str(model_dir), None, "bench", 1 << 22)
                svc.wrapper, svc.tok, svc.context = wrapper, tok, 8192
                svc.engine = ClusterEngine(Pipeline(t, 128), tok.eos_token_ids, 1,
                                           metrics=svc.metrics, prompt_cache=index).start()
                svcs.append(svc)
            with _serving(svcs[0], 2.0) as cached_url, _serving(svcs[1], 2.0) as plain_url:
                _chat_ttft(plain_url, "bench", [{"role": "user", "content": "warm up"}])
                runs = []
                for r in range(rounds):
                    users = _conversation(text, r + 1, tok, history_tokens)
                    msgs: list = []
                    for u in users[:2]:  # turns 1 and 2 on the cached server
                        msgs.append(u)
                        msgs.append(_chat_ttft(cached_url, "bench", msgs)[2])
                    msgs.append(users[2])
                    cold, _, _, n = _chat_ttft(plain_url, "bench", msgs)
                    warm, cached, _, _ = _chat_ttft(cached_url, "bench", msgs)
                    runs.append((warm, cold, cached))
        finally:
            t.shutdown()
            lc.stop()
    ratios = sorted(w / c for w, c, _ in runs)
    return [f"3-stage loopback cluster, turn 3 of a conversation with a ~{history_tokens}-token "
            f"history ({n} prompt tokens in the last round), median of {rounds} interleaved rounds:",
            f"  time to first token: {statistics.median(w for w, _, _ in runs) * 1e3:.0f} ms "
            f"from the stages' prompt cache ({statistics.median(c for _, _, c in runs):.0f} "
            f"tokens restored), {statistics.median(c for _, c, _ in runs) * 1e3:.0f} ms "
            f"prefilling it all: {statistics.median(ratios):.2f}x (rounds "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}; target <= 0.25x)"]


def tensor_prompt_cache(model_dir: Path, rounds: int, history_tokens: int = 2048) -> List[str]:
    """Time to first token of turn 3 of a conversation with a `history_tokens`-token
    history through a 2-rank tensor group on loopback (`cluster server --parallel tensor`
    as a child process, rank 0, and one node's rank 1): with the ranks' prompt cache
    (turns 1 and 2 ran first, as an agent's would) against the same request on a group
    started with --no-prompt-cache. One group at a time (an idle rank polls its next
    command on a core of its own, which would slow the other group on a small machine),
    the two alternating in each round, a fresh conversation each round, the ratio taken
    within a round; every turn-3 reply is checked against the one-process server's (no
    prompt cache) greedy reply."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.server.serving import load_service, make_service
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.tensor_parallel import free_ports

    text = (model_dir / "heldout" / "prose.txt").read_text()
    tok = load_for_generation(str(model_dir))[2]
    ref = make_service(str(model_dir), None, "micro", 1 << 22)
    load_service(ref, str(model_dir), 1, 0, 64, None)
    runs, same, n = [], 0, 0
    with tempfile.TemporaryDirectory() as tmp, _serving(ref) as ref_url:
        node = LocalCluster(Path(tmp), n=1, prefix="tc", ckpt=model_dir,
                            ports=[free_ports(2, consecutive=True)[0]])
        try:
            for r in range(rounds):
                users = _conversation(text, r + 1, tok, history_tokens)
                out = {}
                for cached_mode, extra in ((True, ()), (False, ("--no-prompt-cache",))):
                    srv = ServerProc(node, free_ports(1)[0], "--parallel", "tensor",
                                     "--max-concurrency", "1", *extra, timeout=300)
                    try:
                        _chat_ttft(srv.url, "micro", [{"role": "user", "content": "warm up"}])
                        if cached_mode:  # turns 1 and 2 first, as an agent's would
                            msgs: list = []
                            for u in users[:2]:
                                msgs.append(u)
                                msgs.append(_chat_ttft(srv.url, "micro", msgs)[2])
                            out["msgs"] = msgs + [users[2]]
                        out[cached_mode] = _chat_ttft(srv.url, "micro", out["msgs"], 8)
                    finally:
                        srv.stop()
                warm, cached, warm_reply, n = out[True]
                cold, _, cold_reply, _ = out[False]
                same += warm_reply == _chat_ttft(ref_url, "micro", out["msgs"], 8)[2] == cold_reply
                runs.append((warm, cold, cached))
        finally:
            node.stop()
    ratios = sorted(w / c for w, c, _ in runs)
    return [f"2-rank tensor group on loopback, turn 3 of a conversation with a ~{history_tokens}"
            f"-token history ({n} prompt tokens in the last round), median of {rounds} rounds:",
            f"  time to first token: {statistics.median(w for w, _, _ in runs) * 1e3:.0f} ms "
            f"from the ranks' prompt cache ({statistics.median(c for _, _, c in runs):.0f} "
            f"tokens restored), {statistics.median(c for _, c, _ in runs) * 1e3:.0f} ms "
            f"prefilling it all: {statistics.median(ratios):.2f}x (rounds "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}; target <= 0.25x); replies equal to one "
            f"process (cached and full) in {same} of {rounds} rounds"]


def _texts(url: str, model: str, prompts: List[str], max_tokens: int, clients: int,
           extra: dict = None) -> List[str]:
    """Greedy completion texts of `prompts` from `clients` clients at once."""
    def one(p):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=dict(body, **(extra or {})), timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    with cf.ThreadPoolExecutor(clients) as ex:
        return list(ex.map(one, prompts))


def tensor_batch(model_dir: Path, prompts, max_tokens, concurrency, rounds,
                 extra=()) -> List[str]:
    """Aggregate tokens/s of 1, 4 and 8 clients through a 2-rank tensor group on loopback
    (`cluster server --parallel tensor --max-concurrency N` as a child process, rank 0,
    and one node's rank 1: continuous batching through the group), against the same
    requests one at a time on the same server; then every reply of `concurrency` clients
    at once checked against the one-process server's (one at a time, no prompt cache)."""
    from kimi_mlx.server.serving import load_service, make_service
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.tensor_parallel import free_ports

    ref = make_service(str(model_dir), None, "bench", 1 << 22)
    load_service(ref, str(model_dir), 1, 0, 64, None)
    with tempfile.TemporaryDirectory() as tmp:
        with _serving(ref) as ref_url:
            want = _texts(ref_url, "bench", prompts, max_tokens, 1)
        node = LocalCluster(Path(tmp), n=1, prefix="tb", ckpt=model_dir,
                            ports=[free_ports(2, consecutive=True)[0]])
        try:
            srv = ServerProc(node, free_ports(1)[0], "--parallel", "tensor", "--served-model-name",
                             "bench", "--max-concurrency", str(concurrency), *extra, timeout=600)
            try:
                lines = bench(srv.url, "bench", prompts, max_tokens,
                              f"2-rank tensor group on loopback (--max-concurrency "
                              f"{concurrency}{' ' + ' '.join(extra) if extra else ''})", rounds)
                got = _texts(srv.url, "bench", prompts, max_tokens, concurrency)
            finally:
                srv.stop()
        finally:
            node.stop()
    same = sum(a == b for a, b in zip(got, want))
    lines.append(f"  replies of {concurrency} clients at once equal to one process (one at a "
                 f"time): {same} of {len(prompts)}")
    return lines


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
    p.add_argument("--only-cluster", action="store_true", help="only the cluster (batched "
                   "decode and, with --no-batch, per-session messages)")
    p.add_argument("--no-batch", action="store_true",
                   help="the cluster without batched decode (one message per session per token)")
    p.add_argument("--only-cache", action="store_true",
                   help="only the cluster prompt-cache time to first token")
    p.add_argument("--only-tensor-cache", action="store_true",
                   help="only the 2-rank tensor group's prompt-cache time to first token")
    p.add_argument("--only-tensor", action="store_true",
                   help="only the 2-rank tensor group's batched decode (1/4/8 clients)")
    p.add_argument("--tensor-extra", default="",
                   help="(with --only-tensor) more `cluster server` flags, e.g. '--no-prompt-cache'")
    p.add_argument("--workload", choices=("ordinary", "copy"), default="ordinary",
                   help="prompts: held-out prose, or code the reply copies (n-gram drafts' case)")
    p.add_argument("--draft", choices=("none", "ngram"), default="none",
                   help="the one-process server with --draft ngram (batched drafts); with "
                   "--only-cluster, the pipeline server with n-gram drafts")
    a = p.parse_args(argv)
    if a.only_tensor:
        prompts = _prompts(Path(a.model or default_model()), a.requests, a.workload)
        for line in tensor_batch(Path(a.model or default_model()), prompts, a.max_tokens,
                                 a.concurrency, a.rounds, tuple(a.tensor_extra.split())):
            print(line, flush=True)
        return 0
    if a.only_tensor_cache:
        for line in tensor_prompt_cache(Path(a.model or default_model()), a.rounds):
            print(line, flush=True)
        return 0
    if a.only_cache:
        for line in cluster_prompt_cache(Path(a.model or default_model()), a.rounds):
            print(line, flush=True)
        return 0
    model_dir = Path(a.model or default_model())
    prompts = _prompts(model_dir, a.requests, a.workload)
    if a.only_cluster:
        for line in cluster(model_dir, prompts, a.max_tokens, a.concurrency, a.rounds,
                            batch=not a.no_batch, draft=a.draft):
            print(line, flush=True)
        return 0
    for line in single_process(model_dir, prompts, a.max_tokens, a.concurrency, a.rounds,
                               a.draft):
        print(line, flush=True)
    if not a.skip_cluster:
        for line in cluster(model_dir, prompts, a.max_tokens, a.concurrency, a.rounds):
            print(line, flush=True)
        for line in cluster_prompt_cache(model_dir, a.rounds):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
