"""Load one tensor-parallel rank's slices of a checkpoint, reading only those bytes.

`mx.load` is lazy, but evaluating a slice of a lazily loaded tensor reads the whole
tensor (checked on MLX 0.32.4: a 10-row slice of a 64 MB tensor read 64 MB). So the
slices are read here (`SliceReader`, planned by `plan_slice`): a slice of a tensor's
first axis (rows: an OUT split) is one pread; a slice of a later axis (columns: an IN
split) is one run per row, and those runs are merged into preads of up to MAX_READ
bytes when the gaps between them are small (at most WASTE of a run), or else, when
there are many, copied with one strided NumPy copy out of an mmap of the file. A 4-way
load copies about a quarter of the split tensors plus the replicated ones.

Why an mmap rather than merged preads for the wide gaps: a 2-way column slice has
gap == run, so merging reads twice the slice (4-way: 4x) through user space. Measured
with `python -m kimi_mlx.bench.ranged` (K3.1's expert and trunk shapes, 16 experts,
2 busy shared cores, cold page cache): per-row preads 129,090 calls and 2.0-3.5 s,
merged preads 103 calls reading 1.5x (2 ranks) / 2.5x (4 ranks) the slice and ~0.9 s,
the mmap copy 66 calls (the row slices' preads) reading 1.0x and 0.5-1.1 s. For the
whole model that is ~593M preads per rank before, ~330k after.

What this cannot change: a column slice of a row-major tensor whose rows are shorter
than a page (K3.1's expert down projections: 1536 B rows, 768 B per rank at 2 ranks)
touches every page of the tensor, so the storage device reads the whole tensor for
every rank whatever the reader does; only the bytes copied into the rank are its
share. A 2-way K3.1 load therefore reads ~2/3 of the routed expert bytes from disk per
Mac (w1, w3 halves + whole w2), a 4-way load ~1/2, not 1/2 and 1/4.

Which slice each rank holds comes from `kimi_mlx.model.shard.shard`, run on the model
before any tensor data is read: the model is built, given the checkpoint's quantization
from placeholder tensors of the header shapes (never evaluated), sharded, and its record
of slices (in the coordinates of the whole module parameter) is mapped back onto the
checkpoint tensors (`tensor_map`: stacked experts, the uint32 view of MXFP4 bytes, the
padded A_log).
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.checkpoint.loader import check_tensors, open_checkpoint, quantize_like
from kimi_mlx.checkpoint.shards import DTYPE_BYTES, CheckpointError, TensorInfo, _prod, read_header
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


# How a slice of a stored tensor is read. A slice is `count` runs of `run` bytes, each
# `stride` bytes after the previous (one run per index of the axes before the split axis).
HOLE_BYTES = 1 << 20
"""Largest gap (bytes) between two runs of a slice that a pread reads through and drops
rather than ending one read and starting another (also bounded by WASTE)."""
WASTE = 1 / 8
"""Most bytes read through and dropped per byte kept when runs are merged into one pread:
so a rank never preads much more than its slice."""
MAX_READ = 64 << 20
"""Largest single pread (bytes): a merged read's temporary buffer stays bounded, and
no pread nears the ~2 GiB per call that Linux and macOS transfer at most."""
MMAP_MIN_RUNS = 64
"""A slice whose gaps are too wide to read through (a column slice of a row-major
tensor: the gap is (ranks - 1) x the run) and that has at least this many runs is
copied out of an mmap of the file with one strided NumPy copy instead of one pread per
run (K3.1's expert down projections: 3584 runs per tensor, ~300M preads per rank)."""


@dataclass(frozen=True)
class SlicePlan:
    """How one slice is read: `count` runs of `run` bytes, the first at file offset
    `offset`, each `stride` bytes after the previous; `per_read` runs per pread (1: each
    run its own pread; more: merged, the gaps read and dropped; 0: copied from an mmap
    of the file, no pread)."""

    offset: int
    run: int
    stride: int
    count: int
    per_read: int

    @property
    def reads(self) -> int:
        """pread calls before splitting at MAX_READ (0 for an mmap copy)."""
        return -(-self.count // self.per_read) if self.per_read else 0

    @property
    def needed(self) -> int:
        """Bytes the slice holds."""
        return self.run * self.count

    @property
    def read_bytes(self) -> int:
        """Bytes the preads transfer, merged gaps included (0 for an mmap copy)."""
        if not self.per_read:
            return 0
        full, last = divmod(self.count, self.per_read)
        span = lambda k: (k - 1) * self.stride + self.run
        return full * span(self.per_read) + (span(last) if last else 0)


def plan_slice(info: TensorInfo, axis: int, start: int, stop: int, strategy: str = "auto",
               hole: int = HOLE_BYTES, waste: float = WASTE,
               max_read: int = MAX_READ) -> SlicePlan:
    """The reads for indices [start, stop) along `axis` (already non-negative) of a stored
    tensor.

    strategy "auto": a contiguous slice (axis 0, or every index before `axis` of size 1)
    is one run; otherwise runs are merged while the gap between them is at most
    min(`hole`, `waste` x run) bytes and a read stays within `max_read` bytes; wider
    gaps with at least MMAP_MIN_RUNS runs are copied from an mmap; the rest one pread
    per run. "row": one pread per run, never merged (the reader before coalescing);
    "merge": merged whatever the gap (reads up to `ranks` x the slice); "mmap": always
    the mmap copy. Raises ValueError for another strategy.
    """
    if strategy not in ("auto", "row", "merge", "mmap"):
        raise ValueError(f"unknown read strategy {strategy!r}")
    item = DTYPE_BYTES[info.dtype]
    shape = info.shape
    if not shape:
        return SlicePlan(info.start, item, item, 1, 1)
    outer = _prod(shape[:axis])
    inner_b = _prod(shape[axis + 1:]) * item
    run = (stop - start) * inner_b
    stride = shape[axis] * inner_b
    offset = info.start + start * inner_b
    if outer <= 1 or run == stride:
        return SlicePlan(offset, run * outer, run * outer, 1, 1)
    gap = stride - run
    if strategy == "row":
        return SlicePlan(offset, run, stride, outer, 1)
    if strategy == "mmap":
        return SlicePlan(offset, run, stride, outer, 0)
    if strategy == "merge" or gap <= min(hole, waste * run):
        per = max(1, (max_read - run) // stride + 1)
        return SlicePlan(offset, run, stride, outer, min(per, outer))
    if outer >= MMAP_MIN_RUNS:
        return SlicePlan(offset, run, stride, outer, 0)
    return SlicePlan(offset, run, stride, outer, 1)


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> int:
    """Fill `view` from file offset `offset` in preads of at most MAX_READ bytes,
    continuing after short reads. Returns the pread calls made; raises CheckpointError
    (naming `where`) at end of file."""
    calls, done = 0, 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + MAX_READ]], offset + done)
        calls += 1
        if got <= 0:
            raise CheckpointError(f"{where}: short read ({done} of {len(view)} bytes at "
                                  f"{offset}): the file ends early")
        done += got
    return calls


class SliceReader:
    """Reads slices of the tensors of one open safetensors file (`read`), and counts
    what it did in `stats`: "reads" (pread calls), "bytes" (bytes preads transferred),
    "mapped" (bytes copied out of an mmap), "needed" (bytes of the slices returned).

    `strategy` as `plan_slice`. Close it (or use it as a context manager) to unmap.
    """

    def __init__(self, fd: int, where: str = "", strategy: str = "auto"):
        self.fd, self.where, self.strategy = fd, where, strategy
        self.stats = {"reads": 0, "bytes": 0, "mapped": 0, "needed": 0}
        self._map: Optional[mmap.mmap] = None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read(self, info: TensorInfo, axis: int, start: int, stop: int,
             name: str = "") -> np.ndarray:
        """Indices [start, stop) along `axis` of the stored tensor `info`, as a NumPy
        array of the stored dtype (BF16 as uint16). Raises CheckpointError naming the
        file and `name` for a dtype MLX cannot hold, a range outside the tensor, or a
        file that ends early."""
        where = f"{self.where}: {name}" if name else self.where
        if info.dtype not in _DTYPES:
            raise CheckpointError(f"{where}: dtype {info.dtype} cannot be read into MLX")
        np_dtype = _DTYPES[info.dtype][0]
        shape = list(info.shape)
        if shape:
            axis = axis % len(shape)
            if not 0 <= start <= stop <= shape[axis]:
                raise CheckpointError(f"{where}: slice [{start}, {stop}) of axis {axis} is "
                                      f"outside its shape {tuple(shape)}")
            shape[axis] = stop - start
            if start == stop:
                return np.empty(shape, np_dtype)
        plan = plan_slice(info, axis, start, stop, self.strategy)
        out = np.empty(plan.needed, np.uint8)
        if plan.per_read == 0:
            self._copy_mapped(plan, out, where)
        elif plan.count == 1 or plan.per_read == 1:
            view = memoryview(out)
            for i in range(plan.count):
                self.stats["reads"] += _pread_into(
                    self.fd, view[i * plan.run:(i + 1) * plan.run], plan.offset + i * plan.stride,
                    where)
            self.stats["bytes"] += plan.needed
        else:
            span = (plan.per_read - 1) * plan.stride + plan.run
            buf = np.empty(span, np.uint8)
            rows = out.reshape(plan.count, plan.run)
            for i in range(0, plan.count, plan.per_read):
                k = min(plan.per_read, plan.count - i)
                length = (k - 1) * plan.stride + plan.run
                self.stats["reads"] += _pread_into(self.fd, memoryview(buf)[:length],
                                                   plan.offset + i * plan.stride, where)
                self.stats["bytes"] += length
                rows[i:i + k] = np.lib.stride_tricks.as_strided(
                    buf, (k, plan.run), (plan.stride, 1), writeable=False)
        self.stats["needed"] += plan.needed
        return out.view(np_dtype).reshape(shape)

    def _copy_mapped(self, plan: SlicePlan, out: np.ndarray, where: str) -> None:
        if self._map is None:
            self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        end = plan.offset + (plan.count - 1) * plan.stride + plan.run
        if end > len(self._map):
            raise CheckpointError(f"{where}: short read (the file ends at {len(self._map)}, "
                                  f"the tensor at {end})")
        src = np.frombuffer(self._map, np.uint8, count=end - plan.offset, offset=plan.offset)
        out.reshape(plan.count, plan.run)[:] = np.lib.stride_tricks.as_strided(
            src, (plan.count, plan.run), (plan.stride, 1), writeable=False)
        del src  # the mmap cannot close while a NumPy view of it lives
        # Drop the pages from this process (they stay in the page cache): the rank's
        # resident memory is its slices, not the files it read them from.
        page = mmap.PAGESIZE
        lo = plan.offset // page * page
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, lo, end - lo)
        self.stats["mapped"] += plan.needed


def read_slice(fd: int, info: TensorInfo, axis: int, start: int, stop: int,
               where: str = "", strategy: str = "auto") -> mx.array:
    """Indices [start, stop) along `axis` of one stored tensor as an MLX array of its
    dtype (BF16 read as uint16 and viewed back), read as `SliceReader.read` does.

    Raises CheckpointError (naming `where`) for a dtype MLX cannot hold, a range outside
    the tensor, or a short read.
    """
    with SliceReader(fd, where, strategy) as r:
        return _to_mx(r.read(info, axis, start, stop), info.dtype)


def _to_mx(arr: np.ndarray, dtype: str) -> mx.array:
    a = mx.array(arr)
    return a.view(mx.bfloat16) if dtype == "BF16" else a


def load_sharded(path, group, lm_head: Optional[bool] = None,
                 activation_dtype: Optional[mx.Dtype] = None, start: int = 0,
                 end: Optional[int] = None, strategy: str = "auto"):
    """This rank's tensor-parallel model, reading only its slices of the checkpoint.

    Args:
        path: local checkpoint folder (official layout, or a kimi-mlx build).
        group: the `mx.distributed.Group` (its size and rank choose the slices).
        lm_head: split lm_head by vocabulary (see `shard`).
        activation_dtype: as `loader.load_model` (float32 on the CPU backend).
        start, end: a layer range (a pipeline stage that is also split; default all).
        strategy: how slices are read (`plan_slice`; "auto" unless measuring).
    Returns:
        (the sharded model, evaluated; `SliceReader.stats` summed over the files:
        {"bytes": bytes preads transferred, "reads": pread calls, "mapped": bytes copied
        from an mmap, "needed": bytes of the slices}).
    Raises:
        CheckpointError / ConfigError / ShardError: as `load_model`, plus a model that
            does not split across the group.
    """
    from kimi_mlx.model.model import Model

    model_dir, _, args, end, wm = open_checkpoint(path, end)
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

    readers: Dict[str, SliceReader] = {}

    def read(name: str, axis: int, a: int, b: int) -> mx.array:
        shard_file = wanted[name]
        if shard_file not in readers:
            fd = os.open(model_dir / shard_file, os.O_RDONLY)
            readers[shard_file] = SliceReader(fd, str(model_dir / shard_file), strategy)
        return _to_mx(readers[shard_file].read(infos[name], axis, a, b, name), infos[name].dtype)

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
        for r in readers.values():
            r.close()
            os.close(r.fd)
    report = {k: sum(r.stats[k] for r in readers.values())
              for k in ("bytes", "reads", "mapped", "needed")}
    where = {n: wanted[n] for n in infos}
    check_tensors(model, weights, args, where, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if activation_dtype is None and mx.default_device() == mx.cpu:
        activation_dtype = mx.float32
    model.activation_dtype = activation_dtype
    mx.eval(model.parameters())
    return model, report
