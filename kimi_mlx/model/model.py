"""Kimi K3.1 Pro text model for MLX, in mlx-lm's model-module API (`ModelArgs`, `Model`,
`Model.__call__(inputs, cache)`, `make_cache`, `sanitize`, `layers`).

Layer schedule (K31_SPEC.md section 3): embed -> 93 x [RMSNorm -> KDA | Gated DSA ->
AttnRes mix -> RMSNorm -> dense SiTU MLP (layer 0) | latent MoE] -> output AttnRes mix ->
norm -> lm_head. Any contiguous layer range [start, end) can be built with the same code
(embedding only on the first stage, output mix + norm + lm_head only on the last): a
pipeline stage is a layer range, nothing more.

Module paths equal the checkpoint's tensor names (`language_model.model.layers.N...`), so
`sanitize` only stacks the MXFP4 experts and trims the padded A_log; see `tensor_map.py`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.model.attn_res import Banks, attn_res_mix, res_weights
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.cache import (KV_DEFAULT_GROUP, ArraysCache, DSACache, check_kv_quant,
                                   group_for)
from kimi_mlx.model.dsa import GatedDSA
from kimi_mlx.model.ffn import LatentMoE, SiTUMLP
from kimi_mlx.model.kda import KimiDeltaAttention
from kimi_mlx.model.tensor_map import sanitize_weights

__all__ = ["Model", "ModelArgs", "DecoderLayer", "TextModel", "default_activation_dtype"]


def default_activation_dtype() -> Optional[mx.Dtype]:
    """The residual stream's dtype where nobody chose one: float32 on MLX's CPU backend
    (its bf16 and quantized-bf16 matmuls are several times slower than float32 ones),
    None (the embedding's dtype, BF16 in the release) on a GPU. The one policy for our
    loader and for `mlx_lm.load` (`kimi_mlx.model.mlx_lm_entry`)."""
    return mx.float32 if mx.default_device() == mx.cpu else None


class DecoderLayer(nn.Module):
    """One K3.1 layer with AttnRes block residuals. Call: (x, banks, cache) -> (p, banks)."""

    def __init__(self, args: ModelArgs, idx: int):
        super().__init__()
        self.idx = idx
        self.is_kda = args.is_kda(idx)
        self.self_attn = KimiDeltaAttention(args, idx) if self.is_kda else GatedDSA(args)
        if args.is_moe(idx):
            self.block_sparse_moe = LatentMoE(args, idx)
        else:
            self.mlp = SiTUMLP(args, args.intermediate_size)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.block_size = args.attn_res_block_size
        if self.block_size:
            self.self_attention_res_norm = nn.RMSNorm(d, eps=eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = nn.RMSNorm(d, eps=eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)

    @property
    def ffn(self):
        return self.block_sparse_moe if "block_sparse_moe" in self else self.mlp

    def __call__(self, x: mx.array, banks: Banks, cache: Optional[Any] = None):
        if not self.block_size:  # plain pre-norm residual (configs without AttnRes)
            h = x + self.self_attn(self.input_layernorm(x), cache)
            return h + self.ffn(self.post_attention_layernorm(h)), banks
        w_attn = res_weights(self.self_attention_res_norm, self.self_attention_res_proj)
        h = attn_res_mix(banks, x, w_attn)
        partial = x
        if self.idx % self.block_size == 0:
            banks.append(x)
            partial = None
        y = self.self_attn(self.input_layernorm(h), cache)
        partial = y if partial is None else partial + y
        w_mlp = res_weights(self.mlp_res_norm, self.mlp_res_proj)
        h = attn_res_mix(banks, partial, w_mlp)
        return partial + self.ffn(self.post_attention_layernorm(h)), banks


class TextModel(nn.Module):
    """`language_model.model`: embed_tokens, layers [start, end), output mix, norm."""

    def __init__(self, args: ModelArgs, start: int = 0, end: Optional[int] = None):
        super().__init__()
        n = args.num_hidden_layers
        end = n if end is None else end
        if not 0 <= start < end <= n:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {n})")
        self.args = args
        self.start, self.end = start, end
        # dtype of the residual stream; None = the embedding's (see Model.activation_dtype)
        self.activation_dtype = None
        self.is_first, self.is_last = start == 0, end == n
        if self.is_first or (self.is_last and args.tie_word_embeddings):
            # the last stage of a tied model needs the embedding as its lm_head
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # Entries before `start` are None so that `layers.N` keeps the checkpoint's index.
        self.layers = [None] * start + [DecoderLayer(args, i) for i in range(start, end)]
        if self.is_last:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if args.attn_res_block_size:
                self.output_attn_res_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
                self.output_attn_res_proj = nn.Linear(args.hidden_size, 1, bias=False)

    @property
    def local_layers(self) -> List[DecoderLayer]:
        return self.layers[self.start : self.end]

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids [B, L] -> hidden [B, L, D] in the activation dtype (first stage only)."""
        h = self.embed_tokens(inputs)
        return h if self.activation_dtype is None else h.astype(self.activation_dtype)

    def run_layers(
        self, h: mx.array, banks: Banks, cache: Optional[List[Any]] = None,
        eval_each: bool = False, capture: Optional[Dict[int, Optional[mx.array]]] = None,
    ) -> Tuple[mx.array, Banks]:
        """Run this range's layers on partial sum h [B, L, D] with the banks so far.

        eval_each: start computing each layer's output (`mx.async_eval`) as soon as its
            graph is built, so that building layer i + 1 overlaps computing layer i. A
            pipeline stage wants this: mlx-lm's generate loop hides graph construction by
            building token t + 1 while token t computes, but a stage cannot start before
            its input arrives, so construction (~0.3 ms a layer on the CPU backend) would
            add to every hop. Not for use inside `mx.compile` or autodiff transforms.
        capture: layer index -> None, filled in with what that layer (if in this range)
            returns, [B, L, D]: the hidden states a block drafter reads
            (`kimi_mlx.speculative.block_drafter`). None (the default) costs nothing.
        """
        cache = cache or [None] * (self.end - self.start)
        for layer, c in zip(self.local_layers, cache):
            h, banks = layer(h, banks, c)
            if capture is not None and layer.idx in capture:
                capture[layer.idx] = h
            if eval_each:
                mx.async_eval(h)
        return h, banks

    def finish(self, h: mx.array, banks: Banks) -> mx.array:
        """Output AttnRes mix then final RMSNorm (last stage only). [B, L, D] -> same."""
        if self.args.attn_res_block_size:
            w = res_weights(self.output_attn_res_norm, self.output_attn_res_proj)
            h = attn_res_mix(banks, h, w)
        return self.norm(h)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        if input_embeddings is None:
            h = self.embed(inputs)
        else:
            h = input_embeddings if self.activation_dtype is None else input_embeddings.astype(self.activation_dtype)
        h, banks = self.run_layers(h, Banks(self.args.rms_norm_eps), cache)
        return self.finish(h, banks)

    def embed_with_media(self, inputs: mx.array, media: mx.array, pad_id: int) -> mx.array:
        """Token embeddings with the `<|media_pad|>` positions replaced by image rows.

        Args:
            inputs: token ids [L] or [B, L] (int).
            media: projector output [N, hidden], the images' rows in prompt order
                (`kimi_mlx.vision`); N must equal the number of `pad_id` in `inputs`.
            pad_id: the `<|media_pad|>` id (from the tokenizer).
        Returns:
            [L, hidden] or [B, L, hidden] in the activation dtype: the k-th pad position
            (row-major) gets row k of `media`, every other position its token embedding.
        Raises:
            ValueError: pad count != N (names both: an expansion that went wrong), or a
                media width other than hidden_size.
        """
        h = self.embed(inputs)
        mask = inputs == pad_id
        n_pad = int(mask.sum().item())
        if media.ndim != 2 or media.shape[0] != n_pad or media.shape[1] != h.shape[-1]:
            raise ValueError(
                f"the prompt has {n_pad} <|media_pad|> tokens (id {pad_id}) but the images "
                f"gave {tuple(media.shape)} rows; expected [{n_pad}, {h.shape[-1]}]")
        if n_pad == 0:
            return h
        row = mx.maximum(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(mask.shape)
        return mx.where(mask[..., None], media.astype(h.dtype)[row], h)


class LanguageModel(nn.Module):
    """`language_model`: the text model plus `lm_head` (or tied embeddings)."""

    def __init__(self, args: ModelArgs, start: int = 0, end: Optional[int] = None):
        super().__init__()
        self.args = args
        self.model = TextModel(args, start, end)
        if self.model.is_last and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Set by `shard.shard` when lm_head is split by vocabulary across a group.
        self.logits_group = None

    def logits(self, h: mx.array) -> mx.array:
        """Final hidden [B, L, D] (after `finish`) -> logits [B, L, vocab]."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        if self.logits_group is not None:  # each rank holds vocab / N rows of lm_head
            part = self.lm_head(h)  # [B, L, V/N]
            N = self.logits_group.size()
            every = mx.distributed.all_gather(part, group=self.logits_group)  # [N*B, L, V/N]
            every = every.reshape(N, *part.shape)
            return mx.moveaxis(every, 0, -2).reshape(*part.shape[:-1], N * part.shape[-1])
        return self.lm_head(h)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        return self.logits(self.model(inputs, cache, input_embeddings))


class Model(nn.Module):
    """Kimi K3.1 (text) in mlx-lm's model API; optionally only layers [start, end).

    `Model(args)(tokens [B, L] int32, cache)` -> logits [B, L, vocab]. Pipeline stages use
    `language_model.model.run_layers` / `finish` and `language_model.logits` directly.
    `input_embeddings` [B, L, hidden] (mlx-lm's keyword, which its `generate_step` passes
    for prompts with images) replaces the token embedding; see `embed_with_media`.
    """

    def __init__(self, args: ModelArgs, start: int = 0, end: Optional[int] = None):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args, start, end)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        return self.language_model(inputs, cache, input_embeddings)

    def embed_with_media(self, inputs: mx.array, media: mx.array, pad_id: int) -> mx.array:
        """`TextModel.embed_with_media` (first stage only)."""
        return self.text.embed_with_media(inputs, media, pad_id)

    @property
    def activation_dtype(self):
        """dtype of activations between layers (None: the embedding's, BF16 in the release).

        The loader picks float32 on the CPU backend, where MLX's bf16 matmuls and
        quantized matmuls are several times slower than float32 ones.
        """
        return self.text.activation_dtype

    @activation_dtype.setter
    def activation_dtype(self, dtype):
        self.text.activation_dtype = dtype

    @property
    def text(self) -> TextModel:
        return self.language_model.model

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.text.local_layers

    def shard(self, group=None, lm_head: Optional[bool] = None):
        """Split this model across `group` for tensor parallelism (mlx-lm's `shard` API;
        default: `mx.distributed.init()`); see `kimi_mlx.model.shard`. Returns the record
        of the slices each parameter now holds."""
        from kimi_mlx.model.shard import shard

        return shard(self, group or mx.distributed.init(), lm_head=lm_head)

    # cache format of the Gated DSA layers (`set_kv_quant`): None = the model dtype
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_DEFAULT_GROUP

    def set_kv_quant(self, bits: Optional[int], group_size: int = KV_DEFAULT_GROUP) -> None:
        """Make `make_cache` give DSA caches whose latent and index keys are kept in
        `bits`-bit MLX affine format with `group_size` values per scale (model/cache.py);
        bits None keeps the model dtype. ValueError for an unsupported pair, or for a
        group that cannot split this model's latent (`kv_lora_rank`) or indexer key
        (`index_head_dim`) vectors (`cache.group_for`), named here at load rather than by
        the first prefill (a 500 on every server request)."""
        check_kv_quant(bits, group_size)
        if bits and any(not l.is_kda for l in self.layers):
            for key in ("kv_lora_rank", "index_head_dim"):
                dim = getattr(self.args, key)
                try:
                    group_for(dim, group_size)
                except ValueError as e:
                    raise ValueError(f"--kv-bits {bits}: this model's {key} is {dim}: {e}") from None
        self.kv_bits, self.kv_group_size = bits, group_size

    def make_cache(self) -> List[Any]:
        """One cache per local layer: ArraysCache(2) for KDA, DSACache for Gated DSA."""
        return [ArraysCache(size=2) if l.is_kda else DSACache(self.kv_bits, self.kv_group_size)
                for l in self.layers]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Official checkpoint names -> module paths (see `tensor_map.sanitize_weights`)."""
        return sanitize_weights(weights, self.args, self.text.start, self.text.end)

    @property
    def cast_predicate(self):
        # Keep these in float32 if mlx-lm ever converts the model (as kimi_k3 does).
        keep = ("e_score_correction_bias", "A_log", "dt_bias", "conv1d.weight")
        return lambda path: not path.endswith(keep)
