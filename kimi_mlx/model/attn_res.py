"""AttnRes: Kimi K3's block attention residuals (no plain residual add across blocks).

Source: K31_SPEC.md section 3 "AttnRes"; config `attn_res_block_size` (12). A list of
banked states B (one per block of 12 layers, depth-wise, per token) and a running partial
sum p; each mix is a softmax over candidates c in B + [p] of

    logit_c = (c . w_eff) * rsqrt(mean(c^2) + eps),   w_eff = res_norm.weight * res_proj.weight[0]

returning sum_c softmax_c * c on the raw (unnormalised) candidates, in float32.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn


class Banks:
    """The banked block states of one forward pass: raw [K, B, L, D] plus their inv-RMS.

    This is what crosses a pipeline hop besides the partial sum (`stack` / `from_stacked`).
    """

    def __init__(self, eps: float):
        self.eps = eps
        self.raw: List[mx.array] = []
        self.inv_rms: List[mx.array] = []

    def __len__(self) -> int:
        return len(self.raw)

    def append(self, x: mx.array) -> None:
        """Bank x [B, L, D]."""
        xf = x.astype(mx.float32)
        self.raw.append(x)
        self.inv_rms.append(mx.rsqrt((xf * xf).mean(axis=-1) + self.eps))

    def stack(self) -> Optional[mx.array]:
        """[K, B, L, D] (None when empty)."""
        return mx.stack(self.raw) if self.raw else None

    @classmethod
    def from_stacked(cls, raw: Optional[mx.array], eps: float) -> "Banks":
        """Rebuild from `stack()` output received over a hop (inv-RMS recomputed locally)."""
        banks = cls(eps)
        if raw is not None:
            for i in range(raw.shape[0]):
                banks.append(raw[i])
        return banks


def attn_res_mix(banks: Banks, partial: mx.array, w_eff: mx.array) -> mx.array:
    """Softmax-weighted mix of the banked states and the partial sum.

    Args:
        banks: K banked states, each [B, L, D].
        partial: [B, L, D] running partial sum p.
        w_eff: [D] float32 = res_norm.weight * res_proj.weight[0].
    Returns:
        [B, L, D] in partial's dtype (partial itself when no bank exists yet).
    """
    if not len(banks):
        return partial
    return _mix(banks.raw, banks.inv_rms, partial, w_eff, banks.eps)


@mx.compile
def _mix(raw, inv_rms, partial, w_eff, eps):
    pf = partial.astype(mx.float32)
    p_inv = mx.rsqrt((pf * pf).mean(axis=-1) + eps)
    logits = [(r.astype(mx.float32) @ w_eff) * n for r, n in zip(raw, inv_rms)]
    logits.append((pf @ w_eff) * p_inv)
    weights = mx.softmax(mx.stack(logits), axis=0, precise=True)  # [K+1, B, L]
    out = weights[-1][..., None] * pf
    for i, r in enumerate(raw):
        out = out + weights[i][..., None] * r.astype(mx.float32)
    return out.astype(partial.dtype)


def res_weights(norm: nn.RMSNorm, proj: nn.Linear) -> mx.array:
    """w_eff [D] float32 from a `<name>_res_norm` [D] and `<name>_res_proj` [1, D] pair."""
    return norm.weight.astype(mx.float32) * proj.weight[0].astype(mx.float32)
