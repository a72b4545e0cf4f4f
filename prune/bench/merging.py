"""Held-out perplexity per domain of REAP with and without `--merge`.

On the micro-moe test bed: calibrated once on a mix of every domain (streamed `observe`
with the similarity sums of `merge` and the router inputs of `refit`), then at each keep
(default 0.5, 0.25, 0.125) four builds are written with the prune writer, loaded back and
scored on every domain's held-out text: uniform reap-sum (the default REAP), the same with
`--merge`, `--budget spread --refit-router`, and that with `--merge`. Nothing here is
random (no seeds). Also times the calibration pass with and without the similarity sums.

    python -m kimi_mlx.prune.bench.merging [--model DIR] [--keep 0.25] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

import numpy as np

from kimi_mlx.prune.bench.pruning import (MICRO_MOE, _tokenizer, find_data, model_domains,
                                          perplexity)
from kimi_mlx.prune.calib import load_calibration
from kimi_mlx.prune.merge import DEFAULT_TOKENS
from kimi_mlx.prune.observe import observe
from kimi_mlx.prune.pipeline import merge, refit, save
from kimi_mlx.prune.saliency import experts_to_keep, select
from kimi_mlx.prune.writer import AtomicOutput, source_args

VARIANTS = [("reap-sum", "uniform", False, False), ("reap-sum + merge", "uniform", True, False),
            ("spread + refit", "spread", False, True),
            ("spread + refit + merge", "spread", True, True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.prune.bench.merging",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MICRO_MOE))
    p.add_argument("--keep", type=float, action="append", default=None)
    p.add_argument("--method", default="reap-sum")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--no-timing", action="store_true",
                   help="skip the second calibration pass without similarity sums")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    src = Path(args.model)
    keeps = args.keep or [0.5, 0.25, 0.125]
    _, margs, _ = source_args(src)
    seq_len = int(json.loads((src / "eval.json").read_text())["training"]["seq_len"])
    domains = model_domains(src)
    from kimi_mlx.generation.evaluate import read_tokens

    tok = _tokenizer(src)()
    ids = {d: read_tokens(tok, find_data(src, "heldout", d), args.eval_tokens) for d in domains}
    score = lambda path: {d: perplexity(path, ids[d], seq_len) for d in domains}
    calib = load_calibration([find_data(src, "calib", d) for d in domains], _tokenizer(src),
                             seq_len=seq_len, max_tokens=args.calib_tokens)
    res: Dict = {"domains": domains, "seq_len": seq_len, "calibration": calib.describe(),
                 "full": score(src), "keeps": {}}
    log(f"full model: {res['full']}")
    t = time.perf_counter()
    result = observe(src, calib, chunk=seq_len, progress=False, router_inputs=DEFAULT_TOKENS,
                     similarity=True)
    res["observe_seconds_with_similarity"] = time.perf_counter() - t
    res["observe_peak_with_similarity"] = result.peak_memory
    if not args.no_timing:
        t = time.perf_counter()
        plain = observe(src, calib, chunk=seq_len, progress=False, router_inputs=DEFAULT_TOKENS)
        res["observe_seconds_plain"] = time.perf_counter() - t
        res["observe_peak_plain"] = plain.peak_memory
        del plain
    log(f"calibration {calib.describe()}: {res.get('observe_seconds_plain', 0):.1f} s plain, "
        f"{res['observe_seconds_with_similarity']:.1f} s with similarity")
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        for keep in keeps:
            n = experts_to_keep(margs.num_experts, margs.num_experts_per_token, keep=keep)
            rows = {}
            for name, budget, do_merge, do_refit in VARIANTS:
                sel = select(result.stats, args.method, n, budget=budget)
                merges = merge(result, sel) if do_merge else None
                refitted = (refit(result, sel, margs.num_experts_per_token, merges=merges)
                            if do_refit else None)
                folder = Path(tmp) / f"k{n}-{len(rows)}"
                t = time.perf_counter()
                with AtomicOutput(folder) as ao:
                    save(ao, src, result, calib, sel, log=lambda s: None, refitted=refitted,
                         merges=merges)
                write_s = time.perf_counter() - t
                info = json.loads((folder / "saliency.json").read_text())
                rows[name] = {"ppl": score(folder), "write_seconds": write_s,
                              "requant_error": (info["merge"] or {}).get("requant_error", {}).get("mean"),
                              "similarity": (info["merge"] or {}).get("mean_similarity")}
                shutil.rmtree(folder, ignore_errors=True)
                log(f"keep {keep} ({n}): {name}: " + ", ".join(
                    f"{d} {v:.2f}" for d, v in rows[name]["ppl"].items()) + f" (write {write_s:.1f} s)")
            res["keeps"][str(keep)] = {"n_keep": n, "rows": rows}
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def table(res: Dict) -> str:
    """Markdown: held-out perplexity per domain (and worst-domain ratio to the full model)."""
    d = res["domains"]
    lines = [f"Calibration: {res['calibration']} (mix of every domain). Held-out perplexity, "
             f"windows of {res['seq_len']}.", "",
             "| keep | build | " + " | ".join(d) + " | worst ratio to full |",
             "|---|---|" + "---:|" * (len(d) + 1),
             "| 1.0 | full model | " + " | ".join(f"{res['full'][x]:.2f}" for x in d) + " | 1.00 |"]
    for keep, cell in res["keeps"].items():
        for name, r in cell["rows"].items():
            worst = max(r["ppl"][x] / res["full"][x] for x in d)
            lines.append(f"| {keep} ({cell['n_keep']}) | {name} | "
                         + " | ".join(f"{r['ppl'][x]:.2f}" for x in d) + f" | {worst:.2f} |")
    if "observe_seconds_plain" in res:
        lines += ["", f"Calibration pass: {res['observe_seconds_plain']:.1f} s without, "
                  f"{res['observe_seconds_with_similarity']:.1f} s with the similarity sums "
                  f"(peak MLX memory {res['observe_peak_plain'] / 2**20:.1f} -> "
                  f"{res['observe_peak_with_similarity'] / 2**20:.1f} MiB)."]
    errs = [r["requant_error"] for c in res["keeps"].values() for r in c["rows"].values()
            if r["requant_error"] is not None]
    if errs:
        lines.append(f"MXFP4 requantization of the merged experts: relative error "
                     f"{np.mean(errs):.4f} mean over builds.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
