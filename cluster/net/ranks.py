"""What a head and a node agree on to run a tensor-parallel rank: the backends, the rank's
port, and the error that names a node that cannot join (`node.rank` runs the rank,
`tensor.group` forms the group)."""

from __future__ import annotations

import subprocess
import sys
from typing import List

import mlx.core as mx

RANK_PORT_OFFSET = 1  # a node's rank listens on its serve port + 1
BACKENDS = ("ring", "jaccl")


class TensorSetupError(RuntimeError):
    """A group that cannot be formed (names the node and what it lacks)."""


def available_backends() -> List[str]:
    """MLX distributed backends this install can join (of `BACKENDS`)."""
    return [b for b in BACKENDS if mx.distributed.is_available(backend=b)]


def process_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP / SIGTSTP): /proc on Linux, ps elsewhere."""
    try:
        if sys.platform.startswith("linux"):
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                             text=True, timeout=2).stdout.strip()
        return out.startswith("T")
    except (OSError, IndexError, subprocess.SubprocessError):
        return False
