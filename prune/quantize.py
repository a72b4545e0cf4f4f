"""Trunk and expert quantization for the build writer (`kimi-mlx convert`, `prune --q-bits`).

MLX affine quantization, as `mlx_lm.convert` does it: `mx.quantize(w, group_size, bits)`
of the stored BF16 weight gives `weight` (uint32, `bits` per element packed along the
input dimension), `scales` and `biases` (one per group of `group_size` inputs, in the
weight's dtype), so that w ~ scales * q + biases per group. `mlx_lm.load` and our loader
rebuild `QuantizedLinear` / `QuantizedEmbedding` from those three tensors (per-module
bits and group size are read off the shapes, `mlx_lm.utils.infer_quant_config`).

What is quantized (`QuantSpec`):

* trunk (`bits`, `group_size`): every tensor `tensor_map.quantizable` names (attention,
  dense and shared-expert MLPs, latent projections, embedding, lm_head) whose input
  dimension is a multiple of `group_size`; other tensors (norms, router, correction
  bias, KDA conv / A_log / dt_bias, AttnRes, `kv_b_proj`) keep their stored bytes;
* routed experts (`expert_bits`, `expert_group_size`): the MXFP4 `weight_packed` +
  E8M0 `weight_scale` of each expert projection are dequantized (exact: MXFP4 values are
  representable in BF16) and requantized to affine `weight` / `scales` / `biases`.
  Without `expert_bits` they are byte-copied.

Memory: one source tensor (plus its quantized form) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

# Names and shapes of quantized tensors live with the tensor-name table (the planner
# sizes builds with them too); re-exported here for the writer.
from kimi_mlx.model.tensor_map import expert_outputs, trunk_outputs  # noqa: F401

from kimi_mlx.model.config import QUANT_DEFAULT_GROUP as DEFAULT_GROUP
from kimi_mlx.model.config import QUANT_EXPERT_BITS as EXPERT_BITS
from kimi_mlx.model.config import QUANT_GROUP_SIZES as GROUP_SIZES
from kimi_mlx.model.config import QUANT_TRUNK_BITS as TRUNK_BITS

# safetensors dtype -> (numpy dtype of the raw bytes, MLX dtype of the values)
_RAW = {"BF16": (np.uint16, mx.bfloat16), "F16": (np.float16, mx.float16),
        "F32": (np.float32, mx.float32)}


class QuantError(ValueError):
    """A quantization request that cannot be met (names the flag / tensor and why)."""


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize.

    Attributes:
        bits: trunk bits per weight (4, 5, 6, 8) or None (trunk kept as stored).
        group_size: trunk weights per scale / bias (32, 64, 128).
        expert_bits: routed-expert bits (2, 3, 4) or None (MXFP4 byte-copied).
        expert_group_size: expert weights per scale / bias (32, 64, 128).
    """

    bits: Optional[int] = None
    group_size: int = DEFAULT_GROUP
    expert_bits: Optional[int] = None
    expert_group_size: int = DEFAULT_GROUP

    def __post_init__(self):
        if self.bits is not None and self.bits not in TRUNK_BITS:
            raise QuantError(f"--q-bits must be one of {list(TRUNK_BITS)} (MLX affine), "
                             f"got {self.bits}")
        if self.expert_bits is not None and self.expert_bits not in EXPERT_BITS:
            raise QuantError(f"--expert-bits must be one of {list(EXPERT_BITS)}, "
                             f"got {self.expert_bits}")
        for flag, g in (("--q-group-size", self.group_size),
                        ("--expert-group-size", self.expert_group_size)):
            if g not in GROUP_SIZES:
                raise QuantError(f"{flag} must be one of {list(GROUP_SIZES)}, got {g}")

    @property
    def active(self) -> bool:
        return self.bits is not None or self.expert_bits is not None

    def config_block(self) -> Dict[str, object]:
        """The `quantization` block of config.json (mlx-lm's format: the default
        group_size / bits / mode; per-module values are read off the tensors)."""
        if self.bits is not None:
            return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        return {"group_size": self.expert_group_size, "bits": self.expert_bits, "mode": "affine"}

    def describe(self, markdown: bool = True) -> List[str]:
        """One sentence per line for the model card; `markdown` False: for a terminal
        (no backticks)."""
        lines = []
        if self.bits is not None:
            lines.append(f"Trunk (attention, dense and shared-expert MLPs, latent projections, "
                         f"embedding, lm_head): MLX affine {self.bits}-bit, group size "
                         f"{self.group_size} (as `mlx_lm.convert`). Norms, router, "
                         "correction bias, KDA conv / A_log / dt_bias, AttnRes and kv_b_proj "
                         "keep their stored dtype.")
        else:
            lines.append("Trunk: stored dtype (BF16), unchanged.")
        if self.expert_bits is not None:
            lines.append(f"Routed experts: MXFP4 requantized to MLX affine {self.expert_bits}-bit, "
                         f"group size {self.expert_group_size}.")
        else:
            lines.append("Routed experts: MXFP4, byte-for-byte the source's.")
        return lines if markdown else [line.replace("`", "") for line in lines]


def to_bytes(a: mx.array) -> bytes:
    """Raw little-endian bytes of an evaluated MLX array (row-major)."""
    mx.eval(a)
    return bytes(memoryview(a))


def from_bytes(raw: bytes, dtype: str, shape: Sequence[int]) -> mx.array:
    """An MLX array of safetensors `dtype` ("BF16", "F16", "F32", "U8") from raw bytes."""
    if dtype == "U8":
        return mx.array(np.frombuffer(raw, np.uint8).reshape(shape))
    np_dtype, mx_dtype = _RAW[dtype]
    a = mx.array(np.frombuffer(raw, np_dtype).reshape(shape))
    return a.view(mx_dtype) if np_dtype is np.uint16 else a


def quantize_weight(raw: bytes, dtype: str, shape: Sequence[int], bits: int,
                    group: int) -> Tuple[bytes, bytes, bytes]:
    """Affine-quantize a stored weight: (weight, scales, biases) bytes, scales and biases
    in the weight's own dtype (as `mlx_lm.convert` on a BF16 model)."""
    w = from_bytes(raw, dtype, shape)
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits, mode="affine")
    return to_bytes(q), to_bytes(scales), to_bytes(biases)


def requantize_mxfp4(packed: bytes, scale: bytes, packed_shape: Sequence[int], bits: int,
                     group: int) -> Tuple[bytes, bytes, bytes]:
    """MXFP4 `weight_packed` U8 [out, in/2] + E8M0 `weight_scale` U8 [out, in/32] ->
    affine (weight, scales, biases) bytes with BF16 scales and biases.

    The MXFP4 bytes are MLX `mode="mxfp4"` as they are (K31_SPEC.md section 6); dequantizing
    to BF16 is exact (e2m1 x 2^k), so only the requantization rounds.
    """
    out, half = packed_shape
    w = from_bytes(packed, "U8", (out, half)).view(mx.uint32)
    s = from_bytes(scale, "U8", (out, 2 * half // 32))
    dense = mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.bfloat16)
    q, scales, biases = mx.quantize(dense, group_size=group, bits=bits, mode="affine")
    return to_bytes(q), to_bytes(scales), to_bytes(biases)
