"""The micro trainers' training-only model: subclasses of the inference modules whose
parameters are exactly the inference modules' (so the exported names and shapes are the
model's own), and the model built from them (`build_model`). What each adds is described
in `kimi_mlx.micro.train`'s module doc: the DSA indexer's KL training path
(`TrainGatedDSA`, `dsa_train_forward`), the router's expert choices for auxiliary-loss-free
balancing and MXFP4 fake quantization of the routed experts (`TrainLatentMoE`,
`FakeQuantSwitchLinear`). Shared by `make micro`, `micro-moe`, `micro-draft`, `micro-mtp`.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from kimi_mlx.metal.dsa import dsa_index_scores, dsa_topk_mask
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.dsa import GatedDSA
from kimi_mlx.model.ffn import LatentMoE, route
from kimi_mlx.model.model import Model

MXFP4_GROUP = 32


class _Stash:
    """Plain holder for arrays produced inside a forward pass (not a Module parameter)."""

    def __init__(self):
        self.value = None


def mxfp4_roundtrip(w: mx.array) -> mx.array:
    """w [..., in] (in a multiple of 32) -> MXFP4 quantize then dequantize, w's dtype."""
    q, s = mx.quantize(w, group_size=MXFP4_GROUP, bits=4, mode="mxfp4")
    return mx.dequantize(q, s, group_size=MXFP4_GROUP, bits=4, mode="mxfp4").astype(w.dtype)


class FakeQuantSwitchLinear(SwitchLinear):
    """mlx-lm SwitchLinear whose weight is MXFP4 fake-quantized while `qat` is set.

    Forward uses dequant(quant(w)); backward passes the gradient straight through to w.
    """

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__(input_dims, output_dims, num_experts, bias=False)
        self.qat = False

    def __call__(self, x, indices, sorted_indices=False):
        w = self["weight"]
        if self.qat:
            w = w + mx.stop_gradient(mxfp4_roundtrip(w) - w)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)


class TrainLatentMoE(LatentMoE):
    """LatentMoE that keeps each forward's expert choices (for load balancing) and uses
    fake-quantizable expert weights. Same parameters as LatentMoE."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        sw = self.switch_mlp
        latent, hidden, E = sw.gate_proj.input_dims, sw.gate_proj.output_dims, args.num_experts
        sw.gate_proj = FakeQuantSwitchLinear(latent, hidden, E)
        sw.up_proj = FakeQuantSwitchLinear(latent, hidden, E)
        sw.down_proj = FakeQuantSwitchLinear(hidden, latent, E)
        self.num_experts = E
        self.stash = _Stash()
        self.logits = _Stash()  # router logits [B, T, E] of the last forward (MI loss)

    def set_qat(self, on: bool) -> None:
        for proj in (self.switch_mlp.gate_proj, self.switch_mlp.up_proj, self.switch_mlp.down_proj):
            proj.qat = on

    def route(self, x):
        logits = self.gate(x)
        inds, w = route(logits, self.gate.e_score_correction_bias, self.top_k, self.scaling,
                        self.renormalize)
        self.stash.value = inds
        self.logits.value = logits
        return inds, w


def dsa_train_forward(
    attn: GatedDSA, x: mx.array, sparse: bool
) -> Tuple[mx.array, mx.array]:
    """Gated DSA forward of a whole sequence (no cache) plus the indexer's KL loss.

    Same output as `GatedDSA.__call__(x)` when `sparse` (top-`index_topk` selection from
    the same `dsa_index_scores` / `dsa_topk_mask`), dense causal MLA otherwise.

    Args:
        attn: the layer (its weights are used as they are).
        x: [B, T, hidden] normed layer input.
        sparse: restrict the main attention to the indexer's top-k (else dense causal).
    Returns:
        (output [B, T, hidden], KL loss: mean over queries of
        KL(p_attn || softmax(I * Di^-1/2 * Hi^-1/2)) over the allowed keys, a scalar).
        The indexer's inputs are detached and p_attn carries no gradient.
    """
    B, T, _ = x.shape
    H = attn.num_heads
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(qr).reshape(B, T, H, attn.nope + attn.rope).transpose(0, 2, 1, 3)
    q_nope, q_pe = q[..., : attn.nope], q[..., attn.nope :]
    ckv = attn.kv_a_proj_with_mqa(x)
    latent = attn.kv_a_layernorm(ckv[..., : attn.kv_rank])[:, None]  # [B,1,T,rank]
    k_pe = ckv[..., attn.kv_rank :][:, None]  # [B,1,T,rope]
    w_uk, w_uv = attn._kv_b()
    k = latent @ w_uk.swapaxes(-1, -2)  # [B,H,T,nope]
    v = latent @ w_uv.swapaxes(-1, -2)  # [B,H,T,v]
    scores = (q_nope @ k.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)) * attn.scale

    # Indexer on detached inputs: it learns from the KL loss only.
    ind = attn.indexer
    xd, qrd = mx.stop_gradient(x), mx.stop_gradient(qr)
    q_idx, w_idx = ind.queries(xd, qrd)  # [B,T,Hi,Di], [B,T,Hi]
    k_idx = ind.keys(xd)[:, 0]  # [B,T,Di]
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    if sparse and T > attn.index_topk:
        sel = dsa_index_scores(mx.stop_gradient(q_idx), mx.stop_gradient(w_idx),
                               mx.stop_gradient(k_idx), 0)
        allowed = mx.stop_gradient(dsa_topk_mask(sel, attn.index_topk))  # [B,T,T]
    else:
        allowed = mx.broadcast_to(causal, (B, T, T))

    scores = mx.where(allowed[:, None], scores, mx.array(-mx.inf, scores.dtype))
    p = mx.softmax(scores, axis=-1, precise=True)  # [B,H,T,T]
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * attn.v_dim)
    if attn.use_gate:
        o = o * mx.sigmoid(attn.g_proj(x))
    out = attn.o_proj(o)

    # KL(p_attn || q_index) over the allowed keys (DeepSeek-V3.2 indexer training).
    target = mx.stop_gradient(p.sum(axis=1))
    target = target / target.sum(axis=-1, keepdims=True)
    logits = (mx.maximum(q_idx @ k_idx[:, None].swapaxes(-1, -2), 0.0)
              * w_idx[..., None]).sum(axis=2)  # [B,T,T]
    logits = logits * (ind.head_dim**-0.5 * ind.n_heads**-0.5)
    logits = mx.where(allowed, logits, -1e9)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    logp = mx.log(mx.maximum(target, 1e-30))
    kl = mx.where(allowed, target * (logp - logq), 0.0).sum(axis=-1).mean()
    return out, kl


class TrainGatedDSA(GatedDSA):
    """GatedDSA with the DeepSeek-V3.2 indexer training path while `training` is set
    (`sparse` chooses the phase); the inference path otherwise. Same parameters."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.sparse = False
        self.stash = _Stash()

    def __call__(self, x, cache=None):
        if cache is not None or not self.training:
            return super().__call__(x, cache)
        out, self.stash.value = dsa_train_forward(self, x, self.sparse)
        return out


def build_model(args: ModelArgs, seed: int, router_std: float = 0.02) -> Model:
    """Our `Model` with the training subclasses in place and deterministic initial weights.

    Initialisation (NumPy, seeded): linear weights N(0, fan_in^-1/2) with output
    projections scaled by (2 * layers)^-1/2; embedding N(0, 1); norms 1; KDA A_log =
    log U(1, 16) and dt_bias = inverse-softplus of dt ~ logU(1e-3, 1e-1) (FLA's KDA init);
    depthwise convs U(-1/2, 1/2); AttnRes pseudo-queries 0 (uniform mixing at start, as in
    the AttnRes paper); router N(0, router_std) and correction bias 0.
    """
    mx.random.seed(seed)
    model = Model(args)
    for i, layer in enumerate(model.layers):
        if args.is_dsa(i):
            layer.self_attn = TrainGatedDSA(args)
        if args.is_moe(i):
            layer.block_sparse_moe = TrainLatentMoE(args)
    rng = np.random.default_rng(seed)
    scale_out = (2 * args.num_hidden_layers) ** -0.5
    new = []
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            v = dt + np.log(-np.expm1(-dt))
        elif name.endswith("conv1d.weight"):
            v = rng.uniform(-0.5, 0.5, shape)
        elif name.endswith("_res_proj.weight") or name.endswith("e_score_correction_bias"):
            v = np.zeros(shape)
        elif name.endswith("gate.weight"):
            v = rng.normal(0.0, router_std, shape)
        elif "norm" in name:
            v = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("embed_tokens.weight"):
            v = rng.normal(0.0, 1.0, shape)
        else:
            v = rng.normal(0.0, shape[-1] ** -0.5, shape)
            if name.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
                v = v * scale_out
        new.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(new, strict=True)
    model.freeze(keys=["e_score_correction_bias"])
    model.train()
    mx.eval(model.parameters())
    return model


def _modules(model: Model, cls):
    return [m for _, m in model.named_modules() if isinstance(m, cls)]


def set_phase(model: Model, sparse: bool, qat: bool) -> None:
    """Choose the DSA phase (dense warm-up or sparse) and MXFP4 QAT on or off."""
    for m in _modules(model, TrainGatedDSA):
        m.sparse = sparse
    for m in _modules(model, TrainLatentMoE):
        m.set_qat(qat)
