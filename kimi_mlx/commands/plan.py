"""`kimi-mlx plan`: which Macs hold which layers, whether it fits, how fast it can decode.

Offline: a local folder is measured from its shard headers; a hub id uses the local
Hugging Face cache or the config kimi-mlx ships (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional

from kimi_mlx.model.config import QUANT_DEFAULT_GROUP, QUANT_EXPERT_BITS, QUANT_GROUP_SIZES, QUANT_TRUNK_BITS

from kimi_mlx.placement.layer_bytes import (DEFAULT_MODEL_ID, KV_CACHE_BITS,
                                            KV_CACHE_DEFAULT_GROUP, KV_CACHE_GROUP_SIZES,
                                            BuildSpec, ModelBytes, kv_token_bytes, model_bytes)
from kimi_mlx.placement.tensor_parallel import (JACCL_LATENCY_S, TCP_LATENCY_S,
                                               choose_for_server, recommend,
                                               snapshot_bytes_per_rank, tensor_fits,
                                               tensor_plan_for, tensors_of)
from kimi_mlx.placement.verify_cost import (DEFAULT_DRAFT_BLOCK, DSPARK_ACCEPTANCE_LENGTH,
                                            choose_with_drafts, k_table, parse_acceptance,
                                            tensor_k_table)
from kimi_mlx.placement.planner import (
    DEFAULT_CHIP, DEFAULT_CONTEXT, DEFAULT_HOP_LATENCY_S, GB, GiB, MAC_BANDWIDTH, Plan, PlanError,
    StagePlanner, macos_default_wired_bytes, parse_bytes, parse_macs, planned_context,
)




def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL_ID,
                   help=f"local checkpoint folder or hub id (default {DEFAULT_MODEL_ID}; never downloaded)")
    p.add_argument("--macs", default="1x512GB",
                   help="Macs in pipeline order, e.g. 4x512GB or 2x512GB,1x256GB@m2-ultra "
                        "(RAM in Apple's GB; default 1x512GB)")
    p.add_argument("--mac-chip", default=DEFAULT_CHIP, choices=sorted(MAC_BANDWIDTH),
                   help=f"chip of Macs without @chip, for bandwidth (default {DEFAULT_CHIP})")
    p.add_argument("--wired-limit-mb", type=int, default=None,
                   help="the Macs' `sysctl iogpu.wired_limit_mb` (default: assume RAM - 16 GiB "
                        "above 64 GiB, 3/4 of RAM below)")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per sequence (default {DEFAULT_CONTEXT}, or the model's "
                        "max_position_embeddings when smaller)")
    p.add_argument("--sequences", type=int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="plan for `cluster server --max-concurrency N` (N sequences at once, "
                        "in place of --sequences): also says which mode `--parallel auto` "
                        "chooses for that server, and why")
    p.add_argument("--headroom", default="0.1",
                   help="kept free per Mac: a fraction of usable memory (0.1) or a size (8GB); "
                        "default 0.1, at least 2 GiB")
    p.add_argument("--hop-latency-ms", type=float, default=DEFAULT_HOP_LATENCY_S * 1e3,
                   help="network latency per pipeline hop (default 0.5)")
    p.add_argument("--jaccl-latency-us", type=float, default=JACCL_LATENCY_S * 1e6,
                   help="latency per collective over JACCL (RDMA over Thunderbolt 5) for the "
                        f"tensor-parallel estimate (default {JACCL_LATENCY_S * 1e6:g})")
    p.add_argument("--tcp-latency-us", type=float, default=TCP_LATENCY_S * 1e6,
                   help="latency per collective over the TCP ring for the tensor-parallel "
                        f"estimate (default {TCP_LATENCY_S * 1e6:g})")
    p.add_argument("--keep", type=float, default=None,
                   help="plan a pruned build keeping round(KEEP x experts) routed experts per layer")
    p.add_argument("--q-bits", type=int, choices=QUANT_TRUNK_BITS, default=None,
                   help="plan a build whose BF16 trunk is quantized to this many bits "
                        "(kimi-mlx convert / prune --q-bits)")
    p.add_argument("--q-group-size", type=int, choices=QUANT_GROUP_SIZES,
                   default=QUANT_DEFAULT_GROUP, help=f"with --q-bits (default {QUANT_DEFAULT_GROUP})")
    p.add_argument("--expert-bits", type=int, choices=QUANT_EXPERT_BITS, default=None,
                   help="plan a build whose MXFP4 experts are requantized to this many bits")
    p.add_argument("--expert-group-size", type=int, choices=QUANT_GROUP_SIZES,
                   default=QUANT_DEFAULT_GROUP,
                   help=f"with --expert-bits (default {QUANT_DEFAULT_GROUP})")
    p.add_argument("--draft-acceptance", default=str(DSPARK_ACCEPTANCE_LENGTH),
                   help="speculative decoding estimate per k: a drafter's mean acceptance "
                        "length (tokens per verify step, the target's own included; default "
                        f"{DSPARK_ACCEPTANCE_LENGTH:g}, LithosAI's Kimi-K3.1-Pro-DSpark over "
                        "10 benchmarks) or per-position acceptances (e.g. 0.8,0.7,0.6)")
    p.add_argument("--draft-block-size", type=int, default=DEFAULT_DRAFT_BLOCK,
                   help="positions per block at which a mean acceptance length was measured "
                        f"(default {DEFAULT_DRAFT_BLOCK}: {DEFAULT_DRAFT_BLOCK - 1} drafts)")
    p.add_argument("--draft-ms", type=float, default=0.0,
                   help="the drafter's own time per verify step in ms (default 0: a block "
                        "drafter's one small pass, next to the target's reads)")
    p.add_argument("--expert-union", choices=("measured", "uniform"), default="measured",
                   help="distinct experts a verify block reads: measured (the curve fitted "
                        "on micro-moe's routing, kimi_mlx/assets/expert_union.json; default) "
                        "or uniform (independent uniform routing: the upper bound)")
    p.add_argument("--drafts", action="store_true",
                   help="plan for a server that drafts (--draft-model, --draft mtp|ngram): "
                        "`--parallel auto` then decides on each mode's best k of the "
                        "speculative tables (at --draft-acceptance), not the plain figures")
    p.add_argument("--max-draft-tokens", type=int, default=16,
                   help="largest k in the speculative table (default 16)")
    p.add_argument("--kv-bits", type=int, choices=KV_CACHE_BITS, default=None,
                   help="plan the quantized DSA cache (the MLA latent and the indexer keys "
                        "in MLX's affine format, the rope keys bf16), printed beside bf16")
    p.add_argument("--kv-group-size", type=int, choices=KV_CACHE_GROUP_SIZES,
                   default=KV_CACHE_DEFAULT_GROUP,
                   help=f"with --kv-bits (default {KV_CACHE_DEFAULT_GROUP})")


def _planner(args) -> StagePlanner:
    text = str(args.headroom).strip()
    try:
        fraction = float(text)
    except ValueError:
        return StagePlanner(headroom=0.0, min_headroom_bytes=parse_bytes(text),
                            hop_latency_s=args.hop_latency_ms / 1e3)
    return StagePlanner(headroom=fraction, hop_latency_s=args.hop_latency_ms / 1e3)


def _gb(n: int) -> str:
    return f"{n / GB:.1f}"


def _sizes(ns: List[int]) -> str:
    """'0.4 / 1.8 GB', or in MB when the largest is below a GB."""
    unit, name = (GB, "GB") if max(ns) >= GB else (1e6, "MB")
    return " / ".join(f"{n / unit:.1f}" for n in ns) + f" {name}"


def _describe_model(name: str, model: ModelBytes) -> List[str]:
    kinds = [l.kind for l in model.layers]
    counts = ", ".join(f"{kinds.count(k)} {k.upper()}" for k in ("kda", "dsa", "mla") if kinds.count(k))
    lines = [f"model: {name} ({model.source})",
             f"       {len(kinds)} layers ({counts}), weights {_gb(model.weight_bytes)} GB "
             f"(routed experts {_gb(model.routed_expert_bytes)} GB)"]
    skipped = ", ".join(f"{k} {_gb(v)} GB" + (" (on the cluster head, see below)" if k == "vision" else "")
                        for k, v in sorted(model.not_loaded.items()) if v)
    if skipped:
        lines.append(f"       not loaded by the stages: {skipped}")
    experts = {l.index: l.num_experts for l in model.layers if l.num_experts}
    if len(set(experts.values())) > 1:
        lines.append("       routed experts per layer (not uniform): "
                     + ", ".join(f"{i}: {n}" for i, n in experts.items()))
    lines += [f"note: {n}" for n in model.notes]
    return lines


def _table(plan: Plan) -> List[str]:
    mla = any(s.num_mla for s in plan.stages)
    head = ("stage", "node", "Mac", "layers", "KDA", "MLA+DSA" if mla else "DSA", "weights GB", "cache GB",
            "total GB", "usable GB", "fits")
    rows = []
    for i, s in enumerate(plan.stages):
        extra = "+".join(x for x, on in (("embed", s.has_embed), ("head", s.has_head)) if on)
        layers = f"[{s.start}, {s.end})" + (f" +{extra}" if extra else "") if s.used else "-"
        rows.append((str(i), s.node.name, s.node.label, layers, str(s.num_kda),
                     str(s.num_dsa + s.num_mla), _gb(s.weight_bytes), _gb(s.cache_bytes),
                     _gb(s.total_bytes), _gb(s.node.usable_bytes),
                     ("yes" if s.fits else "NO") if s.used else "unused"))
    widths = [max(len(r[j]) for r in rows + [head]) for j in range(len(head))]
    right = {4, 5, 6, 7, 8, 9}
    fmt = lambda r: "  ".join(c.rjust(w) if j in right else c.ljust(w)
                              for j, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt(head)] + [fmt(r) for r in rows]


def _summary(plan: Plan, model: ModelBytes, planner: StagePlanner, wired_given: bool) -> List[str]:
    dsa = [l for l in model.layers if l.cache_bytes_per_token]
    kda = [l for l in model.layers if l.state_bytes_per_sequence]
    per_layer = sorted({l.cache_bytes_per_token for l in dsa})
    lines = []
    if dsa:
        layer_txt = " or ".join(f"{b:,} B" for b in per_layer)
        lines.append(
            f"KV cache per token: {plan.cache_bytes_per_token:,} B ({len(dsa)} attention layers x "
            f"{layer_txt}); {_gb(plan.cache_bytes_per_token * plan.context * plan.sequences)} GB "
            f"at {plan.context} tokens x {plan.sequences} sequence(s)")
    if kda:
        lines.append(f"KDA state per sequence: {plan.state_bytes_per_sequence / 1e6:.1f} MB "
                     f"({len(kda)} layers, constant in context)")
    used = plan.used_stages
    if len(used) > 1 and (dsa or kda):
        layers = model.layers
        state = [sum(l.state_bytes_per_sequence for l in layers[st.start:st.end]) for st in used]
        token = [sum(l.cache_bytes_per_token for l in layers[st.start:st.end]) for st in used]
        lines.append(
            "prompt-cache snapshot per stage (cluster server; counted against each stage's "
            f"--cache-bytes): {' / '.join(f'{b / 1e6:.0f}' for b in state)} MB of KDA state "
            f"(copied) + {' / '.join(f'{b / 1e3:.1f}' for b in token)} KB per token of DSA "
            "cache (references); at "
            f"{plan.context} tokens: "
            f"{' / '.join(_gb(a + b * plan.context) for a, b in zip(state, token))} GB")
    if used and (dsa or kda):
        snap = [sum(l.cache_bytes(plan.context, 1) for l in model.layers[st.start:st.end])
                for st in used]
        from kimi_mlx.server.serving import DEFAULT_DISK_BYTES

        lines.append(
            f"prompt-cache snapshot on disk (--prompt-cache-dir; one file per snapshot, "
            f"KDA state + DSA cache of one sequence, {model.kv_format()}) at {plan.context} "
            "tokens: "
            + _sizes(snap) + (" per stage" if len(snap) > 1 else "")
            + f"; the default --prompt-cache-disk-bytes ({DEFAULT_DISK_BYTES / GiB:.0f} GiB) "
            f"holds {DEFAULT_DISK_BYTES // max(max(snap), 1)} of them"
            + (" on the fullest stage" if len(snap) > 1 else ""))
    lines += vision_lines(plan, model)
    unused = plan.unused_nodes
    if unused:
        lines.append("not needed: " + ", ".join(n.name for n in unused) + " (0 layers)")
    lines.append(
        f"decode estimate (bandwidth-bound ceiling, at {plan.context} tokens): "
        f"{plan.tokens_per_s:.1f} tokens/s per sequence"
        + (f", {plan.aggregate_tokens_per_s:.1f} aggregate" if plan.sequences > 1 else "")
        + f"; {_gb(plan.read_bytes_per_step)} GB read per step, "
        f"{plan.hops} hop(s) x {planner.hop_latency_s * 1e3:g} ms")
    headroom = {s.headroom_bytes for s in plan.used_stages}
    lines.append(f"headroom kept free per Mac: {', '.join(_gb(h) for h in sorted(headroom))} GB")
    if not wired_given:
        low = [s for s in plan.used_stages if s.node.ram_bytes and
               s.total_bytes + s.headroom_bytes > macos_default_wired_bytes(s.node.ram_bytes)]
        groups = {}
        for s in low:
            key = (macos_default_wired_bytes(s.node.ram_bytes), s.node.usable_bytes // 2**20)
            groups.setdefault(key, []).append(s.node.name)
        for (default, limit_mb), names in groups.items():
            lines.append(
                f"{', '.join(names)}: stage needs more than macOS's default GPU limit "
                f"({default / GiB:.0f} GiB); on each run: sudo sysctl iogpu.wired_limit_mb={limit_mb}")
    return lines


def vision_lines(plan: Plan, model: ModelBytes) -> List[str]:
    """The vision tower + projector's bytes, counted on the machine that runs them: the
    head (`cluster launch` / `cluster server`, or the one `kimi-mlx server` process),
    which loads them from its checkpoint folder on the first image. When the head is also
    stage 0's Mac (the usual set-up), that stage's total with them, and whether it still
    fits. Empty for a checkpoint without vision tensors."""
    vision = model.not_loaded.get("vision", 0)
    if not vision:
        return []
    used = plan.used_stages
    s = used[0]
    total = s.total_bytes + vision
    fits = total + s.headroom_bytes <= s.node.usable_bytes
    where = ("the one process" if len(used) == 1 else
             "the cluster head (where cluster launch / cluster server runs)")
    return [f"vision tower + projector: {_gb(vision)} GB, loaded on {where} on the first "
            f"image (text-only requests never load it); on stage 0's Mac ({s.node.name}): "
            f"{_gb(total)} GB of {_gb(s.node.usable_bytes)} usable with it, "
            + ("fits" if fits else "does NOT fit: run the head on another machine, or send "
               "no images")]


def run(args) -> int:
    server = getattr(args, "max_concurrency", None)
    if server is not None:
        args.sequences = server
    try:
        if (args.context is not None and args.context < 1) or args.sequences < 1:
            raise ValueError(f"--context and --sequences must be >= 1 (got {args.context}, "
                             f"{args.sequences})")
        nodes = parse_macs(args.macs, args.mac_chip, args.wired_limit_mb)
        _check_draft_arguments(args)  # before any output, not after the tables
        planner = _planner(args)
        model = model_bytes(args.model)
        if args.keep is not None and (not model.num_experts or not 0 < args.keep <= 1):
            raise ValueError("--keep needs a MoE model and a fraction in (0, 1]")
        build = None
        if args.keep is not None or args.q_bits or args.expert_bits:
            keep = (None if args.keep is None else
                    max(model.experts_per_token, round(args.keep * model.num_experts)))
            build = BuildSpec(keep, args.q_bits, args.q_group_size, args.expert_bits,
                              args.expert_group_size)
            model = model_bytes(args.model, build)
        bf16 = model  # the cache as the model's dtype, beside the --kv-bits one
        kv_bits = getattr(args, "kv_bits", None)
        if kv_bits is not None:
            model = model.with_kv_bits(kv_bits, args.kv_group_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"kimi-mlx plan: error: {e}", file=sys.stderr)
        return 2
    for line in _describe_model(args.model, model):
        print(line)
    if build is not None:
        print(f"build: {build.describe()}; {_gb(model.file_bytes)} GB of safetensors files "
              f"({model.file_bytes:,} bytes)")
    limit = model.max_position_embeddings
    args.context = planned_context(args.context, limit)
    if limit and args.context > limit:
        print(f"note: --context {args.context} is past the model's max_position_embeddings "
              f"({limit}); it is planned for, but the model is not made for it", file=sys.stderr)
    print(f"Macs: {args.macs} ({', '.join(f'{n.name} {n.label}' for n in nodes)}); "
          f"context {args.context} tokens x {args.sequences} sequence(s)")
    try:
        plan = planner.plan(model, nodes, args.context, args.sequences)
    except PlanError as e:
        print()
        print(str(e).replace("; ", "\n  "))
        return 1
    except ValueError as e:
        print(f"kimi-mlx plan: error: {e}", file=sys.stderr)
        return 2
    print()
    for line in _table(plan):
        print(line)
    print()
    for line in _summary(plan, model, planner, args.wired_limit_mb is not None):
        print(line)
    tensor = None
    if len(nodes) > 1:
        print()
        lines, tensor = _versus_tensor(args, plan, planner, nodes, build)
        for line in lines:
            print(line)
    if getattr(args, "kv_bits", None) is not None:
        print()
        for line in _kv_versus_bf16(args, plan, model, bf16, planner, nodes, build):
            print(line)
    if model.num_experts:
        try:
            spec = _speculative(args, plan, model, planner, tensor)
        except ValueError as e:
            print(f"kimi-mlx plan: error: {e}", file=sys.stderr)
            return 2
        print()
        for line in spec:
            print(line)
    print("fits")
    return 0


def _check_draft_arguments(args):
    """(per-position acceptance, how it was read) of --draft-acceptance; ValueError (naming
    the flag) for a bad --draft-acceptance / --draft-block-size / --max-draft-tokens, or a
    --draft-ms that is negative or not finite (a drafter cannot take less than no time:
    a negative one made drafting look faster than it can be)."""
    if args.draft_block_size < 2 or args.max_draft_tokens < 1:
        raise ValueError("--draft-block-size must be >= 2 and --max-draft-tokens >= 1")
    if not math.isfinite(args.draft_ms) or args.draft_ms < 0:
        raise ValueError(f"--draft-ms must be a finite number of ms >= 0, got {args.draft_ms:g}")
    return parse_acceptance(args.draft_acceptance, args.draft_block_size)


def _speculative(args, plan: Plan, model: ModelBytes, planner: StagePlanner,
                 tensor=None) -> List[str]:
    """Predicted tok/s per k of a block drafter on this plan, the plan's sequences as rows
    verified together (`--max-concurrency`), through the pipeline and, given `tensor`
    ((config, tensors, TensorPlan, fits) from `_versus_tensor`), through the tensor group
    over JACCL and the TCP ring: `kimi_mlx.placement.verify_cost`, with the
    distinct-experts curve of `kimi_mlx.placement.expert_union`.

    Raises:
        ValueError: a bad --draft-acceptance / --draft-block-size / --max-draft-tokens."""
    from kimi_mlx.placement.expert_union import UnionCurve, load_curve, union_experts

    acceptance, how = _check_draft_arguments(args)
    uniform = args.expert_union == "uniform"
    curve = UnionCurve.uniform_bound() if uniform else load_curve()
    B = plan.sequences
    ks = range(1, args.max_draft_tokens + 1)
    plain, rows = k_table(plan, model, acceptance, planner.hop_latency_s, ks,
                          args.draft_ms / 1e3, curve, rows=B)
    E, k0 = model.num_experts, model.experts_per_token
    who = ("one sequence" if B == 1 else
           f"{B} sequences verified together (--max-concurrency {B}: one [{B}, k + 1] pass)")
    lines = [
        f"speculative decoding, {who} through the pipeline: {how}"
        + (f"; drafter {args.draft_ms:g} ms per step" if args.draft_ms else ""),
        (f"verify step of k drafts = one target pass over k + 1 tokens: trunk read once, routed "
         f"experts x D(k+1) distinct per layer, caches once (kimi_mlx/placement/verify_cost.py)"
         if B == 1 else
         f"verify step of k drafts = one target pass over {B} rows x (k + 1) tokens: trunk "
         f"read once, routed experts x D({B} rows of k+1) distinct per layer (the union over "
         f"all {B}(k + 1) tokens), each row's caches once; tokens/step and tok/s are all "
         f"{B} rows' (kimi_mlx/placement/verify_cost.py)"),
        (f"D(n) = {E} (1 - (1 - {k0}/{E})^n): uniform independent routing, the upper "
         f"bound (--expert-union uniform)" if uniform else
         f"D(n) = P (1 - (1 - {k0}/P)^(n^beta)), P = rho x {E}, rho = {curve.rho_mean:.3f} "
         f"(skew), beta = {curve.beta_mean:.3f} (locality): the fit of the distinct-experts "
         f"curve measured on micro-moe's routing (E={curve.num_experts}, top-{curve.top_k}, "
         f"its own corpus; kimi_mlx/assets/expert_union.json, `kimi-mlx bench routing`), "
         f"assumed to hold at E/top-k = {E / k0:g}; uniform routing would read D(16) = "
         f"{union_experts(16, E, k0):.0f} (--expert-union uniform)"),
    ]
    lines += _k_lines(plain, rows)
    if tensor is None:
        return lines
    targs, tensors, tp, fits = tensor
    best = {"pipeline": (max([plain] + rows, key=lambda r: r.tokens_per_s), plain)}
    choices = []
    for link, lat in (("JACCL", args.jaccl_latency_us * 1e-6),
                      ("TCP ring", args.tcp_latency_us * 1e-6)):
        t_plain, t_rows = tensor_k_table(tp, tensors, targs, plan.context, acceptance, lat, ks,
                                         args.draft_ms / 1e3, curve, rows=B)
        choices.append((link, *choose_with_drafts((plain, rows), (t_plain, t_rows), fits, B)))
        if fits:
            best[f"tensor over {link}"] = (max([t_plain] + t_rows, key=lambda r: r.tokens_per_s),
                                           t_plain)
        lines += ["", f"speculative decoding, {who} through the tensor group of {tp.ranks} "
                  f"Macs over {link} ({args.jaccl_latency_us if link == 'JACCL' else args.tcp_latency_us:g} us x "
                  f"{tp.collectives} collectives per step, any k): the largest rank's share "
                  f"of the same reads" + ("" if fits else " (the group does NOT fit)")]
        lines += _k_lines(t_plain, t_rows)
    lines += ["", f"what drafts buy at {B} sequence(s) (tok/s of all rows; each deployment "
              "at its best k of the tables above):"]
    lines += _best_lines(best)
    if getattr(args, "drafts", False):
        lines += [f"cluster server --parallel auto with drafts over {link}: {choice} ({why})"
                  for link, choice, why in choices]
    return lines


def _best_lines(best) -> List[str]:
    """`_speculative`'s summary table: per deployment ({name: (best row, plain row)}) its
    plain tok/s, best k, tok/s there and the ratio."""
    head = ("deployment", "plain", "best k", "with drafts", "gain")
    table = [(name, f"{p.tokens_per_s:.1f}", str(r.k), f"{r.tokens_per_s:.1f}",
              f"{r.tokens_per_s / p.tokens_per_s:.2f}x") for name, (r, p) in best.items()]
    widths = [max(len(t[j]) for t in table + [head]) for j in range(len(head))]
    fmt = lambda t: "  " + "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                                     for j, (c, w) in enumerate(zip(t, widths)))
    return [fmt(head)] + [fmt(t) for t in table]


def _k_lines(plain, rows) -> List[str]:
    """The per-k table (k = 0 first) and its best k, as `_speculative` prints them."""
    head = ("k", "tokens/step", "experts/layer", "GB/step", "ms/step", "tok/s", "vs plain")
    table = [("0 (plain)", f"{plain.tokens_per_step:.2f}", f"{plain.distinct:.0f}",
              _gb(int(plain.read_bytes)), f"{plain.seconds * 1e3:.1f}",
              f"{plain.tokens_per_s:.1f}", "1.00x")]
    for r in rows:
        table.append((str(r.k), f"{r.tokens_per_step:.2f}", f"{r.distinct:.0f}",
                      _gb(int(r.read_bytes)), f"{r.seconds * 1e3:.1f}",
                      f"{r.tokens_per_s:.1f}", f"{r.speedup:.2f}x"))
    widths = [max(len(t[j]) for t in table + [head]) for j in range(len(head))]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
    best = max(rows, key=lambda r: r.tokens_per_s)
    if best.tokens_per_s > plain.tokens_per_s:
        lines.append(f"best k: {best.k} ({best.tokens_per_s:.1f} tok/s, {best.speedup:.2f}x "
                     f"plain); `--num-draft-tokens auto` measures acceptance and step times "
                     f"and picks k as it runs")
    else:
        lines.append(f"best: plain decoding ({plain.tokens_per_s:.1f} tok/s); no k pays at "
                     f"this acceptance")
    return lines


def _versus_tensor(args, plan: Plan, planner: StagePlanner, nodes, build):
    """Pipeline vs tensor parallelism over the same Macs (kimi_mlx/placement/tensor_parallel.py).
    Returns (lines, (config, tensors, TensorPlan, fits) or None when no tensor group is
    possible)."""
    from kimi_mlx.model.shard import ShardError

    jaccl, tcp = args.jaccl_latency_us * 1e-6, args.tcp_latency_us * 1e-6
    lines = [f"pipeline vs tensor parallel over {len(nodes)} Macs at {plan.context} tokens "
             f"(per collective: JACCL {args.jaccl_latency_us:g} us, TCP ring "
             f"{args.tcp_latency_us:g} us; Apple TN3205 via adwaitx.com, see "
             "kimi_mlx/placement/tensor_parallel.py):"]
    try:
        targs, tensors = tensors_of(args.model, build)
        tp = tensor_plan_for(tensors, targs, [n.bandwidth_bytes_per_s for n in nodes], plan.context,
                             **_kv(args))
    except ShardError as e:
        lines.append(f"  tensor: not possible ({e})")
        tp = None
    used = plan.used_stages
    rows = [("", "pipeline", "tensor")]
    per_mac = max(s.weight_bytes + s.cache_bytes for s in used)
    fits = False
    if tp is not None:
        # every rank holds the caches of all the plan's sequences (--max-concurrency)
        tp_mem = tp.rank_bytes(plan.sequences)
        fits = tensor_fits(tp, nodes, plan.sequences, planner._headroom)
        rows += [
            ("bytes per Mac (GB, weights + cache)", f"{_gb(per_mac)} (largest stage)",
             f"{_gb(tp_mem)}" + ("" if fits else " (does NOT fit)")),
            ("read per token per Mac (GB)", f"{_gb(max(s.read_bytes for s in used))} "
             f"(stages in turn: {_gb(plan.read_bytes_per_step)} in all)",
             _gb(tp.read_bytes_per_token)),
            ("collectives per token", f"{plan.hops} hops",
             f"{tp.all_sums} all_sum + {tp.all_gathers} all_gather"),
            ("tok/s over JACCL", f"{plan.tokens_per_s:.1f}", f"{tp.tokens_per_s(jaccl):.1f}"),
            ("tok/s over TCP", f"{plan.tokens_per_s:.1f}", f"{tp.tokens_per_s(tcp):.1f}"),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines += [f"  {a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]
    for link, lat in (("JACCL (every pair of Macs cabled, RDMA on)", jaccl),
                      ("TCP ring (Thunderbolt bridge)", tcp)):
        lines.append(f"recommended over {link}: {recommend(plan.tokens_per_s, tp, lat, fits)}")
    if tp is not None:
        state, per_token = snapshot_bytes_per_rank(targs, tp.ranks, **_kv(args))
        lines.append(
            "prompt-cache snapshot per tensor rank (cluster server --parallel tensor; counted "
            f"against each rank's --cache-bytes): {state / 1e6:.0f} MB of KDA state (its "
            f"heads, copied) + {per_token / 1e3:.1f} KB per token of DSA cache (replicated, "
            f"references); at {plan.context} tokens: {_gb(state + per_token * plan.context)} GB, "
            "and as much per file on each rank's disk with --prompt-cache-dir")
    if getattr(args, "drafts", False):
        lines.append("cluster server --parallel auto with drafts: chosen on the "
                     "speculative tables (below)")
    elif getattr(args, "max_concurrency", None) is not None:
        for link, lat in (("JACCL", jaccl), ("TCP ring", tcp)):
            choice, why = choose_for_server(plan.tokens_per_s, plan.sequences, tp, lat, fits,
                                            args.max_concurrency)
            lines.append(f"cluster server --parallel auto over {link}: {choice} ({why})")
    return lines, (None if tp is None else (targs, tensors, tp, fits))


def _kv(args) -> dict:
    """The --kv-bits cache format as keyword arguments of the tensor-parallel estimates."""
    return dict(kv_bits=getattr(args, "kv_bits", None),
                kv_group_size=getattr(args, "kv_group_size", KV_CACHE_DEFAULT_GROUP))


def _kv_versus_bf16(args, plan: Plan, model: ModelBytes, bf16: ModelBytes,
                    planner: StagePlanner, nodes, build) -> List[str]:
    """`--kv-bits`: the quantized DSA cache beside the bf16 one at the plan's context and
    sequences (kimi_mlx/placement/kv_cache.py): bytes per token, cache per stage and per
    tensor rank, snapshots, what a decode step reads, decode estimates, most sequences."""
    from kimi_mlx.model.shard import ShardError
    from kimi_mlx.placement.kv_cache import (cache_read_bytes_per_sequence,
                                             most_sequences_pipeline, most_sequences_tensor)
    from kimi_mlx.server.serving import DEFAULT_DISK_BYTES

    ctx, seqs = plan.context, plan.sequences
    fmt = model.kv_format()
    try:
        plan_bf16 = planner.plan(bf16, nodes, ctx, seqs)
    except PlanError:
        plan_bf16 = None
    dsa = [l for l in model.layers if l.cache_bytes_per_token]
    lines = [f"DSA cache {fmt} (--kv-bits {model.kv_bits} --kv-group-size "
             f"{model.kv_group_size}) beside bf16, at {ctx} tokens x {seqs} sequence(s):"]
    if dsa:
        latent, rope, index = dsa[0].cache_values
        act, bits, g = dsa[0].cache_act_bytes, model.kv_bits, model.kv_group_size
        lat_b, idx_b = latent * bits // 8, index * bits // 8
        # scales and biases: what kv_token_bytes adds to the packed values (its group rule)
        lat_s = kv_token_bytes(latent, act, bits, g) - lat_b
        idx_s = kv_token_bytes(index, act, bits, g) - idx_b
        lines.append(
            f"  per DSA layer per token: latent {lat_b} B + {lat_s} B of scales "
            f"and biases, rope key {rope * act} B, index key {idx_b} B + "
            f"{idx_s} B = {dsa[0].cache_bytes_per_token:,} B "
            f"(bf16: {bf16.layers[dsa[0].index].cache_bytes_per_token:,} B)")

    def stages(p: Optional[Plan], what) -> str:
        if p is None:
            return "does not fit"
        return " / ".join(what(st) for st in p.used_stages)

    def snap_bytes(m: ModelBytes, st) -> int:
        return sum(l.cache_bytes(ctx, 1) for l in m.layers[st.start:st.end])

    def snap(m: ModelBytes):
        return lambda st: _gb(snap_bytes(m, st))

    def on_disk(p: Optional[Plan], m: ModelBytes) -> str:
        """Snapshot files of one sequence the default disk budget holds on the fullest stage."""
        if p is None:
            return "-"
        return str(DEFAULT_DISK_BYTES // max(max(snap_bytes(m, st) for st in p.used_stages), 1))

    disk_gib = f"{DEFAULT_DISK_BYTES / GiB:.0f} GiB"

    rows = [("", fmt, "bf16"),
            ("cache per token, all layers", f"{model.cache_bytes_per_token:,} B",
             f"{bf16.cache_bytes_per_token:,} B "
             f"({model.cache_bytes_per_token / max(bf16.cache_bytes_per_token, 1):.2f}x)"),
            (f"DSA cache, {seqs} sequence(s) (GB)",
             _gb(model.cache_bytes_per_token * ctx * seqs),
             _gb(bf16.cache_bytes_per_token * ctx * seqs)),
            ("cache per stage (GB, with KDA state)",
             stages(plan, lambda st: _gb(st.cache_bytes)),
             stages(plan_bf16, lambda st: _gb(st.cache_bytes))),
            ("snapshot per stage, one sequence (GB)", stages(plan, snap(model)),
             stages(plan_bf16, snap(bf16))),
            (f"  files in --prompt-cache-disk-bytes {disk_gib} (fullest stage)",
             on_disk(plan, model), on_disk(plan_bf16, bf16)),
            ("cache read per step per sequence (GB)",
             _gb(cache_read_bytes_per_sequence(model, ctx)),
             _gb(cache_read_bytes_per_sequence(bf16, ctx))),
            ("  of it index keys (GB)",
             *(_gb(sum(l.index_bytes_per_token for l in m.layers) * ctx) for m in (model, bf16))),
            (f"pipeline decode tok/s ({seqs} sequence(s))",
             f"{plan.aggregate_tokens_per_s:.1f}",
             "-" if plan_bf16 is None else f"{plan_bf16.aggregate_tokens_per_s:.1f}"),
            (f"pipeline: most sequences at {ctx}",
             str(most_sequences_pipeline(planner, model, nodes, ctx)),
             str(most_sequences_pipeline(planner, bf16, nodes, ctx)))]
    if len(nodes) > 1:
        jaccl, tcp = args.jaccl_latency_us * 1e-6, args.tcp_latency_us * 1e-6
        try:
            targs, tensors = tensors_of(args.model, build)
            bws = [n.bandwidth_bytes_per_s for n in nodes]
            tps = [tensor_plan_for(tensors, targs, bws, ctx, **kv) for kv in
                   (_kv(args), dict(kv_bits=None))]
            snaps = [snapshot_bytes_per_rank(targs, tps[0].ranks, **kv) for kv in
                     (_kv(args), dict(kv_bits=None))]
        except ShardError:
            tps = []
        if tps:
            rows += [
                (f"cache per tensor rank, {seqs} sequence(s) (GB)",
                 *(_gb(t.cache_bytes * seqs) for t in tps)),
                ("snapshot per tensor rank, one sequence (GB)",
                 *(_gb(state + per_token * ctx) for state, per_token in snaps)),
                (f"  files in --prompt-cache-disk-bytes {disk_gib} (per rank)",
                 *(str(DEFAULT_DISK_BYTES // max(state + per_token * ctx, 1))
                   for state, per_token in snaps)),
                (f"tensor decode tok/s over JACCL ({seqs} rows)",
                 *(f"{t.aggregate_tokens_per_s(jaccl, seqs):.1f}" for t in tps)),
                (f"tensor decode tok/s over TCP ({seqs} rows)",
                 *(f"{t.aggregate_tokens_per_s(tcp, seqs):.1f}" for t in tps)),
                (f"tensor group: most sequences at {ctx}",
                 *(str(most_sequences_tensor(t, nodes, planner)) for t in tps)),
            ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines += [f"  {a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]
    return lines
