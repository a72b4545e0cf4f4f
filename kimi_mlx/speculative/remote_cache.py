"""The cache a speculative loop sees for a target whose layers run elsewhere."""
from __future__ import annotations

from typing import List

import mlx.core as mx


class RemoteCache:
    """A remote target's caches (the pipeline's stages, or a tensor group's ranks) as the
    one-process loop sees them: one trimmable KV-like cache whose offset is the target's
    position (`kimi_mlx.speculative.rollback` snapshots it as an offset and trims it after
    a verify step). `target` has `offset` and `trim(n)` (`PipelineTarget`,
    `tensor_step.GroupTarget`)."""

    def __init__(self, target):
        self.target = target

    @property
    def offset(self) -> int:
        return self.target.offset

    @property
    def state(self) -> List[mx.array]:
        return []  # nothing to evaluate on the head

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.target.trim(n)
