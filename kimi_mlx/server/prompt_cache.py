"""Prompt cache across requests: snapshots of the whole model cache (KDA conv + recurrent
state, DSA latents / rope keys / index keys) taken at segment ends (end of the system
prompt, of each earlier turn) and every `every` prefill tokens, in an LRU bounded by bytes.

KDA state cannot be trimmed, so a request can only start from a snapshot whose tokens are
a prefix of its prompt; the longest such prefix wins. A hit restores a fresh cache from
the snapshot (`kimi_mlx.model.cache.restore`), so a request never sees another's state, and at
least the last prompt token always runs (it gives the first token's logits).

Both caches here take an optional disk tier (`server.disk_cache.DiskSnapshotStore`,
`--prompt-cache-dir`). Policy: write-behind of every snapshot stored (segment ends and
every-N points alike), so that a restart, a crash or an eviction from the memory LRU
finds it on disk; the memory LRU then drops evicted snapshots as before (they are on
disk already, or were dropped by a full write queue). A lookup that finds nothing in
memory, or a shorter prefix than disk holds, reads the disk's longest usable prefix
(when `DiskSnapshotStore.worth_reading` says a read beats recomputing) and keeps it in
memory too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from kimi_mlx.model.cache import restore, snapshot, snapshot_nbytes
from kimi_mlx.server.disk_cache import prefix_keys, token_key


DEFAULT_EVERY = 1024  # prefill tokens between two snapshots of a long prompt


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

    Thread-safe (the engine thread stores and fetches; /metrics reads counters).
    `disk`: an optional `DiskSnapshotStore` (module doc: write-behind, read fallback),
    keyed by `disk_cache.token_key` of the prefix (its image pads' digests included)."""

    def __init__(self, max_bytes: int, every: int = DEFAULT_EVERY, disk=None):
        self.max_bytes = max_bytes
        self.every = every  # also snapshot every this many prefill tokens (long prompts)
        self.disk = disk
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
        if self.disk is not None:
            self.disk.put(token_key(key), len(key), snap, size)
        self._keep(key, snap, size)

    def note_prompt_speed(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` tokens took `seconds`: the disk tier's read-or-recompute
        choice uses the fastest prompt speed seen over prefills of 64 tokens or more
        (shorter ones are dominated by fixed costs)."""
        if self.disk is not None and tokens >= 64 and seconds > 0:
            self.disk.prompt_tps = max(self.disk.prompt_tps or 0.0, tokens / seconds)

    def _keep(self, key: Tuple, snap, size: int) -> None:
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
        or (None, 0) on a miss. Memory first; then the disk, for a longer prefix."""
        best = None
        with self._lock:
            for key in self._entries:
                n = len(key)
                if n < len(ids) and (best is None or n > len(best)) and tuple(ids[:n]) == key:
                    best = key
        have = len(best) if best is not None else 0
        if self.disk is not None:
            got = self._fetch_disk(ids, have)
            if got is not None:
                with self._lock:
                    self.hits += 1
                return restore(got[0]), got[1]
        with self._lock:
            if best is None or best not in self._entries:
                self.misses += 1
                return None, 0
            self._entries.move_to_end(best)
            snap = self._entries[best][0]
            self.hits += 1
        return restore(snap), len(best)

    def _fetch_disk(self, ids: Sequence, have: int):
        """(snapshot, length) of the longest prefix of ids[:-1] on disk longer than
        `have`, when reading it beats recomputing its extra tokens; else None."""
        by_length: dict = {}
        for key, n, nbytes in self.disk.entries():
            if have < n < len(ids):
                by_length.setdefault(n, {})[key] = nbytes
        keys = prefix_keys(ids, by_length)
        for n in sorted(by_length, reverse=True):
            key = keys[n]
            if key not in by_length[n]:
                continue
            if not self.disk.worth_reading(by_length[n][key], n - have):
                break
            snap = self.disk.get(key, n)
            if snap is None:
                continue
            self._keep(tuple(ids[:n]), snap, snapshot_nbytes(snap))
            return snap, n
        self.disk.miss()
        return None


class KeyedSnapshotCache:
    """An LRU of (string key -> snapshot of a model's caches or of its part: a stage's
    layers, a tensor rank's shard; positions held), at most `max_bytes` bytes of arrays
    (`snapshot_nbytes`). Whoever names the snapshots (a pipeline's head, a tensor group's
    rank 0) decides where they are taken; this holds them. Thread-safe; snapshots and
    restores run on the caller's MLX thread. `disk` (or `attach_disk`): an optional
    `DiskSnapshotStore` under the same keys (module doc: write-behind, read fallback;
    `held` counts what is on disk as held)."""

    def __init__(self, max_bytes: int, disk=None):
        self.max_bytes = max(int(max_bytes), 0)
        self.nbytes = 0
        self.evictions = 0
        self.disk = disk
        self._entries: "OrderedDict[str, Tuple[Any, int, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def attach_disk(self, disk) -> None:
        """Use `disk` (a `DiskSnapshotStore`, or None) from now on, closing the one used
        before (its queued writes finish first)."""
        old, self.disk = self.disk, disk
        if old is not None and old is not disk:
            old.close()

    def clear(self) -> None:
        """Forget the snapshots in memory (the disk's stay: they belong to their
        fingerprint's folder)."""
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
        disk = self.disk
        if disk is not None:
            disk.put(key, length, snap, size)
        return self._keep(key, length, snap, size) or disk is not None

    def _keep(self, key: str, length: int, snap, size: int) -> bool:
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
            if entry is not None and entry[1] == length:
                self._entries.move_to_end(key)
                return restore(entry[0])
        disk = self.disk
        if disk is None:
            return None
        snap = disk.get(key, length)
        if snap is None:
            return None
        self._keep(key, length, snap, snapshot_nbytes(snap))
        return restore(snap)

    def held(self, keys: Iterable[str]) -> List[str]:
        """The keys of `keys` held now, in memory or on disk (marked recently used)."""
        out = []
        disk = self.disk
        with self._lock:
            for k in keys:
                if k in self._entries:
                    self._entries.move_to_end(k)
                    out.append(k)
                elif disk is not None and disk.has(k):
                    out.append(k)
        return out
