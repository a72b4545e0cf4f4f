"""Free TCP ports for the multi-process tests (stages, servers, ring ranks)."""
from __future__ import annotations

from typing import List


def free_ports(n: int, consecutive: bool = False, host: str = "127.0.0.1") -> List[int]:
    """n TCP ports that can be bound on `host` now (each checked by binding it without
    SO_REUSEADDR, as MLX's ring backend binds); `consecutive`: p, p + 1, ... (a node's
    rank listens on its gRPC port + 1).

    Fixed ports in the ephemeral range (32768-60999 on Linux) fail now and then in a long
    suite: an earlier test's connection can leave the port in TIME_WAIT, and the ring
    backend's bind then fails with EADDRINUSE. Raises RuntimeError after 200 tries."""
    import socket

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return True
            except OSError:
                return False

    out: List[int] = []
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        want = range(first, first + n) if consecutive else [first]
        if first + n > 65535 or first in out or not all(bindable(p) for p in want):
            continue
        out.extend(want)
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"no {n} free TCP port(s) on {host} after 200 tries")
