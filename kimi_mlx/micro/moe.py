"""`make micro-moe`: the pruning test bed, a micro-sized MoE checkpoint whose experts specialise.

Same trainer, architecture and export as `make micro` (`kimi_mlx.micro.train`, run with
other defaults, nothing copied), with three differences that make the routed experts
specialise by domain, so that a pruning criterion has something to find:

* three domains (`kimi_mlx.micro.corpus.ALL_DOMAINS`): stdlib code, documentation prose
  and structured data (JSON / CSV records from `unicodedata` and stdlib tables); each
  batch row is one domain, rows cycle over the three;
* no load balancing: the correction-bias step is 0 (micro uses 0.001), so the router is
  free to send each domain to its own experts;
* a specialisation bonus on the router (`--router-mi`, `train.sequence_expert_mi`): the
  loss subtracts 0.2 x the mutual information between a batch row and the expert its
  tokens route to (softmax of the router logits at temperature 0.1), i.e. it rewards each
  sequence for using few experts and the batch for spreading over all of them. No domain
  label is used; rows are single-domain, so experts specialise by domain while the
  overall load stays spread (no collapse onto a handful);
* 400 steps (200 without the bonus reached only 61-79 % for the best half);
* nothing learned by heart (micro's LICENSE.txt rows are off).

The card (`kimi_mlx/assets/micro-moe/MODEL_CARD.md`, figures in `eval.json`) states, per
domain and MoE layer, the share of the domain's routing mass carried by its best half of
the experts and by random halves (`specialisation`).

Run: `python -m kimi_mlx.micro.moe [--steps N] [--out DIR]` (every option of
`kimi_mlx.micro.train`); `python -m kimi_mlx.micro.moe --recard [DIR]` rewrites the card
(and the derived figures in eval.json) from eval.json without training.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from kimi_mlx.micro.corpus import ALL_DOMAINS

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "micro-moe"
DEFAULTS: Dict[str, Any] = {
    "out": ASSET_DIR,
    "domains": ",".join(ALL_DOMAINS),
    "steps": 400,
    "batch": 6,
    "seq_len": 128,
    "warmup": 20,
    "tokenizer_from": Path(__file__).resolve().parent.parent / "assets" / "micro",
    "bias_step": 0.0,
    "router_mi": 0.2,
    "router_mi_temperature": 0.1,
    "memorize_rate": 0.0,
    "eval_tokens": 8192,
    "heldout_bytes": 60_000,
    "calib_bytes": 32_000,
}
RANDOM_HALVES = 3  # seeds of the random-half figure in the card


def specialisation(share: np.ndarray, seeds: int = RANDOM_HALVES) -> Dict[str, Any]:
    """How concentrated one domain's routing is, per MoE layer.

    Args:
        share: [moe layers, E] float, each row the domain's routing mass per expert
            (sums to 1; `kimi_mlx.generation.evaluate.expert_usage`).
        seeds: random halves drawn (seeds 0..seeds-1, one draw per layer).
    Returns:
        {"best_half": [layers] share carried by the E // 2 experts with the most mass,
         "random_half": [layers] mean over the seeds of the share of a random E // 2,
         "random_half_range": [layers] [min, max] over the seeds}.
    """
    share = np.asarray(share, dtype=np.float64)
    L, E = share.shape
    half = E // 2
    best = np.sort(share, axis=1)[:, ::-1][:, :half].sum(axis=1)
    rnd = np.array([[share[l, np.random.default_rng([s, l]).permutation(E)[:half]].sum()
                     for l in range(L)] for s in range(seeds)])  # [seeds, L]
    return {"best_half": best.tolist(), "random_half": rnd.mean(axis=0).tolist(),
            "random_half_range": [[float(a), float(b)] for a, b in zip(rnd.min(0), rnd.max(0))]}


def domain_structure(share: Dict[str, Sequence]) -> Dict[str, Any]:
    """Specialisation versus collapse, per MoE layer, from each domain's expert shares.

    Args:
        share: {domain: [moe layers, E] routing mass per expert, rows summing to 1}.
    Returns:
        {"best_half_overlap": {"a-b": [layers] |best half of a ∩ best half of b| / (E/2)}
         (about 0.5 for unrelated random halves, 1.0 if the domains use the same experts),
         "pooled_effective_experts": [layers] exp(entropy) of the mean share over domains
         (E when every expert carries the same; a handful when routing collapsed),
         "pooled_top4": [layers] share of the pooled routing on its 4 busiest experts,
         "pooled_unused": [layers] experts with < 0.1 % of the pooled routing,
         "effective_experts": {domain: [layers] exp(entropy) of that domain's share}}.
    """
    doms = list(share)
    arr = {d: np.asarray(share[d], dtype=np.float64) for d in doms}
    L, E = arr[doms[0]].shape
    half = E // 2
    best = {d: [set(np.argsort(-arr[d][l], kind="stable")[:half].tolist()) for l in range(L)]
            for d in doms}
    overlap = {f"{a}-{b}": [len(best[a][l] & best[b][l]) / half for l in range(L)]
               for i, a in enumerate(doms) for b in doms[i + 1:]}
    ent = lambda p: float(np.exp(-(p[p > 0] * np.log(p[p > 0])).sum()))  # noqa: E731
    pooled = np.mean([arr[d] for d in doms], axis=0)
    return {"best_half_overlap": overlap,
            "pooled_effective_experts": [ent(pooled[l]) for l in range(L)],
            "pooled_top4": [float(np.sort(pooled[l])[::-1][:4].sum()) for l in range(L)],
            "pooled_unused": [int((pooled[l] < 1e-3).sum()) for l in range(L)],
            "effective_experts": {d: [ent(arr[d][l]) for l in range(L)] for d in doms}}


def evaluate(trained, ckpt: Path, args, seq_len: int, log=print,
             max_tokens: Optional[int] = None) -> Dict:
    """Held-out perplexity per domain (BF16 weights and the shipped MXFP4 checkpoint) and
    routing specialisation per domain and layer (shipped checkpoint): eval.json's figures."""
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.generation.evaluate import expert_usage, perplexity, read_tokens
    from kimi_mlx.micro.evaluation import inference_copy, measure
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(ckpt)
    domains = sorted(p.stem for p in (ckpt / "heldout").glob("*.txt"))
    domains = [d for d in ALL_DOMAINS if d in domains]
    ids = {d: read_tokens(tok, ckpt / "heldout" / f"{d}.txt", max_tokens) for d in domains}
    res: Dict[str, Any] = {"uniform": args.vocab_size, "seq_len": seq_len, "domains": domains,
                           "heldout_tokens": {d: len(ids[d]) for d in domains}}
    trained.eval()
    res["bf16"] = measure(inference_copy(trained, args), ids, seq_len)
    log(f"bf16 {res['bf16']}")
    shipped, _, _ = load_model(ckpt, verbose=False)
    res["mxfp4"] = measure(shipped, ids, seq_len)
    log(f"mxfp4 {res['mxfp4']}")
    res["tokens_per_second"] = perplexity(shipped, ids[domains[0]][:2049], seq_len).tokens_per_second
    usage = {d: expert_usage(shipped, ids[d], seq_len) for d in domains}
    res["share"] = {d: usage[d].tolist() for d in domains}
    res["specialisation"] = {d: specialisation(usage[d]) for d in domains}
    tv = {}
    for i, a in enumerate(domains):
        for b in domains[i + 1 :]:
            tv[f"{a}-{b}"] = (0.5 * np.abs(usage[a] - usage[b]).sum(axis=1)).tolist()
    res["tv_between_domains"] = tv
    res["structure"] = domain_structure(res["share"])
    for d in domains:
        sp = res["specialisation"][d]
        log(f"{d}: best half {np.round(sp['best_half'], 3)} random half {np.round(sp['random_half'], 3)}")
    return res


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def model_card(info: Dict) -> str:
    """MODEL_CARD.md of the test bed from the run's figures (`info` as in eval.json)."""
    ev, c, t = info["eval"], info["corpus"], info["training"]
    text = info["text_config"]
    domains: List[str] = ev["domains"]
    cs = c["stats"]
    moe_layers = [i for i in range(text["num_hidden_layers"]) if i >= text["first_k_dense_replace"]]
    sources = {
        "code": ("stdlib `.py` sources (no tests, no `encodings/`, files <= 100 kB), held out by file",
                 "PSF License 2.0 (CPython)"),
        "prose": ("`pydoc_data/topics.py` documentation, `LICENSE.txt`, IDLE texts, "
                  "`email/architecture.rst`, held out by paragraph block", "PSF License 2.0 (CPython)"),
        "data": ("records generated from `unicodedata` (Unicode Character Database "
                 f"{info.get('unicode_version', '')}: name, category, bidi, decimal, width, "
                 "decomposition of each code point with its own name) and stdlib tables "
                 "(`http.HTTPStatus`, `mimetypes.types_map`, `locale.locale_alias`, "
                 "`encodings.aliases`, `keyword.kwlist`), 48 records a block as JSON lines, "
                 "a JSON array or CSV, held out by block",
                 "Unicode License v3 (UCD data); PSF License 2.0 (stdlib tables)"),
    }
    lines = [
        "# kimi-mlx micro-moe: a pruning test bed whose experts specialise",
        "",
        f"A {info['parameters'] / 1e6:.1f}M-parameter model of the Kimi K3.1 architecture (the "
        "shipped `micro` model's architecture and trainer), trained from scratch on the CPU by "
        "`make micro-moe` (`python -m kimi_mlx.micro.moe`) on three clearly different domains "
        "with the router's load balancing switched off, so that its routed experts specialise "
        "by domain. It exists to judge expert-pruning methods (`make bench-prune`): on the "
        "load-balanced `micro` model a random half of the experts carries as much routing as "
        "the best half, and no criterion can separate from chance. Not chat-tuned; a small, "
        "briefly trained model (its perplexities are high), not a language model to use.",
        "",
        "## Architecture",
        "",
        f"As `micro` (see its card): {text['num_hidden_layers']} layers (layer 0 dense, "
        f"{len(moe_layers)} latent-MoE layers), hidden {text['hidden_size']}, "
        f"{text['num_experts']} routed experts top-{text['num_experts_per_token']} + "
        f"{text['num_shared_experts']} shared, sigmoid router + correction bias, KDA and Gated "
        f"DSA attention, AttnRes; vocabulary {text['vocab_size']} ({info['tokenizer']['ranks']} "
        "BPE ranks + 256 Kimi special tokens; "
        + ("micro's tokenizer, reused" if info["tokenizer"].get("from") else "learned on this corpus")
        + "). Official file layout "
        f"(BF16 trunk, MXFP4 routed experts, 3 shards + index); {info['checkpoint_bytes'] / 1e6:.2f} MB.",
        "",
        "## Corpus",
        "",
        f"Read from the Python {c['python_version']} standard library at build time "
        f"(`kimi_mlx/micro/corpus.py`, `build_corpus(domains=ALL_DOMAINS)`); fingerprint "
        f"`{c['fingerprint'][:16]}`. Nothing is downloaded.",
        "",
        "| domain | source | licence | train | held out |",
        "|---|---|---|---|---|",
    ]
    for d in domains:
        src, lic = sources[d]
        lines.append(f"| {d} | {src} | {lic} | {cs['train'][d]['documents']} documents, "
                     f"{cs['train'][d]['bytes'] / 1e6:.2f} MB, {c['train_tokens'][d]} tokens | "
                     f"{cs['heldout'][d]['documents']} documents, {cs['heldout'][d]['bytes'] / 1e6:.2f} MB |")
    lines += [
        "",
        "Shipped beside the weights: `heldout/<domain>.txt` (held-out split; "
        + ", ".join(f"{d} {ev['heldout_tokens'][d]} tokens scored" for d in domains)
        + ") and `calib/<domain>.txt` (from the training split, for pruning calibration).",
        "",
        "## Training",
        "",
        f"{t['steps']} AdamW steps (peak lr {t['lr']}, warm-up {t['warmup']}, cosine to 10 %, "
        f"weight decay {t['weight_decay']}, clip {t['clip']}) of {t['batch']} x {t['seq_len']} "
        f"tokens (rows cycle over {', '.join(domains)}): {t['tokens'] / 1e6:.2f}M tokens, "
        f"float32, seed {t['seed']}, {t['wall_seconds'] / 60:.1f} min of training on "
        f"{info['machine']} (shared with other jobs); `make micro-moe` took "
        f"{info['total_seconds'] / 60:.1f} min in all.",
        "",
        f"- Router: **no load balancing** (correction-bias step {t['bias_step']}; micro uses "
        "0.001), router init std {}.".format(t["router_std"]),
        *([f"- Specialisation bonus: the loss subtracts {t['router_mi']} x the mutual "
           "information between a batch row and the expert it routes to (per MoE layer, "
           f"softmax of the router logits at temperature {t.get('router_mi_temperature', 1.0)}; "
           "`kimi_mlx.micro.train.sequence_expert_mi`, the expert/task MI of Mod-Squad with the "
           "row as the task). No domain label is used: rows are single-domain, so rewarding "
           "each row for using few experts and the batch for spreading over all of them makes "
           "experts specialise by domain without collapsing."]
          if t.get("router_mi") else []),
        f"- DSA indexer: dense warm-up for {t['dense_steps']} steps, then sparse top-k (as micro).",
        f"- MXFP4 quantization-aware training of the routed experts in the last {t['qat_steps']} steps.",
        f"- Final training loss (mean of the last logged steps): {t['final_ce']:.3f} nats/token "
        f"(perplexity {math.exp(t['final_ce']):.1f}).",
        "",
        "## Held-out perplexity",
        "",
        f"Windows of {ev['seq_len']} tokens (`kimi-mlx eval --seq-len {ev['seq_len']}`); a "
        f"uniform model scores {ev['uniform']}.",
        "",
        "| weights | " + " | ".join(domains) + " |",
        "|---|" + "---:|" * len(domains),
        "| BF16 (all weights) | " + " | ".join(f"{ev['bf16'][d]:.2f}" for d in domains) + " |",
        "| shipped: BF16 + MXFP4 experts | " + " | ".join(f"{ev['mxfp4'][d]:.2f}" for d in domains) + " |",
        "",
        "## Expert specialisation",
        "",
        "Share of each domain's routing mass (router weight summed over its held-out tokens, "
        "shipped weights) carried by the half of the experts with the most mass for that "
        f"domain, against a random half (mean of {RANDOM_HALVES} seeds), per MoE layer:",
        "",
        "| domain | " + " | ".join(f"layer {l}: best / random half" for l in moe_layers) + " |",
        "|---|" + "---:|" * len(moe_layers),
    ]
    for d in domains:
        sp = ev["specialisation"][d]
        lines.append(f"| {d} | " + " | ".join(f"{_pct(b)} / {_pct(r)}" for b, r in
                                               zip(sp["best_half"], sp["random_half"])) + " |")
    n_ok = sum(b >= 0.75 for d in domains for b in ev["specialisation"][d]["best_half"])
    n_all = sum(len(ev["specialisation"][d]["best_half"]) for d in domains)
    lines += [
        "",
        f"The best half carries at least 75% in {n_ok} of {n_all} (domain, layer) cells. "
        "Total variation distance between two domains' expert shares, per layer: "
        + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in vals)
                    for k, vals in ev["tv_between_domains"].items()) + ".",
        *structure_lines(ev, moe_layers),
        *([ "", "## Pruning benchmark", "",
            "`make bench-prune` on this checkpoint (`python -m kimi_mlx.prune.bench.pruning`; "
            "calibrated on its code text and on an equal-size mix of the three domains, 9,023 "
            "tokens each; every build written by the real writer, loaded back and scored on "
            "2,048 held-out tokens per domain, windows of 128; random: mean and range over 3 "
            "seeds; routing kept = share of the domain's held-out routing mass, unpruned "
            "model, on the kept experts):", info["bench_prune_markdown"].strip("\n")]
          if info.get("bench_prune_markdown") else []),
        "",
        "## Reproduce",
        "",
        "`make micro-moe` rebuilds this folder from the same seed (same Python, MLX and "
        "machine type: same tensors). `eval.json` holds every figure of this card.",
        "",
    ]
    return "\n".join(lines)


def structure_lines(ev: Dict, moe_layers: Sequence[int]) -> List[str]:
    """Card lines: specialisation, not collapse (`domain_structure`)."""
    st = ev.get("structure") or domain_structure(ev["share"])
    f = lambda vals, fmt: " | ".join(fmt.format(v) for v in vals)  # noqa: E731
    lines = ["", "Specialisation, not collapse: how much two domains' best halves share (0.5 "
             "for unrelated random halves, 1.0 for the same experts), and how spread the "
             "routing of all domains together is (effective experts = exp(entropy) of the "
             "mean share over domains, 32 at most):", "",
             "| per MoE layer | " + " | ".join(f"layer {l}" for l in moe_layers) + " |",
             "|---|" + "---:|" * len(moe_layers)]
    for k, vals in st["best_half_overlap"].items():
        lines.append(f"| best-half overlap {k} | " + f(vals, "{:.2f}") + " |")
    lines.append("| effective experts, all domains | " + f(st["pooled_effective_experts"], "{:.1f}") + " |")
    for d, vals in st["effective_experts"].items():
        lines.append(f"| effective experts, {d} | " + f(vals, "{:.1f}") + " |")
    lines.append("| share of the 4 busiest experts, all domains | "
                 + f(st["pooled_top4"], "{:.0%}") + " |")
    lines.append("| experts with < 0.1% of all domains' routing | " + f(st["pooled_unused"], "{}") + " |")
    return lines


def recard(folder: Path = ASSET_DIR, bench: Optional[Path] = None) -> None:
    """Rewrite `folder`'s MODEL_CARD.md, and eval.json's derived `structure`, from its
    eval.json (no training, no model run); `bench`: a file with `make bench-prune`'s
    README tables (markdown) to keep in eval.json and show in the card."""
    import json

    path = Path(folder) / "eval.json"
    info = json.loads(path.read_text())
    info["eval"]["structure"] = domain_structure(info["eval"]["share"])
    if bench is not None:
        info["bench_prune_markdown"] = Path(bench).read_text()
    path.write_text(json.dumps(info, indent=1) + "\n")
    (Path(folder) / "MODEL_CARD.md").write_text(model_card(info))


def main(argv: Optional[Sequence[str]] = None) -> int:
    import unicodedata

    from kimi_mlx.micro import train

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--recard"]:  # --recard [DIR] [BENCH_TABLES.md]
        recard(Path(argv[1]) if len(argv) > 1 else ASSET_DIR,
               Path(argv[2]) if len(argv) > 2 else None)
        return 0

    cfg = train.parse_args(argv, defaults=DEFAULTS, prog="python -m kimi_mlx.micro.moe",
                           description=__doc__.splitlines()[0])

    def card(info: Dict) -> str:
        info["unicode_version"] = unicodedata.unidata_version
        return model_card(info)

    return train.main(cfg=cfg, evaluate=evaluate, card=card, tag="micro-moe")


if __name__ == "__main__":
    sys.exit(main())
