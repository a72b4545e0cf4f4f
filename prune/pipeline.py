"""`kimi-mlx prune` / `convert` as library calls: calibrate -> observe (streamed) ->
select -> write (bytes copied, or quantized while written).

`prune()` is what the prune command runs, `convert()` the convert command (quantization
only, every expert kept). `save()` writes one pruned checkpoint from statistics already
gathered, so the benchmark calibrates once and writes one checkpoint per method.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from kimi_mlx.prune.calib import CalibSet, load_calibration
from kimi_mlx.prune.merge import DEFAULT_TOKENS as DEFAULT_MERGE_TOKENS
from kimi_mlx.prune.merge import DEFAULT_MIN_SIMILARITY, LayerMerge, plan_merges
from kimi_mlx.prune.quantize import QuantSpec
from kimi_mlx.prune.observe import LayerStats, ObserveResult, activation_bytes, observe, spills
from kimi_mlx.prune.refit import DEFAULT_STEPS as DEFAULT_REFIT_STEPS
from kimi_mlx.prune.refit import DEFAULT_TOKENS as DEFAULT_REFIT_TOKENS
from kimi_mlx.prune.refit import RefitResult, refit_routers, router_rows
from kimi_mlx.prune.report import model_card, write_report
from kimi_mlx.prune.saliency import DEFAULT_BALANCE, Selection, select
from kimi_mlx.prune.writer import (AtomicOutput, CheckpointPlan, PruneError, plan_checkpoint, source_args,
                     write_checkpoint)

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibration(src, paths: Sequence, seq_len: int, max_tokens: Optional[int], seed: int = 0,
                vocab_size: Optional[int] = None, heldout_tokens: int = 0) -> CalibSet:
    """Tokenise calibration data with the source checkpoint's tokenizer (see `calib`);
    `heldout_tokens` per domain are set aside for the card's table (`compare`)."""
    from kimi_mlx.text.tokenizer import KimiTokenizer

    return load_calibration(paths, lambda: KimiTokenizer.from_pretrained(src), seq_len=seq_len,
                            max_tokens=max_tokens, seed=seed, vocab_size=vocab_size,
                            heldout_tokens=heldout_tokens)


def check_space(src, where: Path, n_keep: int, scratch: int = 0,
                quant: Optional[QuantSpec] = None) -> int:
    """Bytes the output will take (+ `scratch` bytes of spilled activations); PruneError
    when `where`'s disk has less free space.

    Sizes come from the shard headers with the first n_keep experts of every layer (the
    size does not depend on which experts are kept) and the quantized shapes.
    """
    _, args, _ = source_args(src)
    layers = [i for i in range(args.num_hidden_layers) if args.is_moe(i)]
    plan = plan_checkpoint(src, {i: list(range(n_keep)) for i in layers}, n_keep, quant)
    need = plan.files_bytes + plan.copy_bytes + scratch
    free = shutil.disk_usage(where).free
    if free < need:
        what = " and its spilled calibration activations" if scratch else ""
        raise PruneError(f"{where}: not enough free space for the pruned checkpoint{what}: it "
                         f"needs {need / 1e9:.2f} GB, the disk has {free / 1e9:.2f} GB free")
    return need


def write_with_progress(plan: CheckpointPlan, dest: Path, progress: bool = True) -> None:
    """`write_checkpoint` with a tqdm bar over the bytes written (stderr)."""
    from tqdm import tqdm

    with tqdm(total=plan.bytes_out, unit="B", unit_scale=True, desc="writing", file=sys.stderr,
              disable=None if progress else True, dynamic_ncols=True) as bar:
        write_checkpoint(plan, dest, bar.update)


def refit(result: ObserveResult, sel: Selection, top_k: int, *, steps: int = DEFAULT_REFIT_STEPS,
          log: Optional[Log] = None,
          merges: Optional[Dict[int, LayerMerge]] = None) -> Dict[int, RefitResult]:
    """Re-fit the kept router rows of `sel` on the router inputs `result` recorded
    (`observe(..., router_inputs=N)`); see `kimi_mlx.prune.refit`. With `merges`
    (`merge`), each dropped expert's gate weight counts for its merge target.

    Raises:
        PruneError: the calibration pass kept no router inputs.
    """
    if not result.router_inputs:
        raise PruneError("--refit-router needs the router inputs of a calibration pass "
                         "(--calib data; --method random alone has none)")
    try:
        return refit_routers(result.router_inputs, result.routers, sel.kept, top_k,
                             steps=steps, log=log,
                             into={l: m.into for l, m in merges.items()} if merges else None)
    except ValueError as e:
        raise PruneError(str(e)) from None


def merge(result: ObserveResult, sel: Selection,
          min_similarity: float = DEFAULT_MIN_SIMILARITY) -> Dict[int, LayerMerge]:
    """The merge plan (`kimi_mlx.prune.merge`) of `sel` from the similarity sums `result`
    recorded (`observe(..., similarity=True)`); dropped experts less similar than
    `min_similarity` to every kept one are deleted instead.

    Raises:
        PruneError: the calibration pass recorded no similarity.
    """
    if not result.similarities:
        raise PruneError("--merge needs the expert similarity of a calibration pass "
                         "(--calib data; --method random alone has none)")
    try:
        return plan_merges(result.similarities, {l: s.count for l, s in result.stats.items()},
                           sel.kept, min_similarity)
    except ValueError as e:
        raise PruneError(str(e)) from None


def save(out: AtomicOutput, src, result: ObserveResult, calib: CalibSet, sel: Selection,
         *, protect: bool = False, extra_card: Optional[str] = None, log: Log = _stderr,
         quant: Optional[QuantSpec] = None, progress: bool = False,
         refitted: Optional[Dict[int, RefitResult]] = None,
         merges: Optional[Dict[int, LayerMerge]] = None, lost: bool = True,
         chunk: int = 1024) -> Path:
    """Write the pruned (and, with `quant`, quantized) checkpoint for `sel` into `out`'s
    temporary folder, then commit. `refitted` (from `refit`): the kept router rows to
    write instead of the source's; `merges` (from `merge`): kept experts written as the
    merge of their groups. `lost` and held-out text in `calib` (`calib.heldout`):
    before the commit, evaluate the build against the source per calibration domain
    (`compare`, streamed) and add the table to the card (README.md, "What it lost") and
    to saliency.json (`what_it_lost`).

    Raises:
        PruneError: source problems (from `plan_checkpoint`) or a failed write (the
            temporary folder is removed by `out`'s context manager).
    """
    src = Path(src)
    _, args, _ = source_args(src)
    plan = plan_checkpoint(src, sel.kept, sel.n_keep if sel.uniform else None, quant,
                           router_rows(refitted) if refitted else None,
                           {l: m.groups for l, m in merges.items()} if merges else None)
    log(f"writing {len(plan.shards)} shard(s), {plan.bytes_out / 1e9:.3f} GB "
        f"(source {plan.bytes_in / 1e9:.3f} GB) to {out.out}")
    write_with_progress(plan, out.tmp, progress)
    fmt = (f"MLX affine {plan.quant.expert_bits}-bit, group {plan.quant.expert_group_size}"
           if plan.quant and plan.quant.expert_bits else "the stored format, MXFP4")
    merge_info = _merge_info(merges, plan.merge_errors, fmt) if merges else None
    info = {
        "source": str(src),
        "num_experts_before": args.num_experts,
        "num_experts_per_token": args.num_experts_per_token,
        "protect_super_experts": protect,
        "router_refit": ({str(l): {"tokens": r.tokens, "skipped": r.skipped,
                                   "gate_kl_before": r.kl_before, "gate_kl_after": r.kl_after,
                                   "gate_tv_before": r.tv_before, "gate_tv_after": r.tv_after}
                          for l, r in refitted.items()} if refitted else None),
        "merge": merge_info,
        "calibration": {
            "description": calib.describe(), "tokens": calib.num_tokens,
            "domains": calib.domain_tokens(), "balance": sel.balance,
            "sequences": len(calib.sequences), "seq_len": calib.seq_len, "files": calib.files,
        },
        "observe": {"seconds": round(result.seconds, 3), "spilled_to_disk": result.spilled,
                    "peak_memory_bytes": result.peak_memory},
        "bytes_before": plan.bytes_in, "bytes_after": plan.bytes_out,
        "quantization": plan.config.get("quantization") if plan.quant else None,
        "expert_quantization": ({"bits": plan.quant.expert_bits, "group_size":
                                 plan.quant.expert_group_size, "mode": "affine"}
                                if plan.quant and plan.quant.expert_bits else None),
    }
    card = model_card(
        src=str(src), out_name=str(out.out), method=sel.method, n_keep=sel.n_keep,
        num_experts=args.num_experts, top_k=args.num_experts_per_token,
        moe_layers=len(sel.kept), calib_desc=calib.describe(), calib_files=calib.files,
        bytes_in=plan.bytes_in, bytes_out=plan.bytes_out,
        protected=sum(len(v) for v in sel.protected.values()), protect=protect,
        seed=sel.seed, notes=plan.notes, copied=[p.name for p in plan.copies], extra=extra_card,
        gate=sel.gate, quantized=_quant_lines(plan),
        per_layer=None if sel.uniform else sel.counts)
    if refitted:
        kb = sum(r.kl_before for r in refitted.values()) / len(refitted)
        ka = sum(r.kl_after for r in refitted.values()) / len(refitted)
        card = card.rstrip("\n") + (
            "\n\n## Router refit\n\nThe kept experts' router rows were re-fitted on the "
            "calibration tokens (`--refit-router`, `kimi_mlx.prune.refit`) so that the pruned "
            "router reproduces the full model's gate renormalised over the kept experts: mean "
            f"gate KL over the MoE layers {kb:.4f} -> {ka:.4f} (details in `saliency.json`, "
            "`router_refit`).\n")
    if merges:
        err = merge_info["requant_error"]
        card = card.rstrip("\n") + (
            "\n\n## Merging\n\nEach dropped expert was merged into the kept expert closest to "
            "it (`--merge`, `kimi_mlx.prune.merge`: router-logit correlation and output cosine "
            "on the calibration tokens; neurons aligned, then averaged weighted by routed "
            f"tokens): {merge_info['dropped']} dropped experts into {merge_info['merged']} "
            f"kept ones over {len(merges)} MoE layers, mean similarity "
            f"{merge_info['mean_similarity']:.3f}. Requantization of the merged weights to "
            f"{merge_info['format']}: relative error mean {err['mean']:.4f}, max "
            f"{err['max']:.4f} (details in `saliency.json`, `merge`).\n")
    if lost and calib.heldout:
        from kimi_mlx.prune.compare import compare

        log(f"measuring what the build lost on {sum(len(s) for _, s in calib.heldout):,} "
            "held-out calibration tokens")
        try:
            table = compare(src, out.tmp, calib.heldout_by_domain(), chunk=chunk,
                            kept=sel.kept)
        except ValueError as e:
            raise PruneError(f"evaluating the build: {e}") from None
        info["what_it_lost"] = table.to_dict()
        card = card.rstrip("\n") + (
            "\n\n## What it lost\n\nPer calibration domain, on held-out calibration text "
            "(set aside before calibrating, never calibrated on): perplexity of the full "
            "model and of this build, the gate KL (the full router's gate over the kept "
            "experts vs this build's, at this build's router inputs) and the share of the "
            "full router's mass on kept experts (`kimi_mlx.prune.compare`; "
            "`kimi-mlx eval --compare FULL BUILD DATA...` prints the same table for any "
            "text).\n\n" + table.table() + "\n")
    write_report(out.tmp, result.stats, sel, info, card)
    return out.commit()


def _merge_info(merges: Dict[int, LayerMerge], errors: Dict[str, float], fmt: str) -> dict:
    """The `merge` entry of saliency.json: groups, similarities, requantization errors."""
    sims = [s for m in merges.values() for s in m.similarity.values()]
    errs = list(errors.values())
    return {
        "dropped": sum(len(m.into) for m in merges.values()),
        "merged": sum(len(m.groups) for m in merges.values()),
        "mean_similarity": float(sum(sims) / len(sims)) if sims else 0.0,
        "format": fmt,
        "requant_error": {"mean": float(sum(errs) / len(errs)) if errs else 0.0,
                          "max": float(max(errs)) if errs else 0.0, "per_projection": errors},
        "layers": {str(l): {"groups": {str(k): [[int(e), w] for e, w in g]
                                       for k, g in m.groups.items()},
                            "similarity": {str(d): s for d, s in m.similarity.items()}}
                   for l, m in merges.items()},
    }


def _quant_lines(plan: CheckpointPlan) -> Optional[List[str]]:
    if plan.quant is None:
        return None
    lines = plan.quant.describe()
    if plan.kept_dtype:
        lines.append(f"{len(plan.kept_dtype)} linear weight(s) kept in their stored dtype: "
                     "input dimension not a multiple of the group size (e.g. "
                     f"`{plan.kept_dtype[0]}`).")
    return lines


def convert(src, out, quant: QuantSpec, *, force: bool = False, progress: bool = True,
            log: Log = _stderr) -> CheckpointPlan:
    """Quantize a checkpoint's trunk (and optionally its experts) into `out`, atomically,
    every expert kept (`kimi-mlx convert`).

    Raises:
        PruneError: bad source (not the official layout, already quantized), existing or
            overlapping --out, not enough disk space, or a failed write; nothing is left
            at `out` or beside it.
    """
    src = Path(src)
    _, args, _ = source_args(src)
    if not quant.active:
        raise PruneError("nothing to do: give --q-bits and/or --expert-bits")
    E = args.num_experts
    kept = {i: list(range(E)) for i in range(args.num_hidden_layers) if args.is_moe(i)}
    with AtomicOutput(out, src=src, force=force) as ao:
        plan = plan_checkpoint(src, kept, E, quant)
        need = plan.files_bytes + plan.copy_bytes
        free = shutil.disk_usage(ao.tmp).free
        if free < need:
            raise PruneError(f"{ao.out}: not enough free space for the converted checkpoint: "
                             f"it needs {need / 1e9:.2f} GB, the disk has {free / 1e9:.2f} GB free")
        log(f"writing {plan.bytes_out / 1e9:.3f} GB (source {plan.bytes_in / 1e9:.3f} GB) "
            f"to {ao.out}")
        write_with_progress(plan, ao.tmp, progress)
        (ao.tmp / "README.md").write_text(convert_card(src, ao.out, plan))
        ao.commit()
    return plan


def convert_card(src: Path, out: Path, plan: CheckpointPlan) -> str:
    """README.md of a converted checkpoint."""
    gb = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
    lines = [f"# {out.name}", "", f"A quantized build of `{src}` made by `kimi-mlx convert`.",
             "", "## Quantization", "", *[f"- {q}" for q in _quant_lines(plan)], "",
             "## Size", "",
             f"- Tensors: {gb(plan.bytes_out)} (source {gb(plan.bytes_in)}, "
             f"{100 * plan.bytes_out / plan.bytes_in:.1f}%).", "", "## Use", "", "```",
             f"kimi-mlx generate --model {out} --prompt \"...\"",
             f"python -c \"import mlx_lm; mlx_lm.load('{out}')\"", "```"]
    return "\n".join(lines) + "\n"


def peak_memory(args, layer_bytes: int, calib_tokens: int, *, itemsize: int = 2,
                refit_tokens: int = 0, merge_tokens: int = 0) -> Dict[str, int]:
    """Estimated peak bytes of `prune` at one layer at a time (what `prune --dry-run` prints).

    Args:
        args: the source's ModelArgs; layer_bytes: the largest layer's weights as loaded
            (first layer: with the embedding), bytes.
        calib_tokens: calibration tokens; itemsize: activation bytes per element (2 on a
            GPU: BF16; 4 on the CPU).
        refit_tokens: --refit-router's router inputs per MoE layer (0: no refit).
        merge_tokens: --merge's sampled tokens per MoE layer (0: no merge).
    Returns:
        {"layer", "activations" (h + AttnRes banks; spilled to disk above a quarter of
        RAM), "refit" (router inputs float32 x MoE layers + the routers), "merge_pass"
        (similarities kept + the running layer's sums and output chunk, `merge.
        memory_estimate`), "merge_write" (three experts float32 + one I x I score),
        "plain" (layer + activations), "peak" (the largest of the pass with refit and
        merge and the write)}.
    """
    from kimi_mlx.prune.merge import memory_estimate

    moe = sum(1 for i in range(args.num_hidden_layers) if args.is_moe(i))
    e = args.num_experts
    act = activation_bytes(args, calib_tokens, itemsize)
    refit = (refit_tokens * args.hidden_size * 4 + e * args.hidden_size * 4 + e * 4) * moe \
        if refit_tokens else 0
    merge_pass = merge_write = 0
    if merge_tokens:
        m = memory_estimate(e, args.hidden_size, args.routed_expert_hidden_size or args.hidden_size,
                            args.moe_intermediate_size, merge_tokens, moe)
        merge_pass = m["similarity"] + m["sums"] + m["outputs_chunk"]
        merge_write = m["merge"]
    plain = layer_bytes + act
    return {"layer": layer_bytes, "activations": act, "refit": refit, "merge_pass": merge_pass,
            "merge_write": merge_write, "plain": plain,
            "peak": max(plain + refit + merge_pass, merge_write)}


def _wire_prune(src, args, calib_tokens: int, itemsize: int, refit_tokens: int,
                merge_tokens: int) -> None:
    """MLX's wired limit for the pass's peak (`peak_memory`: the largest layer plus the
    activations, refit and merge buffers) before it loads a layer (`placement.wired`; a
    no-op without Metal). Raises PruneError (one line naming the sysctl to run) when
    that exceeds the Mac's GPU working set."""
    from kimi_mlx.placement.layer_bytes import model_bytes_from_checkpoint
    from kimi_mlx.placement.wired import WiredLimitError, WiredPlan, wire

    def plan():
        mb = model_bytes_from_checkpoint(Path(src))
        first = mb.layers[0].weight_bytes + mb.embed_bytes if mb.layers else 0
        layer = max([first] + [l.weight_bytes for l in mb.layers])  # as `prune --dry-run` counts it
        peak = peak_memory(args, layer, calib_tokens, itemsize=itemsize,
                           refit_tokens=refit_tokens, merge_tokens=merge_tokens)["peak"]
        return WiredPlan("kimi-mlx prune", layer, max(peak - layer, 0),
                         f"{calib_tokens} calibration tokens, one layer at a time")

    try:
        wire(plan)
    except WiredLimitError as e:
        raise PruneError(str(e)) from None


@dataclass
class PruneResult:
    """What `prune` did: output folder, selection, calibration statistics."""

    out: Path
    selection: Selection
    observed: ObserveResult
    calib: CalibSet


def prune(src, out, calib: CalibSet, method: str, n_keep: int, *, protect: bool = False,
          seed: int = 0, gate: str = "softmax", force: bool = False, chunk: int = 1024,
          activation_budget: Optional[int] = None, progress: bool = True,
          quant: Optional[QuantSpec] = None, budget: str = "uniform",
          refit_router: bool = False, refit_tokens: int = DEFAULT_REFIT_TOKENS,
          refit_steps: int = DEFAULT_REFIT_STEPS, merge_experts: bool = False,
          merge_tokens: int = DEFAULT_MERGE_TOKENS,
          merge_min_similarity: float = DEFAULT_MIN_SIMILARITY, log: Log = _stderr,
          balance: str = DEFAULT_BALANCE, lost: bool = True) -> PruneResult:
    """Calibrate layer by layer, rank experts, write `out` atomically.

    The temporary output folder is made first (so a read-only or full disk fails before
    calibration); spilled activations live inside it and are gone before the rename.
    `refit_router`: keep `refit_tokens` router inputs per MoE layer during calibration and
    re-fit the kept router rows (`refit`, `refit_steps` Adam steps) before writing.
    `merge_experts`: the pass also sums expert similarities on `merge_tokens` sampled tokens
    per MoE layer, and each dropped expert is merged into its closest kept one (`merge`;
    order: select, merge, refit, write).
    `balance`: how per-domain saliency is combined (`saliency.BALANCES`). `lost`: the
    card's per-domain table on `calib.heldout` (see `save`).

    Raises:
        PruneError: bad source, existing --out, no space, or a failed write; nothing is
            left at `out` or beside it.
    """
    _, args, _ = source_args(src)
    if not calib.sequences and (method != "random" or protect or refit_router or merge_experts):
        what = " with --protect-super-experts" if protect else ""
        what += " with --refit-router" if refit_router else ""
        what += " with --merge" if merge_experts else ""
        raise PruneError(f"--method {method}{what} "
                         "needs calibration data (--calib); only --method random runs without")
    itemsize = 4 if mx.default_device() == mx.cpu else 2  # the loader's activation dtype
    est = activation_bytes(args, calib.num_tokens, itemsize)
    _wire_prune(src, args, calib.num_tokens, itemsize,
                refit_tokens if refit_router else 0, merge_tokens if merge_experts else 0)
    with AtomicOutput(out, src=src, force=force) as ao:
        check_space(src, ao.tmp, n_keep, est if spills(est, activation_budget) else 0, quant)
        if calib.sequences:
            log(f"calibrating on {calib.describe()}")
            result = observe(src, calib, chunk=chunk, spill_dir=ao.tmp / ".activations",
                             activation_budget=activation_budget, progress=progress, log=log,
                             router_inputs=max(refit_tokens if refit_router else 0,
                                               merge_tokens if merge_experts else 0),
                             keep_router_inputs=refit_router, similarity=merge_experts)
            log(f"calibration: {result.tokens:,} tokens x {len(result.layer_seconds)} layers "
                f"in {result.seconds:.1f} s, peak memory {result.peak_memory / 2**20:.1f} MiB")
        else:  # random selection: no pass over the model, empty statistics
            result = ObserveResult({i: LayerStats(i, args.num_experts, args.num_experts_per_token)
                                    for i in range(args.num_hidden_layers) if args.is_moe(i)},
                                   tokens=0, seconds=0.0)
        sel = select(result.stats, method, n_keep, protect_super_experts=protect, seed=seed,
                     gate=gate, budget=budget, balance=balance,
                     domain_stats=result.domain_stats)
        merges = merge(result, sel, merge_min_similarity) if merge_experts else None
        refitted = (refit(result, sel, args.num_experts_per_token, steps=refit_steps, log=log,
                          merges=merges)
                    if refit_router else None)
        path = save(ao, src, result, calib, sel, protect=protect, log=log, quant=quant,
                    progress=progress, refitted=refitted, merges=merges, lost=lost, chunk=chunk)
    return PruneResult(path, sel, result, calib)
