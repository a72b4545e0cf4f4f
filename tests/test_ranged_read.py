"""Coalesced ranged reads (`kimi_mlx.checkpoint.ranged`): every slice a rank reads equals
a NumPy slice of the whole tensor read with `np.fromfile`, for BF16, MXFP4 packed +
E8M0 scales, and MLX-affine weights + scales + biases split on group boundaries (those
compared after `mx.dequantize` against the whole tensor's dequantized columns), first,
middle and last rank, odd sizes; the reader's own counts are checked against bounds:
bytes transferred at most the slice x (1 + WASTE), far fewer preads than rows (the
preads themselves counted by wrapping `os.preadv`)."""

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.checkpoint import ranged
from kimi_mlx.checkpoint.ranged import SliceReader, plan_slice, read_slice
from kimi_mlx.checkpoint.shards import CheckpointError, read_header

NP = {"BF16": np.uint16, "U8": np.uint8, "U32": np.uint32, "F32": np.float32}


def write_safetensors(path, tensors):
    """tensors: {name: (safetensors dtype, numpy array of the stored bits)}."""
    header, off, blobs = {}, 0, []
    for name, (dt, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


def whole(path, info):
    """The whole stored tensor, read independently of the code under test."""
    dt = NP[info.dtype]
    return np.fromfile(path, dt, count=int(np.prod(info.shape)), offset=info.start).reshape(info.shape)


@pytest.fixture
def counted_preads(monkeypatch):
    """Every os.preadv call's byte count, as the kernel was asked for it."""
    calls = []
    real = os.preadv

    def preadv(fd, buffers, offset, *a):
        calls.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(ranged.os, "preadv", preadv)
    return calls


def bounds(ranks, n, rank):
    """[start, stop) of rank `rank` of `ranks` over n units (uneven: the first ones larger)."""
    base, extra = divmod(n, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@pytest.mark.parametrize("strategy", ["auto", "row", "merge", "mmap"])
def test_bf16_slices_equal_numpy_every_rank_and_axis(tmp_path, strategy):
    rng = np.random.default_rng(0)
    t = {"a": ("BF16", rng.integers(0, 1 << 16, (37, 91), dtype=np.uint16)),   # odd both ways
         "b": ("F32", rng.standard_normal((130, 5)).astype(np.float32)),
         "c": ("BF16", rng.integers(0, 1 << 16, (5, 7, 3), dtype=np.uint16)),   # 3-D, middle axis
         "d": ("F32", rng.standard_normal((11,)).astype(np.float32))}
    path = write_safetensors(tmp_path / "m.safetensors", t)
    infos = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in infos.items():
            full = whole(path, info)
            for axis in range(len(info.shape)):
                for ranks in (2, 3, 4):
                    for rank in range(ranks):
                        a, b = bounds(ranks, info.shape[axis], rank)
                        got = read_slice(fd, info, axis, a, b, name, strategy)
                        if info.dtype == "BF16":
                            assert got.dtype == mx.bfloat16
                            got = got.view(mx.uint16)
                        want = np.take(full, range(a, b), axis=axis)
                        np.testing.assert_array_equal(np.array(got), want,
                                                      err_msg=f"{name} axis {axis} {rank}/{ranks}")
    finally:
        os.close(fd)


def ocp_mxfp4(rng, rows, cols):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(118, 136, (rows, cols // 32), dtype=np.uint8)
    return packed, scales


@pytest.mark.parametrize("ranks", [2, 4])
def test_mxfp4_column_split_on_block_boundaries_dequantizes_to_the_whole_tensors_columns(
        tmp_path, ranks, counted_preads):
    """An expert down projection (w2, split on its input columns: MXFP4 blocks of 32 kept
    whole), K3.1's shape scaled down in rows only, 96 blocks per row as in K3.1."""
    rng = np.random.default_rng(1)
    rows, cols = 130, 3072
    packed, scales = ocp_mxfp4(rng, rows, cols)
    path = write_safetensors(tmp_path / "e.safetensors",
                             {"w2.weight_packed": ("U8", packed), "w2.weight_scale": ("U8", scales)})
    infos = read_header(path)
    ref = np.array(mx.dequantize(mx.array(packed).view(mx.uint32), mx.array(scales), None,
                                 group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
    fd = os.open(path, os.O_RDONLY)
    try:
        for rank in range(ranks):
            blocks = bounds(ranks, cols // 32, rank)  # whole blocks per rank
            with SliceReader(fd, str(path)) as r:
                p = r.read(infos["w2.weight_packed"], 1, blocks[0] * 16, blocks[1] * 16)
                s = r.read(infos["w2.weight_scale"], 1, *blocks)
                stats = dict(r.stats)
            np.testing.assert_array_equal(p, packed[:, blocks[0] * 16:blocks[1] * 16])
            got = mx.dequantize(mx.array(p).view(mx.uint32), mx.array(s), None, group_size=32,
                                bits=4, mode="mxfp4")
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)),
                                          ref[:, blocks[0] * 32:blocks[1] * 32])
            # gap = (ranks - 1) x run: not read through, copied from the mapping instead
            assert stats["bytes"] + stats["mapped"] == stats["needed"] == p.nbytes + s.nbytes
    finally:
        os.close(fd)
    assert counted_preads == []  # 130 rows x 2 tensors x ranks: no pread at all


def test_mxfp4_row_split_is_one_pread_per_tensor(tmp_path, counted_preads):
    rng = np.random.default_rng(2)
    packed, scales = ocp_mxfp4(rng, 96, 256)
    path = write_safetensors(tmp_path / "e.safetensors",
                             {"p": ("U8", packed), "s": ("U8", scales)})
    infos = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with SliceReader(fd) as r:
            np.testing.assert_array_equal(r.read(infos["p"], 0, 48, 96), packed[48:])
            np.testing.assert_array_equal(r.read(infos["s"], 0, 0, 48), scales[:48])
    finally:
        os.close(fd)
    assert counted_preads == [48 * 128, 48 * 8]


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (2, 128)])
def test_affine_quantized_split_on_group_boundaries(tmp_path, bits, group):
    """MLX affine weight [out, in * bits / 32] uint32 + scales/biases [out, in / group]:
    a rank's columns are whole groups; 3 ranks over 7 groups (3 + 2 + 2)."""
    rng = np.random.default_rng(3)
    out_dim, in_dim = 45, 7 * group
    w, sc, bi = mx.quantize(mx.array(rng.standard_normal((out_dim, in_dim)).astype(np.float32)),
                            group_size=group, bits=bits)
    ref = np.array(mx.dequantize(w, sc, bi, group_size=group, bits=bits))
    path = write_safetensors(tmp_path / "q.safetensors", {
        "w": ("U32", np.array(w)), "s": ("F32", np.array(sc)), "b": ("F32", np.array(bi))})
    infos = read_header(path)
    per_group = group * bits // 32  # uint32 words per group
    fd = os.open(path, os.O_RDONLY)
    try:
        for rank in range(3):
            g0, g1 = bounds(3, 7, rank)
            with SliceReader(fd, str(path)) as r:
                ws = r.read(infos["w"], 1, g0 * per_group, g1 * per_group)
                ss, bs = (r.read(infos[k], 1, g0, g1) for k in "sb")
            got = mx.dequantize(mx.array(ws), mx.array(ss), mx.array(bs), group_size=group, bits=bits)
            np.testing.assert_array_equal(np.array(got), ref[:, g0 * group:g1 * group])
    finally:
        os.close(fd)


def test_small_gaps_are_read_through_within_the_waste_bound(tmp_path, counted_preads):
    """Columns [0, 950) of 1000: gaps of 100 B after runs of 1900 B are read through (one
    pread), and the bytes transferred stay within the slice x (1 + WASTE)."""
    rng = np.random.default_rng(4)
    a = rng.integers(0, 1 << 16, (300, 1000), dtype=np.uint16)
    path = write_safetensors(tmp_path / "m.safetensors", {"a": ("BF16", a)})
    info = read_header(path)["a"]
    fd = os.open(path, os.O_RDONLY)
    try:
        with SliceReader(fd) as r:
            got = r.read(info, 1, 0, 950)
            stats = dict(r.stats)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(got, a[:, :950])
    assert len(counted_preads) == stats["reads"] == 1
    assert stats["needed"] == got.nbytes
    assert got.nbytes < sum(counted_preads) == stats["bytes"] <= got.nbytes * (1 + ranged.WASTE)


def test_merged_reads_stay_under_max_read(tmp_path, monkeypatch, counted_preads):
    monkeypatch.setattr(ranged, "MAX_READ", 10_000)
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1 << 16, (300, 1000), dtype=np.uint16)
    path = write_safetensors(tmp_path / "m.safetensors", {"a": ("BF16", a)})
    info = read_header(path)["a"]
    fd = os.open(path, os.O_RDONLY)
    try:
        np.testing.assert_array_equal(np.array(read_slice(fd, info, 1, 3, 998).view(mx.uint16)),
                                      a[:, 3:998])
        # a contiguous slice larger than MAX_READ: several preads into the result itself
        n = len(counted_preads)
        np.testing.assert_array_equal(np.array(read_slice(fd, info, 0, 10, 290).view(mx.uint16)),
                                      a[10:290])
    finally:
        os.close(fd)
    assert max(counted_preads) <= 10_000
    assert len(counted_preads) - n == -(-280 * 2000 // 10_000)


def test_k31_down_projection_read_counts():
    """The plan for K3.1's expert down projection (w2 packed [3584, 1536] U8) at 2 and 4
    ranks: no pread per row (3584 of them before), exactly the slice's bytes."""
    from kimi_mlx.checkpoint.shards import TensorInfo

    info = TensorInfo("U8", (3584, 1536), 1000, 1000 + 3584 * 1536)
    for ranks in (2, 4):
        w = 1536 // ranks
        assert plan_slice(info, 1, 0, w, "row").reads == 3584
        plan = plan_slice(info, 1, (ranks - 1) * w, ranks * w)
        assert (plan.reads, plan.needed) == (0, 3584 * w)
    # and a slice whose gaps are small enough to read through: one read per MAX_READ
    bf = TensorInfo("BF16", (7168, 12288), 0, 7168 * 12288 * 2)
    plan = plan_slice(bf, 1, 0, 12000)
    assert plan.reads == -(-7168 // ((ranged.MAX_READ - 24000) // 24576 + 1))
    assert plan.read_bytes <= plan.needed * (1 + ranged.WASTE)


def test_errors_name_the_file_and_tensor(tmp_path):
    a = np.arange(64, dtype=np.uint8).reshape(8, 8)
    path = write_safetensors(tmp_path / "m.safetensors", {"t": ("U8", a)})
    info = read_header(path)["t"]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=r"m.safetensors: t: slice \[4, 9\)"):
            SliceReader(fd, str(path)).read(info, 1, 4, 9, "t")
    finally:
        os.close(fd)
    # a file cut short after its header was read: pread and mmap paths both say so
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        for strategy in ("row", "mmap"):
            with pytest.raises(CheckpointError, match="t: short read"):
                SliceReader(fd, str(path), strategy).read(info, 1, 0, 4, "t")
    finally:
        os.close(fd)
