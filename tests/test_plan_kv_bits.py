"""`kimi-mlx plan --kv-bits 8`: the quantized DSA cache counted by the planner
(placement/layer_bytes.py `kv_token_bytes` / `with_kv_bits`, placement/tensor_parallel.py,
placement/kv_cache.py, commands/plan.py), against hand computations from K31_SPEC.md:
24 Gated DSA layers x 1,408 B bf16 (512 latent + 64 rope + 128 index-key values, 2 B each)
= 33,792 B per token; at 8 bits, group g, the latent is 512 B + 2 (512 / g) x 2 B of scales
and biases, the index key 128 B + 2 (128 / g) x 2 B, the rope key 128 B.
"""

from __future__ import annotations

import re

import pytest

from kimi_mlx.commands.main import main
from kimi_mlx.model.config import ModelArgs, read_config
from kimi_mlx.placement import layer_bytes as lb
from kimi_mlx.placement.kv_cache import (cache_read_bytes_per_sequence,
                                         most_sequences_pipeline, most_sequences_tensor)
from kimi_mlx.placement.layer_bytes import (LayerBytes, ModelBytes, cache_bytes,
                                            kv_token_bytes, model_bytes, official_config)
from kimi_mlx.placement.planner import GB, Node, StagePlanner
from kimi_mlx.placement.tensor_parallel import (TensorPlan, rank_read_bytes,
                                               snapshot_bytes_per_rank, tensors_of)

K31 = "moonshotai/Kimi-K3.1-Pro"
DSA_LAYERS, LATENT, ROPE, INDEX, TOPK = 24, 512, 64, 128, 2048  # K31_SPEC.md


def hand_layer_bytes(g=None):
    """(per token, index key per token) of one K3.1 DSA layer, by hand."""
    if g is None:
        return (LATENT + ROPE + INDEX) * 2, INDEX * 2
    index = INDEX + 2 * (INDEX // g) * 2
    return LATENT + 2 * (LATENT // g) * 2 + ROPE * 2 + index, index


@pytest.fixture(autouse=True)
def no_hf_cache(monkeypatch):
    monkeypatch.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)


@pytest.fixture(scope="module")
def k31():
    mp = pytest.MonkeyPatch()
    mp.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)
    m = model_bytes(K31)
    mp.undo()
    return m


@pytest.fixture(scope="module")
def k31_args():
    return ModelArgs.from_config(read_config(official_config(K31).parent))


def test_hand_numbers_are_the_spec():
    assert hand_layer_bytes() == (1408, 256)
    assert DSA_LAYERS * hand_layer_bytes()[0] == 33_792
    assert hand_layer_bytes(64) == (544 + 128 + 136, 136) == (808, 136)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_bytes_per_token_by_hand(k31, k31_args, g):
    per, index = hand_layer_bytes(g)
    q = k31.with_kv_bits(8, g)
    assert k31.cache_bytes_per_token == 33_792
    assert q.cache_bytes_per_token == DSA_LAYERS * per  # 19,392 B at group 64
    dsa = [l for l in q.layers if l.kind == "dsa"]
    assert len(dsa) == DSA_LAYERS
    assert all(l.cache_bytes_per_token == per and l.index_bytes_per_token == index for l in dsa)
    # the KDA states are not the DSA cache: unchanged
    assert q.state_bytes_per_sequence == k31.state_bytes_per_sequence
    # the config-side count agrees layer by layer
    for i, l in enumerate(q.layers):
        assert cache_bytes(k31_args, i, 2, 8, g)[:2] == (l.cache_bytes_per_token,
                                                          l.index_bytes_per_token)
    assert k31.with_kv_bits(None).layers == k31.layers
    assert q.kv_format() == f"8-bit (group {g})" and k31.kv_format() == "bf16"


def test_kv_token_bytes_and_its_errors():
    assert kv_token_bytes(512, 2) == 1024
    assert kv_token_bytes(512, 2, 8, 64) == 544
    assert kv_token_bytes(128, 4, 8, 32) == 128 + 2 * 4 * 4  # fp32 scales and biases
    with pytest.raises(ValueError, match="--kv-bits 3"):
        kv_token_bytes(512, 2, 3, 64)
    with pytest.raises(ValueError, match="--kv-group-size 48"):
        kv_token_bytes(512, 2, 8, 48)
    with pytest.raises(ValueError, match="cache_values"):
        LayerBytes(index=0, kind="dsa", weight_bytes=1, cache_bytes_per_token=10).with_kv_bits(8)


def test_decode_reads_fewer_cache_bytes_by_hand(k31):
    """Per sequence per step at 131,072 tokens: every index key, 2048 latent + rope rows."""
    ctx = 131_072
    q = k31.with_kv_bits(8, 64)
    kda = k31.state_bytes_per_sequence
    assert cache_read_bytes_per_sequence(k31, ctx) == DSA_LAYERS * (256 * ctx + 1152 * TOPK) + kda
    assert cache_read_bytes_per_sequence(q, ctx) == DSA_LAYERS * (136 * ctx + 672 * TOPK) + kda
    # the pipeline's read per step (LayerBytes.read_bytes) falls by exactly that difference
    for seqs in (1, 8):
        diff = sum(a.read_bytes(ctx, seqs) - b.read_bytes(ctx, seqs)
                   for a, b in zip(k31.layers, q.layers))
        assert diff == seqs * DSA_LAYERS * (120 * ctx + 480 * TOPK)


def test_cache_per_stage_counts_the_quantized_cache(k31):
    nodes = [Node(f"m{i}", 500 * GB, 800 * GB) for i in range(4)]
    planner = StagePlanner(headroom=0.1)
    ctx, seqs = 131_072, 8
    plan_q = planner.plan(k31.with_kv_bits(8, 64), nodes, ctx, seqs)
    for st in plan_q.used_stages:
        layers = k31.layers[st.start:st.end]
        n_dsa = sum(l.kind == "dsa" for l in layers)
        kda = sum(l.state_bytes_per_sequence for l in layers)
        assert st.cache_bytes == seqs * (n_dsa * 808 * ctx + kda)


def test_tensor_rank_reads_and_snapshots_by_hand(k31_args):
    targs, tensors = tensors_of(K31, lb.BuildSpec(None, 4, 64, None, 64))
    ctx = 131_072
    for seqs in (1, 8):
        bf16 = rank_read_bytes(tensors, targs, 4, 0, ctx, sequences=seqs)
        q = rank_read_bytes(tensors, targs, 4, 0, ctx, sequences=seqs, kv_bits=8,
                            kv_group_size=64)
        assert bf16 - q == seqs * DSA_LAYERS * (120 * ctx + 480 * TOPK)
    state, per_token = snapshot_bytes_per_rank(targs, 4, kv_bits=8, kv_group_size=64)
    state_bf16, per_token_bf16 = snapshot_bytes_per_rank(targs, 4)
    assert (per_token, per_token_bf16) == (19_392, 33_792) and state == state_bf16


def _synthetic(cache_per_token, n=4, weight=10 * GB):
    layers = tuple(LayerBytes(index=i, kind="dsa", weight_bytes=weight,
                              cache_bytes_per_token=cache_per_token, cache_values=(512, 64, 128))
                   for i in range(n))
    return ModelBytes(layers, embed_bytes=0, head_bytes=0, embed_rows=1, source="synthetic")


def test_most_sequences_pipeline_by_hand():
    """One node of 100 GB, no headroom: 4 x 10 GB weights + n x 4 layers x 1000 B x ctx."""
    planner = StagePlanner(headroom=0, min_headroom_bytes=0)
    m = _synthetic(1000)
    node = [Node("a", 100 * GB, 100 * GB)]
    ctx = 1_000_000
    assert most_sequences_pipeline(planner, m, node, ctx) == (60 * GB) // (4 * 1000 * ctx)  # 15
    # two nodes: each holds two layers and two layers' caches
    nodes = [Node("a", 30 * GB, 100 * GB), Node("b", 30 * GB, 100 * GB)]
    assert most_sequences_pipeline(planner, m, nodes, ctx) == (10 * GB) // (2 * 1000 * ctx)
    assert most_sequences_pipeline(planner, m, [Node("a", 30 * GB, 100 * GB)], ctx) == 0
    assert most_sequences_pipeline(planner, _synthetic(1), node, 10, cap=1000) == 1000
    # the 8-bit count holds more sequences of the same context
    q = m.with_kv_bits(8, 64)
    assert q.layers[0].cache_bytes_per_token == 808
    assert most_sequences_pipeline(planner, q, node, ctx) == (60 * GB) // (4 * 808 * ctx)  # 18


def test_most_sequences_tensor_by_hand():
    tp = TensorPlan(ranks=2, load_bytes=(300 * GB, 310 * GB), read_bytes_per_token=1,
                    cache_bytes=3 * GB, all_sums=0, all_gathers=0, bandwidth=1)
    planner = StagePlanner(headroom=0.1, min_headroom_bytes=0)
    nodes = [Node("a", 500 * GB, 1), Node("b", 400 * GB, 1)]
    # the smaller Mac: 400 - 40 headroom - 310 (largest rank's weights) = 50 GB / 3 GB
    assert most_sequences_tensor(tp, nodes, planner) == 16
    assert most_sequences_tensor(tp, [Node("c", 300 * GB, 1)], planner) == 0


def test_cli_prints_kv_bits_beside_bf16(capsys):
    rc = main(["plan", "--model", K31, "--macs", "4x512GB", "--q-bits", "4",
               "--max-concurrency", "8", "--kv-bits", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # the default group is the cache's own (`--kv-group-size` 128): 528 + 128 + 132 B a layer
    block = out[out.index("DSA cache 8-bit (group 128)"):]
    assert "= 788 B (bf16: 1,408 B)" in block
    assert "18,912 B" in block and "33,792 B (0.56x)" in block
    rows = {}
    for line in block.splitlines()[3:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    q, b = rows["pipeline: most sequences at 131072"]
    assert int(q) > int(b) > 0
    q, b = rows["tensor group: most sequences at 131072"]
    assert int(q) > int(b) > 0
    q, b = rows["tensor decode tok/s over JACCL (8 rows)"]
    assert float(q) > float(b)
    # the stage table and the summary count the 8-bit cache
    assert "KV cache per token: 18,912 B (24 attention layers x 788 B)" in out
    assert "8-bit (group 128)) at 131072" in out


def test_cli_without_kv_bits_prints_no_comparison(capsys):
    assert main(["plan", "--model", K31, "--macs", "1x512GB", "--keep", "0.25",
                 "--q-bits", "4", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "DSA cache 8-bit" not in out and "33,792 B" in out
