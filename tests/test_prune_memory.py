"""Peak memory of pruning grows with one layer's size, not with the model's."""

import gc

import mlx.core as mx
import pytest

from kimi_mlx.prune.pipeline import calibration, prune
from kimi_mlx.testing.prune import moe_text_config, write_code_text
from kimi_mlx.checkpoint.shards import read_header, weight_map
from kimi_mlx.testing.checkpoints import build_checkpoint


def model_bytes(folder):
    wm = weight_map(folder)
    return sum(i.nbytes for s in set(wm.values()) for i in read_header(folder / s).values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Prune a 4-layer and a 12-layer checkpoint of the same width (experts dominate a
    layer's bytes; AttnRes blocks of 6 keep the carried banks small)."""
    root = tmp_path_factory.mktemp("mem")
    code = write_code_text(root / "code.txt", n=40)
    out = {}
    for n in (4, 12):
        cfg = moe_text_config(num_layers=n, num_experts=64, top_k=2, moe_intermediate_size=256,
                              routed_expert_hidden_size=64, attn_res_block_size=6)
        src = build_checkpoint(root / f"src{n}", cfg, n_shards=2, extras=False)
        calib = calibration(src, [code], seq_len=64, max_tokens=256)
        gc.collect()
        base = mx.get_active_memory()  # arrays other tests left alive count in MLX's peak
        res = prune(src, root / f"out{n}", calib, "reap", 32, progress=False, log=lambda s: None)
        out[n] = (model_bytes(src), res.observed.peak_memory - base, res.observed.activation_bytes)
    return out


def test_peak_memory_follows_one_layer_not_the_model(runs):
    (size4, peak4, act4), (size12, peak12, act12) = runs[4], runs[12]
    layer = (size12 - size4) / 8  # bytes of one MoE layer on disk
    assert size12 > 2.5 * size4
    # Streaming: the 12-layer run needs about what the 4-layer run needs (3x the layers,
    # not 3x the memory), and far less than its whole model.
    assert peak12 < 1.3 * peak4, (peak4, peak12)
    assert peak12 < size12 / 3, (peak12, size12)
    assert peak12 - peak4 < layer + act12, (peak4, peak12, layer)
