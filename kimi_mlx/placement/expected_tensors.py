"""The tensors of the official Kimi K3.1 checkpoint layout, computed from a config alone.

`expected_tensors` gives every tensor's safetensors dtype and shape as the official
checkpoint lays them out (K31_SPEC.md section 2); `layer_bytes.model_bytes_from_config`
sizes a checkpoint from it, and `check_real` compares a real checkpoint's headers with it.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from kimi_mlx.model.config import ModelArgs

__all__ = ["expected_tensors"]


def expected_tensors(args: ModelArgs, vision: Optional[Mapping[str, Any]] = None,
                     prefix: str = "language_model.") -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Every tensor of the official checkpoint layout computed from the config.

    Returns {name: (safetensors dtype, shape)} (K31_SPEC.md section 2): BF16 everywhere
    except KDA conv/A_log/dt_bias/o_norm and the router correction bias (F32) and routed
    experts (MXFP4: `weight_packed` U8 [out, in/2] + `weight_scale` U8 [out, in/32]). The
    indexer (`self_attn.indexer.*`) follows the kimi-mlx convention: wq_b
    [heads*dim, q_lora_rank], wk [dim, hidden], weights_proj [heads, hidden], k_norm weight
    and bias [dim], BF16. With `vision` (a `vision_config`), the vision tower and projector
    are included under their own names (estimated, not loaded by us).
    """
    h = args.hidden_size
    lin = args.linear_attn_config
    heads, hd = lin["num_heads"], lin["head_dim"]
    proj = heads * hd
    kernel = lin["short_conv_kernel_size"]
    qk_head = args.qk_nope_head_dim + args.qk_rope_head_dim
    n_heads = args.num_attention_heads
    latent = args.routed_expert_hidden_size or h
    quantized = args.quantization is not None
    group = (args.quantization or {}).get("group_size", 32)
    t: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    m = f"{prefix}model."

    def linear(name: str, out: int, inp: int, packed: bool = False) -> None:
        if packed and quantized:
            t[f"{name}.weight_packed"] = ("U8", (out, inp // 2))
            t[f"{name}.weight_scale"] = ("U8", (out, inp // group))
        else:
            t[f"{name}.weight"] = ("BF16", (out, inp))

    t[f"{m}embed_tokens.weight"] = ("BF16", (args.vocab_size, h))
    t[f"{m}norm.weight"] = ("BF16", (h,))
    if args.attn_res_block_size:
        t[f"{m}output_attn_res_norm.weight"] = ("BF16", (h,))
        t[f"{m}output_attn_res_proj.weight"] = ("BF16", (1, h))
    if not args.tie_word_embeddings:
        t[f"{prefix}lm_head.weight"] = ("BF16", (args.vocab_size, h))

    for i in range(args.num_hidden_layers):
        p = f"{m}layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}{norm}.weight"] = ("BF16", (h,))
        if args.attn_res_block_size:
            for res in ("self_attention_res", "mlp_res"):
                t[f"{p}{res}_norm.weight"] = ("BF16", (h,))
                t[f"{p}{res}_proj.weight"] = ("BF16", (1, h))
        a = f"{p}self_attn."
        if args.is_kda(i):
            for x in "qkvg":
                linear(f"{a}{x}_proj", proj, h)
            for x in "qkv":
                t[f"{a}{x}_conv1d.weight"] = ("F32", (proj, 1, kernel))
            linear(f"{a}f_a_proj", hd, h)
            linear(f"{a}f_b_proj", proj, hd)
            linear(f"{a}b_proj", heads, h)
            # [128] for 96 heads in the release: per-head values zero-padded (s.2); our
            # checkpoint writers pad to 128 as well (kimi_mlx.testing.checkpoints).
            t[f"{a}A_log"] = ("F32", (max(heads, 128),))
            t[f"{a}dt_bias"] = ("F32", (proj,))
            t[f"{a}o_norm.weight"] = ("F32", (hd,))
            linear(f"{a}o_proj", h, proj)
        else:
            q_in = h
            if args.q_lora_rank:
                linear(f"{a}q_a_proj", args.q_lora_rank, h)
                t[f"{a}q_a_layernorm.weight"] = ("BF16", (args.q_lora_rank,))
                q_in = args.q_lora_rank
            linear(f"{a}q_b_proj" if args.q_lora_rank else f"{a}q_proj", n_heads * qk_head, q_in)
            linear(f"{a}kv_a_proj_with_mqa", args.kv_lora_rank + args.qk_rope_head_dim, h)
            t[f"{a}kv_a_layernorm.weight"] = ("BF16", (args.kv_lora_rank,))
            linear(f"{a}kv_b_proj", n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                   args.kv_lora_rank)
            if args.mla_use_output_gate:
                linear(f"{a}g_proj", n_heads * args.v_head_dim, h)
            linear(f"{a}o_proj", h, n_heads * args.v_head_dim)
            if args.is_dsa(i):
                ih, idim = args.index_n_heads, args.index_head_dim
                linear(f"{a}indexer.wq_b", ih * idim, args.q_lora_rank or h)
                linear(f"{a}indexer.wk", idim, h)
                linear(f"{a}indexer.weights_proj", ih, h)
                t[f"{a}indexer.k_norm.weight"] = ("BF16", (idim,))
                t[f"{a}indexer.k_norm.bias"] = ("BF16", (idim,))
        if args.is_moe(i):
            b = f"{p}block_sparse_moe."
            e = args.experts_in(i)
            t[f"{b}gate.weight"] = ("BF16", (e, h))
            t[f"{b}gate.e_score_correction_bias"] = ("F32", (e,))
            if latent != h:
                linear(f"{b}routed_expert_down_proj", latent, h)
                linear(f"{b}routed_expert_up_proj", h, latent)
                if args.latent_moe_use_norm:
                    t[f"{b}routed_expert_norm.weight"] = ("BF16", (latent,))
            if args.num_shared_experts:
                width = args.moe_intermediate_size * args.num_shared_experts
                linear(f"{b}shared_experts.gate_proj", width, h)
                linear(f"{b}shared_experts.up_proj", width, h)
                linear(f"{b}shared_experts.down_proj", h, width)
            for j in range(e):
                linear(f"{b}experts.{j}.w1", args.moe_intermediate_size, latent, packed=True)
                linear(f"{b}experts.{j}.w3", args.moe_intermediate_size, latent, packed=True)
                linear(f"{b}experts.{j}.w2", latent, args.moe_intermediate_size, packed=True)
        else:
            linear(f"{p}mlp.gate_proj", args.intermediate_size, h)
            linear(f"{p}mlp.up_proj", args.intermediate_size, h)
            linear(f"{p}mlp.down_proj", h, args.intermediate_size)
    if vision:
        t.update(_vision_tensors(vision))
    return t


def _vision_tensors(v: Mapping[str, Any]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """MoonViT3d tower + patchmergerv2 projector shapes (K31_SPEC.md s.1-2), BF16."""
    hid = v.get("vt_hidden_size", v.get("hidden_size", 1024))
    qkv = v.get("qkv_hidden_size", hid)
    mlp = v.get("vt_intermediate_size", v.get("intermediate_size", 4 * hid))
    n = v.get("vt_num_hidden_layers", v.get("num_hidden_layers", 0))
    patch = v.get("patch_size", 14)
    kh, kw = v.get("merge_kernel_size", [2, 2])
    # the projector reads kh * kw merged tokens of mm_hidden_size (= vt_hidden_size, 1024
    # in the published config): 4096 wide
    merged = (v.get("mm_hidden_size") or hid) * kh * kw
    text = v.get("text_hidden_size", 7168)
    t: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    enc = "vision_tower.encoder."
    for i in range(n):
        b = f"{enc}blocks.{i}."
        t[b + "wqkv.weight"] = ("BF16", (3 * qkv, hid))
        t[b + "wo.weight"] = ("BF16", (hid, qkv))
        t[b + "mlp.fc0.weight"] = ("BF16", (mlp, hid))
        t[b + "mlp.fc1.weight"] = ("BF16", (hid, mlp))
        t[b + "norm0.weight"] = ("BF16", (hid,))
        t[b + "norm1.weight"] = ("BF16", (hid,))
    t[enc + "final_layernorm.weight"] = ("BF16", (hid,))
    t["vision_tower.patch_embed.pos_emb.weight"] = (
        "BF16", (v.get("init_pos_emb_height", 64), v.get("init_pos_emb_width", 64), hid))
    t["vision_tower.patch_embed.proj.weight"] = ("BF16", (hid, 3, patch, patch))
    t["mm_projector.proj.0.weight"] = ("BF16", (merged, merged))
    t["mm_projector.proj.2.weight"] = ("BF16", (text, merged))
    t["mm_projector.post_norm.weight"] = ("BF16", (text,))
    return t
