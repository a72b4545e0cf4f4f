"""Gated DeepSeek Sparse Attention layer (24 of K3.1's 93 layers): K3's gated MLA plus the
K3.1 lightning indexer.

Sources: K31_SPEC.md section 3 ("Gated MLA / Gated DSA", "K3.1 lightning indexer") and the
conventions table (indexer tensor names, `dsa_config`); DeepSeek-V3.2 for the indexer math.
No rotary embedding anywhere (the 64 "rope" dims are used raw; k_pe is shared by all heads).

Cache per token: MLA latent c (kv_lora_rank=512), rope key k_pe (64), indexer key (128);
with `--kv-bits 8` the latent and indexer key are kept 8-bit (model/cache.py). An 8-bit
cache is read packed past index_topk: the indexer scores its quantized keys and only the
selected latent rows are dequantized (metal/dsa.py's ops given quantized triples: in the
`_q` kernels on Metal, by their reference ops elsewhere); within index_topk (dense
attention over at most index_topk tokens) it is dequantized whole.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.model.cache import DSACache  # noqa: F401  (DSACache: old import path)
from kimi_mlx.model.cache import BatchDSACache, dequantize
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.metal.dsa import (allowed_keys, dsa_prefill_indices, dsa_sparse_decode, query_block,
                        sparse_mla_attend)


class Indexer(nn.Module):
    """Lightning indexer: `self_attn.indexer.{wq_b, wk, weights_proj, k_norm}`.

    wq_b [Hi*Di, q_lora_rank] reads the normalised MLA query latent qr; wk [Di, hidden];
    weights_proj [Hi, hidden]; k_norm LayerNorm(Di) with weight and bias, eps=rms_norm_eps.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=args.rms_norm_eps)

    def keys(self, x: mx.array) -> mx.array:
        """Index keys for x [B, L, hidden] -> [B, 1, L, Di]."""
        return self.k_norm(self.wk(x))[:, None]

    def queries(self, x: mx.array, qr: mx.array) -> Tuple[mx.array, mx.array]:
        """(q_idx [B, L, Hi, Di], head weights [B, L, Hi]) for x and the query latent qr."""
        B, L, _ = x.shape
        q = self.wq_b(qr).reshape(B, L, self.n_heads, self.head_dim)
        return q, self.weights_proj(x)


class GatedDSA(nn.Module):
    """Gated MLA (no RoPE) whose softmax is restricted to the indexer's top-k keys.

    Parameter names are the checkpoint's: q_a_proj, q_a_layernorm, q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj [H*(nope+v), kv_lora_rank], g_proj,
    o_proj, indexer.*. x: [B, L, hidden] -> [B, L, hidden].
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.q_lora_rank is None:
            raise ValueError("q_lora_rank: the K3.1 indexer needs the MLA query latent")
        self.num_heads = H = args.num_attention_heads
        self.nope = args.qk_nope_head_dim
        self.rope = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.index_topk = args.index_topk
        self.use_gate = args.mla_use_output_gate
        d = args.hidden_size
        self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(args.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        if self.use_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.indexer = Indexer(args)
        self.query_block = None  # queries per sparse-prefill block; None = by memory budget

    def _kv_b(self) -> Tuple[mx.array, mx.array]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]) views of kv_b_proj."""
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def __call__(self, x: mx.array, cache: Optional[DSACache] = None) -> mx.array:
        if isinstance(cache, BatchDSACache):  # several sequences, one call (padding masked)
            return cache.attend(self.__call__, x)
        B, L, _ = x.shape
        H = self.num_heads
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).reshape(B, L, H, self.nope + self.rope).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]

        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[..., : self.kv_rank])[:, None]  # [B,1,L,rank]
        k_pe = ckv[..., self.kv_rank :][:, None]  # [B,1,L,rope]
        k_idx = self.indexer.keys(x)  # [B,1,L,Di]
        offset = cache.offset if cache is not None else 0
        # first real key of each row of a left-padded batch (None: no padding)
        starts = getattr(cache, "starts", None)
        packed = None  # an 8-bit cache's arrays (`QuantizedDSA`), read as they are kept
        if cache is not None and getattr(cache, "kv_bits", None):
            cache.append_all(latent, k_pe, k_idx)
            packed = cache.quantized()
            k_pe = packed.k_pe
        elif cache is not None:
            latent, k_pe, k_idx = cache.update_and_fetch_all(latent, k_pe, k_idx)
        S = k_pe.shape[2]
        if packed is not None and S > self.index_topk:
            # quantized triples: the ops below score the packed index keys and dequantize
            # only the latent rows they select (latent [B,1,S,*], index keys [B,S,*] parts)
            latent, k_idx = packed.latent, tuple(p[:, 0] for p in packed.index)
        elif packed is not None:  # dense within index_topk: at most index_topk rows
            latent = dequantize(packed.latent, packed.bits)
        elif S > self.index_topk:
            k_idx = k_idx[:, 0]

        w_uk, w_uv = self._kv_b()
        if L == 1 and S > self.index_topk:
            # Decode past index_topk: indexer top-k, then attention over the selected latent
            # rows only (kernels, or reference ops: metal/dsa.py).
            q_idx, w = self.indexer.queries(x, qr)
            o = dsa_sparse_decode(
                q_nope @ w_uk, q_pe, latent, k_pe, self.scale,
                q_idx, w, k_idx, self.index_topk, offset, starts=starts,
            )
            o = o @ w_uv.swapaxes(-1, -2)  # [B,H,1,v]
            return self._output(x, o)

        if S > self.index_topk:
            # Prefill past index_topk: per block of queries, gather each query's selected
            # rows (memory O(block*k), not O(L*S): a 2048-token chunk at 128k context would
            # otherwise need a [H, 2048, 128k] score mask). Blocks are sized by a fixed
            # element budget (`query_block`), so the extra memory is set by that budget,
            # not by the prompt.
            q_idx, w = self.indexer.queries(x, qr)
            q_lat = q_nope @ w_uk  # [B,H,L,rank]
            rows = tuple(p[:, 0] for p in latent) if packed is not None else latent[:, 0]
            k = min(self.index_topk, S)
            step = self.query_block or query_block(
                L, S, k, H, self.indexer.n_heads, self.kv_rank + self.rope)
            outs = []
            for s0 in range(0, L, step):
                blk = slice(s0, s0 + step)
                idx = dsa_prefill_indices(q_idx[:, blk], w[:, blk], k_idx, k, offset + s0,
                                          starts=starts)
                outs.append(sparse_mla_attend(q_lat[:, :, blk], q_pe[:, :, blk], rows,
                                              k_pe[:, 0], idx, self.scale))
                if step < L:
                    # One block's scores and gathered rows at a time: left lazy, the graph
                    # of all blocks is scheduled together and their intermediates
                    # (step x S scores, step x k gathered rows each) can be alive at once,
                    # which made peak memory grow with the prompt.
                    mx.eval(outs[-1])
            o = mx.concatenate(outs, axis=2) @ w_uv.swapaxes(-1, -2)  # [B,H,L,v]
            return self._output(x, o)

        # Context within index_topk: exactly dense causal MLA. Additive score mask: the
        # scaled rope-part scores, -inf above the diagonal.
        if L == 1:  # absorbed: attend in the 512-dim latent, then unembed per head
            q_lat = q_nope @ w_uk  # [B,H,1,rank]
            bias = self._dense_bias(q_pe, k_pe, offset, starts)
            o = mx.fast.scaled_dot_product_attention(
                q_lat, latent, latent, scale=self.scale, mask=bias
            )
            o = o @ w_uv.swapaxes(-1, -2)  # [B,H,1,v]
            return self._output(x, o)
        # expanded: per-head keys/values from the latent; queries in blocks so that the
        # [H, block, S] bias and scores stay within a fixed budget (an unblocked 2048-token
        # chunk at H=96 needs 1.6 GB for each), evaluated one block at a time
        k = latent @ w_uk.swapaxes(-1, -2)  # [B,H,S,nope]
        v = latent @ w_uv.swapaxes(-1, -2)  # [B,H,S,v]
        step = self.query_block or query_block(L, S, S, H, 0, 0)
        outs = []
        for s0 in range(0, L, step):
            blk = slice(s0, s0 + step)
            bias = self._dense_bias(q_pe[:, :, blk], k_pe, offset + s0, starts)
            outs.append(mx.fast.scaled_dot_product_attention(
                q_nope[:, :, blk], k, v, scale=self.scale, mask=bias))
            if step < L:
                mx.eval(outs[-1])
        return self._output(x, mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0])

    def _dense_bias(self, q_pe: mx.array, k_pe: mx.array, offset: int,
                    starts: Optional[mx.array] = None) -> mx.array:
        """Additive SDPA mask [B, H, L, S] for queries at offset..offset+L-1: the scaled
        rope-part scores, -inf where s > the query's position or, in a left-padded batch,
        s < the row's first real key `starts` [B] (`allowed_keys`)."""
        L, S = q_pe.shape[2], k_pe.shape[2]
        causal = allowed_keys(L, S, offset, starts)  # [L, S] or [B, L, S]
        if starts is not None:
            causal = causal[:, None]  # [B, 1, L, S]
        pe = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)  # [B,H,L,S]
        return mx.where(causal, pe, mx.array(-mx.inf, pe.dtype))

    def _output(self, x: mx.array, o: mx.array) -> mx.array:
        """Heads [B, H, L, v] -> gated o_proj output [B, L, hidden]."""
        B, H, L, _ = o.shape
        o = o.transpose(0, 2, 1, 3).reshape(B, L, H * self.v_dim)
        if self.use_gate:
            o = o * mx.sigmoid(self.g_proj(x))
        return self.o_proj(o)
