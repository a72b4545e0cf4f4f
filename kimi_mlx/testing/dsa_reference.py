"""The 8-bit DSA cache read the way it was before the Gated DSA layer read it packed: the
whole latent and every index key dequantized on every call (`DSACache.update_and_fetch_all`),
then the layer's model-dtype path on those arrays. Kept as the independent reference for
the packed read (tests/test_kv8_packed_read.py) and as the "before" column of
`make bench-kv` (kimi_mlx/bench/kv_memory.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from kimi_mlx.model.cache import BatchDSACache
from kimi_mlx.model.dsa import GatedDSA


class _Dequantizing:
    """A quantized DSA cache (or a batch view of one) as the layer's model-dtype path sees
    it: no `kv_bits`, so the layer calls `update_and_fetch_all`, which returns the whole
    cache dequantized."""

    def __init__(self, cache):
        self._cache = cache
        self.offset = cache.offset
        self.starts = getattr(cache, "starts", None)

    def update_and_fetch_all(self, latent, k_pe, k_idx):
        return self._cache.update_and_fetch_all(latent, k_pe, k_idx)


@contextlib.contextmanager
def dequantize_everything() -> Iterator[None]:
    """Inside the block every `GatedDSA` reads an 8-bit cache dequantized whole (the cache
    is written as always, so a cache filled inside reads back the same outside). Batched
    caches too: `GatedDSA` hands a `BatchDSACache`'s row view back to `__call__`. Not
    thread-safe (patches the class)."""
    real = GatedDSA.__call__

    def call(self, x, cache=None):
        if getattr(cache, "kv_bits", None) and not isinstance(cache, BatchDSACache):
            cache = _Dequantizing(cache)  # (a batch comes back here as its row view)
        return real(self, x, cache)

    GatedDSA.__call__ = call
    try:
        yield
    finally:
        GatedDSA.__call__ = real
