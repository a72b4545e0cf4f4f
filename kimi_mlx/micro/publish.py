"""Publishing a micro checkpoint folder: its figures and card written into it, its size
checked, usual permissions, and an atomic replace of the shipped folder. Shared by every
micro trainer (`make micro`, `micro-moe`, `micro-draft`, `micro-dspark`, `micro-mtp`,
`micro-vision`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict


def dir_bytes(path: Path) -> int:
    """Total size of the files under `path` (bytes)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _umask_permissions(root: Path) -> None:
    """Give folders and files the usual permissions (mkdtemp / atomic writes make 0700 / 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder `src` to `dst`, replacing any old `dst` (rename-based, same filesystem)."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def publish_checkpoint(ckpt: Path, out: Path, info: Dict[str, Any], card: str,
                       max_mb: float, what: str = "checkpoint") -> int:
    """Finish a built checkpoint folder and move it into place: write `eval.json` (info)
    and `MODEL_CARD.md` (card) into `ckpt`, refuse a folder over `max_mb` MB, give it the
    usual permissions, then `replace_dir(ckpt, out)`. Shared by `make micro` and
    `make micro-draft`.

    Returns:
        the folder's size in bytes.
    Raises:
        RuntimeError: the folder is over max_mb (named by `what`); `out` is left as it was.
    """
    (ckpt / "eval.json").write_text(json.dumps(info, indent=1) + "\n")
    (ckpt / "MODEL_CARD.md").write_text(card)
    total = dir_bytes(ckpt)
    if total > max_mb * 1e6:
        raise RuntimeError(f"{what} folder is {total / 1e6:.1f} MB, over --max-mb {max_mb}")
    _umask_permissions(ckpt)
    replace_dir(ckpt, out)
    return total
