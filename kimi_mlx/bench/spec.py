"""`kimi-mlx bench spec`: speculative decoding against plain decoding, in one process.

For each k (drafts per verify step) it reports the mean accepted drafts per verify step
and the generation tokens/s of greedy speculative decoding next to plain greedy decoding
(mlx-lm's `generate_step`) of the same prompts, with the ratio. Plain and speculative runs
alternate, repeated, and each figure is the median over repeats: on a shared machine a
burst of load then hits both sides alike. Tokens/s counts generated tokens over the
generation wall time (the prompt's prefill excluded, for both sides). The ratio is the
median over repeats of each repeat's speculative/plain ratio: within a repeat the two
sides alternate prompt by prompt, so a change of machine load between repeats cancels
in the ratio (on a shared 2-core machine the load swings plain tokens/s by 1.5x
between repeats).

It also prints what the rollback costs at K3.1's size (one KDA layer: 96 heads x 128 x
128 float32 state): replay of m accepted tokens from the snapshot, against the memory
that keeping every per-step state of a k+1-token verify would write.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

REAL_KDA_HEADS, REAL_KDA_DIM, REAL_KDA_LAYERS = 96, 128, 69


def default_draft() -> Optional[Path]:
    path = Path(__file__).resolve().parents[1] / "assets" / "micro-draft"
    return path if (path / "config.json").exists() else None


def default_prompts(model_dir: Path, tokenizer, n: int = 4, length: int = 32) -> List[List[int]]:
    """n prompts of `length` tokens from the checkpoint's held-out text (code and prose),
    or from a fixed sentence when it ships none."""
    texts = []
    for name in ("code", "prose"):
        f = Path(model_dir) / "heldout" / f"{name}.txt"
        if f.exists():
            texts.append(f.read_text(encoding="utf-8"))
    if not texts:
        texts = ["The quick brown fox jumps over the lazy dog. " * 40]
    prompts = []
    i = 0
    while len(prompts) < n:
        ids = tokenizer.encode(texts[i % len(texts)])
        start = (i // len(texts)) * 997 % max(1, len(ids) - length)
        prompts.append(ids[start : start + length])
        i += 1
    return prompts


def _gen_time(fn) -> float:
    """Seconds from the first yielded token to the end (prefill excluded)."""
    it = fn()
    next(it)
    t0 = time.perf_counter()
    n = 1
    for _ in it:
        n += 1
    return (time.perf_counter() - t0), n - 1


def run_plain(model, prompt: List[int], tokens: int):
    from mlx_lm.generate import generate_step

    return _gen_time(lambda: generate_step(mx.array(prompt), model, max_tokens=tokens))


def run_spec(model, draft, prompt: List[int], tokens: int, k: int, stats):
    from kimi_mlx.speculative.loop import speculative_generate_step

    return _gen_time(lambda: speculative_generate_step(
        prompt, model, draft, num_draft_tokens=k, max_tokens=tokens, stats=stats))


def bench(model, draft, prompts: List[List[int]], tokens: int, ks: List[int],
          repeats: int, log=None) -> List[Dict]:
    """Rows {k, mean_accepted, plain_tps, spec_tps (medians over repeats), speedup (median
    of the per-repeat ratios)}; k=0 is not a row."""
    from kimi_mlx.speculative.loop import SpecStats

    # warm up both paths (compilation of the decode graphs and of each k's draft chain,
    # first-call allocations): one-time costs, left out of both sides alike
    run_plain(model, prompts[0], 4)
    for k in ks:
        run_spec(model, draft, prompts[0], 2 * k + 2, k, SpecStats())
    rows = []
    for k in ks:
        plain_tps, spec_tps, ratios, stats = [], [], [], SpecStats()
        for _ in range(repeats):
            tp = np_ = ts = ns = 0
            for p in prompts:
                dt, n = run_plain(model, p, tokens)
                tp, np_ = tp + dt, np_ + n
                dt, n = run_spec(model, draft, p, tokens, k, stats)
                ts, ns = ts + dt, ns + n
            plain_tps.append(np_ / tp)
            spec_tps.append(ns / ts)
            ratios.append(spec_tps[-1] / plain_tps[-1])
        row = dict(k=k, mean_accepted=stats.mean_accepted,
                   plain_tps=statistics.median(plain_tps), spec_tps=statistics.median(spec_tps),
                   speedup=statistics.median(ratios))
        rows.append(row)
        if log:
            log(row)
    return rows


def rollback_cost(max_m: int = 6, repeats: int = 5) -> Dict:
    """At one K3.1 KDA layer: ms to replay m tokens (1..max_m) from a snapshot with the
    rollback's own replay op, and MB a per-step-state scheme would keep for a verify of m
    tokens (m states of 6.3 MB)."""
    from kimi_mlx.speculative.rollback import _compiled_decode as kda_decode

    H, D = REAL_KDA_HEADS, REAL_KDA_DIM
    mx.random.seed(0)
    state = mx.random.normal((1, H, D, D)) * 0.1
    T = max_m
    q, k, v, a = (mx.random.normal((1, T, H, D)) for _ in range(4))
    b = mx.random.normal((1, T, H))
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,)))
    dt = mx.random.normal((H, D)) * 0.5
    mx.eval(state, q, k, v, a, b, A_log, dt)
    out = {"state_mb": H * D * D * 4 / 1e6, "replay_ms": {}, "per_step_mb": {}}
    for m in range(1, max_m + 1):
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            mx.eval(kda_decode(q[:, :m], k[:, :m], v[:, :m], a[:, :m], b[:, :m], A_log, dt,
                               state, -5.0, D**-0.5)[1])
            best = min(best, time.perf_counter() - t0)
        out["replay_ms"][m] = best * 1e3
        out["per_step_mb"][m] = m * out["state_mb"]
    return out


def print_report(rows: List[Dict], cost: Dict, target: str, draft: str, tokens: int,
                 n_prompts: int) -> None:
    print(f"speculative decoding, one process: target {target}, draft {draft}")
    print(f"greedy, {n_prompts} prompts x {tokens} tokens, medians of interleaved repeats "
          "(ratio: median of the per-repeat ratios)")
    print(f"{'k':>3} {'accepted/step':>14} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7}")
    for r in rows:
        print(f"{r['k']:>3} {r['mean_accepted']:>14.2f} {r['plain_tps']:>12.1f} "
              f"{r['spec_tps']:>11.1f} {r['speedup']:>6.2f}x")
    best = max(rows, key=lambda r: r["speedup"])
    print(f"best: k={best['k']} at {best['speedup']:.2f}x plain (target >= 1.3x)")
    print()
    print(f"rollback at K3.1 size (one KDA layer, 96 x 128 x 128 f32 = "
          f"{cost['state_mb']:.1f} MB state; x{REAL_KDA_LAYERS} layers):")
    print(f"{'m':>3} {'replay ms/layer':>16} {'x69 ms':>8} {'per-step states MB/layer':>25} "
          f"{'x69 GB':>7}")
    for m, ms in cost["replay_ms"].items():
        mb = cost["per_step_mb"][m]
        print(f"{m:>3} {ms:>16.2f} {ms * REAL_KDA_LAYERS:>8.1f} {mb:>25.1f} "
              f"{mb * REAL_KDA_LAYERS / 1e3:>7.2f}")
    print("replay runs only after a rejection, over the accepted tokens; per-step states "
          "would be written on every verify step (and need the token-by-token form).")


def main(model: Optional[str], draft: Optional[str], tokens: int, ks: List[int],
         repeats: int, n_prompts: int) -> int:
    from kimi_mlx.generation.generate import resolve_model_arg
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.speculative.loop import load_draft

    spec = resolve_model_arg(model)
    draft_spec = draft or default_draft()
    if draft_spec is None:
        print("kimi-mlx bench spec: no --draft-model and no shipped micro-draft")
        return 2
    target, wrapper, tok, _ = load_for_generation(spec)
    d = load_draft(str(draft_spec), wrapper, spec)
    prompts = default_prompts(Path(spec), tok, n_prompts)
    rows = bench(target, d, prompts, tokens, ks, repeats)
    cost = rollback_cost(max(ks))
    print_report(rows, cost, spec, str(draft_spec), tokens, len(prompts))
    return 0
