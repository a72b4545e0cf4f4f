"""Load one tensor-parallel rank's slices of a checkpoint, reading only those bytes.

`mx.load` is lazy, but evaluating a slice of a lazily loaded tensor reads the whole
tensor (checked on MLX 0.32.4: a 10-row slice of a 64 MB tensor read 64 MB). So the
slices are read here with `os.pread`: one read for a slice of a tensor's first axis (rows:
an OUT split), one read per row for a slice of its last axis (columns: an IN split), and
a 4-way load reads about a quarter of the split tensors plus the replicated ones.

Which slice each rank holds comes from `kimi_mlx.model.shard.shard`, run on the model
before any tensor data is read: the model is built, given the checkpoint's quantization
from placeholder tensors of the header shapes (never evaluated), sharded, and its record
of slices (in the coordinates of the whole module parameter) is mapped back onto the
checkpoint tensors (`tensor_map`: stacked experts, the uint32 view of MXFP4 bytes, the
padded A_log).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.checkpoint.loader import _check_model_type, check_tensors, quantize_like
from kimi_mlx.checkpoint.shards import CheckpointError, TensorInfo, read_header, weight_map
from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.model.shard import shard
from kimi_mlx.model.tensor_map import (EXPERT_FIELD, EXPERT_PROJ, TensorError, canonical,
                                       in_range, sanitize_weights)

# safetensors dtype -> (numpy dtype read from disk, MLX dtype it becomes)
_DTYPES = {
    "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8), "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16), "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16), "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32), "F32": (np.float32, mx.float32),
    "U64": (np.uint64, mx.uint64), "I64": (np.int64, mx.int64),
    "F64": (np.float64, mx.float64),
}
_SWITCH_RE = re.compile(r"^(?P<moe>.*\.block_sparse_moe)\.switch_mlp\.(?P<proj>\w+)\.(?P<f>\w+)$")


def read_slice(fd: int, info: TensorInfo, axis: int, start: int, stop: int,
               where: str = "") -> mx.array:
    """Rows or columns [start, stop) along `axis` of one stored tensor, by `os.pread`.

    One read per contiguous run: a single one for axis 0, one per index of the axes
    before `axis` otherwise. BF16 is read as uint16 and viewed back.
    Raises CheckpointError (naming `where`) for a dtype MLX cannot hold or a short read.
    """
    if info.dtype not in _DTYPES:
        raise CheckpointError(f"{where}: dtype {info.dtype} cannot be read into MLX")
    np_dtype, mx_dtype = _DTYPES[info.dtype]
    shape = info.shape
    axis = axis % len(shape) if shape else 0
    item = np.dtype(np_dtype).itemsize
    if not shape:
        outer, n, inner = 1, 1, 1
        start, stop = 0, 1
    else:
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        n = shape[axis]
        inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    run = (stop - start) * inner * item
    buf = bytearray(outer * run)
    view = memoryview(buf)
    for i in range(outer):
        off = info.start + ((i * n + start) * inner) * item
        got = os.preadv(fd, [view[i * run:(i + 1) * run]], off)
        if got != run:
            raise CheckpointError(f"{where}: short read ({got} of {run} bytes at {off})")
    out_shape = list(shape)
    if shape:
        out_shape[axis] = stop - start
    arr = np.frombuffer(buf, dtype=np_dtype).reshape(out_shape)
    a = mx.array(arr)
    return a.view(mx_dtype) if info.dtype == "BF16" else a


def load_sharded(path, group, lm_head: Optional[bool] = None,
                 activation_dtype: Optional[mx.Dtype] = None, start: int = 0,
                 end: Optional[int] = None):
    """This rank's tensor-parallel model, reading only its slices of the checkpoint.

    Args:
        path: local checkpoint folder (official layout, or a kimi-mlx build).
        group: the `mx.distributed.Group` (its size and rank choose the slices).
        lm_head: split lm_head by vocabulary (see `shard`).
        activation_dtype: as `loader.load_model` (float32 on the CPU backend).
        start, end: a layer range (a pipeline stage that is also split; default all).
    Returns:
        (the sharded model, evaluated; {"bytes": tensor bytes read, "reads": pread calls}).
    Raises:
        CheckpointError / ConfigError / ShardError: as `load_model`, plus a model that
            does not split across the group.
    """
    from kimi_mlx.model.model import Model

    model_dir = Path(path)
    config = read_config(model_dir)
    args = ModelArgs.from_config(config, str(model_dir / "config.json"))
    end = args.num_hidden_layers if end is None else end
    wm = weight_map(model_dir)
    _check_model_type(config, wm, model_dir)
    wanted = {canonical(n): s for n, s in wm.items() if in_range(n, args, start, end)}
    headers = {s: read_header(model_dir / s) for s in sorted(set(wanted.values()))}
    infos: Dict[str, TensorInfo] = {}
    for name, s in wm.items():
        if canonical(name) in wanted:
            if name not in headers[s]:
                raise CheckpointError(f"{model_dir / s}: tensor {name} is listed in the index "
                                      "but not in the shard")
            infos[canonical(name)] = headers[s][name]
    placeholders = {n: mx.zeros(i.shape, _DTYPES[i.dtype][1]) for n, i in infos.items()
                    if i.dtype in _DTYPES}
    try:
        full = sanitize_weights(placeholders, args, start, end)
    except TensorError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None

    model = Model(args, start, end)
    quantize_like(model, full, args.quantization, model_dir)
    rec = shard(model, group, lm_head=lm_head)

    fds: Dict[str, int] = {}
    report = {"bytes": 0, "reads": 0}

    def read(name: str, axis: int, a: int, b: int) -> mx.array:
        shard_file = wanted[name]
        if shard_file not in fds:
            fds[shard_file] = os.open(model_dir / shard_file, os.O_RDONLY)
        info = infos[name]
        arr = read_slice(fds[shard_file], info, axis, a, b, f"{model_dir / shard_file}: {name}")
        outer = int(np.prod(info.shape[:axis % max(1, len(info.shape))], dtype=np.int64))
        report["bytes"] += arr.nbytes
        report["reads"] += max(1, outer)
        return arr

    weights: Dict[str, mx.array] = {}
    try:
        for path_, param in tree_flatten(model.parameters()):
            ref = full[path_]
            m = _SWITCH_RE.match(path_)
            if path_ in rec:
                axis, a, b = rec[path_]
            elif m:  # whole experts: their first axis in full
                axis, a, b = 1, 0, ref.shape[1]
            else:  # whole (A_log: only the heads used, not the padding)
                axis, a, b = 0, 0, ref.shape[0] if ref.ndim else 1
            if m:  # stacked experts: per-expert tensors, axis - 1, uint32 view of bytes
                w = {v: k for k, v in EXPERT_PROJ.items()}[m["proj"]]
                field = {v: k for k, v in EXPERT_FIELD.items()}.get(m["f"], m["f"])
                names = [f"{m['moe']}.experts.{e}.{w}.{field}" for e in range(args.num_experts)]
                if names[0] not in infos:
                    field = m["f"]  # experts requantized to MLX affine keep MLX's names
                    names = [f"{m['moe']}.experts.{e}.{w}.{field}" for e in range(args.num_experts)]
                axis = axis % ref.ndim - 1
                disk = infos[names[0]]
                scale = 1
                if axis == ref.ndim - 2:  # the last axis: param columns -> stored columns
                    scale = disk.shape[-1] // ref.shape[-1]
                parts = [read(n, axis, a * scale, b * scale) for n in names]
                weights[path_] = mx.stack(parts).view(ref.dtype)
            else:
                weights[path_] = read(path_, axis, a, b)
    finally:
        for fd in fds.values():
            os.close(fd)
    where = {n: wanted[n] for n in infos}
    check_tensors(model, weights, args, where, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if activation_dtype is None and mx.default_device() == mx.cpu:
        activation_dtype = mx.float32
    model.activation_dtype = activation_dtype
    mx.eval(model.parameters())
    return model, report
