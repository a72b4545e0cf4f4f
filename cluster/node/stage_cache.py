"""The cluster's prompt cache: snapshots on the stages (here), keys (`net.cache_keys`) and
choices on the head (`head.cache_index`).

Each stage keeps snapshots of its own layers' caches (`kimi_mlx.model.cache.snapshot`:
references to the append-only DSA arrays, the KDA conv / recurrent state as it was) in a
`StageCache`, an LRU bounded by bytes (`cluster serve --cache-bytes`). The head decides
where snapshots are taken, with the one-process server's policy
(`kimi_mlx.server.prompt_cache.snapshot_points`: message ends, every N prefill tokens),
and names them by their token prefix (`prefix_key`). It remembers which prefixes it
asked for in a `HeadCacheIndex`; before a request it asks every stage which of the
candidate prefixes it still holds (`CacheLookup`) and restores the longest one they all
hold. A snapshot evicted on any stage, or a stage restarted (its cache empty), only
shortens the prefix restored, down to a full prefill; never a wrong answer, since every
stage restores the same prefix or the session is refused ("prompt cache miss") and the
head prefills in full.
"""

from __future__ import annotations

from kimi_mlx.server.prompt_cache import KeyedSnapshotCache


__all__ = ["StageCache"]


class StageCache(KeyedSnapshotCache):
    """One stage's LRU of (key -> snapshot of its layers' caches, positions held), at most
    `max_bytes` bytes of arrays (`server.prompt_cache.KeyedSnapshotCache`)."""
