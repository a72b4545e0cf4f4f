"""Hidden-state capture on a pipeline stage, for block drafters (DFlash / DSpark).

A drafter on the head reads the target's hidden states leaving its `target_layer_ids`
(`kimi_mlx.speculative.block_loop`). Through the pipeline, a chunk that asks for them
carries `Activation.capture_layers` (global 0-based layer ids, strictly ascending). Each
stage runs its layers with `TextModel.run_layers(capture=...)` on the ids it owns and
appends those rows, [n_own, length, hidden], to what the stages before it captured
(`Activation.captured`, [n_before, length, hidden], in the wire dtype); the last stage
answers with all of them (`Event.hidden`). Rows therefore travel in ascending layer
order, one copy per layer, forward with the activations: no extra message, and nothing
at all when no drafter asks (no ids: `capture` is None, `run_layers` records nothing).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

__all__ = ["CapturePlan", "plan_capture"]


class CapturePlan:
    """What one stage captures for one chunk.

    Attributes:
        ids: every requested layer id (ascending). own: those in [start, end).
        before: how many ids lie below `start` (the rows that arrive in `captured`).
    """

    def __init__(self, ids: Sequence[int], start: int, end: int):
        self.ids = [int(i) for i in ids]
        self.own = [i for i in self.ids if start <= i < end]
        self.before = sum(1 for i in self.ids if i < start)

    def prior_shape(self, length: int, hidden: int) -> Optional[Tuple[int, int, int]]:
        """The shape `Activation.captured` must have on arrival ([before, length, hidden]),
        or None when it must be absent (no id below this stage)."""
        return (self.before, length, hidden) if self.before else None

    def slots(self) -> Dict[int, Optional[mx.array]]:
        """The `capture` dict for `TextModel.run_layers` (this stage's ids -> None)."""
        return {i: None for i in self.own}

    def collect(self, prior: Optional[mx.array], slots: Dict[int, Optional[mx.array]],
                dtype: mx.Dtype) -> Optional[mx.array]:
        """prior [before, L, D] (or None) followed by this stage's captured rows (from
        `slots` filled by `run_layers`, each [1, L, D]) -> [before + own, L, D] in `dtype`,
        or None when nothing was captured yet."""
        rows: List[mx.array] = [] if prior is None else [prior.astype(dtype)]
        rows += [slots[i][0][None].astype(dtype) for i in self.own]
        return mx.concatenate(rows, axis=0) if rows else None


def plan_capture(ids: Sequence[int], start: int, end: int, num_layers: int,
                 who: str) -> CapturePlan:
    """The `CapturePlan` of a chunk's `capture_layers` on the stage holding [start, end).

    Raises:
        ValueError: naming `who`, for ids that are not strictly ascending or not in
            [0, num_layers) (the service turns it into a refusal).
    """
    ids = [int(i) for i in ids]
    if any(b <= a for a, b in zip(ids, ids[1:])) or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"{who}: capture_layers {ids[:16]} must be strictly ascending layer "
                         f"ids in [0, {num_layers})")
    return CapturePlan(ids, start, end)
