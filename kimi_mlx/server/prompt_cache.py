"""Prompt cache across requests: snapshots of the whole model cache (KDA conv + recurrent
state, DSA latents / rope keys / index keys) taken at segment ends (end of the system
prompt, of each earlier turn) and every `every` prefill tokens, in an LRU bounded by bytes.

KDA state cannot be trimmed, so a request can only start from a snapshot whose tokens are
a prefix of its prompt; the longest such prefix wins. A hit restores a fresh cache from
the snapshot (`kimi_mlx.model.cache.restore`), so a request never sees another's state, and at
least the last prompt token always runs (it gives the first token's logits).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from kimi_mlx.model.cache import restore, snapshot, snapshot_nbytes


def snapshot_points(n_ids: int, start: int, segment_ends: Sequence[int], every: int) -> List[int]:
    """The snapshot policy (the one-process engine and the cluster head both use it):
    sorted prompt positions e (start < e < n_ids) where a snapshot of the first e tokens
    is kept: the segment ends (message ends), and every `every` tokens (0: none) short
    of the last prompt token, which always runs to give the first token's logits."""
    snaps = {e for e in segment_ends if start < e < n_ids}
    if every:
        snaps |= set(range((start // every + 1) * every, n_ids - 1, every))
    return sorted(snaps)


class PromptCache:
    """LRU of (token prefix -> cache snapshot), at most `max_bytes` of arrays.

    Thread-safe (the engine thread stores and fetches; /metrics reads counters)."""

    def __init__(self, max_bytes: int, every: int = 1024):
        self.max_bytes = max_bytes
        self.every = every  # also snapshot every this many prefill tokens (long prompts)
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: "OrderedDict[Tuple[int, ...], Tuple[Any, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, prefix: Sequence[int], cache: List[Any]) -> None:
        """Keep a snapshot of `cache`, which holds exactly the tokens `prefix`."""
        key = tuple(prefix)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        snap = snapshot(cache)
        size = snapshot_nbytes(snap)
        if size > self.max_bytes:
            return
        with self._lock:
            self._entries[key] = (snap, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, n) = self._entries.popitem(last=False)
                self.nbytes -= n

    def fetch(self, ids: Sequence[int]) -> Tuple[Optional[List[Any]], int]:
        """(fresh cache restored from the longest stored prefix of ids[:-1], its length),
        or (None, 0) on a miss."""
        best = None
        with self._lock:
            for key in self._entries:
                n = len(key)
                if n < len(ids) and (best is None or n > len(best)) and tuple(ids[:n]) == key:
                    best = key
            if best is None:
                self.misses += 1
                return None, 0
            self._entries.move_to_end(best)
            snap = self._entries[best][0]
            self.hits += 1
        return restore(snap), len(best)


class KeyedSnapshotCache:
    """An LRU of (string key -> snapshot of a model's caches or of its part: a stage's
    layers, a tensor rank's shard; positions held), at most `max_bytes` bytes of arrays
    (`snapshot_nbytes`). Whoever names the snapshots (a pipeline's head, a tensor group's
    rank 0) decides where they are taken; this holds them. Thread-safe; snapshots and
    restores run on the caller's MLX thread."""

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
