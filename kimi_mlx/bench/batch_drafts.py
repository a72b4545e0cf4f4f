"""Drafts inside continuous batching, measured: the one-process server at
`--max-concurrency C` without drafts against the same with each batched drafter
(`--draft ngram`, `--draft-model micro-draft`, the block drafter `--draft-model
micro-dspark`), C concurrent clients, on ordinary
(held-out prose) and copy-heavy prompts (`bench.spec.copy_texts`).

Every server is loaded once in this process and the measurements are interleaved: each
round runs the plain server, then each drafted one, on the same prompts, and a drafted
server's ratio is its tokens/s over the plain server's in the same round (the machine is
shared and its load drifts between rounds, not within one); the median ratio over rounds
and its range are printed. Clients are streamed HTTP clients in a process of their own
(`bench.server.measure`). Before timing, every drafted server's greedy replies at C
clients are checked against the plain server's one request at a time (`--max-concurrency
1`, no draft): the line says "equal" or names the prompts that differ.

    python -m kimi_mlx.bench.batch_drafts [--concurrency 4] [--rounds 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["main"]


def _load(model_dir: Path, concurrency: int, drafts):
    from kimi_mlx.server.serving import load_service, make_service

    svc = make_service(str(model_dir), None, "bench", 1 << 20)
    load_service(svc, str(model_dir), concurrency, 0, 64, None, drafts=drafts)
    return svc


def run(model_dir: Path, concurrency: int, rounds: int, max_tokens: int, requests: int,
        k: int = 3) -> List[str]:
    """The table (lines) for both workloads; see the module doc."""
    from kimi_mlx.bench.server import _prompts, _serving, _texts, measure
    from kimi_mlx.speculative.settings import DraftSettings

    draft_dir = model_dir.parent / "micro-draft"
    configs: Dict[str, Optional[DraftSettings]] = {
        "plain": None,
        "--draft ngram": DraftSettings(kind="ngram", num_draft_tokens=k),
        "--draft-model micro-draft": DraftSettings(model=str(draft_dir), num_draft_tokens=k),
        "--draft-model micro-dspark": DraftSettings(model=str(model_dir.parent / "micro-dspark"),
                                                    num_draft_tokens=k),
    }
    lines = [f"one process, --max-concurrency {concurrency}, {concurrency} clients, "
             f"{requests} requests x {max_tokens} tokens, k = {k}, median of {rounds} "
             f"interleaved rounds (load average {os.getloadavg()[0]:.1f} at start)"]
    import contextlib

    with contextlib.ExitStack() as stack:
        ref_url = stack.enter_context(_serving(_load(model_dir, 1, None)))
        svcs = {name: _load(model_dir, concurrency, d) for name, d in configs.items()}
        urls = {name: stack.enter_context(_serving(s)) for name, s in svcs.items()}
        ctx = mp.get_context("spawn")
        from kimi_mlx.lifetime import watch_parent

        # the clients' process ends with this one, even when this one is killed
        pool = stack.enter_context(cf.ProcessPoolExecutor(1, mp_context=ctx,
                                                          initializer=watch_parent,
                                                          initargs=(os.getpid(),)))
        for workload in ("ordinary", "copy"):
            prompts = _prompts(model_dir, requests, workload)
            want = _texts(ref_url, "bench", prompts, max_tokens, 1)
            lines.append(f"{workload} prompts:")
            for name, url in urls.items():
                got = _texts(url, "bench", prompts, max_tokens, concurrency)
                bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                lines.append(f"  {name}: greedy replies at {concurrency} clients "
                             f"{'equal' if not bad else f'DIFFER at prompts {bad}'} the "
                             "single runs")
            before = {n: _counts(s) for n, s in svcs.items()}
            tps = {name: [] for name in urls}
            for _ in range(rounds):
                for name, url in urls.items():
                    tps[name].append(pool.submit(measure, url, "bench", prompts, concurrency,
                                                 max_tokens).result()[0])
            base = tps["plain"]
            for name in urls:
                line = f"  {name:28s} {statistics.median(tps[name]):7.1f} tok/s"
                if name != "plain":
                    r = sorted(a / b for a, b in zip(tps[name], base))
                    st = _counts(svcs[name])
                    steps = st[0] - before[name][0]
                    acc = (st[2] - before[name][2]) / steps if steps else 0.0
                    line += (f"  {statistics.median(r):.2f}x plain (rounds {r[0]:.2f}-"
                             f"{r[-1]:.2f}), {acc:.2f} accepted per verified row")
                lines.append(line)
    lines.append(f"load average {os.getloadavg()[0]:.1f} at the end")
    return lines


def _counts(svc):
    spec = svc.engine.speculation
    if spec is None:
        return (0, 0, 0)
    st = spec.stats
    return (st.steps, st.drafted, st.accepted)


def main(argv=None) -> int:
    from kimi_mlx.generation.request import default_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped micro model)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    a = p.parse_args(argv)
    for line in run(Path(a.model or default_model()), a.concurrency, a.rounds, a.max_tokens,
                    a.requests, a.num_draft_tokens):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
