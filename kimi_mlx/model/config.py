"""Kimi K3.1 configuration: reading `config.json` and the conventions where the record is silent.

`ModelArgs` holds the text-model fields under the checkpoint's own key names
(`text_config` of the official multimodal config, see K31_SPEC.md section 1). The
K3.1-only indexer settings (`dsa_config`) were not published; `CONVENTIONS` is the one
table that says which spellings we write and which we also accept on read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlx_lm.models.base import BaseModelArgs

MODEL_TYPE = "kimi_k31"
ARCHITECTURE = "KimiK31ForConditionalGeneration"

# Top-level `model_type` values we load. `kimi_k3` is taken only when the config or the
# tensors carry a DSA indexer (otherwise it is plain K3 and mlx-lm's kimi_k3 handles it).
ACCEPTED_MODEL_TYPES = (MODEL_TYPE, "kimi_k3", "kimi_linear")

# Where the public record is silent (K31_SPEC.md "Conventions"): first spelling is the one
# our tools write, the rest are accepted on read, in order.
CONVENTIONS: Dict[str, Any] = {
    "dsa_config_key": "dsa_config",
    "index_n_heads": ("index_n_heads", "num_heads", "head_count", "n_heads"),
    "index_head_dim": ("index_head_dim", "head_dim", "key_length"),
    "index_topk": ("index_topk", "topk", "top_k"),
    "dsa_layers": ("dsa_layers", "layers", "types"),
    "indexer_tensors": ("wq_b", "wk", "weights_proj", "k_norm"),
}

# Build quantization choices (`convert`, `prune --q-bits`, `plan --q-bits`): MLX affine
# trunk bits, routed-expert requantization bits, group sizes.
QUANT_TRUNK_BITS = (4, 5, 6, 8)
QUANT_EXPERT_BITS = (2, 3, 4)
QUANT_GROUP_SIZES = (32, 64, 128)
QUANT_DEFAULT_GROUP = 64

# Keys a text config must carry; a missing one is reported by name.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "rms_norm_eps",
    "linear_attn_config",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
REQUIRED_LINEAR_KEYS = ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers")


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi K3.1 model; the message names file and key."""


@dataclass
class ModelArgs(BaseModelArgs):
    """Text-model hyper-parameters, named as in the official `text_config` (K31_SPEC.md s.1).

    Layer lists (`kda_layers`, `full_attn_layers`, `dsa_layers`) are 1-indexed as in the
    checkpoint; use `is_kda(i)` / `is_dsa(i)` with 0-based layer indices.
    """

    model_type: str = MODEL_TYPE
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    linear_attn_config: Dict[str, Any] = field(default_factory=dict)
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: Optional[float] = 25.0
    attn_res_block_size: Optional[int] = 12
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    num_experts: int = 896
    # Per-layer routed-expert counts of a non-uniformly pruned build ({"<0-based layer>": n},
    # written by `kimi-mlx prune --budget spread`); `num_experts` is then their maximum.
    num_experts_per_layer: Optional[Dict[str, int]] = None
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: Optional[int] = 3584
    latent_moe_use_norm: bool = True
    tie_word_embeddings: bool = False
    # DeepSeek-style MTP layers after the trunk (`kimi_mlx.speculative.mtp`; the trunk skips them).
    num_nextn_predict_layers: int = 0
    # K3.1 lightning indexer (normalised from `dsa_config` by `from_config`).
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    dsa_layers: Optional[List[int]] = None
    # Compressed-tensors / MLX quantization of the routed experts, if any.
    quantization: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        if self.hidden_act != "situ":
            raise ConfigError(f"hidden_act: expected 'situ', got {self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            raise ConfigError(
                "moe_router_activation_func: expected 'sigmoid', got "
                f"{self.moe_router_activation_func!r}"
            )
        if not self.mla_use_nope:
            raise ConfigError("mla_use_nope: only NoPE MLA (true) is supported")
        if self.dsa_layers is None:
            self.dsa_layers = list(self.linear_attn_config.get("full_attn_layers", []))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_experts_per_layer is not None:
            per = self.num_experts_per_layer
            if not isinstance(per, dict) or not all(
                    str(k).isdigit() and isinstance(v, int) and v >= self.num_experts_per_token
                    for k, v in per.items()):
                raise ConfigError(
                    "num_experts_per_layer: expected {\"<0-based layer>\": experts} with every "
                    f"count >= num_experts_per_token ({self.num_experts_per_token}), got {per!r}")
            self.num_experts_per_layer = {str(int(k)): int(v) for k, v in per.items()}
            moe = [str(i) for i in range(self.num_hidden_layers) if self.is_moe(i)]
            if sorted(self.num_experts_per_layer, key=int) != moe:
                raise ConfigError(f"num_experts_per_layer: expected one count for each MoE "
                                  f"layer {moe}, got layers {sorted(per, key=int)}")
            if max(self.num_experts_per_layer.values()) != self.num_experts:
                raise ConfigError(f"num_experts ({self.num_experts}) must be the largest of "
                                  f"num_experts_per_layer ({self.num_experts_per_layer})")

    def experts_in(self, i: int) -> int:
        """Routed experts of 0-based layer `i` (0 for a dense layer): `num_experts`, or
        the layer's own count in a non-uniformly pruned build (`num_experts_per_layer`)."""
        if not self.is_moe(i):
            return 0
        if self.num_experts_per_layer:
            return self.num_experts_per_layer[str(i)]
        return self.num_experts

    # -- layer schedule ---------------------------------------------------------------
    @property
    def kda_layers(self) -> List[int]:
        return list(self.linear_attn_config["kda_layers"])

    def is_kda(self, i: int) -> bool:
        """True when 0-based layer `i` is a Kimi Delta Attention layer (1-indexed list)."""
        return (i + 1) in self.linear_attn_config["kda_layers"]

    def is_dsa(self, i: int) -> bool:
        """True when 0-based layer `i` is a full-attention layer with a lightning indexer."""
        return not self.is_kda(i) and (i + 1) in self.dsa_layers

    def is_moe(self, i: int) -> bool:
        """True when layer `i` has the latent MoE (layer 0 is dense in K3/K3.1)."""
        return (
            self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @classmethod
    def from_config(cls, config: Dict[str, Any], source: str = "config.json") -> "ModelArgs":
        """Build args from a full config (with or without `text_config`).

        Raises:
            ConfigError: unknown `model_type`, or a required key missing (named).
        """
        text = text_config(config, source)
        missing = [k for k in REQUIRED_KEYS if k not in text]
        if missing:
            raise ConfigError(f"{source}: text config is missing key(s) {missing}")
        lin = text["linear_attn_config"]
        missing = [k for k in REQUIRED_LINEAR_KEYS if k not in lin]
        if missing:
            raise ConfigError(f"{source}: linear_attn_config is missing key(s) {missing}")
        params = dict(text)
        params.update(_dsa_params(text, source))
        params["model_type"] = MODEL_TYPE
        quant = config.get("quantization") or text.get("quantization")
        qcfg = config.get("quantization_config") or text.get("quantization_config")
        params["quantization"] = quant or (_quantization_from(qcfg, source) if qcfg else None)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names})

    @classmethod
    def from_dict(cls, params):
        """mlx-lm's entry point: it passes the whole config.json here."""
        return cls.from_config(params)


def text_config(config: Dict[str, Any], source: str = "config.json") -> Dict[str, Any]:
    """Return the text-model part of a config, checking the model type.

    Raises:
        ConfigError: the top-level `model_type` is not one we load.
    """
    model_type = config.get("model_type")
    if model_type not in ACCEPTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not a Kimi K3.1 checkpoint "
            f"(expected one of {list(ACCEPTED_MODEL_TYPES)})"
        )
    return config.get("text_config", config)


def _first(d: Dict[str, Any], names) -> Any:
    for n in names:
        if n in d:
            return d[n]
    return None


def _dsa_params(text: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Normalise the indexer settings from `dsa_config` or DeepSeek-V3.2 spellings."""
    dsa = text.get(CONVENTIONS["dsa_config_key"])
    if dsa is None:
        dsa = text  # DeepSeek-V3.2 puts index_* directly in the text config
    out = {}
    for key in ("index_n_heads", "index_head_dim", "index_topk", "dsa_layers"):
        value = _first(dsa, CONVENTIONS[key])
        if key == "dsa_layers" and dsa is text:
            value = text.get("dsa_layers")
        if value is not None:
            out[key] = value
    if "dsa_layers" in out and not all(isinstance(v, int) for v in out["dsa_layers"]):
        raise ConfigError(f"{source}: dsa_config layer list must be 1-indexed integers")
    return out


def _quantization_from(qcfg: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Map a compressed-tensors `quantization_config` to MLX quantization parameters."""
    if qcfg.get("quant_method") == "compressed-tensors":
        fmt = qcfg.get("format")
        if fmt != "mxfp4-pack-quantized":
            raise ConfigError(
                f"{source}: quantization_config.format {fmt!r} is not supported "
                "(expected 'mxfp4-pack-quantized')"
            )
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if "group_size" in qcfg and "bits" in qcfg:
        return dict(qcfg)
    raise ConfigError(f"{source}: unsupported quantization_config {qcfg!r}")


def read_config(model_dir: Path) -> Dict[str, Any]:
    """Read `<model_dir>/config.json`.

    Raises:
        FileNotFoundError: no config.json (message names the folder).
        ConfigError: the file is not valid JSON.
    """
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json in the model folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
