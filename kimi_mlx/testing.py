"""Small deterministic Kimi K3.1 checkpoints in the official file layout, for tests and demos.

`build_checkpoint(out_dir)` writes what the release has, at toy size: `config.json` (the
multimodal wrapper with `text_config`, `dsa_config`, compressed-tensors
`quantization_config`), sharded `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`, the `language_model.` prefix, BF16 weights (F32 for KDA
conv/A_log/dt_bias and the router bias), MXFP4 `weight_packed` + E8M0 `weight_scale`
routed experts, a zero-padded `A_log[128]`, vision-tower / projector tensors and an MTP
layer (both must be skipped), and tokenizer files (`tiktoken.model` +
`tokenizer_config.json`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .config import ARCHITECTURE, MODEL_TYPE, ModelArgs
from .tensor_map import EXPERT_FIELD, EXPERT_PROJ

F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


def tiny_text_config(**overrides) -> Dict[str, Any]:
    """A toy K3.1 text config: 6 layers (0 dense; KDA 0,1,3,4; DSA 2,5), AttnRes blocks of
    2, 8 routed experts top-2 + 1 shared, index_topk 8, hidden 64, vocab 512."""
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [3, 6],
            "kda_layers": [1, 2, 4, 5],
        },
        "dsa_config": {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8},
        "eos_token_id": 258,
    }
    cfg.update(overrides)
    cfg.setdefault("dsa_config", {})
    cfg["dsa_config"].setdefault("dsa_layers", cfg["linear_attn_config"]["full_attn_layers"])
    return cfg


def full_config(text: Dict[str, Any]) -> Dict[str, Any]:
    """Wrap a text config the way the release does (top level + text_config + quantization)."""
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "scale_dtype": "uint8",
                },
                "targets": ["Linear"],
            }
        },
        "ignore": ["re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "lm_head"],
    }
    text = dict(text, quantization_config=quant)
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "text_config": text,
        "vision_config": {"model_type": "moonvit3d", "hidden_size": 16, "patch_size": 14},
        "media_placeholder_token_id": text["vocab_size"] - 1,
        "pad_token_id": 0,
        "quantization_config": quant,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }


def random_model(args: ModelArgs, seed: int = 0):
    """Our unquantized model with deterministic, non-trivial random weights (float32)."""
    from .model import Model

    mx.random.seed(seed)
    model = Model(args)
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(model.parameters()))
    new = {}
    for name, p in params.items():
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            v = rng.normal(0.0, 0.5, shape)
        elif name.endswith("e_score_correction_bias"):
            v = rng.normal(0.0, 0.1, shape)
        elif name.endswith("_res_proj.weight"):
            v = rng.normal(0.0, 0.5, shape)
        elif "norm" in name and name.endswith("weight"):
            v = rng.uniform(0.8, 1.2, shape)
        elif name.endswith("bias"):
            v = rng.normal(0.0, 0.05, shape)
        elif name.endswith("conv1d.weight"):
            v = rng.normal(0.0, 0.5, shape)
        elif name.endswith("embed_tokens.weight"):
            v = rng.normal(0.0, 1.0, shape)
        else:
            fan_in = shape[-1]
            v = rng.normal(0.0, fan_in**-0.5, shape)
        new[name] = mx.array(v.astype(np.float32))
    model.load_weights(list(new.items()))
    return model


def checkpoint_tensors(model, args: ModelArgs, dtype=mx.bfloat16) -> Dict[str, mx.array]:
    """Our unquantized model's parameters under the official names and dtypes.

    Experts become per-expert MXFP4 `weight_packed` (U8 [out, in/2]) and `weight_scale`
    (U8 [out, in/32]) via `mx.quantize(mode="mxfp4")`; A_log is zero padded to [128].
    """
    out = {}
    inv_proj = {v: k for k, v in EXPERT_PROJ.items()}
    inv_field = {v: k for k, v in EXPERT_FIELD.items()}
    for name, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:
            moe, rest = name.split(".switch_mlp.")
            proj, _ = rest.split(".")
            q, scales = mx.quantize(p, group_size=32, bits=4, mode="mxfp4")
            packed = q.view(mx.uint8)
            for e in range(p.shape[0]):
                w = inv_proj[proj]
                out[f"{moe}.experts.{e}.{w}.{inv_field['weight']}"] = packed[e]
                out[f"{moe}.experts.{e}.{w}.{inv_field['scales']}"] = scales[e]
            continue
        if name.endswith("self_attn.A_log"):
            pad = max(128, p.shape[0])
            p = mx.concatenate([p, mx.zeros((pad - p.shape[0],), p.dtype)])
        keep_f32 = name.endswith(F32_SUFFIXES)
        out[name] = p.astype(mx.float32 if keep_f32 else dtype)
    return out


def extra_tensors(args: ModelArgs, dtype=mx.bfloat16) -> Dict[str, mx.array]:
    """Tensors the loader must skip: a vision tower, the projector and one MTP layer."""
    n = args.num_hidden_layers
    d = args.hidden_size
    return {
        "vision_tower.encoder.blocks.0.wqkv.weight": mx.ones((48, 16), dtype),
        "vision_tower.patch_embed.proj.weight": mx.ones((16, 3, 14, 14), dtype),
        "mm_projector.proj.0.weight": mx.ones((64, 64), dtype),
        f"language_model.model.layers.{n}.enorm.weight": mx.ones((d,), dtype),
        f"language_model.model.layers.{n}.eh_proj.weight": mx.ones((d, 2 * d), dtype),
    }


def shard_plan(names, args: ModelArgs, n_shards: int) -> Dict[str, int]:
    """Shard number (1-based) per tensor: layers spread evenly, embedding in the first,
    norm / head in the last, skipped extras in the last."""
    from .tensor_map import layer_of

    n = args.num_hidden_layers
    plan = {}
    for name in names:
        layer = layer_of(name)
        if name.startswith(("vision_tower", "mm_projector")) or (layer is not None and layer >= n):
            plan[name] = n_shards
        elif layer is None:
            plan[name] = 1 if "embed_tokens" in name else n_shards
        else:
            plan[name] = 1 + layer * n_shards // n
    return plan


def write_safetensors_sharded(
    tensors: Dict[str, mx.array], plan: Dict[str, int], out_dir: Path, n_shards: int
) -> None:
    """Write shards and `model.safetensors.index.json` in the Hugging Face layout."""
    weight_map = {}
    total = 0
    for k in range(1, n_shards + 1):
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        part = {name: t for name, t in tensors.items() if plan[name] == k}
        if not part:
            continue
        mx.save_safetensors(str(out_dir / fname), part, metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def byte_level_ranks() -> Dict[bytes, int]:
    """256 single-byte ranks: the smallest valid tiktoken vocabulary."""
    return {bytes([i]): i for i in range(256)}


def build_checkpoint(
    out_dir,
    text_config: Optional[Dict[str, Any]] = None,
    seed: int = 0,
    n_shards: int = 3,
    dtype=mx.bfloat16,
    model=None,
    ranks: Optional[Dict[bytes, int]] = None,
    extras: bool = True,
) -> Path:
    """Write a checkpoint folder in the official layout; returns its path.

    Args:
        out_dir: destination folder (must not exist; written atomically via a temp dir).
        text_config: text config (default `tiny_text_config()`).
        seed: weight seed (deterministic output for a given seed).
        n_shards: number of safetensors shards.
        dtype: dtype of the non-expert, non-F32 tensors (BF16 like the release).
        model: optional unquantized `Model` to export instead of random weights.
        ranks: tokenizer ranks (default: 256 byte tokens); specials follow them.
        extras: also write vision / projector / MTP tensors that loaders must skip.
    Raises:
        FileExistsError: out_dir exists.
    """
    from .tokenizer import kimi_special_tokens, write_tokenizer_files

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists")
    text = copy.deepcopy(text_config or tiny_text_config())
    ranks = ranks or byte_level_ranks()
    specials = kimi_special_tokens(len(ranks))
    text["vocab_size"] = max(text["vocab_size"], len(ranks) + len(specials))
    text["eos_token_id"] = specials["<|end_of_msg|>"]
    config = full_config(text)
    args = ModelArgs.from_config(config)
    model = model if model is not None else random_model(args, seed)
    tensors = checkpoint_tensors(model, args, dtype)
    if extras:
        tensors.update(extra_tensors(args, dtype))
    plan = shard_plan(tensors, args, n_shards)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_safetensors_sharded(tensors, plan, tmp, n_shards)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": text["eos_token_id"]}, indent=2)
        )
        write_tokenizer_files(tmp, ranks, specials)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
