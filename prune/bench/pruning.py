"""`make bench-prune`: held-out perplexity after pruning, per saliency method, per domain,
on a model whose experts specialise; and (`--quant`, `make bench-quant`) quantization.

Default run: the micro-moe test bed (`kimi_mlx/assets/micro-moe`, three domains: code,
prose, structured data; see its card). Calibrated twice, streamed (`observe`): on one
domain (`--domain`, code) and on a mix of every domain with the same token budget. Each
calibration prunes to 50% and 25% of the routed experts with every method (REAP with the
softmax gate and with the model's gate, REAP summed, frequency, EAN; the methods beyond
uniform REAP in `BEYOND`: the `spread` budget with reap-sum and with reap, and reap-sum
with super-expert protection, reap-sum with its router rows re-fitted (`--refit-router`),
uniform and spread; random over `--random-seeds` seeds, which needs no calibration and is
shared by both), each written as a real checkpoint (the writer of
`kimi-mlx prune`), loaded back and scored on the held-out text of every domain. "Routing
kept" is the share of a domain's held-out routing mass (unpruned model) that went to the
kept experts. The tables end with the checks the pruner's default must pass (beat
random's seed range on the calibration domain at both keeps, and on the mean over
domains with the mixed calibration) and the beyond-REAP methods against uniform reap-sum
at the smallest keep.

`--quant` adds quantization of the unpruned `--quant-model` (micro; `kimi-mlx convert`):
BF16 trunk vs q8 / q6 / q4 (group 64), and MXFP4 experts vs 3-bit / 2-bit: held-out
perplexity and file size; and decode tokens/s, peak memory and bytes read per token of a
q4 vs BF16 trunk on the `make bench` model config, measured in the same process.

    python -m kimi_mlx.prune.bench.pruning [--model DIR] [--keep 0.5 --keep 0.25] [--quant]
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from kimi_mlx.prune.pipeline import convert, refit, save
from kimi_mlx.prune.refit import DEFAULT_TOKENS as REFIT_TOKENS
from kimi_mlx.prune.quantize import QuantSpec
from kimi_mlx.prune.saliency import experts_to_keep, select
from kimi_mlx.prune.writer import AtomicOutput, source_args

# Assets live in the kimi_mlx package (prune/ is mapped to kimi_mlx.prune).
MICRO = Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro"
MICRO_MOE = MICRO.parent / "micro-moe"
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


# (row name, method, gate, budget, protect, refit) of the methods beyond uniform REAP, run
# beside CANDIDATES with the same total expert count (refit: `prune --refit-router`).
BEYOND = [("reap-sum, spread budget", "reap-sum", "softmax", "spread", False, False),
          ("reap, spread budget", "reap", "softmax", "spread", False, False),
          ("reap-sum, super experts protected", "reap-sum", "softmax", "uniform", True, False),
          ("reap-sum, router refit", "reap-sum", "softmax", "uniform", False, True),
          ("reap-sum, spread budget + router refit", "reap-sum", "softmax", "spread", False, True)]


def model_domains(model_dir: Path) -> List[str]:
    """Domains with a held-out file in the model folder (`heldout/<domain>.txt`), in a
    fixed order (code, prose, data first)."""
    found = sorted(p.stem for p in (Path(model_dir) / "heldout").glob("*.txt"))
    order = ["code", "prose", "data"]
    return [d for d in order if d in found] + [d for d in found if d not in order]


def trained_seq_len(model_dir: Path, seq_len: Optional[int] = None, default: int = 256) -> int:
    """`seq_len` when given, else the window length the micro model was trained with
    (its eval.json's training.seq_len), else `default` (a folder without that record)."""
    if seq_len is not None:
        return seq_len
    try:
        return int(json.loads((Path(model_dir) / "eval.json").read_text())["training"]["seq_len"])
    except (OSError, KeyError, ValueError):
        return default


def routing_kept(share: Dict[str, np.ndarray], kept: Dict[int, List[int]]) -> Dict[str, float]:
    """{domain: share of the domain's held-out routing mass (unpruned model,
    `expert_usage`, [moe layers, E]) that the kept experts carry, mean over layers}."""
    layers = sorted(kept)
    return {d: float(np.mean([s[r, kept[l]].sum() for r, l in enumerate(layers)]))
            for d, s in share.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.prune.bench.pruning", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MICRO_MOE),
                   help="source checkpoint (default: the micro-moe test bed)")
    p.add_argument("--keep", type=float, action="append", default=None,
                   help="fraction of experts kept, repeatable (default 0.5 and 0.25)")
    p.add_argument("--domain", default="code", help="calibration domain (default code)")
    p.add_argument("--domains", default=None,
                   help="held-out domains, comma-separated (default: every heldout/<domain>.txt "
                        "in the model folder)")
    p.add_argument("--no-mix", action="store_true",
                   help="skip the second calibration on a mix of every domain")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=None,
                   help="calibration and scoring window (default: the model's training length "
                        "from eval.json, else 256)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens scored per domain")
    p.add_argument("--random-seeds", type=int, default=3)
    p.add_argument("--no-prune", action="store_true", help="skip the pruning tables")
    p.add_argument("--quant", action="store_true",
                   help="also the quantization tables (on --quant-model, default micro)")
    p.add_argument("--quant-model", default=str(MICRO))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    keeps = args.keep or [0.5, 0.25]
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out: Dict = {"calibrations": {}, "quant": None, "decode": None}
    if not args.no_prune:
        src = Path(args.model)
        if not (src / "config.json").exists():
            print(f"error: {src}: no checkpoint (the test bed ships in kimi_mlx/assets/micro-moe; "
                  "build it with `make micro-moe`)", file=sys.stderr)
            return 2
        out.update(prune_bench(src, args, keeps, log))
        print(prune_tables(out, args))
        print(readme_tables(out))
    if args.quant:
        with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
            qsrc = Path(args.quant_model)
            tok = _tokenizer(qsrc)()
            from kimi_mlx.generation.evaluate import read_tokens

            qdomains = model_domains(qsrc)
            ids = {d: read_tokens(tok, qsrc / "heldout" / f"{d}.txt", 8192) for d in qdomains}
            score = lambda path: {d: perplexity(path, ids[d], 256) for d in qdomains}
            out["quant"] = quant_rows(qsrc, Path(tmp), score, log)
            out["decode"] = decode_compare(Path(tmp), log)
        print()
        print(quant_table(out["quant"], qdomains))
        print()
        print(decode_table(out["decode"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def prune_bench(src: Path, args, keeps: Sequence[float], log) -> Dict:
    """Calibrate on `args.domain` and on a mix, prune with every method at every keep,
    score every build on every domain's held-out text (see the module docstring)."""
    from kimi_mlx.generation.evaluate import expert_usage, read_tokens
    from kimi_mlx.checkpoint.loader import load_model

    _, margs, _ = source_args(src)
    seq_len = trained_seq_len(src, args.seq_len)
    domains = ([d.strip() for d in args.domains.split(",")] if args.domains
               else model_domains(src))
    tok = _tokenizer(src)()
    eval_ids = {}
    for d in domains:
        f = find_data(src, "heldout", d)
        if f is None:
            raise SystemExit(f"error: {src}: no held-out file for domain {d!r}")
        eval_ids[d] = read_tokens(tok, f, args.eval_tokens)
    model, _, _ = load_model(src, verbose=False)
    share = {d: expert_usage(model, eval_ids[d], seq_len) for d in domains}
    del model
    score = lambda path: {d: perplexity(path, eval_ids[d], seq_len) for d in domains}
    res: Dict = {"seq_len": seq_len, "domains": domains, "eval_tokens": args.eval_tokens,
                 "num_experts": margs.num_experts, "calibrations": {}}
    res["unpruned"] = score(src)
    log(f"model {src}: {margs.num_experts} experts top-{margs.num_experts_per_token}; "
        f"unpruned {res['unpruned']}")
    calib_files = {d: find_data(src, "calib", d) for d in domains}
    one = load_calibration([calib_files[args.domain]], _tokenizer(src), seq_len=seq_len,
                           max_tokens=args.calib_tokens)
    calibs = [(args.domain, one)]
    if not args.no_mix:
        mix = load_calibration([calib_files[d] for d in domains], _tokenizer(src), seq_len=seq_len,
                               max_tokens=one.num_tokens)
        calibs.append(("mix", mix))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-prune-") as tmp:
        tmp = Path(tmp)
        random_rows: Dict[str, Dict] = {}
        for cname, calib in calibs:
            result = observe(src, calib, chunk=seq_len, progress=False,
                             router_inputs=REFIT_TOKENS)
            log(f"calibration {cname}: {calib.describe()} in {result.seconds:.1f} s")
            cell: Dict = {"describe": calib.describe(), "tokens": calib.num_tokens, "keeps": {}}
            for keep in keeps:
                n_keep = experts_to_keep(margs.num_experts, margs.num_experts_per_token, keep=keep)
                rows: Dict[str, Dict] = {}
                runs = [(name, m, g, "uniform", False, False, 0) for name, m, g in CANDIDATES]
                runs += [(name, m, g, b, pr, rf, 0) for name, m, g, b, pr, rf in BEYOND]
                seeds = [(f"random-{s}", "random", "softmax", "uniform", False, False, s)
                         for s in range(args.random_seeds)]
                for name, method, gate, budget, protect, refit_on, seed in runs + seeds:
                    key = f"{keep}/{name}"
                    if method == "random" and key in random_rows:  # needs no calibration
                        rows[name] = random_rows[key]
                        continue
                    sel = select(result.stats, method, n_keep, seed=seed, gate=gate,
                                 budget=budget, protect_super_experts=protect)
                    folder = f"{cname}-k{n_keep}-" + "".join(c if c.isalnum() else "_" for c in name)
                    refitted = (refit(result, sel, margs.num_experts_per_token)
                                if refit_on else None)
                    with AtomicOutput(tmp / folder) as ao:
                        path = save(ao, src, result, calib, sel, log=lambda s: None,
                                    refitted=refitted)
                    rows[name] = {"ppl": score(path), "routing_kept": routing_kept(share, sel.kept),
                                  "traffic": traffic_kept(result.stats, sel.kept),
                                  "counts": sel.counts}
                    if refitted:
                        rows[name]["gate_kl"] = [float(np.mean([r.kl_before for r in refitted.values()])),
                                                 float(np.mean([r.kl_after for r in refitted.values()]))]
                        rows[name]["gate_tv"] = [float(np.mean([r.tv_before for r in refitted.values()])),
                                                 float(np.mean([r.tv_after for r in refitted.values()]))]
                    shutil.rmtree(path, ignore_errors=True)
                    if method == "random":
                        random_rows[key] = rows[name]
                    log(f"[{time.perf_counter() - t_start:.0f} s] {cname} keep {n_keep}: {name}: "
                        + ", ".join(f"{d} {v:.2f}" for d, v in rows[name]["ppl"].items())
                        + ("" if sel.uniform else f" budgets {list(sel.counts.values())}")
                        + (f" gate KL {rows[name]['gate_kl'][0]:.3f}->{rows[name]['gate_kl'][1]:.3f}"
                           if refitted else ""))
                cell["keeps"][str(keep)] = {"n_keep": n_keep, "rows": rows}
            res["calibrations"][cname] = cell
    return res


def _random_stats(rows: Dict, key) -> Tuple[float, float, float]:
    vals = [key(rows[k]) for k in rows if k.startswith("random-")]
    return float(np.mean(vals)), float(min(vals)), float(max(vals))


def method_names() -> List[str]:
    return [n for n, _, _ in CANDIDATES] + [n for n, *_ in BEYOND]


def mean_ranks(keeps: Dict, domains: Sequence[str]) -> Dict[str, float]:
    """Mean rank (1 = lowest perplexity) of each method over every (cell, domain): `keeps`
    is {cell name: {"rows": {method: {domain: ppl} or {"ppl": {domain: ppl}}}}}; random
    (its mean over the `random-<seed>` rows) is ranked alongside as the floor."""
    ppl = lambda row, d: row["ppl"][d] if "ppl" in row else row[d]
    ranks: Dict[str, List[int]] = {}
    for cell in keeps.values():
        rows = cell["rows"]
        seeds = [k for k in rows if k.startswith("random-")]
        for d in domains:
            vals = {name: ppl(rows[name], d) for name in method_names() if name in rows}
            if seeds:
                vals["random (mean)"] = float(np.mean([ppl(rows[s], d) for s in seeds]))
            for r, name in enumerate(sorted(vals, key=vals.get), 1):
                ranks.setdefault(name, []).append(r)
    return {k: float(np.mean(v)) for k, v in sorted(ranks.items(), key=lambda kv: np.mean(kv[1]))}


def prune_tables(res: Dict, args) -> str:
    """Markdown: one table per (calibration, keep) with every method's held-out perplexity
    per domain, their geometric mean, and the routing kept per domain; then the checks."""
    from kimi_mlx.prune.saliency import DEFAULT_BUDGET, DEFAULT_GATE, DEFAULT_METHOD

    domains = res["domains"]
    gmean = lambda ppl: float(np.exp(np.mean([np.log(ppl[d]) for d in domains])))
    lines = [f"Held-out perplexity after pruning ({res['num_experts']} experts per layer; windows "
             f"of {res['seq_len']}; {res['eval_tokens']:,} held-out tokens per domain; routing "
             "kept = share of the domain's held-out routing mass, unpruned model, on kept experts)"]
    for cname, cal in res["calibrations"].items():
        for keep, cell in cal["keeps"].items():
            rows = cell["rows"]
            lines += ["", f"Calibration {cname} ({cal['describe']}), keep {cell['n_keep']}/"
                      f"{res['num_experts']} per layer on average:", "",
                      "| method | " + " | ".join(f"{d} ppl" for d in domains) + " | mean ppl | "
                      + " | ".join(f"{d} routing kept" for d in domains) + " |",
                      "|---|" + "---:|" * (2 * len(domains) + 1)]
            lines.append("| unpruned | " + " | ".join(f"{res['unpruned'][d]:.2f}" for d in domains)
                         + f" | {gmean(res['unpruned']):.2f} | " + " | ".join("100%" for _ in domains) + " |")
            for name in method_names():
                r = rows[name]
                lines.append(f"| {name} | " + " | ".join(f"{r['ppl'][d]:.2f}" for d in domains)
                             + f" | {gmean(r['ppl']):.2f} | "
                             + " | ".join(f"{100 * r['routing_kept'][d]:.1f}%" for d in domains) + " |")
            cells = []
            for d in domains:
                m, lo, hi = _random_stats(rows, lambda r: r["ppl"][d])
                cells.append(f"{m:.2f} ({lo:.2f}-{hi:.2f})")
            m, lo, hi = _random_stats(rows, lambda r: gmean(r["ppl"]))
            cells.append(f"{m:.2f} ({lo:.2f}-{hi:.2f})")
            cells += [f"{100 * _random_stats(rows, lambda r: r['routing_kept'][d])[0]:.1f}%" for d in domains]
            lines.append(f"| random (mean, range of {args.random_seeds} seeds) | " + " | ".join(cells) + " |")
            spread = [n for n in method_names() if rows[n]["counts"]
                      and len(set(rows[n]["counts"].values())) > 1]
            for n in spread:
                lines.append(f"\n{n}: experts per layer " + ", ".join(
                    f"{l}: {c}" for l, c in rows[n]["counts"].items()))
    ranks = mean_ranks({f"{c}/{k}": cell for c, cal in res["calibrations"].items()
                        for k, cell in cal["keeps"].items()}, domains)
    lines += ["", "Mean rank over every (calibration, keep, domain) cell (1 = best): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ranks.items())]
    default = next(n for n, m, g in CANDIDATES if m == DEFAULT_METHOD and g == DEFAULT_GATE)
    if DEFAULT_BUDGET != "uniform":
        default = next(n for n, m, g, b, _, rf in BEYOND
                       if m == DEFAULT_METHOD and b == DEFAULT_BUDGET and not rf)
    lines += ["", f"Checks for the default ({default}):"]
    cal = res["calibrations"].get(args.domain)
    for keep, cell in (cal or {"keeps": {}})["keeps"].items():
        rows = cell["rows"]
        v = rows[default]["ppl"][args.domain]
        _, lo, _ = _random_stats(rows, lambda r: r["ppl"][args.domain])
        lines.append(f"- calibration {args.domain}, keep {cell['n_keep']}: {args.domain} ppl {v:.2f} vs "
                     f"random's best seed {lo:.2f}: " + ("beats" if v < lo else "does NOT beat")
                     + " random's range")
    for keep, cell in res["calibrations"].get("mix", {"keeps": {}})["keeps"].items():
        rows = cell["rows"]
        v = gmean(rows[default]["ppl"])
        _, lo, _ = _random_stats(rows, lambda r: gmean(r["ppl"]))
        lines.append(f"- calibration mix, keep {cell['n_keep']}: mean ppl over domains {v:.2f} vs "
                     f"random's best seed {lo:.2f}: " + ("beats" if v < lo else "does NOT beat")
                     + " random's range")
    lines += ["", "Beyond uniform REAP at the smallest keep (vs reap-sum, uniform): per-domain ppl"]
    for cname, cal in res["calibrations"].items():
        cell = cal["keeps"][str(min(float(k) for k in cal["keeps"]))]
        base = cell["rows"][default if DEFAULT_BUDGET == "uniform" else "reap-sum (softmax gate)"]
        for name, *_ in BEYOND:
            r = cell["rows"][name]
            wins = [d for d in domains if r["ppl"][d] < base["ppl"][d]]
            lines.append(f"- calibration {cname}, {name}: " + ", ".join(
                f"{d} {r['ppl'][d]:.2f} vs {base['ppl'][d]:.2f}" for d in domains)
                + f"; better on {len(wins)} of {len(domains)} domains"
                + (f" (gate KL to the full router {r['gate_kl'][0]:.3f} -> {r['gate_kl'][1]:.3f}, "
                   f"TV {r['gate_tv'][0]:.3f} -> {r['gate_tv'][1]:.3f})" if "gate_kl" in r else ""))
    return "\n".join(lines)


def readme_tables(res: Dict) -> str:
    """The README's form of the pruning results: per calibration, one table with every
    method's held-out perplexity per domain at each keep, and the routing kept at the
    smallest keep (random: mean and range over the seeds)."""
    domains = res["domains"]
    out = []
    for cname, cal in res["calibrations"].items():
        keeps = sorted(cal["keeps"].items(), key=lambda kv: -float(kv[0]))
        small = keeps[-1][1]
        out += ["", f"**calibrated on {cname}** ({cal['tokens']:,} tokens; perplexity on held-out "
                "text):", "",
                "| method | " + " | ".join(f"keep {c['n_keep']}: {d}" for _, c in keeps for d in domains)
                + f" | keep {small['n_keep']}: " + " / ".join(domains) + " routing kept |",
                "|---|" + "---:|" * (len(keeps) * len(domains) + 1)]
        out.append("| unpruned | " + " | ".join(f"{res['unpruned'][d]:.1f}" for _ in keeps
                                                 for d in domains) + " | 100% |")
        for name in method_names():
            counts = small["rows"][name]["counts"]
            label = name + ("" if len(set(counts.values())) <= 1 else
                            " (" + ", ".join(str(v) for v in counts.values()) + f" per layer at keep {small['n_keep']})")
            out.append(f"| {label} | " + " | ".join(f"{c['rows'][name]['ppl'][d]:.1f}" for _, c in keeps
                                                   for d in domains) + " | "
                       + " / ".join(f"{100 * small['rows'][name]['routing_kept'][d]:.0f}%" for d in domains) + " |")
        cells = []
        for _, c in keeps:
            for d in domains:
                m, lo, hi = _random_stats(c["rows"], lambda r: r["ppl"][d])
                cells.append(f"{m:.1f} ({lo:.1f}-{hi:.1f})")
        out.append(f"| random (mean, range of {sum(k.startswith('random-') for k in small['rows'])} seeds) | "
                   + " | ".join(cells) + " | " + " / ".join(
                       f"{100 * _random_stats(small['rows'], lambda r: r['routing_kept'][d])[0]:.0f}%"
                       for d in domains) + " |")
    return "\n".join(out)


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
    reads (`placement.layer_bytes`: weights but unpicked experts, plus the caches)."""
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
