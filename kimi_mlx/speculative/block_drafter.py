"""Block drafters that read the target's hidden states: DFlash and DSpark checkpoints as
released (`--draft-model` on a folder whose config.json has a `dflash_config`).

The architecture (DFlash: Chen et al. 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding", z-lab; DSpark: its variant with a Markov head, as implemented by
mlx-vlm 0.7.10 `mlx_vlm/speculative/drafters/{qwen3_dflash,dspark}`, which
`tests/test_block_drafter.py` checks this module against):

    ctx      = hidden_norm(fc(concat_i h_target[layer i]))   # [S, n * d] -> [S, d]
    x        = embed([anchor, mask, mask, ...])              # the target's embedding
    per layer (Qwen3 style, non-causal inside the block):
        q     = q_norm(q_proj(input_layernorm(x)))            # RoPE at the block's positions
        k, v  = [k_norm(k_proj(ctx)), v_proj(ctx)]  ++  [k_norm(k_proj(x_n)), v_proj(x_n)]
        x     = x + o_proj(attn(q, k, v));  x = x + down(silu(gate(.)) * up(.))
    logits_i = lm_head(norm(x_i))                            # the target's head
    DSpark:  logits_i += markov_w2(markov_w1(t_{i-1}))       # t_{i-1}: the token drafted
             before position i (the anchor for the first), so drafts are drawn in order
    DSpark:  confidence_i = sigmoid(proj([norm(x_i) ; markov_w1(t_{i-1})]))  (optional head)

The context keys and values (from target hiddens of committed tokens only) are the
drafter's only state (`KVCache` per layer); the block's own keys are never cached, so a
rejected draft needs no rollback of the drafter.

Config fields (the released configs' names): top level `hidden_size`,
`intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
`head_dim`, `rms_norm_eps`, `vocab_size`, `rope_theta` (or `rope_parameters`),
`rope_scaling`, `rope_is_neox_style`, `layer_types`, `sliding_window`,
`final_logit_softcapping`, `block_size`, `quantization`; under `dflash_config`:
`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`, `projector_type`
("dspark"), `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor`, `causal`, `attention_sink_bias`,
`swa_window_size`. Block width: a DFlash `block_size` counts the anchor (block_size - 1
proposals); a DSpark one counts proposals only (unless `dspark_bonus_anchor` is true),
as mlx-vlm reads them.

Convention for K3.1 targets (one place, `capture` in `TextModel.run_layers`): the hidden
state "of layer i" is what decoder layer i returns (with AttnRes: its block's partial
sum), the value a Hugging Face `output_hidden_states` loop records after layer i.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.checkpoint.shards import CheckpointError

__all__ = ["BlockDraftConfig", "BlockDrafter", "is_block_drafter", "load_block_drafter",
           "check_target", "read_block_config"]


@dataclass
class BlockDraftConfig:
    """A DFlash / DSpark drafter's config, normalized (see the module docstring).

    kind: "dflash" or "dspark". proposals: drafts per block at most (the released
    block width less the anchor). Everything else keeps the checkpoint's key names."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    proposals: int
    mask_token_id: int
    target_layer_ids: List[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rope_is_neox_style: bool = True
    max_position_embeddings: int = 262144
    final_logit_softcapping: Optional[float] = None
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: bool = False
    attention_sink_bias: bool = False
    sample_from_anchor: bool = False
    markov_rank: int = 0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    quantization: Optional[dict] = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers


_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "vocab_size")


def is_block_drafter(config: dict) -> bool:
    """Whether a config.json (dict) is a DFlash / DSpark drafter's: it has a
    `dflash_config` object, or top-level `target_layer_ids` and `mask_token_id`."""
    return isinstance(config.get("dflash_config"), dict) or (
        "target_layer_ids" in config and "mask_token_id" in config)


def read_block_config(config: dict, source: str = "config.json") -> BlockDraftConfig:
    """Normalize a released DFlash / DSpark config.json (dict) into `BlockDraftConfig`.

    Raises:
        CheckpointError: a missing or malformed field, named with `source`.
    """
    def bad(what: str):
        return CheckpointError(f"{source}: {what}")

    flat = dict(config)
    sub = flat.pop("dflash_config", None) or {}
    if not isinstance(sub, dict):
        raise bad("dflash_config must be an object")
    pick = lambda key, default=None: sub.get(key, flat.get(key, default))  # noqa: E731
    archs = " ".join(flat.get("architectures") or [])
    dspark = (sub.get("projector_type") == "dspark" or "DSpark" in archs
              or "markov_rank" in sub)
    for key in _INTS:
        if not isinstance(flat.get(key), int) or flat[key] <= 0:
            raise bad(f"{key} must be a positive integer, got {flat.get(key)!r}")
    heads = flat["num_attention_heads"]
    head_dim = flat.get("head_dim") or flat["hidden_size"] // heads
    ids = pick("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise bad(f"dflash_config.target_layer_ids must be a non-empty list of layer "
                  f"indices, got {ids!r}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise bad(f"target_layer_ids must be increasing, got {ids}")
    mask = pick("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < flat["vocab_size"]:
        raise bad(f"mask_token_id must be a token id in [0, {flat['vocab_size']}), got {mask!r}")
    raw = pick("block_size")
    if not isinstance(raw, int) or raw < 1:
        raise bad(f"block_size must be a positive integer, got {raw!r}")
    if dspark:
        proposals = raw - 1 if flat.get("dspark_bonus_anchor") else raw
    else:
        proposals = raw - 1
    if proposals < 1:
        raise bad(f"block_size {raw} leaves no drafted position")
    rope_theta = flat.get("rope_theta", 10000.0)
    rope_scaling = flat.get("rope_scaling")
    if isinstance(flat.get("rope_parameters"), dict):
        rp = dict(flat["rope_parameters"])
        rope_theta = rp.pop("rope_theta", rope_theta)
        rope_scaling = rp if rp.get("rope_type", "default") != "default" else None
    if sub.get("markov_head_type", "vanilla") != "vanilla":
        raise bad(f"dflash_config.markov_head_type {sub['markov_head_type']!r} is not "
                  "supported (only 'vanilla')")
    if flat.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act {flat['hidden_act']!r} is not supported (only 'silu')")
    causal = sub.get("causal", flat.get("dflash_query_causal", False))
    cfg = BlockDraftConfig(
        kind="dspark" if dspark else "dflash",
        hidden_size=flat["hidden_size"], intermediate_size=flat["intermediate_size"],
        num_hidden_layers=flat["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=flat["num_key_value_heads"], head_dim=int(head_dim),
        vocab_size=flat["vocab_size"], proposals=proposals, mask_token_id=mask,
        target_layer_ids=list(ids),
        num_target_layers=int(pick("num_target_layers") or max(ids) + 1),
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        rope_scaling=rope_scaling, rope_is_neox_style=bool(flat.get("rope_is_neox_style", True)),
        max_position_embeddings=int(flat.get("max_position_embeddings", 262144)),
        final_logit_softcapping=flat.get("final_logit_softcapping"),
        layer_types=list(flat.get("layer_types") or []),
        sliding_window=sub.get("swa_window_size", flat.get("sliding_window")),
        is_causal=bool(causal), attention_sink_bias=bool(sub.get("attention_sink_bias", False)),
        sample_from_anchor=bool(sub.get("sample_from_anchor", True)) if dspark else False,
        markov_rank=int(sub.get("markov_rank", 256)) if dspark else 0,
        enable_confidence_head=bool(sub.get("enable_confidence_head", False)) and dspark,
        confidence_head_with_markov=bool(sub.get("confidence_head_with_markov", True)),
        quantization=flat.get("quantization"),
    )
    if len(cfg.layer_types) != cfg.num_hidden_layers or any(
            t not in ("full_attention", "sliding_attention") for t in cfg.layer_types):
        raise bad(f"layer_types must give full_attention or sliding_attention for each of "
                  f"the {cfg.num_hidden_layers} layers, got {cfg.layer_types}")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise bad("sliding_attention layers need sliding_window (or swa_window_size)")
    if heads % cfg.num_key_value_heads:
        raise bad(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                  f"{cfg.num_key_value_heads}")
    return cfg


# ---------------------------------------------------------------------------- modules


class _Attention(nn.Module):
    """Qwen3-style attention of a block over [context ; block] (GQA, q/k RMSNorm, RoPE)."""

    def __init__(self, cfg: BlockDraftConfig, idx: int):
        super().__init__()
        d, H, Hk, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hk, self.D, self.scale = H, Hk, D, D**-0.5
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hk * D, bias=False)
        self.v_proj = nn.Linear(d, Hk * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.q_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        if cfg.attention_sink_bias:
            self.attention_sink_bias = mx.zeros((H,))
        sliding = cfg.layer_types[idx] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.causal = cfg.is_causal or (sliding and cfg.is_causal)

    def kv(self, x: mx.array, rope, offset: int) -> Tuple[mx.array, mx.array]:
        """x [B, S, d] at positions offset.. -> (keys, values) [B, Hk, S, D], keys roped."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.Hk, self.D)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, S, self.Hk, self.D).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x: mx.array, ctx_k: mx.array, ctx_v: mx.array, rope, offset,
                 ctx_mask: Optional[mx.array] = None):
        """x [B, L, d] (normed) at positions offset.. (an int, or [B] int32 per row);
        ctx_k / ctx_v [B, Hk, S, D] the context before them; ctx_mask [B, S] bool, where
        given, the context positions each row may see (training many blocks of one
        sequence at once: each sees only the context before its anchor; full-attention
        layers only). Returns [B, L, d]."""
        B, L, _ = x.shape
        if ctx_mask is not None and self.window is not None:
            raise ValueError("ctx_mask: sliding-window layers are not supported")
        if self.window is not None and ctx_k.shape[2] > self.window - 1:
            ctx_k, ctx_v = ctx_k[:, :, -(self.window - 1):], ctx_v[:, :, -(self.window - 1):]
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.H, self.D)).transpose(0, 2, 1, 3)
        q = rope(q, offset=offset)
        bk, bv = self.kv(x, rope, offset)
        k = mx.concatenate([ctx_k, bk], axis=2)
        v = mx.concatenate([ctx_v, bv], axis=2)
        mask = None
        if self.causal:
            S = ctx_k.shape[2]
            qi = mx.arange(L)[:, None]
            kj = mx.arange(S + L)[None] - S
            mask = kj <= qi
            if self.window is not None:
                mask = mask & (kj > qi - self.window)
        if ctx_mask is not None:
            full = mx.concatenate([ctx_mask, mx.ones((B, L), mx.bool_)], axis=1)[:, None, None, :]
            mask = full if mask is None else (mask & full)
        sinks = self.attention_sink_bias if "attention_sink_bias" in self else None
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask,
                                                 sinks=sinks)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _MLP(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: BlockDraftConfig, idx: int):
        super().__init__()
        self.self_attn = _Attention(cfg, idx)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_k, ctx_v, rope, offset, ctx_mask=None):
        h = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, rope, offset, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Markov(nn.Module):
    """DSpark's low-rank token-transition term: logits += w2(w1(previous token))."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(prev))


class _Confidence(nn.Module):
    def __init__(self, d: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(d + rank if with_markov else d, 1, bias=True)


class _Bound:
    """The target's embedding and head, held outside the parameter tree (a plain object,
    so `BlockDrafter.parameters()` lists the drafter's own tensors only)."""

    def __init__(self, embed, head):
        self.embed, self.head = embed, head


class BlockDrafter(nn.Module):
    """A DFlash / DSpark drafter (module paths = the released tensor names less `model.`).

    Use: `bind(target)` (our `Model`: its embedding and lm_head), `make_cache()`,
    `add_context(hidden, cache)` with the target's captured hiddens of committed tokens,
    then `base_logits(anchor, k, cache)` and `draft(...)`.
    """

    def __init__(self, cfg: BlockDraftConfig, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.layers = [_Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        if own_head:
            self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.kind == "dspark":
            self.markov_head = _Markov(cfg.vocab_size, cfg.markov_rank)
            if cfg.enable_confidence_head:
                self.confidence_head = _Confidence(d, cfg.markov_rank,
                                                   cfg.confidence_head_with_markov)
        from mlx_lm.models.rope_utils import initialize_rope

        self._rope = initialize_rope(cfg.head_dim, cfg.rope_theta, not cfg.rope_is_neox_style,
                                     cfg.rope_scaling, cfg.max_position_embeddings)
        self._bound = None

    # -- binding ---------------------------------------------------------------------

    def bind(self, embed, head) -> "BlockDrafter":
        """Use `embed` (tokens [B, L] -> [B, L, d]) and `head` ([..., d] -> [..., V]) where
        the checkpoint has no embedding / lm_head of its own (the released drafters share
        the target's). Returns self."""
        self._bound = _Bound(self.embed_tokens if "embed_tokens" in self else embed,
                             self.lm_head if "lm_head" in self else head)
        return self

    def bind_target(self, model) -> "BlockDrafter":
        """`bind` to our `Model` (whole, or a last stage holding the embedding)."""
        lm = model.language_model
        return self.bind(lm.model.embed_tokens, lm.logits)

    # -- forward ---------------------------------------------------------------------

    def make_cache(self) -> List[Any]:
        """One mlx-lm `KVCache` per layer, for the context keys / values."""
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def context(self, hidden: mx.array) -> mx.array:
        """Captured target hiddens [B, S, n * d] (layers concatenated in
        `target_layer_ids` order) -> the context stream [B, S, d]."""
        return self.hidden_norm(self.fc(hidden))

    def add_context(self, hidden: mx.array, cache: List[Any]) -> None:
        """Append the context keys / values of hiddens [B, S, n * d] (the next S committed
        positions) to `cache`."""
        ctx = self.context(hidden)
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.kv(ctx, self._rope, c.offset)
            c.update_and_fetch(k, v)

    def block_hidden(self, tokens: mx.array, ctx_kv: Sequence[Tuple[mx.array, mx.array]],
                     offset, ctx_mask: Optional[mx.array] = None) -> mx.array:
        """Block tokens [B, L] at positions offset.. (int, or [B] int32 per row) over
        per-layer context (keys, values) [B, Hk, S, D], of which each row sees the
        positions ctx_mask [B, S] bool allows (all where None) -> final-normed hidden
        [B, L, d]."""
        if self._bound is None:
            raise RuntimeError("BlockDrafter used before bind()")
        x = self._bound.embed(tokens)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, self._rope, offset, ctx_mask)
        return self.norm(x)

    def logits(self, h: mx.array) -> mx.array:
        out = self._bound.head(h)
        cap = self.config.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap

    def block_inputs(self, anchor: mx.array, k: int) -> mx.array:
        """[B] anchors -> block tokens [B, L]: the anchor then masks, L = k (DSpark drawing
        from the anchor's position) or k + 1 (DFlash)."""
        n_mask = k - 1 if self.config.sample_from_anchor else k
        masks = mx.full((anchor.shape[0], n_mask), self.config.mask_token_id, anchor.dtype)
        return mx.concatenate([anchor[:, None], masks], axis=1)

    def base_logits(self, anchor: mx.array, k: int, cache: List[Any]
                    ) -> Tuple[mx.array, mx.array]:
        """k proposal positions after anchors [B] (the last committed token, at the
        position right after the cached context): (logits [B, k, V] before the Markov
        term, hidden [B, k, d])."""
        kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) if c.keys is not None
              else (mx.zeros((anchor.shape[0], l.self_attn.Hk, 0, l.self_attn.D)),) * 2
              for l, c in zip(self.layers, cache)]
        offset = cache[0].offset
        h = self.block_hidden(self.block_inputs(anchor, k), kv, offset)
        if not self.config.sample_from_anchor:
            h = h[:, 1:]
        return self.logits(h), h

    def step_logits(self, base: mx.array, prev: mx.array) -> mx.array:
        """One position's logits [B, V] given the token before it [B] (DSpark adds its
        Markov term; DFlash returns `base` as it is)."""
        if "markov_head" not in self:
            return base
        return base + self.markov_head(prev).astype(base.dtype)

    def confidence(self, h: mx.array, prev: mx.array) -> Optional[mx.array]:
        """DSpark confidence [B, L] float32 in (0, 1) of hidden [B, L, d] with the
        tokens before each position [B, L]; None without a confidence head."""
        if "confidence_head" not in self:
            return None
        head = self.confidence_head
        f = mx.concatenate([h, self.markov_head.markov_w1(prev).astype(h.dtype)], -1) \
            if head.with_markov else h
        return mx.sigmoid(head.proj(f).squeeze(-1).astype(mx.float32))

    def greedy_block(self, anchor: mx.array, k: int, cache: List[Any]) -> mx.array:
        """k greedy drafts [B, k] uint32 after anchors [B]."""
        base, _ = self.base_logits(anchor, k, cache)
        prev, out = anchor, []
        for i in range(k):
            prev = mx.argmax(self.step_logits(base[:, i], prev), axis=-1).astype(anchor.dtype)
            out.append(prev)
        return mx.stack(out, axis=1)


# ---------------------------------------------------------------------------- loading


def check_target(cfg: BlockDraftConfig, target_args, where: str) -> None:
    """Refuse a drafter made for another target.

    Args:
        cfg: the drafter's config. target_args: our `ModelArgs` (hidden_size,
            vocab_size, num_hidden_layers). where: the drafter's path, for the message.
    Raises:
        CheckpointError: naming the field and both values (hidden size, vocabulary,
            number of target layers, a target layer id out of range).
    """
    def mismatch(field_, draft, target):
        return CheckpointError(f"{where}: drafter {field_} is {draft} but the target's is "
                               f"{target}; this drafter was made for another model")

    if cfg.hidden_size != target_args.hidden_size:
        raise mismatch("hidden_size", cfg.hidden_size, target_args.hidden_size)
    if cfg.vocab_size != target_args.vocab_size:
        raise mismatch("vocab_size", cfg.vocab_size, target_args.vocab_size)
    n = target_args.num_hidden_layers
    if cfg.num_target_layers != n:
        raise mismatch("num_target_layers", cfg.num_target_layers, n)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        raise CheckpointError(f"{where}: drafter target_layer_ids {cfg.target_layer_ids} "
                              f"name layers {bad} outside the target's 0..{n - 1}")


def _read_weights(path: Path) -> Dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights for the drafter")
    out: Dict[str, mx.array] = {}
    for f in files:
        for k, v in mx.load(str(f)).items():
            k = k.removeprefix("model.")
            if k in out:
                raise CheckpointError(f"{f}: tensor {k} appears twice (with and without model.)")
            out[k] = v
    return out


def load_block_drafter(path, target=None) -> BlockDrafter:
    """Load a DFlash / DSpark drafter folder (config.json + safetensors, BF16 or
    quantized with a `quantization` {group_size, bits} entry, as mlx-lm writes it).

    Args:
        path: the folder. target: our `Model` to check against (`check_target`) and
            `bind_target` to, or None.
    Returns:
        the `BlockDrafter`, weights evaluated.
    Raises:
        FileNotFoundError: no config.json. CheckpointError: a config field wrong or not
        matching the target, a missing, extra or misshapen tensor (named).
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (a DFlash / DSpark drafter folder)")
    config = json.loads(cfg_path.read_text())
    cfg = read_block_config(config, str(cfg_path))
    if target is not None:
        check_target(cfg, target.args, str(path))
    weights = _read_weights(path)
    model = BlockDrafter(cfg, own_embed="embed_tokens.weight" in weights,
                         own_head="lm_head.weight" in weights)
    q = cfg.quantization
    if q:
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    from mlx.utils import tree_flatten

    want = dict(tree_flatten(model.parameters()))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise CheckpointError(f"{path}: drafter tensors do not match its config "
                              f"({cfg.kind}): missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in weights.items():
        if v.shape != want[k].shape:
            raise CheckpointError(f"{path}: tensor {k} has shape {tuple(v.shape)}, the config "
                                  f"gives {tuple(want[k].shape)}")
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    if target is not None:
        model.bind_target(target)
    return model


class _EmbedHead(nn.Module):
    """The target's token embedding and lm_head alone (tied: the embedding is the head)."""

    def __init__(self, vocab: int, d: int, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        if not tied:
            self.lm_head = nn.Linear(d, vocab, bias=False)

    def logits(self, h: mx.array) -> mx.array:
        """[..., d] -> [..., vocab], as `LanguageModel.logits` of the unsharded model."""
        return self.lm_head(h) if "lm_head" in self else self.embed_tokens.as_linear(h)


def load_target_embed_head(model_dir) -> Tuple[Any, Any, Any]:
    """(target `ModelArgs`, embed, head) from a K3.1 checkpoint folder, reading only the
    token embedding and lm_head (as stored: BF16, or quantized as `quantize_like` infers),
    for a drafter whose target runs elsewhere (a tensor group's ranks hold lm_head split
    by vocabulary, so its logits need a collective the drafter cannot join). Costs their
    bytes once on this process (at K3.1 size 2 x 2.35 GB in BF16).

    Raises:
        FileNotFoundError / ConfigError: config.json missing or invalid.
        CheckpointError: a shard missing or unreadable, the tensors absent or misshapen.
    """
    from kimi_mlx.checkpoint.loader import quantize_like, read_tensors
    from kimi_mlx.checkpoint.shards import weight_map
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.model.tensor_map import canonical

    model_dir = Path(model_dir)
    args = ModelArgs.from_config(read_config(model_dir), str(model_dir / "config.json"))
    prefixes = {"language_model.model.embed_tokens.": "embed_tokens.",
                "language_model.lm_head.": "lm_head."}
    wanted, rename = {}, {}
    for name, shard in weight_map(model_dir).items():
        c = canonical(name)
        for pre, ours in prefixes.items():
            if c.startswith(pre) and (ours == "embed_tokens." or not args.tie_word_embeddings):
                wanted[name], rename[name] = shard, ours + c[len(pre):]
    raw, _ = read_tensors(model_dir, wanted)
    weights = {rename[n]: v for n, v in raw.items()}
    module = _EmbedHead(args.vocab_size, args.hidden_size, args.tie_word_embeddings)
    quantize_like(module, weights, args.quantization, model_dir)
    want = dict(_flat(module))
    if set(want) != set(weights) or any(weights[k].shape != want[k].shape for k in want):
        raise CheckpointError(f"{model_dir}: the embedding / lm_head tensors "
                              f"{sorted(weights)} do not match the config (want "
                              f"{ {k: tuple(v.shape) for k, v in want.items()} })")
    module.load_weights(list(weights.items()))
    mx.eval(module.parameters())
    return args, module.embed_tokens, module.logits


def _flat(module: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())
