"""Safetensors shards and their index: the one reader every part of kimi-mlx uses.

Nothing read from disk is trusted (DESIGN.md principle 5): a header is checked entry by
entry (known dtype, integer shape, offsets inside the file and equal to shape x dtype
size) and an index may only name plain shard files in its own folder. Only headers are
read here, never tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Tuple

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype names -> bytes per element.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or trusted; the message names the file/tensor/key."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: safetensors dtype name, shape, and absolute byte range in the file."""

    dtype: str
    shape: Tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def header_bytes(f: BinaryIO, path, size: int) -> bytes:
    """The JSON header of safetensors file `path`, open as `f` (binary, at offset 0)
    and `size` bytes long: its 8-byte little-endian length n, then n bytes; `f` is left
    at the data section (offset 8 + n). The one reader of header lengths: `read_header`
    and the cluster's checkpoint fingerprint (`cluster.net.fingerprint`) share its checks.

    Raises:
        CheckpointError: a file shorter than 8 bytes, or n past the file or past
            MAX_HEADER_BYTES (100 MB); the message names the file.
    """
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise CheckpointError(
            f"{path}: header length {n} exceeds the file ({size} B) or the 100 MB limit")
    raw = f.read(n)
    if len(raw) < n:
        raise CheckpointError(f"{path}: shorter than its {n}-byte header")
    return raw


def read_header(path) -> Dict[str, TensorInfo]:
    """Read and check one shard's header (8-byte little-endian length + JSON).

    Returns {tensor name: TensorInfo}. Reads 8 + header-length bytes only.
    Raises:
        CheckpointError: missing file, file shorter than its header, header too long or
            not a JSON object, or a bad entry (unknown dtype, bad shape, offsets outside
            the data section = truncated shard, byte count that disagrees with dtype x
            shape); the message names the file and the tensor.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = header_bytes(f, path, size)
        n = len(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    base, data_len = 8 + n, size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry") from e
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise CheckpointError(f"{path}: tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise CheckpointError(f"{path}: tensor {name!r}: bad data_offsets {[begin, end]}")
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} data_offsets {[begin, end]} outside the "
                f"{data_len}-byte data section")
        if end - begin != _prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name!r}: {end - begin} bytes on disk but {dtype}{shape} "
                f"needs {_prod(shape) * DTYPE_BYTES[dtype]}")
        out[name] = TensorInfo(dtype, tuple(shape), base + begin, base + end)
    return out


def weight_map(folder) -> Dict[str, str]:
    """Tensor name -> shard file name, from the index (or the single file's header).

    Raises:
        CheckpointError: neither an index nor `model.safetensors`, an unreadable index, or
            an index naming a shard outside the folder (path separators, '..').
    """
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if not index_path.exists():
        if (folder / SINGLE_FILE).exists():
            return {k: SINGLE_FILE for k in read_header(folder / SINGLE_FILE)}
        raise CheckpointError(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    try:
        wmap = json.loads(index_path.read_text())["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: no readable weight_map ({e})") from e
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{index_path}: weight_map is not an object")
    for name, shard in wmap.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: tensor {name!r} maps to bad shard name {shard!r}")
    return dict(wmap)


def needed_shards(model_dir, start: int = 0, end: Optional[int] = None) -> List[str]:
    """Shard files a model of layers [start, end) must open (sorted): the shards whose
    tensors `tensor_map.in_range` assigns to those layers (plus embeddings, norm, head).

    Raises CheckpointError / ConfigError for a bad index or config."""
    from kimi_mlx.model.config import ModelArgs, read_config
    from kimi_mlx.model.tensor_map import in_range

    model_dir = Path(model_dir)
    args = ModelArgs.from_config(read_config(model_dir), str(model_dir / "config.json"))
    end = args.num_hidden_layers if end is None else end
    wm = weight_map(model_dir)
    return sorted({f for n, f in wm.items() if in_range(n, args, start, end)})
