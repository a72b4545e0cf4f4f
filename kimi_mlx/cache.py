"""Caches of our layers and what the server does with them.

- KDA layers: mlx-lm `ArraysCache(2)` ([conv state, recurrent state]).
- Gated DSA layers: `DSACache` (kimi_mlx/dsa.py): latent + rope key + indexer key per token.

`snapshot` / `restore` copy a whole model cache for the prompt cache across requests:
MLX arrays are immutable values, so a snapshot holds references, not copies; the only
in-place writes (KVCache's slice assignment into its preallocated buffer) never reach a
snapshot because snapshots hold slices of exactly `offset` tokens, and a restored cache
grows into a new buffer (concatenation) before it writes.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from mlx_lm.models.cache import ArraysCache

from .dsa import DSACache

Snapshot = List[Tuple[str, Any]]


def snapshot(cache: List[Any]) -> Snapshot:
    """Per-layer immutable state of a single-sequence model cache (see module doc).

    Raises TypeError for a cache type this module does not know."""
    out: Snapshot = []
    for c in cache:
        if isinstance(c, DSACache):
            n = c.offset
            if c.keys is None:
                out.append(("dsa", None))
            else:
                out.append(("dsa", (c.keys[..., :n, :], c.values[..., :n, :],
                                    c.index_keys[..., :n, :], n)))
        elif isinstance(c, ArraysCache):
            out.append(("arrays", list(c.cache)))
        else:
            raise TypeError(f"cannot snapshot a {type(c).__name__}")
    return out


def restore(snap: Snapshot) -> List[Any]:
    """A fresh model cache holding a snapshot's state (the snapshot stays unchanged)."""
    cache: List[Any] = []
    for kind, state in snap:
        if kind == "dsa":
            c = DSACache()
            if state is not None:
                c.keys, c.values, c.index_keys, c.offset = state
        else:
            c = ArraysCache(len(state))
            c.cache = list(state)
        cache.append(c)
    return cache


def snapshot_nbytes(snap: Snapshot) -> int:
    n = 0
    for kind, state in snap:
        if state is None:
            continue
        arrays = state[:3] if kind == "dsa" else state
        n += sum(a.nbytes for a in arrays if a is not None)
    return n
