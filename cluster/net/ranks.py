"""What a head and a node agree on to run a tensor-parallel rank: the backends, the rank's
port, and the error that names a node that cannot join (`node.rank` runs the rank,
`tensor.group` forms the group)."""

from __future__ import annotations

from typing import List

import mlx.core as mx

RANK_PORT_OFFSET = 1  # a node's rank listens on its serve port + 1
BACKENDS = ("ring", "jaccl")


class TensorSetupError(RuntimeError):
    """A group that cannot be formed (names the node and what it lacks)."""


def available_backends() -> List[str]:
    """MLX distributed backends this install can join (of `BACKENDS`)."""
    return [b for b in BACKENDS if mx.distributed.is_available(backend=b)]
