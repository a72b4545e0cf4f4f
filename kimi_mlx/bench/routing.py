"""`kimi-mlx bench routing`: distinct routed experts per layer for a block of n tokens,
observed on a MoE checkpoint's own corpus (default: the shipped micro-moe and its
held-out text), written as `kimi_mlx/assets/expert_union.json` (the curve the verify
cost model and `kimi-mlx plan --draft-acceptance` read; see
`kimi_mlx.placement.expert_union`).

Routing is observed as `prune/observe.py` observes it: each MoE layer's `route` is
wrapped (an instance attribute shadowing the method) and the expert indices it returns
are kept. Each corpus chunk runs through the model in one prefill pass, so token t's
routing is what a decode or verify step at position t would route (same causal inputs).
For every n = 1..16 the distinct experts of every window of n consecutive tokens are
counted (every start position), and of n tokens drawn at random from all chunks (the
router's skew without the locality of neighbouring tokens), averaged per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from kimi_mlx.placement.expert_union import CURVE_FILE, MAX_BLOCK, UnionCurve, fit_beta, fit_rho


def default_model() -> Path:
    return Path(__file__).resolve().parents[1] / "assets" / "micro-moe"


def observe_routing(model, chunks: List[List[int]]) -> Dict[int, List[np.ndarray]]:
    """{MoE layer index: [int32 [L, k] expert ids per chunk]} from one forward pass per
    chunk (fresh caches each)."""
    import mlx.core as mx

    layers = {i: l.ffn for i, l in enumerate(model.layers) if "block_sparse_moe" in l}
    seen: Dict[int, List] = {i: [] for i in layers}
    for i, moe in layers.items():
        inner = moe.route

        def route(x, _inner=inner, _i=i):
            inds, w = _inner(x)
            seen[_i].append(inds)
            return inds, w

        moe.route = route
    out: Dict[int, List[np.ndarray]] = {i: [] for i in layers}
    try:
        for ids in chunks:
            for i in seen:
                seen[i].clear()
            model(mx.array(ids)[None], cache=model.make_cache())
            for i in layers:
                (inds,) = seen[i]
                out[i].append(np.array(inds.astype(mx.int32)).reshape(len(ids), -1))
    finally:
        for moe in layers.values():
            if "route" in vars(moe):
                del moe.__dict__["route"]
    return out


def block_counts(per_chunk: List[np.ndarray], num_experts: int, max_n: int = MAX_BLOCK,
                 seed: int = 0, draws: int = 4000) -> Dict[str, List[float]]:
    """{"block": mean distinct experts of n consecutive tokens (every window of every
    chunk), "random": of n tokens drawn without replacement from all chunks} for
    n = 1..max_n. per_chunk: int [L, k] expert ids per chunk."""
    block = []
    for n in range(1, max_n + 1):
        total = count = 0
        for ids in per_chunk:
            L = ids.shape[0]
            if L < n:
                continue
            onehot = np.zeros((L, num_experts), np.int32)
            np.put_along_axis(onehot, ids, 1, axis=1)
            csum = np.concatenate([np.zeros((1, num_experts), np.int32), np.cumsum(onehot, 0)])
            windows = csum[n:] - csum[:-n]  # [L - n + 1, E] picks per expert per window
            total += int((windows > 0).sum())
            count += windows.shape[0]
        block.append(total / count)
    pool = np.concatenate(per_chunk)
    rng = np.random.default_rng(seed)
    random = []
    for n in range(1, max_n + 1):
        picks = np.stack([rng.choice(len(pool), n, replace=False) for _ in range(draws)])
        random.append(float(np.mean([len(np.unique(pool[p])) for p in picks])))
    return {"block": block, "random": random}


def measure(model_dir: Path, chunk: int = 256, max_chunks: int = 24) -> UnionCurve:
    """The curve of `model_dir` over its held-out (or calib) corpus: up to `max_chunks`
    chunks of `chunk` tokens, spread over its text files.

    Raises:
        FileNotFoundError: no corpus text; ValueError: a model without MoE layers."""
    from kimi_mlx.checkpoint.loader import load_for_generation

    model, _, tok, _ = load_for_generation(str(model_dir))
    files = sorted((model_dir / "heldout").glob("*.txt")) or sorted((model_dir / "calib").glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no heldout/*.txt or calib/*.txt corpus to route")
    chunks: List[List[int]] = []
    per_file = max(1, max_chunks // len(files))
    for f in files:
        ids = tok.encode(f.read_text(encoding="utf-8"))
        for s in range(0, len(ids) - chunk + 1, chunk)[:per_file]:
            chunks.append(ids[s: s + chunk])
    routed = observe_routing(model, chunks)
    if not routed:
        raise ValueError(f"{model_dir}: no MoE layers to observe")
    args = model.args
    E, k = args.num_experts, args.num_experts_per_token
    block, random, rho, beta = {}, {}, {}, {}
    for i, per_chunk in routed.items():
        c = block_counts(per_chunk, E)
        block[i] = [round(x, 4) for x in c["block"]]
        random[i] = [round(x, 4) for x in c["random"]]
        rho[i] = round(fit_rho(c["random"], E, k), 5)
        beta[i] = round(fit_beta(c["block"], E, k, rho[i]), 5)
    src = (f"{model_dir.name}: routing observed on its own corpus "
           f"({', '.join(f.parent.name + '/' + f.name for f in files)}), {len(chunks)} chunks "
           f"of {chunk} tokens, every window of n consecutive tokens; E={E}, top-k={k}")
    return UnionCurve(src, E, k, block, random, rho, round(sum(rho.values()) / len(rho), 5),
                      beta, round(sum(beta.values()) / len(beta), 5))


def write_atomic(path: Path, data: dict) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def print_curve(curve: UnionCurve, k31=(896, 16)) -> None:
    E, k = curve.num_experts, curve.top_k
    mean = curve.mean_block()
    rows = list(curve.random.values())
    rand = [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))] if rows else None
    print(curve.source)
    print(f"rho (skew) per layer: {', '.join(f'{i}: {r:.3f}' for i, r in curve.rho.items())}; "
          f"mean {curve.rho_mean:.3f}")
    print(f"beta (locality) per layer: {', '.join(f'{i}: {b:.3f}' for i, b in curve.beta.items())}; "
          f"mean {curve.beta_mean:.3f}")
    print(f"{'n':>3} {'D(n) block':>11} {'/(n k)':>7} {'/E':>6} {'random':>7} {'model':>7}"
          f" {'K3.1 D(n)':>10} {'/(n k)':>7} {'uniform':>8}")
    from kimi_mlx.placement.expert_union import union_experts

    for n in range(1, len(mean) + 1):
        d31 = curve.distinct(n, *k31)
        print(f"{n:>3} {mean[n - 1]:>11.2f} {mean[n - 1] / (n * k):>7.3f} {mean[n - 1] / E:>6.3f} "
              f"{(rand[n - 1] if rand else float('nan')):>7.2f} "
              f"{curve.distinct(n, E, k):>7.2f} {d31:>10.1f} "
              f"{d31 / (n * k31[1]):>7.3f} {union_experts(n, *k31):>8.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx bench routing", description=__doc__)
    p.add_argument("--model", default=None, help="MoE checkpoint (default: the shipped micro-moe)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--chunks", type=int, default=24, help="chunks in all (default 24)")
    p.add_argument("--out", default=str(CURVE_FILE),
                   help="where to write the curve (default: kimi_mlx/assets/expert_union.json)")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    curve = measure(Path(a.model) if a.model else default_model(), a.chunk, a.chunks)
    print_curve(curve)
    if not a.no_write:
        write_atomic(Path(a.out), curve.to_json())
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
