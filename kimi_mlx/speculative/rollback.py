"""Exact rollback of a model's caches after a speculative verify step.

A verify step feeds the target k+1 tokens [y, d1..dk] at once; when only the first
`n_keep` of them are accepted, every layer's cache must be what a plain decode of those
`n_keep` tokens would have left. mlx-lm does this with `trim`, which KDA's recurrent
state does not allow (mlx-lm issue #1446). Here:

* KDA layers (`ArraysCache` [conv state [B, K-1, 3P], recurrent state [B, H, Dv, Dk] f32]):
  before the verify step the cache's arrays are kept by reference (MLX arrays are
  immutable: a snapshot is references, not copies); during it the layer records its
  already-projected per-token inputs (conv inputs [B, T, 3P], q/k/v after conv + SiLU
  [B, T, H, D], gate input a [B, T, H, D], beta logits b [B, T, H]: the hook in
  `KimiDeltaAttention.__call__`). Rollback rebuilds the conv state from the recorded
  conv inputs (a slice: exact) and replays the recurrence over the accepted tokens from
  the kept state (`kda_decode`, the same ops a plain decode runs). No weight is read.
* KV-type caches (our `DSACache`: latent, k_pe and indexer keys at the same offsets,
  8-bit ones with their scales and biases too; mlx-lm's `KVCache` in a draft model):
  trimmed to the kept offset.

Why replay and not per-step states: at K3.1's size a KDA state is 96 x 128 x 128 f32 =
6.3 MB per layer. Keeping the state after each of k+1 verify tokens costs (k+1) x 6.3 MB
x 69 layers (2.2 GB at k=4) of extra memory writes on every verify step, and forces the
verify through the token-by-token recurrence (the chunked/prefill kernels produce only
the final state). The record costs 7P + H values per token (about 172 KB per token per
layer in bf16, 37x less than a state) and the replay runs only when a draft is rejected,
over at most k tokens; `kimi-mlx bench spec` prints both costs at the real size.
The exception is a small state on the reference path (`kda.keeps_step_states`: at most
1 MiB for all verify tokens of a layer, e.g. the micro model's 16 KB states), where the
verify runs the token loop anyway: there the layer keeps each token's state and the
rollback picks one, which on the MLX CPU backend saves the replay's few dozen ops per
layer (its cost is per op, not per byte).

For a model that is fed one token at a time (the draft), `snapshot` / `restore` keep and
put back per-step cache states: references for array caches, offsets for KV caches.

Several sequences verified in one batched pass (the batched server's n-gram drafts,
`kimi_mlx.speculative.batch`) keep different numbers of tokens per row: `rollback_rows`
replays each KDA row over its own accepted count, and trims a left-padded batch KV cache
(`BatchDSACache`, mlx-lm's `BatchKVCache`) per row by rolling the rows that keep fewer
tokens right by the difference (their rejected tail becomes left padding, as mlx-lm's
`finalize` does with a right-padded prefill; K3.1's attention has no positional
encoding, and the indexer's and the dense mask's `starts` follow the padding) and
trimming the rest from the shared end.

API: `snapshot`, `restore`, `begin_verify`, `rollback`, `rollback_rows`, `end_verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kimi_mlx.metal.dispatch import kernel_mode
from kimi_mlx.model.cache import AUX_QUANT

__all__ = ["RollbackError", "KDARecord", "Verify", "snapshot", "restore", "begin_verify",
           "rollback", "rollback_rows", "end_verify"]

RECORD_ATTR = "verify_record"  # attribute the KDA layer looks for on its cache


class RollbackError(RuntimeError):
    """A cache cannot be rolled back (names the layer and the cache type)."""


class KDARecord:
    """What one KDA layer saw during a verify step (filled by the layer's hook).

    Attributes (None until `capture`): layer (the `KimiDeltaAttention`), conv_in
    [B, T, 3P] projected q|k|v before the conv, q/k/v [B, T, H, D] after conv + SiLU,
    a [B, T, H, D] raw gate input f_b(f_a(x)), b [B, T, H] beta logits; states
    [B, T, H, Dv, Dk] float32, the recurrent state after each token, when the layer kept
    them (`kda.keeps_step_states`: small states on the reference path), else None.
    """

    __slots__ = ("layer", "conv_in", "q", "k", "v", "a", "b", "states")

    def __init__(self):
        self.layer = None
        self.conv_in = self.q = self.k = self.v = self.a = self.b = self.states = None

    def capture(self, layer, conv_in, q, k, v, a, b, states=None) -> None:
        if self.layer is not None:
            raise RollbackError(
                f"KDA layer {layer.layer_idx}: two forward calls in one verify step "
                "(call begin_verify before each verify step)")
        self.layer = layer
        self.conv_in, self.q, self.k, self.v, self.a, self.b = conv_in, q, k, v, a, b
        self.states = states


def _is_kv(c) -> bool:
    return hasattr(c, "offset") and hasattr(c, "trim")


def snapshot(caches: List[Any]) -> List[Any]:
    """References to every cache's current state: a tuple of arrays for an `ArraysCache`,
    the offset for a KV cache. Costs no copy.

    Raises:
        RollbackError: a cache that is neither (named by its index and type).
    """
    out = []
    for i, c in enumerate(caches):
        if isinstance(c, ArraysCache):
            out.append(tuple(c.cache))
        elif _is_kv(c):
            out.append(c.offset)
        else:
            raise RollbackError(f"cache {i} ({type(c).__name__}): cannot snapshot it")
    return out


def restore(caches: List[Any], snap: List[Any]) -> None:
    """Put back a `snapshot` taken on the same caches since which tokens were only added.

    Raises:
        RollbackError: a KV cache now shorter than in the snapshot, or one that cannot
            be trimmed (e.g. a rotating cache that has wrapped).
    """
    for i, (c, s) in enumerate(zip(caches, snap)):
        if isinstance(c, ArraysCache):
            c.cache = list(s)
        else:
            _trim_to(c, s, i)


def _trim_to(c, offset: int, i: int) -> None:
    n = c.offset - offset
    if n < 0:
        raise RollbackError(f"cache {i} ({type(c).__name__}): offset {c.offset} is below "
                            f"the snapshot's {offset}")
    if n and not c.is_trimmable():
        raise RollbackError(f"cache {i} ({type(c).__name__}) cannot be trimmed")
    if n and c.trim(n) != n:
        raise RollbackError(f"cache {i} ({type(c).__name__}): trimmed less than {n} tokens")


@dataclass
class Verify:
    """State of one verify step: the snapshot before it and the KDA records."""

    snap: List[Any]
    records: List[Optional[KDARecord]]
    after: Optional[List[Any]] = None  # snapshot after the verify pass (first rollback)


def begin_verify(caches: List[Any]) -> Verify:
    """Snapshot the caches and ask every KDA layer to record its inputs; call right before
    the verify forward pass. Pair with `rollback` (any number of times) and `end_verify`."""
    snap = snapshot(caches)
    records = []
    for c in caches:
        rec = None
        if isinstance(c, ArraysCache):
            rec = KDARecord()
            setattr(c, RECORD_ATTR, rec)
        records.append(rec)
    return Verify(snap, records)


def rollback(caches: List[Any], verify: Verify, n_keep: int) -> None:
    """Make every cache hold the pre-verify tokens plus the first `n_keep` verify tokens.

    Works from the snapshot: may be called again with a smaller n_keep (before
    `end_verify`). n_keep equal to the number of verify tokens leaves the caches exactly as
    the verify pass left them.

    Args:
        caches: the model's caches (one per local layer), as passed to the forward pass.
        verify: what `begin_verify` returned for this step.
        n_keep: 0 <= n_keep <= T, T the verify step's token count.
    Raises:
        RollbackError: an array cache whose layer recorded nothing (a layer type with
            no rollback hook), or n_keep outside [0, T].
    """
    if verify.after is None:
        verify.after = snapshot(caches)
    for i, (c, s, rec) in enumerate(zip(caches, verify.snap, verify.records)):
        if rec is None:
            _trim_to(c, s + n_keep, i)
            continue
        if rec.layer is None:
            raise RollbackError(f"cache {i} (ArraysCache): its layer recorded nothing in the "
                                "verify step; only KDA layers can be rolled back")
        T = rec.q.shape[1]
        if not 0 <= n_keep <= T:
            raise RollbackError(f"n_keep {n_keep} outside [0, {T}] verify tokens")
        if n_keep == T:
            c.cache = list(verify.after[i])
        else:
            c.cache = list(_replay(rec, s[0], s[1], n_keep))


def rollback_rows(caches: List[Any], verify: Verify, n_keep: Sequence[int],
                  tokens: Optional[int] = None) -> None:
    """`rollback` for a batch of B rows verified together: row b keeps the pre-verify
    tokens plus its first `n_keep[b]` verify tokens (module doc). Call once per verify
    step (the batch caches' padding moves).

    Args:
        caches: the batch caches (one per layer): `ArraysCache` [B, ...] for KDA layers,
            left-padded `BatchKVCache`s (`BatchDSACache`) for the others.
        verify: what `begin_verify` returned for this step.
        n_keep: B ints, 0 <= n_keep[b] <= T (T the verify step's tokens per row).
        tokens: T (needed only by a model without KDA layers, whose records say it).
    Raises:
        RollbackError: a KDA layer that recorded nothing, an n_keep outside [0, T] or of
            the wrong length, or a cache type that has no per-row trim.
    """
    from mlx_lm.models.cache import BatchKVCache

    n_keep = [int(n) for n in n_keep]
    T = next((r.q.shape[1] for r in verify.records if r is not None and r.q is not None),
             tokens)
    for i, (c, rec) in enumerate(zip(caches, verify.records)):
        if rec is None:
            if not isinstance(c, BatchKVCache):
                raise RollbackError(f"cache {i} ({type(c).__name__}): no per-row trim")
            if T is None:
                raise RollbackError("rollback_rows: no KDA layer recorded the verify step's "
                                    "length: pass tokens=T")
            _trim_rows(c, [T - n for n in n_keep], i)
            continue
        if rec.layer is None:
            raise RollbackError(f"cache {i} (ArraysCache): its layer recorded nothing in the "
                                "verify step; only KDA layers can be rolled back")
        T, B = rec.q.shape[1], rec.q.shape[0]
        if len(n_keep) != B or not all(0 <= n <= T for n in n_keep):
            raise RollbackError(f"n_keep {n_keep}: expected {B} counts in [0, {T}]")
        if all(n == T for n in n_keep):
            continue  # the caches hold what the verify pass left
        c.cache = list(_replay_rows(rec, c.cache, verify.snap[i], n_keep))


def _trim_rows(c, drop: List[int], i: int) -> None:
    """Drop the last drop[b] tokens of row b of left-padded batch KV cache `c`."""
    import mlx.core as mx
    from mlx_lm.models.cache import dynamic_roll

    B = int(c.offset.shape[0])
    if len(drop) != B or min(drop) < 0 or max(drop) > c._idx:
        raise RollbackError(f"cache {i} ({type(c).__name__}): cannot drop {drop} tokens "
                            f"from {B} rows of {c._idx}")
    low = min(drop)
    shifts = [d - low for d in drop]
    if any(shifts) and c.keys is not None:
        sh = mx.array(shifts, mx.int32)[:, None]
        c.keys = dynamic_roll(c.keys, sh, axis=2)
        c.values = dynamic_roll(c.values, sh, axis=2)
        # the indexer keys, and an 8-bit cache's scales and biases, at the same positions
        for name in ("index_keys",) + (AUX_QUANT if getattr(c, "kv_bits", None) else ()):
            if getattr(c, name, None) is not None:
                setattr(c, name, dynamic_roll(getattr(c, name), sh, axis=2))
        c.left_padding = c.left_padding + mx.array(shifts)
        if hasattr(c, "_pads"):
            c._pads = [p + s for p, s in zip(c._pads, shifts)]
    c._idx -= low
    c.offset = c.offset - mx.array(drop)
    pads = c._pads if hasattr(c, "_pads") else c.left_padding.tolist()
    if min(pads) > 0:
        c.filter(list(range(B)))  # shift every row left by the padding they all have


def _replay_rows(rec: KDARecord, after, snap, n_keep: List[int]):
    """(conv state, recurrent state) [B, ...] with row b after its first n_keep[b]
    recorded tokens: rows that keep all T take the verify pass's state (`after`), the
    others are replayed from the snapshot, rows with the same count together."""
    import mlx.core as mx

    conv0, state0 = snap
    B, T, C = rec.conv_in.shape
    H, D = rec.layer.num_heads, rec.layer.head_dim
    K1 = rec.layer.conv_size - 1
    if conv0 is None:
        conv0 = mx.zeros((B, K1, C), rec.conv_in.dtype)
    if state0 is None:
        state0 = mx.zeros((B, H, D, D), mx.float32)
    xs = mx.concatenate([conv0.astype(rec.conv_in.dtype), rec.conv_in], axis=1)
    pos = mx.array(n_keep, mx.int32)[:, None] + mx.arange(K1)[None]
    conv = mx.take_along_axis(xs, pos[..., None], axis=1)  # [B, K-1, C]
    if rec.states is not None:  # the verify pass kept each token's state: pick
        every = mx.concatenate([state0[:, None], rec.states], axis=1)  # [B, T+1, ...]
        return conv, every[mx.arange(B), mx.array(n_keep, mx.int32)]
    parts = {}
    for n in sorted(set(n_keep)):
        rows = [b for b in range(B) if n_keep[b] == n]
        if n == T:
            parts[n] = after[1][mx.array(rows)]
        elif n == 0:
            parts[n] = state0[mx.array(rows)]
        else:
            idx = mx.array(rows)
            sub = KDARecord()
            sub.capture(rec.layer, rec.conv_in[idx], rec.q[idx], rec.k[idx], rec.v[idx],
                        rec.a[idx], rec.b[idx])
            parts[n] = _replay(sub, conv0[idx], state0[idx], n)[1]
    order, states = [], []
    for n, st in parts.items():
        order += [b for b in range(B) if n_keep[b] == n]
        states.append(st)
    state = mx.concatenate(states, axis=0)
    if order != list(range(B)):
        state = state[mx.array([order.index(b) for b in range(B)])]
    return conv, state


def end_verify(caches: List[Any]) -> None:
    """Stop recording (remove the KDA hooks' records); the caches keep their state."""
    for c in caches:
        if isinstance(c, ArraysCache) and hasattr(c, RECORD_ATTR):
            delattr(c, RECORD_ATTR)


def _replay(rec: KDARecord, conv0, state0, n: int):
    """(conv state, recurrent state) after the first n recorded tokens, from the snapshot.

    conv: the last K-1 of [conv0; conv_in[:n]] (what `causal_depthwise_conv` keeps).
    recurrent: `kda_decode` (L2 norms, gate, beta, token-by-token delta rule) from state0:
    the reference ops of a plain decode step, so the result equals it to rounding.
    """
    from kimi_mlx.metal.kda import kda_decode

    layer = rec.layer
    B, T, _ = rec.conv_in.shape
    H, D = layer.num_heads, layer.head_dim
    K1 = layer.conv_size - 1
    if conv0 is None:
        conv0 = mx.zeros((B, K1, rec.conv_in.shape[-1]), rec.conv_in.dtype)
    if state0 is None:
        state0 = mx.zeros((B, H, D, D), mx.float32)
    if n == 0:
        return conv0, state0
    xs = mx.concatenate([conv0.astype(rec.conv_in.dtype), rec.conv_in[:, :n]], axis=1)
    conv = xs[:, n : n + K1]
    if rec.states is not None:  # the verify pass kept the state after each token
        return conv, rec.states[:, n - 1]
    lower = float(layer.lower_bound) if layer.lower_bound is not None else None
    replay = kda_decode if kernel_mode() == "sim" else _compiled_decode
    _, state = replay(
        rec.q[:, :n], rec.k[:, :n], rec.v[:, :n], rec.a[:, :n], rec.b[:, :n],
        layer.A_log, layer.dt_bias, state0, lower, D**-0.5,
    )
    return conv, state


def _decode_fn(q, k, v, a, b, A_log, dt_bias, state, lower, scale):
    from kimi_mlx.metal.kda import kda_decode

    return kda_decode(q, k, v, a, b, A_log, dt_bias, state, lower, scale)


# One graph per (n, shapes): the replay is a few fused elementwise passes over the state
# instead of a Python-level op sequence per token (the decode step compiles the same way).
_compiled_decode = mx.compile(_decode_fn)
