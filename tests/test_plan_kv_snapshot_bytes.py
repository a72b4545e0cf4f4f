"""The planner's `--kv-bits 8` cache and snapshot bytes against the cache itself:

- a cache vector shorter than the group is one group, as model/cache.py quantizes it
  (`group_for`): micro's 64-value latent and 32-value index key at the default group 128
  (before, the planner refused every micro plan with --kv-bits 8 at the default group);
- a real snapshot of micro's cache after a prefill (`model.cache.snapshot`), and the
  safetensors file the disk tier writes of it (`--prompt-cache-dir`), hold exactly the
  bytes `kimi-mlx plan` counts for one sequence at that context;
- `kimi-mlx plan --kv-bits 8` prints the scale bytes of those groups and how many
  snapshot files the default --prompt-cache-disk-bytes holds beside BF16, by hand.

Hand numbers for micro (config.json: kv_lora_rank 64, qk_rope_head_dim 16,
index_head_dim 32, 2 Gated DSA + 4 KDA layers, BF16 caches): a DSA layer per token keeps
224 B in BF16, and at 8 bits group 128: 64 + 4 (one BF16 scale and bias) + 32 + 32 + 4 =
136 B (group 64 the same; group 32: 64 + 8 + 32 + 32 + 4 = 140 B); a KDA layer per
sequence 3 x 3 x 128 x 2 + 4 x 32 x 32 x 4 = 18,688 B.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from kimi_mlx.commands.main import main
from kimi_mlx.model.cache import KV_GROUP_SIZES, group_for, snapshot, snapshot_nbytes
from kimi_mlx.placement.layer_bytes import kv_token_bytes, model_bytes

MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"
HAND_DSA = {None: 224, 128: 136, 64: 136, 32: 140}  # B per token per DSA layer
KDA = 18_688
TOKENS = 80


def test_short_vectors_are_one_group_as_the_cache_quantizes_them():
    assert kv_token_bytes(32, 2, 8, 128) == 32 + 2 * 2  # one group of 32
    assert kv_token_bytes(64, 2, 8, 128) == 64 + 2 * 2
    assert kv_token_bytes(64, 2, 8, 32) == 64 + 2 * 2 * 2
    assert kv_token_bytes(512, 2, 8, 128) == 512 + 2 * 4 * 2  # K3.1's latent: 4 groups
    # the planner refuses what the cache refuses: a 16-value vector fits no group size
    for g in KV_GROUP_SIZES:
        with pytest.raises(ValueError, match="--kv-group-size"):
            group_for(16, g)
        with pytest.raises(ValueError, match="--kv-group-size"):
            kv_token_bytes(16, 2, 8, g)
    # 96 values: group 32 divides them, 64 does not (neither in the cache)
    assert kv_token_bytes(96, 2, 8, 32) == 96 + 3 * 2 * 2
    with pytest.raises(ValueError):
        group_for(96, 64)
    with pytest.raises(ValueError):
        kv_token_bytes(96, 2, 8, 64)


@pytest.mark.parametrize("group", [None, 128, 32])
def test_micro_per_token_bytes_by_hand(group):
    m = model_bytes(str(MICRO))
    if group is not None:
        m = m.with_kv_bits(8, group)
    dsa = [l for l in m.layers if l.kind == "dsa"]
    assert [l.cache_bytes_per_token for l in dsa] == [HAND_DSA[group]] * 2
    assert [l.state_bytes_per_sequence for l in m.layers if l.kind == "kda"] == [KDA] * 4


@pytest.fixture(scope="module")
def micro_bf16():
    """micro with BF16 activations (its caches in BF16, as the planner counts them and as
    a Mac runs it); our own instance."""
    from kimi_mlx.checkpoint.loader import load_model

    if not MICRO.exists():
        pytest.skip("no shipped micro checkpoint")
    model, _, _ = load_model(MICRO, verbose=False, activation_dtype=mx.bfloat16)
    yield model
    model.set_kv_quant(None)


def _safetensors_data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensors: the file less its 8-byte length and the
    JSON header it announces (the format's definition)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    json.loads(raw[8:8 + n])
    return len(raw) - 8 - n


@pytest.mark.parametrize("group", [None, 128, 32])
def test_snapshot_and_its_file_hold_the_planned_bytes(micro_bf16, tmp_path, group):
    from kimi_mlx.server.disk_cache import DiskSnapshotStore, token_key

    micro_bf16.set_kv_quant(8 if group else None, group or 128)
    cache = micro_bf16.make_cache()
    ids = [(7 * i) % 4000 + 5 for i in range(TOKENS)]
    micro_bf16(mx.array(ids)[None], cache)
    snap = snapshot(cache)
    hand = 2 * TOKENS * HAND_DSA[group] + 4 * KDA
    m = model_bytes(str(MICRO))
    if group is not None:
        m = m.with_kv_bits(8, group)
    planned = sum(l.cache_bytes(TOKENS, 1) for l in m.layers)
    assert snapshot_nbytes(snap) == planned == hand

    store = DiskSnapshotStore(tmp_path, 1 << 30, {"test": "plan bytes"})
    try:
        assert store.put(token_key(ids), TOKENS, snap, snapshot_nbytes(snap))
        assert store.flush()
        files = list(store.dir.glob("*.safetensors"))
        assert len(files) == 1 and _safetensors_data_bytes(files[0]) == planned
    finally:
        store.close()


def test_cli_prints_group_scales_and_disk_files_beside_bf16(capsys):
    """At 4096 tokens, one sequence: a snapshot is 2 x 4096 x 136 + 4 x 18,688 = 1,188,864
    B at 8 bits and 2 x 4096 x 224 + 74,752 = 1,909,760 B in BF16; 32 GiB holds 28,901
    and 17,991 of them."""
    assert main(["plan", "--model", str(MICRO), "--context", "4096", "--kv-bits", "8"]) == 0
    out = capsys.readouterr().out
    assert ("per DSA layer per token: latent 64 B + 4 B of scales and biases, rope key 32 B, "
            "index key 32 B + 4 B = 136 B (bf16: 224 B)") in out
    row = next(l for l in out.splitlines() if "files in --prompt-cache-disk-bytes 32 GiB" in l)
    assert re.split(r"\s{2,}", row.strip())[1:] == [str((32 << 30) // 1_188_864),
                                                    str((32 << 30) // 1_909_760)]
    assert (32 << 30) // 1_188_864 == 28_901 and (32 << 30) // 1_909_760 == 17_991
    assert "272 B (2 attention layers x 136 B)" in out
