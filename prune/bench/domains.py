"""`make bench-domains`: choose the pruner's domain balance from evidence.

On the micro-moe test bed (three domains: code, prose, data), calibrated on each domain
alone and on a mix of all three, each drawn with `--seeds` calibration seeds (a seeded
sample of `--calib-tokens` tokens of the model folder's `calib/<domain>.txt`; the mix
takes an equal share of every domain), every method in `METHODS` prunes to each keep
(0.5, 0.25, 0.125 of the routed experts) from the same observation (one calibration pass
per calibration and seed, reused across keeps and methods). Random over the same number of
seeds is the floor. Every build is scored on the held-out text of every domain
(`heldout/<domain>.txt`, never calibrated on).

Builds are scored in memory: the full model is loaded once and a selection is applied by
setting the dropped experts' `e_score_correction_bias` to -1e9, so the router never
selects them and renormalises over the kept ones, which is the written build's arithmetic
(`tests/test_prune_domains.py` checks the two agree against a checkpoint written by
`kimi-mlx prune`'s writer).

The rule (printed with the table): a candidate may become the default if, in every
(keep, calibration, domain) cell, its perplexity averaged over the calibration seeds is
no worse than uniform REAP's (the shipped default, reap-sum) by more than the seed noise
(the range of uniform REAP's perplexity over the seeds in that cell), and its geometric
mean over all cells is lower. Of those, the lowest geometric mean wins; with none, the
default stays.

    python -m kimi_mlx.prune.bench.domains [--seeds 3] [--calib-tokens 4096] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from kimi_mlx.prune.bench.pruning import MICRO_MOE, _tokenizer, model_domains, trained_seq_len
from kimi_mlx.prune.calib import load_calibration
from kimi_mlx.prune.observe import observe
from kimi_mlx.prune.saliency import experts_to_keep, select

# (row name, method, budget, balance): uniform REAP (the default before) first; the rest
# are the candidates. Merging (`--merge`) is one more line here.
BASELINE = "uniform REAP (reap-sum)"
METHODS: List[Tuple[str, str, str, str]] = [
    (BASELINE, "reap-sum", "uniform", "none"),
    ("balanced max", "reap-sum", "uniform", "max"),
    ("balanced mean", "reap-sum", "uniform", "mean"),
    ("balanced floor", "reap-sum", "uniform", "floor"),
    ("spread budget", "reap-sum", "spread", "none"),
    ("balanced max, spread budget", "reap-sum", "spread", "max"),
    # spread at keep <= 0.25, uniform above (`saliency.resolve_budget`): the default
    ("auto budget", "reap-sum", "auto", "none"),
    ("balanced max, auto budget", "reap-sum", "auto", "max"),
]
KEEPS = (0.5, 0.25, 0.125)
NEVER = -1e9  # correction bias of a dropped expert: never selected


class Scorer:
    """The full model in memory, scored with a selection applied by masking (docstring)."""

    def __init__(self, src: Path, eval_ids: Dict[str, List[int]], seq_len: int):
        from kimi_mlx.checkpoint.loader import load_model
        from kimi_mlx.model.ffn import LatentMoE

        self.model, _, _ = load_model(src, verbose=False)
        self.moes = {i: l.block_sparse_moe for i, l in enumerate(self.model.layers)
                     if isinstance(getattr(l, "block_sparse_moe", None), LatentMoE)}
        self.bias = {i: np.array(m.gate.e_score_correction_bias, np.float32)
                     for i, m in self.moes.items()}
        self.eval_ids, self.seq_len = eval_ids, seq_len
        self.cache: Dict[tuple, Dict[str, float]] = {}

    def score(self, kept=None) -> Dict[str, float]:
        """{domain: held-out perplexity} with only `kept` ({layer: ids}) routable."""
        from kimi_mlx.generation.evaluate import perplexity

        key = None if kept is None else tuple((l, tuple(v)) for l, v in sorted(kept.items()))
        if key in self.cache:
            return self.cache[key]
        for i, m in self.moes.items():
            b = self.bias[i].copy()
            if kept is not None:
                drop = np.ones(len(b), bool)
                drop[kept[i]] = False
                b[drop] = NEVER
            m.gate.e_score_correction_bias = mx.array(b)
        self.cache[key] = {d: perplexity(self.model, ids, self.seq_len).perplexity
                           for d, ids in self.eval_ids.items()}
        return self.cache[key]


def run(src: Path, seeds: int, calib_tokens: int, eval_tokens: int, seq_len: int,
        keeps: Sequence[float], log) -> Dict:
    """Every (calibration, seed, keep, method) build's held-out perplexity per domain."""
    from kimi_mlx.generation.evaluate import read_tokens
    from kimi_mlx.prune.writer import source_args

    _, margs, _ = source_args(src)
    domains = model_domains(src)
    tok = _tokenizer(src)()
    eval_ids = {d: read_tokens(tok, src / "heldout" / f"{d}.txt", eval_tokens) for d in domains}
    scorer = Scorer(src, eval_ids, seq_len)
    t0 = time.perf_counter()
    res: Dict = {"domains": domains, "keeps": {}, "full": scorer.score(None), "seeds": seeds,
                 "calib_tokens": calib_tokens, "eval_tokens": eval_tokens, "seq_len": seq_len,
                 "num_experts": margs.num_experts, "methods": [m[0] for m in METHODS]}
    n_keeps = {k: experts_to_keep(margs.num_experts, margs.num_experts_per_token, keep=k)
               for k in keeps}
    for k in keeps:
        res["keeps"][str(k)] = {"n_keep": n_keeps[k], "random": [], "cells": {}}
        for s in range(seeds):
            sel = select({l: _empty(margs, l) for l in scorer.moes}, "random", n_keeps[k], seed=s)
            res["keeps"][str(k)]["random"].append(scorer.score(sel.kept))
    calibs = {d: [src / "calib" / f"{d}.txt"] for d in domains}
    calibs["mix"] = [src / "calib" / f"{d}.txt" for d in domains]
    for cname, files in calibs.items():
        for s in range(seeds):
            calib = load_calibration(files, _tokenizer(src), seq_len=seq_len,
                                     max_tokens=calib_tokens, seed=s)
            obs = observe(src, calib, chunk=seq_len, progress=False)
            for k in keeps:
                cell = res["keeps"][str(k)]["cells"].setdefault(cname, {})
                for name, method, budget, balance in METHODS:
                    sel = select(obs.stats, method, n_keeps[k], budget=budget, balance=balance,
                                 domain_stats=obs.domain_stats)
                    cell.setdefault(name, []).append(scorer.score(sel.kept))
            log(f"[{time.perf_counter() - t0:.0f} s] calibration {cname} seed {s}: "
                f"{calib.num_tokens} tokens observed in {obs.seconds:.1f} s")
    res["seconds"] = time.perf_counter() - t0
    return res


def _empty(margs, layer):
    from kimi_mlx.prune.observe import LayerStats

    return LayerStats(layer, margs.num_experts, margs.num_experts_per_token)


def _gmean(vals) -> float:
    return float(np.exp(np.mean(np.log(vals))))


def decide(res: Dict, noise: str = "both") -> Dict:
    """Apply the rule (module docstring): {"passes": {method: (ok, failures)}, "gmean":
    {method: geometric mean over cells}, "choice": method name}. The seed noise of a cell
    is the larger of the two methods' ranges over the calibration seeds (`noise` "both")
    or uniform REAP's range alone ("baseline", which is 0 where every seed chose the same
    experts)."""
    domains = res["domains"]
    gm, passes = {}, {}
    for name in res["methods"]:
        vals, fails = [], []
        for k, kk in res["keeps"].items():
            for cname, cell in kk["cells"].items():
                for d in domains:
                    base = [r[d] for r in cell[BASELINE]]
                    mine = [r[d] for r in cell[name]]
                    vals.append(np.mean(mine))
                    spread = max(base) - min(base)
                    if noise == "both":
                        spread = max(spread, max(mine) - min(mine))
                    if np.mean(mine) > np.mean(base) + spread:
                        fails.append(f"keep {k} {cname} {d}: {np.mean(mine):.3f} vs "
                                     f"{np.mean(base):.3f} + noise {spread:.3f}")
        gm[name] = _gmean(vals)
        passes[name] = (not fails, fails)
    ok = [n for n in res["methods"] if n != BASELINE and passes[n][0] and gm[n] < gm[BASELINE]]
    choice = min(ok, key=gm.get) if ok else BASELINE
    return {"passes": passes, "gmean": gm, "choice": choice, "noise": noise}


def worst_ratio(res: Dict, name: str, keep: str = "0.25", cname: str = "mix") -> List[float]:
    """Per calibration seed: max over domains of build ppl / full ppl."""
    rows = res["keeps"][keep]["cells"][cname][name]
    return [max(r[d] / res["full"][d] for d in res["domains"]) for r in rows]


def tables(res: Dict, verdict: Dict) -> str:
    domains = res["domains"]
    fmt = lambda vals: (f"{np.mean(vals):.2f}" if len(vals) == 1 else
                        f"{np.mean(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
    out = [f"Held-out perplexity per domain (micro-moe, {res['num_experts']} experts per MoE "
           f"layer; mean (min-max) over {res['seeds']} calibration seeds of "
           f"{res['calib_tokens']:,} tokens; {res['eval_tokens']:,} held-out tokens per domain, "
           f"windows of {res['seq_len']}; {res['seconds']:.0f} s)", ""]
    out += ["| keep | calibration | method | " + " | ".join(domains) + " | worst / full |",
            "|---|---|---|" + "---:|" * (len(domains) + 1)]
    out.append("| 1.0 | - | full model | " + " | ".join(f"{res['full'][d]:.2f}" for d in domains)
               + " | 1.000 |")
    for k, kk in res["keeps"].items():
        rnd = kk["random"]
        out.append(f"| {kk['n_keep']} ({k}) | - | random ({len(rnd)} seeds) | "
                   + " | ".join(fmt([r[d] for r in rnd]) for d in domains) + " | "
                   + f"{np.mean([max(r[d] / res['full'][d] for d in domains) for r in rnd]):.3f} |")
        for cname, cell in kk["cells"].items():
            for name in res["methods"]:
                rows = cell[name]
                worst = np.mean([max(r[d] / res["full"][d] for d in domains) for r in rows])
                out.append(f"| {kk['n_keep']} ({k}) | {cname} | {name} | "
                           + " | ".join(fmt([r[d] for r in rows]) for d in domains)
                           + f" | {worst:.3f} |")
    strict = decide(res, "baseline")
    for v, what in ((verdict, "the larger of the two methods' seed ranges in that cell"),
                    (strict, "uniform REAP's seed range alone (0 where its seeds agree)")):
        out += ["", "Rule: a candidate may be the default if in every (keep, calibration, "
                "domain) cell its seed-mean perplexity is at most uniform REAP's seed-mean plus "
                f"the seed noise, {what}, and its geometric mean over all cells is lower; the "
                "lowest geometric mean of those wins.", ""]
        for name in res["methods"]:
            ok, fails = v["passes"][name]
            out.append(f"- {name}: geometric mean {v['gmean'][name]:.4f}; "
                       + ("never worse than uniform REAP beyond the seed noise" if ok else
                          f"worse beyond the noise in {len(fails)} cell(s): " + "; ".join(fails[:4])))
        out.append(f"- choice: **{v['choice']}**")
    if "mix" in next(iter(res["keeps"].values()))["cells"] and "0.25" in res["keeps"]:
        out += ["", "Worst-domain ratio (build ppl / full ppl, max over domains) at keep 0.25, "
                "mixed calibration, per seed:"]
        for name in res["methods"]:
            out.append(f"- {name}: " + ", ".join(f"{v:.3f}" for v in worst_ratio(res, name)))
        b = worst_ratio(res, BASELINE)
        c = worst_ratio(res, verdict["choice"])
        out.append(f"- {verdict['choice']} lower than uniform REAP on "
                   f"{sum(x < y for x, y in zip(c, b))} of {len(b)} seeds")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.prune.bench.domains",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MICRO_MOE))
    p.add_argument("--seeds", type=int, default=3, help="calibration and random seeds")
    p.add_argument("--calib-tokens", type=int, default=4096,
                   help="calibration tokens per (calibration, seed) (default 4096)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per domain")
    p.add_argument("--seq-len", type=int, default=None,
                   help="calibration and scoring window (default: the model's training "
                        "length from eval.json, else 256)")
    p.add_argument("--keep", type=float, action="append", default=None,
                   help="fraction kept, repeatable (default 0.5, 0.25, 0.125)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    src = Path(args.model)
    if not (src / "config.json").exists():
        print(f"error: {src}: no checkpoint (build it with `make micro-moe`)", file=sys.stderr)
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)
    seq_len = trained_seq_len(src, args.seq_len)
    res = run(src, args.seeds, args.calib_tokens, args.eval_tokens, seq_len,
              args.keep or KEEPS, log)
    verdict = decide(res)
    print(tables(res, verdict))
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "verdict": {
            "choice": verdict["choice"], "gmean": verdict["gmean"],
            "passes": {k: v[0] for k, v in verdict["passes"].items()}}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
