"""Caches of our layers, in mlx-lm's cache protocol, batchable for its `BatchGenerator`.

- KDA layers: mlx-lm `ArraysCache(2)` = [conv state [B, K-1, 3P], recurrent state
  [B, H, Dv, Dk]]. Batching (merge / extract / filter / extend / prepare / finalize /
  advance / make_mask) is mlx-lm's own; `KimiDeltaAttention` reads `make_mask` and
  `lengths` so that padded positions leave the conv and recurrent state untouched.
- Gated DSA layers: `DSACache` (one sequence) and `BatchDSACache` (several, left-padded
  as mlx-lm's `BatchKVCache`): MLA latent [B, 1, T, 512] as keys, rope key [B, 1, T, 64]
  as values, and indexer keys [B, 1, T, 128] at the same offsets.

A batched DSA layer runs the whole batch in one call (`BatchDSACache.attend`): each
row's first real key (`starts`, its left padding) reaches the dense mask, the indexer's
causal top-k and the sparse gather (metal/dsa.py), so no padded key is ever
scored, selected or attended to and every row computes what its single run computes.
Right-padded prefill (rows of different lengths in one chunk) needs nothing more: a real
query never sees the padding after it, and `finalize` rolls that padding to the left.

`snapshot` / `restore` copy a whole single-sequence model cache for the prompt cache
across requests: MLX arrays are immutable values, so a snapshot holds references, not
copies; the only in-place writes (slice assignment into a preallocated buffer) never
reach a snapshot, which holds slices of exactly `offset` tokens, because a restored cache
grows into a new buffer (concatenation) before it writes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, dynamic_roll

__all__ = ["ArraysCache", "DSACache", "BatchDSACache", "snapshot", "restore", "snapshot_nbytes"]


class DSACache(KVCache):
    """mlx-lm KVCache (keys = latent [B,1,T,512], values = k_pe [B,1,T,64]) that also keeps
    the indexer keys [B,1,T,Di] at the same offsets (keys only: no zero values stored).
    """

    def __init__(self):
        super().__init__()
        self.index_keys = None

    def update_and_fetch_all(
        self, latent: mx.array, k_pe: mx.array, k_idx: mx.array
    ) -> Tuple[mx.array, mx.array, mx.array]:
        """Append L new tokens; return all cached (latent, k_pe, k_idx) up to the offset."""
        return _append_all(self, "offset", latent, k_pe, k_idx)

    @property
    def state(self):
        return self.keys, self.values, self.index_keys, self.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.index_keys, self.offset = v

    @property
    def nbytes(self):
        n = super().nbytes
        return n + (self.index_keys.nbytes if self.index_keys is not None else 0)

    @classmethod
    def merge(cls, caches: List["DSACache"]) -> "BatchDSACache":
        """Several single-sequence caches -> one left-padded batch cache."""
        return BatchDSACache.merge(caches)


class BatchDSACache(BatchKVCache):
    """`BatchKVCache` (left-padded rows, `_idx` buffer position) plus indexer keys
    `index_keys` [B, 1, cap, Di] kept at the same positions through every batch
    operation (merge, extend, filter, extract, right-padding finalize).
    """

    def __init__(self, left_padding: List[int]):
        super().__init__(left_padding)
        self.index_keys = None
        # Python copies of the padding, so a decode step never waits for the device to
        # read `left_padding` back (that would stall MLX's async pipelining every layer)
        self._pads = [int(p) for p in left_padding]
        self._right = None  # right padding of the prefill in progress (until finalize)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if left_padding is not None:
            self._pads = [a + int(b) for a, b in zip(self._pads, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._right = [int(r) for r in right_padding]

    # -------------------------------------------------------------- writes

    def update_and_fetch_all(self, latent, k_pe, k_idx):
        """Append L new tokens to every row; return the buffers up to `_idx`."""
        return _append_all(self, "_idx", latent, k_pe, k_idx)

    def attend(self, layer_call: Callable[[mx.array, Any], mx.array], x: mx.array) -> mx.array:
        """Run a DSA layer on x [B, L, hidden] (-> [B, L, hidden]) against this batch in
        one call: `layer_call(x, view)` is the layer's forward on a view whose `offset`
        is the shared buffer position, whose `starts` [B] (None without padding) is each
        row's first real key, and whose writes go to this cache."""
        return layer_call(x, _WholeBatch(self))

    # -------------------------------------------------------------- batch protocol

    def finalize(self):
        padding = self._right_padding
        if padding is not None:
            self._pads = [a + b for a, b in zip(self._pads, self._right)]
        self._right = None
        super().finalize()
        if padding is not None and self.index_keys is not None:
            self.index_keys = dynamic_roll(self.index_keys, padding[:, None], axis=2)

    def filter(self, batch_indices):
        if self.index_keys is not None:
            self.index_keys = self.index_keys[batch_indices]
        pads = [self._pads[i] for i in batch_indices]
        super().filter(batch_indices)
        self._pads = [p - min(pads) for p in pads] if pads else []
        # BatchKVCache shifts keys left by the smallest padding left: follow it
        if self.index_keys is not None and self.keys is not None:
            shift = self.index_keys.shape[2] - self.keys.shape[2]
            if shift > 0:
                self.index_keys = self.index_keys[..., shift:, :]

    def extend(self, other: "BatchDSACache"):
        max_idx = max(self._idx, other._idx)
        sizes = [c.keys.shape[2] for c in (self, other) if c.keys is not None]
        max_size = max(sizes) if sizes else 0
        ref = self.index_keys if self.index_keys is not None else other.index_keys

        def pad(c):
            k = c.index_keys
            if k is None:
                k = mx.zeros((c.offset.shape[0], 1, 0, ref.shape[-1]), ref.dtype)
            left = max_idx - c._idx
            right = max_size - k.shape[2] - left
            if right < 0:
                k = k[..., :right, :]
                right = 0
            if left or right:
                k = mx.pad(k, [(0, 0), (0, 0), (left, right), (0, 0)])
            return k

        idx_keys = None if ref is None else mx.concatenate([pad(self), pad(other)])
        if self.keys is None and other.keys is None:
            pads = self._pads + other._pads
        else:
            pads = ([p + max_idx - self._idx for p in self._pads]
                    + [p + max_idx - other._idx for p in other._pads])
        super().extend(other)
        self.index_keys = idx_keys
        self._pads = pads

    def extract(self, idx: int) -> DSACache:
        cache = DSACache()
        padding = self._pads[idx]
        if self.keys is not None:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, padding : self._idx])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, padding : self._idx])
            cache.index_keys = mx.contiguous(self.index_keys[idx : idx + 1, :, padding : self._idx])
            cache.offset = cache.keys.shape[2]
        return cache

    @classmethod
    def merge(cls, caches: List[DSACache]) -> "BatchDSACache":
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        n = max(lengths)
        if n == 0:
            return cls([0] * len(caches))
        padding = [n - l for l in lengths]
        src = next(c for c in caches if c.keys is not None)
        B = len(caches)

        def buf(a):
            return mx.zeros((B, a.shape[1], n, a.shape[3]), a.dtype)

        keys, values, idx = buf(src.keys), buf(src.values), buf(src.index_keys)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, p:] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, p:] = c.values[..., : c.offset, :]
            idx[i : i + 1, :, p:] = c.index_keys[..., : c.offset, :]
        cache = cls(padding)
        cache.keys, cache.values, cache.index_keys = keys, values, idx
        cache.offset += n
        cache._idx = n
        return cache

    @property
    def state(self):
        return self.keys, self.values, self.index_keys, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.index_keys, self.offset, self.left_padding, self._idx = v
        self._pads = self.left_padding.tolist()
        self._right = None
        self._right_padding = None

    def is_trimmable(self):
        return False

    @property
    def nbytes(self):
        n = super().nbytes
        return n + (self.index_keys.nbytes if self.index_keys is not None else 0)


def _append_all(cache, pos: str, latent, k_pe, k_idx):
    """Append L tokens (latent [B,1,L,R], k_pe [B,1,L,P], k_idx [B,1,L,Di]) to a DSA cache
    whose write position is the attribute `pos` (`offset` for one sequence, `_idx` for a
    batch); the indexer keys follow the key buffer's capacity. Returns (latent, k_pe,
    k_idx) up to the new position."""
    prev = getattr(cache, pos)
    latent, k_pe = cache.update_and_fetch(latent, k_pe)
    end = getattr(cache, pos)
    cap = cache.keys.shape[2]
    if cache.index_keys is None or cache.index_keys.shape[2] != cap:
        new = mx.zeros((*k_idx.shape[:2], cap, k_idx.shape[-1]), k_idx.dtype)
        if cache.index_keys is not None and prev:
            new[..., :prev, :] = cache.index_keys[..., :prev, :]
        cache.index_keys = new
    cache.index_keys[..., prev:end, :] = k_idx
    return latent, k_pe, cache.index_keys[..., :end, :]


class _WholeBatch:
    """A `BatchDSACache` as the single-sequence DSA path sees it: `offset` is the shared
    buffer position, `starts` [B] int32 each row's first real key (None when no row is
    padded), and writes go to the batch cache."""

    def __init__(self, batch: BatchDSACache):
        self.batch = batch
        self.offset = batch._idx
        # from the Python copy of the padding: building it never waits for the device
        self.starts = mx.array(batch._pads, dtype=mx.int32) if any(batch._pads) else None

    def update_and_fetch_all(self, latent, k_pe, k_idx):
        return self.batch.update_and_fetch_all(latent, k_pe, k_idx)


# ------------------------------------------------------------------ prompt-cache snapshots

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
    """Bytes of the arrays a snapshot holds."""
    n = 0
    for kind, state in snap:
        if state is None:
            continue
        arrays = state[:3] if kind == "dsa" else state
        n += sum(a.nbytes for a in arrays if a is not None)
    return n
