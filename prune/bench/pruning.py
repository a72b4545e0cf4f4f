"""`make bench-prune`: held-out perplexity after pruning per saliency method, and after
quantization, in one run.

Default run: the shipped micro checkpoint (`kimi_mlx/assets/micro`), calibrated once on
its code-domain calibration text (streamed, `observe`), pruned to 50% and 25% of the
routed experts with each method (REAP with the softmax gate and with the model's gate,
REAP summed, frequency, EAN, and random over `--random-seeds` seeds), each written as a
real checkpoint (the same writer as `kimi-mlx prune`), loaded back and scored on held-out
code and held-out prose. The methods are ranked by perplexity in each (domain, keep)
cell; the best mean rank is the pruner's default. The "routing kept" column is the share
of the calibration tokens' expert assignments that went to kept experts.

Then quantization of the unpruned model (`kimi-mlx convert`): BF16 trunk vs q8 / q6 / q4
(group 64), and MXFP4 experts vs 3-bit / 2-bit: held-out perplexity and file size; and
decode tokens/s, peak memory and bytes read per token of a q4 vs BF16 trunk on the `make
bench` model config (`kimi_mlx.bench.model.bench_text_config`), measured in the same process.

    python -m kimi_mlx.prune.bench.pruning [--model DIR] [--keep 0.5 --keep 0.25] [--no-quant]

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
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

import kimi_mlx

from kimi_mlx.prune.calib import CalibSet, load_calibration
from kimi_mlx.prune.observe import observe
from kimi_mlx.prune.pipeline import convert, save
from kimi_mlx.prune.quantize import QuantSpec
from kimi_mlx.prune.saliency import experts_to_keep, select
from kimi_mlx.prune.writer import AtomicOutput, source_args

# Assets live in the kimi_mlx package (prune/ is mapped to kimi_mlx.prune).
MICRO = Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro"
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".py", ".md")
# (row name, method, gate) of the candidates for the default; random is the floor.
CANDIDATES = [("reap (softmax gate)", "reap", "softmax"), ("reap (model gate)", "reap", "model"),
              ("reap-sum (softmax gate)", "reap-sum", "softmax"), ("frequency", "frequency", "softmax"),
              ("ean", "ean", "softmax")]


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
    from kimi_mlx.text.tokenizer import KimiTokenizer

    return lambda: KimiTokenizer.from_pretrained(model_dir)


def perplexity(model_dir: Path, ids: Sequence[int], seq_len: int) -> float:
    """Perplexity of a checkpoint on token ids, as `kimi-mlx eval` measures it
    (`kimi_mlx.generation.evaluate.perplexity`: consecutive windows of seq_len + 1 tokens)."""
    from kimi_mlx.generation.evaluate import perplexity as eval_perplexity
    from kimi_mlx.checkpoint.loader import load_model

    model, _, _ = load_model(model_dir, verbose=False)
    ppl = eval_perplexity(model, ids, seq_len).perplexity
    del model
    mx.clear_cache()
    return ppl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.prune.bench.pruning", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MICRO), help="source checkpoint (default: shipped micro)")
    p.add_argument("--keep", type=float, action="append", default=None,
                   help="fraction of experts kept, repeatable (default 0.5 and 0.25)")
    p.add_argument("--domain", default="code", help="calibration / scoring domain (default code)")
    p.add_argument("--other-domain", default="prose", help="second held-out domain ('' = none)")
    p.add_argument("--calib", default=None, help="calibration file (default: found or rebuilt)")
    p.add_argument("--heldout", default=None, help="held-out file of --domain (default: found)")
    p.add_argument("--heldout-other", default=None, help="held-out file of --other-domain")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=256, help="calibration and scoring window")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens scored per domain")
    p.add_argument("--random-seeds", type=int, default=3)
    p.add_argument("--no-quant", action="store_true", help="skip the quantization tables")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    keeps = args.keep or [0.5, 0.25]

    src = Path(args.model)
    if not (src / "config.json").exists():
        print(f"error: {src}: no checkpoint (the micro model ships in kimi_mlx/assets/micro; "
              "build it with `make micro`)", file=sys.stderr)
        return 2
    _, margs, _ = source_args(src)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out: Dict = {"keeps": {}, "quant": None, "decode": None}
    with tempfile.TemporaryDirectory(prefix="bench-prune-") as tmp:
        tmp = Path(tmp)
        calib_path = Path(args.calib) if args.calib else (
            find_data(src, "calib", args.domain) or corpus_file("train", args.domain, tmp))
        domains = [d for d in (args.domain, args.other_domain) if d]
        heldout = {args.domain: args.heldout, args.other_domain: args.heldout_other}
        heldout = {d: Path(heldout[d]) if heldout.get(d) else (
            find_data(src, "heldout", d) or corpus_file("heldout", d, tmp)) for d in domains}
        from kimi_mlx.generation.evaluate import read_tokens

        tok = _tokenizer(src)()
        eval_ids = {d: read_tokens(tok, f, args.eval_tokens) for d, f in heldout.items()}
        calib = load_calibration([calib_path], _tokenizer(src), seq_len=args.seq_len,
                                 max_tokens=args.calib_tokens)
        log(f"model {src}: {margs.num_experts} experts top-{margs.num_experts_per_token}")
        log(f"calibration ({args.domain}): {calib.describe()}")
        for d, f in heldout.items():
            log(f"held-out {d}: {len(eval_ids[d]):,} tokens from {f}")
        t0 = time.perf_counter()
        result = observe(src, calib, chunk=args.seq_len, progress=False)
        log(f"streamed calibration: {time.perf_counter() - t0:.1f} s")
        score = lambda path: {d: perplexity(path, eval_ids[d], args.seq_len) for d in domains}
        unpruned = score(src)
        log(f"unpruned: {unpruned}")
        for keep in keeps:
            n_keep = experts_to_keep(margs.num_experts, margs.num_experts_per_token, keep=keep)
            rows: Dict[str, Dict[str, float]] = {}
            runs = [(name, m, g, 0) for name, m, g in CANDIDATES]
            runs += [(f"random-{s}", "random", "softmax", s) for s in range(args.random_seeds)]
            for name, method, gate, seed in runs:
                sel = select(result.stats, method, n_keep, seed=seed, gate=gate)
                folder = f"k{n_keep}-{name.replace(' ', '_').replace('(', '').replace(')', '')}"
                with AtomicOutput(tmp / folder) as ao:
                    path = save(ao, src, result, calib, sel, log=lambda s: None)
                rows[name] = score(path)
                rows[name]["traffic"] = traffic_kept(result.stats, sel.kept)
                log(f"keep {n_keep}: {name}: {rows[name]}")
            out["keeps"][str(keep)] = {"n_keep": n_keep, "rows": rows}
        out["unpruned"] = unpruned
        out["ranks"] = mean_ranks(out["keeps"], domains)
        if not args.no_quant:
            out["quant"] = quant_rows(src, tmp, score, log)
            out["decode"] = decode_compare(tmp, log)

    print(prune_table(out, domains, args, margs.num_experts, calib))
    print()
    print(gate_diagnostic(result.stats, margs.num_experts_per_token))
    if out["quant"]:
        print()
        print(quant_table(out["quant"], domains))
        print()
        print(decode_table(out["decode"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def mean_ranks(keeps: Dict, domains: Sequence[str]) -> Dict[str, float]:
    """Mean rank (1 = lowest perplexity) of each candidate method over every (keep,
    domain) cell; random (its mean over seeds) is ranked alongside as the floor."""
    ranks: Dict[str, List[int]] = {}
    for cell in keeps.values():
        rows = cell["rows"]
        seeds = [k for k in rows if k.startswith("random-")]
        for d in domains:
            vals = {name: rows[name][d] for name, _, _ in CANDIDATES}
            if seeds:
                vals["random (mean)"] = float(np.mean([rows[s][d] for s in seeds]))
            for r, name in enumerate(sorted(vals, key=vals.get), 1):
                ranks.setdefault(name, []).append(r)
    return {k: float(np.mean(v)) for k, v in sorted(ranks.items(), key=lambda kv: np.mean(kv[1]))}


def quant_rows(src: Path, tmp: Path, score, log) -> List[Dict]:
    """Perplexity and safetensors size of the unpruned model under each quantization."""
    specs: List[Tuple[str, Optional[QuantSpec]]] = [
        ("BF16 trunk, MXFP4 experts (source)", None),
        ("q8 trunk (group 64)", QuantSpec(8, 64)), ("q6 trunk (group 64)", QuantSpec(6, 64)),
        ("q4 trunk (group 64)", QuantSpec(4, 64)),
        ("3-bit experts (group 32)", QuantSpec(None, 64, 3, 32)),
        ("2-bit experts (group 32)", QuantSpec(None, 64, 2, 32)),
    ]
    rows = []
    for name, spec in specs:
        path = src if spec is None else tmp / f"quant-{len(rows)}"
        if spec is not None:
            convert(src, path, spec, progress=False, log=lambda s: None)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        rows.append({"name": name, "bytes": size, **score(path)})
        log(f"{name}: {rows[-1]}")
    return rows


def decode_compare(tmp: Path, log, prompt_len: int = 64, decode_steps: int = 32,
                   repeats: int = 3) -> Dict:
    """Decode tokens/s and peak memory of the `make bench` config with a BF16 vs a q4
    trunk (same process, interleaved, best of `repeats`), and the bytes one decode step
    reads (`cluster.layer_bytes`: weights but unpicked experts, plus the caches)."""
    from kimi_mlx.bench.model import bench_text_config, peak_memory, run_once
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.testing.checkpoints import build_checkpoint

    bf16 = build_checkpoint(tmp / "bench-bf16", text_config=bench_text_config(), seed=0)
    q4 = tmp / "bench-q4"
    convert(bf16, q4, QuantSpec(4, 64), progress=False, log=lambda s: None)
    tokens = mx.random.randint(0, 256, (1, prompt_len), key=mx.random.key(0))
    paths = {"BF16 trunk": bf16, "q4 trunk": q4}
    res = {n: {"peak_bytes": peak_memory(lambda p=p: load_model(p, verbose=False)[0], tokens,
                                         decode_steps), "decode_tps": 0.0} for n, p in paths.items()}
    models = {n: load_model(p, verbose=False)[0] for n, p in paths.items()}
    for m in models.values():
        run_once(m, tokens[:, :8], 2)
    for _ in range(repeats):
        for n, m in models.items():
            _, dec = run_once(m, tokens, decode_steps)
            res[n]["decode_tps"] = max(res[n]["decode_tps"], decode_steps / dec)
    for n, p in paths.items():
        mb = model_bytes(str(p))
        ctx = prompt_len + decode_steps
        res[n]["read_bytes"] = (mb.embed_read_bytes() + mb.head_bytes
                                + sum(l.read_bytes(ctx) for l in mb.layers))
        res[n]["file_bytes"] = mb.file_bytes
        log(f"decode {n}: {res[n]}")
    res["device"] = str(mx.default_device())
    return res


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


def prune_table(out: Dict, domains, args, num_experts: int, calib: CalibSet) -> str:
    lines = [f"Held-out perplexity after pruning (calibration: {args.domain}, "
             f"{calib.num_tokens:,} tokens; windows of {args.seq_len}; "
             f"{args.eval_tokens:,} held-out tokens per domain)", ""]
    head = "| model | " + " | ".join(
        f"keep {c['n_keep']}/{num_experts}: {d} ppl" for c in out["keeps"].values() for d in domains)
    head += " | " + " | ".join(f"keep {c['n_keep']}: {args.domain} routing kept"
                               for c in out["keeps"].values()) + " |"
    cells = len(domains) * len(out["keeps"]) + len(out["keeps"])
    lines += [head, "|---|" + "---:|" * cells]
    lines.append("| unpruned | " + " | ".join(f"{out['unpruned'][d]:.2f}" for _ in out["keeps"]
                                               for d in domains)
                 + " | " + " | ".join("100%" for _ in out["keeps"]) + " |")
    for name, _, _ in CANDIDATES:
        vals = [f"{c['rows'][name][d]:.2f}" for c in out["keeps"].values() for d in domains]
        kept = [f"{100 * c['rows'][name]['traffic']:.1f}%" for c in out["keeps"].values()]
        lines.append(f"| {name} | " + " | ".join(vals + kept) + " |")
    vals, kept = [], []
    for c in out["keeps"].values():
        seeds = [k for k in c["rows"] if k.startswith("random-")]
        for d in domains:
            v = [c["rows"][s][d] for s in seeds]
            vals.append(f"{np.mean(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
        kept.append(f"{100 * np.mean([c['rows'][s]['traffic'] for s in seeds]):.1f}%" if seeds else "-")
    lines.append(f"| random (mean, range of {args.random_seeds} seeds) | " + " | ".join(vals + kept) + " |")
    lines += ["", "Mean rank over both domains and keeps (1 = best): "
              + ", ".join(f"{k} {v:.2f}" for k, v in out["ranks"].items())]
    return "\n".join(lines)


def quant_table(rows: List[Dict], domains) -> str:
    base = rows[0]
    lines = ["Quantization of the unpruned model (kimi-mlx convert): held-out perplexity and "
             "safetensors size", "",
             "| build | " + " | ".join(f"{d} ppl" for d in domains) + " | vs BF16 | size MB |",
             "|---|" + "---:|" * (len(domains) + 2)]
    for r in rows:
        delta = ", ".join(f"{100 * (r[d] / base[d] - 1):+.1f}%" for d in domains)
        lines.append(f"| {r['name']} | " + " | ".join(f"{r[d]:.2f}" for d in domains)
                     + f" | {delta} | {r['bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def decode_table(res: Dict) -> str:
    a, b = res["BF16 trunk"], res["q4 trunk"]
    lines = [f"Decode on the `make bench` config, BF16 vs q4 trunk (same process, device "
             f"{res['device']})", "",
             "| trunk | decode tok/s | peak MB | read per token MB | files MB |",
             "|---|---:|---:|---:|---:|"]
    for n in ("BF16 trunk", "q4 trunk"):
        r = res[n]
        lines.append(f"| {n} | {r['decode_tps']:.1f} | {r['peak_bytes'] / 1e6:.1f} | "
                     f"{r['read_bytes'] / 1e6:.1f} | {r['file_bytes'] / 1e6:.1f} |")
    lines.append(f"| ratio q4/BF16 | {b['decode_tps'] / a['decode_tps']:.2f}x | "
                 f"{b['peak_bytes'] / a['peak_bytes']:.2f}x | {b['read_bytes'] / a['read_bytes']:.2f}x"
                 f" | {b['file_bytes'] / a['file_bytes']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
