"""Feed-forward blocks: SiTU MLP (dense layer 0, shared experts) and the latent MoE.

Sources: K31_SPEC.md section 3 ("SiTU", "Latent MoE"); config keys `activation_situ_beta`,
`activation_situ_linear_beta`, `num_experts`, `num_experts_per_token`,
`routed_expert_hidden_size`, `latent_moe_use_norm`, `routed_scaling_factor`.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from kimi_mlx.model.config import ModelArgs


@partial(mx.compile, shapeless=True)
def situ(gate: mx.array, up: mx.array, beta: float, linear_beta: float) -> mx.array:
    """SiTU gated activation, computed in float32, returned in `up`'s dtype.

    situ(g, u) = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)
    (linear_beta <= 0 means no bound on u). Any matching shapes.
    """
    g = gate.astype(mx.float32)
    u = up.astype(mx.float32)
    a = beta * mx.tanh(g / beta) * mx.sigmoid(g)
    if linear_beta > 0:
        u = linear_beta * mx.tanh(u / linear_beta)
    return (a * u).astype(up.dtype)


class SiTU(nn.Module):
    """SiTU as the `activation(up, gate)` callable mlx-lm's SwitchGLU expects."""

    def __init__(self, beta: float, linear_beta: Optional[float]):
        super().__init__()
        self.beta = float(beta)
        self.linear_beta = float(linear_beta or 0.0)

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return situ(gate, up, self.beta, self.linear_beta)


class SiTUMLP(nn.Module):
    """down(situ(gate(x), up(x))): dense layer 0 (width `intermediate_size`) and shared experts.

    x: [..., hidden] -> [..., hidden].
    """

    def __init__(self, args: ModelArgs, hidden: int):
        super().__init__()
        d = args.hidden_size
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act = SiTU(args.activation_situ_beta, args.activation_situ_linear_beta)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x), self.gate_proj(x)))


def route(
    logits: mx.array,
    bias: mx.array,
    top_k: int,
    scaling: float,
    renormalize: bool = True,
) -> Tuple[mx.array, mx.array]:
    """Sigmoid router with `e_score_correction_bias` used for selection only (noaux_tc).

    Args:
        logits: [..., E] router logits (any float dtype; computed in float32).
        bias: [E] float32 e_score_correction_bias.
        top_k: num_experts_per_token.
        scaling: routed_scaling_factor.
    Returns:
        (indices [..., top_k] uint32, weights [..., top_k] float32) where
        weights = s_sel / (sum s_sel + 1e-20) * scaling, s = sigmoid(logits).
    """
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)
    inds = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    inds = mx.stop_gradient(inds)
    w = mx.take_along_axis(scores, inds, axis=-1)
    if renormalize and top_k > 1:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return inds.astype(mx.uint32), w * scaling


class Router(nn.Module):
    """`block_sparse_moe.gate`: weight [E, hidden] and e_score_correction_bias [E] (F32)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        self.e_score_correction_bias = mx.zeros((num_experts,), dtype=mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


class LatentMoE(nn.Module):
    """K3 latent MoE: routed experts work in `routed_expert_hidden_size` (3584) dims.

    y = up(RMSNorm(sum_k w_k * expert_k(down(x)))) + shared(x); experts are mlx-lm's
    SwitchGLU (gather-qmm once quantized to mxfp4). x: [B, L, hidden] -> same.
    """

    def __init__(self, args: ModelArgs, layer: Optional[int] = None):
        """`layer` (0-based) picks its own expert count in a non-uniformly pruned build
        (`ModelArgs.experts_in`); None means `num_experts`."""
        super().__init__()
        num_experts = args.num_experts if layer is None else args.experts_in(layer)
        self.top_k = args.num_experts_per_token
        self.scaling = args.routed_scaling_factor
        self.renormalize = args.moe_renormalize
        d, latent = args.hidden_size, args.routed_expert_hidden_size or args.hidden_size
        self.gate = Router(d, num_experts)
        self.latent = args.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.routed_expert_norm = (
            nn.RMSNorm(latent, eps=args.rms_norm_eps) if args.latent_moe_use_norm else None
        )
        self.switch_mlp = SwitchGLU(
            latent,
            args.moe_intermediate_size,
            num_experts,
            activation=SiTU(args.activation_situ_beta, args.activation_situ_linear_beta),
        )
        self.shared_experts = (
            SiTUMLP(args, args.moe_intermediate_size * args.num_shared_experts)
            if args.num_shared_experts
            else None
        )
        # Set by `shard.shard`: the group whose ranks each hold a slice of every expert's
        # (and the shared experts') intermediate dim; None in one process.
        self.sharding_group = None

    def route(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """(indices, weights) for x [..., hidden]; see `route`."""
        return route(
            self.gate(x),
            self.gate.e_score_correction_bias,
            self.top_k,
            self.scaling,
            self.renormalize,
        )

    def __call__(self, x: mx.array) -> mx.array:
        inds, w = self.route(x)
        z = self.routed_expert_down_proj(x) if self.latent else x
        y = self.switch_mlp(z, inds)  # [B, L, k, latent]
        y = (y * w[..., None].astype(y.dtype)).sum(axis=-2)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.sharding_group is not None:
            y, shared = sum_partials(y, shared, self.sharding_group)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared
        return y


def sum_partials(y: mx.array, shared: Optional[mx.array], group) -> Tuple[mx.array, Optional[mx.array]]:
    """One all_sum over `group` of a tensor-parallel MoE block's two partial sums: the
    routed experts' (latent width, before `routed_expert_norm`, which needs the full sum)
    and the shared experts' (hidden width), concatenated as mlx-lm's kimi_k3 does.
    y [..., latent], shared [..., hidden] or None -> the summed pair."""
    if shared is None:
        return mx.distributed.all_sum(y, group=group), None
    split = y.shape[-1]
    total = mx.distributed.all_sum(mx.concatenate([y, shared.astype(y.dtype)], axis=-1),
                                   group=group)
    return total[..., :split], total[..., split:].astype(shared.dtype)
