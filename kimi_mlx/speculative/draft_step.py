"""One decode step of a KDA-only kimi-mlx model with fused weights: the draft's hot loop.

On the MLX CPU backend a small model costs per graph node, not per FLOP (~8 us a matmul,
~5 us a fused elementwise kernel, ~1 us a view; `kimi-mlx bench spec` is the figure that
counts). The model's own decode step of the shipped 2-layer micro-draft is ~490 nodes:
per KDA layer seven projections of the same input, three separate short convs with a
slice per tap, per-op dtype casts of BF16 weights. This step computes the same function
with weights fused once, in the activation dtype:

* per layer, one matmul for q|k|v|g|f_a|b (they all read the normed input), one for the
  MLP's gate|up, and one short conv over the q|k|v stream (a multiply and a sum over the
  K taps);
* the KDA math itself (L2 norms, gate, beta, the delta-rule step) is the reference op
  `kimi_mlx.metal.kda.kda_decode`, the AttnRes mixes are `attn_res.attn_res_mix`, the
  activation `ffn.situ`: only the wiring of the layer is repeated here, and
  `tests/test_speculative.py` checks the logits and states against `Model.__call__`.

It is for drafting: a draft's logits only choose proposals (the target verifies every
token), so rounding differences from the fused matmuls cannot change the output.

Source of the math: K31_SPEC.md section 3 (AttnRes, KDA, SiTU); `kimi_mlx.model.model`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from kimi_mlx.model.attn_res import Banks, attn_res_mix, res_weights
from kimi_mlx.model.ffn import situ
from kimi_mlx.metal.kda import kda_decode

__all__ = ["FusedKDAStep", "supports"]


def supports(model) -> bool:
    """True for a kimi-mlx `Model` holding all its layers, every one KDA with a dense MLP
    (no MoE), with AttnRes: the shape `FusedKDAStep` implements."""
    from kimi_mlx.model.ffn import SiTUMLP
    from kimi_mlx.model.kda import KimiDeltaAttention

    text = getattr(getattr(model, "language_model", None), "model", None)
    if text is None or not (getattr(text, "is_first", False) and getattr(text, "is_last", False)):
        return False
    if not text.args.attn_res_block_size or text.args.tie_word_embeddings:
        return False
    return all(isinstance(l.self_attn, KimiDeltaAttention) and isinstance(l.ffn, SiTUMLP)
               for l in model.layers)


class _Layer:
    """Fused float32 weights of one KDA + dense-MLP decoder layer."""

    def __init__(self, layer, dtype):
        a = layer.self_attn
        self.idx = layer.idx
        self.H, self.D = a.num_heads, a.head_dim
        self.P = self.H * self.D
        self.lower = float(a.lower_bound) if a.lower_bound is not None else None
        cast = lambda w: w.astype(dtype)  # noqa: E731
        # input projections, in this column order: q | k | v | g | f_a | b
        self.w_in = cast(mx.concatenate(
            [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.g_proj.weight,
             a.f_a_proj.weight, a.b_proj.weight], axis=0).T)
        self.w_fb = cast(a.f_b_proj.weight.T)
        # conv taps [K, 3P] (tap j multiplies input t - (K - 1) + j), float32 as the layer
        conv = mx.concatenate([a.q_conv1d.weight, a.k_conv1d.weight, a.v_conv1d.weight], 0)
        self.conv = conv[:, 0, :].T.astype(mx.float32)
        self.A_log, self.dt_bias = a.A_log, a.dt_bias
        self.o_norm_w, self.o_norm_eps = a.o_norm.weight, a.o_norm.eps
        self.w_o = cast(a.o_proj.weight.T)
        m = layer.ffn
        self.I = m.gate_proj.weight.shape[0]
        self.w_gu = cast(mx.concatenate([m.gate_proj.weight, m.up_proj.weight], 0).T)
        self.w_down = cast(m.down_proj.weight.T)
        self.beta, self.linear_beta = m.act.beta, m.act.linear_beta
        self.in_norm = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.post_norm = (layer.post_attention_layernorm.weight,
                          layer.post_attention_layernorm.eps)
        self.w_attn = res_weights(layer.self_attention_res_norm, layer.self_attention_res_proj)
        self.w_mlp = res_weights(layer.mlp_res_norm, layer.mlp_res_proj)
        self.block = layer.block_size

    def attention(self, x: mx.array, conv_state: mx.array, state: mx.array):
        """x [1, d] normed input -> (out [1, d], conv state [1, K-1, 3P], state)."""
        H, D, P = self.H, self.D, self.P
        proj = x @ self.w_in  # [1, 3P + P + D + H]
        qkv, g_in = proj[:, : 3 * P], proj[:, 3 * P : 4 * P]
        a = proj[:, 4 * P : 4 * P + D] @ self.w_fb  # raw gate input [1, P]
        b = proj[:, 4 * P + D :]  # beta logits [1, H]
        xs = mx.concatenate([conv_state.astype(qkv.dtype), qkv[:, None]], axis=1)  # [1,K,3P]
        y = (xs.astype(mx.float32) * self.conv).sum(axis=1).astype(qkv.dtype)
        y = y * mx.sigmoid(y)  # SiLU
        q, k, v = (y[:, i * P : (i + 1) * P].reshape(1, 1, H, D) for i in range(3))
        o, state = kda_decode(q, k, v, a.reshape(1, 1, H, D), b.reshape(1, 1, H), self.A_log,
                              self.dt_bias, state, self.lower, D**-0.5)
        o = mx.fast.rms_norm(o.astype(x.dtype), self.o_norm_w, self.o_norm_eps)
        o = (o * mx.sigmoid(g_in.reshape(1, 1, H, D))).astype(x.dtype)
        return o.reshape(1, P) @ self.w_o, xs[:, 1:], state

    def __call__(self, x: mx.array, banks: Banks, conv_state, state):
        """DecoderLayer.__call__ for one token: x [1, d] -> (partial [1, d], banks, states)."""
        h = attn_res_mix(banks, x, self.w_attn)
        partial = x
        if self.idx % self.block == 0:
            banks.append(x)
            partial = None
        y, conv_state, state = self.attention(
            mx.fast.rms_norm(h, *self.in_norm), conv_state, state)
        partial = y if partial is None else partial + y
        h = attn_res_mix(banks, partial, self.w_mlp)
        gu = mx.fast.rms_norm(h, *self.post_norm) @ self.w_gu
        act = situ(gu[:, : self.I], gu[:, self.I :], self.beta, self.linear_beta)
        return partial + act @ self.w_down, banks, conv_state, state


class FusedKDAStep:
    """`model(token[None, None], cache)[0, -1]` for a model `supports` accepts, as
    `step(token, states) -> (logits [V], states)` with fused weights (built once, here).

    token: [1] integer array; states: one (conv [1, K-1, 3P], recurrent [1, H, Dv, Dk]
    float32) pair per layer, as the model's `ArraysCache`s hold them (batch of one).
    Pure function of its inputs: fit for `mx.compile` and for chaining greedy steps.
    Raises ValueError for a model that `supports` refuses.
    """

    def __init__(self, model):
        if not supports(model):
            raise ValueError("FusedKDAStep needs a whole kimi-mlx model of KDA layers with "
                             "dense MLPs and AttnRes")
        text = model.language_model.model
        self.dtype = text.activation_dtype or text.embed_tokens.weight.dtype
        self.embed = text.embed_tokens.weight
        self.layers = [_Layer(l, self.dtype) for l in model.layers]
        self.eps = text.args.rms_norm_eps
        self.w_out = res_weights(text.output_attn_res_norm, text.output_attn_res_proj)
        self.norm = (text.norm.weight, text.norm.eps)
        self.w_head = model.language_model.lm_head.weight.astype(self.dtype).T
        mx.eval(self.arrays())

    def arrays(self) -> List[mx.array]:
        out = [self.embed, self.w_out, self.w_head]
        for l in self.layers:
            out += [l.w_in, l.w_fb, l.conv, l.w_o, l.w_gu, l.w_down, l.w_attn, l.w_mlp]
        return out

    def __call__(self, token: mx.array, states: List[Tuple[mx.array, mx.array]]
                 ) -> Tuple[mx.array, List[Tuple[mx.array, mx.array]]]:
        x = self.embed[token].astype(self.dtype)  # [1, d]
        banks = Banks(self.eps)
        new = []
        for layer, (conv_state, state) in zip(self.layers, states):
            x, banks, conv_state, state = layer(x, banks, conv_state, state)
            new.append((conv_state, state))
        h = mx.fast.rms_norm(attn_res_mix(banks, x, self.w_out), *self.norm)
        return (h @ self.w_head)[0], new


def fused_step_for(model) -> Optional[FusedKDAStep]:
    """A `FusedKDAStep` for the model, or None when `supports` refuses it."""
    return FusedKDAStep(model) if supports(model) else None
