"""`cluster launch|server` place the stages for the cache format they run (`--kv-bits 8`),
as `kimi-mlx plan --kv-bits 8` does, checked against hand computations from micro's
config.json and its safetensors files' sizes (the shipped checkpoint: 6 layers, KDA at
1, 2, 4, 5 and Gated DSA at 3, 6; kv_lora_rank 64, qk_rope_head_dim 16, index_head_dim 32,
cache values in BF16, the model's dtype):

- a DSA layer keeps per token (64 + 16 + 32) x 2 = 224 B in BF16; at 8 bits with group 128
  the 64-value latent is one group of 64 (model/cache.py `group_for`: a vector shorter
  than the group is one group): 64 B + a BF16 scale and bias = 68 B, the rope key 32 B,
  the 32-value index key 32 + 4 = 36 B: 136 B;
- a KDA layer keeps per sequence (kernel 4 - 1) x 3 x 4 heads x 32 x 2 B of conv state +
  4 x 32 x 32 fp32 of recurrent state = 2,304 + 16,384 = 18,688 B;
- the planner keeps max(10 % of usable, 2 GiB) free per node (`StagePlanner` defaults).
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest

from kimi_mlx.cluster.head.plan import plan_stages
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.commands.main import main
from kimi_mlx.placement.planner import DEFAULT_CHIP, MAC_BANDWIDTH, GiB, PlanError

MiB = 2**20
CONTEXT, SEQUENCES = 4096, 64


def hand(micro: Path):
    """(BF16 bytes per token per DSA layer, 8-bit group 128 ditto, KDA bytes per
    sequence per layer, DSA layer indices, KDA layer indices, bytes of all safetensors
    files) from micro's config.json and its files, by hand."""
    text = json.loads((micro / "config.json").read_text())["text_config"]
    lat, rope, idx = text["kv_lora_rank"], text["qk_rope_head_dim"], text["dsa_config"]["index_head_dim"]
    assert (lat, rope, idx) == (64, 16, 32)  # both vectors shorter than a group of 128
    bf16 = (lat + rope + idx) * 2
    q8 = (lat + 2 * 2) + rope * 2 + (idx + 2 * 2)  # one group each: a BF16 scale and bias
    lin = text["linear_attn_config"]
    heads, hd, k = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    kda = (k - 1) * 3 * heads * hd * 2 + heads * hd * hd * 4
    dsa_layers = [i - 1 for i in text["dsa_config"]["dsa_layers"]]
    kda_layers = [i - 1 for i in lin["kda_layers"]]
    files = sum(f.stat().st_size for f in micro.glob("*.safetensors"))
    return bf16, q8, kda, dsa_layers, kda_layers, files


def test_hand_numbers(micro_path):
    assert hand(micro_path)[:5] == (224, 136, 18_688, [2, 5], [0, 1, 3, 4])


def nodes_like_plan(n: int, wired_mb: int, ram_gb: int = 8):
    """The `NodeInfo` of n nodes as `kimi-mlx plan --macs {n}x{ram_gb}GB --wired-limit-mb
    {wired_mb}` plans them: names mac1.., usable = the wired limit, the default chip's
    bandwidth."""
    return [NodeInfo(f"mac{i + 1}", "127.0.0.1", 50000 + i, total_memory=ram_gb * GiB,
                     usable_memory=wired_mb * MiB, chip=DEFAULT_CHIP,
                     bandwidth=MAC_BANDWIDTH[DEFAULT_CHIP])
            for i in range(n)]


def cli_ranges(capsys, micro: Path, n: int, wired_mb: int, kv: bool):
    """(exit status, [(node, start, end)]) of `kimi-mlx plan` for the same nodes."""
    argv = ["plan", "--model", str(micro), "--macs", f"{n}x8GB", "--wired-limit-mb",
            str(wired_mb), "--context", str(CONTEXT), "--sequences", str(SEQUENCES)]
    rc = main(argv + (["--kv-bits", "8"] if kv else []))
    out = capsys.readouterr().out
    rows = re.findall(r"^\d+\s+(mac\d+)\s+.*?\[(\d+), (\d+)\)", out, re.M)
    return rc, [(name, int(s), int(e)) for name, s, e in rows], out


def test_one_node_fits_only_with_8bit_caches(micro_path, capsys):
    """One node with 100 MiB of room above the 2 GiB headroom: 64 sequences x 4096 tokens
    of BF16 caches alone (122.2 MB) overflow it, the 8-bit ones with every weight (at most
    the files' bytes) fit."""
    bf16, q8, kda, dsa, kda_layers, files = hand(micro_path)
    room = 100 * MiB
    wired_mb = (2 * GiB + room) // MiB  # 10 % of it is below 2 GiB: the headroom is 2 GiB
    cache16 = SEQUENCES * (CONTEXT * len(dsa) * bf16 + len(kda_layers) * kda)
    cache8 = SEQUENCES * (CONTEXT * len(dsa) * q8 + len(kda_layers) * kda)
    assert (cache16, cache8) == (122_224_640, 76_087_296)
    assert cache16 > room >= files + cache8  # the hand verdict
    nodes = nodes_like_plan(1, wired_mb)

    with pytest.raises(PlanError):
        plan_stages(micro_path, nodes, CONTEXT, SEQUENCES)  # BF16: what ran before --kv-bits
    plan, stages = plan_stages(micro_path, nodes, CONTEXT, SEQUENCES, kv_bits=8,
                               kv_group_size=128)
    assert [(a.node.node_id, a.start, a.end) for a in stages] == [("mac1", 0, 6)]
    st = plan.used_stages[0]
    assert st.cache_bytes == cache8
    assert st.total_bytes <= files + cache8 and st.headroom_bytes == 2 * GiB
    # the group left out is the cache's default (128)
    assert plan_stages(micro_path, nodes, CONTEXT, SEQUENCES, 8)[0].used_stages[0].cache_bytes == cache8

    rc, ranges, _ = cli_ranges(capsys, micro_path, 1, wired_mb, kv=True)
    assert (rc, ranges) == (0, [("mac1", 0, 6)])
    assert cli_ranges(capsys, micro_path, 1, wired_mb, kv=False)[0] == 1  # does not fit


def test_three_nodes_ranges_equal_plan_kv_bits(micro_path, capsys):
    """Three nodes with 50 MiB of room each: one DSA layer's BF16 cache (64 x 4096 x 224 B
    = 58.7 MB) fits no node, so BF16 has no placement; at 8 bits (35.7 MB a DSA layer)
    one DSA layer with everything else fits a node, both do not, so the stages split the
    two DSA layers. The ranges are the ones `kimi-mlx plan --kv-bits 8` prints."""
    bf16, q8, kda, dsa, kda_layers, files = hand(micro_path)
    room = 50 * MiB
    wired_mb = (2 * GiB + room) // MiB
    per_dsa16, per_dsa8 = SEQUENCES * CONTEXT * bf16, SEQUENCES * CONTEXT * q8
    all_kda = SEQUENCES * len(kda_layers) * kda
    assert per_dsa16 > room  # no BF16 placement at all
    assert 2 * per_dsa8 > room >= per_dsa8 + all_kda + files  # 8-bit: one DSA layer a node
    nodes = nodes_like_plan(3, wired_mb)

    with pytest.raises(PlanError):
        plan_stages(micro_path, nodes, CONTEXT, SEQUENCES)
    plan, stages = plan_stages(micro_path, nodes, CONTEXT, SEQUENCES, kv_bits=8)
    ranges = [(a.node.node_id, a.start, a.end) for a in stages]
    assert ranges[0][1] == 0 and ranges[-1][2] == 6 and len(ranges) >= 2
    for (_, s, e), st in zip(ranges, plan.used_stages):
        n_dsa = sum(s <= i < e for i in dsa)
        assert n_dsa <= 1
        n_kda = sum(s <= i < e for i in kda_layers)
        assert st.cache_bytes == SEQUENCES * (CONTEXT * n_dsa * q8 + n_kda * kda)  # by hand
        assert st.total_bytes + st.headroom_bytes <= wired_mb * MiB

    rc, cli, out = cli_ranges(capsys, micro_path, 3, wired_mb, kv=True)
    assert rc == 0 and cli == ranges, out
    assert cli_ranges(capsys, micro_path, 3, wired_mb, kv=False)[0] == 1


class _Loaded(Exception):
    pass


def _connect(monkeypatch, micro: Path, nodes, kv_bits, kv_group_size=128):
    """`Cluster.connect` (what `cluster launch` and `cluster server` run) over `nodes` with
    a transport that records the load it is asked for and stops there: (load kwargs and
    stages, or the exception connect raised, whether the transport was shut down)."""
    from kimi_mlx.cluster.head import cluster as head_cluster
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.nodes import NodeSettings

    seen = {}

    class Transport:
        def __init__(self, *a, **kw):
            seen["shutdown"] = False

        def load(self, fp, stages, compute, wire, **kw):
            seen["stages"] = [(s.node.node_id, s.start, s.end) for s in stages]
            seen["kv"] = kw["kv"]
            raise _Loaded()

        def shutdown(self):
            seen["shutdown"] = True

    monkeypatch.setattr(head_cluster, "GrpcTransport", Transport)
    settings = NodeSettings(secret_file=micro / "none.key", kv_bits=kv_bits,
                            kv_group_size=kv_group_size)
    finder = types.SimpleNamespace(settings=settings, secret=b"s", model_dir=micro, fp="fp",
                                   accepted=lambda t: [(n, pb.HealthReply()) for n in nodes])
    c = head_cluster.Cluster(finder, head_cluster.PipelineSettings(sequences=SEQUENCES,
                                                                   quiet=True), CONTEXT)
    try:
        c.connect()
    except _Loaded:
        return seen
    except Exception as e:
        seen["error"] = e
    return seen


def test_cluster_connect_plans_with_the_kv_bits_it_loads(micro_path, monkeypatch):
    wired_mb = (2 * GiB + 100 * MiB) // MiB
    nodes = nodes_like_plan(1, wired_mb)
    seen = _connect(monkeypatch, micro_path, nodes, 8)
    assert "error" not in seen, seen
    assert seen["stages"] == [("mac1", 0, 6)] and seen["kv"] == (8, 128)
    # BF16 caches: no placement, and the transport is shut down on the way out
    seen = _connect(monkeypatch, micro_path, nodes, None)
    assert isinstance(seen.get("error"), PlanError) and seen["shutdown"]
    # group 32 (two groups in the latent: 140 B a DSA layer per token) still fits
    seen = _connect(monkeypatch, micro_path, nodes, 8, 32)
    assert "error" not in seen and seen["kv"] == (8, 32)


def test_an_unset_group_is_the_caches_default_on_the_wire(monkeypatch):
    """The head's LoadRequest for (8, None) carries the group a DSA cache built without
    one uses (model/cache.py `DSACache`), not an older literal; and the cluster flags'
    settings default to it."""
    from kimi_mlx.cluster.head.transport import GrpcTransport, StageAssignment
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.nodes import NodeSettings
    from kimi_mlx.model.cache import DSACache

    default = DSACache(kv_bits=8).kv_group_size
    sent = []

    class Stub:
        def Load(self, req, timeout=None):
            sent.append(req)
            yield pb.LoadProgress(phase="ready")

    t = GrpcTransport(b"secret")
    monkeypatch.setattr(t, "_connect", lambda stages: setattr(t, "_stubs", [Stub()]))
    monkeypatch.setattr(t, "_start_watches", lambda: None)
    node = NodeInfo("a", "127.0.0.1", 1)
    try:
        t.load("fp", [StageAssignment(node, 0, 6)], "float32", "float32", kv=(8, None))
    finally:
        t.shutdown()
    assert [(r.kv_bits, r.kv_group_size) for r in sent] == [(8, default)]
    assert NodeSettings(secret_file=Path("k")).kv_group_size == default
