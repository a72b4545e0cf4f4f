"""Caches of our layers, in mlx-lm's cache protocol, batchable for its `BatchGenerator`.

- KDA layers: mlx-lm `ArraysCache(2)` = [conv state [B, K-1, 3P], recurrent state
  [B, H, Dv, Dk]]. Batching (merge / extract / filter / extend / prepare / finalize /
  advance / make_mask) is mlx-lm's own; `KimiDeltaAttention` reads `make_mask` and
  `lengths` so that padded positions leave the conv and recurrent state untouched.
- Gated DSA layers: `DSACache` (one sequence) and `BatchDSACache` (several, left-padded
  as mlx-lm's `BatchKVCache`): MLA latent [B, 1, T, 512] as keys, rope key [B, 1, T, 64]
  as values, and indexer keys [B, 1, T, 128] at the same offsets.

8-bit caches (`--kv-bits 8`, `kv_bits=8`): the latent's 512 values and the indexer key's
128 values are kept in MLX's affine format, `mx.quantize(x, group_size, bits)` along the
last axis: packed uint32 [.., D*bits/32] in `keys` / `index_keys`, scales and biases
[.., D/group_size] in the cache dtype in `latent_scales` / `latent_biases` /
`index_scales` / `index_biases`, all at the same positions (`AUX_QUANT`); the 64 rope
values (`values`) stay unquantized. Each token is quantized once, when it is written, so
a token reads back the same values whatever chunk, batch or rank wrote it.
`update_and_fetch_all` returns dequantized (latent, k_pe, k_idx); the Gated DSA layer
instead writes with `append_all` and reads `quantized()`, the packed arrays themselves
(`QuantizedDSA`), which metal/dsa.py's quantized ops dequantize only where they read
(the index keys, and the selected latent rows).

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

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, dynamic_roll

__all__ = ["ArraysCache", "DSACache", "BatchDSACache", "QuantizedDSA", "KV_BITS", "KV_GROUP_SIZES", "KV_DEFAULT_GROUP",
           "check_kv_quant", "group_for", "dequantize", "dequantize_error_bound", "snapshot", "snapshot_kv_quant", "restore",
           "snapshot_nbytes"]

KV_BITS = (8,)  # quantized cache widths (None: the model dtype, no quantization)
KV_GROUP_SIZES = (32, 64, 128)
# values per scale by default: the only group of 32/64/128 within 0.56x of BF16's bytes on
# K3.1 (788 B per DSA layer against 1,408), and on micro the same quality as 64 (README,
# `--kv-bits`); placement/layer_bytes.py KV_CACHE_DEFAULT_GROUP counts the same
KV_DEFAULT_GROUP = 128
# per-position arrays a quantized DSA cache keeps beside keys / values / index_keys
AUX_QUANT = ("latent_scales", "latent_biases", "index_scales", "index_biases")


def check_kv_quant(bits: Optional[int], group_size: int = KV_DEFAULT_GROUP) -> None:
    """Raise ValueError naming the flag for a cache quantization we do not support:
    bits must be None (model dtype) or 8, group_size one of 32/64/128."""
    if bits is not None and bits not in KV_BITS:
        raise ValueError(f"--kv-bits {bits}: supported are {', '.join(map(str, KV_BITS))} "
                         "(or leave it out for the model dtype)")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(f"--kv-group-size {group_size}: supported are "
                         f"{', '.join(map(str, KV_GROUP_SIZES))}")


class QuantizedDSA(NamedTuple):
    """The packed arrays of a quantized DSA cache up to its position (the shared 8-bit
    format, module doc). latent: (packed uint32 [B,1,S,R*bits/32], scales, biases
    [B,1,S,R/group]); k_pe [B,1,S,P] unquantized; index: (packed [B,1,S,Di*bits/32],
    scales, biases [B,1,S,Di/group]); scales/biases in the cache dtype. A vector shorter
    than the group is one group (`group_for`); `dequantize` reads the group from shapes."""

    latent: Tuple[mx.array, mx.array, mx.array]
    k_pe: mx.array
    index: Tuple[mx.array, mx.array, mx.array]
    bits: int
    group_size: int


def group_for(dim: int, group_size: int) -> int:
    """Values per scale for a `dim`-value vector: `group_size`, or `dim` itself when it is
    smaller (a small model's 32-value index key is one group). ValueError when neither
    divides (names the sizes)."""
    g = min(group_size, dim)
    if dim % g or g not in KV_GROUP_SIZES:
        raise ValueError(f"--kv-group-size {group_size}: cannot quantize {dim}-value cache "
                         f"vectors (need a group of {', '.join(map(str, KV_GROUP_SIZES))} "
                         f"dividing {dim})")
    return g


def dequantize(q: Tuple[mx.array, mx.array, mx.array], bits: int) -> mx.array:
    """(packed uint32 [.., D*bits/32], scales, biases [.., D/g]) -> values [.., D] in the
    scales' dtype (`mx.dequantize`; the group g is read from the shapes)."""
    dim = q[0].shape[-1] * 32 // bits
    return mx.dequantize(q[0], q[1], q[2], group_size=dim // q[1].shape[-1], bits=bits)


_UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def dequantize_error_bound(q: Tuple[mx.array, mx.array, mx.array], bits: int) -> mx.array:
    """Per value, a bound [.., D] (float32) on |x - dequantize(q)| for the values x that
    `mx.quantize(x, group, bits)` turned into q = (packed, scales, biases), read from q's
    own group scale s and bias b and the dequantized value y:

        |s| + (n |s| + |b| + |y|) u,   n = 2^bits - 1, u = unit roundoff of s's dtype

    Derivation (MLX's affine rule, mlx/backend/*/quantized: s = (max - min) / n, then s
    moved to edge / round(edge / s) so that zero is exact, b = edge): rounding to the
    grid errs by at most s/2, and the moved scale leaves at most n * s * 0.5 / (n / 2) = s
    of the group's range uncovered at the far end, so together <= |s|; storing s and b in
    their dtype moves q * s + b by <= (n |s| + |b|) u and rounding y to it by <= |y| u.
    Checked against random groups in tests/test_kv_quality_ties.py (measured up to 0.83
    of this bound in BF16)."""
    packed, scales, biases = q
    dim = packed.shape[-1] * 32 // bits
    g = dim // scales.shape[-1]
    u = _UNIT_ROUNDOFF.get(scales.dtype, 2.0**-24)
    y = dequantize(q, bits).astype(mx.float32)
    s = mx.repeat(mx.abs(scales.astype(mx.float32)), g, axis=-1)
    b = mx.repeat(mx.abs(biases.astype(mx.float32)), g, axis=-1)
    return s + ((2**bits - 1) * s + b + mx.abs(y)) * u


def _aux(cache) -> Tuple[str, ...]:
    """Names of the per-position arrays kept beside keys / values."""
    return ("index_keys",) + (AUX_QUANT if cache.kv_bits else ())


class DSACache(KVCache):
    """mlx-lm KVCache (keys = latent [B,1,T,512], values = k_pe [B,1,T,64]) that also keeps
    the indexer keys [B,1,T,Di] at the same offsets (keys only: no zero values stored).

    kv_bits 8: keys and index_keys hold packed uint32 words and `AUX_QUANT` their scales
    and biases (module doc); kv_group_size 32/64/128 values per scale. ValueError for
    another pair (`check_kv_quant`).
    """

    def __init__(self, kv_bits: Optional[int] = None, kv_group_size: int = KV_DEFAULT_GROUP):
        super().__init__()
        check_kv_quant(kv_bits, kv_group_size)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.index_keys = None
        for name in AUX_QUANT if kv_bits else ():
            setattr(self, name, None)

    def update_and_fetch_all(
        self, latent: mx.array, k_pe: mx.array, k_idx: mx.array
    ) -> Tuple[mx.array, mx.array, mx.array]:
        """Append L new tokens; return all cached (latent, k_pe, k_idx) up to the offset
        (dequantized when the cache is quantized)."""
        return _append_all(self, "offset", latent, k_pe, k_idx)

    def append_all(self, latent: mx.array, k_pe: mx.array, k_idx: mx.array) -> None:
        """Append L new tokens as `update_and_fetch_all` does, returning nothing (a
        quantized cache is then read packed through `quantized()`)."""
        _append_all(self, "offset", latent, k_pe, k_idx, fetch=False)

    def quantized(self) -> Optional[QuantizedDSA]:
        """The packed arrays up to the offset (None for an unquantized cache)."""
        return _quantized(self, self.offset)

    @property
    def state(self):
        return (self.keys, self.values, self.index_keys, self.offset,
                *(getattr(self, a) for a in _aux(self)[1:]))

    @state.setter
    def state(self, v):
        self.keys, self.values, self.index_keys, self.offset = v[:4]
        for name, a in zip(_aux(self)[1:], v[4:]):
            setattr(self, name, a)

    @property
    def nbytes(self):
        n = super().nbytes
        return n + sum(getattr(self, a).nbytes for a in _aux(self) if getattr(self, a) is not None)

    @classmethod
    def merge(cls, caches: List["DSACache"]) -> "BatchDSACache":
        """Several single-sequence caches -> one left-padded batch cache."""
        return BatchDSACache.merge(caches)


class BatchDSACache(BatchKVCache):
    """`BatchKVCache` (left-padded rows, `_idx` buffer position) plus indexer keys
    `index_keys` [B, 1, cap, Di] kept at the same positions through every batch
    operation (merge, extend, filter, extract, right-padding finalize); kv_bits 8 as
    `DSACache` (the scales and biases follow the same operations; merging or extending
    caches of different formats raises ValueError).
    """

    def __init__(self, left_padding: List[int], kv_bits: Optional[int] = None,
                 kv_group_size: int = KV_DEFAULT_GROUP):
        super().__init__(left_padding)
        check_kv_quant(kv_bits, kv_group_size)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.index_keys = None
        for name in AUX_QUANT if kv_bits else ():
            setattr(self, name, None)
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

    def append_all(self, latent, k_pe, k_idx) -> None:
        """Append L new tokens to every row without fetching (`DSACache.append_all`)."""
        _append_all(self, "_idx", latent, k_pe, k_idx, fetch=False)

    def quantized(self) -> Optional[QuantizedDSA]:
        """The packed arrays up to `_idx` (None for an unquantized cache)."""
        return _quantized(self, self._idx)

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
            for name in _aux(self):
                setattr(self, name, dynamic_roll(getattr(self, name), padding[:, None], axis=2))

    def filter(self, batch_indices):
        if self.index_keys is not None:
            for name in _aux(self):
                setattr(self, name, getattr(self, name)[batch_indices])
        pads = [self._pads[i] for i in batch_indices]
        super().filter(batch_indices)
        self._pads = [p - min(pads) for p in pads] if pads else []
        # BatchKVCache shifts keys left by the smallest padding left: follow it
        if self.index_keys is not None and self.keys is not None:
            shift = self.index_keys.shape[2] - self.keys.shape[2]
            if shift > 0:
                for name in _aux(self):
                    setattr(self, name, getattr(self, name)[..., shift:, :])

    def extend(self, other: "BatchDSACache"):
        if _format(self) != _format(other):
            raise ValueError(f"cannot extend a kv_bits={self.kv_bits}/{self.kv_group_size} "
                             f"batch cache with a kv_bits={other.kv_bits}/"
                             f"{other.kv_group_size} one")
        max_idx = max(self._idx, other._idx)
        sizes = [c.keys.shape[2] for c in (self, other) if c.keys is not None]
        max_size = max(sizes) if sizes else 0
        names = _aux(self)
        refs = {n: (getattr(self, n) if getattr(self, n) is not None else getattr(other, n))
                for n in names}

        def pad(c, name):
            k, ref = getattr(c, name), refs[name]
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

        aux = {n: None if refs["index_keys"] is None
               else mx.concatenate([pad(self, n), pad(other, n)]) for n in names}
        if self.keys is None and other.keys is None:
            pads = self._pads + other._pads
        else:
            pads = ([p + max_idx - self._idx for p in self._pads]
                    + [p + max_idx - other._idx for p in other._pads])
        super().extend(other)
        for n, a in aux.items():
            setattr(self, n, a)
        self._pads = pads

    def extract(self, idx: int) -> DSACache:
        cache = DSACache(self.kv_bits, self.kv_group_size)
        padding = self._pads[idx]
        if self.keys is not None:
            for name in ("keys", "values") + _aux(self):
                setattr(cache, name,
                        mx.contiguous(getattr(self, name)[idx : idx + 1, :, padding : self._idx]))
            cache.offset = cache.keys.shape[2]
        return cache

    @classmethod
    def merge(cls, caches: List[DSACache]) -> "BatchDSACache":
        quant = {_format(c) for c in caches}
        if len(quant) != 1:
            raise ValueError(f"cannot merge DSA caches of different kv_bits/group sizes {quant}")
        bits, group = quant.pop()
        group = group or KV_DEFAULT_GROUP
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        n = max(lengths)
        if n == 0:
            return cls([0] * len(caches), bits, group)
        padding = [n - l for l in lengths]
        src = next(c for c in caches if c.keys is not None)
        B = len(caches)
        names = ("keys", "values") + _aux(src)

        def buf(a):
            return mx.zeros((B, a.shape[1], n, a.shape[3]), a.dtype)

        bufs = {name: buf(getattr(src, name)) for name in names}
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for name in names:
                bufs[name][i : i + 1, :, p:] = getattr(c, name)[..., : c.offset, :]
        cache = cls(padding, bits, group)
        for name in names:
            setattr(cache, name, bufs[name])
        cache.offset += n
        cache._idx = n
        return cache

    @property
    def state(self):
        return (self.keys, self.values, self.index_keys, self.offset, self.left_padding, self._idx,
                *(getattr(self, a) for a in _aux(self)[1:]))

    @state.setter
    def state(self, v):
        self.keys, self.values, self.index_keys, self.offset, self.left_padding, self._idx = v[:6]
        for name, a in zip(_aux(self)[1:], v[6:]):
            setattr(self, name, a)
        self._pads = self.left_padding.tolist()
        self._right = None
        self._right_padding = None

    def is_trimmable(self):
        return False

    @property
    def nbytes(self):
        n = super().nbytes
        return n + sum(getattr(self, a).nbytes for a in _aux(self) if getattr(self, a) is not None)


def _format(cache) -> Tuple[Optional[int], Optional[int]]:
    """(kv_bits, kv_group_size) of a DSA cache, the group None when unquantized (a BF16
    cache's group setting stores nothing, so caches that differ only there are one format)."""
    bits = getattr(cache, "kv_bits", None)
    return bits, (getattr(cache, "kv_group_size", KV_DEFAULT_GROUP) if bits else None)


def _append_all(cache, pos: str, latent, k_pe, k_idx, fetch: bool = True):
    """Append L tokens (latent [B,1,L,R], k_pe [B,1,L,P], k_idx [B,1,L,Di]) to a DSA cache
    whose write position is the attribute `pos` (`offset` for one sequence, `_idx` for a
    batch); the indexer keys (and a quantized cache's scales and biases) follow the key
    buffer's capacity. Returns (latent, k_pe, k_idx) up to the new position, dequantized
    when the cache is quantized (then in the dtype of the values written); None when
    `fetch` is False."""
    bits, group = cache.kv_bits, cache.kv_group_size
    prev = getattr(cache, pos)
    if bits:
        lq, ls, lb = mx.quantize(latent, group_size=group_for(latent.shape[-1], group), bits=bits)
        iq, is_, ib = mx.quantize(k_idx, group_size=group_for(k_idx.shape[-1], group), bits=bits)
        new = {"index_keys": iq, "latent_scales": ls, "latent_biases": lb,
               "index_scales": is_, "index_biases": ib}
        _, k_pe = cache.update_and_fetch(lq, k_pe)
    else:
        new = {"index_keys": k_idx}
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
    end = getattr(cache, pos)
    cap = cache.keys.shape[2]
    for name, a in new.items():
        buf = getattr(cache, name)
        if buf is None or buf.shape[2] != cap:
            grown = mx.zeros((*a.shape[:2], cap, a.shape[-1]), a.dtype)
            if buf is not None and prev:
                grown[..., :prev, :] = buf[..., :prev, :]
            setattr(cache, name, grown)
            buf = grown
        buf[..., prev:end, :] = a
    if not fetch:
        return None
    if not bits:
        return latent, k_pe, cache.index_keys[..., :end, :]
    q = _quantized(cache, end)
    return dequantize(q.latent, bits), k_pe, dequantize(q.index, bits)


def _quantized(cache, end: int) -> Optional[QuantizedDSA]:
    """`QuantizedDSA` of a quantized DSA cache's arrays up to position `end`."""
    if not cache.kv_bits or cache.keys is None:
        return None

    def upto(name):
        return getattr(cache, name)[..., :end, :]

    return QuantizedDSA((upto("keys"), upto("latent_scales"), upto("latent_biases")),
                        upto("values"),
                        (upto("index_keys"), upto("index_scales"), upto("index_biases")),
                        cache.kv_bits, cache.kv_group_size)


class _WholeBatch:
    """A `BatchDSACache` as the single-sequence DSA path sees it: `offset` is the shared
    buffer position, `starts` [B] int32 each row's first real key (None when no row is
    padded), and writes go to the batch cache."""

    def __init__(self, batch: BatchDSACache):
        self.batch = batch
        self.offset = batch._idx
        self.kv_bits = batch.kv_bits
        # from the Python copy of the padding: building it never waits for the device
        self.starts = mx.array(batch._pads, dtype=mx.int32) if any(batch._pads) else None

    def update_and_fetch_all(self, latent, k_pe, k_idx):
        return self.batch.update_and_fetch_all(latent, k_pe, k_idx)

    def append_all(self, latent, k_pe, k_idx) -> None:
        self.batch.append_all(latent, k_pe, k_idx)

    def quantized(self) -> Optional[QuantizedDSA]:
        return self.batch.quantized()


# ------------------------------------------------------------------ prompt-cache snapshots

Snapshot = List[Tuple[str, Any]]


def snapshot(cache: List[Any]) -> Snapshot:
    """Per-layer immutable state of a single-sequence model cache (see module doc).

    A DSA layer's state is (latent, k_pe, index keys, positions) for an unquantized
    cache; a quantized one adds a fifth item (latent scales, latent biases, index
    scales, index biases, kv_bits, kv_group_size), latent / index keys then packed.

    Raises TypeError for a cache type this module does not know."""
    out: Snapshot = []
    for c in cache:
        if isinstance(c, DSACache):
            n = c.offset
            if c.keys is None:
                out.append(("dsa", None))
            else:
                state = (c.keys[..., :n, :], c.values[..., :n, :], c.index_keys[..., :n, :], n)
                if c.kv_bits:
                    state += ((*(getattr(c, a)[..., :n, :] for a in AUX_QUANT),
                               c.kv_bits, c.kv_group_size),)
                out.append(("dsa", state))
        elif isinstance(c, ArraysCache):
            out.append(("arrays", list(c.cache)))
        else:
            raise TypeError(f"cannot snapshot a {type(c).__name__}")
    return out


def snapshot_kv_quant(snap: Snapshot) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """(kv_bits, kv_group_size) of a snapshot's DSA layers ((None, None) unquantized);
    None when it holds no DSA state."""
    for kind, state in snap:
        if kind == "dsa" and state is not None:
            return (state[4][4], state[4][5]) if len(state) > 4 else (None, None)
    return None


def restore(snap: Snapshot, kv_bits: Any = ...,
            kv_group_size: int = KV_DEFAULT_GROUP) -> List[Any]:
    """A fresh model cache holding a snapshot's state (the snapshot stays unchanged).

    kv_bits / kv_group_size: the cache format the caller runs (left out: the
    snapshot's own); an empty DSA layer gets it, and a held one must match it
    (ValueError otherwise: a snapshot of an 8-bit cache is never restored into a
    model-dtype cache, nor the other way round)."""
    cache: List[Any] = []
    if kv_bits is ...:
        kv_bits, kv_group_size = snapshot_kv_quant(snap) or (None, None)
        kv_group_size = kv_group_size or KV_DEFAULT_GROUP
    want = (kv_bits, kv_group_size if kv_bits else None)
    for i, (kind, state) in enumerate(snap):
        if kind == "dsa":
            c = DSACache(kv_bits, kv_group_size)
            if state is not None:
                got = (state[4][4], state[4][5]) if len(state) > 4 else (None, None)
                if got != want:
                    raise ValueError(f"snapshot layer {i}: a kv_bits={got[0]} group={got[1]} "
                                     f"cache, restored into kv_bits={want[0]} group={want[1]}")
                c.keys, c.values, c.index_keys, c.offset = state[:4]
                if len(state) > 4:
                    for name, a in zip(AUX_QUANT, state[4][:4]):
                        setattr(c, name, a)
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
        arrays = (state[:3] + (state[4][:4] if len(state) > 4 else ())) if kind == "dsa" else state
        n += sum(a.nbytes for a in arrays if a is not None)
    return n
