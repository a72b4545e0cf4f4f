"""Build writer: the official layout in, the same layout out, bytes copied or quantized.

Without quantization, tensors are copied as raw bytes from the source shards (never
through a dtype or a framework), so:

* the kept experts' MXFP4 `weight_packed` / E8M0 `weight_scale` (and anything else
  under `experts.E.`) are byte-identical, renamed `experts.0..n-1` in their old order;
* the router `gate.weight` [E, hidden] rows and `gate.e_score_correction_bias` [E]
  entries of the kept experts are sliced out (row byte ranges, no cast);
* every other tensor is byte-identical, in the same shard file as in the source.

The config gets the new `num_experts` (and its aliases, top level included; with
per-layer counts their maximum, and `num_experts_per_layer` {"<layer>": n} in the text
config, which `kimi_mlx.model.config.ModelArgs` reads, so such a build loads in
`generate`, the cluster and `mlx_lm.load` alike),
`num_experts_per_token` capped at it, and a single expert group (grouped routing cannot
survive uneven per-group pruning); `quantization_config` is untouched. MTP layers
(`layers.N`, N >= num_hidden_layers), which no calibration reaches, are dropped when they
hold routed experts (their expert count would contradict `num_experts`), else kept.
Every other file of the source folder (tokenizer, generation config, ...) is copied.

With a `quantize.QuantSpec` (`kimi-mlx convert`, `prune --q-bits / --expert-bits`), the
trunk's linear weights become MLX affine `weight` / `scales` / `biases` in place (same
shard, same position), and with `expert_bits` each kept expert's `weight_packed` +
`weight_scale` become `experts.E.wN.{weight,scales,biases}`; the config gets mlx-lm's
`quantization` block (and `quantization_config`, as mlx_lm.convert writes it). Sizes are
known from the shapes before anything is read, so the header is written first and each
tensor is quantized while it is written: memory holds one tensor.

Output goes to a temporary folder beside `--out` and is renamed into place at the end
(`AtomicOutput`); on any error the temporary folder is removed, and the source is only
ever read.

What goes where is planned first, from headers only (`prune.build_plan.plan_checkpoint`);
this module writes the plan (`write_checkpoint`).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

from kimi_mlx.checkpoint.shards import INDEX_FILE

# the plan (what goes where) is built in build_plan; its names stay importable from here
from kimi_mlx.prune.build_plan import COPY_CHUNK, CheckpointPlan, OutTensor, PruneError, _header_bytes
from kimi_mlx.prune.build_plan import plan_checkpoint, pruned_config, source_args  # noqa: F401


def write_shard(path: Path, src: Path, tensors: List[OutTensor], metadata: Optional[dict],
                progress: Optional[Callable[[int], None]] = None) -> int:
    """Write one safetensors file from byte ranges of `src` (or computed tensors); returns
    bytes written. `progress(bytes)` is called after each tensor."""
    head = _header_bytes(tensors, metadata)
    with open(src, "rb") as fin, open(path, "wb") as fout:
        fout.write(struct.pack("<Q", len(head)))
        fout.write(head)
        for t in tensors:
            if t.make is not None:
                data = t.make()
                if len(data) != t.nbytes:
                    raise PruneError(f"{t.name}: computed {len(data)} bytes, planned {t.nbytes}")
                fout.write(data)
                if progress:
                    progress(len(data))
                continue
            for a, b in t.ranges:
                fin.seek(a)
                left = b - a
                while left:
                    buf = fin.read(min(left, COPY_CHUNK))
                    if not buf:
                        raise PruneError(f"{src}: ends early while reading {t.name}")
                    fout.write(buf)
                    left -= len(buf)
            if progress:
                progress(t.nbytes)
        fout.flush()
        os.fsync(fout.fileno())
    return 8 + len(head) + sum(t.nbytes for t in tensors)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_checkpoint(plan: CheckpointPlan, dest: Path, progress=None) -> None:
    """Write the planned checkpoint into the (empty, temporary) folder `dest`.

    `progress(bytes)` is called after each tensor with its data bytes. OSError propagates
    (see AtomicOutput).
    """
    dest = Path(dest)
    weight_map: Dict[str, str] = {}
    total = 0
    for fname, (src_path, tensors, meta) in plan.shards.items():
        if not tensors:
            continue
        write_shard(dest / fname, src_path, tensors, meta, progress)
        for t in tensors:
            weight_map[t.name] = fname
            total += t.nbytes
    if plan.indexed:
        index = copy.deepcopy(plan.index_extra)
        index.setdefault("metadata", {})["total_size"] = total
        index["weight_map"] = dict(sorted(weight_map.items()))
        write_json(dest / INDEX_FILE, index)
    write_json(dest / "config.json", plan.config)
    for p in plan.copies:
        if p.is_dir():
            shutil.copytree(p, dest / p.name, symlinks=False)
        else:
            shutil.copy2(p, dest / p.name)


def _explain(e: OSError, where: Path) -> str:
    why = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
    }.get(e.errno, e.strerror or str(e))
    return f"cannot write the checkpoint at {where}: {why}"


class AtomicOutput:
    """A temporary folder beside `out` that becomes `out` on `commit()`.

    On entry the checks run (out must not exist unless `force`, must not be or contain or
    sit inside `src`) and `.NAME.tmp-XXXX` is created beside it; missing parent folders
    are created and, on failure, removed again. Leaving the `with` block without
    `commit()` (an exception, Ctrl-C) removes everything created. An OSError inside the
    block is re-raised as PruneError naming the reason (no space, read-only, ...).
    """

    def __init__(self, out, src=None, force: bool = False):
        self.out = Path(out).expanduser().absolute()
        self.src = Path(src).expanduser().resolve() if src is not None else None
        self.force = force
        self.tmp: Optional[Path] = None
        self._made: List[Path] = []
        self.committed = False

    def check(self) -> None:
        """Refuse an existing --out (without force) and any overlap with the source."""
        out = self.out
        if out.exists() and not self.force:
            raise PruneError(f"{out}: already exists; choose another --out or pass --force")
        if self.src is not None:
            r = out.resolve()
            if r == self.src or self.src in r.parents or r in self.src.parents:
                raise PruneError(f"{out}: --out must not be, contain or sit inside the source "
                                 f"{self.src}")

    def __enter__(self) -> "AtomicOutput":
        self.check()
        parent = self.out.parent
        try:
            missing = [p for p in [parent, *parent.parents] if not p.exists()]
            for p in reversed(missing):
                p.mkdir()
                self._made.append(p)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=parent))
            umask = os.umask(0o22)
            os.umask(umask)
            os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stick to the output
        except OSError as e:
            self._cleanup()
            raise PruneError(_explain(e, self.out)) from None
        return self

    def commit(self) -> Path:
        """Rename the temporary folder to `out` (replacing it under --force)."""
        old = None
        try:
            if self.out.exists() or self.out.is_symlink():
                old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
                os.rename(self.out, old)
            try:
                os.rename(self.tmp, self.out)
            except OSError:
                if old is not None:
                    os.rename(old, self.out)
                raise
        except OSError as e:
            raise PruneError(_explain(e, self.out)) from None
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        return self.out

    def _cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        for p in reversed(self._made):
            try:
                p.rmdir()
            except OSError:
                pass

    def __exit__(self, exc_type, exc, tb):
        if not self.committed:
            self._cleanup()
        if isinstance(exc, OSError) and not isinstance(exc, PruneError):
            raise PruneError(_explain(exc, self.out)) from exc
        return False
