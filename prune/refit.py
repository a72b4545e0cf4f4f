"""Router-row re-fitting after pruning (`kimi-mlx prune --refit-router`).

Pruning removes experts but leaves the kept experts' router rows as they were, so the
pruned router picks its top-k among the survivors by the old logits: a token whose chosen
experts were partly pruned gets substitutes, weighted as the old router happens to score
them. Re-fitting changes the kept rows so that the pruned router reproduces, on the
calibration tokens, the full model's gate distribution renormalised over the kept experts:

    g(x)   = full gate over all E experts: top-k of sigmoid(W x) + b (selection only, the
             e_score_correction_bias b), the selected sigmoid scores renormalised, 0 else;
    q(x)   = g(x) restricted to the kept set K and renormalised (tokens where the full
             router chose no kept expert carry no target and are skipped);
    p_θ(x) = the pruned gate with rows W_K': top-k over K of sigmoid(W_K' x) + b_K, the
             selected sigmoid scores renormalised (what the pruned model multiplies by).

W_K' starts at the kept rows W_K and minimises, with Adam in MLX (`steps`, `lr`), the mean
over tokens of the cross-entropy of q against p_θ on p_θ's selected experts (selection
held fixed within a step, as in the model), plus `hinge` x a selection hinge (for each
expert in q's support, max(0, m + best score of an expert outside the support - its
score), scores sigmoid + b, margin m = `margin`, which brings a target the pruned top-k
missed back in, where the cross-entropy has no gradient), plus `l2` x mean((W_K' - W_K)^2).
A token whose experts were all kept starts at zero loss, so the refit moves only what the
pruning broke. (A dense stand-in, sigmoid(W_K' x) renormalised over all of K, was tried
first: it also pushes down every unselected kept expert, moves well-routed tokens and fit
the real gate worse on the test bed.) The correction bias b_K is kept as is: it only shifts the selection
(noaux_tc), and it is 0 on a model trained without load balancing; the K3 router has no
logit bias to fit. The router input x is the MoE block's input (the hidden state after
the layer's post-attention norm), recorded by the calibration pass (`observe(...,
router_inputs=N)`, N tokens per MoE layer, strided over the calibration set).

After `prune --merge` (`kimi_mlx.prune.merge`) the target is the full gate with each
dropped expert's weight added to the kept expert it was merged into (`target_gates(...,
into=)`), so the refit sends a dropped expert's tokens to its merge target.

`gate_kl` measures what the refit is for: the mean over target tokens of KL(q || p) with
p the actual pruned gate (top-k over K, renormalised), smoothed by `eps`; `gate_tv` the
mean total variation distance between the two. Rows whose KL would be worse than the old
rows' are not used (the old rows are returned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

DEFAULT_STEPS = 300
DEFAULT_TOKENS = 16384  # router inputs kept per MoE layer (observe(router_inputs=...))
DEFAULT_LR = 1e-2
DEFAULT_L2 = 1e-3
DEFAULT_HINGE = 3.0
DEFAULT_MARGIN = 0.05
KL_EPS = 1e-4


@dataclass
class RefitResult:
    """One layer's refit.

    Attributes:
        weight: float32 [n_keep, hidden] the new router rows of the kept experts (in the
            kept order); bias: float32 [n_keep] their correction bias (unchanged).
        tokens: calibration tokens with a target (the full router chose a kept expert);
        skipped: tokens without one.
        kl_before, kl_after: `gate_kl` of the pruned gate with the old / new rows.
        tv_before, tv_after: `gate_tv` likewise.
    """

    weight: np.ndarray
    bias: np.ndarray
    tokens: int
    skipped: int
    kl_before: float
    kl_after: float
    tv_before: float = 0.0
    tv_after: float = 0.0


def _gate(logits: mx.array, bias: mx.array, top_k: int) -> mx.array:
    """Dense [N, E] renormalised top-k sigmoid gate (selection by sigmoid + bias)."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    k = min(top_k, scores.shape[-1])
    inds = mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[..., :k]
    w = mx.take_along_axis(scores, inds, axis=-1)
    w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return mx.put_along_axis(mx.zeros_like(scores), inds, w, axis=-1)


def target_gates(x: mx.array, weight: mx.array, bias: mx.array, kept: Sequence[int],
                 top_k: int, into: Optional[Mapping[int, int]] = None) -> Tuple[mx.array, mx.array]:
    """(q [n, K] full gate renormalised over the kept experts, valid [N] bool).

    x [N, hidden], weight [E, hidden], bias [E]; q holds only the valid tokens' rows.
    `into` {dropped id: kept id} (`prune --merge`): a dropped expert's gate weight counts
    for the kept expert it was merged into.
    """
    kept = list(kept)
    g = _gate(x @ weight.T, bias, top_k)
    if into:
        col = {k: c for c, k in enumerate(kept)}
        fold = np.zeros((weight.shape[0], len(kept)), np.float32)
        for c, k in enumerate(kept):
            fold[k, c] = 1.0
        for d, k in into.items():
            fold[d, col[k]] = 1.0
        g = g @ mx.array(fold)
    else:
        g = g[:, mx.array(kept)]
    s = g.sum(axis=-1)
    valid = s > 0
    idx = mx.array(np.flatnonzero(np.array(valid)).astype(np.int32))
    q = g[idx] / s[idx][:, None]
    return q, valid


def gate_kl(x: mx.array, weight_k: mx.array, bias_k: mx.array, q: mx.array, top_k: int,
            eps: float = KL_EPS) -> float:
    """Mean KL(q || p) over the rows of q, p the pruned gate of rows `weight_k` [K, hidden]
    (top-k of sigmoid + bias_k over the kept experts, renormalised), smoothed as
    (p + eps) / (1 + K eps). x [n, hidden] are the tokens of q [n, K]."""
    p = _gate(x @ weight_k.T, bias_k, top_k)
    p = (p + eps) / (1 + eps * p.shape[-1])
    kl = (q * (mx.log(mx.maximum(q, 1e-30)) - mx.log(p))).sum(axis=-1)
    return float(kl.mean().item()) if q.shape[0] else 0.0


def gate_tv(x: mx.array, weight_k: mx.array, bias_k: mx.array, q: mx.array, top_k: int) -> float:
    """Mean total variation distance between q [n, K] and the pruned gate (as `gate_kl`)."""
    p = _gate(x @ weight_k.T, bias_k, top_k)
    return float((0.5 * mx.abs(p - q).sum(axis=-1)).mean().item()) if q.shape[0] else 0.0


def refit_layer(x, weight, bias, kept: Sequence[int], top_k: int, *,
                steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR, l2: float = DEFAULT_L2,
                hinge: float = DEFAULT_HINGE, margin: float = DEFAULT_MARGIN,
                into: Optional[Mapping[int, int]] = None) -> RefitResult:
    """Re-fit one layer's kept router rows (see the module docstring).

    Args:
        x: [N, hidden] router inputs (NumPy or MLX, any float dtype).
        weight: [E, hidden] the full router; bias: [E] its e_score_correction_bias.
        kept: sorted kept expert ids (len >= top_k); top_k: num_experts_per_token.
        steps, lr, l2: Adam steps, learning rate, pull toward the old rows.
        hinge, margin: weight and margin of the selection hinge.
        into: {dropped id: kept id} of `prune --merge` (see `target_gates`).
    Returns:
        RefitResult (old rows unchanged when no token has a target or steps == 0).
    Raises:
        ValueError: shapes that do not agree, or fewer kept experts than top_k.
    """
    x = mx.array(np.asarray(x, dtype=np.float32))
    weight = mx.array(np.asarray(weight, dtype=np.float32))
    bias = mx.array(np.asarray(bias, dtype=np.float32))
    E, d = weight.shape
    if x.ndim != 2 or x.shape[1] != d or bias.shape != (E,):
        raise ValueError(f"router refit: x {x.shape}, weight {weight.shape}, bias {bias.shape} "
                         "do not agree (want [N, hidden], [E, hidden], [E])")
    kept = list(kept)
    if len(kept) < top_k:
        raise ValueError(f"router refit: {len(kept)} kept experts, fewer than top_k {top_k}")
    ids = mx.array(kept)
    w0, b_k = weight[ids], bias[ids]
    q, valid = target_gates(x, weight, bias, kept, top_k, into)
    n = int(q.shape[0])
    xv = x[mx.array(np.flatnonzero(np.array(valid)).astype(np.int32))]
    before, tv0 = gate_kl(xv, w0, b_k, q, top_k), gate_tv(xv, w0, b_k, q, top_k)
    if n == 0 or steps <= 0:
        return RefitResult(np.array(w0), np.array(b_k), n, x.shape[0] - n, before, before, tv0, tv0)
    target = q > 0
    k = min(top_k, len(kept))

    def loss(w):
        sc = mx.sigmoid(xv @ w.T)
        c = sc + b_k
        inds = mx.stop_gradient(mx.argpartition(-c, kth=k - 1, axis=-1)[..., :k])
        chosen = mx.take_along_axis(sc, inds, axis=-1)
        logp = mx.log(chosen + 1e-12) - mx.log(chosen.sum(axis=-1, keepdims=True))
        ce = -(mx.take_along_axis(q, inds, axis=-1) * logp).sum(axis=-1).mean()
        rival = mx.where(target, -1e9, c).max(axis=-1, keepdims=True)
        sel = mx.where(target, mx.maximum(rival - c + margin, 0.0), 0.0).sum(axis=-1).mean()
        return ce + hinge * sel + l2 * ((w - w0) ** 2).mean()

    grad = mx.value_and_grad(loss)
    opt = optim.Adam(learning_rate=lr)
    state = {"w": w0}
    for _ in range(steps):
        _, g = grad(state["w"])
        state = opt.apply_gradients({"w": g}, state)
        mx.eval(state["w"], opt.state)
    w = state["w"]
    after, tv1 = gate_kl(xv, w, b_k, q, top_k), gate_tv(xv, w, b_k, q, top_k)
    if after > before:  # never hand back rows that fit worse than the old ones
        w, after, tv1 = w0, before, tv0
    return RefitResult(np.array(w), np.array(b_k), n, x.shape[0] - n, before, after, tv0, tv1)


def refit_routers(inputs: Mapping[int, np.ndarray], routers: Mapping[int, Tuple[np.ndarray, np.ndarray]],
                  kept: Mapping[int, Sequence[int]], top_k: int, *, steps: int = DEFAULT_STEPS,
                  lr: float = DEFAULT_LR, l2: float = DEFAULT_L2,
                  log=None, into: Optional[Mapping[int, Mapping[int, int]]] = None
                  ) -> Dict[int, RefitResult]:
    """`refit_layer` for every MoE layer of `kept` ({layer: ids}); `inputs` {layer:
    [N, hidden]} and `routers` {layer: (weight [E, hidden], bias [E])} from the
    calibration pass; `into` {layer: {dropped: kept}} with `prune --merge`.
    Raises ValueError when a layer has no recorded inputs."""
    out: Dict[int, RefitResult] = {}
    for layer in sorted(kept):
        if layer not in inputs or layer not in routers:
            raise ValueError(f"router refit: layer {layer} has no recorded router inputs "
                             "(calibrate with router_inputs > 0)")
        w, b = routers[layer]
        out[layer] = r = refit_layer(inputs[layer], w, b, kept[layer], top_k, steps=steps,
                                     lr=lr, l2=l2, into=(into or {}).get(layer))
        if log is not None:
            log(f"layer {layer}: router refit on {r.tokens} tokens ({r.skipped} without a kept "
                f"expert): gate KL {r.kl_before:.4f} -> {r.kl_after:.4f}, TV {r.tv_before:.3f} "
                f"-> {r.tv_after:.3f}")
    return out


def router_rows(results: Mapping[int, RefitResult]) -> Dict[int, Dict[str, np.ndarray]]:
    """{layer: {"weight": rows, "e_score_correction_bias": bias}} for the writer."""
    return {l: {"weight": r.weight, "e_score_correction_bias": r.bias} for l, r in results.items()}
