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

import threading
from collections import OrderedDict
from typing import Any, Iterable, List, Optional, Tuple


__all__ = ["StageCache"]


class StageCache:
    """One stage's LRU of (key -> snapshot of its layers' caches, positions held), at most
    `max_bytes` bytes of arrays (`snapshot_nbytes`). Thread-safe; snapshots and restores
    run on the stage's MLX thread."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(int(max_bytes), 0)
        self.nbytes = 0
        self.evictions = 0
        self._entries: "OrderedDict[str, Tuple[Any, int, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def store(self, key: str, length: int, cache: List[Any]) -> bool:
        """Keep a snapshot of `cache` (holding `length` positions) under `key`, dropping
        the least recently used ones for room; False when one snapshot alone is larger
        than the bound (nothing is kept)."""
        from kimi_mlx.model.cache import snapshot, snapshot_nbytes

        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
        snap = snapshot(cache)
        size = snapshot_nbytes(snap)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._entries[key] = (snap, length, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, _, n) = self._entries.popitem(last=False)
                self.nbytes -= n
                self.evictions += 1
        return True

    def restore(self, key: str, length: int) -> Optional[List[Any]]:
        """A fresh cache from the snapshot under `key` (None when not held, or when it holds
        another number of positions)."""
        from kimi_mlx.model.cache import restore

        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[1] != length:
                return None
            self._entries.move_to_end(key)
        return restore(entry[0])

    def held(self, keys: Iterable[str]) -> List[str]:
        """The keys of `keys` held now (marked recently used)."""
        out = []
        with self._lock:
            for k in keys:
                if k in self._entries:
                    self._entries.move_to_end(k)
                    out.append(k)
        return out
