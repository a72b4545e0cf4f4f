"""Bytes per layer of a Kimi K3.1 checkpoint: resident weights, weights read per token, caches.

Two sources give the same `ModelBytes`:

- a local checkpoint: the real tensor sizes from each shard's safetensors header (8-byte
  little-endian length + JSON of dtype, shape, data_offsets), found through
  `model.safetensors.index.json`. Only headers are read, never tensor data.
- a config alone: every tensor's shape and dtype computed from `config.json` as the
  official checkpoint lays them out (K31_SPEC.md section 2), so `kimi-mlx plan` works
  offline for a hub id we ship the config of.

A `BuildSpec` turns either into the sizes of a build `kimi-mlx prune` / `convert` would
write from it (experts kept, trunk and expert quantization), tensor by tensor with the
same name and shape rules as the writer (`kimi_mlx.model.tensor_map`), before anything is read.

Caches always come from the config (K31_SPEC.md section 4): a KDA layer keeps a conv state
and an fp32 recurrent state per sequence, constant in the context length; a DSA layer
keeps the MLA latent + rope key (and the indexer key) per token.

Placement (which stage holds what): `layers.N.*` go to the stage holding layer N; the
embedding to the first stage; `norm`, `output_attn_res_*` and `lm_head` to the last stage;
vision tower, projector and MTP layers (N >= num_hidden_layers) are not loaded and are
reported apart.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import kimi_mlx
from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.checkpoint.hub import looks_local, missing_folder
from kimi_mlx.checkpoint.shards import DTYPE_BYTES, INDEX_FILE, CheckpointError, read_header
from kimi_mlx.checkpoint.shards import weight_map as _weight_map
from kimi_mlx.model.tensor_map import expert_outputs, quantizable, trunk_outputs
from kimi_mlx.placement.expected_tensors import expected_tensors  # noqa: F401 (re-exported)

# Shipped official configs (no weights): `kimi_mlx/assets/official/<repo name>/config.json`.
OFFICIAL_DIR = Path(kimi_mlx.__file__).resolve().parent / "assets" / "official"
DEFAULT_MODEL_ID = "moonshotai/Kimi-K3.1-Pro"

_LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.(?:experts\.(\d+)|switch_mlp)\.")
_ROUTER_RE = re.compile(r"\.(?:block_sparse_moe|mlp)\.(?:gate\.weight|gate\.e_score_correction_bias|e_score_correction_bias)$")
_EMBED_RE = re.compile(r"^(?:language_model\.)?model\.embed_tokens\.")
_HEAD_RE = re.compile(
    r"^(?:language_model\.)?(?:lm_head\.|model\.norm\.|model\.output_attn_res_)"
)
_VISION_RE = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:vision_tower|mm_projector)\.")
_MTP_RE = re.compile(r"^(?:language_model\.)?(?:model\.)?mtp")
_EXPERT_TENSOR_RE = re.compile(
    r"^(?:language_model\.)?model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(.+)$")
SHARD_BYTES = 5 * 10**9  # shard size assumed for a build sized from a config alone
# The quantized DSA cache (`--kv-bits`): MLX affine quantization (`mx.quantize`) of the
# latent's and the index key's values, a scale and a bias per group in the cache dtype.
KV_CACHE_BITS = (8,)
KV_CACHE_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DEFAULT_GROUP = 128  # as model/cache.py KV_DEFAULT_GROUP (`--kv-group-size`)

Tensors = Dict[str, Tuple[str, Tuple[int, ...]]]  # name -> (safetensors dtype, shape)


@dataclass(frozen=True)
class BuildSpec:
    """A build of a checkpoint as `kimi-mlx prune` / `convert` writes it.

    Attributes:
        keep_experts: routed experts kept per MoE layer (None: all; clamped to
            [experts_per_token, num_experts]).
        bits, group_size: trunk MLX affine quantization (None: stored dtype).
        expert_bits, expert_group_size: routed-expert requantization (None: MXFP4 as is).
    """

    keep_experts: Optional[int] = None
    bits: Optional[int] = None
    group_size: int = 64
    expert_bits: Optional[int] = None
    expert_group_size: int = 64

    def describe(self) -> str:
        parts = []
        if self.keep_experts is not None:
            parts.append(f"{self.keep_experts} experts/layer")
        parts.append(f"trunk {self.bits}-bit g{self.group_size}" if self.bits else "trunk as stored")
        if self.expert_bits:
            parts.append(f"experts {self.expert_bits}-bit g{self.expert_group_size}")
        return ", ".join(parts)


def apply_build(tensors: Tensors, args: ModelArgs, build: Optional[BuildSpec]) -> Tensors:
    """The tensors (name -> (dtype, shape)) of `build` made from `tensors`: experts
    >= keep dropped and router rows sliced (the writer keeps the chosen experts, renumbered
    0..keep-1; sizes do not depend on which), trunk weights and expert projections
    replaced by their quantized weight / scales / biases (`kimi_mlx.model.tensor_map`).

    Raises:
        ValueError: an expert input dimension that is not a multiple of the group size.
    """
    if build is None:
        return dict(tensors)
    keep = build.keep_experts
    if keep is not None:
        keep = max(min(keep, args.num_experts), args.num_experts_per_token)
    out: Tensors = {}
    for name, (dt, shape) in tensors.items():
        m = _EXPERT_TENSOR_RE.match(name) if ".experts." in name else None
        if m and int(m.group(1)) < args.num_hidden_layers:
            if keep is not None and int(m.group(2)) >= keep:
                continue
            rest = m.group(3)
            if build.expert_bits and rest.endswith(".weight_scale"):
                continue
            if build.expert_bits and rest.endswith(".weight_packed"):
                for n, d, shp in expert_outputs(name[: -len(".weight_packed")], shape,
                                                build.expert_bits, build.expert_group_size):
                    out[n] = (d, shp)
                continue
        elif m:
            pass  # an MTP layer's experts: as stored
        elif keep is not None and ".gate." in name and _ROUTER_RE.search(name) and _LAYER_RE.match(name):
            shape = (keep, *shape[1:])
        elif build.bits and name.endswith(".weight") and quantizable(name):
            q = trunk_outputs(name, dt, shape, build.bits, build.group_size)
            if q is not None:
                for n, d, shp in q:
                    out[n] = (d, shp)
                continue
        out[name] = (dt, shape)
    return out


def header_bytes(tensors: Tensors, shard_bytes: int) -> int:
    """Estimated safetensors header bytes (8-byte length + JSON, padded) of one shard
    holding `tensors` with `shard_bytes` of data: each entry as the writer spells it, with
    offsets of the shard size's digit count."""
    digits = len(str(max(shard_bytes, 1)))
    total = 8 + len('{"__metadata__":{"format":"pt"}}') + 4
    for name, (dt, shape) in tensors.items():
        total += len(f'"{name}":{{"dtype":"{dt}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[,]}},') + 2 * digits
    return total


@dataclass(frozen=True)
class LayerBytes:
    """Bytes of one decoder layer (0-based `index`), resident and read per decode step.

    Attributes (bytes unless said):
        kind: "kda", "dsa" (Gated MLA + lightning indexer) or "mla" (no indexer).
        weight_bytes: all tensors of the layer as loaded.
        routed_expert_bytes: the part of `weight_bytes` in routed experts (read only for
            the experts a token picks).
        router_bytes: router gate + correction bias (scale with the number of experts).
        num_experts, experts_per_token: routed experts held and picked per token (0 dense).
        cache_bytes_per_token: per sequence per token of context (DSA: latent + rope key
            + index key; K31_SPEC.md s.4).
        index_bytes_per_token: the indexer-key part of `cache_bytes_per_token`, read in full
            every decode step to score all keys.
        index_topk: keys the main attention reads per step (None: all of them).
        state_bytes_per_sequence: constant per sequence (KDA conv + recurrent state).
        cache_values: values per token of (MLA latent, rope key, index key), so the cache
            can be recounted in another format (`with_kv_bits`); (0, 0, 0) for KDA.
        cache_act_bytes: bytes of one unquantized cache value (the activation dtype).
    """

    index: int
    kind: str
    weight_bytes: int
    routed_expert_bytes: int = 0
    router_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    cache_bytes_per_token: int = 0
    index_bytes_per_token: int = 0
    index_topk: Optional[int] = None
    state_bytes_per_sequence: int = 0
    cache_values: Tuple[int, int, int] = (0, 0, 0)
    cache_act_bytes: int = 2

    def with_kv_bits(self, bits: Optional[int], group_size: int = KV_CACHE_DEFAULT_GROUP
                     ) -> "LayerBytes":
        """This layer with its per-token cache counted in the `--kv-bits` format
        (`kv_token_bytes`: the latent and the index key quantized, the rope key not);
        bits None: unquantized. A layer with no per-token cache is returned as is.

        Raises:
            ValueError: a layer with a per-token cache but no `cache_values`, or a format
            `kv_token_bytes` refuses."""
        if not self.cache_bytes_per_token:
            return self
        if not any(self.cache_values):
            raise ValueError(f"layer {self.index}: cache_values unknown, the cache cannot be "
                             f"recounted for --kv-bits")
        latent, rope, index = self.cache_values
        act = self.cache_act_bytes
        idx = kv_token_bytes(index, act, bits, group_size)
        per_token = kv_token_bytes(latent, act, bits, group_size) + rope * act + idx
        return replace(self, cache_bytes_per_token=per_token, index_bytes_per_token=idx)

    def cache_bytes(self, context: int, sequences: int = 1) -> int:
        """Cache bytes held for `sequences` sequences of `context` tokens each."""
        return sequences * (self.cache_bytes_per_token * context + self.state_bytes_per_sequence)

    def resident_bytes(self, context: int, sequences: int = 1) -> int:
        """Weights + caches (bytes) this layer needs in memory."""
        return self.weight_bytes + self.cache_bytes(context, sequences)

    def active_experts(self, sequences: int = 1) -> float:
        """Distinct routed experts read in one decode step of `sequences` tokens.

        One token reads `experts_per_token`; a batch reads the expected union under
        uniform routing, E * (1 - (1 - k/E)^B). Real routing is skewed, so this is an
        upper estimate of the union for B > 1.
        """
        e, k = self.num_experts, self.experts_per_token
        if e == 0:
            return 0.0
        if sequences <= 1:
            return float(min(k, e))
        return e * (1.0 - (1.0 - min(k, e) / e) ** sequences)

    def read_bytes(self, context: int, sequences: int = 1) -> int:
        """Bytes read from memory by one decode step (one token for each of `sequences`).

        Weights: everything but the routed experts, plus the active experts' share of
        them. Caches at `context` tokens: every index key is scored; the main attention
        reads min(context, index_topk) latent rows; a KDA state is read once.
        """
        weights = self.weight_bytes - self.routed_expert_bytes
        if self.num_experts:
            weights += self.routed_expert_bytes * self.active_experts(sequences) / self.num_experts
        attended = context if self.index_topk is None else min(context, self.index_topk)
        per_seq = (
            self.index_bytes_per_token * context
            + (self.cache_bytes_per_token - self.index_bytes_per_token) * attended
            + self.state_bytes_per_sequence
        )
        return int(round(weights)) + sequences * per_seq

    def pruned(self, keep_experts: int) -> "LayerBytes":
        """This layer with only `keep_experts` routed experts (REAP pruning): bytes scale."""
        if not self.num_experts:
            return self
        keep = max(min(keep_experts, self.num_experts), self.experts_per_token)
        routed = self.routed_expert_bytes * keep // self.num_experts
        router = self.router_bytes * keep // self.num_experts
        dropped = self.routed_expert_bytes - routed + self.router_bytes - router
        return replace(
            self,
            weight_bytes=self.weight_bytes - dropped,
            routed_expert_bytes=routed,
            router_bytes=router,
            num_experts=keep,
        )


@dataclass(frozen=True)
class ModelBytes:
    """Per-layer bytes of a whole checkpoint, as the planner needs them.

    Attributes (bytes):
        layers: one `LayerBytes` per decoder layer, in order.
        embed_bytes: token embedding (first stage); `embed_rows` rows, one read per token.
        head_bytes: final norm, output AttnRes mix and lm_head (last stage), read in full.
        not_loaded: bytes in the checkpoint no stage loads, by group ("vision", "mtp",
            "other").
        source: where the sizes came from ("headers: <folder>" or "config: <file>").
        notes: anything the user should know about the sizes (e.g. an offline fallback).
        max_position_embeddings: the config's context limit in tokens (0 = unknown).
    """

    layers: Tuple[LayerBytes, ...]
    embed_bytes: int
    head_bytes: int
    embed_rows: int
    not_loaded: Mapping[str, int] = field(default_factory=dict)
    source: str = ""
    notes: Tuple[str, ...] = ()
    max_position_embeddings: int = 0  # the config's context limit (0 = unknown)
    header_bytes: int = 0  # safetensors headers of every shard (estimated for a build)
    build: Optional[BuildSpec] = None  # the build these sizes are for (None: as stored)
    kv_bits: Optional[int] = None  # the DSA cache format counted (None: the cache dtype)
    kv_group_size: int = KV_CACHE_DEFAULT_GROUP

    def with_kv_bits(self, bits: Optional[int], group_size: int = KV_CACHE_DEFAULT_GROUP
                     ) -> "ModelBytes":
        """The same model with its DSA caches counted in the `--kv-bits` format
        (`LayerBytes.with_kv_bits`); bits None: unquantized.

        Raises:
            ValueError: as `LayerBytes.with_kv_bits`."""
        layers = tuple(l.with_kv_bits(bits, group_size) for l in self.layers)
        return replace(self, layers=layers, kv_bits=bits, kv_group_size=group_size)

    def kv_format(self) -> str:
        """The cache format counted, e.g. "bf16" or "8-bit (group 64)"."""
        if self.kv_bits is None:
            return "bf16" if not self.layers or self.layers[0].cache_act_bytes == 2 else "fp32"
        return f"{self.kv_bits}-bit (group {self.kv_group_size})"

    @property
    def file_bytes(self) -> int:
        """Bytes of the checkpoint's safetensors files: every tensor (loaded or not) plus
        the headers."""
        return self.weight_bytes + sum(self.not_loaded.values()) + self.header_bytes

    @property
    def weight_bytes(self) -> int:
        """All loaded weights (embedding + layers + head), bytes."""
        return self.embed_bytes + self.head_bytes + sum(l.weight_bytes for l in self.layers)

    @property
    def routed_expert_bytes(self) -> int:
        return sum(l.routed_expert_bytes for l in self.layers)

    @property
    def cache_bytes_per_token(self) -> int:
        """KV cache per token of context per sequence, all layers (K3.1: 33,792 B)."""
        return sum(l.cache_bytes_per_token for l in self.layers)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Constant per-sequence state, all layers (K3.1 KDA: 449,372,160 B)."""
        return sum(l.state_bytes_per_sequence for l in self.layers)

    @property
    def num_experts(self) -> int:
        return max((l.num_experts for l in self.layers), default=0)

    @property
    def experts_per_token(self) -> int:
        return max((l.experts_per_token for l in self.layers), default=0)

    def embed_read_bytes(self, sequences: int = 1) -> int:
        """Embedding bytes read per decode step: one row per sequence."""
        rows = max(self.embed_rows, 1)
        return self.embed_bytes * min(sequences, rows) // rows

    def cache_bytes(self, context: int, sequences: int = 1) -> int:
        """All layers' caches for `sequences` sequences of `context` tokens, bytes."""
        return sum(l.cache_bytes(context, sequences) for l in self.layers)

    def pruned(self, keep_experts: int) -> "ModelBytes":
        """The same checkpoint with `keep_experts` routed experts per MoE layer.

        `keep_experts` is clamped to [experts_per_token, num_experts].
        """
        return replace(
            self,
            layers=tuple(l.pruned(keep_experts) for l in self.layers),
            source=f"{self.source}, pruned to {keep_experts} experts/layer",
        )


# -- from a config --------------------------------------------------------------------

def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n




def _act_bytes(config: Mapping[str, Any]) -> int:
    text = config.get("text_config", config)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return 4 if str(dtype) in ("float32", "torch.float32") else 2


def kv_token_bytes(values: int, act_bytes: int = 2, bits: Optional[int] = None,
                   group_size: int = KV_CACHE_DEFAULT_GROUP) -> int:
    """Bytes per token of `values` cache values: `act_bytes` each unquantized (bits None),
    or in MLX's affine format (`mx.quantize(x, group_size, bits)`, the `--kv-bits` cache):
    values * bits / 8 bytes of packed uint32 words plus a scale and a bias per group of
    `group_size` values (all `values` as one group when fewer: `model.cache.group_for`)
    in the cache dtype (`act_bytes` each). K3.1's latent at 8 bits,
    group 64: 512 + 2 * 8 * 2 = 544 B; its index key: 128 + 2 * 2 * 2 = 136 B.

    Raises:
        ValueError: bits not in KV_CACHE_BITS, a group size not in KV_CACHE_GROUP_SIZES or
        one (below `values`) that does not divide `values`."""
    if bits is None or values == 0:
        return values * act_bytes
    if bits not in KV_CACHE_BITS:
        raise ValueError(f"--kv-bits {bits}: the cache is quantized to "
                         f"{' or '.join(map(str, KV_CACHE_BITS))} bits")
    # a vector shorter than the group is one group, as the cache stores it
    # (`model.cache.group_for`: a small model's 32-value index key at group 64)
    group = min(group_size, values) if group_size in KV_CACHE_GROUP_SIZES else group_size
    if group not in KV_CACHE_GROUP_SIZES or values % group:
        raise ValueError(f"--kv-group-size {group_size}: must be one of "
                         f"{', '.join(map(str, KV_CACHE_GROUP_SIZES))} and divide the "
                         f"{values} cache values of a token")
    return values * bits // 8 + 2 * (values // group) * act_bytes


def cache_values(args: ModelArgs, i: int) -> Tuple[int, int, int]:
    """Values per token of layer `i`'s cache: (MLA latent, rope key, index key); zeros for
    KDA (K31_SPEC.md section 4)."""
    if args.is_kda(i):
        return 0, 0, 0
    return (args.kv_lora_rank, args.qk_rope_head_dim,
            args.index_head_dim if args.is_dsa(i) else 0)


def cache_bytes(args: ModelArgs, i: int, act_bytes: int = 2, kv_bits: Optional[int] = None,
                kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> Tuple[int, int, int]:
    """(cache bytes per token, of which index-key bytes per token, state bytes per sequence).

    K31_SPEC.md section 4, for 0-based layer `i`:
    - KDA: conv state [kernel-1, 3*P] in the activation dtype + recurrent state
      [H, D, D] fp32 per sequence; nothing per token. K3.1: 221,184 + 6,291,456 B.
    - MLA: latent c (kv_lora_rank) + rope key (qk_rope_head_dim) per token, bf16: 1,152 B.
    - DSA: MLA + indexer key (index_head_dim) per token, bf16: 1,152 + 256 B.
    With `kv_bits` (the `--kv-bits` cache) the latent and the index key are counted in the
    quantized format (`kv_token_bytes`), the rope key unquantized: K3.1 at 8 bits, group
    64: 544 + 128 + 136 = 808 B per DSA layer.

    Raises:
        ValueError: a format `kv_token_bytes` refuses.
    """
    if args.is_kda(i):
        lin = args.linear_attn_config
        heads, hd = lin["num_heads"], lin["head_dim"]
        conv = (lin["short_conv_kernel_size"] - 1) * 3 * heads * hd * act_bytes
        return 0, 0, conv + heads * hd * hd * 4
    latent, rope, index_values = cache_values(args, i)
    per_token = kv_token_bytes(latent, act_bytes, kv_bits, kv_group_size) + rope * act_bytes
    index = kv_token_bytes(index_values, act_bytes, kv_bits, kv_group_size)
    return per_token + index, index, 0


def _layer_kind(args: ModelArgs, i: int) -> str:
    return "kda" if args.is_kda(i) else ("dsa" if args.is_dsa(i) else "mla")


def _assemble(args: ModelArgs, sizes: Mapping[str, int], act_bytes: int, source: str,
              notes: Tuple[str, ...] = (), origin: str = "tensors", header: int = 0,
              build: Optional[BuildSpec] = None) -> ModelBytes:
    """Group {tensor name: bytes} into a ModelBytes (placement rules in the module doc)."""
    n = args.num_hidden_layers
    weight = [0] * n
    routed = [0] * n
    router = [0] * n
    expert_ids: List[set] = [set() for _ in range(n)]
    embed = head = 0
    not_loaded: Dict[str, int] = {}
    embed_rows = args.vocab_size
    for name, size in sizes.items():
        lm = _LAYER_RE.match(name)
        if lm:
            i = int(lm.group(1))
            if i >= n:
                not_loaded["mtp"] = not_loaded.get("mtp", 0) + size
                continue
            weight[i] += size
            me = _EXPERT_RE.search(name)
            if me:
                routed[i] += size
                if me.group(1) is not None:
                    expert_ids[i].add(int(me.group(1)))
            elif _ROUTER_RE.search(name):
                router[i] += size
        elif _EMBED_RE.match(name):
            embed += size
        elif _HEAD_RE.match(name):
            head += size
        elif _VISION_RE.match(name):
            not_loaded["vision"] = not_loaded.get("vision", 0) + size
        elif _MTP_RE.match(name):
            not_loaded["mtp"] = not_loaded.get("mtp", 0) + size
        else:
            not_loaded["other"] = not_loaded.get("other", 0) + size
    missing = [i for i in range(n) if weight[i] == 0]
    if missing:
        raise CheckpointError(
            f"{source}: no {origin} for layer(s) {missing[:10]}{'...' if len(missing) > 10 else ''} "
            f"of num_hidden_layers={n}"
        )
    if embed == 0:
        raise CheckpointError(f"{source}: no embed_tokens {origin}")
    layers = []
    for i in range(n):
        per_token, index, state = cache_bytes(args, i, act_bytes)
        moe = args.is_moe(i)
        layers.append(LayerBytes(
            index=i,
            kind=_layer_kind(args, i),
            weight_bytes=weight[i],
            routed_expert_bytes=routed[i],
            router_bytes=router[i],
            # A checkpoint's own expert tensors win over the config (pruned builds).
            num_experts=(len(expert_ids[i]) or args.num_experts) if moe else 0,
            experts_per_token=args.num_experts_per_token if moe else 0,
            cache_bytes_per_token=per_token,
            index_bytes_per_token=index,
            index_topk=args.index_topk if args.is_dsa(i) else None,
            state_bytes_per_sequence=state,
            cache_values=cache_values(args, i),
            cache_act_bytes=act_bytes,
        ))
    if build is not None:
        source = f"{source}, build: {build.describe()}"
    return ModelBytes(tuple(layers), embed, head, embed_rows, not_loaded, source, notes,
                      args.max_position_embeddings, header, build)


def model_bytes_from_config(config: Mapping[str, Any], source: str = "config.json",
                            notes: Tuple[str, ...] = (),
                            build: Optional[BuildSpec] = None) -> ModelBytes:
    """Per-layer bytes computed from a config alone (shapes from `expected_tensors`), of
    the checkpoint itself or of `build` made from it. Headers are estimated for shards of
    `SHARD_BYTES`.

    The vision tower (from `vision_config`, if present) is reported under
    `not_loaded["vision"]`. MTP layers are not modelled (none in the shipped config).

    Raises:
        ConfigError: the config is not a Kimi K3/K3.1 config (from `ModelArgs.from_config`).
        ValueError: a build whose group size does not divide an expert's input dimension.
    """
    args = ModelArgs.from_config(dict(config), source)
    tensors = apply_build(expected_tensors(args, config.get("vision_config")), args, build)
    sizes = {k: _prod(shape) * DTYPE_BYTES[dt] for k, (dt, shape) in tensors.items()}
    total = sum(sizes.values())
    shards = max(1, -(-total // SHARD_BYTES))
    header = header_bytes(tensors, SHARD_BYTES) + (shards - 1) * header_bytes({}, SHARD_BYTES)
    return _assemble(args, sizes, _act_bytes(config), f"config: {source}", notes,
                     header=header, build=build)


# -- from a checkpoint's headers ------------------------------------------------------

def model_bytes_from_checkpoint(folder: Path, build: Optional[BuildSpec] = None) -> ModelBytes:
    """Per-layer bytes of a local checkpoint from its config and shard headers, or of
    `build` made from it (each output shard holds what its source shard held, as the
    writer does; its header is estimated).

    Sizes are the real on-disk tensor sizes (data_offsets) of every tensor listed in
    `model.safetensors.index.json` (or of `model.safetensors` when there is no index).
    Tensor data is never read.

    Raises:
        FileNotFoundError: no config.json; CheckpointError: missing shard, a tensor of the
            index absent from its shard, a bad header, or a layer with no tensors.
    """
    folder = Path(folder)
    config = read_config(folder)
    args = ModelArgs.from_config(config, str(folder / "config.json"))
    wmap = _weight_map(folder)
    by_shard: Dict[str, List[str]] = {}
    for name, shard in wmap.items():
        by_shard.setdefault(shard, []).append(name)
    sizes: Dict[str, int] = {}
    head_total = 0
    for shard in sorted(by_shard):
        path = folder / shard
        if not path.exists():
            raise CheckpointError(f"{folder / INDEX_FILE}: shard {shard} is missing")
        header = read_header(path)
        tensors: Tensors = {}
        for name in by_shard[shard]:
            if name not in header:
                raise CheckpointError(f"{path}: tensor {name!r} listed in the index is not in the shard")
            tensors[name] = (header[name].dtype, header[name].shape)
        if build is None:
            shard_sizes = {n: header[n].nbytes for n in tensors}
            with open(path, "rb") as f:
                head_total += 8 + int.from_bytes(f.read(8), "little")
        else:
            built = apply_build(tensors, args, build)
            shard_sizes = {n: _prod(shp) * DTYPE_BYTES[dt] for n, (dt, shp) in built.items()}
            head_total += header_bytes(built, sum(shard_sizes.values())) if built else 0
        sizes.update(shard_sizes)
    return _assemble(args, sizes, _act_bytes(config), f"headers: {folder}",
                     origin=f"tensors in {INDEX_FILE}", header=head_total, build=build)


# -- resolving --model ----------------------------------------------------------------

def official_config(model_id: str = DEFAULT_MODEL_ID) -> Optional[Path]:
    """The shipped config.json for a hub id (matched on its repo name, any case), or None."""
    name = model_id.rstrip("/").split("/")[-1].lower()
    if OFFICIAL_DIR.is_dir():
        for d in sorted(OFFICIAL_DIR.iterdir()):
            if d.name.lower() == name and (d / "config.json").exists():
                return d / "config.json"
    return None


def _hf_cached_file(model_id: str, filename: str) -> Optional[Path]:
    """A file of `model_id` already in the local Hugging Face cache (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None
    try:
        found = try_to_load_from_cache(model_id, filename)
    except Exception:  # an id that is not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def model_bytes(model: str, build: Optional[BuildSpec] = None) -> ModelBytes:
    """Per-layer bytes for `--model` (or for `build` made from it): a local folder, else a
    hub id resolved offline.

    Order: a local folder (real header sizes); a path-like name that is not a folder
    is an error (`kimi_mlx.checkpoint.hub.looks_local`: the same rule as generate); a hub id whose index and shards are all
    in the local Hugging Face cache (header sizes); its cached config.json (computed
    sizes); the shipped config of the same repo name; otherwise the shipped
    Kimi-K3.1-Pro config, with a note saying so. Nothing is downloaded.

    Raises:
        CheckpointError, ConfigError, FileNotFoundError: as the readers above.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return model_bytes_from_checkpoint(path, build)
    if looks_local(model) or path.exists():
        raise FileNotFoundError(missing_folder(model, "checkpoint folder"))
    index = _hf_cached_file(model, INDEX_FILE)
    if index is not None:
        try:
            return model_bytes_from_checkpoint(index.parent, build)
        except (CheckpointError, FileNotFoundError):
            pass  # partial download: fall back to the config
    cached_config = _hf_cached_file(model, "config.json")
    if cached_config is not None:
        config = json.loads(cached_config.read_text())
        return model_bytes_from_config(
            config, str(cached_config),
            (f"{model}: shards not all in the local cache; sizes computed from its config",),
            build)
    shipped = official_config(model)
    notes: Tuple[str, ...] = ()
    if shipped is None:
        shipped = official_config(DEFAULT_MODEL_ID)
        notes = (f"{model}: not a local folder and not in the local cache; sizes are those "
                 f"of the shipped {DEFAULT_MODEL_ID} config",)
    config = json.loads(shipped.read_text())
    return model_bytes_from_config(config, str(shipped), notes, build)
