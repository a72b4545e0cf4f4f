"""Checkpoint fingerprints, and the checkpoints a node offers from its models folder.

A fingerprint names a checkpoint's content well enough to refuse a mismatched stage, and
costs milliseconds even for the 1.56 TB release: SHA-256 over `config.json`, the index's
weight map, each shard's name, size and safetensors header (dtypes, shapes, offsets), and
`SAMPLES` blocks of `BLOCK` bytes spread over each shard's data. Two checkpoints with the
same layout but different weights (another seed, a fine-tune) differ in the sampled bytes.
It is not a full content hash: an edit confined to unsampled bytes is not seen.

A stage only ever loads a checkpoint it found itself under its own `--models` folder (and
the checkpoint shipped with the install); the network names a fingerprint, never a path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

from kimi_mlx.checkpoint.shards import CheckpointError, header_bytes

FINGERPRINT_CHARS = 24
SAMPLES = 16
BLOCK = 4096
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

log = logging.getLogger(__name__)


class FingerprintError(ValueError):
    """A folder that is not a readable checkpoint (names the file)."""


def is_checkpoint(folder: Path) -> bool:
    """A folder with config.json and an index or a single model.safetensors."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (
        (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()
    )


def _shards(folder: Path) -> Dict[str, str]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, OSError) as e:
            raise FingerprintError(f"{index}: not a safetensors index ({e})") from None
        return {str(k): str(v) for k, v in wm.items()}
    return {"*": SINGLE_FILE}


def fingerprint(folder) -> str:
    """24 hex characters identifying the checkpoint in `folder` (see module doc).

    Raises:
        FingerprintError: missing config/index/shard, or a malformed shard header.
    """
    folder = Path(folder)
    h = hashlib.sha256(b"kimi-mlx checkpoint v1\n")
    try:
        h.update((folder / "config.json").read_bytes())
    except OSError as e:
        raise FingerprintError(f"{folder / 'config.json'}: {e.strerror}") from None
    wm = _shards(folder)
    h.update(json.dumps(sorted(wm.items())).encode())
    for shard in sorted(set(wm.values())):
        path = folder / shard
        if os.sep in shard or shard.startswith(".."):
            raise FingerprintError(f"{folder / INDEX_FILE}: shard name {shard!r} is not a file name")
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                try:  # the checks every reader of a header makes (`checkpoint.shards`)
                    header = header_bytes(f, path, size)
                except CheckpointError as e:
                    raise FingerprintError(str(e)) from None
                h.update(f"{shard}\n{size}\n".encode())
                h.update(header)
                base, data = 8 + len(header), size - 8 - len(header)
                for k in range(SAMPLES if data > 0 else 0):
                    f.seek(base + (data - 1) * k // max(SAMPLES - 1, 1))
                    h.update(f.read(BLOCK))
        except FileNotFoundError:
            raise FingerprintError(f"{path}: shard listed in the index is missing") from None
        except OSError as e:
            raise FingerprintError(f"{path}: {e.strerror}") from None
    return h.hexdigest()[:FINGERPRINT_CHARS]


def _candidates(root: Path, depth: int) -> Iterable[Path]:
    """Folders under root up to `depth` levels (following links), checkpoints first-found."""
    if is_checkpoint(root):
        yield root
        return
    if depth == 0:
        return
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    for child in children[:1000]:
        yield from _candidates(child, depth - 1)


def scan(models_dir: Optional[Path], include_shipped: bool = True, depth: int = 4) -> Dict[str, Path]:
    """Fingerprint -> folder for every checkpoint under `models_dir` (up to `depth` levels,
    which covers `org/name` folders and the Hugging Face cache layout
    `models--org--name/snapshots/<rev>`), plus the shipped default checkpoint.

    Unreadable checkpoints are logged and skipped.
    """
    found: Dict[str, Path] = {}
    roots = []
    if models_dir is not None and Path(models_dir).expanduser().is_dir():
        roots.append(Path(models_dir).expanduser())
    if include_shipped:
        from kimi_mlx.generation.generate import default_model

        shipped = default_model()
        if shipped is not None:
            roots.append(shipped)
    for root in roots:
        for folder in _candidates(root, depth):
            try:
                found.setdefault(fingerprint(folder), folder.resolve())
            except FingerprintError as e:
                log.warning("skipping %s: %s", folder, e)
    return found


def folder_state(models_dir: Optional[Path], depth: int = 4) -> tuple:
    """What `scan(models_dir)` would find, cheaply (directory listings and stat calls, no
    reads): each checkpoint folder under `models_dir` with the name, size and mtime of
    every file in it. A checkpoint copied in, finished, changed or removed changes it, so
    a node rescans (fingerprints) only then (`StageService.refresh_catalog`)."""
    if models_dir is None or not Path(models_dir).expanduser().is_dir():
        return ()
    state = []
    for folder in _candidates(Path(models_dir).expanduser(), depth):
        try:
            files = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                                 for e in os.scandir(folder) if e.is_file()))
        except OSError:
            files = ()
        state.append((str(folder), files))
    return tuple(state)


def named(fp: str, catalog: Dict[str, Path]) -> str:
    """'folder (fingerprint)' for messages; the bare fingerprint when the folder is not known."""
    return f"{catalog[fp].name} ({fp})" if fp in catalog else fp
