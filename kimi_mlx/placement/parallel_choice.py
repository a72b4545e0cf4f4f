"""`--parallel auto` from a checkpoint and the Macs: the pipeline or a tensor group.

`choose_parallel` is what `cluster launch` / `cluster server --parallel auto` ask (through
`kimi_mlx.cluster.launch.recommended`); `kimi-mlx plan` prints the same choice from the
tables it has already computed. Both modes are planned for `sequences` sequences
(`--max-concurrency`) of `context` tokens with the `--kv-bits` cache format:

- the pipeline: `planner.StagePlanner` (every stage holds all sequences' caches of its
  layers); None when it does not fit;
- the tensor group: `tensor_parallel.tensor_plan_for`, and it must hold all sequences'
  caches on every rank (`tensor_parallel.tensor_fits`, the planner's headroom kept).

Without drafts the higher predicted aggregate plain decode wins
(`tensor_parallel.choose_for_server`); with drafts each mode's best k of its speculative
table at `sequences` rows (`verify_cost.k_table` / `tensor_k_table`, the acceptance of
`--draft-acceptance`, default DSpark's published 3.45) (`verify_cost.choose_with_drafts`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from kimi_mlx.placement.layer_bytes import KV_CACHE_DEFAULT_GROUP, BuildSpec, model_bytes
from kimi_mlx.placement.planner import Node, PlanError, StagePlanner
from kimi_mlx.placement.tensor_parallel import (choose_for_server, tensor_fits,
                                               tensor_plan_for, tensors_of)
from kimi_mlx.placement.verify_cost import (DSPARK_ACCEPTANCE_LENGTH, choose_with_drafts,
                                            k_table, parse_acceptance, tensor_k_table)

__all__ = ["ParallelChoice", "choose_parallel"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelChoice:
    """What `choose_parallel` decided: `mode` "pipeline" | "tensor", `why` one line with
    the figures (tok/s of all rows), `tensor_fits` whether the group holds the sequences."""

    mode: str
    why: str
    tensor_fits: bool


def choose_parallel(model: str, nodes: Sequence[Node], context: int, sequences: int,
                    latency_s: float, drafts: bool = False,
                    tensor_nodes: Optional[Sequence[Node]] = None,
                    kv_bits: Optional[int] = None,
                    kv_group_size: int = KV_CACHE_DEFAULT_GROUP,
                    planner: Optional[StagePlanner] = None,
                    build: Optional[BuildSpec] = None,
                    acceptance: str = str(DSPARK_ACCEPTANCE_LENGTH),
                    max_draft_tokens: int = 16) -> ParallelChoice:
    """The pipeline over `nodes` or a tensor group of one rank per `tensor_nodes` (default
    `nodes`) for `sequences` sequences of `context` tokens (module docstring).

    Args:
        model: a checkpoint folder or hub id (`layer_bytes.model_bytes`; nothing is
            downloaded). latency_s: seconds per collective of the group's link.
        drafts: the server drafts: decide on each mode's best k (`acceptance`:
            `--draft-acceptance`'s text, k up to `max_draft_tokens`).
        kv_bits, kv_group_size: the `--kv-bits` cache format (None: bf16).
        build: a planned build (`--q-bits`, `--keep`, ...), for `kimi-mlx plan`.

    Raises:
        ValueError: sequences or context < 1, a bad acceptance. (A cache format the
            planner cannot count, e.g. a group that does not divide a cache's values,
            is one warning and the caches counted in the model dtype.)
        FileNotFoundError: no config for `model`."""
    if sequences < 1 or context < 1:
        raise ValueError(f"sequences and context must be >= 1 (got {sequences}, {context})")
    from kimi_mlx.model.shard import ShardError

    planner = planner or StagePlanner()
    tensor_nodes = list(tensor_nodes if tensor_nodes is not None else nodes)
    mb = model_bytes(model, build)
    if kv_bits is not None:
        try:
            mb = mb.with_kv_bits(kv_bits, kv_group_size)
        except ValueError as e:  # a format the cache refuses too (a 16-value key)
            log.warning("--parallel auto counts the caches in the model dtype: %s", e)
            kv_bits = None
    try:
        plan = planner.plan(mb, list(nodes), context, sequences)
    except PlanError:
        plan = None
    tp, fits, targs, tensors = None, False, None, None
    try:
        targs, tensors = tensors_of(model, build)
        tp = tensor_plan_for(tensors, targs, [n.bandwidth_bytes_per_s for n in tensor_nodes],
                             context, kv_bits=kv_bits, kv_group_size=kv_group_size)
        fits = tensor_fits(tp, tensor_nodes, sequences, planner._headroom)
    except (ShardError, ValueError):  # heads or experts that do not split so
        tp = None
    if not drafts or not mb.num_experts or tp is None or not fits:
        mode, why = choose_for_server(0.0 if plan is None else plan.tokens_per_s, sequences,
                                      tp, latency_s, fits, sequences)
        return ParallelChoice(mode, why, fits)
    values, _ = parse_acceptance(acceptance)
    ks = range(1, max(1, max_draft_tokens) + 1)
    pipeline = (None if plan is None else
                k_table(plan, mb, values, planner.hop_latency_s, ks, rows=sequences))
    tensor = tensor_k_table(tp, tensors, targs, context, values, latency_s, ks,
                            rows=sequences)
    mode, why = choose_with_drafts(pipeline, tensor, fits, sequences)
    return ParallelChoice(mode, why, fits)
