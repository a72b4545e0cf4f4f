"""Kimi Delta Attention layer (69 of K3.1's 93 layers).

Source: Kimi Linear (arXiv 2510.26692); K31_SPEC.md section 3 "KDA"; config
`linear_attn_config` {num_heads, head_dim, short_conv_kernel_size, gate_lower_bound,
use_full_rank_gate}. Parameter names are the checkpoint's own (`q_proj`, `q_conv1d`,
`f_a_proj`, `A_log`, ...), so the loader maps nothing here but the A_log padding.

Cache: mlx-lm `ArraysCache(2)` = [conv state [B, K-1, 3P] (act dtype),
recurrent state [B, H, Dv, Dk] float32], constant size in the sequence length.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.metal.dispatch import kernel_mode
from kimi_mlx.metal.kda import RECURRENT_MAX_T, kda_forward, kda_prepare, kda_recurrent, kda_update


def causal_depthwise_conv(x: mx.array, weight: mx.array, state: mx.array):
    """Short causal depthwise conv; the last tap multiplies the current token.

    Args:
        x: [B, T, C] new inputs.
        weight: [C, 1, K] (the checkpoint's layout; F32 in the release).
        state: [B, K-1, C] the previous K-1 inputs (zeros at sequence start).
    Returns:
        (y [B, T, C] in x's dtype, new state [B, K-1, C]).
    """
    K = weight.shape[-1]
    T = x.shape[1]
    xs = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, T+K-1, C]
    w = weight[:, 0, :].astype(mx.float32)  # [C, K]
    y = xs[:, 0:T].astype(mx.float32) * w[:, 0]
    for j in range(1, K):
        y = y + xs[:, j : j + T].astype(mx.float32) * w[:, j]
    return y.astype(x.dtype), xs[:, -(K - 1) :]


class KimiDeltaAttention(nn.Module):
    """KDA: q,k,v = SiLU(conv(W x)); L2-normalised q (x Dk^-1/2), k; per-channel decay;
    delta-rule recurrence; per-head RMSNorm output times sigmoid(g_proj x); o_proj.

    x: [B, T, hidden] -> [B, T, hidden].
    """

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        cfg = args.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads = H = cfg["num_heads"]
        self.head_dim = D = cfg["head_dim"]
        self.conv_size = cfg["short_conv_kernel_size"]
        self.lower_bound = cfg.get("gate_lower_bound")
        P = H * D
        d = args.hidden_size
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", nn.Linear(d, P, bias=False))
            setattr(self, f"{name}_conv1d", _Conv(P, self.conv_size))
        self.f_a_proj = nn.Linear(d, D, bias=False)
        self.f_b_proj = nn.Linear(D, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        if not cfg.get("use_full_rank_gate", True):
            raise ValueError(
                "linear_attn_config.use_full_rank_gate=false (low-rank KDA output gate) "
                "is not a K3/K3.1 layout"
            )
        self.g_proj = nn.Linear(d, P, bias=False)
        self.A_log = mx.zeros((H,), dtype=mx.float32)
        self.dt_bias = mx.zeros((P,), dtype=mx.float32)
        self.o_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(P, d, bias=False)
        self._decode = None
        self._verify = None

    def __call__(self, x: mx.array, cache: Optional[Any] = None) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        P = H * D
        conv_state = cache[0] if cache is not None else None
        state = cache[1] if cache is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_size - 1, 3 * P), dtype=x.dtype)
        if state is None:
            state = mx.zeros((B, H, D, D), dtype=mx.float32)
        # A right-padded batch prefill (mlx-lm BatchGenerator) gives each row's real token
        # count in this chunk; padded steps must leave both states untouched. A speculative
        # verify step records this layer's per-token inputs for an exact rollback
        # (kimi_mlx/speculative/rollback.py sets the record on the cache).
        lengths = getattr(cache, "lengths", None)
        record = getattr(cache, "verify_record", None)
        compiled = not self.training and kernel_mode() != "sim"
        if lengths is not None:
            y, conv_state, state = self._forward(x, conv_state, state, lengths=lengths,
                                                 record=record)
        elif T == 1 and compiled and record is None:
            # One decode token: a compiled graph (fused elementwise ops, no per-op overhead).
            # Not under the emulator: its kernels read their inputs, which a trace cannot.
            if self._decode is None:
                self._decode = mx.compile(self._forward)
            y, conv_state, state = self._decode(x, conv_state, state)
        elif record is not None and compiled:
            # A verify step (a few tokens): compiled too, the recorded inputs as outputs;
            # one graph with and one without per-token states (`keeps_step_states`).
            keep = keeps_step_states(T, B, H, D)
            if self._verify is None:
                self._verify = {}
            if keep not in self._verify:
                self._verify[keep] = mx.compile(partial(self._forward_recorded, keep=keep))
            y, conv_state, state, *inputs = self._verify[keep](x, conv_state, state)
            record.capture(self, *inputs)
        else:
            y, conv_state, state = self._forward(
                x, conv_state, state, record=record,
                keep_states=record is not None and keeps_step_states(T, B, H, D))
        if cache is not None:
            cache[0], cache[1] = conv_state, state
            if hasattr(cache, "advance"):
                cache.advance(T)  # counts down the batch padding bookkeeping
        return y

    def _forward_recorded(self, x: mx.array, conv_state: mx.array, state: mx.array,
                          keep: bool = False):
        """`_forward`'s outputs followed by the inputs a rollback replays (see
        `rollback.KDARecord`: conv_in, q, k, v, a, b, and the per-token states if keep)."""
        rec = _Recorded()
        return (*self._forward(x, conv_state, state, record=rec, keep_states=keep),
                *rec.arrays)

    def _forward(self, x: mx.array, conv_state: mx.array, state: mx.array,
                 lengths: Optional[mx.array] = None, record=None, keep_states: bool = False):
        """(y [B, T, hidden], conv state [B, K-1, 3P], recurrent state [B, H, Dv, Dk]).

        lengths [B] (batched prefill): tokens past lengths[b] are padding; the returned
        states are those after row b's last real token (outputs there are don't-care).
        record: a `rollback.KDARecord` to receive the per-token inputs, or None.
        keep_states: with a record, run the token loop and record each token's state too
            (`keeps_step_states` decides; the caller passes it so that a compiled trace
            knows which graph it holds).
        """
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        P = H * D
        valid = None
        if lengths is not None:
            ends = mx.clip(lengths, 0, T)
            valid = mx.arange(T)[None] < ends[:, None]  # [B, T]

        streams, new_conv, conv_in = [], [], []
        for i, name in enumerate("qkv"):
            proj = getattr(self, f"{name}_proj")(x)
            conv_in.append(proj)
            y, s = causal_depthwise_conv(
                proj, getattr(self, f"{name}_conv1d").weight, conv_state[..., i * P : (i + 1) * P],
            )
            if valid is not None:  # state = the K-1 inputs before position ends[b]
                xs = mx.concatenate([conv_state[..., i * P : (i + 1) * P].astype(x.dtype), proj], axis=1)
                pos = (ends[:, None] + mx.arange(self.conv_size - 1))[..., None]
                s = mx.take_along_axis(xs, pos, axis=1)
            streams.append(nn.silu(y).reshape(B, T, H, D))
            new_conv.append(s)
        q, k, v = streams
        raw = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        b = self.b_proj(x)
        lower = float(self.lower_bound) if self.lower_bound is not None else None
        step_states = None
        if record is not None and valid is None and keep_states:
            # A small verify step: the token loop computes every per-token state anyway;
            # keeping them makes the rollback a pick instead of a replay.
            qn, kn, g, beta = kda_prepare(q, k, raw, b, self.A_log, self.dt_bias, lower, D**-0.5)
            step_states = []
            o, state = kda_recurrent(qn, kn, v, g, beta, state, states_out=step_states)
            step_states = mx.stack(step_states, axis=1)  # [B, T, H, Dv, Dk]
        elif valid is None:
            # L2 norms, gate, beta and the recurrence (kernel or reference: metal/kda.py).
            o, state = kda_forward(q, k, v, raw, b, self.A_log, self.dt_bias, state, lower, D**-0.5)
        else:  # padded steps: decay exp(0) = 1 and beta = 0 leave the state as it was
            qn, kn, g, beta = kda_prepare(q, k, raw, b, self.A_log, self.dt_bias, lower, D**-0.5)
            g = mx.where(valid[:, :, None, None], g, 0.0)
            beta = mx.where(valid[:, :, None], beta, 0.0)
            o, state = kda_update(qn, kn, v, g, beta, state)
        if record is not None:
            record.capture(self, mx.concatenate(conv_in, axis=-1), q, k, v, raw, b, step_states)

        gate = mx.sigmoid(self.g_proj(x).reshape(B, T, H, D))
        o = (self.o_norm(o.astype(x.dtype)) * gate).astype(x.dtype)  # o_norm is F32 on disk
        return self.o_proj(o.reshape(B, T, P)), mx.concatenate(new_conv, axis=-1), state


# Per-token states a verify step may keep for its rollback (bytes per layer, all T states).
# At the micro model's size (4 heads x 32 x 32) a state is 16 KB and keeping them is free;
# at K3.1's (96 x 128 x 128 f32 = 6.3 MB) a 4-token verify would write 25 MB per layer x 69
# layers on every step, so there the rollback replays the accepted tokens instead
# (kimi_mlx/speculative/rollback.py says why).
STEP_STATES_MAX_BYTES = 1 << 20


def keeps_step_states(T: int, B: int, H: int, D: int) -> bool:
    """Whether a T-token verify step keeps its per-token states (see STEP_STATES_MAX_BYTES):
    only where the token loop runs anyway (the reference ops, T <= RECURRENT_MAX_T; the
    Metal kernels and the emulator produce the final state only)."""
    return (kernel_mode() == "reference" and T <= RECURRENT_MAX_T
            and T * B * H * D * D * 4 <= STEP_STATES_MAX_BYTES)


class _Recorded:
    """Collects the arrays `_forward` records, inside a compiled trace."""

    def capture(self, layer, *arrays):
        self.arrays = tuple(a for a in arrays if a is not None)  # no per-step states: None


class _Conv(nn.Module):
    """Holds a depthwise conv weight under the checkpoint name `<q|k|v>_conv1d.weight`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel), dtype=mx.float32)
