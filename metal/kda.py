"""Kimi Delta Attention: pure-MLX reference ops (the Metal kernels sit beside these).

Math: Kimi Linear (arXiv 2510.26692) and flash-linear-attention `fla/ops/kda/naive.py`;
gate with lower bound from fla `gate.py` (K31_SPEC.md section 3, "KDA"). Per head, with
state S in R^{Dk x Dv} (stored transposed, as mlx-lm does: [B, H, Dv, Dk], float32):

    S <- Diag(alpha_t) S                       alpha_t = exp(g_t), per key channel
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

`kda_update` is the single place that chooses kernel or reference.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


@partial(mx.compile, shapeless=True)
def kda_gate(
    raw: mx.array, A_log: mx.array, dt_bias: mx.array, lower_bound: float
) -> mx.array:
    """Log-space per-channel decay g (so alpha = exp(g)) with K3's lower bound.

    g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias))   (fla `naive_kda_lowerbound_gate`)

    Args:
        raw: [B, T, H, D] output of f_b(f_a(x)), any float dtype.
        A_log: [H, 1] per-head log temperature (first H of the file's zero-padded [128]).
        dt_bias: [H, D] float32.
        lower_bound: `linear_attn_config.gate_lower_bound` (K3: -5.0).
    Returns:
        [B, T, H, D] float32, in (lower_bound, 0).
    """
    a = raw.astype(mx.float32) + dt_bias
    return lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * a)


@partial(mx.compile, shapeless=True)
def kda_gate_softplus(raw: mx.array, A_log: mx.array, dt_bias: mx.array) -> mx.array:
    """Log-space decay without a lower bound: g = -exp(A_log) * softplus(raw + dt_bias).

    Shapes as `kda_gate`. Used when `gate_lower_bound` is absent (Kimi Linear default).
    """
    a = raw.astype(mx.float32) + dt_bias
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed in float32 (FLA `l2norm`)."""
    xf = x.astype(mx.float32)
    return (xf * mx.rsqrt((xf * xf).sum(axis=-1, keepdims=True) + eps)).astype(x.dtype)


@mx.compile
def _kda_step(q, k, v, g, beta, state):
    # q, k, g: [B, H, Dk]; v: [B, H, Dv]; beta: [B, H]; state: [B, H, Dv, Dk] fp32
    state = state * mx.exp(g)[..., None, :]
    kv = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv) * beta[..., None]
    state = state + delta[..., None] * k[..., None, :]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y, state


def kda_recurrent(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Token-by-token KDA recurrence (reference; exact for any length).

    Args:
        q, k: [B, T, H, Dk], already L2-normalised (q also scaled by Dk^-1/2).
        v: [B, T, H, Dv].
        g: [B, T, H, Dk] float32 log decay (see `kda_gate`).
        beta: [B, T, H] in (0, 1).
        state: [B, H, Dv, Dk] float32 or None (zeros).
    Returns:
        (o [B, T, H, Dv] in v's dtype, final state [B, H, Dv, Dk] float32).
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    qf, kf, vf = (a.astype(mx.float32) for a in (q, k, v))
    bf = beta.astype(mx.float32)
    ys = []
    for t in range(T):
        y, state = _kda_step(qf[:, t], kf[:, t], vf[:, t], g[:, t], bf[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1).astype(v.dtype), state


def kda_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """KDA for a prompt chunk or one decode token; same contract as `kda_recurrent`.

    The one place where a Metal kernel or a reference op is chosen.
    """
    return kda_recurrent(q, k, v, g, beta, state)
