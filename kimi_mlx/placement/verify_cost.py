"""What a speculative verify step of k drafts costs on the planned Macs, and which k pays.

Bytes of one verify step, i.e. one target pass over a block of T = k + 1 tokens of one
sequence (the last accepted token and k drafts), per layer (`layer_verify_bytes`):

    trunk:   weight_bytes - routed_expert_bytes            (read once for the block)
    experts: routed_expert_bytes x D(T) / E                (the union of the experts the
             block's tokens route to; D from `expert_union`, E the layer's experts)
    caches:  index keys x context + latent rows x min(context, index_topk) + KDA state
             (read once: the block's queries share the keys in one pass, as a decode
             step's do; the DSA top-k rows of neighbouring tokens mostly coincide)

plus the embedding's T rows on the first stage and the head (norm, output AttnRes mix,
lm_head) on the last, read once. At T = 1 this is exactly the plain decode step of
`LayerBytes.read_bytes`. Not counted: the KDA verify record (7P + H bf16 values per
token per KDA layer, 12 MB per token for K3.1: 0.04% of a step) and the replay after a
rejection (one state read and write per KDA layer, 0.9 GB for K3.1, only when a draft is
rejected; `kimi-mlx bench spec` measures it), and compute (bandwidth dominates at these
block sizes: 16 tokens of ~33B active parameters is ~1 TFLOP, tens of ms on an M3 Ultra,
against hundreds of ms of reads).

Rows: a server at `--max-concurrency` B verifies B sequences together, one [B, k + 1]
pass: the trunk is still read once, the routed experts x D(B rows of k + 1 tokens) (the
union over all B(k + 1) tokens, `expert_union.union_experts(..., rows=B)`: locality
within a row's block, none across rows), each row's caches once, B(k + 1) embedding rows.
k = 0 is then the plain batched decode step of B rows with the same union model.

Tensor group (`tensor_verify_seconds`): every rank reads its share of each tensor (the
`tensor_parallel` split) for the same [B, k + 1] block: its share of the trunk, of the
D(B, k + 1) experts' rows, the caches of its KDA heads and the replicated DSA caches per
row; the step takes the largest rank's bytes / the slowest Mac's bandwidth + the
collectives of one step (2 all_sums per layer + the logits' all_gather, whatever the
block: the rows' activations travel together) x latency per collective.

Time: through the pipeline the stages run in turn for one sequence, so a verify step
takes sum_s bytes_s / bandwidth_s + hops x hop latency (as `Plan.seconds_per_step`),
plus the draft's own time per step (`draft_s`, run on the head).

Tokens per step: with a_i the probability that draft i is accepted given drafts before
it were, a step of k drafts yields E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens (the 1:
the target's own token). A published *mean acceptance length* tau (DSpark, DFlash, EAGLE:
tokens per draft-and-verify cycle, the target's own token included) measured with blocks
of B positions (B - 1 drafts) is turned into a constant a by solving
(1 - a^B) / (1 - a) = tau (`alpha_from_acceptance_length`): the geometric model, each
draft accepted with the same conditional probability. tok/s at k = E(k) / step time(k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from kimi_mlx.placement.expert_union import UnionCurve, load_curve
from kimi_mlx.placement.layer_bytes import LayerBytes, ModelBytes
from kimi_mlx.placement.planner import Plan

DSPARK_ACCEPTANCE_LENGTH = 3.45  # LithosAI Kimi-K3.1-Pro-DSpark, mean over 10 benchmarks
DEFAULT_DRAFT_BLOCK = 16  # positions per drafted block the published figure is taken at (assumed)


def layer_verify_bytes(layer: LayerBytes, context: int, distinct: float, rows: int = 1) -> float:
    """Bytes one layer reads for a verify block whose tokens route to `distinct` distinct
    experts in total (module docstring), `rows` sequences' caches. distinct: D(T) (ignored
    by a dense layer; clipped to [0, num_experts])."""
    weights = layer.weight_bytes - layer.routed_expert_bytes
    if layer.num_experts:
        weights += layer.routed_expert_bytes * min(max(distinct, 0.0), layer.num_experts) / layer.num_experts
    attended = context if layer.index_topk is None else min(context, layer.index_topk)
    caches = (layer.index_bytes_per_token * context
              + (layer.cache_bytes_per_token - layer.index_bytes_per_token) * attended
              + layer.state_bytes_per_sequence)
    return weights + rows * caches


def stage_verify_bytes(model: ModelBytes, start: int, end: int, context: int, tokens: int,
                       curve: UnionCurve, rows: int = 1) -> float:
    """Bytes read by the stage holding layers [start, end) for a verify block of `tokens`
    tokens in each of `rows` sequences (embedding rows on the first stage, the head on
    the last)."""
    total = 0.0
    for layer in model.layers[start:end]:
        d = (curve.distinct(tokens, layer.num_experts, layer.experts_per_token, rows)
             if layer.num_experts else 0.0)
        total += layer_verify_bytes(layer, context, d, rows)
    if end > start and start == 0:
        total += model.embed_read_bytes(rows * tokens)
    if end > start and end == len(model.layers):
        total += model.head_bytes
    return total


@dataclass(frozen=True)
class KRow:
    """One k: drafts per step, distinct experts per layer for the block, bytes and seconds
    of a step, tokens per step, tokens/s and the ratio to plain decoding."""

    k: int
    distinct: float
    read_bytes: float
    seconds: float
    tokens_per_step: float
    tokens_per_s: float
    speedup: float
    rows: int = 1  # sequences verified together; tokens_per_step / tokens_per_s: all rows'


def verify_seconds(plan: Plan, model: ModelBytes, k: int, curve: UnionCurve,
                   hop_latency_s: float, draft_s: float = 0.0, rows: int = 1
                   ) -> Tuple[float, float]:
    """(bytes, seconds) of one step verifying k drafts in each of `rows` sequences on
    `plan`'s stages (k = 0: a plain decode step, no draft time)."""
    read = secs = 0.0
    for s in plan.used_stages:
        b = stage_verify_bytes(model, s.start, s.end, plan.context, k + 1, curve, rows)
        read += b
        secs += b / s.node.bandwidth_bytes_per_s
    return read, secs + plan.hops * hop_latency_s + (draft_s if k else 0.0)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j; `acceptance` per position (the last value
    extends to deeper positions)."""
    total = run = 1.0
    for i in range(k):
        run *= acceptance[min(i, len(acceptance) - 1)]
        total += run
    return total


def alpha_from_acceptance_length(tau: float, block: int = DEFAULT_DRAFT_BLOCK) -> float:
    """The constant per-position acceptance a with (1 - a^block) / (1 - a) = tau, i.e.
    the geometric model's E(block - 1) = tau (bisection).

    Raises:
        ValueError: tau outside [1, block] (a block of `block` positions yields 1..block)."""
    if not 1.0 <= tau <= block:
        raise ValueError(f"a mean acceptance length of {tau} is outside [1, {block}] for "
                         f"blocks of {block} positions")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        a = (lo + hi) / 2
        if expected_tokens([a], block - 1) < tau:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def parse_acceptance(text: str, block: int = DEFAULT_DRAFT_BLOCK) -> Tuple[List[float], str]:
    """--draft-acceptance: one number >= 1 is a mean acceptance length (tokens per step,
    the target's own included) at blocks of `block` positions; one number < 1, or a
    comma list of numbers in (0, 1], the per-position acceptance a_1, a_2, ... (the last
    extends). Returns (per-position acceptance, a line saying how it was read).

    Raises:
        ValueError: not numbers, or out of range (names the flag)."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--draft-acceptance: expected a mean acceptance length (e.g. 3.45) "
                         f"or per-position acceptances (e.g. 0.8,0.7,0.6), got {text!r}") from None
    if len(values) == 1 and values[0] >= 1:
        tau = values[0]
        a = alpha_from_acceptance_length(tau, block)
        return [a], (f"mean acceptance length {tau:g} at blocks of {block} positions "
                     f"({block - 1} drafts) -> per-position acceptance a = {a:.3f} "
                     f"(geometric: (1 - a^{block}) / (1 - a) = {tau:g})")
    if not values or not all(0 < v <= 1 for v in values):
        raise ValueError(f"--draft-acceptance: per-position acceptances must be in (0, 1], "
                         f"got {text!r}")
    return values, "per-position acceptance " + ", ".join(f"{v:g}" for v in values)


def k_table(plan: Plan, model: ModelBytes, acceptance: Sequence[float], hop_latency_s: float,
            ks: Sequence[int] = range(1, 17), draft_s: float = 0.0,
            curve: Optional[UnionCurve] = None, rows: int = 1) -> Tuple[KRow, List[KRow]]:
    """(the plain step as k = 0, one row per k in `ks`) for `plan` and the acceptance,
    `rows` sequences verified together (tokens per step and tok/s: all rows')."""
    curve = curve or load_curve()
    return _rows_table(lambda k: verify_seconds(plan, model, k, curve, hop_latency_s,
                                                draft_s, rows),
                       model.num_experts, model.experts_per_token, acceptance, ks, curve, rows)


def _rows_table(cost, num_experts: int, top_k: int, acceptance: Sequence[float],
                ks: Sequence[int], curve: UnionCurve, rows: int) -> Tuple[KRow, List[KRow]]:
    """k_table's rows from `cost(k)` -> (bytes, seconds) of one step."""

    def row(k: int) -> KRow:
        b, t = cost(k)
        e = rows * expected_tokens(acceptance, k)
        d = curve.distinct(k + 1, num_experts, top_k, rows) if num_experts else 0.0
        return KRow(k, d, b, t, e, e / t, 1.0, rows)

    plain = row(0)
    return plain, [KRow(r.k, r.distinct, r.read_bytes, r.seconds, r.tokens_per_step,
                        r.tokens_per_s, r.tokens_per_s / plain.tokens_per_s, rows)
                   for r in map(row, ks)]


def tensor_verify_bytes(tensors, args, ranks: int, context: int, k: int, curve: UnionCurve,
                        rows: int = 1, classes=None) -> int:
    """Bytes the largest-read rank of a `ranks`-Mac tensor group reads for one step
    verifying k drafts in each of `rows` sequences (module docstring): its share of every
    non-expert tensor (`tensor_parallel.rank_read_bytes` without the experts, at `rows`
    sequences: their caches and embedding rows), plus the rows' other k embedding rows
    each and its share of the routed experts x D(rows, k + 1) / E.

    Args: tensors, args: `tensor_parallel.tensors_of`; context: tokens per sequence;
        classes: `tensor_parallel._classes` of them if already computed (K3.1: seconds)."""
    from kimi_mlx.placement.tensor_parallel import _classes, _lm_head, _share, rank_read_bytes

    classes = classes or _classes(tensors, args, _lm_head(args, ranks, None))
    trunk = {c: n for c, n in classes.items() if not c.expert}
    e, top = args.num_experts, args.num_experts_per_token
    frac = curve.distinct(k + 1, e, top, rows) / e if e else 0.0
    best = 0
    for r in range(ranks):
        b = rank_read_bytes(tensors, args, ranks, r, context, classes=trunk, sequences=rows)
        for c, n in classes.items():
            share = _share(c, ranks, r) * c.nbytes * n
            if c.expert:
                b += share * frac
            elif c.embed_rows:
                b += share * rows * k / c.embed_rows
        best = max(best, int(b))
    return best


def tensor_k_table(tensor_plan, tensors, args, context: int, acceptance: Sequence[float],
                   latency_s: float,
                   ks: Sequence[int] = range(1, 17), draft_s: float = 0.0,
                   curve: Optional[UnionCurve] = None, rows: int = 1
                   ) -> Tuple[KRow, List[KRow]]:
    """`k_table` for a tensor group (`tensor_parallel.TensorPlan`): a step takes
    `tensor_verify_bytes` / the plan's bandwidth + its collectives x `latency_s` (+ the
    drafter's `draft_s` when k > 0), at `context` tokens per sequence."""
    from kimi_mlx.placement.tensor_parallel import _classes, _lm_head

    curve = curve or load_curve()
    ranks = tensor_plan.ranks
    classes = _classes(tensors, args, _lm_head(args, ranks, None))

    def cost(k: int) -> Tuple[float, float]:
        b = tensor_verify_bytes(tensors, args, ranks, context, k, curve, rows, classes)
        return b, (b / tensor_plan.bandwidth + tensor_plan.collectives * latency_s
                   + (draft_s if k else 0.0))

    return _rows_table(cost, args.num_experts, args.num_experts_per_token, acceptance, ks,
                       curve, rows)


def best_row(table: Tuple[KRow, List[KRow]]) -> KRow:
    """The row of a `k_table` / `tensor_k_table` result with the most tok/s, plain (k = 0)
    included; plain on a tie."""
    plain, rows = table
    return max([plain] + list(rows), key=lambda r: (r.tokens_per_s, -r.k))


def choose_with_drafts(pipeline: Optional[Tuple[KRow, List[KRow]]],
                       tensor: Optional[Tuple[KRow, List[KRow]]], tensor_fits: bool,
                       concurrency: int) -> Tuple[str, str]:
    """("tensor" | "pipeline", why in one line) for a server that drafts, at
    `concurrency` sequences verified together: each mode at its best k (`best_row` of its
    speculative table, k = 0 included, tok/s of all rows), the higher wins; a tie keeps
    the pipeline, as `tensor_parallel.choose_for_server` does. The line also says when
    the plain figures of the same tables would choose the other mode.

    Args:
        pipeline: `k_table(..., rows=concurrency)` of the pipeline, None when it does not fit.
        tensor: `tensor_k_table(..., rows=concurrency)` of the group, None when no group
            is possible (heads that do not split).
        tensor_fits: whether the group holds `concurrency` sequences
            (`tensor_parallel.tensor_fits`)."""
    if tensor is None:
        return "pipeline", "a tensor group is not possible here (heads or memory)"
    if not tensor_fits:
        return "pipeline", "a tensor group does not fit in the Macs' memory"
    t = best_row(tensor)
    if pipeline is None:
        return "tensor", (f"the pipeline does not fit; the tensor group with drafts "
                          f"predicts {t.tokens_per_s:.1f} tok/s at k = {t.k}")
    p = best_row(pipeline)
    choice = "tensor" if t.tokens_per_s > p.tokens_per_s else "pipeline"
    plain = "tensor" if tensor[0].tokens_per_s > pipeline[0].tokens_per_s else "pipeline"
    why = (f"with drafts at --max-concurrency {concurrency} the planner predicts "
           f"{t.tokens_per_s:.1f} tok/s for the tensor group at k = {t.k} (plain "
           f"{tensor[0].tokens_per_s:.1f}) vs {p.tokens_per_s:.1f} for the pipeline at "
           f"k = {p.k} (plain {pipeline[0].tokens_per_s:.1f})")
    if plain != choice:
        why += f"; without drafts it would be the {plain}"
    return choice, why
