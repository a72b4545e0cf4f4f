"""A tensor group's fit check counts every sequence of `--max-concurrency` at the planned
context, in the `--kv-bits` format (placement/tensor_parallel.py `TensorPlan.rank_bytes`,
`tensor_fits`; commands/plan.py; placement/parallel_choice.py), against a hand computation
from the shipped K3.1 config.json read as plain JSON.

By hand, per sequence per rank of a 4-Mac group (K31_SPEC.md section 4): every DSA layer's
cache whole (replicated): latent kv_lora_rank + rope key qk_rope_head_dim + index key
index_head_dim values per token, 2 B each in bf16; at 8 bits, group g, the latent and the
index key are v bytes + 2 (v / g) x 2 B of scales and biases. Every KDA layer: the rank's
num_heads / 4 heads, conv state (kernel - 1) x 3 x heads x head_dim x 2 B and recurrent
state heads x head_dim^2 x 4 B.
"""

from __future__ import annotations

import json
import re

import pytest

from kimi_mlx.commands.main import main
from kimi_mlx.placement import layer_bytes as lb
from kimi_mlx.placement.layer_bytes import BuildSpec, official_config
from kimi_mlx.placement.planner import GB, Node, StagePlanner, parse_macs
from kimi_mlx.placement.tensor_parallel import tensor_fits, tensor_plan_for, tensors_of

K31 = "moonshotai/Kimi-K3.1-Pro"
CTX = 131_072
RANKS = 4


@pytest.fixture(autouse=True)
def no_hf_cache(monkeypatch):
    monkeypatch.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)


def hand_cache_per_sequence(kv_bits=None, g=128) -> int:
    """One sequence's cache bytes on rank 0 of 4 at CTX tokens, from config.json alone."""
    config = json.loads(official_config(K31).read_text())
    text = config.get("text_config", config)
    lin, dsa = text["linear_attn_config"], text["dsa_config"]

    def values(v):
        return v * 2 if kv_bits is None else v * kv_bits // 8 + 2 * (v // g) * 2

    per_token = values(text["kv_lora_rank"]) + text["qk_rope_head_dim"] * 2 \
        + values(dsa["index_head_dim"])
    heads = lin["num_heads"] // RANKS
    kda = ((lin["short_conv_kernel_size"] - 1) * 3 * heads * lin["head_dim"] * 2
           + heads * lin["head_dim"] ** 2 * 4)
    assert len(dsa["dsa_layers"]) + len(lin["kda_layers"]) == text["num_hidden_layers"]
    return len(dsa["dsa_layers"]) * per_token * CTX + len(lin["kda_layers"]) * kda


def test_hand_figures_are_the_spec():
    # 24 x 1,408 B per token and 69 KDA layers x 24 heads' states (K31_SPEC.md); at 8 bits
    # with the default group of 128, 24 x 788 B per token
    assert hand_cache_per_sequence() == 33_792 * CTX + 69 * (3 * 3 * 24 * 128 * 2 + 24 * 128 * 128 * 4)
    assert hand_cache_per_sequence(8) == 18_912 * CTX + 69 * 1_628_160


@pytest.fixture(scope="module")
def q4():
    """(config, tensors) of the 4-bit-trunk build, as `plan --q-bits 4` plans it."""
    mp = pytest.MonkeyPatch()
    mp.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)
    out = tensors_of(K31, BuildSpec(None, 4, 64, None, 64))
    mp.undo()
    return out


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_rank_bytes_count_every_sequence(q4, kv_bits):
    targs, tensors = q4
    tp = tensor_plan_for(tensors, targs, [800 * GB] * RANKS, CTX, kv_bits=kv_bits)
    per_seq = hand_cache_per_sequence(kv_bits)
    for n in (1, 8, 32):
        assert tp.rank_bytes(n) - max(tp.load_bytes) == n * per_seq
    with pytest.raises(ValueError, match="sequences"):
        tp.rank_bytes(0)
    # a Mac with exactly room for 8 sequences beside its headroom holds 8, not 9
    weights = max(tp.load_bytes)
    node = Node("m", weights + 8 * per_seq + 5 * GB, 800 * GB)
    room = lambda n: 5 * GB
    assert tensor_fits(tp, [node] * RANKS, 8, room)
    assert not tensor_fits(tp, [node] * RANKS, 9, room)


def _tensor_bytes_per_mac(out: str) -> str:
    line = next(l for l in out.splitlines() if l.strip().startswith("bytes per Mac"))
    return re.split(r"\s{2,}", line.strip())[-1]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_plan_fits_the_group_at_max_concurrency(q4, capsys, kv_bits):
    """`plan --macs 4x512GB --q-bits 4 --max-concurrency 32`: the group's bytes per Mac are
    the weights + 32 sequences' caches; in bf16 that is past 512 GB Macs (less headroom),
    so `--parallel auto` keeps the pipeline; with --kv-bits 8 the 32 fit."""
    targs, tensors = q4
    nodes = parse_macs("4x512GB", "m3-ultra", None)
    tp = tensor_plan_for(tensors, targs, [n.bandwidth_bytes_per_s for n in nodes], CTX,
                         kv_bits=kv_bits)
    want = max(tp.load_bytes) + 32 * hand_cache_per_sequence(kv_bits)
    room = nodes[0].usable_bytes - StagePlanner()._headroom(nodes[0])
    fits = want <= room
    assert fits == (kv_bits == 8)  # bf16: ~519 GB of ~479; 8-bit: ~455
    argv = ["plan", "--model", K31, "--macs", "4x512GB", "--q-bits", "4",
            "--max-concurrency", "32", "--max-draft-tokens", "1"]
    assert main(argv + (["--kv-bits", "8"] if kv_bits else [])) == 0
    out = capsys.readouterr().out
    assert _tensor_bytes_per_mac(out) == f"{want / GB:.1f}" + ("" if fits else " (does NOT fit)")
    auto = [l for l in out.splitlines() if l.startswith("cluster server --parallel auto over")]
    assert len(auto) == 2
    for line in auto:
        if fits:
            assert ": tensor (" in line
        else:
            assert line.endswith(": pipeline (a tensor group does not fit in the Macs' memory)")
