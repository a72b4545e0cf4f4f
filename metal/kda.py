"""Kimi Delta Attention: pure-MLX reference ops (the Metal kernels sit beside these).

Math: Kimi Linear (arXiv 2510.26692) and flash-linear-attention `fla/ops/kda/naive.py`;
gate with lower bound from fla `gate.py` (K31_SPEC.md section 3, "KDA"). Per head, with
state S in R^{Dk x Dv} (stored transposed, as mlx-lm does: [B, H, Dv, Dk], float32):

    S <- Diag(alpha_t) S                       alpha_t = exp(g_t), per key channel
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

Kernel or reference is chosen in two dispatch functions at the end of this file:
`kda_forward` (the layer's entry, raw streams in) and `kda_update` (prepared q, k, g, beta).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.metal import selfcheck
from kimi_mlx.metal.dispatch import kernel_enabled, register_check


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
    states_out: Optional[list] = None,
) -> Tuple[mx.array, mx.array]:
    """Token-by-token KDA recurrence (reference; exact for any length).

    Args:
        q, k: [B, T, H, Dk], already L2-normalised (q also scaled by Dk^-1/2).
        v: [B, T, H, Dv].
        g: [B, T, H, Dk] float32 log decay (see `kda_gate`).
        beta: [B, T, H] in (0, 1).
        state: [B, H, Dv, Dk] float32 or None (zeros).
        states_out: a list that receives the state after each token (T arrays
            [B, H, Dv, Dk] float32; the last is the returned state), or None.
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
        if states_out is not None:
            states_out.append(state)
    return mx.stack(ys, axis=1).astype(v.dtype), state


CHUNK = 16
_LOG2_E = 1.4426950408889634


def _exp_full(x: mx.array) -> mx.array:
    """e^x computed as 2^(x log2 e), within float32 rounding of `mx.exp` (max relative
    difference ~6e-8 measured on decay exponents): on MLX's x86 CPU backend `mx.exp` is
    about 3x slower (37 vs 13 ms for 4M float32), and the chunked form's one full-size
    exponential is its largest elementwise cost."""
    return mx.power(2.0, x * _LOG2_E)


def _neumann_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] (C a power of two).

    A is nilpotent (A^C = 0), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: log2(C)
    batched matmuls, differentiable, no sequential substitution.
    """
    C = A.shape[-1]
    eye = mx.eye(C, dtype=A.dtype)
    inv = eye - A
    p = A @ A
    m = 2
    while m < C:
        inv = inv @ (eye + p)
        p = p @ p
        m *= 2
    return inv


def kda_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    chunk: int = CHUNK,
) -> Tuple[mx.array, mx.array]:
    """Chunked KDA (WY / UT form, Kimi Linear section 3 and FLA `chunk_kda`), same contract
    and result as `kda_recurrent`, with matmuls inside each chunk of `chunk` tokens and a
    sequential pass only over chunks.

    Per chunk, with G the within-chunk cumulative log decay and S0 the incoming state:
        A[i,j] = beta_i sum_d k_i k_j e^{G_i-G_j}  (j < i)     T = (I + A)^-1
        u = T(beta*v) - T(beta*(k e^G)) S0
        o = (q e^G) S0 + M u,   M[t,i] = sum_d q_t k_i e^{G_t-G_i}  (i <= t)
        S = e^{G_C} S0 + (k e^{G_C-G})^T u
    e^{G_i-G_j} is factored around the chunk's middle token R, so exponents stay within
    +-(chunk/2)*|g|: safe in float32 for K3's gate lower bound (-5) and chunk <= 32.
    Use `kda_recurrent` for unbounded gates.

    Cost: every full-size decay factor is derived from the one full-size exponential
    E = e^{G-R} (e^{R-G} = 1/E, e^G = E e^R, e^{G_C-G} = e^{G_C-R}/E); the other
    exponentials are per chunk. Elementwise work runs in the input's [B, T, H, D] order
    (chunks are a free reshape); only matmul operands are viewed heads-first.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    pad = (-T) % C
    N = (T + pad) // C
    f32 = mx.float32

    def chunks(x):  # [B, T, H, ...] -> [B, N, C, H, ...] float32
        x = x.astype(f32)
        if pad:
            widths = [(0, 0)] * x.ndim
            widths[1] = (0, pad)
            x = mx.pad(x, widths)
        return x.reshape(B, N, C, *x.shape[2:])

    def heads_first(x):  # [B, N, C, H, D] -> [B, N, H, C, D]
        return x.swapaxes(2, 3)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
    bc = chunks(beta)[..., None]  # [B, N, C, H, 1]
    G = mx.cumsum(gc, axis=2)
    R = G[:, :, C // 2 : C // 2 + 1]  # [B, N, 1, H, Dk]
    E = _exp_full(G - R)
    R_end = G[:, :, -1:] - R  # G_C - R
    kE = heads_first(kc * E)  # k e^{G-R}
    kI = heads_first(kc * mx.reciprocal(E))  # k e^{R-G}
    qE = heads_first(qc * E)  # q e^{G-R}
    bh = heads_first(bc)
    eR = heads_first(mx.exp(R))  # [B, N, H, 1, Dk]
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    A = mx.where(lower, bh * (kE @ kI.swapaxes(-1, -2)), 0.0)
    M = mx.where(lower | mx.eye(C, dtype=mx.bool_), qE @ kI.swapaxes(-1, -2), 0.0)
    Tinv = _neumann_inverse(A)
    W = Tinv @ (bh * kE * eR)  # T beta k e^G          [B, N, H, C, Dk]
    U0 = Tinv @ heads_first(bc * vc)  # T beta v       [B, N, H, C, Dv]
    Qd = qE * eR  # q e^G
    Kd = kI * heads_first(mx.exp(R_end))  # k e^{G_C-G}
    decay_end = heads_first(mx.exp(R_end + R)).swapaxes(-1, -2)  # e^{G_C}  [B, N, H, Dk, 1]

    # o = Qd S0 + M u = (Qd - M W) S0 + M T(beta v): one [2C, Dk] x [Dk, Dv] product of S0
    # per chunk gives both W S0 (for u) and the output's S0 term.
    WQ = mx.concatenate([W, Qd - M @ W], axis=-2)  # [B, N, H, 2C, Dk]
    KdT = Kd.swapaxes(-1, -2)  # [B, N, H, Dk, C]
    S = state.astype(f32).swapaxes(-1, -2)  # [B, H, Dk, Dv]
    outs = []
    for n in range(N):
        X = WQ[:, n] @ S
        u = U0[:, n] - X[..., :C, :]
        outs.append(X[..., C:, :])
        S = decay_end[:, n] * S + KdT[:, n] @ u
    o = mx.stack(outs, axis=1) + M @ U0  # [B, N, H, C, Dv]
    o = heads_first(o)  # [B, N, C, H, Dv]
    o = o.reshape(B, N * C, H, Dv)[:, :T]
    return o.astype(v.dtype), S.swapaxes(-1, -2)


def kda_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """KDA for a prompt chunk or one decode token; same contract as `kda_recurrent`.

    Chooses kernel or reference (`dispatch.kernel_enabled("kda_prefill")`): on Metal (its
    device check passed) or in the emulator the `kda_prefill` kernel (any length);
    otherwise up to `RECURRENT_MAX_T` tokens go through the recurrence, longer inputs
    through the chunked form.
    """
    if kernel_enabled("kda_prefill"):
        from kimi_mlx.metal.kernels import kda_prefill

        return kda_prefill(q, k, v, g, beta, state)
    if q.shape[1] <= RECURRENT_MAX_T:
        return kda_recurrent(q, k, v, g, beta, state)
    return kda_chunked(q, k, v, g, beta, state)


# A few tokens (a speculative verify step of k + 1 <= 8) take the token loop: on the MLX
# CPU backend the cost is per op, and T compiled steps are fewer ops than one padded
# 16-token chunk (its Neumann inverse, masks, in-chunk products); measured on the micro
# model, a 4-token verify pass went from 17.5 to 13.1 ms against 10.9 ms for one token.
# It is also the op sequence of a plain decode step, token by token, so verify logits
# equal decode logits to rounding.
RECURRENT_MAX_T = 8


def kda_prepare(
    q: mx.array,
    k: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    lower_bound: Optional[float],
    scale: float,
    eps: float = 1e-6,
) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """(q, k, g, beta) for the recurrence from the raw streams (shapes as `kda_decode`):
    q <- l2norm(q) * scale, k <- l2norm(k), g from `kda_gate` (or `kda_gate_softplus`
    when lower_bound is None), beta = sigmoid(b) in float32."""
    H, Dk = q.shape[2], q.shape[3]
    q = l2_normalize(q, eps) * scale
    k = l2_normalize(k, eps)
    A_log = A_log.reshape(H, 1)
    dt_bias = dt_bias.reshape(H, Dk)
    if lower_bound is not None:
        g = kda_gate(a, A_log, dt_bias, float(lower_bound))
    else:
        g = kda_gate_softplus(a, A_log, dt_bias)
    beta = mx.sigmoid(b.astype(mx.float32))
    return q, k, g, beta


def kda_decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    lower_bound: Optional[float] = -5.0,
    scale: Optional[float] = None,
    eps: float = 1e-6,
) -> Tuple[mx.array, mx.array]:
    """KDA from the raw streams: L2 norms, gate, beta, then the recurrence (reference op of
    the fused `kda_decode` kernel, which does all of it in one dispatch).

    Args:
        q, k: [B, T, H, Dk] after conv + SiLU, before the L2 norm; v: [B, T, H, Dv].
        a: [B, T, H, Dk] raw gate input f_b(f_a(x)); b: [B, T, H] beta logits.
        A_log: [H] or [H, 1]; dt_bias: [H, Dk] or [H * Dk].
        state: [B, H, Dv, Dk] float32 or None (zeros).
        lower_bound: gate_lower_bound (`kda_gate`), or None for `kda_gate_softplus`.
        scale: readout scale folded into q (default Dk^-1/2); eps: `l2_normalize` eps.
    Returns:
        (o [B, T, H, Dv] in v's dtype, state [B, H, Dv, Dk] float32).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, g, beta = kda_prepare(q, k, a, b, A_log, dt_bias, lower_bound, scale, eps)
    return kda_recurrent(q, k, v, g, beta, state)


def kda_forward(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    lower_bound: Optional[float] = -5.0,
    scale: Optional[float] = None,
) -> Tuple[mx.array, mx.array]:
    """The KDA layer's entry point (arguments as `kda_decode`): one decode token goes to
    the fused `kda_decode` kernel on Metal or in the emulator (where
    `dispatch.kernel_enabled("kda_decode")`); everything else prepares
    q, k, g, beta with the reference ops and goes through `kda_update`.
    """
    Dk = q.shape[-1]
    if scale is None:
        scale = Dk**-0.5
    if q.shape[1] == 1 and kernel_enabled("kda_decode"):
        from kimi_mlx.metal.kernels import kda_decode as kda_decode_kernel

        return kda_decode_kernel(q, k, v, a, b, A_log, dt_bias, state, lower_bound, scale)
    q, k, g, beta = kda_prepare(q, k, a, b, A_log, dt_bias, lower_bound, scale)
    return kda_update(q, k, v, g, beta, state)


def _check_kda_decode_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_kda_decode(kernels.kda_decode, kda_decode)


def _check_kda_prefill_kernel():
    from kimi_mlx.metal import kernels

    return selfcheck.check_kda_prefill(kernels.kda_prefill, kda_prepare, kda_recurrent)


# The device checks `kernel_enabled` runs before these kernels' first use on Metal.
register_check("kda_decode", _check_kda_decode_kernel)
register_check("kda_prefill", _check_kda_prefill_kernel)
