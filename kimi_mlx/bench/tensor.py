"""`kimi-mlx bench tensor`: 2-rank tensor parallelism (MLX ring backend on 127.0.0.1)
against one process, on the same checkpoint and prompt.

Per decode step it reports the collectives issued (counted on an uncompiled step), the
bare all_sum floor measured on the same group in the same run, and so the part of a
step the collectives take; the bytes each rank loaded (measured) and reads per step
(the planner's `rank_read_bytes`); and greedy decode tokens/s of 2 ranks and of one
process, measured before and after the ranks (the machine's load drifts), medians of
`repeats` runs each.

On a CPU-only box the two ranks share the cores and memory bandwidth, so this cannot
show TP's bandwidth gain; it separates collective cost from compute, which is what a
reader on Macs needs to carry the figures over (a Mac's all_sum is ~50 us over JACCL,
~300 us over TCP: `kimi_mlx.placement.tensor_parallel`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

MICRO = Path(__file__).resolve().parents[1] / "assets" / "micro"


def main(model: Optional[str] = None, prompt_tokens: int = 64, steps: int = 32,
         port: int = 45900, repeats: int = 3) -> int:
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.placement.tensor_parallel import rank_load_bytes, rank_read_bytes, tensors_of
    from kimi_mlx.testing.tensor_parallel import decode_tokens_per_s, run_ranks

    model_dir = Path(model) if model else MICRO
    one, _, _ = load_model(model_dir, verbose=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, prompt_tokens)]
    single = [decode_tokens_per_s(one, prompt, steps) for _ in range(repeats)]
    with tempfile.TemporaryDirectory(prefix="kimi-tp-bench-") as tmp:
        run_ranks([port, port + 1], ["--model", str(model_dir), "--prompts",
                                     json.dumps([prompt]), "--bench-decode", str(steps),
                                     "--repeats", str(repeats), "--ranged", "--out", tmp],
                  Path(tmp), timeout=300)
        ranks = [dict(np.load(Path(tmp) / f"rank{r}.npz")) for r in (0, 1)]
    single += [decode_tokens_per_s(one, prompt, steps) for _ in range(repeats)]
    args, tensors = tensors_of(str(model_dir))
    one_tps = statistics.median(single)
    tp_all = [float(t) for t in ranks[0]["tokens_per_s"]]
    tp_tps = statistics.median(tp_all)
    step = 1.0 / tp_tps
    sums, gathers = int(ranks[0]["all_sums"]), int(ranks[0]["all_gathers"])
    floor = max(float(r["floor_s"]) for r in ranks)
    coll = (sums + gathers) * floor
    ctx = prompt_tokens + steps
    print(f"kimi-mlx bench tensor: {model_dir.name}, {args.num_hidden_layers} layers, prompt "
          f"{prompt_tokens} tokens, {steps} greedy decode steps, 2 ranks (ring, 127.0.0.1)")
    print(f"  collectives per decode step: {sums} all_sum + {gathers} all_gather "
          f"(expected 2 per layer + the logits: {2 * args.num_hidden_layers} + 1)")
    print(f"  bare all_sum floor ([1, 1, {args.hidden_size}] float32, same run): "
          f"{floor * 1e3:.2f} ms")
    inside = max(float(r["collective_s"]) for r in ranks)
    print(f"  decode step 2 ranks: {step * 1e3:.1f} ms, of which collectives at the floor "
          f"~{coll * 1e3:.1f} ms ({100 * min(1.0, coll / step):.0f}%); measured inside the "
          f"collectives of one uncompiled step (transfer + waiting for the other rank): "
          f"{inside * 1e3:.1f} ms")
    for r, res in enumerate(ranks):
        c = int(res["step_context"])
        print(f"  rank {r}: loaded {int(res['loaded_bytes']):,} B (tensors predicted "
              f"{rank_load_bytes(tensors, args, 2, r):,} B + metadata); one step at "
              f"{c} tokens reads {int(res['step_read_bytes']):,} B counted from its arrays, "
              f"{rank_read_bytes(tensors, args, 2, r, c, act_bytes=4):,} B planned "
              f"(float32 caches)")
    print(f"  one process: loads {rank_load_bytes(tensors, args, 1, 0):,} B, a step reads "
          f"{rank_read_bytes(tensors, args, 1, 0, ctx, act_bytes=4):,} B planned")
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    print(f"  tokens/s (medians): 2 ranks {tp_tps:.1f} ({fmt(tp_all)}), one process "
          f"{one_tps:.1f} (before: {fmt(single[:repeats])}; after: {fmt(single[repeats:])}); "
          f"ratio {tp_tps / one_tps:.2f}x")
    print(f"  without the collectives' floor a 2-rank step would take "
          f"~{max(0.0, step - coll) * 1e3:.1f} ms against one process's {1e3 / one_tps:.1f} ms "
          "(the rest is each rank's compute and its waits for the other on shared cores)")
    return 0
