"""A checkpoint rewritten in place with files of the same sizes (a retrained model of the
same shapes) is another checkpoint to the prompt cache's disk tier: its identity
(`server.disk_cache.checkpoint_identity`, the shards' names, sizes and mtimes) changes,
so the one-process server's folder (`server.serving.model_cache_fingerprint`) and a
pipeline stage's (`cluster.node.stage_cache.stage_fingerprint`, whose content fingerprint
`cluster.net.fingerprint` samples only some bytes) move, and a snapshot of the old weights
is never restored. And the two readers of a safetensors header length
(`checkpoint.shards.read_header`, `cluster.net.fingerprint.fingerprint`) refuse the same
lengths, past the file or past one 100 MB cap."""

import os
import struct
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from kimi_mlx.checkpoint.shards import MAX_HEADER_BYTES, CheckpointError, read_header
from kimi_mlx.cluster.net.fingerprint import FingerprintError, fingerprint
from kimi_mlx.server.disk_cache import DiskSnapshotStore, checkpoint_identity


def write_checkpoint(folder, seed: float):
    """config.json and one model.safetensors of fixed shapes (the same size for every
    seed), the data large enough that most of it lies outside the fingerprint's samples."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "kimi_k31"}')
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {"w": mx.full((256, 1024), seed, dtype=mx.float32)})
    return folder / "model.safetensors"


def rewrite_same_size(shard, seed: float):
    """The shard rewritten with other values in bytes no fingerprint sample reads, its
    size unchanged and its mtime 10 s later."""
    before = os.stat(shard)
    with open(shard, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + 8000)  # inside the data, between the first and second samples
        f.write(struct.pack("<f", seed) * 256)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 10_000_000_000))
    after = os.stat(shard)
    assert after.st_size == before.st_size and after.st_mtime_ns != before.st_mtime_ns


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4)]


def test_an_equal_size_rewrite_changes_the_identity_and_the_cache_folders(tmp_path):
    from kimi_mlx.cluster.node.stage_cache import stage_fingerprint
    from kimi_mlx.server.serving import model_cache_fingerprint

    ck = tmp_path / "ck"
    shard = write_checkpoint(ck, 1.0)
    ident, content = checkpoint_identity(ck), fingerprint(ck)
    one = model_cache_fingerprint(ck, Tiny())
    spec = SimpleNamespace(fingerprint=content, start=0, end=1, compute_dtype="float32")
    stage = stage_fingerprint(spec, ident)
    root = tmp_path / "pc"
    old = DiskSnapshotStore(root, 1 << 20, one)
    assert old.put("k", 3, [("arrays", [mx.ones((8,))])], 32) and old.flush()
    old.close()

    rewrite_same_size(shard, 2.0)
    assert fingerprint(ck) == content  # the sampled content fingerprint cannot tell
    assert checkpoint_identity(ck) != ident  # the mtime does
    new_one = model_cache_fingerprint(ck, Tiny())
    assert new_one != one
    spec2 = SimpleNamespace(fingerprint=fingerprint(ck), start=0, end=1, compute_dtype="float32")
    assert stage_fingerprint(spec2, checkpoint_identity(ck)) != stage
    new = DiskSnapshotStore(root, 1 << 20, new_one)
    try:
        assert new.dir != old.dir and new.get("k", 3) is None  # the old weights' snapshot
    finally:
        new.close()


def test_identity_holds_still_and_follows_each_shard(tmp_path):
    ck = tmp_path / "ck"
    write_checkpoint(ck, 1.0)
    (ck / "model-2.safetensors").write_bytes((ck / "model.safetensors").read_bytes())
    first = checkpoint_identity(ck)
    assert checkpoint_identity(ck) == first  # nothing changed: the same folder
    st = os.stat(ck / "model-2.safetensors")
    os.utime(ck / "model-2.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert checkpoint_identity(ck) != first  # any shard, by one nanosecond


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 3 << 30])
def test_both_header_readers_refuse_the_same_lengths(tmp_path, n):
    """A length past the 100 MB cap (the file holds it: a sparse file) and one past the
    file: refused by the loader's reader and the fingerprint alike, naming the file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    shard = ck / "model.safetensors"
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(min(n, MAX_HEADER_BYTES + 16) + 8)
    with pytest.raises(CheckpointError, match="model.safetensors: header length"):
        read_header(shard)
    with pytest.raises(FingerprintError, match="model.safetensors: header length"):
        fingerprint(ck)


def test_both_header_readers_accept_a_header_at_the_cap(tmp_path):
    """A header of exactly MAX_HEADER_BYTES bytes (padded JSON) is read by both."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    body = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    header = body + b" " * (MAX_HEADER_BYTES - len(body))
    with open(ck / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    assert read_header(ck / "model.safetensors")["w"].shape == (1,)
    assert len(fingerprint(ck)) == 24
