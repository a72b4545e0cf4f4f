"""Float64 NumPy references for the KDA and Gated DSA ops, with float32 rounding bounds.

Used by `check_real` to judge both the Metal kernels (in the emulator) and the pure-MLX
reference ops at K3.1 Pro's real widths. These are written from the math in K31_SPEC.md
section 3 (KDA recurrence, lightning indexer, absorbed MLA), not from the code they judge.

Tolerances follow from float32 rounding (unit roundoff u = 2^-24): a sum of n products
computed in float32 is within n u sum|terms| of the exact value (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., section 3.1). Each oracle therefore also
returns the magnitude sum|terms| of what it computed (the same computation on absolute
values), and the allowed error is (reduction length + a few) x u x that magnitude.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff


def f64(a) -> np.ndarray:
    """Any mx / NumPy array as float64 NumPy (bf16 goes through float32, exactly)."""
    import mlx.core as mx

    if isinstance(a, mx.array):
        a = np.array(a.astype(mx.float32))
    return np.asarray(a, dtype=np.float64)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kda_prepare64(q, k, a, b, A_log, dt_bias, lower_bound: Optional[float], scale: float,
                  eps: float = 1e-6):
    """(q, k, g, beta) in float64 from the raw KDA streams (K31_SPEC.md s.3, "KDA").

    q, k, a: [B, T, H, Dk]; b: [B, T, H]; A_log: [H]; dt_bias: [H * Dk] or [H, Dk].
    q <- q / sqrt(sum q^2 + eps) * scale; k <- k / sqrt(sum k^2 + eps);
    g = lower_bound * sigmoid(e^A_log[h] (a + dt_bias)) (or -e^A_log softplus(a + dt_bias)
    without a bound); beta = sigmoid(b).
    """
    q, k, a, b = f64(q), f64(k), f64(a), f64(b)
    H, Dk = q.shape[2], q.shape[3]
    A = np.exp(f64(A_log).reshape(H, 1))
    x = a + f64(dt_bias).reshape(H, Dk)
    if lower_bound is not None:
        g = lower_bound * _sigmoid(A * x)
    else:
        g = -A * np.logaddexp(0.0, x)
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) * scale
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    return qn, kn, g, _sigmoid(b)


def kda_recurrence64(q, k, v, g, beta, state=None, extra_terms: int = 16) -> Dict[str, np.ndarray]:
    """Token-by-token KDA in float64 with a running magnitude bound.

    Per head, state S [Dv, Dk] (mlx-lm's transposed layout):
        S <- S diag(e^g_t);  S <- S + beta_t (v_t - S k_t) k_t^T;  o_t = S q_t.

    Args:
        q, k, g: [B, T, H, Dk] (prepared); v: [B, T, H, Dv]; beta: [B, T, H];
        state: [B, H, Dv, Dk] or None (zeros).
        extra_terms: roundings per token beyond the Dk-term sums (16: decay, gate and
            normalisation inputs; a chunked computation also pays for its in-chunk
            products, about C (log2 C + 2) for chunks of C tokens).
    Returns:
        {"o": [B, T, H, Dv], "state": [B, H, Dv, Dk], "o_tol": [B, T, H, Dv],
         "state_tol": [B, H, Dv, Dk]}: the float64 result and the float32 error bound of a
        computation of it. The bound adds, per token, (Dk + extra_terms) u |S| for the
        state update (a Dk-term sum, the decay and the gate/normalisation inputs) and carries earlier
        errors forward undamped (the update I - beta k k^T has 2-norm <= 1 for |k| = 1,
        0 < beta < 1); the output adds (Dk + 2) u |S| |q| plus the state error times sum|q|.
    """
    q, k, v, g, beta = (f64(x) for x in (q, k, v, g, beta))
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = np.zeros((B, H, Dv, Dk)) if state is None else f64(state).copy()
    M = np.abs(S)  # magnitude: the same recurrence on absolute values
    err = np.zeros_like(S)  # accumulated float32 error bound of the state
    o = np.zeros((B, T, H, Dv))
    o_tol = np.zeros_like(o)
    for t in range(T):
        alpha = np.exp(g[:, t])[:, :, None, :]  # [B, H, 1, Dk]
        kt, qt, vt, bt = k[:, t], q[:, t], v[:, t], beta[:, t][..., None]
        S = S * alpha
        M = M * alpha
        err = err * alpha
        kv = np.einsum("bhvd,bhd->bhv", S, kt)
        kvM = np.einsum("bhvd,bhd->bhv", M, np.abs(kt))
        S = S + ((vt - kv) * bt)[..., None] * kt[:, :, None, :]
        M = M + ((np.abs(vt) + kvM) * bt)[..., None] * np.abs(kt)[:, :, None, :]
        err = err + (Dk + extra_terms) * U32 * M
        o[:, t] = np.einsum("bhvd,bhd->bhv", S, qt)
        qa = np.abs(qt)
        o_tol[:, t] = ((Dk + 2) * U32 * np.einsum("bhvd,bhd->bhv", M, qa)
                       + np.einsum("bhvd,bhd->bhv", err, qa))
    return {"o": o, "state": S, "o_tol": o_tol, "state_tol": err}


def index_scores64(q_idx, weights, k_idx, offset: int) -> Tuple[np.ndarray, np.ndarray]:
    """Lightning-indexer scores in float64 and their float32 error bounds.

    I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) for s <= offset + t, -inf after.

    Args:
        q_idx: [B, L, Hi, Di]; weights: [B, L, Hi]; k_idx: [B, S, Di]; offset: position
            of the first query.
    Returns:
        (scores [B, L, S] float64, tol [B, L, S]) with
        tol = (Di + Hi + 2) u sum_h |w_h| sum_d |q_hd k_sd|.
    """
    q, w, k = f64(q_idx), f64(weights), f64(k_idx)
    Hi, Di = q.shape[2], q.shape[3]
    B, L = q.shape[:2]
    S = k.shape[1]
    kt = k.transpose(0, 2, 1)  # [B, Di, S]: the products go through BLAS matmul
    dots = (q.reshape(B, L * Hi, Di) @ kt).reshape(B, L, Hi, S)
    mags = (np.abs(q).reshape(B, L * Hi, Di) @ np.abs(kt)).reshape(B, L, Hi, S)
    scores = (w[..., None] * np.maximum(dots, 0.0)).sum(axis=2)
    tol = (Di + Hi + 2) * U32 * (np.abs(w)[..., None] * mags).sum(axis=2)
    causal = np.arange(S)[None, :] <= (np.arange(L)[:, None] + offset)
    return np.where(causal[None], scores, -np.inf), tol


def selection_report(idx, scores: np.ndarray, tol: np.ndarray, topk: int) -> Dict[str, float]:
    """Judge a top-k selection against float64 scores, allowing swaps only at near-ties.

    Args:
        idx: [B, L, K] selected positions (any order; -1 = none).
        scores, tol: from `index_scores64`.
        topk: index_topk.
    Returns:
        {"rows", "bad_rows" (wrong count, duplicates, masked or out-of-range positions),
         "swaps" (positions selected instead of an exact top-k member, summed over rows),
         "worst" (max over swapped positions of |score - threshold| / (2 tol); <= 1 means
         every swap is a tie within float32 rounding)}.
    """
    idx = np.asarray(idx)
    B, L, _ = idx.shape
    S = scores.shape[-1]
    rows = bad = swaps = 0
    worst = 0.0
    for b in range(B):
        for l in range(L):
            rows += 1
            row = scores[b, l]
            allowed = np.isfinite(row)
            kk = int(min(topk, allowed.sum()))
            got = idx[b, l][idx[b, l] >= 0]
            if (len(got) != kk or len(set(got.tolist())) != kk or np.any(got >= S)
                    or not np.all(allowed[got])):
                bad += 1
                continue
            order = np.argsort(-np.where(allowed, row, -np.inf), kind="stable")
            ref = order[:kk]
            thr = row[order[kk - 1]]
            diff = np.setxor1d(got, ref)
            swaps += len(diff) // 2
            for s in diff:
                allow = 2.0 * max(tol[b, l, s], tol[b, l, order[kk - 1]]) + 1e-300
                worst = max(worst, abs(row[s] - thr) / allow)
    return {"rows": rows, "bad_rows": bad, "swaps": swaps, "worst": worst}


def sparse_mla_decode64(q_lat, q_pe, latent, k_pe, indices, scale: float) -> Dict[str, np.ndarray]:
    """Absorbed-MLA attention of one query per row over its selected latent rows, float64.

    o = sum_s softmax_s(scale (q_lat . c_s + q_pe . kpe_s)) c_s over valid selected s.

    Args:
        q_lat: [B, H, 1, R]; q_pe: [B, H, 1, P]; latent: [B, S, R]; k_pe: [B, S, P];
        indices: [B, K] (outside [0, S) = skipped); scale: softmax scale.
    Returns:
        {"o": [B, H, 1, R], "tol": [B, 1, 1, 1]}: with score error
        d = (R + P + 2) u max_s scale (|q_lat| . |c_s| + |q_pe| . |kpe_s|), the allowed error
        is (2 d + (K + 4) u) max|c| (the softmax weights move by at most 2 d relatively; the
        weighted sum of K rows adds K u).
    """
    ql, qp, lat, kp = f64(q_lat), f64(q_pe), f64(latent), f64(k_pe)
    idx = np.asarray(indices)
    B, H, _, R = ql.shape
    P = qp.shape[-1]
    S = lat.shape[1]
    o = np.zeros((B, H, 1, R))
    tol = np.zeros((B, 1, 1, 1))
    for b in range(B):
        sel = idx[b][(idx[b] >= 0) & (idx[b] < S)]
        if not len(sel):
            continue
        c, kpe = lat[b, sel], kp[b, sel]
        s = scale * (ql[b, :, 0] @ c.T + qp[b, :, 0] @ kpe.T)  # [H, K]
        mag = scale * (np.abs(ql[b, :, 0]) @ np.abs(c).T + np.abs(qp[b, :, 0]) @ np.abs(kpe).T)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o[b, :, 0] = p @ c
        d = (R + P + 2) * U32 * mag.max()
        tol[b] = (2 * d + (len(sel) + 4) * U32) * np.abs(c).max()
    return {"o": o, "tol": tol}


def max_excess(out, ref: np.ndarray, tol: np.ndarray) -> Tuple[float, float, float]:
    """(max |out - ref|, max tol, max |out - ref| / tol): <= 1 everywhere means within bounds.

    `tol` broadcasts against ref. NaN or inf in `out` gives an infinite ratio.
    """
    out = f64(out)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} vs reference {ref.shape}")
    err = np.abs(out - ref)
    if not np.all(np.isfinite(out)):
        return float("inf"), float(np.max(tol)), float("inf")
    tol = np.broadcast_to(tol, ref.shape)
    ratio = err / np.maximum(tol, 1e-300)
    return float(err.max()), float(tol.max()), float(ratio.max())
