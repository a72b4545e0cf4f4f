"""`kimi-mlx prune`: REAP expert pruning, streamed layer by layer, to a checkpoint one Mac holds.

    kimi-mlx prune --model SRC --calib DATA --keep 0.2 --out DST [--method reap] [--q-bits 4]
    kimi-mlx prune --model SRC --experts 180 --q-bits 6 --dry-run
    kimi-mlx prune --model SRC --calib DATA --keep 0.25 --merge --refit-router --out DST

Exit status: 0 done, 2 bad input (the message says which file / flag and why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from kimi_mlx.prune.calib import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN, CalibError
from kimi_mlx.prune.observe import DEFAULT_CHUNK
from kimi_mlx.prune.observe import GATES
from kimi_mlx.prune.merge import DEFAULT_MIN_SIMILARITY
from kimi_mlx.prune.merge import DEFAULT_TOKENS as DEFAULT_MERGE_TOKENS
from kimi_mlx.prune.refit import DEFAULT_STEPS as DEFAULT_REFIT_STEPS
from kimi_mlx.prune.refit import DEFAULT_TOKENS as DEFAULT_REFIT_TOKENS
from kimi_mlx.prune.quantize import DEFAULT_GROUP, EXPERT_BITS, GROUP_SIZES, TRUNK_BITS, QuantError, QuantSpec
from kimi_mlx.prune.saliency import (AUTO_SPREAD_KEEP, BALANCES, BUDGETS, DEFAULT_BALANCE,
                                     DEFAULT_BUDGET, DEFAULT_GATE, DEFAULT_METHOD, METHODS,
                                     KeepError, experts_to_keep)
from kimi_mlx.prune.writer import AtomicOutput, PruneError, source_args

DEFAULT_HELDOUT = 2048  # tokens per calibration domain for the card's "What it lost" table
DRY_RUN_MACS = ("1x64GB", "1x96GB", "1x128GB", "1x192GB", "1x256GB", "1x512GB")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="source checkpoint: folder in the official layout, or a Hugging Face id")
    p.add_argument("--calib", nargs="+", default=None, metavar="DATA",
                   help="calibration data: JSONL (chat `messages`, `prompt`/`completion`, "
                        "`text`) or plain text files, or folders of them (not needed by "
                        "--method random)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--keep", type=float, help="fraction of routed experts to keep, in (0, 1]")
    size.add_argument("--experts", type=int, help="number of routed experts to keep per layer")
    p.add_argument("--out", default=None, help="output folder (must not exist unless --force)")
    p.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help=f"saliency: reap (mean of router weight x expert output norm over "
                        f"routed tokens), reap-sum (its sum: frequency x mean), frequency, ean, "
                        f"random (default {DEFAULT_METHOD}, the best mean rank in "
                        f"`make bench-prune`)")
    p.add_argument("--gate", choices=GATES, default=DEFAULT_GATE,
                   help="router weight of reap / reap-sum: softmax (REAP's reference: softmax of "
                        "the router logits over the model's selected experts) or model (the "
                        f"model's renormalised sigmoid gate); default {DEFAULT_GATE}")
    p.add_argument("--budget", choices=BUDGETS, default=DEFAULT_BUDGET,
                   help="experts per layer: uniform (n in every MoE layer, REAP), spread (the "
                        "same total shared out by where each layer's saliency is spread; the "
                        "build records `num_experts_per_layer`) or auto (spread when keeping "
                        f"at most {AUTO_SPREAD_KEEP:g} of the experts, where make bench-domains "
                        "found it better on every domain, else uniform); default " + DEFAULT_BUDGET)
    p.add_argument("--balance", choices=BALANCES, default=DEFAULT_BALANCE,
                   help="with calibration data from several domains (a record's `domain` "
                        "field, else the --calib folder's subfolder, else the file name): "
                        "none pools every token; max keeps the max over domains of each "
                        "domain's saliency / its layer maximum (every domain's top expert "
                        "kept); mean averages each domain's saliency share; floor keeps "
                        f"each domain's top experts first (default {DEFAULT_BALANCE})")
    p.add_argument("--heldout-tokens", type=int, default=DEFAULT_HELDOUT,
                   help="tokens per calibration domain set aside (not calibrated on) to "
                        "measure what the build lost: the card's per-domain table of full vs "
                        f"build perplexity and gate KL; 0 = none (default {DEFAULT_HELDOUT})")
    p.add_argument("--protect-super-experts", action="store_true",
                   help="always keep experts with extreme activation outliers (REAP's rule)")
    p.add_argument("--refit-router", action="store_true",
                   help="after choosing the kept experts, re-fit their router rows on the "
                        "calibration tokens so the pruned router reproduces the full model's "
                        "gate renormalised over the kept experts (kimi_mlx.prune.refit)")
    p.add_argument("--refit-tokens", type=int, default=DEFAULT_REFIT_TOKENS,
                   help="with --refit-router: router inputs kept per MoE layer (held in memory, "
                        f"tokens x hidden x 4 bytes per layer; default {DEFAULT_REFIT_TOKENS})")
    p.add_argument("--refit-steps", type=int, default=DEFAULT_REFIT_STEPS,
                   help=f"with --refit-router: Adam steps per layer (default {DEFAULT_REFIT_STEPS})")
    p.add_argument("--merge", action="store_true",
                   help="merge each dropped expert into the kept expert closest to it (router "
                        "logits and outputs on the calibration tokens; neurons aligned, then "
                        "averaged weighted by routed tokens; MXFP4 requantized, error in the "
                        "card) instead of deleting it (REAM-style, kimi_mlx.prune.merge); "
                        "runs before --refit-router")
    p.add_argument("--merge-tokens", type=int, default=DEFAULT_MERGE_TOKENS,
                   help="with --merge: calibration tokens per MoE layer every expert is run on "
                        f"to compare experts (default {DEFAULT_MERGE_TOKENS})")
    p.add_argument("--merge-min-similarity", type=float, default=DEFAULT_MIN_SIMILARITY,
                   help="with --merge: a dropped expert whose similarity (in [-1, 1]: mean of "
                        "router-logit correlation and output cosine) to every kept expert is "
                        "below this is deleted, not merged (default "
                        f"{DEFAULT_MIN_SIMILARITY}: merge all)")
    p.add_argument("--seed", type=int, default=0, help="seed for --method random and sampling")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                   help=f"calibration sequence length, tokens (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"calibration token budget (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                   help=f"prefill chunk per layer, tokens (default {DEFAULT_CHUNK})")
    p.add_argument("--activation-memory", default="auto",
                   help="activations kept in memory between layers before spilling to disk "
                        "(a size like 8GB, or auto = a quarter of RAM)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    from kimi_mlx.placement.wired import add_allow_paging_argument

    add_allow_paging_argument(p)
    add_quant_arguments(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print per-layer sizes before/after and which Macs the result fits")
    p.add_argument("--macs", action="append", default=None,
                   help="with --dry-run: Mac set(s) to check, planner syntax (e.g. 1x256GB "
                        "or 2x192GB); repeatable (default: single Macs 64GB..512GB)")
    p.add_argument("--context", type=int, default=None,
                   help="with --dry-run: tokens of context to plan for (default 131072, or "
                        "the model's max_position_embeddings when smaller)")


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """--q-bits / --q-group-size / --expert-bits / --expert-group-size (prune, convert, plan)."""
    p.add_argument("--q-bits", type=int, choices=TRUNK_BITS, default=None,
                   help="quantize the BF16 trunk (attention, MLPs, shared experts, embedding, "
                        "head) to this many bits, MLX affine as mlx_lm.convert (default: keep BF16)")
    p.add_argument("--q-group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP,
                   help=f"trunk weights per scale/bias (default {DEFAULT_GROUP})")
    p.add_argument("--expert-bits", type=int, choices=EXPERT_BITS, default=None,
                   help="requantize the MXFP4 routed experts to this many bits, MLX affine "
                        "(default: MXFP4 copied byte for byte)")
    p.add_argument("--expert-group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP,
                   help=f"expert weights per scale/bias with --expert-bits (default {DEFAULT_GROUP})")


def quant_spec(args) -> QuantSpec:
    """The QuantSpec of parsed --q-bits / ... flags (PruneError for a bad combination)."""
    try:
        return QuantSpec(args.q_bits, args.q_group_size, args.expert_bits, args.expert_group_size)
    except QuantError as e:
        raise PruneError(str(e)) from None


def _budget(text: str):
    """--activation-memory: None for auto, else bytes ("8GB", "512MiB", "1e9")."""
    t = text.strip().lower().replace(" ", "")
    if t == "auto":
        return None
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10,
             "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    for u, f in units.items():
        if t.endswith(u):
            t, scale = t[: -len(u)], f
            break
    else:
        scale = 1
    try:
        value = float(t) * scale
    except ValueError:
        value = -1
    if value < 0:
        raise PruneError(f"--activation-memory: not a size: {text!r} (e.g. 8GB, 512MiB, auto)")
    return int(value)


def _source(spec: str) -> Path:
    """--model as a local folder; a hub id is fetched whole (every layer is calibrated)
    through `kimi_mlx.checkpoint.hub.resolve`, which honours HF_HUB_OFFLINE."""
    from kimi_mlx.checkpoint.hub import resolve

    try:
        return resolve(spec)
    except FileNotFoundError as e:
        raise PruneError(f"--model: {e}") from None


def run(args) -> int:
    try:
        quant = quant_spec(args)
        if args.dry_run:
            budgets = None
            # auto without --calib: the uniform figures (spread's budgets need saliency)
            if args.budget == "spread" or (args.budget == "auto" and args.calib):
                budgets = dry_run_budgets(args)
            return dry_run(args.model, args.keep, args.experts, args.macs or list(DRY_RUN_MACS),
                           args.context, quant, budgets,
                           memory=(args.calib_tokens or DEFAULT_MAX_TOKENS, args.refit_tokens,
                                   args.merge_tokens))
        if args.allow_paging:
            from kimi_mlx.placement.wired import allow_paging

            allow_paging(True)  # read by the pass's `wire`
        if args.merge and args.merge_tokens < 1:
            raise PruneError(f"--merge-tokens must be >= 1, got {args.merge_tokens}")
        src = _source(args.model)
        _, margs, _ = source_args(src)
        n_keep = experts_to_keep(margs.num_experts, margs.num_experts_per_token,
                                 keep=args.keep, experts=args.experts)
        if not args.out:
            raise PruneError("--out is required (or use --dry-run)")
        AtomicOutput(args.out, src=src, force=args.force).check()  # fail before calibrating
        budget = _budget(args.activation_memory)
        from kimi_mlx.prune.pipeline import calibration, prune

        if args.method == "random" and not args.calib:  # needs no pass over the model
            from kimi_mlx.prune.calib import CalibSet

            calib = CalibSet([], [], [], 0, seq_len=args.seq_len)
        else:
            if args.heldout_tokens < 0:
                raise PruneError(f"--heldout-tokens must be >= 0, got {args.heldout_tokens}")
            calib = calibration(src, args.calib or [], args.seq_len, args.calib_tokens,
                                args.seed, vocab_size=margs.vocab_size,
                                heldout_tokens=args.heldout_tokens)
        res = prune(src, args.out, calib, args.method, n_keep,
                    protect=args.protect_super_experts, seed=args.seed, gate=args.gate,
                    force=args.force, quant=quant, budget=args.budget,
                    chunk=args.chunk, activation_budget=budget, progress=not args.quiet,
                    refit_router=args.refit_router, refit_tokens=args.refit_tokens,
                    refit_steps=args.refit_steps, merge_experts=args.merge,
                    merge_tokens=args.merge_tokens,
                    merge_min_similarity=args.merge_min_similarity, balance=args.balance)
    except (PruneError, CalibError, KeepError) as e:
        print(f"kimi-mlx prune: error: {e}", file=sys.stderr)
        return 2
    protected = sum(len(v) for v in res.selection.protected.values())
    kept_txt = (f"{n_keep} of {margs.num_experts} experts kept in "
                if res.selection.uniform else
                "experts kept per layer " + ", ".join(
                    f"{l}: {n}" for l, n in res.selection.counts.items())
                + f" (of {margs.num_experts}; spread budget) in ")
    print(f"pruned {args.model} -> {res.out}: {kept_txt}"
          f"{len(res.selection.kept)} MoE layers ({args.method}"
          + (f", {args.gate} gate" if args.method in ("reap", "reap-sum") else "")
          + (f", {protected} super experts protected" if args.protect_super_experts else "")
          + (", dropped experts merged" if args.merge else "")
          + (", router rows re-fitted" if args.refit_router else "")
          + (f", domains balanced by {res.selection.balance}"
             if res.selection.balance != "none" else "")
          + ")" + "".join(f"; {q}" for q in _short(quant)))
    return 0


def _short(quant: QuantSpec):
    if quant.bits is not None:
        yield f"trunk {quant.bits}-bit group {quant.group_size}"
    if quant.expert_bits is not None:
        yield f"experts {quant.expert_bits}-bit group {quant.expert_group_size}"


def dry_run_budgets(args):
    """{layer: experts kept} of a `--budget spread` prune: calibrates (streamed, as the
    prune itself would) and selects, writing nothing.

    Raises:
        PruneError: no --calib (the budgets come from the calibration's saliency).
    """
    if not args.calib:
        raise PruneError(f"--dry-run --budget {args.budget}: the per-layer budgets come from "
                         "the calibration's saliency; give --calib")
    from kimi_mlx.prune.observe import observe
    from kimi_mlx.prune.pipeline import calibration
    from kimi_mlx.prune.saliency import select

    src = _source(args.model)
    _, margs, _ = source_args(src)
    n_keep = experts_to_keep(margs.num_experts, margs.num_experts_per_token,
                             keep=args.keep, experts=args.experts)
    calib = calibration(src, args.calib, args.seq_len, args.calib_tokens, args.seed,
                        vocab_size=margs.vocab_size)
    result = observe(src, calib, chunk=args.chunk, progress=not args.quiet)
    sel = select(result.stats, args.method, n_keep, seed=args.seed, gate=args.gate,
                 budget=args.budget, protect_super_experts=args.protect_super_experts,
                 balance=args.balance, domain_stats=result.domain_stats)
    return sel.counts


def dry_run(model: str, keep, experts, macs, context: Optional[int],
            quant: QuantSpec = QuantSpec(), budgets=None, memory=None) -> int:
    """Print per-layer bytes before/after pruning and, for each Mac set, whether the
    planner fits the result (weights + cache at `context` tokens; None: as `kimi-mlx
    plan` chooses, `planner.planned_context`). Writes nothing.

    `model` may also be a hub id: sizes then come from the local cache or the shipped
    config, as for `kimi-mlx plan` (nothing is downloaded). `memory` (calibration
    tokens, --refit-tokens, --merge-tokens): also print the prune's own peak memory
    (`pipeline.peak_memory`) without and with --refit-router / --merge.
    Raises:
        PruneError: the model cannot be sized; KeepError: bad --keep / --experts.
    """
    # The one accepted cluster import in prune/: the planner owns "what fits where".
    from kimi_mlx.placement.layer_bytes import BuildSpec, model_bytes
    from kimi_mlx.placement.planner import PlanError, StagePlanner, parse_macs, planned_context

    try:
        before = model_bytes(model)
    except (ValueError, FileNotFoundError) as e:
        raise PruneError(f"{model}: cannot size the checkpoint: {e}") from None
    if not before.num_experts:
        raise PruneError(f"{model}: the model has no routed-expert (MoE) layers to prune")
    n_keep = experts_to_keep(before.num_experts, before.experts_per_token, keep=keep,
                             experts=experts)
    build = BuildSpec(n_keep, quant.bits, quant.group_size, quant.expert_bits,
                      quant.expert_group_size)
    try:
        after = model_bytes(model, build)
    except ValueError as e:
        raise PruneError(f"{model}: {e}") from None
    limit = before.max_position_embeddings
    context = planned_context(context, limit)
    gb = lambda n: f"{n / 1e9:,.3f}"
    print(f"model: {model} ({before.source})")
    if budgets and len(set(budgets.values())) > 1:
        print(f"keep {sum(budgets.values())} of {before.num_experts * len(budgets)} routed "
              f"experts ({n_keep} per MoE layer on average), per-layer budgets (spread): "
              + ", ".join(f"{l}: {n}" for l, n in sorted(budgets.items()))
              + f"; {before.experts_per_token} per token")
        print("(every MoE layer's experts are the same size, so the sizes below, planned with "
              f"{n_keep} per layer, are the build's)")
    else:
        print(f"keep {n_keep} of {before.num_experts} routed experts per MoE layer; "
              f"{before.experts_per_token} per token")
    print(" ".join(quant.describe(markdown=False)))
    print()
    rows = [("layer", "kind", "experts", "before GB", "after GB")]
    for b, a in zip(before.layers, after.layers):
        rows.append((str(b.index), b.kind, f"{b.num_experts}->{a.num_experts}" if b.num_experts
                     else "dense", gb(b.weight_bytes), gb(a.weight_bytes)))
    rows.append(("embed+head", "", "", gb(before.embed_bytes + before.head_bytes),
                 gb(after.embed_bytes + after.head_bytes)))
    rows.append(("total", "", "", gb(before.weight_bytes), gb(after.weight_bytes)))
    rows.append(("files", "", "", gb(before.file_bytes), gb(after.file_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print()
    print(f"build size: {gb(after.file_bytes)} GB of safetensors files ({after.file_bytes:,} "
          f"bytes; source {gb(before.file_bytes)} GB)")
    print(f"fits (planner: weights + cache for {context} tokens, 1 sequence):")
    planner = StagePlanner()
    for spec in macs:
        try:
            nodes = parse_macs(spec)
        except ValueError as e:
            print(f"  {spec}: {e}")
            continue
        try:
            plan = planner.plan(after, nodes, context)
        except PlanError as e:
            print(f"  {spec:>10}: no ({gb(e.short_bytes)} GB short)")
            continue
        need = sum(s.total_bytes for s in plan.used_stages)
        usable = sum(n.usable_bytes for n in nodes)
        print(f"  {spec:>10}: yes ({gb(need)} GB of {gb(usable)} GB usable, "
              f"~{plan.tokens_per_s:.1f} tokens/s decode ceiling)")
    if memory is not None:
        print_peak_memory(model, before, *memory)
    return 0


def print_peak_memory(model: str, before, calib_tokens: int, refit_tokens: int,
                      merge_tokens: int) -> None:
    """The prune's own peak memory (`pipeline.peak_memory`) for `model` sized as `before`
    (planner `ModelBytes`): plain, with --refit-router, with --merge, with both."""
    import json

    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.placement.layer_bytes import DEFAULT_MODEL_ID, official_config
    from kimi_mlx.prune.pipeline import peak_memory

    path = Path(model).expanduser()
    if path.is_dir():
        config = read_config(path)
    else:
        shipped = official_config(model) or official_config(DEFAULT_MODEL_ID)
        config = json.loads(shipped.read_text())
    args = ModelArgs.from_config(config, "config.json")
    first = before.layers[0].weight_bytes + before.embed_bytes if before.layers else 0
    layer = max([first] + [l.weight_bytes for l in before.layers])
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    est = lambda r, m: peak_memory(args, layer, calib_tokens, refit_tokens=r, merge_tokens=m)
    plain, refit, merge, both = est(0, 0), est(refit_tokens, 0), est(0, merge_tokens), \
        est(refit_tokens, merge_tokens)
    print(f"prune peak memory (one layer at a time, {calib_tokens:,} calibration tokens, BF16 "
          "activations):")
    print(f"  REAP: {gb(plain['peak'])} = largest layer {gb(plain['layer'])} + calibration "
          f"activations {gb(plain['activations'])} (kept on disk instead when over a quarter "
          "of RAM)")
    print(f"  + --refit-router: {gb(refit['peak'])} (router inputs {refit_tokens:,} tokens x "
          f"hidden x 4 B and the routers of every MoE layer: +{gb(refit['refit'])})")
    print(f"  + --merge: {gb(merge['peak'])} (during the pass +{gb(merge['merge_pass'])}: "
          f"each layer's expert similarity, and every expert's outputs on a chunk of the "
          f"{merge_tokens:,} sampled tokens, never all of them at once; at write time "
          f"{gb(merge['merge_write'])}: three experts in float32 and one neuron-matching "
          "score)")
    print(f"  + both: {gb(both['peak'])}")
