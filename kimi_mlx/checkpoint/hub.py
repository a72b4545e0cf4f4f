"""Resolve `--model`: a local folder, or a Hugging Face hub id via huggingface_hub.

For a hub id, only `*.json` and tokenizer files come first; then only the shards holding
the requested layer range (so a pipeline stage never downloads other stages' layers).
`HF_HUB_OFFLINE=1` is honoured: only the local cache is used, and a miss is a clear error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

META_PATTERNS = ["*.json", "tiktoken.model", "*.tiktoken", "*.txt", "*.jinja", "*.md"]


def offline() -> bool:
    """True when HF_HUB_OFFLINE is set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def looks_local(spec: str) -> bool:
    """A path-like spec (absolute, ./, ../, ~, or more than one '/') is never a hub id."""
    return spec.startswith(("/", "./", "../", "~")) or spec.count("/") != 1


def missing_folder(spec, what: str = "model folder") -> str:
    """The message for a --model that is not a checkpoint folder: a file (most often the
    folder's config.json, given instead of the folder) or nothing at all ('no such
    `what`')."""
    path = Path(str(spec)).expanduser()
    if path.exists() and not path.is_dir():
        return f"{spec}: not a folder; --model takes the checkpoint folder ({path.parent})"
    return f"{spec}: no such {what}"


def resolve(
    spec, start: int = 0, end: Optional[int] = None, revision: Optional[str] = None,
    vision: bool = False,
) -> Path:
    """Local folder for `spec`, downloading what layers [start, end) need if it is a hub id
    (with `vision`, also the shards of the vision tower and projector).

    Raises:
        FileNotFoundError: a path-like spec that does not exist, or a hub id that is not
            in the local cache while offline (message says HF_HUB_OFFLINE).
    """
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        return path
    spec = str(spec)
    if looks_local(spec) or path.exists():
        raise FileNotFoundError(missing_folder(spec))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fetch(patterns):
        try:
            return Path(
                snapshot_download(
                    spec,
                    revision=revision,
                    allow_patterns=patterns,
                    local_files_only=offline(),
                )
            )
        except LocalEntryNotFoundError as e:
            why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline() else str(e)
            raise FileNotFoundError(f"{spec}: cannot get the model from the hub: {why}") from None

    folder = fetch(META_PATTERNS)
    from kimi_mlx.checkpoint.shards import needed_shards

    shards = needed_shards(folder, start, end)
    if vision:
        from kimi_mlx.checkpoint.shards import weight_map

        shards = sorted(set(shards) | {f for n, f in weight_map(folder).items()
                                       if n.startswith(("vision_tower.", "mm_projector."))})
    return fetch(META_PATTERNS + shards) if shards else folder
