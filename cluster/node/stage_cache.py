"""The cluster's prompt cache: snapshots on the stages, keys and choices on the head.

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

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

CACHE_MISS = "prompt cache miss"

__all__ = ["CACHE_MISS", "prefix_key", "StageCache", "HeadCacheIndex"]


def prefix_key(ids: Sequence) -> str:
    """The key of the snapshot holding exactly the tokens `ids`: '<length>-<sha256 of
    the int32 little-endian ids, 32 hex digits>'. A prompt with images gives its
    `server.images.cache_key`, whose pads are (pad id, image digest) pairs: each is
    hashed as the pad id then the digest's bytes, so the same text with another image
    has another key from the first image on."""
    ids = list(ids)
    if all(isinstance(t, int) for t in ids):
        data = np.asarray(ids, dtype="<i4").tobytes()
    else:
        h = hashlib.sha256()
        for t in ids:
            if isinstance(t, tuple):
                h.update(np.asarray([t[0]], dtype="<i4").tobytes() + bytes.fromhex(t[1]))
            else:
                h.update(np.asarray([t], dtype="<i4").tobytes())
        return f"{len(ids)}-{h.hexdigest()[:32]}"
    return f"{len(ids)}-{hashlib.sha256(data).hexdigest()[:32]}"


def key_length(key: str) -> int:
    """Positions a snapshot key holds (ValueError when it is not a `prefix_key`)."""
    n, _, digest = key.partition("-")
    if not n.isdigit() or len(digest) != 32:
        raise ValueError(f"prompt cache key {key[:80]!r} is not '<length>-<32 hex digits>'")
    return int(n)


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


class HeadCacheIndex:
    """The head's record of the prefixes it asked the stages to snapshot (token tuples,
    the newest `max_entries`); the stages' own LRUs decide what is still there.

    Args:
        every: snapshot every this many prefill tokens too (0: only at message ends).
        max_entries: prefixes remembered.
    """

    def __init__(self, every: int = 1024, max_entries: int = 4096):
        self.every = every
        self.max_entries = max_entries
        self._prefixes: "OrderedDict[Tuple[int, ...], str]" = OrderedDict()
        self._lock = threading.Lock()

    def candidates(self, ids: Sequence[int]) -> List[Tuple[int, str]]:
        """(length, key) of the remembered prefixes of ids[:-1] (the last prompt token
        always runs), longest first."""
        out = []
        with self._lock:
            for p, key in self._prefixes.items():
                n = len(p)
                if n < len(ids) and tuple(ids[:n]) == p:
                    out.append((n, key))
        return sorted(out, reverse=True)

    def plan(self, ids: Sequence[int], start: int, segment_ends: Sequence[int]) -> Dict[int, str]:
        """{position e: key} of the snapshots to take while prefilling ids from `start`
        (`snapshot_points`), remembered from now on."""
        from kimi_mlx.server.prompt_cache import snapshot_points

        points = snapshot_points(len(ids), start, segment_ends, self.every)
        out = {}
        with self._lock:
            for e in points:
                p = tuple(ids[:e])
                key = self._prefixes.get(p) or prefix_key(p)
                self._prefixes[p] = key
                self._prefixes.move_to_end(p)
                out[e] = key
            while len(self._prefixes) > self.max_entries:
                self._prefixes.popitem(last=False)
        return out
