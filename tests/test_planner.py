"""Stage planner, layer bytes and `kimi-mlx plan`, checked against hand-computed values."""

import json
import struct

import mlx.core as mx
import pytest

from kimi_mlx.checkpoint.shards import read_header as read_safetensors_header

from kimi_mlx.commands.main import main
from kimi_mlx.placement import layer_bytes as lb
from kimi_mlx.placement.layer_bytes import (
    CheckpointError, LayerBytes, ModelBytes, expected_tensors, model_bytes,
    model_bytes_from_checkpoint, model_bytes_from_config,
)
from kimi_mlx.placement.planner import (
    GB, GiB, Node, PlanError, StagePlanner, macos_default_wired_bytes, parse_bytes,
    parse_macs, usable_bytes_for_ram,
)
from kimi_mlx.model.config import ModelArgs, read_config

K31 = "moonshotai/Kimi-K3.1-Pro"


@pytest.fixture(autouse=True)
def no_hf_cache(monkeypatch):
    """Hub ids resolve as on a machine with an empty Hugging Face cache."""
    monkeypatch.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)


# -- a tiny config whose bytes are computed by hand ------------------------------------

def tiny_config():
    """4 layers: 0 KDA dense, 1 DSA MoE, 2 KDA MoE, 3 DSA MoE (1-indexed lists below)."""
    return {
        "model_type": "kimi_k31",
        "architectures": ["KimiK31ForConditionalGeneration"],
        "text_config": {
            "model_type": "kimi_linear",
            "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 24,
            "rms_norm_eps": 1e-5, "hidden_act": "situ", "attn_res_block_size": 2,
            "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 2, "v_head_dim": 4,
            "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
            "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
            "first_k_dense_replace": 1, "tie_word_embeddings": False,
            "linear_attn_config": {
                "num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
                "full_attn_layers": [2, 4], "kda_layers": [1, 3],
            },
            "dsa_config": {"index_n_heads": 2, "index_head_dim": 4, "index_topk": 3,
                           "dsa_layers": [2, 4]},
            "quantization_config": {"quant_method": "compressed-tensors",
                                    "format": "mxfp4-pack-quantized"},
        },
    }


# Hand computation (bytes), hidden 16, BF16 = 2 B, F32 = 4 B:
NORMS = 4 * 16 * 2 + 2 * 16 * 2            # 4 RMSNorm [16] + 2 res_proj [1,16] = 192
KDA = (4 * 8 * 16 * 2                      # q,k,v,g_proj [8,16]
       + 3 * 8 * 4 * 4                     # q,k,v conv1d [8,1,4] F32
       + 4 * 16 * 2 + 8 * 4 * 2            # f_a [4,16], f_b [8,4]
       + 2 * 16 * 2                        # b_proj [2,16]
       + 128 * 4 + 8 * 4 + 4 * 4           # A_log [128] (zero padded), dt_bias [8], o_norm [4]: F32
       + 16 * 8 * 2)                       # o_proj [16,8]           = 2480
MLA = (8 * 16 * 2 + 8 * 2                  # q_a [8,16], q_a_layernorm [8]
       + 12 * 8 * 2                        # q_b [2*(4+2), 8]
       + 10 * 16 * 2 + 8 * 2               # kv_a_proj_with_mqa [8+2,16], kv_a_layernorm [8]
       + 16 * 8 * 2                        # kv_b [2*(4+4), 8]
       + 8 * 16 * 2 + 16 * 8 * 2)          # g_proj [8,16], o_proj [16,8]   = 1568
INDEXER = 8 * 8 * 2 + 4 * 16 * 2 + 2 * 16 * 2 + 2 * 4 * 2   # wq_b, wk, weights_proj, k_norm w+b = 336
DENSE = 3 * 24 * 16 * 2                    # gate/up [24,16], down [16,24] = 2304
EXPERT = 3 * (32 * 16 + 32 * 1)            # w1,w3,w2: packed [32,16] U8 + scale [32,1] U8 = 1632
ROUTER = 4 * 16 * 2 + 4 * 4                # gate [4,16] BF16 + correction bias [4] F32 = 144
MOE = (ROUTER + 32 * 16 * 2 * 2 + 32 * 2   # latent down [32,16], up [16,32], norm [32]
       + 3 * 32 * 16 * 2                   # one shared expert, width 32
       + 4 * EXPERT)                       # = 11856
TINY_LAYERS = [NORMS + KDA + DENSE, NORMS + MLA + INDEXER + MOE, NORMS + KDA + MOE,
               NORMS + MLA + INDEXER + MOE]
EMBED = 64 * 16 * 2
HEAD = 3 * 16 * 2 + 64 * 16 * 2            # norm, output_attn_res norm+proj, lm_head


def test_tiny_config_bytes_by_hand():
    assert TINY_LAYERS == [4976, 13952, 14528, 13952]
    m = model_bytes_from_config(tiny_config())
    assert [l.weight_bytes for l in m.layers] == TINY_LAYERS
    assert [l.kind for l in m.layers] == ["kda", "dsa", "kda", "dsa"]
    assert (m.embed_bytes, m.head_bytes) == (EMBED, HEAD)
    assert m.weight_bytes == sum(TINY_LAYERS) + EMBED + HEAD == 51600
    assert [l.routed_expert_bytes for l in m.layers] == [0] + [4 * EXPERT] * 3
    assert [l.router_bytes for l in m.layers] == [0] + [ROUTER] * 3
    # DSA: latent 8 + rope 2 (+ index key 4) bf16 per token; KDA: conv 3*(3*8) bf16 + [2,4,4] f32.
    assert [l.cache_bytes_per_token for l in m.layers] == [0, 28, 0, 28]
    assert [l.state_bytes_per_sequence for l in m.layers] == [272, 0, 272, 0]
    # One decode step at 10 tokens: 2 of 4 experts; 10 index keys, min(10, topk 3) latents.
    assert m.layers[1].read_bytes(10) == (13952 - 4 * EXPERT) + 2 * EXPERT + 8 * 10 + 20 * 3
    assert m.layers[2].read_bytes(10) == (14528 - 4 * EXPERT) + 2 * EXPERT + 272
    # Two sequences: E(1-(1-k/E)^2) = 4 * (1 - 1/4) = 3 experts, caches twice.
    assert m.layers[1].read_bytes(10, 2) == (13952 - 4 * EXPERT) + 3 * EXPERT + 2 * 140
    # Pruned to 3 experts: one expert and one router row fewer.
    assert m.pruned(3).layers[1].weight_bytes == 13952 - EXPERT - ROUTER // 4
    assert m.pruned(1).layers[1].num_experts == 2  # never below top-k


def test_official_config_parses_and_matches_spec():
    folder = lb.OFFICIAL_DIR / "Kimi-K3.1-Pro"
    config = read_config(folder)
    assert config["model_type"] == "kimi_k31"
    assert config["architectures"] == ["KimiK31ForConditionalGeneration"]
    args = ModelArgs.from_config(config)
    lin = args.linear_attn_config
    assert lin["full_attn_layers"] == [4 * i for i in range(1, 24)] + [93]
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, 94))
    assert [i for i in range(93) if args.is_dsa(i)] == [4 * i + 3 for i in range(23)] + [92]
    assert sum(args.is_kda(i) for i in range(93)) == 69
    assert (args.index_n_heads, args.index_head_dim, args.index_topk) == (32, 128, 2048)
    assert args.quantization == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert args.num_experts == 896 and args.num_experts_per_token == 16


def test_k31_totals_against_spec():
    m = model_bytes(K31)
    # K31_SPEC.md s.4: 24 DSA layers x (1,152 + 256) B per token; KDA 69 x (221,184 + 6,291,456).
    assert m.cache_bytes_per_token == 33_792
    assert m.state_bytes_per_sequence == 69 * (221_184 + 6_291_456) == 449_372_160
    # s.2: one expert is 3 x 3072 x 1904 U8 (packed + scales) = 17,547,264 B; 92 MoE layers.
    assert m.routed_expert_bytes == 92 * 896 * 17_547_264
    assert m.embed_bytes == m.head_bytes - 3 * 7168 * 2 == 163840 * 7168 * 2
    # Text model only, BF16 + MXFP4 experts as loaded: 1,560,322,659,328 B. The release is
    # quoted as ~1.56 TB; vision (MoonViT3d + projector, ~447M params) is counted apart.
    assert m.weight_bytes == 1_560_322_659_328
    assert abs(m.weight_bytes / 1.56e12 - 1) < 0.03
    assert 0.8e9 < m.not_loaded["vision"] < 1.0e9


# -- real header sizes ------------------------------------------------------------------

MX_DTYPES = {"BF16": mx.bfloat16, "F32": mx.float32, "U8": mx.uint8}


def write_tiny_checkpoint(folder, extra=None):
    """The tiny config in the official layout, two shards + index, written by MLX."""
    config = tiny_config()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    args = ModelArgs.from_config(config)
    tensors = dict(expected_tensors(args))
    tensors.update(extra or {})
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    wmap = {}
    for shard, keys in shards.items():
        mx.save_safetensors(str(folder / shard),
                            {k: mx.zeros(tensors[k][1], dtype=MX_DTYPES[tensors[k][0]]) for k in keys})
        wmap.update({k: shard for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return folder


def test_headers_match_config_and_report_unloaded(tmp_path):
    extra = {
        "vision_tower.encoder.blocks.0.wqkv.weight": ("BF16", (12, 4)),   # 96 B
        "mm_projector.proj.0.weight": ("BF16", (4, 4)),                   # 32 B
        "language_model.model.layers.4.eh_proj.weight": ("BF16", (16, 32)),  # MTP: 1024 B
    }
    folder = write_tiny_checkpoint(tmp_path / "tiny", extra)
    real = model_bytes_from_checkpoint(folder)
    computed = model_bytes_from_config(tiny_config())
    assert real.layers == computed.layers
    assert (real.embed_bytes, real.head_bytes) == (EMBED, HEAD)
    assert dict(real.not_loaded) == {"vision": 128, "mtp": 1024}
    assert real.source.startswith("headers:")
    assert model_bytes(str(folder)).layers == real.layers
    for typo in (str(tmp_path / "typo"), "Kimi-K3.1-Pro", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
            model_bytes(typo)


def test_pruned_checkpoint_counts_its_own_experts(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    index = folder / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {
        k: v for k, v in wmap.items() if ".layers.3.block_sparse_moe.experts.3." not in k}}))
    m = model_bytes_from_checkpoint(folder)
    assert [l.num_experts for l in m.layers] == [0, 4, 4, 3]
    assert m.layers[3].routed_expert_bytes == 3 * EXPERT
    assert m.layers[3].read_bytes(1) == 13952 - 4 * EXPERT + 2 * EXPERT + 8 + 20


def test_shape_table_matches_the_project_checkpoint_builder(tiny_ckpt):
    """kimi_mlx.testing.checkpoints writes checkpoints from the model itself: same bytes per layer."""
    real = model_bytes_from_checkpoint(tiny_ckpt)
    config = read_config(tiny_ckpt)
    computed = model_bytes_from_config(config)
    for r, c in zip(real.layers, computed.layers):
        assert r == c
    assert (real.embed_bytes, real.head_bytes) == (computed.embed_bytes, computed.head_bytes)
    assert set(real.not_loaded) == {"vision", "mtp"}


def test_header_reader_reads_only_the_header(tmp_path):
    path = tmp_path / "one.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((3, 5), dtype=mx.bfloat16)})
    header = read_safetensors_header(path)
    assert header["a"].dtype == "BF16" and header["a"].shape == (3, 5)
    assert header["a"].nbytes == 30


def _raw_shard(path, header, data_len):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)


def test_bad_headers_are_named(tmp_path):
    p = tmp_path / "bad.safetensors"
    _raw_shard(p, {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]}}, 8)
    with pytest.raises(CheckpointError, match=r"bad.safetensors: tensor 'w': 6 bytes on disk"):
        read_safetensors_header(p)
    _raw_shard(p, {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, 4)
    with pytest.raises(CheckpointError, match="outside the 4-byte data section"):
        read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors_header(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than"):
        read_safetensors_header(p)


def test_bad_index_is_named(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    index = folder / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**wmap, "language_model.model.norm.extra": wmap[
        "language_model.model.norm.weight"]}}))
    with pytest.raises(CheckpointError, match="'language_model.model.norm.extra' listed in the index"):
        model_bytes_from_checkpoint(folder)
    index.write_text(json.dumps({"weight_map": {**wmap, "x": "../evil.safetensors"}}))
    with pytest.raises(CheckpointError, match="bad shard name"):
        model_bytes_from_checkpoint(folder)
    index.write_text(json.dumps({"weight_map": {k: v for k, v in wmap.items() if ".layers.2." not in k}}))
    with pytest.raises(CheckpointError, match=r"layer\(s\) \[2\]"):
        model_bytes_from_checkpoint(folder)


def test_hub_ids_resolve_offline():
    assert model_bytes(K31).notes == ()
    other = model_bytes("someone/Other-Model")
    assert other.weight_bytes == model_bytes(K31).weight_bytes
    assert "not a local folder" in other.notes[0]


# -- Mac figures -----------------------------------------------------------------------

def test_usable_memory_rule_and_mac_specs():
    assert usable_bytes_for_ram(512 * GiB) == 496 * GiB
    assert usable_bytes_for_ram(64 * GiB) == 48 * GiB
    assert usable_bytes_for_ram(36 * GiB) == 27 * GiB
    assert usable_bytes_for_ram(512 * GiB, wired_limit_mb=500_000) == 500_000 * 2**20
    assert macos_default_wired_bytes(512 * GiB) == 384 * GiB
    assert macos_default_wired_bytes(24 * GiB) == 16 * GiB
    assert parse_bytes("1.5TB") == 1_500_000_000_000 and parse_bytes("8GiB") == 8 * GiB
    nodes = parse_macs("2x512GB,1x256GB@m2-ultra", chip="m3-ultra")
    assert [(n.name, n.ram_bytes // GiB, n.chip, n.bandwidth_bytes_per_s) for n in nodes] == [
        ("mac1", 512, "m3-ultra", 819 * GB), ("mac2", 512, "m3-ultra", 819 * GB),
        ("mac3", 256, "m2-ultra", 800 * GB)]
    with pytest.raises(ValueError, match="unknown chip"):
        parse_macs("1x128GB@m9")
    # Mac RAM without a unit is GB (nobody means a 512-byte Mac); other sizes need a unit
    assert [n.ram_bytes for n in parse_macs("4x512")] == [512 * GiB] * 4
    assert parse_bytes("4096B") == 4096
    with pytest.raises(ValueError, match="no unit"):
        parse_bytes("512")


# -- planner on hand examples ---------------------------------------------------------

def synthetic(n_layers, weight=10 * GB, experts=0, routed=0):
    """n identical layers without caches; a dense one reads all its weights per step."""
    layers = tuple(LayerBytes(index=i, kind="kda", weight_bytes=weight,
                              routed_expert_bytes=routed, num_experts=experts,
                              experts_per_token=2 if experts else 0)
                   for i in range(n_layers))
    return ModelBytes(layers, embed_bytes=0, head_bytes=0, embed_rows=1, source="synthetic")


def node(name, usable_gb=100, bw_gb=100):
    return Node(name, usable_gb * GB, bw_gb * GB)


def test_equal_nodes_split_evenly_with_times_by_hand():
    m = synthetic(6)
    plan = StagePlanner(headroom=0.1, min_headroom_bytes=0).plan(m, [node("a"), node("b")], 1)
    assert plan.ranges() == [("a", 0, 3), ("b", 3, 6)]
    # 30 GB read at 100 GB/s per stage, plus 2 hops x 0.5 ms.
    assert plan.seconds_per_step == pytest.approx(0.3 + 0.3 + 0.001)
    assert plan.tokens_per_s == pytest.approx(1 / 0.601)
    assert all(s.fits and s.headroom_bytes == 10 * GB for s in plan.stages)


def test_faster_node_gets_more_and_memory_caps_it():
    m = synthetic(6)
    planner = StagePlanner(headroom=0, min_headroom_bytes=0)
    plan = planner.plan(m, [node("fast", bw_gb=200), node("slow", bw_gb=100)], 1)
    assert plan.ranges() == [("fast", 0, 4), ("slow", 4, 6)]  # 4/200 = 2/100 s
    plan = planner.plan(m, [node("fast", usable_gb=30, bw_gb=200), node("slow")], 1)
    assert plan.ranges() == [("fast", 0, 3), ("slow", 3, 6)]


def test_ties_go_to_earlier_nodes_and_plans_repeat():
    m = synthetic(7)
    planner = StagePlanner(headroom=0, min_headroom_bytes=0)
    nodes = [node("a"), node("b")]
    plan = planner.plan(m, nodes, 1)
    assert plan.ranges() == [("a", 0, 4), ("b", 4, 7)]
    assert all(planner.plan(m, nodes, 1) == plan for _ in range(3))


def test_node_that_cannot_hold_a_layer_is_left_out():
    m = synthetic(4)
    plan = StagePlanner(headroom=0, min_headroom_bytes=0).plan(
        m, [node("a"), node("tiny", usable_gb=5), node("b")], 1)
    assert plan.ranges() == [("a", 0, 2), ("b", 2, 4)]
    assert [n.name for n in plan.unused_nodes] == ["tiny"]
    assert plan.hops == 2


def test_caches_count_against_memory():
    m = ModelBytes(tuple(LayerBytes(index=i, kind="dsa", weight_bytes=10 * GB,
                                    cache_bytes_per_token=1000) for i in range(4)),
                   embed_bytes=0, head_bytes=0, embed_rows=1)
    planner = StagePlanner(headroom=0, min_headroom_bytes=0)
    assert len(planner.plan(m, [node("a", usable_gb=45)], 1_000_000).used_stages) == 1
    # 4 x (10 GB + 1000 B x 2M tokens) = 48 GB > 45 GB.
    with pytest.raises(PlanError):
        planner.plan(m, [node("a", usable_gb=45)], 2_000_000)


def test_plan_error_says_shortfall_and_what_fits():
    # 10 MoE layers of 10 GB, 8 of them in 8 experts (top-2): keeping n experts costs 2 + n GB.
    m = synthetic(10, experts=8, routed=8 * GB)
    with pytest.raises(PlanError) as info:
        StagePlanner(headroom=0.1, min_headroom_bytes=0).plan(m, [node("a")], 1)
    e = info.value
    assert (e.need_bytes, e.have_bytes, e.short_bytes) == (100 * GB, 90 * GB, 10 * GB)
    assert e.more_nodes == 1 and e.keep_experts == 7 and e.keep_fraction == 0.87
    assert e.pruned_bytes == 90 * GB
    msg = str(e)
    assert "short by 10.0 GB" in msg
    assert "would fit on 2 nodes (1 more" in msg
    assert "--keep 0.87 pruning (7 of 8 experts per layer, weights 90.0 GB)" in msg


def test_k31_on_four_512gb_macs():
    m = model_bytes(K31)
    plan = StagePlanner().plan(m, parse_macs("4x512GB"), 131072)
    assert [r[1:] for r in plan.ranges()] == [(0, 23), (23, 47), (47, 71), (71, 93)]
    assert plan.stages[0].has_embed and plan.stages[-1].has_head
    assert sum(s.weight_bytes for s in plan.stages) == m.weight_bytes
    assert sum(s.cache_bytes for s in plan.stages) == 33_792 * 131072 + 449_372_160
    assert sum(s.num_kda for s in plan.stages) == 69 and sum(s.num_dsa for s in plan.stages) == 24
    assert all(s.fits for s in plan.stages)
    assert 5 < plan.tokens_per_s < 7  # ~139 GB read per token over 819 GB/s


# -- the CLI ----------------------------------------------------------------------------

def test_cli_four_macs_fits(capsys):
    rc = main(["plan", "--model", K31, "--macs", "4x512GB", "--context", "131072"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "weights 1560.3 GB" in out
    for row in ("mac1  512GB m3-ultra  [0, 23) +embed", "[23, 47)", "[47, 71)",
                "mac4  512GB m3-ultra  [71, 93) +head"):
        assert row in out
    assert "KV cache per token: 33,792 B (24 attention layers x 1,408 B)" in out
    assert "KDA state per sequence: 449.4 MB (69 layers" in out
    assert "5.8 tokens/s per sequence" in out
    assert "sudo sysctl iogpu.wired_limit_mb=507904" in out
    assert out.rstrip().endswith("fits")


def test_cli_two_macs_does_not_fit(capsys):
    rc = main(["plan", "--model", K31, "--macs", "2x512GB", "--context", "131072"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "does not fit" in out and "short by 606.6 GB" in out
    assert "would fit on 4 nodes (2 more 512GB m3-ultra)" in out
    assert "--keep 0.57 pruning" in out


def test_cli_local_checkpoint_and_bad_input(tmp_path, capsys):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    assert main(["plan", "--model", str(folder), "--macs", "1x16GB", "--context", "100"]) == 0
    out = capsys.readouterr().out
    assert "headers:" in out and "[0, 4) +embed+head" in out
    assert main(["plan", "--macs", "4xlots"]) == 2
    assert "not a size" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--macs", "4x0GB"], "--macs: '4x0GB' has no Macs or no memory"),
    (["--macs", "4x512GB,0x256GB"], "--macs: '0x256GB' has no Macs or no memory"),
    (["--macs", "4x512GB", "--context", "0"], "--context and --sequences must be >= 1"),
    (["--macs", "4x512GB", "--sequences", "-1"], "--context and --sequences must be >= 1"),
])
def test_cli_refuses_empty_macs_and_non_positive_context_before_printing(capsys, flags, message):
    assert main(["plan", "--model", K31, *flags]) == 2
    out = capsys.readouterr()
    assert out.out == "" and f"kimi-mlx plan: error: {message}" in out.err


def test_cli_notes_a_context_past_the_models_limit(capsys):
    assert main(["plan", "--model", K31, "--macs", "8x512GB", "--context", "2000000"]) == 0
    assert "past the model's max_position_embeddings (1048576)" in capsys.readouterr().err


def test_cli_default_context_is_capped_by_the_models_limit(capsys):
    """Without --context a 4096-token model is planned for 4096 tokens, not 131072, and
    K3.1 (limit 1048576) for 131072."""
    from kimi_mlx.generation.request import default_model  # the shipped micro checkpoint

    assert main(["plan", "--model", str(default_model()), "--macs", "1x64GB"]) == 0
    out = capsys.readouterr()
    assert "context 4096 tokens x 1 sequence(s)" in out.out and "past the model" not in out.err
    assert main(["plan", "--model", K31, "--macs", "4x512GB"]) == 0
    assert "context 131072 tokens x 1 sequence(s)" in capsys.readouterr().out
