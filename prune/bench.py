"""`make bench-prune`: held-out perplexity after pruning, per saliency method, in one table.

Default run: the shipped micro checkpoint (`kimi_mlx/assets/micro`), calibrated on its
code-domain calibration text, pruned to 50% of the routed experts with REAP, frequency,
EAN and random (mean of `--random-seeds` seeds), each scored on held-out code (and
held-out prose, to show what code-only calibration costs elsewhere), next to the unpruned
model. Calibration runs once (streamed, `observe`); each method then writes a real
pruned checkpoint (the same writer as `kimi-mlx prune`) that is loaded back and scored.
The last column is the share of the calibration tokens' expert assignments that went to
experts the method kept: how much of the domain's routing a selection preserves.

    python -m kimi_mlx.prune.bench [--model DIR] [--keep 0.5] [--calib FILE] [--heldout FILE]

Data files are looked up in the model folder (`calib*/...code...`, `heldout*/...code...`);
when the folder has none they are rebuilt from `kimi_mlx.micro.corpus` (the micro model's
own corpus: calibration = its training split, scoring = its held-out split).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx
import numpy as np

import kimi_mlx

from .calib import CalibSet, load_calibration
from .observe import observe
from .pipeline import save
from .saliency import METHODS, experts_to_keep, select
from .writer import AtomicOutput, source_args

# Assets live in the kimi_mlx package (prune/ is mapped to kimi_mlx.prune).
MICRO = Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro"
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".py", ".md")


def find_data(model_dir: Path, split: str, domain: str) -> Optional[Path]:
    """A `split` ("calib" | "heldout") file of `domain` shipped in the model folder, if any.

    Looks for files whose path names both (e.g. `calib/code.txt`, `heldout_code.jsonl`,
    `held-out/code.txt`).
    """
    aliases = {"calib": ("calib",), "heldout": ("heldout", "held_out", "held-out", "eval")}[split]
    hits = []
    for f in sorted(Path(model_dir).rglob("*")):
        rel = f.relative_to(model_dir).as_posix().lower()
        if (f.is_file() and f.suffix.lower() in DATA_SUFFIXES and domain in rel
                and any(a in rel for a in aliases) and not rel.startswith(".")):
            hits.append(f)
    return hits[0] if hits else None


def corpus_file(split: str, domain: str, where: Path) -> Path:
    """Write the micro corpus's `split` ("train" | "heldout") text of `domain` to a file."""
    from kimi_mlx.micro.corpus import build_corpus

    path = where / f"{split}_{domain}.txt"
    path.write_text(build_corpus().text(split, domain), encoding="utf-8")
    return path


def _tokenizer(model_dir: Path):
    from kimi_mlx.tokenizer import KimiTokenizer

    return lambda: KimiTokenizer.from_pretrained(model_dir)


def perplexity(model_dir: Path, ids: Sequence[int], seq_len: int) -> float:
    """Perplexity of a checkpoint on token ids, as `kimi-mlx eval` measures it
    (`kimi_mlx.evaluate.perplexity`: consecutive windows of seq_len + 1 tokens)."""
    from kimi_mlx.evaluate import perplexity as eval_perplexity
    from kimi_mlx.loader import load_model

    model, _, _ = load_model(model_dir, verbose=False)
    ppl = eval_perplexity(model, ids, seq_len).perplexity
    del model
    mx.clear_cache()
    return ppl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.prune.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MICRO), help="source checkpoint (default: shipped micro)")
    p.add_argument("--keep", type=float, default=0.5, help="fraction of experts kept (default 0.5)")
    p.add_argument("--domain", default="code", help="calibration / scoring domain (default code)")
    p.add_argument("--other-domain", default="prose", help="second held-out domain ('' = none)")
    p.add_argument("--calib", default=None, help="calibration file (default: found or rebuilt)")
    p.add_argument("--heldout", default=None, help="held-out file of --domain (default: found)")
    p.add_argument("--heldout-other", default=None, help="held-out file of --other-domain")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=256, help="calibration and scoring window")
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens scored per domain")
    p.add_argument("--random-seeds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    src = Path(args.model)
    if not (src / "config.json").exists():
        print(f"error: {src}: no checkpoint (the micro model ships in kimi_mlx/assets/micro; "
              "build it with `make micro`)", file=sys.stderr)
        return 2
    _, margs, _ = source_args(src)
    n_keep = experts_to_keep(margs.num_experts, margs.num_experts_per_token, keep=args.keep)
    with tempfile.TemporaryDirectory(prefix="bench-prune-") as tmp:
        tmp = Path(tmp)
        calib_path = Path(args.calib) if args.calib else (
            find_data(src, "calib", args.domain) or corpus_file("train", args.domain, tmp))
        domains = [d for d in (args.domain, args.other_domain) if d]
        heldout = {args.domain: args.heldout, args.other_domain: args.heldout_other}
        heldout = {d: Path(heldout[d]) if heldout.get(d) else (
            find_data(src, "heldout", d) or corpus_file("heldout", d, tmp)) for d in domains}
        from kimi_mlx.evaluate import read_tokens

        tok = _tokenizer(src)()
        eval_ids = {d: read_tokens(tok, f, args.eval_tokens) for d, f in heldout.items()}

        calib = load_calibration([calib_path], _tokenizer(src), seq_len=args.seq_len,
                                 max_tokens=args.calib_tokens)
        print(f"model {src}: {margs.num_experts} experts top-{margs.num_experts_per_token}, "
              f"keep {n_keep} ({args.keep:g})", file=sys.stderr)
        print(f"calibration ({args.domain}): {calib.describe()}", file=sys.stderr)
        for d, f in heldout.items():
            print(f"held-out {d}: {len(eval_ids[d]):,} tokens from {f}", file=sys.stderr)
        t0 = time.perf_counter()
        result = observe(src, calib, chunk=args.seq_len, progress=False)
        print(f"streamed calibration: {time.perf_counter() - t0:.1f} s, "
              f"{calib.num_tokens * margs.num_hidden_layers / result.seconds:,.0f} token-layers/s",
              file=sys.stderr)

        rows: Dict[str, Dict[str, float]] = {}
        rows["unpruned"] = {d: perplexity(src, eval_ids[d], args.seq_len) for d in domains}
        runs = [(m, 0) for m in METHODS if m != "random"]
        runs += [("random", s) for s in range(args.random_seeds)]
        for method, seed in runs:
            sel = select(result.stats, method, n_keep, seed=seed)
            name = method if method != "random" else f"random-{seed}"
            with AtomicOutput(tmp / name) as out:
                path = save(out, src, result, calib, sel, log=lambda s: None)
            rows[name] = {d: perplexity(path, eval_ids[d], args.seq_len) for d in domains}
            rows[name]["traffic"] = traffic_kept(result.stats, sel.kept)
            print(f"{name}: " + ", ".join(f"{d} {v:.3f}" for d, v in rows[name].items()),
                  file=sys.stderr)

    table = _table(rows, domains, args, n_keep, margs.num_experts, calib)
    print(table)
    print(gate_diagnostic(result.stats, margs.num_experts_per_token))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "keep": n_keep}, indent=2) + "\n")
    return 0


def traffic_kept(stats, kept) -> float:
    """Share of the calibration tokens' expert assignments that went to kept experts,
    averaged over MoE layers (1.0 unpruned; about n_keep / E for a random choice)."""
    return float(np.mean([stats[l].count[kept[l]].sum() / stats[l].count.sum() for l in kept]))


def gate_diagnostic(stats, top_k: int) -> str:
    """What REAP's router weight g_j can tell apart on this model: the range of the
    experts' mean renormalised gate weight per layer (all equal to 1/top_k when the
    router weighs its top-k alike, and REAP then ranks by activation norm alone), and the
    rank correlation of REAP scores with routing frequency."""
    spans, corr = [], []
    for st in stats.values():
        used = st.count > 0
        g = st.gate_sum[used] / st.count[used]
        spans.append((float(g.min()), float(g.max())))
        if used.sum() > 2:
            ranks = [np.argsort(np.argsort(a[used])) for a in (st.reap("model"), st.frequency)]
            corr.append(float(np.corrcoef(*ranks)[0, 1]))
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return (f"router: mean renormalised gate weight per expert {lo:.3f}-{hi:.3f} over the MoE "
            f"layers (1/top_k = {1 / top_k:.3f}); rank correlation of REAP with frequency "
            f"{np.mean(corr):+.2f} (mean over layers)")


def _table(rows, domains, args, n_keep, num_experts, calib: CalibSet) -> str:
    seeds = [k for k in rows if k.startswith("random-")]
    order = ["unpruned", "reap", "frequency", "ean"]
    lines = [
        f"Held-out perplexity, {n_keep}/{num_experts} experts kept per layer "
        f"(calibration: {args.domain}, {calib.num_tokens:,} tokens; windows of {args.seq_len})",
        "",
        "| model | " + " | ".join(f"{d} ppl" for d in domains) + f" | {args.domain} routing kept |",
        "|---|" + "---:|" * (len(domains) + 1),
    ]
    for k in order:
        kept = rows[k].get("traffic", 1.0)
        lines.append(f"| {k} | " + " | ".join(f"{rows[k][d]:.3f}" for d in domains)
                     + f" | {100 * kept:.1f}% |")
    if seeds:
        cells = []
        for d in domains:
            vals = [rows[s][d] for s in seeds]
            cells.append(f"{np.mean(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        cells.append(f"{100 * np.mean([rows[s]['traffic'] for s in seeds]):.1f}%")
        lines.append(f"| random (mean of {len(seeds)} seeds, range) | " + " | ".join(cells) + " |")
        d = domains[0]
        rand = float(np.mean([rows[s][d] for s in seeds]))
        lines += ["", f"{d}: REAP {rows['reap'][d]:.3f} vs random {rand:.3f} "
                  f"({'better' if rows['reap'][d] < rand else 'NOT better'}), vs frequency "
                  f"{rows['frequency'][d]:.3f} "
                  f"({'no worse' if rows['reap'][d] <= rows['frequency'][d] else 'worse'})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
