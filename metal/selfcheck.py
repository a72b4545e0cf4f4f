"""The device check of our Metal kernels: each kernel the dispatch functions can choose
runs once on small shapes that include its edge cases, against its pure-MLX reference op,
within the project's tolerance rule. `kimi_mlx.metal.dispatch.kernel_enabled` runs it
before a kernel's first use on Metal (KIMI_MLX_KERNELS=auto) and falls back to the
reference op for the rest of the process when it fails.

The cases here take the kernel wrapper and the reference op as arguments; `kda.py` and
`dsa.py` register them with the dispatcher (`dispatch.register_check`) next to their
dispatch functions, so this module imports nothing of ours (no import cycle through the
dispatcher). `dispatch.run_check(name)` runs one.

Cases (edge cases in brackets), each against its reference op:

- `kda_decode` vs `kda.kda_decode`: one token, both gate forms [a zero q row and a zero
  k row: the l2norm eps case; a state carried in].
- `kda_prefill` vs `kda.kda_recurrent`: 20 tokens at chunk 16 [a chunk boundary inside
  the prompt, a partial last chunk; a state carried in].
- `dsa_index_topk` vs `dsa.dsa_index_topk` (compared on `dsa.dsa_index_scores`): four
  keys each at three positions [the top-k cut inside a group of exact ties; rows with
  fewer allowed keys than top-k; a left-padded row with none].
- `sparse_mla_decode` vs `dsa.sparse_mla_decode`: three splits [a row with fewer valid
  keys than top-k, a row with none, an index equal to S].
- `dsa_index_topk_q` / `sparse_mla_decode_q` (over an `mx.quantize`d cache) vs
  `dsa.dsa_index_topk_q_reference` / `dsa.sparse_mla_decode_q_reference`: the cases above
  with the index keys / latent quantized, at 8 bits (the cache's format) and 4 bits, group
  size 32 [the same edge cases; the unpacking order of the words].

Tolerance (`tolerance`): the rule of ``kimi_mlx/testing/checkpoints.py`` (``tolerance``),
restated here because metal imports nothing of ours but its own:
``rel_err = max|kernel - reference| / max|reference| <= 2 (depth + 1) n u`` with u = 2^-24,
depth 1 (one kernel) and n the longest rounded sum of the case (named per case below).
Top-k is compared as sets robust to ties: the same number of selected keys per row, each
allowed and distinct, and the reference scores at the kernel's keys equal, as sorted
lists, the reference scores at the reference's keys (within the tolerance).

Inputs come from fixed PRNG keys (`mx.random.key`), so the global random state is left
alone; everything is float32.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

__all__ = ["tolerance", "rel_err", "topk_mismatch", "check_kda_decode", "check_kda_prefill",
           "check_dsa_index_topk", "check_sparse_mla_decode", "check_dsa_index_topk_q",
           "check_sparse_mla_decode_q", "EDGE_CASES"]

F32_UNIT_ROUNDOFF = 2.0**-24


def tolerance(depth: int, n: int, unit_roundoff: float = F32_UNIT_ROUNDOFF) -> float:
    """2 (depth + 1) n u: the project's tolerance rule (see the module docstring)."""
    return 2.0 * (depth + 1) * n * unit_roundoff


def rel_err(a: mx.array, b: mx.array) -> float:
    """max|a - b| / max|b| in float32 (inf when a has NaN/inf or the shapes differ)."""
    if tuple(a.shape) != tuple(b.shape):
        return math.inf
    a = a.astype(mx.float32)
    b = b.astype(mx.float32)
    if not mx.all(mx.isfinite(a)).item():
        return math.inf
    err = mx.abs(a - b).max().item() if a.size else 0.0
    scale = mx.abs(b).max().item() if b.size else 0.0
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def _keys(seed: int, n: int) -> List[mx.array]:
    return list(mx.random.split(mx.random.key(seed), n))


def _close(what: str, got: mx.array, ref: mx.array, n: int) -> Optional[str]:
    tol = tolerance(1, n)
    err = rel_err(got, ref)
    if err <= tol:
        return None
    return (f"{what}: differs from the reference op (shape {tuple(got.shape)} vs "
            f"{tuple(ref.shape)}): relative error {err:.3g} > tolerance {tol:.3g} (n={n})")


# ------------------------------------------------------------------------------ KDA


def _kda_raw(seed: int, B: int, T: int, H: int, Dk: int, Dv: int):
    """Raw KDA streams, q's first and k's last (b, t, h) row zero (the l2norm eps case)."""
    kq, kk, kv, ka, kb, kA, kd, ks = _keys(seed, 8)
    q = mx.random.normal((B, T, H, Dk), key=kq)
    k = mx.random.normal((B, T, H, Dk), key=kk)
    rows = mx.arange(B * T * H).reshape(B, T, H, 1)
    q = mx.where(rows == 0, 0.0, q)
    k = mx.where(rows == B * T * H - 1, 0.0, k)
    v = mx.random.normal((B, T, H, Dv), key=kv)
    a = mx.random.normal((B, T, H, Dk), key=ka)
    b = mx.random.normal((B, T, H), key=kb)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,), key=kA))
    dt_bias = mx.random.normal((H, Dk), key=kd) * 0.5
    state = mx.random.normal((B, H, Dv, Dk), key=ks) * 0.3
    return q, k, v, a, b, A_log, dt_bias, state


def check_kda_decode(kernel: Callable, reference: Callable) -> Optional[str]:
    """`kernel` (kernels.kda_decode) against `reference` (kda.kda_decode): one token,
    both gate forms, a state carried in, zero-norm rows. None if they agree, else why not
    (exceptions propagate)."""
    B, H, Dk, Dv = 2, 2, 64, 32
    for seed, lower_bound in ((11, -5.0), (12, None)):
        q, k, v, a, b, A_log, dt_bias, state = _kda_raw(seed, B, 1, H, Dk, Dv)
        got = kernel(q, k, v, a, b, A_log, dt_bias, state, lower_bound)
        ref = reference(q, k, v, a, b, A_log, dt_bias, state, lower_bound)
        mx.eval(got, ref)
        gate = "softplus gate" if lower_bound is None else f"gate lower bound {lower_bound}"
        for what, g, r in zip(("y", "state"), got, ref):
            # n: the state row's Dk-long dot products (the state carried in is an input).
            bad = _close(f"{gate}, {what}", g, r, max(Dk, Dv))
            if bad:
                return bad
    return None


KDA_PREFILL_CHUNK = 16
KDA_PREFILL_T = KDA_PREFILL_CHUNK + 4  # one full chunk, then a partial one


def check_kda_prefill(kernel: Callable, prepare: Callable, reference: Callable) -> Optional[str]:
    """`kernel` (kernels.kda_prefill) against `reference` (kda.kda_recurrent) on inputs
    from `prepare` (kda.kda_prepare): a prompt across a chunk boundary, a state carried
    in. None if they agree, else why not (exceptions propagate)."""
    B, T, H, Dk, Dv = 1, KDA_PREFILL_T, 2, 64, 32
    q, k, v, a, b, A_log, dt_bias, state = _kda_raw(21, B, T, H, Dk, Dv)
    q, k, g, beta = prepare(q, k, a, b, A_log, dt_bias, -5.0, Dk**-0.5)
    got = kernel(q, k, v, g, beta, state, chunk=KDA_PREFILL_CHUNK)
    ref = reference(q, k, v, g, beta, state)
    mx.eval(got, ref)
    for what, gt, r in zip(("y", "state"), got, ref):
        # n: Dk-long dot products, accumulated over the T tokens of the state.
        bad = _close(f"T={T} at chunk {KDA_PREFILL_CHUNK}, {what}", gt, r, max(Dk, Dv) + T)
        if bad:
            return bad
    return None


# ------------------------------------------------------------------------------ DSA

DSA_SHAPE = dict(B=2, L=10, Hi=2, Di=16, offset=2, topk=5, groups=4, repeat=3)
DSA_STARTS = (0, 3)


def _dsa_inputs(Di: Optional[int] = None):
    s = DSA_SHAPE
    B, L, Hi = s["B"], s["L"], s["Hi"]
    Di = s["Di"] if Di is None else Di
    S = s["offset"] + L
    kq, kw, kk = _keys(31, 3)
    q = mx.random.normal((B, L, Hi, Di), key=kq)
    w = mx.random.uniform(0.1, 1.0, (B, L, Hi), key=kw)
    # groups distinct keys, each at `repeat` positions (s % groups): exact ties in every
    # row, and with topk = 5 the cut falls inside a group for a row that sees every key.
    distinct = mx.random.normal((B, s["groups"], Di), key=kk)
    kx = mx.take(distinct, mx.arange(S) % s["groups"], axis=1)
    return q, w, kx, S


def topk_mismatch(idx: List, ref_idx: List, scores: List, tol: float) -> Optional[str]:
    """Compare one row's top-k selections robustly to ties.

    Args:
        idx, ref_idx: the kernel's and the reference's selected positions (-1 = none).
        scores: the row's reference scores (-inf = not allowed), a list over positions.
        tol: relative tolerance (of the row's largest finite |score|).
    Returns:
        None if they agree, else why not.
    """
    sel = [i for i in idx if i >= 0]
    ref_sel = [i for i in ref_idx if i >= 0]
    if len(sel) != len(ref_sel):
        return f"selects {len(sel)} keys, the reference {len(ref_sel)}"
    if len(set(sel)) != len(sel):
        return f"selects a key twice: {sorted(sel)}"
    if any(i >= len(scores) or scores[i] == -math.inf for i in sel):
        return f"selects a key that is not allowed: {sorted(sel)}"
    finite = [abs(x) for x in scores if x != -math.inf]
    scale = max(finite) if finite else 0.0
    got = sorted(scores[i] for i in sel)
    want = sorted(scores[i] for i in ref_sel)
    worst = max((abs(x - y) for x, y in zip(got, want)), default=0.0)
    if worst > tol * scale:
        return (f"selected scores {got} differ from the reference's {want} "
                f"(by {worst:.3g} > {tol:.3g} x {scale:.3g})")
    return None


def check_dsa_index_topk(kernel: Callable, reference: Callable,
                         scores_op: Callable) -> Optional[str]:
    """`kernel` (kernels.dsa_index_topk) against `reference` (dsa.dsa_index_topk), the
    selections compared on the scores of `scores_op` (dsa.dsa_index_scores): exact ties
    cut by top-k, rows with fewer allowed keys than top-k, one with none. None if they
    agree, else why not (exceptions propagate)."""
    s = DSA_SHAPE
    q, w, kx, S = _dsa_inputs()
    starts = mx.array(DSA_STARTS, dtype=mx.int32)
    got = kernel(q, w, kx, s["topk"], s["offset"], starts)
    ref = reference(q, w, kx, s["topk"], s["offset"], starts)
    scores = scores_op(q, w, kx, s["offset"], starts)
    mx.eval(got, ref, scores)
    if tuple(got.shape) != tuple(ref.shape):
        return f"indices of shape {tuple(got.shape)}, the reference {tuple(ref.shape)}"
    # n: a score sums Hi weighted Di-long dot products (at most Hi * Di products).
    tol = tolerance(1, s["Hi"] * s["Di"])
    G, R, SC = got.tolist(), ref.tolist(), scores.tolist()
    for b in range(s["B"]):
        for l in range(s["L"]):
            bad = topk_mismatch(G[b][l], R[b][l], SC[b][l], tol)
            if bad:
                return f"batch row {b} (first key {DSA_STARTS[b]}), query {l}: {bad}"
    return None


MLA_SHAPE = dict(B=3, H=2, R=32, P=16, S=20, K=8, splits=3)


def _mla_inputs():
    s = MLA_SHAPE
    B, H, R, P, S, K = s["B"], s["H"], s["R"], s["P"], s["S"], s["K"]
    k1, k2, k3, k4 = _keys(41, 4)
    q_lat = mx.random.normal((B, H, 1, R), key=k1)
    q_pe = mx.random.normal((B, H, 1, P), key=k2)
    latent = mx.random.normal((B, S, R), key=k3)
    k_pe = mx.random.normal((B, S, P), key=k4)
    indices = mx.array([
        [0, 5, 19, 7, 3, 12, 18, 1],           # K valid keys (S - 1 included)
        [4, 9, 20, -1, -1, -1, -1, -1],        # fewer keys than top-k (20 = S: skipped)
        [-1, -1, -1, -1, -1, -1, -1, -1],      # none: the output is zeros
    ], dtype=mx.int32)
    assert tuple(indices.shape) == (B, K)
    return q_lat, q_pe, latent, k_pe, indices


def check_sparse_mla_decode(kernel: Callable, reference: Callable) -> Optional[str]:
    """`kernel` (kernels.sparse_mla_decode) against `reference` (dsa.sparse_mla_decode):
    three splits, a row with fewer valid keys than top-k, a row with none, an index = S.
    None if they agree, else why not (exceptions propagate)."""
    s = MLA_SHAPE
    q_lat, q_pe, latent, k_pe, indices = _mla_inputs()
    scale = (s["R"] + s["P"]) ** -0.5
    # Three splits of K=8 keys (3, 3, 2): the combine step merges splits, some of them
    # empty (rows 1 and 2), as it does at the model's K (K / 128 splits).
    got = kernel(q_lat, q_pe, latent, k_pe, indices, scale, splits=s["splits"])
    ref = reference(q_lat, q_pe, latent, k_pe, indices, scale)
    mx.eval(got, ref)
    # n: (R + P)-long score dot products; K-long softmax sums.
    return _close(f"splits={s['splits']}, out", got, ref, max(s["R"] + s["P"], s["K"]))


# The quantized variants: (bits, group size) of each run; Di and R a multiple of the group.
QUANT_CASES = ((8, 32), (4, 32))
DSA_Q_DI = 32


def check_dsa_index_topk_q(kernel: Callable, reference: Callable, scores_op: Callable,
                           dequantize: Callable) -> Optional[str]:
    """`kernel` (kernels.dsa_index_topk_q) against `reference`
    (dsa.dsa_index_topk_q_reference) on `check_dsa_index_topk`'s cases with the keys
    quantized (`QUANT_CASES`), the selections compared on `scores_op`
    (dsa.dsa_index_scores) of the keys as `dequantize` (dsa.dequantize_rows) gives them.
    None if they agree, else why not (exceptions propagate)."""
    s = DSA_SHAPE
    q, w, kx, S = _dsa_inputs(DSA_Q_DI)
    starts = mx.array(DSA_STARTS, dtype=mx.int32)
    for bits, gs in QUANT_CASES:
        parts = mx.quantize(kx, group_size=gs, bits=bits)
        got = kernel(q, w, parts, s["topk"], s["offset"], starts, group_size=gs, bits=bits)
        ref = reference(q, w, parts, s["topk"], s["offset"], starts, group_size=gs, bits=bits)
        scores = scores_op(q, w, dequantize(parts, gs, bits), s["offset"], starts)
        mx.eval(got, ref, scores)
        if tuple(got.shape) != tuple(ref.shape):
            return (f"{bits}-bit keys: indices of shape {tuple(got.shape)}, the reference "
                    f"{tuple(ref.shape)}")
        tol = tolerance(1, s["Hi"] * DSA_Q_DI)
        G, R, SC = got.tolist(), ref.tolist(), scores.tolist()
        for b in range(s["B"]):
            for l in range(s["L"]):
                bad = topk_mismatch(G[b][l], R[b][l], SC[b][l], tol)
                if bad:
                    return (f"{bits}-bit keys, group {gs}: batch row {b} (first key "
                            f"{DSA_STARTS[b]}), query {l}: {bad}")
    return None


def check_sparse_mla_decode_q(kernel: Callable, reference: Callable) -> Optional[str]:
    """`kernel` (kernels.sparse_mla_decode_q) against `reference`
    (dsa.sparse_mla_decode_q_reference) on `check_sparse_mla_decode`'s case with the
    latent quantized (`QUANT_CASES`). None if they agree, else why not (exceptions
    propagate)."""
    s = MLA_SHAPE
    q_lat, q_pe, latent, k_pe, indices = _mla_inputs()
    scale = (s["R"] + s["P"]) ** -0.5
    for bits, gs in QUANT_CASES:
        parts = mx.quantize(latent, group_size=gs, bits=bits)
        got = kernel(q_lat, q_pe, parts, k_pe, indices, scale, group_size=gs, bits=bits,
                     splits=s["splits"])
        ref = reference(q_lat, q_pe, parts, k_pe, indices, scale, group_size=gs, bits=bits)
        mx.eval(got, ref)
        bad = _close(f"{bits}-bit latent, group {gs}, splits={s['splits']}, out", got, ref,
                     max(s["R"] + s["P"], s["K"]))
        if bad:
            return bad
    return None


# The edge-case inputs each check builds (tests assert they are what they claim).
EDGE_CASES: Dict[str, Callable[[], Tuple]] = {
    "kda_prefill": lambda: (KDA_PREFILL_T, KDA_PREFILL_CHUNK),
    "dsa_index_topk": lambda: (*_dsa_inputs(), DSA_SHAPE, DSA_STARTS),
    "sparse_mla_decode": lambda: (*_mla_inputs(), MLA_SHAPE),
}
