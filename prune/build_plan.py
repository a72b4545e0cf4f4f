"""What a pruned or converted build will hold, before a byte is written: the source's
config and index read (`source_args`), the new config (`pruned_config`), and every output
tensor planned (`plan_checkpoint` -> `CheckpointPlan`): kept experts renamed in their old
order, router rows sliced, merged experts computed, quantized weights sized from their
shapes, MTP layers with routed experts dropped. `prune.writer` writes the plan; its module
doc describes the build's layout.
"""

from __future__ import annotations

import copy
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from kimi_mlx.model.config import ConfigError, ModelArgs, read_config
from kimi_mlx.checkpoint.shards import DTYPE_BYTES, INDEX_FILE, CheckpointError, read_header, weight_map
from kimi_mlx.model.tensor_map import kind, quantizable

from kimi_mlx.prune.quantize import QuantSpec, expert_outputs, quantize_weight, requantize_mxfp4, trunk_outputs

COPY_CHUNK = 16 << 20  # bytes per read when copying tensor data
EXPERT_RE = re.compile(
    r"^(?P<moe>(?:language_model\.)?model\.layers\.(?P<layer>\d+)\.block_sparse_moe)"
    r"\.experts\.(?P<e>\d+)\.(?P<rest>.+)$"
)
ROUTER_RE = re.compile(
    r"^(?:language_model\.)?model\.layers\.(?P<layer>\d+)\.block_sparse_moe"
    r"\.gate\.(?:weight|e_score_correction_bias)$"
)
NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_token", "num_experts_per_tok")


class PruneError(Exception):
    """A prune that cannot proceed; the message names the file, key or flag and why."""


@dataclass
class OutTensor:
    """A tensor of the output: its name, safetensors dtype and shape, and either the
    absolute byte ranges [start, end) of the source shard that make up its data, in
    order, or `make`, a function computing its bytes (quantization; `size` bytes)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    ranges: List[Tuple[int, int]]
    make: Optional[Callable[[], bytes]] = None
    size: int = 0

    @property
    def nbytes(self) -> int:
        return self.size if self.make is not None else sum(b - a for a, b in self.ranges)


class _Shared:
    """One computation feeding several output tensors (a quantized weight's weight,
    scales and biases): run on first use, dropped when every part has been taken."""

    def __init__(self, fn: Callable[[], Tuple[bytes, ...]]):
        self.fn = fn
        self.value: Optional[Tuple[bytes, ...]] = None
        self.taken = 0

    def part(self, i: int) -> Callable[[], bytes]:
        def get() -> bytes:
            if self.value is None:
                self.value = self.fn()
            out = self.value[i]
            self.taken += 1
            if self.taken == len(self.value):
                self.value = None
            return out
        return get


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise PruneError(f"{path}: ends early at byte {start + len(data)} (expected {end})")
    return data


@dataclass
class CheckpointPlan:
    """What `write_checkpoint` will write.

    Attributes:
        src: source folder; config: the new config.json contents.
        shards: {file name: (source shard path, [OutTensor], __metadata__)}.
        indexed: whether the source has a `model.safetensors.index.json`.
        index_extra: other top-level keys of the source index (kept).
        copies: other source files and folders to copy unchanged.
        n_keep: experts per layer after pruning; num_experts: before.
        bytes_in, bytes_out: tensor bytes of source and output.
        notes: things the model card should say (dropped MTP layers, ...).
        quant: the quantization applied (None: bytes copied).
        kept_dtype: trunk linear weights left unquantized (in-dim not a multiple of the
            group size), by name.
    """

    src: Path
    config: dict
    shards: Dict[str, Tuple[Path, List[OutTensor], Optional[dict]]]
    indexed: bool
    index_extra: dict
    copies: List[Path]
    n_keep: int
    num_experts: int
    bytes_in: int
    bytes_out: int
    notes: List[str] = field(default_factory=list)
    quant: Optional[QuantSpec] = None
    kept_dtype: List[str] = field(default_factory=list)
    merge_errors: Dict[str, float] = field(default_factory=dict)

    @property
    def files_bytes(self) -> int:
        """Bytes of the shard files to be written (tensor data + headers)."""
        total = 0
        for _, tensors, meta in self.shards.values():
            if tensors:
                total += 8 + len(_header_bytes(tensors, meta)) + sum(t.nbytes for t in tensors)
        return total

    @property
    def copy_bytes(self) -> int:
        total = 0
        for p in self.copies:
            if p.is_dir():
                total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            else:
                total += p.stat().st_size
        return total


def source_args(src: Path) -> Tuple[dict, ModelArgs, Dict[str, str]]:
    """(config, ModelArgs, weight map) of a checkpoint we can prune.

    Raises:
        PruneError: not a folder, no config.json, unknown model type, no index/shards,
            not a MoE model, or routed experts not in the official per-expert layout.
    """
    src = Path(src)
    if not src.is_dir():
        from kimi_mlx.checkpoint.hub import missing_folder

        raise PruneError(missing_folder(src, "checkpoint folder"))
    try:
        config = read_config(src)
        args = ModelArgs.from_config(config, str(src / "config.json"))
        wm = weight_map(src)
    except (FileNotFoundError, ConfigError, CheckpointError) as e:
        raise PruneError(f"{src}: not a Kimi K3.1 checkpoint in the official layout: {e}") from None
    if args.num_experts < 1 or not any(args.is_moe(i) for i in range(args.num_hidden_layers)):
        raise PruneError(f"{src}: the model has no routed-expert (MoE) layers to prune")
    if args.num_experts_per_layer:
        raise PruneError(f"{src}: its layers already hold different numbers of experts "
                         "(num_experts_per_layer, a `--budget spread` build); prune or convert "
                         "the original checkpoint instead")
    if not any(EXPERT_RE.match(n) for n in wm):
        stacked = any(".switch_mlp." in n for n in wm)
        raise PruneError(
            f"{src}: no per-expert tensors `...block_sparse_moe.experts.E.w1.weight_packed`"
            + (" (its experts are stacked `switch_mlp` tensors, an mlx-lm conversion); prune "
               "needs the official layout" if stacked else "; not the official K3.1 layout"))
    return config, args, wm


def pruned_config(config: dict, n_keep: int,
                  per_layer: Optional[Mapping[int, int]] = None) -> Tuple[dict, List[str]]:
    """The config with `n_keep` routed experts (per_layer: {layer: count} when layers
    differ; n_keep is then their maximum); returns (new config, notes)."""
    new = copy.deepcopy(config)
    notes = []
    text = new.get("text_config") if isinstance(new.get("text_config"), dict) else new
    if per_layer and len(set(per_layer.values())) > 1:
        text["num_experts_per_layer"] = {str(l): int(n) for l, n in sorted(per_layer.items())}
    else:
        text.pop("num_experts_per_layer", None)
    for d in (new, new.get("text_config")):
        if not isinstance(d, dict):
            continue
        for k in NUM_EXPERTS_KEYS:
            if k in d:
                d[k] = n_keep
        for k in TOP_K_KEYS:
            if k in d and d[k] > n_keep:
                d[k] = n_keep
        if d.get("num_expert_group", 1) > 1:
            notes.append(f"num_expert_group {d['num_expert_group']} -> 1 (and topk_group -> 1): "
                         "experts were pruned per layer, not per group")
            d["num_expert_group"] = 1
            if "topk_group" in d:
                d["topk_group"] = 1
    return new, notes


def _metadata(path: Path) -> Optional[dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__")


def _rows(start: int, end: int, n_rows: int, keep: Sequence[int]) -> List[Tuple[int, int]]:
    """Byte ranges of rows `keep` (sorted) of a row-major tensor at [start, end)."""
    row = (end - start) // n_rows
    out: List[Tuple[int, int]] = []
    for j in keep:
        a = start + j * row
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + row)
        else:
            out.append((a, a + row))
    return out


def plan_checkpoint(src, kept: Mapping[int, Sequence[int]], n_keep: int,
                    quant: Optional[QuantSpec] = None,
                    router_rows: Optional[Mapping[int, Mapping[str, "np.ndarray"]]] = None,
                    merges: Optional[Mapping[int, Mapping[int, Sequence[Tuple[int, float]]]]] = None
                    ) -> CheckpointPlan:
    """Work out the output tensors, shards, config and copies (reads headers only).

    Args:
        src: source checkpoint folder (official layout).
        kept: {MoE layer: sorted old expert ids to keep}, every MoE layer, n_keep each
            (or, with n_keep None, each layer its own count: `num_experts_per_layer`).
        n_keep: experts per layer after pruning; None for per-layer counts.
        quant: trunk / expert quantization (None or inactive: bytes copied).
        router_rows: {MoE layer: {"weight": [n, hidden], "e_score_correction_bias": [n]}}
            new values of the kept experts' router tensors (`refit`), written in the
            source tensor's dtype instead of the sliced source rows; None: sliced rows.
        merges: {MoE layer: {kept id: [(expert id, weight), ...]}} (`merge.LayerMerge
            .groups`, the kept expert first): each listed kept expert is written as the
            frequency-weighted merge of its group (`merge.merge_group`), requantized to its
            source format (MXFP4, or `quant.expert_bits` affine); the relative
            requantization error of each merged projection lands in the plan's
            `merge_errors` {"layer.kept.wN": error} as it is written.
    Raises:
        PruneError: a source problem (see `source_args`), a MoE layer without an entry
            in `kept`, a layer whose experts are not exactly 0..num_experts-1, a router
            tensor whose first dimension is not num_experts, or a quantization the source
            cannot take (trunk or experts already quantized, bad group size).
    """
    src = Path(src)
    config, args, wm = source_args(src)
    quant = quant if quant is not None and quant.active else None
    if quant is not None:
        _check_quantizable(src, wm, quant)
    E = args.num_experts
    per_layer = {layer: len(ids) for layer, ids in kept.items()}
    uniform = n_keep is not None
    if n_keep is None:
        if not per_layer:
            raise PruneError("no MoE layer selection given")
        if min(per_layer.values()) < args.num_experts_per_token:
            raise PruneError(f"per-layer expert counts {per_layer}: every layer needs at least "
                             f"num_experts_per_token = {args.num_experts_per_token}")
        n_keep = max(per_layer.values())
    for layer, ids in kept.items():
        want = n_keep if uniform else per_layer[layer]
        if (len(ids) != want or list(ids) != sorted(set(ids))
                or not all(0 <= j < E for j in ids)):
            raise PruneError(f"layer {layer}: kept experts must be {want} sorted distinct ids "
                             f"in [0, {E})")
    renumber = {layer: {old: new for new, old in enumerate(ids)} for layer, ids in kept.items()}
    mtp_has_experts = any(kind(n, args) == "mtp" and ".experts." in n for n in wm)
    new_config, notes = pruned_config(config, n_keep, per_layer)
    if quant is not None:
        new_config["quantization"] = quant.config_block()
        new_config["quantization_config"] = quant.config_block()
    if mtp_has_experts:
        notes.append("MTP layers with routed experts were dropped (calibration does not reach "
                     "them, so their experts cannot be ranked)")
        for d in (new_config, new_config.get("text_config")):
            if isinstance(d, dict) and "num_nextn_predict_layers" in d:
                d["num_nextn_predict_layers"] = 0

    shards: Dict[str, Tuple[Path, List[OutTensor], Optional[dict]]] = {}
    seen: Dict[int, set] = {}
    bytes_in = bytes_out = 0
    headers = {}
    for shard in sorted(set(wm.values())):
        try:
            headers[shard] = read_header(src / shard)
        except CheckpointError as e:
            raise PruneError(str(e)) from None
    located = {name: (src / shard, info) for shard, h in headers.items() for name, info in h.items()}
    kept_dtype: List[str] = []
    merge_errors: Dict[str, float] = {}
    groups: Dict[Tuple[int, int], _MergedExpert] = {}
    for shard, header in headers.items():
        path = src / shard
        out: List[OutTensor] = []
        for name, info in sorted(header.items(), key=lambda kv: kv[1].start):
            bytes_in += info.end - info.start
            t = _plan_tensor(name, info, args, kept, renumber, seen, mtp_has_experts, E,
                             router_rows)
            if t is None:
                continue
            m = EXPERT_RE.match(name)
            group = (merges or {}).get(int(m["layer"]), {}).get(int(m["e"])) if m else None
            if group and len(group) > 1 and kind(name, args) == "text":
                key = (int(m["layer"]), int(m["e"]))
                if key not in groups:
                    groups[key] = _MergedExpert(m["moe"], key, group, located, quant,
                                                merge_errors)
                parts = groups[key].outputs(t, m["rest"], info)
            else:
                parts = ([t] if quant is None or kind(name, args) != "text"
                         else _quantized(t, name, path, info, quant, located, kept_dtype))
            out.extend(parts)
            bytes_out += sum(p.nbytes for p in parts)
        shards[shard] = (path, out, _metadata(path))
    for layer in range(args.num_hidden_layers):
        if layer in seen and layer not in kept:
            raise PruneError(f"layer {layer} has routed experts but no selection was made for it")
        if layer in seen and seen[layer] != set(range(E)):
            missing = sorted(set(range(E)) - seen[layer])[:8]
            raise PruneError(f"{src}: layer {layer} does not hold experts 0..{E - 1} "
                             f"(num_experts); missing {missing}")
    skip = {INDEX_FILE, "config.json", "README.md", *wm.values()}
    copies = sorted(p for p in src.iterdir() if p.name not in skip and not p.name.startswith("."))
    index_extra = {}
    if (src / INDEX_FILE).exists():
        index_extra = {k: v for k, v in json.loads((src / INDEX_FILE).read_text()).items()
                       if k != "weight_map"}
    return CheckpointPlan(src, new_config, shards, (src / INDEX_FILE).exists(), index_extra,
                          copies, n_keep, E, bytes_in, bytes_out, notes, quant, kept_dtype,
                          merge_errors)


class _MergedExpert:
    """One kept expert written as the merge of its group (`plan_checkpoint(merges=...)`):
    computed on the first request of any of its output tensors, dropped once all were
    taken. Memory: `merge.merge_group`'s (three experts in float32)."""

    def __init__(self, moe: str, key: Tuple[int, int], group, located, quant, errors):
        self.moe, self.key, self.group = moe, key, list(group)
        self.located, self.errors = located, errors
        self.bits = quant.expert_bits if quant is not None else None
        self.group_size = quant.expert_group_size if quant is not None else None
        self.value: Optional[Dict[str, bytes]] = None
        self.planned = 0
        self.taken = 0

    def _source(self, e: int, w: str):
        """(w [out, in] float32, format): format "mxfp4" or the float safetensors dtype."""
        import numpy as np

        from kimi_mlx.prune.merge import dequantize_mxfp4
        from kimi_mlx.prune.quantize import from_bytes

        base = f"{self.moe}.experts.{e}.{w}"
        if base + ".weight_packed" in self.located:
            (pp, pi), (sp, si) = (self.located.get(base + ".weight_packed"),
                                  self.located.get(base + ".weight_scale", (None, None)))
            if si is None:
                raise PruneError(f"{pp}: {base}.weight_packed has no {base}.weight_scale")
            packed = np.frombuffer(_read(pp, pi.start, pi.end), np.uint8).reshape(pi.shape)
            scale = np.frombuffer(_read(sp, si.start, si.end), np.uint8).reshape(si.shape)
            return dequantize_mxfp4(packed, scale), "mxfp4"
        if base + ".weight" in self.located:
            p, i = self.located[base + ".weight"]
            import mlx.core as mx

            a = from_bytes(_read(p, i.start, i.end), i.dtype, i.shape).astype(mx.float32)
            return np.array(a), i.dtype
        raise PruneError(f"--merge: no {base}.weight_packed or {base}.weight in the checkpoint")

    def _compute(self) -> Dict[str, bytes]:
        import mlx.core as mx

        from kimi_mlx.prune.merge import PROJ, merge_group, quantize_affine, quantize_mxfp4, rel_error
        from kimi_mlx.prune.quantize import _RAW, to_bytes

        fmt: Dict[str, str] = {}

        class _Lazy:  # experts loaded one at a time by merge_group
            def __len__(s):
                return len(self.group)

            def __getitem__(s, j):
                e = self.group[j][0]
                out = []
                for w in PROJ:
                    arr, f = self._source(e, w)
                    fmt.setdefault(w, f)
                    out.append(arr)
                return tuple(out)

        try:
            merged = merge_group(_Lazy(), [wt for _, wt in self.group])
        except ValueError as e:
            raise PruneError(f"layer {self.key[0]} expert {self.key[1]}: {e}") from None
        out: Dict[str, bytes] = {}
        layer, kept = self.key
        for w, arr in zip(PROJ, merged):
            if fmt[w] == "mxfp4" and self.bits is None:
                packed, scale, err = quantize_mxfp4(arr)
                out[f"{w}.weight_packed"], out[f"{w}.weight_scale"] = packed.tobytes(), scale.tobytes()
            elif fmt[w] == "mxfp4":
                q, sc, bi, err = quantize_affine(arr, self.bits, self.group_size)
                out[f"{w}:weight"], out[f"{w}:scales"], out[f"{w}:biases"] = (
                    to_bytes(q), to_bytes(sc), to_bytes(bi))
            else:
                cast = mx.array(arr).astype(_RAW[fmt[w]][1])
                err = rel_error(arr, _np_array(cast))
                out[f"{w}.weight"] = to_bytes(cast)
            self.errors[f"{layer}.{kept}.{w}"] = err
        return out

    def part(self, key: str) -> Callable[[], bytes]:
        self.planned += 1

        def get() -> bytes:
            if self.value is None:
                self.value = self._compute()
            if key not in self.value:
                raise PruneError(f"--merge: layer {self.key[0]} expert {self.key[1]}: no "
                                 f"merged output {key!r}")
            data = self.value[key]
            self.taken += 1
            if self.taken == self.planned:
                self.value = None
            return data
        return get

    def outputs(self, t: OutTensor, rest: str, info) -> List[OutTensor]:
        """The output tensor(s) that replace source tensor `rest` (e.g. "w1.weight_packed")
        of this kept expert (`t`: its planned, renumbered copy)."""
        w, _, field_ = rest.partition(".")
        if field_ == "weight_scale" and self.bits is not None:
            return []  # folded into the affine outputs of weight_packed
        if field_ == "weight_packed" and self.bits is not None:
            prefix = t.name[: -len(".weight_packed")]
            try:
                outs = expert_outputs(prefix, info.shape, self.bits, self.group_size)
            except ValueError as e:
                raise PruneError(str(e)) from None
            return [OutTensor(n, dt, shp, [], self.part(f"{w}:{n[len(prefix) + 1:]}"),
                              _size(dt, shp)) for n, dt, shp in outs]
        if field_ not in ("weight_packed", "weight_scale", "weight"):
            raise PruneError(f"--merge: cannot merge {t.name} (only w1/w2/w3 weights)")
        return [OutTensor(t.name, info.dtype, info.shape, [], self.part(rest),
                          _size(info.dtype, info.shape))]


def _np_array(a):
    import mlx.core as mx
    import numpy as np

    return np.array(a.astype(mx.float32))


def _check_quantizable(src: Path, wm: Mapping[str, str], quant: QuantSpec) -> None:
    """Refuse a source that is already (partly) quantized where `quant` would quantize."""
    for name in wm:
        if EXPERT_RE.match(name):
            if quant.expert_bits is not None and not name.endswith(("weight_packed", "weight_scale")):
                raise PruneError(f"{src}: routed experts are not MXFP4 `weight_packed` / "
                                 f"`weight_scale` (found {name}); --expert-bits requantizes "
                                 "the official MXFP4 experts only")
        elif quant.bits is not None and name.endswith((".scales", ".biases")):
            raise PruneError(f"{src}: the trunk is already quantized (found {name}); convert "
                             "from the BF16 source instead")


def _quantized(t: OutTensor, name: str, path: Path, info, quant: QuantSpec, located,
               kept_dtype: List[str]) -> List[OutTensor]:
    """The output tensor(s) for planned tensor `t` (source `name`, read from `path` at
    `info`) under `quant`; `located` finds any source tensor's (shard, header entry)."""
    if EXPERT_RE.match(t.name):
        if quant.expert_bits is None or not name.endswith((".weight_packed", ".weight_scale")):
            return [t]
        if name.endswith(".weight_scale"):
            return []  # folded into the outputs of its weight_packed
        scale_name = name[: -len(".weight_packed")] + ".weight_scale"
        if scale_name not in located:
            raise PruneError(f"{path}: {name} has no {scale_name} in the checkpoint")
        scale_path, scale_info = located[scale_name]
        bits, group = quant.expert_bits, quant.expert_group_size
        try:
            outs = expert_outputs(t.name[: -len(".weight_packed")], info.shape, bits, group)
        except ValueError as e:
            raise PruneError(str(e)) from None
        shared = _Shared(lambda: requantize_mxfp4(
            _read(path, info.start, info.end), _read(scale_path, scale_info.start, scale_info.end),
            info.shape, bits, group))
        return [OutTensor(n, dt, shp, [], shared.part(k), _size(dt, shp))
                for k, (n, dt, shp) in enumerate(outs)]
    if quant.bits is None or not quantizable(t.name):
        return [t]
    outs = trunk_outputs(t.name, t.dtype, t.shape, quant.bits, quant.group_size)
    if outs is None:
        kept_dtype.append(t.name)
        return [t]
    bits, group, (a, b) = quant.bits, quant.group_size, t.ranges[0]
    shared = _Shared(lambda: quantize_weight(_read(path, a, b), t.dtype, t.shape, bits, group))
    return [OutTensor(n, dt, shp, [], shared.part(k), _size(dt, shp))
            for k, (n, dt, shp) in enumerate(outs)]


def _size(dtype: str, shape) -> int:
    n = DTYPE_BYTES[dtype]
    for s in shape:
        n *= int(s)
    return n


def _router_override(name: str, dtype: str, shape, value) -> OutTensor:
    """A router tensor computed from new values (refit), cast to the source dtype."""
    import mlx.core as mx
    import numpy as np

    from kimi_mlx.prune.quantize import _RAW, to_bytes

    arr = np.asarray(value, dtype=np.float32)
    if tuple(arr.shape) != tuple(shape):
        raise PruneError(f"{name}: refit values have shape {list(arr.shape)}, expected "
                         f"{list(shape)}")
    if dtype not in _RAW:
        raise PruneError(f"{name}: cannot write refit values as {dtype} (BF16, F16, F32 only)")
    mx_dtype = _RAW[dtype][1]
    return OutTensor(name, dtype, tuple(shape), [],
                     lambda: to_bytes(mx.array(arr).astype(mx_dtype)), _size(dtype, shape))


def _plan_tensor(name, info, args, kept, renumber, seen, drop_mtp, E,
                 router_rows=None) -> Optional[OutTensor]:
    if drop_mtp and kind(name, args) == "mtp":
        return None
    m = EXPERT_RE.match(name)
    if m and kind(name, args) == "text":
        layer, e = int(m["layer"]), int(m["e"])
        seen.setdefault(layer, set()).add(e)
        if layer not in kept:
            return OutTensor(name, info.dtype, info.shape, [(info.start, info.end)])
        new = renumber[layer].get(e)
        if new is None:
            return None
        return OutTensor(f"{m['moe']}.experts.{new}.{m['rest']}", info.dtype, info.shape,
                         [(info.start, info.end)])
    r = ROUTER_RE.match(name)
    if r and int(r["layer"]) in kept:
        if not info.shape or info.shape[0] != E:
            raise PruneError(f"{name}: expected first dimension {E} (num_experts), got "
                             f"{list(info.shape)}")
        ids = kept[int(r["layer"])]
        shape = (len(ids), *info.shape[1:])
        new = (router_rows or {}).get(int(r["layer"]), {}).get(name.rsplit(".", 1)[1])
        if new is not None:
            return _router_override(name, info.dtype, shape, new)
        return OutTensor(name, info.dtype, shape, _rows(info.start, info.end, E, ids))
    return OutTensor(name, info.dtype, info.shape, [(info.start, info.end)])


def _header_bytes(tensors: List[OutTensor], metadata: Optional[dict]) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
