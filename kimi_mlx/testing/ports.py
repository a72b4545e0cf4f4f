"""Free TCP ports for the multi-process tests (stages, servers, ring ranks)."""
from __future__ import annotations

import random
from typing import List

PORT_RANGE = (20000, 32768)  # [lo, hi): below every common OS's ephemeral port range


def free_ports(n: int, consecutive: bool = False, host: str = "127.0.0.1") -> List[int]:
    """n TCP ports that can be bound on `host` now (each checked by binding it without
    SO_REUSEADDR, as MLX's ring backend binds); `consecutive`: p, p + 1, ... (a node's
    rank listens on its gRPC port + 1).

    The ports are drawn at random below the ephemeral ranges (`PORT_RANGE`, under Linux's
    32768-60999 and macOS's 49152-65535), not asked of the kernel with bind(0): a port the
    kernel hands out is an ephemeral one, and a test that stops a node and starts it again
    on its port can then find it taken as the source port of some other process's
    outgoing connection (EADDRINUSE; seen with several suites on one machine). Raises
    RuntimeError after 500 tries."""
    import socket

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return True
            except OSError:
                return False

    draw = random.SystemRandom()
    out: List[int] = []
    for _ in range(500):
        first = draw.randrange(PORT_RANGE[0], PORT_RANGE[1] - n)
        want = range(first, first + n) if consecutive else [first]
        if first + n > 65535 or first in out or not all(bindable(p) for p in want):
            continue
        out.extend(want)
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"no {n} free TCP port(s) on {host} after 500 tries")
