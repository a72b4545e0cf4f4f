"""The prompt cache of a tensor-parallel group: every rank keeps its shard of
the snapshots (KDA conv + recurrent state of its heads, DSA latents / keys / index keys)
in its own `server.prompt_cache.KeyedSnapshotCache`, under the keys rank 0 chooses.

Rank 0 decides everything: where snapshots are taken (`server.prompt_cache.
snapshot_points` through `net.cache_index.HeadCacheIndex`, the policy of one process and
of the pipeline) and their names (`net.cache_keys.prefix_key` of the prompt's cache key:
its ids, image pads tagged with their image's digest, so another image is another key).
Keys travel in the group's int32 commands (`encode_keys`: the length and the 128 bits of
the digest as 4 words).

Each rank's store may have evicted a snapshot (its own LRU, its own bound) or fail to
restore it, independently of the others. So a restore is agreed (`agree_restore`, run by
every rank in the same order): an all_sum of each candidate's miss flags picks the
longest prefix every rank holds; every rank restores it; an all_sum of the failures then
decides between that prefix on every rank or a full prefill on every rank. No rank ever
continues from a state another rank does not share.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.cluster.net.cache_keys import key_length

log = logging.getLogger(__name__)

WORDS = 5  # int32 per key: length, then the 32 hex digits as 4 x 32 bits
MAX_CANDIDATES = 32  # remembered prefixes offered per restore, longest first


def encode_keys(keys: Sequence[str]) -> List[int]:
    """int32 words of `prefix_key`s (WORDS each): [length, 4 x 32 bits of the digest]
    (each word as a signed int32). ValueError for a key that is not a `prefix_key`."""
    out: List[int] = []
    for key in keys:
        n = key_length(key)
        digest = key.partition("-")[2]
        out.append(n)
        for i in range(4):
            w = int(digest[8 * i:8 * i + 8], 16)
            out.append(w - (1 << 32) if w >= 1 << 31 else w)
    return out


def decode_keys(words: Sequence[int]) -> List[str]:
    """The keys `encode_keys` wrote (ValueError when the words are not WORDS per key)."""
    if len(words) % WORDS:
        raise ValueError(f"{len(words)} int32 words are not {WORDS} per prompt-cache key")
    out = []
    for i in range(0, len(words), WORDS):
        n, *ws = words[i:i + WORDS]
        out.append(f"{int(n)}-" + "".join(f"{int(w) & 0xFFFFFFFF:08x}" for w in ws))
    return out


def _all_sum(values: Sequence[int], group) -> List[int]:
    return mx.distributed.all_sum(mx.array(list(values), mx.int32), group=group).tolist()


def agree_restore(store, keys: Sequence[str], group) -> Tuple[Optional[List[Any]], int]:
    """Run on every rank, in the same command: (this rank's restored caches, positions)
    from the longest of `keys` (longest first) that every rank holds and restored, or
    (None, 0) on every rank: then every rank prefills in full.

    `store`: this rank's `KeyedSnapshotCache`, or None (a rank without a cache misses
    every key). Two all_sums (one when no key is held by all). Raises what the
    collectives raise (RuntimeError: a peer is gone)."""
    keys = list(keys)
    if not keys:
        return None, 0
    held = set(store.held(keys)) if store is not None else set()
    misses = _all_sum([0 if k in held else 1 for k in keys], group)
    pick = next((k for k, m in zip(keys, misses) if m == 0), None)
    if pick is None:
        return None, 0
    n = key_length(pick)
    cache = None
    try:
        cache = store.restore(pick, n)
    except Exception:  # noqa: BLE001 - a store that fails (a disk tier) is a miss here
        cache = None
    if _all_sum([0 if cache is not None else 1], group)[0]:
        return None, 0
    return cache, n


def default_cache_bytes(usable_bytes: Optional[int] = None) -> int:
    """The bound of a rank's snapshot LRU when none is given, as a pipeline stage derives
    its own (`node.loading`): a quarter of the memory left after loading its shard (this
    machine's usable memory, `net.discovery.local_memory`, minus MLX's active memory)."""
    if usable_bytes is None:
        from kimi_mlx.cluster.net.discovery import local_memory

        usable_bytes = local_memory()[1]
    return max(int(usable_bytes) - mx.get_active_memory(), 0) // 4


def make_store(max_bytes: Optional[int], disk_dir=None, disk_bytes: int = 0,
               fingerprint: Optional[dict] = None, who: str = "tensor rank"):
    """This rank's `KeyedSnapshotCache` bounded by `max_bytes` (None: `default_cache_bytes`;
    0: no prompt cache, None returned). With `disk_dir` (`--prompt-cache-dir`) its
    snapshots also go to disk (`server.disk_cache.DiskSnapshotStore`, at most `disk_bytes`)
    in the folder of `fingerprint` (`rank_fingerprint`), so a restarted rank still holds
    them; a folder that cannot be used (locked by another process, unwritable) is logged
    and the rank keeps its memory cache only."""
    from kimi_mlx.server.prompt_cache import KeyedSnapshotCache

    bound = default_cache_bytes() if max_bytes is None else int(max_bytes)
    if bound <= 0:
        return None
    disk = None
    if disk_dir is not None:
        from kimi_mlx.server.disk_cache import DiskSnapshotStore

        try:
            disk = DiskSnapshotStore(disk_dir, disk_bytes, fingerprint or {})
        except (OSError, RuntimeError) as e:
            log.warning("%s: prompt cache on disk off: %s", who, e)
    return KeyedSnapshotCache(bound, disk=disk)


def rank_fingerprint(model_dir, model, rank: int, size: int) -> dict:
    """What a tensor rank's disk snapshots depend on besides their tokens: the weights
    (`server.serving.model_cache_fingerprint`: the checkpoint's identity, layer count and
    parameter dtypes of this rank's slices) and the shard, rank `rank` of a group of
    `size` (`model.shard` splits heads and expert columns by both). Another checkpoint,
    rank, group size or dtype reads and writes another folder."""
    from kimi_mlx.server.serving import model_cache_fingerprint

    return model_cache_fingerprint(model_dir, model, role=f"tensor rank {int(rank)} of {int(size)}")
