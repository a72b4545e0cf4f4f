"""The DSA cache format in the plan: `--kv-bits 8` against the bf16 cache.

What `kimi-mlx plan --kv-bits` prints beside the bf16 figures: bytes per token
(`layer_bytes.kv_token_bytes`, `LayerBytes.with_kv_bits`), cache and snapshot bytes per
stage and per tensor rank, the cache bytes a decode step reads (the indexer scores every
index key of a sequence, the attention reads index_topk latent rows), and the most
sequences of a given context that fit (`most_sequences_pipeline`,
`most_sequences_tensor`).
"""

from __future__ import annotations

from typing import Sequence

from kimi_mlx.placement.layer_bytes import ModelBytes
from kimi_mlx.placement.planner import Node, PlanError, StagePlanner
from kimi_mlx.placement.tensor_parallel import TensorPlan

__all__ = ["most_sequences_pipeline", "most_sequences_tensor", "cache_read_bytes_per_sequence",
           "MAX_SEQUENCES"]

MAX_SEQUENCES = 1 << 16  # the search stops here (more is reported as this many)


def most_sequences_pipeline(planner: StagePlanner, model: ModelBytes, nodes: Sequence[Node],
                            context: int, cap: int = MAX_SEQUENCES) -> int:
    """The largest number of sequences of `context` tokens for which `planner` finds a
    pipeline placement of `model` on `nodes` (every stage's weights + caches + headroom
    within its Mac's usable memory); 0 if not even one fits, `cap` if `cap` fits.

    Raises:
        ValueError: context < 1 or bad nodes (from `StagePlanner.plan`)."""

    def fits(n: int) -> bool:
        try:
            planner.plan(model, nodes, context, n)
        except PlanError:
            return False
        return True

    if not fits(1):
        return 0
    lo, hi = 1, 2  # lo fits; hi is the next to try
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return cap if fits(cap) else _search(fits, lo, cap)
    return _search(fits, lo, hi)


def _search(fits, lo: int, hi: int) -> int:
    """Largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def most_sequences_tensor(tp: TensorPlan, nodes: Sequence[Node], planner: StagePlanner) -> int:
    """The most sequences of the plan's context a tensor group holds: every rank keeps its
    share of the weights (the largest rank's `load_bytes`) and, per sequence, the DSA
    caches whole (replicated) plus its KDA heads' states (`tp.cache_bytes`, one sequence);
    each Mac keeps the planner's headroom free. 0 if not even one fits."""
    per_seq = max(tp.cache_bytes, 1)
    room = min(n.usable_bytes - planner._headroom(n) for n in nodes) - max(tp.load_bytes)
    return max(0, room // per_seq)


def cache_read_bytes_per_sequence(model: ModelBytes, context: int) -> int:
    """Cache bytes one decode step reads for one sequence at `context` tokens, all layers:
    every index key (the indexer scores them all), min(context, index_topk) latent + rope
    rows, and the KDA states (`LayerBytes.read_bytes` without the weights)."""
    total = 0
    for l in model.layers:
        attended = context if l.index_topk is None else min(context, l.index_topk)
        total += (l.index_bytes_per_token * context
                  + (l.cache_bytes_per_token - l.index_bytes_per_token) * attended
                  + l.state_bytes_per_sequence)
    return total
