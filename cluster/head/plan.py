"""A pipeline's placement from the head: the stage planner over the accepted nodes, and
the one activation dtype every stage computes in."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from kimi_mlx.cluster.head.transport import StageAssignment
from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.discovery import NodeInfo


def checkpoint_dtype(model_dir: Path) -> str:
    """Wire name of the embedding's dtype in a checkpoint ("bfloat16" for the release)."""
    from kimi_mlx.checkpoint.loader import read_header, weight_map

    wm = weight_map(Path(model_dir))
    for name in ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight"):
        if name in wm:
            dt = read_header(Path(model_dir) / wm[name])[name].dtype
            return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dt, "bfloat16")
    return "bfloat16"


def choose_compute_dtype(replies: Sequence[pb.HealthReply], model_dir: Path, requested: str) -> str:
    """The one activation dtype of the pipeline: `requested` unless "auto"; auto is
    float32 when any stage computes on a CPU (as the loader chooses there), else the
    checkpoint's embedding dtype."""
    if requested != "auto":
        return requested
    if any(r.default_dtype == "float32" for r in replies):
        return "float32"
    return checkpoint_dtype(model_dir)


def plan_stages(model_dir: Path, nodes: List[NodeInfo], context: int, sequences: int = 1,
                kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None):
    """Plan with the stage planner for `sequences` sequences of `context` tokens whose DSA
    caches the stages keep in the `--kv-bits` format (`kv_bits` None: the model dtype;
    `kv_group_size` None: model/cache.py's default group), as `kimi-mlx plan --kv-bits`
    counts them (`ModelBytes.with_kv_bits`); returns (Plan, [StageAssignment]) for the
    used nodes.

    Raises:
        PlanError: the model does not fit these nodes (message says by how much).
        ValueError: a cache format the stages would refuse too (names the flag).
    """
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP
    from kimi_mlx.placement.layer_bytes import model_bytes
    from kimi_mlx.placement.planner import StagePlanner

    model = model_bytes(str(model_dir))
    if kv_bits:
        model = model.with_kv_bits(kv_bits, kv_group_size or KV_DEFAULT_GROUP)
    plan = StagePlanner().plan(model, [n.planner_node() for n in nodes], context, sequences)
    by_id = {n.node_id: n for n in nodes}
    return plan, [StageAssignment(by_id[name], s, e) for name, s, e in plan.ranges()]


def describe_plan(assignments: List[StageAssignment]) -> List[str]:
    """One line per stage for the launcher's log."""
    return [a.describe(i) for i, a in enumerate(assignments)]
