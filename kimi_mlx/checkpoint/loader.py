"""Load a Kimi K3.1 checkpoint in the official layout, or only a layer range of it.

Reads `config.json`, `model.safetensors.index.json` and only the shards holding the
requested layers. Every shard header is checked against the index and the file size
before any tensor is read; every tensor is checked against the model's expected shape and
dtype class. MXFP4 experts go into MLX `mxfp4` quantized switch layers bit for bit (no
dequantise / requantise); all other tensors keep their stored dtype.

Errors name the file, tensor or key and what was expected (`CheckpointError`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.metal.dispatch import check_kernels
from kimi_mlx.checkpoint.shards import INDEX_FILE, CheckpointError, TensorInfo, needed_shards, read_header, weight_map
from kimi_mlx.model.tensor_map import TensorError, in_range, kind, original_names, sanitize_weights

__all__ = ["CheckpointError", "LoadReport", "TensorInfo", "byte_bar", "check_tensors",
           "eval_parameters", "load", "load_model", "load_for_generation", "needed_shards",
           "read_header", "read_tensors", "weight_map"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


@dataclass
class LoadReport:
    """What a load touched: shards opened, tensors and bytes read, tensors skipped by kind."""

    shards_opened: List[str] = field(default_factory=list)
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)


def _check_model_type(config: dict, wm: Dict[str, str], path: Path) -> None:
    text = config.get("text_config", config)
    if config.get("model_type") == "kimi_k3" and "dsa_config" not in text:
        if not any(".self_attn.indexer." in n for n in wm):
            raise CheckpointError(
                f"{path}: model_type 'kimi_k3' without dsa_config or indexer tensors is "
                "Kimi K3, not K3.1; load it with mlx-lm's kimi_k3"
            )


def open_checkpoint(path, end: Optional[int] = None):
    """The opening every loader of a whole checkpoint folder shares (`load_model`,
    `ranged.load_sharded`): read and check config.json and the index.

    Args:
        path: local checkpoint folder. end: the layer range's end (None: all layers).
    Returns:
        (model_dir Path, config dict, ModelArgs, end as an int, weight map name -> shard).
    Raises:
        FileNotFoundError / ConfigError: config.json missing or invalid (named key).
        CheckpointError: no index / shard list, or a Kimi K3 (not K3.1) checkpoint.
    """
    model_dir = Path(path)
    config = read_config(model_dir)
    args = ModelArgs.from_config(config, str(model_dir / "config.json"))
    end = args.num_hidden_layers if end is None else end
    wm = weight_map(model_dir)
    _check_model_type(config, wm, model_dir)
    return model_dir, config, args, end, wm


def load_model(
    path,
    start: int = 0,
    end: Optional[int] = None,
    lazy: bool = False,
    verbose: bool = True,
    activation_dtype: Optional[mx.Dtype] = None,
    progress: Optional[Progress] = None,
) -> Tuple[nn.Module, dict, LoadReport]:
    """Load layers [start, end) (default: all) of a checkpoint folder.

    Args:
        path: local checkpoint folder (use `hub.resolve` for hub ids).
        start, end: 0-based layer range; embedding loads only with start == 0, output
            mix + norm + lm_head only with end == num_hidden_layers.
        lazy: leave tensors unevaluated (read from disk on first use).
        verbose: print the one-line notice about skipped vision / MTP tensors.
        activation_dtype: dtype of the residual stream; default float32 on the CPU
            backend (bf16 matmuls are slow there), the embedding's dtype on a GPU.
        progress: called as (bytes done, bytes total) while the tensors are read
            (`eval_parameters`; `byte_bar` draws it); not called when `lazy`.
    Returns:
        (model, config dict, LoadReport).
    Raises:
        FileNotFoundError / ConfigError: config.json missing or invalid (named key).
        CheckpointError / TensorError: missing or truncated shard, missing, extra or
            misshapen tensor (named, with its shard and the expected shape/dtype).
    """
    from kimi_mlx.model.model import Model, default_activation_dtype

    model_dir, config, args, end, wm = open_checkpoint(path, end)

    report = LoadReport()
    wanted: Dict[str, str] = {}
    for name, shard in wm.items():
        k = kind(name, args)
        if k != "text":
            report.skipped[k] = report.skipped.get(k, 0) + 1
        elif in_range(name, args, start, end):
            wanted[name] = shard

    weights, where = read_tensors(model_dir, wanted, report)

    if verbose and report.skipped:
        when = {"vision": "loaded with the first image", "mtp": "loaded with --draft mtp"}
        parts = [f"{v} {k} tensors ({when.get(k, 'not used')})"
                 for k, v in sorted(report.skipped.items())]
        print(f"[kimi-mlx] not in the text model: {' and '.join(parts)}", file=sys.stderr)

    model = fill_module(Model(args, start, end), weights, args, start, end, where, model_dir)
    if activation_dtype is None:
        activation_dtype = default_activation_dtype()
    model.activation_dtype = activation_dtype
    # On Metal (KIMI_MLX_KERNELS=auto) each kernel is checked on the device now, at load,
    # rather than inside the first forward; elsewhere this does nothing.
    check_kernels()
    if not lazy:
        eval_parameters(model, progress)
    return model, config, report


def eval_parameters(model: nn.Module, progress: Optional[Progress] = None) -> int:
    """Read a lazily loaded model's tensors: the embedding, then layer by layer, then the
    rest (norm, output mix, lm_head), calling `progress(bytes done, bytes total)` before
    and after each part. Returns the bytes evaluated."""
    from mlx.utils import tree_flatten

    def nbytes(m) -> int:
        return sum(v.nbytes for _, v in tree_flatten(m.parameters()))

    text = model.text
    parts = ([text.embed_tokens] if text.is_first else []) + list(text.local_layers)
    total, done = nbytes(model), 0
    if progress:
        progress(0, total)
    for part in parts:
        mx.eval(part.parameters())
        done += nbytes(part)
        if progress:
            progress(done, total)
    mx.eval(model.parameters())
    if progress and done < total:
        progress(total, total)
    return total


def byte_bar(desc: str, enabled: bool = True) -> Optional[Progress]:
    """A `progress` callback drawing a tqdm bar of bytes on stderr, on a terminal only;
    None when not `enabled` (`--quiet`) or when stderr is a pipe or a log file (then not
    even tqdm is touched: a cluster stage counts the bytes its load reads). The bar
    clears itself when the load completes."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                       leave=False, dynamic_ncols=True)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return update


def fill_module(module: nn.Module, weights: Dict[str, mx.array], args: ModelArgs, start: int,
                end: int, where: Dict[str, str], model_dir: Path) -> nn.Module:
    """Load checkpoint tensors of layers [start, end) into `module` (built for them), in
    eval mode: `sanitize_weights` (official names -> ours), the checkpoint's quantization
    (`quantize_like`), every tensor checked (`check_tensors`), then a strict load.
    Used for the trunk (`load_model`) and the MTP layers (`mtp.load_mtp`).

    Raises:
        CheckpointError: a tensor that cannot be mapped, or missing / extra / misshapen
            tensors (each names `model_dir`, the tensor and its shard in `where`).
    """
    try:
        sanitized = sanitize_weights(weights, args, start, end)
    except TensorError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    quantize_like(module, sanitized, args.quantization, model_dir)
    check_tensors(module, sanitized, args, where, model_dir)
    module.load_weights(list(sanitized.items()), strict=True)
    module.eval()
    return module


def read_tensors(model_dir: Path, wanted: Dict[str, str],
                 report: Optional[LoadReport] = None) -> Tuple[Dict[str, mx.array], Dict[str, str]]:
    """Read the tensors `wanted` ({checkpoint name: shard file}) from their shards, each
    shard's header checked first; returns ({name: array (lazy)}, {name: shard file}).

    Raises:
        CheckpointError: a shard missing, unreadable, or without a tensor its index names.
    """
    report = report if report is not None else LoadReport()
    weights: Dict[str, mx.array] = {}
    where: Dict[str, str] = {}
    for shard in sorted(set(wanted.values())):
        shard_path = Path(model_dir) / shard
        header = read_header(shard_path)
        names = [n for n, s in wanted.items() if s == shard]
        absent = [n for n in names if n not in header]
        if absent:
            raise CheckpointError(
                f"{shard_path}: tensor {absent[0]} is listed in {INDEX_FILE} but not in "
                f"the shard ({len(absent)} missing)"
            )
        try:
            arrays = mx.load(str(shard_path))
        except Exception as e:  # MLX raises RuntimeError/ValueError for bad files
            raise CheckpointError(f"{shard_path}: cannot read safetensors ({e})") from None
        report.shards_opened.append(shard)
        for n in names:
            weights[n] = arrays[n]
            where[n] = shard
            report.tensors_loaded += 1
            report.bytes_loaded += header[n].nbytes
        del arrays
    return weights, where


def quantize_like(model: nn.Module, weights: Dict[str, mx.array], default: Optional[dict] = None,
                  where: Path = Path(".")) -> None:
    """Turn every module that has `<path>.scales` in `weights` into its quantized form,
    with the mode, bits and group size its tensors were packed with.

    Per module, as mlx-lm's loader (`mlx_lm.utils.infer_quant_config`): uint8 scales =
    mxfp4 (4 bits, group 32: the official experts), float scales = affine with group =
    in / scales columns and bits = 32 * packed columns / in (a `convert` trunk or
    `--expert-bits` experts). So one checkpoint can mix both.
    Raises:
        CheckpointError: a module's tensors fit no MLX quantization (names it).
    """
    from mlx_lm.utils import infer_quant_config

    default = default or MXFP4

    def predicate(path, module):
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        try:
            return infer_quant_config(path, module, weights)
        except (ValueError, KeyError, ZeroDivisionError) as e:
            raise CheckpointError(f"{where}: {path}: quantized tensors of unknown layout ({e})") from None

    nn.quantize(model, group_size=default.get("group_size", 32), bits=default.get("bits", 4),
                mode=default.get("mode", "affine"), class_predicate=predicate)


def check_tensors(model, weights, args, where, model_dir: Path) -> None:
    """Every parameter of `model` is in `weights` (module paths) with its shape and dtype
    class, and nothing else is; CheckpointError names the tensor, shard and expectation."""
    expected = dict(tree_flatten(model.parameters()))

    def shard_of(key):
        for name in original_names(key, args):
            if name in where:
                return where[name]
        return "?"

    for key, ref in expected.items():
        if key not in weights:
            names = original_names(key, args)
            raise CheckpointError(
                f"{model_dir}: tensor {names[0]} is missing (expected shape "
                f"{list(ref.shape)}; not in {INDEX_FILE})"
            )
        got = weights[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{model_dir / shard_of(key)}: tensor {original_names(key, args)[0]} has "
                f"shape {list(got.shape)}, expected {list(ref.shape)}"
            )
        want_float = mx.issubdtype(ref.dtype, mx.floating)
        if want_float != mx.issubdtype(got.dtype, mx.floating) or (
            not want_float and got.dtype != ref.dtype
        ):
            raise CheckpointError(
                f"{model_dir / shard_of(key)}: tensor {original_names(key, args)[0]} has "
                f"dtype {got.dtype}, expected {'a float type' if want_float else ref.dtype}"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(
            f"{model_dir / shard_of(extra[0])}: unexpected tensor {extra[0]} "
            f"({len(extra)} unexpected; not part of a Kimi K3.1 text model with this config)"
        )


def load(path_or_repo, start: int = 0, end: Optional[int] = None, lazy: bool = False):
    """Resolve a local folder or hub id, then `load_model`; returns (model, tokenizer, config).

    Only the shards of layers [start, end) are downloaded / opened.
    """
    from kimi_mlx.checkpoint.hub import resolve
    from kimi_mlx.text.tokenizer import KimiTokenizer

    model_dir = resolve(path_or_repo, start=start, end=end)
    model, config, _ = load_model(model_dir, start, end, lazy=lazy)
    return model, KimiTokenizer.from_pretrained(model_dir), config


def load_for_generation(spec: str, progress: bool = False):
    """(model, mlx-lm TokenizerWrapper, our KimiTokenizer, config) for a checkpoint.

    `spec` is a local folder or a Hugging Face id (`hub.resolve`: only the needed files,
    HF_HUB_OFFLINE honoured); `progress`: a bar while the tensors are read, on a terminal
    only (`byte_bar`). Raises FileNotFoundError / CheckpointError naming the path."""
    from mlx_lm.utils import load_tokenizer

    from kimi_mlx.checkpoint.hub import resolve
    from kimi_mlx.text.hf_register import register_with_transformers
    from kimi_mlx.text.tokenizer import KimiTokenizer

    model_dir = resolve(spec)
    model, config, _ = load_model(model_dir, progress=byte_bar(f"loading {model_dir.name}", progress))
    kimi_tok = KimiTokenizer.from_pretrained(model_dir)
    register_with_transformers()
    wrapper = load_tokenizer(model_dir, eos_token_ids=kimi_tok.eos_token_ids)
    return model, wrapper, kimi_tok, config


def has_vision(model_dir) -> bool:
    """Whether the checkpoint at `model_dir` has a `vision_config` and vision tensors
    (`vision_tower.*` / `mm_projector.*` in its index)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if not isinstance(config.get("vision_config"), dict):
        return False
    return any(n.startswith(VISION_PREFIXES) for n in weight_map(model_dir))


VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def load_vision(model_dir, dtype: Optional[mx.Dtype] = None, lazy: bool = False):
    """Load the vision tower and projector (`vision_tower.*`, `mm_projector.*`) of a
    checkpoint: only the shards that hold them, each tensor checked for shape and dtype
    class, strict. Called only when a request has images (the text loader skips them).

    Args:
        model_dir: local checkpoint folder.
        dtype: compute dtype of the weights; default float32 on the CPU backend (bf16
            matmuls are slow there), the stored dtype (BF16 in the release) on a GPU.
        lazy: leave the weights unevaluated.
    Returns:
        `kimi_mlx.vision.tower.VisionModel`.
    Raises:
        CheckpointError: no vision_config or no vision tensors ("this checkpoint has no
            vision weights", naming the folder), or a missing / extra / misshapen tensor
            (named, with its shard).
    """
    from kimi_mlx.vision.config import VisionArgs, VisionConfigError
    from kimi_mlx.vision.tower import VisionModel

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    wm = weight_map(model_dir)
    wanted = {n: s for n, s in wm.items() if n.startswith(VISION_PREFIXES)}
    if not isinstance(config.get("vision_config"), dict) or not wanted:
        what = "no vision_config in config.json" if not isinstance(
            config.get("vision_config"), dict) else f"no vision_tower.* / mm_projector.* tensors in {INDEX_FILE}"
        raise CheckpointError(f"{model_dir}: this checkpoint has no vision weights ({what}); "
                              "it cannot take images")
    try:
        vargs = VisionArgs.from_config(config, str(model_dir / "config.json"))
    except VisionConfigError as e:
        raise CheckpointError(str(e)) from None
    weights, where = read_tensors(model_dir, wanted)
    model = VisionModel(vargs)
    expected = dict(tree_flatten(model.parameters()))
    for name, ref in expected.items():
        if name not in weights:
            raise CheckpointError(f"{model_dir}: vision tensor {name} is missing (expected shape "
                                  f"{list(ref.shape)}; not in {INDEX_FILE})")
        got = weights[name]
        if tuple(got.shape) != tuple(ref.shape) or not mx.issubdtype(got.dtype, mx.floating):
            raise CheckpointError(
                f"{model_dir / where[name]}: vision tensor {name} is {got.dtype} "
                f"{list(got.shape)}, expected a float type of shape {list(ref.shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"{model_dir / where[extra[0]]}: unexpected vision tensor {extra[0]} "
                              f"({len(extra)} unexpected for this vision_config)")
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = mx.float32
    items = [(n, w.astype(dtype) if dtype is not None else w) for n, w in weights.items()]
    model.load_weights(items, strict=True)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model
