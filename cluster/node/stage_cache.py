"""The cluster's prompt cache: snapshots on the stages (here), keys (`net.cache_keys`) and
choices on the head (`net.cache_index`).

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

With `cluster serve --prompt-cache-dir`, the snapshots also go to disk
(`server.disk_cache.DiskSnapshotStore`, write-behind) in a folder named by
`stage_fingerprint`, so a restarted stage still holds them: `held` counts what is on
disk, and a restore reads it back.
"""

from __future__ import annotations

from kimi_mlx.server.prompt_cache import KeyedSnapshotCache


__all__ = ["StageCache", "stage_fingerprint"]


def stage_fingerprint(spec, files: str = "") -> dict:
    """What a stage's disk snapshots depend on besides their tokens (`server.disk_cache`):
    the checkpoint's fingerprint (`net.fingerprint`: config, index and every shard's
    header), `files` (`server.disk_cache.checkpoint_identity`: the shards' sizes and
    mtimes, which a retrained checkpoint of the same shapes changes), the layer range
    [start, end), the compute dtype and the cache format (kv_bits / kv_group_size, when
    quantized) of a `runner.StageSpec`. Another checkpoint, split, dtype or cache format
    reads and writes another folder."""
    fp = {"checkpoint": spec.fingerprint, "files": files,
          "layers": [int(spec.start), int(spec.end)], "dtype": spec.compute_dtype,
          "role": "pipeline stage"}
    if getattr(spec, "kv_bits", None):
        fp.update(kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size)
    return fp


class StageCache(KeyedSnapshotCache):
    """One stage's LRU of (key -> snapshot of its layers' caches, positions held), at most
    `max_bytes` bytes of arrays (`server.prompt_cache.KeyedSnapshotCache`)."""
