"""The speculative table at --max-concurrency rows, through the pipeline and the tensor
group: bytes of one [B, k + 1] verify step against NumPy hand computations (the layer
sizes for the pipeline, the checkpoint's own safetensors headers for a one-rank group),
the row-union of experts against a Monte-Carlo count, and `kimi-mlx plan`'s tables."""

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from fixtures.verify_cost import MOE, hand_union, hand_verify, moe_config, moe_two_stage_plan, \
    monte_carlo_union

from kimi_mlx.placement.expert_union import load_curve, union_experts
from kimi_mlx.placement.layer_bytes import model_bytes_from_config
from kimi_mlx.placement.planner import GB
from kimi_mlx.placement.verify_cost import tensor_k_table, tensor_verify_bytes, verify_seconds


def test_rows_of_uniform_routing_match_a_monte_carlo_count():
    """rho = beta = 1 and B rows: B x T tokens each picking 4 distinct of 32 uniformly."""
    rng = np.random.default_rng(0)
    E, k, draws = 32, 4, 4000
    for B, T in ((2, 1), (4, 3), (3, 5)):
        mean, se = monte_carlo_union(rng, E, k, B * T, draws)
        assert abs(union_experts(T, E, k, rows=B) - mean) < 5 * se + 1e-9


def test_pipeline_verify_of_rows_matches_a_numpy_hand_computation():
    model, plan = moe_two_stage_plan()
    hop = 0.5e-3
    for k, B in ((3, 4), (0, 4), (2, 1)):
        want_b, want_t = hand_verify(model, plan, k, rows=B, hop_s=hop, draft_s=0.002)
        got_b, got_t = verify_seconds(plan, model, k, load_curve(), hop, draft_s=0.002, rows=B)
        assert got_b == pytest.approx(want_b, rel=1e-6, abs=B * (k + 1))  # embed rows: integer bytes
        assert got_t == pytest.approx(want_t, rel=1e-6)


_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "U32": 4, "I32": 4, "F64": 8}


def _headers(folder: Path):
    """{name: (dtype, shape)} read straight from the safetensors files (8-byte length +
    JSON header), not through kimi_mlx's reader."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        out.update({k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"})
    return out


def test_one_rank_tensor_verify_of_rows_matches_the_checkpoint_headers():
    """A one-rank group reads every tensor: the trunk whole, the routed experts x D/E,
    B(k + 1) embedding rows, and each row's caches (the pipeline layer model's, at the
    same context): summed here from the raw safetensors headers with NumPy."""
    from kimi_mlx.placement.tensor_parallel import tensors_of

    config = moe_config()
    text = config.get("text_config", config)
    E, k0 = text["num_experts"], text["num_experts_per_token"]
    vocab = text["vocab_size"]
    heads = text["linear_attn_config"]["num_heads"]
    expert_b = trunk_b = embed_b = 0.0
    for name, (dtype, shape) in _headers(MOE).items():
        b = float(np.prod(shape)) * _BYTES[dtype]
        if re.search(r"\.experts\.\d+\.", name):
            expert_b += b
        elif "embed_tokens" in name:
            embed_b += b
        elif name.endswith("A_log"):  # stored for more heads than the layer uses
            trunk_b += b * heads / shape[0]
        else:
            trunk_b += b
    layers = model_bytes_from_config(config).layers
    ctx = 200
    cache = sum(l.index_bytes_per_token * ctx + (l.cache_bytes_per_token - l.index_bytes_per_token)
                * min(ctx, l.index_topk or 10**9) + l.state_bytes_per_sequence for l in layers)
    args, tensors = tensors_of(str(MOE))
    for k, B in ((3, 4), (0, 1), (5, 2)):
        T = k + 1
        want = (trunk_b + expert_b * hand_union(E, k0, T, B) / E + embed_b * B * T / vocab
                + B * cache)
        got = tensor_verify_bytes(tensors, args, 1, ctx, k, load_curve(), rows=B)
        assert got == pytest.approx(want, rel=1e-6), (k, B)


def test_tensor_table_k0_is_the_tensor_plans_own_decode_step():
    """At one row, k = 0 of the tensor table is `TensorPlan`'s decode step (its bytes are
    checked against the ranged loader in tests/test_tensor_parallel.py), for 2 ranks."""
    from kimi_mlx.placement.tensor_parallel import tensor_plan_for, tensors_of

    args, tensors = tensors_of(str(MOE))
    tp = tensor_plan_for(tensors, args, [800 * GB, 800 * GB], 300)
    plain, rows = tensor_k_table(tp, tensors, args, 300, [0.7], 50e-6, ks=[1, 4])
    assert plain.read_bytes == pytest.approx(tp.read_bytes_per_token, abs=2)
    assert plain.seconds == pytest.approx(tp.seconds_per_token(50e-6), rel=1e-9)
    assert [r.k for r in rows] == [1, 4] and rows[1].read_bytes > rows[0].read_bytes > plain.read_bytes
    # tokens per step of 1 + 0.7 + 0.49 + ... per row
    assert rows[1].tokens_per_step == pytest.approx(sum(0.7 ** i for i in range(5)))


def _section(out: str, starts: str):
    lines = out.splitlines()
    i = next(j for j, l in enumerate(lines) if l.startswith(starts))
    table = {}
    for l in lines[i + 1:]:
        if not l.strip():
            break
        if l.startswith("  ") and l.split()[0].isdigit():
            table[int(l.split()[0])] = l.split()
    return table


def test_plan_prints_pipeline_and_tensor_tables_at_max_concurrency(capsys):
    """micro-moe over 2 Macs at --max-concurrency 3: the pipeline's table and one per
    link for the tensor group, each at 3 rows, each row's bytes those of `verify_seconds`
    / `tensor_verify_bytes` at 3 rows, tokens per step 3 x (1 + a + a^2 ...)."""
    from kimi_mlx.commands.main import main

    assert main(["plan", "--model", str(MOE), "--macs", "2x16GB", "--max-draft-tokens", "4",
                 "--max-concurrency", "3", "--draft-acceptance", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("fits")
    pipe = _section(out, "speculative decoding, 3 sequences verified together")
    jaccl = _section(out, "speculative decoding, 3 sequences verified together (--max-concurrency "
                          "3: one [3, k + 1] pass) through the tensor group of 2 Macs over JACCL")
    tcp = _section(out, "speculative decoding, 3 sequences verified together (--max-concurrency "
                        "3: one [3, k + 1] pass) through the tensor group of 2 Macs over TCP")
    for table in (pipe, jaccl, tcp):
        assert sorted(table) == [0, 1, 2, 3, 4]
        for k in range(5):
            assert float(table[k][-6]) == pytest.approx(
                3 * sum(0.5 ** i for i in range(k + 1)), abs=0.006)
    # over TCP each step pays 6x JACCL's collectives: same bytes, more ms
    assert all(float(tcp[k][-3]) > float(jaccl[k][-3]) for k in range(5))
    assert [jaccl[k][-4] for k in range(5)] == [tcp[k][-4] for k in range(5)]
    # the summary names each deployment's best row of its own table
    lines = out.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("what drafts buy at 3 sequence(s)"))
    assert lines[at + 1].split() == ["deployment", "plain", "best", "k", "with", "drafts", "gain"]
    summary = {re.split(r"\s{2,}", l.strip())[0]: l.split()[-4:] for l in lines[at + 2:at + 5]}
    for name, table in (("pipeline", pipe), ("tensor over JACCL", jaccl), ("tensor over TCP ring", tcp)):
        k = max(table, key=lambda k: float(table[k][-2]))
        gain = float(table[k][-2]) / float(table[0][-2])
        assert summary[name][:3] == [table[0][-2], str(k), table[k][-2]], name
        assert float(summary[name][3].rstrip("x")) == pytest.approx(gain, abs=0.011)
