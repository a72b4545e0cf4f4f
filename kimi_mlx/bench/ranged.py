"""How a tensor-parallel rank reads its slices of K3.1's tensors: pread per row, merged
preads, an mmap copy, and what `kimi_mlx.checkpoint.ranged` chooses ("auto").

`python -m kimi_mlx.bench.ranged` writes a synthetic safetensors file with K3.1 Pro's
real per-layer shapes (K31_SPEC section 2): `--experts` routed experts of MXFP4
`w1`/`w3` (`weight_packed` [3072, 1792] + E8M0 `weight_scale` [3072, 112], split on
their rows) and `w2` ([3584, 1536] + [3584, 96], split on their columns: the ~300M
per-row preads per rank of the whole model), and BF16 trunk tensors (`o_proj`
[7168, 12288] and the shared experts' `down_proj` [7168, 6144], split on columns;
`q_proj` [12288, 7168], split on rows). Then, for 2 and 4 ranks, first and last rank,
each strategy reads every slice, with the file's pages dropped from the page cache
first (`posix_fadvise DONTNEED`: a cold read) and again with them cached (warm), and
reports: pread calls, bytes preads transferred vs bytes the slices hold, bytes copied
from an mmap, wall seconds; and the preads and seconds scaled to the whole model per
rank (92 layers x (the trunk tensors + 896 experts); the trunk's other, row-split
tensors are single reads and left out). Every strategy's slices are checked equal to a NumPy slice of
the whole tensor read with `np.fromfile`.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from kimi_mlx.checkpoint.ranged import SliceReader
from kimi_mlx.checkpoint.shards import read_header

# name -> (dtype, shape, split axis)
EXPERT = {
    "w1.weight_packed": ("U8", (3072, 1792), 0), "w1.weight_scale": ("U8", (3072, 112), 0),
    "w3.weight_packed": ("U8", (3072, 1792), 0), "w3.weight_scale": ("U8", (3072, 112), 0),
    "w2.weight_packed": ("U8", (3584, 1536), 1), "w2.weight_scale": ("U8", (3584, 96), 1),
}
TRUNK = {
    "self_attn.o_proj.weight": ("BF16", (7168, 12288), 1),
    "shared_experts.down_proj.weight": ("BF16", (7168, 6144), 1),
    "self_attn.q_proj.weight": ("BF16", (12288, 7168), 0),
}
LAYERS, EXPERTS = 92, 896
STRATEGIES = ("row", "merge", "mmap", "auto")


def write_file(path: Path, experts: int, seed: int = 0) -> Dict[str, Tuple[str, tuple, int]]:
    """A safetensors file of `experts` experts and the trunk tensors, random bytes.
    Returns {tensor name: (dtype, shape, split axis)}."""
    tensors = {f"experts.{e}.{k}": v for e in range(experts) for k, v in EXPERT.items()}
    tensors.update(TRUNK)
    header, off = {}, 0
    for name, (dt, shape, _) in tensors.items():
        n = int(np.prod(shape)) * (2 if dt == "BF16" else 1)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (dt, shape, _) in tensors.items():
            n = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    return tensors


def drop_cache(path: Path) -> bool:
    """Drop `path`'s pages from the page cache (the next read is cold); False where the
    platform has no posix_fadvise (macOS: only `sudo purge` evicts, and all files)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def read_all(path: Path, tensors, ranks: int, rank: int, strategy: str, keep: bool = False):
    """Read every slice of rank `rank` of `ranks`; (stats, seconds, {name: slice} if keep)."""
    infos = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    out = {}
    try:
        t0 = time.perf_counter()
        with SliceReader(fd, str(path), strategy) as r:
            for name, (_, shape, axis) in tensors.items():
                n = shape[axis] // ranks
                a = r.read(infos[name], axis, rank * n, (rank + 1) * n, name)
                if keep:
                    out[name] = a
            secs = time.perf_counter() - t0
            stats = dict(r.stats)
    finally:
        os.close(fd)
    return stats, secs, out


def check_equal(path: Path, tensors, ranks: int, rank: int, got) -> None:
    """Every slice equals the NumPy slice of the whole tensor (np.fromfile)."""
    infos = read_header(path)
    for name, (dt, shape, axis) in tensors.items():
        info = infos[name]
        whole = np.fromfile(path, np.uint16 if dt == "BF16" else np.uint8,
                            count=int(np.prod(shape)), offset=info.start).reshape(shape)
        n = shape[axis] // ranks
        want = np.take(whole, range(rank * n, (rank + 1) * n), axis=axis)
        if not np.array_equal(got[name], want):
            raise SystemExit(f"{name}: rank {rank} of {ranks} differs from the NumPy slice")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=16, help="experts in the file (default 16)")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=2, help="timed runs each (min is shown)")
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kimi-bench-ranged-", dir=a.workdir) as tmp:
        path = Path(tmp) / "model.safetensors"
        tensors = write_file(path, a.experts)
        size = path.stat().st_size
        print(f"synthetic file: {a.experts} experts at K3.1 widths + 3 BF16 trunk tensors, "
              f"{size / 1e6:,.0f} MB")
        if not drop_cache(path):
            print("note: no posix_fadvise here (macOS): the 'cold' columns are warm reads; "
                  "run `sudo purge` before a run for a cold figure")
        print(f"{'ranks':>5} {'rank':>4} {'strategy':>8} {'preads':>10} {'pread MB':>9} "
              f"{'mmap MB':>8} {'needed MB':>9} {'read/need':>9} {'cold s':>7} {'warm s':>7} "
              f"{'model preads':>13} {'model cold':>10} {'model warm':>10}")
        for ranks in (int(x) for x in a.ranks.split(",")):
            for rank in sorted({0, ranks - 1}):
                for strategy in a.strategies.split(","):
                    _, _, got = read_all(path, tensors, ranks, rank, strategy, keep=True)
                    check_equal(path, tensors, ranks, rank, got)
                    del got
                    ex = {k: v for k, v in tensors.items() if k.split(".", 2)[-1] in EXPERT}
                    tr = {k: v for k, v in tensors.items() if k in TRUNK}
                    res = {}
                    for part, ts in (("experts", ex), ("trunk", tr)):
                        cold, warm = [], []
                        for _ in range(a.repeats):
                            drop_cache(path)
                            stats, s, _ = read_all(path, ts, ranks, rank, strategy)
                            cold.append(s)
                            warm.append(read_all(path, ts, ranks, rank, strategy)[1])
                        res[part] = (stats, min(cold), min(warm))
                    stats = {k: res["experts"][0][k] + res["trunk"][0][k] for k in res["trunk"][0]}
                    # per layer: the trunk tensors once, the experts scaled to 896
                    model_reads = LAYERS * (res["trunk"][0]["reads"]
                                            + res["experts"][0]["reads"] * EXPERTS / a.experts)
                    model = {i: LAYERS * (res["trunk"][i] + res["experts"][i] * EXPERTS / a.experts)
                             for i in (1, 2)}
                    print(f"{ranks:>5} {rank:>4} {strategy:>8} {stats['reads']:>10,} "
                          f"{stats['bytes'] / 1e6:>9.1f} {stats['mapped'] / 1e6:>8.1f} "
                          f"{stats['needed'] / 1e6:>9.1f} "
                          f"{(stats['bytes'] + stats['mapped']) / stats['needed']:>9.3f} "
                          f"{res['experts'][1] + res['trunk'][1]:>7.2f} "
                          f"{res['experts'][2] + res['trunk'][2]:>7.2f} {model_reads:>13,.0f} "
                          f"{model[1] / 60:>8.1f} m {model[2] / 60:>8.1f} m", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
